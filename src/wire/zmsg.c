/* zmsg.c - messages on the producer's ZeroMQ socket: ecx's hello and the
 * reference's single-item pull, with the reference's reply shape. */
#include "wire.h"

#include <stdlib.h>
#include <string.h>

static char *json_print_free(cJSON *o)
{
	char *s = o != NULL ? cJSON_PrintUnformatted(o) : NULL;
	cJSON_Delete(o);
	return s;
}

static cJSON *b64_node(const void *p, size_t n)
{
	char *s = malloc(ecx_b64_enclen(n) + 1);
	if (s == NULL)
		return NULL;
	ecx_b64_encode(p, n, s);
	cJSON *c = cJSON_CreateString(s);
	free(s);
	return c;
}

/* Decodes the base64 string field key into a malloc'd buffer. */
static int b64_field(const cJSON *o, const char *key, unsigned char **out,
                     size_t *outlen, char *why, size_t whylen)
{
	const cJSON *w = cJSON_GetObjectItemCaseSensitive(o, key);
	if (!cJSON_IsString(w) || w->valuestring == NULL)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is missing or not a string", key);
	size_t sl = strlen(w->valuestring);
	if (sl > ecx_b64_enclen(ECX_WORKER_ADDR_MAX))
		return ecx_why(why, whylen, ECX_ETOOBIG, "\"%s\" is too long",
		               key);
	unsigned char *b = malloc(sl / 4 * 3 + 1);
	if (b == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	long n = ecx_b64_decode(w->valuestring, sl, b, sl / 4 * 3 + 1);
	if (n <= 0) {
		free(b);
		return ecx_why(why, whylen, ECX_EPROTO, "\"%s\" is not base64",
		               key);
	}
	*out = b;
	*outlen = (size_t)n;
	return 0;
}

static const char *tr_name(unsigned t)
{
	return t == ECX_TR_SHM ? "shm" : "tcp";
}

static unsigned tr_parse(const char *s)
{
	return strcmp(s, "shm") == 0   ? ECX_TR_SHM
	       : strcmp(s, "tcp") == 0 ? ECX_TR_TCP
	                               : 0;
}

char *ecx_zreq_encode_hello(const void *worker, size_t worker_len,
                            const char *token, unsigned transports,
                            const char *domain)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddStringToObject(o, "op", "hello");
	if (token != NULL && token[0] != '\0')
		cJSON_AddStringToObject(o, "token", token);
	cJSON *w = b64_node(worker, worker_len);
	if (w == NULL) {
		cJSON_Delete(o);
		return NULL;
	}
	cJSON_AddItemToObject(o, "worker", w);
	if (transports != 0) {
		cJSON *a = cJSON_AddArrayToObject(o, "transports");
		for (unsigned t = ECX_TR_SHM; a != NULL && t <= ECX_TR_TCP;
		     t <<= 1)
			if (transports & t)
				cJSON_AddItemToArray(
				    a, cJSON_CreateString(tr_name(t)));
	}
	if (domain != NULL && domain[0] != '\0')
		cJSON_AddStringToObject(o, "domain", domain);
	return json_print_free(o);
}

char *ecx_zreq_encode_bye(uint64_t conn, uint64_t epoch, const char *token)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddStringToObject(o, "op", "bye");
	if (token != NULL && token[0] != '\0')
		cJSON_AddStringToObject(o, "token", token);
	cJSON_AddItemToObject(o, "conn", ecx_json_u64(conn));
	cJSON_AddItemToObject(o, "epoch", ecx_json_u64(epoch));
	return json_print_free(o);
}

char *ecx_zreq_encode_pull(const char *mm_hash, const char *dst_session,
                           uint64_t dst_ptr, uint64_t nbytes)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddStringToObject(o, "op", "pull");
	cJSON_AddStringToObject(o, "mm_hash", mm_hash);
	cJSON_AddStringToObject(o, "dst_session", dst_session);
	cJSON_AddItemToObject(o, "dst_ptr", ecx_json_u64(dst_ptr));
	cJSON_AddItemToObject(o, "nbytes", ecx_json_u64(nbytes));
	return json_print_free(o);
}

char *ecx_zreq_encode_lease(const char *const *ids, size_t n, uint64_t ms,
                            const char *token)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddStringToObject(o, "op", "lease");
	if (token != NULL && token[0] != '\0')
		cJSON_AddStringToObject(o, "token", token);
	cJSON_AddItemToObject(o, "ms", ecx_json_u64(ms));
	cJSON *a = cJSON_AddArrayToObject(o, "ids");
	for (size_t i = 0; a != NULL && i < n; i++) {
		cJSON *s = cJSON_CreateString(ids[i]);
		if (s == NULL) {
			a = NULL;
			break;
		}
		cJSON_AddItemToArray(a, s);
	}
	if (a == NULL) {
		cJSON_Delete(o);
		return NULL;
	}
	return json_print_free(o);
}

char *ecx_zreq_encode_release(const uint64_t *leases, size_t n,
                              const char *token)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddStringToObject(o, "op", "release");
	if (token != NULL && token[0] != '\0')
		cJSON_AddStringToObject(o, "token", token);
	cJSON *a = cJSON_AddArrayToObject(o, "leases");
	for (size_t i = 0; a != NULL && i < n; i++) {
		cJSON *v = ecx_json_u64(leases[i]);
		if (v == NULL) {
			a = NULL;
			break;
		}
		cJSON_AddItemToArray(a, v);
	}
	if (a == NULL) {
		cJSON_Delete(o);
		return NULL;
	}
	return json_print_free(o);
}

void ecx_zreq_free(ecx_zreq *r)
{
	if (r != NULL) {
		free(r->worker);
		r->worker = NULL;
		free(r->ids.ids);
		r->ids.ids = NULL;
		r->ids.n = 0;
		free(r->leases);
		r->leases = NULL;
		r->nleases = 0;
	}
}

int ecx_json_id(const cJSON *n, const char *what, char *out, char *why,
                size_t whylen);

/* The lease request's "ids" and "ms". */
static int lease_fields(const cJSON *o, ecx_zreq *r, char *why, size_t whylen)
{
	int rc = ecx_json_get_u64(o, "ms", &r->lease_ms, why, whylen);
	if (rc != 0)
		return rc;
	const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "ids");
	if (!cJSON_IsArray(a))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"ids\" is missing or not an array");
	int n = cJSON_GetArraySize(a);
	if (n > ECX_LEASE_MAX_IDS)
		return ecx_why(why, whylen, ECX_ETOOBIG,
		               "%d ids in one lease (at most %d)", n,
		               ECX_LEASE_MAX_IDS);
	r->ids.ids = calloc((size_t)n + 1, sizeof(*r->ids.ids));
	if (r->ids.ids == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	const cJSON *s;
	cJSON_ArrayForEach (s, a) {
		rc = ecx_json_id(s, "a lease's id", r->ids.ids[r->ids.n], why,
		                 whylen);
		if (rc != 0)
			return rc;
		r->ids.n++;
	}
	return 0;
}

/* The release request's "leases". */
static int release_fields(const cJSON *o, ecx_zreq *r, char *why, size_t whylen)
{
	const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "leases");
	if (!cJSON_IsArray(a))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"leases\" is missing or not an array");
	int n = cJSON_GetArraySize(a);
	if (n > ECX_LEASE_MAX_IDS)
		return ecx_why(why, whylen, ECX_ETOOBIG,
		               "%d leases in one release (at most %d)", n,
		               ECX_LEASE_MAX_IDS);
	r->leases = calloc((size_t)n + 1, sizeof(*r->leases));
	if (r->leases == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	const cJSON *v;
	cJSON_ArrayForEach (v, a) {
		double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
		if (d < 1 || d >= (double)ECX_JSON_INT_MAX ||
		    d != (double)(uint64_t)d)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "a lease is not a positive integer");
		r->leases[r->nleases++] = (uint64_t)d;
	}
	return 0;
}

int ecx_zreq_decode(const char *buf, size_t len, ecx_zreq *out, char *why,
                    size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_WIRE_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_WIRE_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	ecx_zreq r;
	memset(&r, 0, sizeof(r));
	char op[16];
	int rc = ecx_json_get_str(o, "op", op, sizeof(op), why, whylen);
	if (rc != 0) {
		/* The reference answers anything without op "pull" this way. */
		if (cJSON_GetObjectItemCaseSensitive(o, "op") == NULL ||
		    rc == ECX_EPROTO)
			rc = ecx_why(why, whylen, ECX_EUNSUPPORTED,
			             "unknown op");
		goto out;
	}
	if (cJSON_GetObjectItemCaseSensitive(o, "token") != NULL &&
	    (rc = ecx_json_get_str(o, "token", r.token, sizeof(r.token), why,
	                           whylen)) != 0)
		goto out;
	if (strcmp(op, "hello") == 0) {
		r.op = ECX_ZOP_HELLO;
		rc = b64_field(o, "worker", &r.worker, &r.worker_len, why,
		               whylen);
		/* Both optional (older consumers send neither); names this
		 * side does not know are skipped, so a newer transport does
		 * not end the hello. */
		const cJSON *ts =
		    cJSON_GetObjectItemCaseSensitive(o, "transports");
		const cJSON *t;
		if (rc == 0 && ts != NULL && !cJSON_IsArray(ts))
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "\"transports\" is not an array");
		if (rc == 0 && ts != NULL)
			cJSON_ArrayForEach (t, ts)
				if (cJSON_IsString(t))
					r.transports |=
					    tr_parse(t->valuestring);
		if (rc == 0 &&
		    cJSON_GetObjectItemCaseSensitive(o, "domain") != NULL)
			rc = ecx_json_get_str(o, "domain", r.domain,
			                      sizeof(r.domain), why, whylen);
	} else if (strcmp(op, "bye") == 0) {
		r.op = ECX_ZOP_BYE;
		if ((rc = ecx_json_get_u64(o, "conn", &r.conn, why, whylen)) ==
		    0)
			rc =
			    ecx_json_get_u64(o, "epoch", &r.epoch, why, whylen);
	} else if (strcmp(op, "lease") == 0) {
		r.op = ECX_ZOP_LEASE;
		rc = lease_fields(o, &r, why, whylen);
	} else if (strcmp(op, "release") == 0) {
		r.op = ECX_ZOP_RELEASE;
		rc = release_fields(o, &r, why, whylen);
	} else if (strcmp(op, "pull") == 0) {
		r.op = ECX_ZOP_PULL;
		const cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "mm_hash");
		if (h == NULL) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "missing field \"mm_hash\"");
			goto out;
		}
		if (!cJSON_IsString(h)) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "\"mm_hash\" is not a string");
			goto out;
		}
		char r2[160];
		if (core_id_check(h->valuestring, r2, sizeof(r2)) != 0) {
			rc = ecx_why(why, whylen, ECX_EID, "\"mm_hash\": %s",
			             r2);
			goto out;
		}
		ecx_strlcpy(r.mm_hash, h->valuestring, sizeof(r.mm_hash));
		if ((rc = ecx_json_get_str(o, "dst_session", r.dst_session,
		                           sizeof(r.dst_session), why,
		                           whylen)) ||
		    (rc = ecx_json_get_u64(o, "dst_ptr", &r.dst_ptr, why,
		                           whylen)) ||
		    (rc =
		         ecx_json_get_u64(o, "nbytes", &r.nbytes, why, whylen)))
			goto out;
	} else {
		rc = ecx_why(why, whylen, ECX_EUNSUPPORTED, "unknown op");
	}
out:
	cJSON_Delete(o);
	if (rc == 0)
		*out = r;
	else
		ecx_zreq_free(&r);
	return rc;
}

char *ecx_zresp_encode_error(int err, const char *detail)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddBoolToObject(o, "ok", false);
	cJSON_AddStringToObject(o, "err",
	                        detail != NULL ? detail : core_strerror(err));
	cJSON_AddStringToObject(o, "code", core_err_name(err));
	return json_print_free(o);
}

char *ecx_zresp_encode_ref_pull(int err, const char *detail)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddBoolToObject(o, "ok", err == 0);
	cJSON_AddNumberToObject(o, "mooncake_ret", err == 0 ? 0 : -1);
	if (err != 0) {
		cJSON_AddStringToObject(
		    o, "err", detail != NULL ? detail : core_strerror(err));
		cJSON_AddStringToObject(o, "code", core_err_name(err));
	}
	return json_print_free(o);
}

char *ecx_zresp_encode_hello(const void *worker, size_t worker_len,
                             uint64_t epoch, uint64_t conn, uint64_t now_ms,
                             unsigned transport, uint64_t idle_ms, uint64_t pid,
                             uint64_t pid_start, unsigned lane_port,
                             const unsigned char *lane_key)
{
	cJSON *o = cJSON_CreateObject();
	cJSON *w = b64_node(worker, worker_len);
	if (o == NULL || w == NULL) {
		cJSON_Delete(o);
		cJSON_Delete(w);
		return NULL;
	}
	cJSON_AddBoolToObject(o, "ok", true);
	cJSON_AddItemToObject(o, "worker", w);
	cJSON_AddItemToObject(o, "epoch", ecx_json_u64(epoch));
	cJSON_AddItemToObject(o, "conn", ecx_json_u64(conn));
	if (now_ms != 0)
		cJSON_AddItemToObject(o, "now_ms", ecx_json_u64(now_ms));
	if (transport != 0)
		cJSON_AddStringToObject(o, "transport", tr_name(transport));
	if (idle_ms != 0)
		cJSON_AddItemToObject(o, "idle_ms", ecx_json_u64(idle_ms));
	if (pid != 0 && pid_start != 0) {
		cJSON_AddItemToObject(o, "pid", ecx_json_u64(pid));
		cJSON_AddItemToObject(o, "pid_start", ecx_json_u64(pid_start));
	}
	if (lane_port != 0 && lane_key != NULL) {
		static const char digits[] = "0123456789abcdef";
		char hex[2 * ECX_LANE_KEY_LEN + 1];
		for (size_t i = 0; i < ECX_LANE_KEY_LEN; i++) {
			hex[2 * i] = digits[lane_key[i] >> 4];
			hex[2 * i + 1] = digits[lane_key[i] & 15];
		}
		hex[2 * ECX_LANE_KEY_LEN] = '\0';
		cJSON *l = cJSON_AddObjectToObject(o, "lane");
		if (l == NULL) {
			cJSON_Delete(o);
			return NULL;
		}
		cJSON_AddNumberToObject(l, "port", lane_port);
		cJSON_AddStringToObject(l, "key", hex);
	}
	return json_print_free(o);
}

char *ecx_zresp_encode_bye(bool closed)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddBoolToObject(o, "ok", true);
	cJSON_AddBoolToObject(o, "closed", closed);
	return json_print_free(o);
}

char *ecx_zresp_encode_lease(uint64_t epoch, uint64_t ms,
                             const uint64_t *leases, const int *errs, size_t n)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddBoolToObject(o, "ok", true);
	cJSON_AddItemToObject(o, "epoch", ecx_json_u64(epoch));
	cJSON_AddItemToObject(o, "ms", ecx_json_u64(ms));
	cJSON *a = cJSON_AddArrayToObject(o, "items");
	for (size_t i = 0; a != NULL && i < n; i++) {
		cJSON *x = cJSON_CreateObject();
		if (x == NULL) {
			a = NULL;
			break;
		}
		cJSON_AddItemToArray(a, x);
		if (leases[i] != 0)
			cJSON_AddItemToObject(x, "lease",
			                      ecx_json_u64(leases[i]));
		else
			cJSON_AddStringToObject(x, "code",
			                        core_err_name(errs[i]));
	}
	if (a == NULL) {
		cJSON_Delete(o);
		return NULL;
	}
	return json_print_free(o);
}

char *ecx_zresp_encode_release(uint64_t released)
{
	cJSON *o = cJSON_CreateObject();
	if (o == NULL)
		return NULL;
	cJSON_AddBoolToObject(o, "ok", true);
	cJSON_AddItemToObject(o, "released", ecx_json_u64(released));
	return json_print_free(o);
}

void ecx_zresp_free(ecx_zresp *r)
{
	if (r != NULL) {
		free(r->worker);
		r->worker = NULL;
		free(r->leases);
		free(r->lease_err);
		r->leases = NULL;
		r->lease_err = NULL;
		r->nleases = 0;
	}
}

/* A lease answer's "items" (and "epoch", "ms"). */
static int lease_items(const cJSON *o, ecx_zresp *r, char *why, size_t whylen)
{
	int rc = ecx_json_get_u64(o, "epoch", &r->epoch, why, whylen);
	if (rc == 0)
		rc = ecx_json_get_u64(o, "ms", &r->lease_ms, why, whylen);
	if (rc != 0)
		return rc;
	const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "items");
	int n = cJSON_GetArraySize(a);
	if (n > ECX_LEASE_MAX_IDS)
		return ecx_why(why, whylen, ECX_ETOOBIG, "too many leases");
	r->leases = calloc((size_t)n + 1, sizeof(*r->leases));
	r->lease_err = calloc((size_t)n + 1, sizeof(*r->lease_err));
	if (r->leases == NULL || r->lease_err == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	const cJSON *x;
	cJSON_ArrayForEach (x, a) {
		size_t k = r->nleases++;
		if (!cJSON_IsObject(x))
			return ecx_why(why, whylen, ECX_EPROTO,
			               "a lease is not an object");
		if (cJSON_GetObjectItemCaseSensitive(x, "lease") != NULL) {
			rc = ecx_json_get_u64(x, "lease", &r->leases[k], why,
			                      whylen);
			if (rc != 0)
				return rc;
			if (r->leases[k] == 0)
				r->lease_err[k] = ECX_EPROTO;
			continue;
		}
		const cJSON *c = cJSON_GetObjectItemCaseSensitive(x, "code");
		r->lease_err[k] = cJSON_IsString(c)
		                      ? ecx_err_from_name(c->valuestring)
		                      : ECX_EPROTO;
		if (r->lease_err[k] == 0)
			r->lease_err[k] = ECX_EPROTO;
	}
	return 0;
}

/* The hello's "lane": {"port": 1..65535, "key": 32 hex digits}. */
static int lane_parse(const cJSON *l, ecx_zresp *r, char *why, size_t whylen)
{
	const cJSON *port = cJSON_GetObjectItemCaseSensitive(l, "port");
	const cJSON *key = cJSON_GetObjectItemCaseSensitive(l, "key");
	if (!cJSON_IsObject(l) || !cJSON_IsNumber(port) ||
	    port->valuedouble < 1 || port->valuedouble > 65535 ||
	    port->valuedouble != (double)(int)port->valuedouble ||
	    !cJSON_IsString(key) || key->valuestring == NULL ||
	    strlen(key->valuestring) != 2 * ECX_LANE_KEY_LEN)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"lane\" is not {\"port\": 1..65535, "
		               "\"key\": %d hex digits}",
		               2 * ECX_LANE_KEY_LEN);
	for (size_t i = 0; i < ECX_LANE_KEY_LEN; i++) {
		int hi = ecx_hex_digit(key->valuestring[2 * i]);
		int lo = ecx_hex_digit(key->valuestring[2 * i + 1]);
		if (hi < 0 || lo < 0)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "\"lane\" key is not hex");
		r->lane_key[i] = (unsigned char)(hi << 4 | lo);
	}
	r->lane_port = (unsigned)port->valueint;
	return 0;
}

int ecx_zresp_decode(const char *buf, size_t len, ecx_zresp *out, char *why,
                     size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_WIRE_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_WIRE_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	ecx_zresp r;
	memset(&r, 0, sizeof(r));
	int rc = 0;
	const cJSON *ok = cJSON_GetObjectItemCaseSensitive(o, "ok");
	if (!cJSON_IsBool(ok)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "\"ok\" is missing or not a boolean");
		goto out;
	}
	r.ok = cJSON_IsTrue(ok);
	if (!r.ok) {
		const cJSON *c = cJSON_GetObjectItemCaseSensitive(o, "code");
		const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "err");
		r.err = cJSON_IsString(c) ? ecx_err_from_name(c->valuestring)
		                          : ECX_EIO;
		if (r.err == 0)
			r.err = ECX_EIO;
		ecx_strlcpy(r.detail,
		            cJSON_IsString(e) ? e->valuestring
		                              : core_strerror(r.err),
		            sizeof(r.detail));
		goto out;
	}
	if (cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(o, "items"))) {
		rc = lease_items(o, &r, why, whylen);
	} else if (cJSON_GetObjectItemCaseSensitive(o, "released") != NULL) {
		rc = ecx_json_get_u64(o, "released", &r.released, why, whylen);
	} else if (cJSON_GetObjectItemCaseSensitive(o, "worker") != NULL) {
		rc = b64_field(o, "worker", &r.worker, &r.worker_len, why,
		               whylen);
		if (rc == 0)
			rc =
			    ecx_json_get_u64(o, "epoch", &r.epoch, why, whylen);
		if (rc == 0)
			rc = ecx_json_get_u64(o, "conn", &r.conn, why, whylen);
		if (rc == 0 &&
		    cJSON_GetObjectItemCaseSensitive(o, "now_ms") != NULL)
			rc = ecx_json_get_u64(o, "now_ms", &r.now_ms, why,
			                      whylen);
		const cJSON *t =
		    cJSON_GetObjectItemCaseSensitive(o, "transport");
		if (rc == 0 && t != NULL &&
		    (!cJSON_IsString(t) ||
		     (r.transport = tr_parse(t->valuestring)) == 0))
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "\"transport\" is not \"shm\" or "
			             "\"tcp\"");
		if (rc == 0 &&
		    cJSON_GetObjectItemCaseSensitive(o, "idle_ms") != NULL)
			rc = ecx_json_get_u64(o, "idle_ms", &r.idle_ms, why,
			                      whylen);
		if (rc == 0 &&
		    cJSON_GetObjectItemCaseSensitive(o, "pid") != NULL)
			rc = ecx_json_get_u64(o, "pid", &r.pid, why, whylen);
		if (rc == 0 &&
		    cJSON_GetObjectItemCaseSensitive(o, "pid_start") != NULL)
			rc = ecx_json_get_u64(o, "pid_start", &r.pid_start, why,
			                      whylen);
		const cJSON *l = cJSON_GetObjectItemCaseSensitive(o, "lane");
		if (rc == 0 && l != NULL)
			rc = lane_parse(l, &r, why, whylen);
	}
	r.closed = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "closed"));
out:
	cJSON_Delete(o);
	if (rc == 0)
		*out = r;
	else
		ecx_zresp_free(&r);
	return rc;
}

int ecx_ref_reply_decode(const char *buf, size_t len, bool *ok, int64_t *ret,
                         char *err, size_t errlen, char *why, size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_ZMQ_MAX_MSG, why, whylen);
	if (o == NULL)
		return len > ECX_ZMQ_MAX_MSG ? ECX_ETOOBIG : ECX_EPROTO;
	int rc = 0;
	const cJSON *k = cJSON_GetObjectItemCaseSensitive(o, "ok");
	const cJSON *m = cJSON_GetObjectItemCaseSensitive(o, "mooncake_ret");
	const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "err");
	*ret = 0;
	if (errlen > 0)
		err[0] = '\0';
	if (!cJSON_IsBool(k)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "\"ok\" is missing or not a boolean");
	} else if (m != NULL &&
	           (!cJSON_IsNumber(m) || m->valuedouble > 9007199254740992.0 ||
	            m->valuedouble < -9007199254740992.0 ||
	            m->valuedouble != (double)(int64_t)m->valuedouble)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "\"mooncake_ret\" is not an integer");
	} else {
		*ok = cJSON_IsTrue(k);
		if (m != NULL)
			*ret = (int64_t)m->valuedouble;
		if (cJSON_IsString(e))
			ecx_strlcpy(err, e->valuestring, errlen);
	}
	cJSON_Delete(o);
	return rc;
}
