/* server.c - the HTTP registry on libmicrohttpd. */
#include "registry/server.h"

#include <microhttpd.h>

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MOD "registry"

/* Request latency histogram bounds, in microseconds. */
static const uint64_t lat_bounds_us[] = {50,   100,  250,   500,  1000,
                                         2500, 5000, 10000, 50000};
#define NLAT (sizeof(lat_bounds_us) / sizeof(lat_bounds_us[0]))

struct ecx_registry {
	struct MHD_Daemon *mhd;
	ecx_store *store;
	uint16_t port;
	char *token;
	size_t token_len;
	bool token_reads;
	bool redis; /* the store is Redis: /healthz asks it */
	uint64_t
	    epoch; /* changes each start: producers republish on a change */
	int entry_ttl_s; /* the lease of entries PUT without one (0: none) */
	/* counters, updated with relaxed atomics */
	uint64_t lookups, hits, misses, publishes, removals, requests;
	uint64_t lat_count, lat_sum_us, lat_buckets[NLAT + 1];
	/* the embedding producer's lines; set once, before they are read */
	ecx_registry_metrics_fn metrics_fn;
	void *metrics_arg;
};

/* Per-request state, from the first call of the handler to completion. */
typedef struct reg_req {
	uint64_t start_ns;
	char *body;
	size_t len;
	bool too_big;
} reg_req;

static void count(uint64_t *c, uint64_t n)
{
	__atomic_add_fetch(c, n, __ATOMIC_RELAXED);
}

static uint64_t load(const uint64_t *c)
{
	return __atomic_load_n(c, __ATOMIC_RELAXED);
}

/* Sets the answer; body is malloc'd (NULL: out of memory). */
static int answer(ecx_reg_answer *a, unsigned status, char *body,
                  const char *ctype)
{
	free(a->body);
	a->status = status;
	a->body = body;
	a->ctype = ctype;
	if (body == NULL) {
		a->status = MHD_HTTP_INTERNAL_SERVER_ERROR;
		a->body = strdup("{\"detail\":\"out of memory\"}");
	}
	return 0;
}

static int answer_json(ecx_reg_answer *a, unsigned status, char *body)
{
	return answer(a, status, body, "application/json");
}

/* An error answer: {"detail": "..."} as FastAPI (the reference) writes it. */
static int answer_error(ecx_reg_answer *a, unsigned status, const char *detail)
{
	cJSON *o = cJSON_CreateObject();
	cJSON_AddStringToObject(o, "detail", detail);
	char *s = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	return answer_json(a, status, s);
}

static unsigned status_of(int err)
{
	switch (err) {
	case ECX_ENOTFOUND:
		return MHD_HTTP_NOT_FOUND;
	case ECX_ETOOBIG:
		return MHD_HTTP_CONTENT_TOO_LARGE;
	case ECX_ENOMEM:
		return MHD_HTTP_INTERNAL_SERVER_ERROR;
	case ECX_EIO:
	case ECX_ECONNECT:
	case ECX_ETIMEDOUT:
	/* From the store: the registry's own credentials (a wrong Redis
	 * password) are not the caller's fault; a caller's token is
	 * refused with 401 before the store is asked. */
	case ECX_EAUTH:
		return MHD_HTTP_SERVICE_UNAVAILABLE;
	default:
		return MHD_HTTP_BAD_REQUEST;
	}
}

static bool authorized(ecx_registry *r, const ecx_reg_http *q)
{
	if (r->token == NULL)
		return true;
	const char *h = q->authorization;
	if (h == NULL || strncmp(h, "Bearer ", 7) != 0)
		return false;
	h += 7;
	return ecx_ct_equal(h, strlen(h), r->token, r->token_len);
}

static int route_info_get(ecx_registry *r, ecx_reg_answer *a, const char *id)
{
	char why[200];
	ecx_entry e;
	count(&r->lookups, 1);
	int rc = r->store->ops->get(r->store, id, &e, why, sizeof(why));
	if (rc == ECX_ENOTFOUND) {
		count(&r->misses, 1);
		return answer_error(a, MHD_HTTP_NOT_FOUND, "unknown mm_hash");
	}
	if (rc != 0)
		return answer_error(a, status_of(rc), why);
	count(&r->hits, 1);
	return answer_json(a, MHD_HTTP_OK, ecx_entry_encode(&e));
}

static int route_info_put(ecx_registry *r, ecx_reg_answer *a, const char *id,
                          const ecx_reg_http *q)
{
	char why[200];
	ecx_entry e;
	int rc = ecx_entry_decode(q->body, q->len, &e, why, sizeof(why));
	if (rc == 0 && e.ttl_s == 0)
		e.ttl_s = (uint32_t)r->entry_ttl_s;
	e.age_ms = 0;
	if (rc == 0)
		rc = r->store->ops->put(r->store, id, &e, why, sizeof(why));
	if (rc != 0)
		return answer_error(a, status_of(rc), why);
	count(&r->publishes, 1);
	return answer_json(a, MHD_HTTP_OK, strdup("{\"ok\":true}"));
}

static int route_info_delete(ecx_registry *r, ecx_reg_answer *a, const char *id,
                             const ecx_reg_http *q)
{
	char why[200];
	const char *producer = q->arg_producer;
	int rc = r->store->ops->del(r->store, id, producer, why, sizeof(why));
	if (rc == ECX_ENOTFOUND)
		return answer_error(a, MHD_HTTP_NOT_FOUND, "unknown mm_hash");
	if (rc != 0)
		return answer_error(a, status_of(rc), why);
	count(&r->removals, 1);
	return answer_json(a, MHD_HTTP_OK, strdup("{\"ok\":true}"));
}

/* POST /ec/renew {"producer_zmq", "ecx_epoch", "ecx_ttl_s"}: renews every
 * entry of that producer (of that epoch) in one request; answers
 * {"renewed": N}, so a producer that holds more learns the registry lost
 * some and publishes them again. */
static int route_renew(ecx_registry *r, ecx_reg_answer *a,
                       const ecx_reg_http *q)
{
	char why[200], producer[ECX_ADDR_MAX];
	uint64_t epoch = 0, ttl = 0;
	cJSON *o = ecx_json_parse(q->body != NULL ? q->body : "", q->len,
	                          ECX_ENTRY_MAX, why, sizeof(why));
	int rc = o == NULL ? ECX_EPROTO : 0;
	if (rc == 0)
		rc = ecx_json_get_str(o, "producer_zmq", producer,
		                      sizeof(producer), why, sizeof(why));
	if (rc == 0)
		rc = ecx_json_get_u64(o, "ecx_epoch", &epoch, why, sizeof(why));
	if (rc == 0 && cJSON_GetObjectItemCaseSensitive(o, "ecx_ttl_s"))
		rc = ecx_json_get_u64(o, "ecx_ttl_s", &ttl, why, sizeof(why));
	cJSON_Delete(o);
	if (rc == 0 && ttl > ECX_TTL_MAX_S)
		rc = ecx_why(why, sizeof(why), ECX_EPROTO,
		             "\"ecx_ttl_s\" is over %d", ECX_TTL_MAX_S);
	if (rc != 0)
		return answer_error(a, MHD_HTTP_BAD_REQUEST, why);
	if (r->store->ops->renew == NULL)
		return answer_error(a, MHD_HTTP_NOT_IMPLEMENTED,
		                    "this registry's store renews entries when "
		                    "they are written again");
	if (ttl == 0)
		ttl = (uint64_t)r->entry_ttl_s;
	size_t n = 0;
	rc = r->store->ops->renew(r->store, producer, epoch, (uint32_t)ttl, &n,
	                          why, sizeof(why));
	if (rc != 0)
		return answer_error(a, status_of(rc), why);
	char body[64];
	snprintf(body, sizeof(body), "{\"renewed\":%zu}", n);
	return answer_json(a, MHD_HTTP_OK, strdup(body));
}

static int route_lookup(ecx_registry *r, ecx_reg_answer *a,
                        const ecx_reg_http *q)
{
	char why[200];
	ecx_idlist l;
	int rc = ecx_lookup_req_decode(q->body, q->len, &l, why, sizeof(why));
	if (rc != 0)
		return answer_error(a, status_of(rc), why);
	ecx_lookup_item *items = calloc(l.n + 1, sizeof(*items));
	if (items == NULL) {
		free(l.ids);
		return answer_error(a, 500, "out of memory");
	}
	for (size_t i = 0; i < l.n; i++)
		items[i].id = l.ids[i];
	rc = r->store->ops->mget(r->store, items, l.n, why, sizeof(why));
	if (rc == 0)
		rc = ecx_store_redis_holders(r->store, items, l.n, why,
		                             sizeof(why));
	if (rc != 0) {
		answer_error(a, status_of(rc), why);
	} else {
		size_t hits = 0;
		for (size_t i = 0; i < l.n; i++)
			hits += items[i].found;
		count(&r->lookups, l.n);
		count(&r->hits, hits);
		count(&r->misses, l.n - hits);
		answer_json(a, MHD_HTTP_OK, ecx_lookup_resp_encode(items, l.n));
	}
	ecx_lookup_items_clear(items, l.n);
	free(items);
	free(l.ids);
	return 0;
}

static int route_list(ecx_registry *r, ecx_reg_answer *a, const ecx_reg_http *q)
{
	const char *after = q->arg_after;
	const char *lim = q->arg_limit;
	unsigned long limit = 100;
	if (lim != NULL) {
		char *end;
		errno = 0;
		limit = strtoul(lim, &end, 10);
		if (*lim == '\0' || *end != '\0' || errno != 0 ||
		    lim[0] == '-' || limit == 0)
			return answer_error(a, MHD_HTTP_BAD_REQUEST,
			                    "limit must be a positive integer");
		if (limit > ECX_REG_MAX_PAGE) {
			char d[80];
			snprintf(d, sizeof(d), "limit is at most %d per page",
			         ECX_REG_MAX_PAGE);
			return answer_error(a, MHD_HTTP_BAD_REQUEST, d);
		}
	}
	if (after == NULL)
		after = "";
	else if (after[0] != '\0' && ecx_id_check(after, NULL, 0) != 0)
		return answer_error(a, MHD_HTTP_BAD_REQUEST,
		                    "after is not a valid id");
	ecx_store_row *rows = calloc(limit, sizeof(*rows));
	if (rows == NULL)
		return answer_error(a, 500, "out of memory");
	size_t n = 0, total = 0;
	char why[200];
	int rc = r->store->ops->list(r->store, after, limit, rows, &n, &total,
	                             why, sizeof(why));
	if (rc != 0) {
		free(rows);
		return answer_error(a, status_of(rc), why);
	}
	cJSON *o = cJSON_CreateObject();
	cJSON *arr = cJSON_AddArrayToObject(o, "items");
	for (size_t i = 0; i < n; i++) {
		cJSON *e = ecx_entry_to_json(&rows[i].entry);
		if (e != NULL) {
			cJSON_AddStringToObject(e, "id", rows[i].id);
			cJSON_AddItemToArray(arr, e);
		}
	}
	if (n == limit && n > 0)
		cJSON_AddStringToObject(o, "next", rows[n - 1].id);
	else
		cJSON_AddNullToObject(o, "next");
	cJSON_AddItemToObject(o, "total", ecx_json_u64(total));
	char *s = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	free(rows);
	return answer_json(a, MHD_HTTP_OK, s);
}

void ecx_registry_set_metrics(ecx_registry *r, ecx_registry_metrics_fn fn,
                              void *arg)
{
	r->metrics_arg = arg;
	__atomic_store_n(&r->metrics_fn, fn, __ATOMIC_RELEASE);
}

static int route_metrics(ecx_registry *r, ecx_reg_answer *a)
{
	size_t cap = 4096, off = 0;
	char *s = malloc(cap);
	if (s == NULL)
		return answer_error(a, 500, "out of memory");
#define P(...) off += (size_t)snprintf(s + off, cap - off, __VA_ARGS__)
#define COUNTER(name, help, v)                                               \
	P("# HELP ecx_registry_" name " " help "\n# TYPE ecx_registry_" name \
	  " counter\necx_registry_" name " %llu\n",                          \
	  (unsigned long long)(v))
	COUNTER("lookups_total", "Ids looked up.", load(&r->lookups));
	COUNTER("hits_total", "Ids looked up and found.", load(&r->hits));
	COUNTER("misses_total", "Ids looked up and not found.",
	        load(&r->misses));
	COUNTER("publishes_total", "Entries published.", load(&r->publishes));
	COUNTER("removals_total", "Entries removed.", load(&r->removals));
	COUNTER("requests_total", "HTTP requests answered.",
	        load(&r->requests));
	P("# HELP ecx_registry_entries Entries in the store.\n"
	  "# TYPE ecx_registry_entries gauge\necx_registry_entries %zu\n",
	  r->store->ops->count(r->store));
	P("# HELP ecx_registry_request_duration_seconds Time to answer a "
	  "request.\n# TYPE ecx_registry_request_duration_seconds "
	  "histogram\n");
	uint64_t cum = 0;
	for (size_t i = 0; i < NLAT; i++) {
		cum += load(&r->lat_buckets[i]);
		P("ecx_registry_request_duration_seconds_bucket{le=\"%g\"} "
		  "%llu\n",
		  (double)lat_bounds_us[i] / 1e6, (unsigned long long)cum);
	}
	cum += load(&r->lat_buckets[NLAT]);
	P("ecx_registry_request_duration_seconds_bucket{le=\"+Inf\"} %llu\n",
	  (unsigned long long)cum);
	P("ecx_registry_request_duration_seconds_sum %.6f\n",
	  (double)load(&r->lat_sum_us) / 1e6);
	P("ecx_registry_request_duration_seconds_count %llu\n",
	  (unsigned long long)load(&r->lat_count));
	ecx_registry_metrics_fn fn =
	    __atomic_load_n(&r->metrics_fn, __ATOMIC_ACQUIRE);
	if (fn != NULL && off < cap)
		off += fn(r->metrics_arg, s + off, cap - off);
#undef COUNTER
#undef P
	if (off >= cap) {
		free(s);
		return answer_error(a, 500, "metrics do not fit");
	}
	return answer(a, MHD_HTTP_OK, s, "text/plain; version=0.0.4");
}

static int reg_route(ecx_registry *r, const ecx_reg_http *q, ecx_reg_answer *a)
{
	const char *url = q->url, *method = q->method;
	bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
	bool put = strcmp(method, "PUT") == 0;
	bool del = strcmp(method, "DELETE") == 0;
	bool post = strcmp(method, "POST") == 0;

	if (strcmp(url, "/healthz") == 0) {
		if (!get)
			goto not_allowed;
		/* Healthy means lookups can be answered: a Redis store that
		 * does not answer makes the registry unhealthy (503). */
		char why[256] = "";
		bool ok = !r->redis ||
		          ecx_store_redis_ping(r->store, why, sizeof(why)) == 0;
		cJSON *o = cJSON_CreateObject();
		cJSON_AddBoolToObject(o, "ok", ok);
		cJSON_AddNumberToObject(o, "epoch", (double)r->epoch);
		if (!ok)
			cJSON_AddStringToObject(o, "detail", why);
		char *h = cJSON_PrintUnformatted(o);
		cJSON_Delete(o);
		return answer_json(
		    a, ok ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, h);
	}
	if (q->too_big) {
		char d[80];
		snprintf(d, sizeof(d), "request body exceeds %u bytes",
		         ECX_REG_MAX_BODY);
		return answer_error(a, MHD_HTTP_CONTENT_TOO_LARGE, d);
	}
	bool renew = post && strcmp(url, "/ec/renew") == 0;
	bool write = put || del || renew;
	if ((write || r->token_reads) && !authorized(r, q))
		return answer_error(a, MHD_HTTP_UNAUTHORIZED,
		                    "missing or bad token");
	if (strncmp(url, "/ec/info/", 9) == 0) {
		const char *id = url + 9;
		char why[160];
		if (!get && !put && !del)
			goto not_allowed;
		if (ecx_id_check(id, why, sizeof(why)) != 0)
			return answer_error(a, MHD_HTTP_BAD_REQUEST, why);
		if (get)
			return route_info_get(r, a, id);
		if (put)
			return route_info_put(r, a, id, q);
		return route_info_delete(r, a, id, q);
	}
	if (strcmp(url, "/ec/renew") == 0) {
		if (!post)
			goto not_allowed;
		return route_renew(r, a, q);
	}
	if (strcmp(url, "/ec/lookup") == 0) {
		if (!post)
			goto not_allowed;
		return route_lookup(r, a, q);
	}
	if (strcmp(url, "/ec/list") == 0) {
		if (!get)
			goto not_allowed;
		return route_list(r, a, q);
	}
	if (strcmp(url, "/metrics") == 0) {
		if (!get)
			goto not_allowed;
		return route_metrics(r, a);
	}
	return answer_error(a, MHD_HTTP_NOT_FOUND, "Not Found");
not_allowed:
	return answer_error(a, MHD_HTTP_METHOD_NOT_ALLOWED,
	                    "Method Not Allowed");
}

void ecx_registry_route(ecx_registry *r, const ecx_reg_http *q,
                        ecx_reg_answer *a)
{
	reg_route(r, q, a);
}

static enum MHD_Result reg_handle(void *cls, struct MHD_Connection *c,
                                  const char *url, const char *method,
                                  const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
	(void)version;
	ecx_registry *r = cls;
	reg_req *q = *con_cls;
	if (q == NULL) {
		q = calloc(1, sizeof(*q));
		if (q == NULL)
			return MHD_NO;
		q->start_ns = ecx_now_ns();
		*con_cls = q;
		return MHD_YES;
	}
	if (*upload_size > 0) {
		size_t n = *upload_size;
		*upload_size = 0;
		if (q->too_big || q->len + n > ECX_REG_MAX_BODY) {
			q->too_big = true;
			return MHD_YES;
		}
		char *b = realloc(q->body, q->len + n + 1);
		if (b == NULL)
			return MHD_NO;
		memcpy(b + q->len, upload, n);
		q->body = b;
		q->len += n;
		q->body[q->len] = '\0';
		return MHD_YES;
	}
	ecx_reg_http h = {
	    .method = method,
	    .url = url,
	    .arg_after =
	        MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "after"),
	    .arg_limit =
	        MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "limit"),
	    .arg_producer = MHD_lookup_connection_value(
	        c, MHD_GET_ARGUMENT_KIND, "producer_zmq"),
	    .authorization = MHD_lookup_connection_value(
	        c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
	    .body = q->body,
	    .len = q->len,
	    .too_big = q->too_big};
	ecx_reg_answer a = {0};
	ecx_registry_route(r, &h, &a);
	struct MHD_Response *resp = MHD_create_response_from_buffer(
	    strlen(a.body), a.body, MHD_RESPMEM_MUST_FREE);
	if (resp == NULL) {
		free(a.body);
		return MHD_NO;
	}
	MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, a.ctype);
	if (a.status == MHD_HTTP_UNAUTHORIZED)
		MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
		                        "Bearer");
	enum MHD_Result ret = MHD_queue_response(c, a.status, resp);
	MHD_destroy_response(resp);
	return ret;
}

static void reg_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                          enum MHD_RequestTerminationCode toe)
{
	(void)c;
	(void)toe;
	ecx_registry *r = cls;
	reg_req *q = *con_cls;
	if (q == NULL)
		return;
	uint64_t us = (ecx_now_ns() - q->start_ns) / 1000;
	size_t b = 0;
	while (b < NLAT && us > lat_bounds_us[b])
		b++;
	count(&r->lat_buckets[b], 1);
	count(&r->lat_count, 1);
	count(&r->lat_sum_us, us);
	count(&r->requests, 1);
	free(q->body);
	free(q);
	*con_cls = NULL;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Decodes %XX in the URL in place, as libmicrohttpd would, except %00: a
 * NUL would cut the id short ("a%00b" would look up "a"), so it stays
 * encoded and the id check refuses the '%'. */
static size_t reg_unescape(void *cls, struct MHD_Connection *c, char *s)
{
	(void)cls;
	(void)c;
	char *w = s;
	for (const char *r = s; *r != '\0'; r++) {
		int hi, lo;
		if (r[0] == '%' && (hi = hexval(r[1])) >= 0 &&
		    (lo = hexval(r[2])) >= 0 && (hi | lo) != 0) {
			*w++ = (char)(hi << 4 | lo);
			r += 2;
		} else {
			*w++ = *r;
		}
	}
	*w = '\0';
	return (size_t)(w - s);
}

static void reg_mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	char line[512];
	vsnprintf(line, sizeof(line), fmt, ap);
	size_t n = strlen(line);
	while (n > 0 && line[n - 1] == '\n')
		line[--n] = '\0';
	ecx_debug(MOD, "libmicrohttpd: %s", line);
}

/* Binds the listening socket here rather than in libmicrohttpd so that a
 * taken port or a bad address is reported precisely. */
static int reg_listen(const char *host, uint16_t port, int *fd_out,
                      uint16_t *port_out, char *why, size_t whylen)
{
	struct addrinfo hints, *res = NULL;
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
	char ps[8];
	snprintf(ps, sizeof(ps), "%u", port);
	int gai = getaddrinfo(host, ps, &hints, &res);
	if (gai != 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "cannot use bind address '%s': %s", host,
		               gai_strerror(gai));
	int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC,
	                res->ai_protocol);
	if (fd < 0) {
		freeaddrinfo(res);
		return ecx_why(why, whylen, ECX_EIO, "socket: %s",
		               strerror(errno));
	}
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
		int e = errno;
		freeaddrinfo(res);
		close(fd);
		if (e == EADDRINUSE)
			return ecx_why(why, whylen, ECX_EADDRINUSE,
			               "port %u on %s is already in use (is "
			               "another registry or producer running?)",
			               port, host);
		return ecx_why(
		    why, whylen, e == EADDRNOTAVAIL ? ECX_EINVAL : ECX_EIO,
		    "cannot bind %s:%u: %s", host, port, strerror(e));
	}
	freeaddrinfo(res);
	if (listen(fd, 512) != 0) {
		int e = errno;
		close(fd);
		return ecx_why(why, whylen, ECX_EIO, "listen: %s", strerror(e));
	}
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sl);
	*port_out = ntohs(ss.ss_family == AF_INET6
	                      ? ((struct sockaddr_in6 *)&ss)->sin6_port
	                      : ((struct sockaddr_in *)&ss)->sin_port);
	*fd_out = fd;
	return 0;
}

int ecx_registry_create(const ecx_registry_params *p, ecx_registry **out,
                        char *why, size_t whylen)
{
	uint64_t m = p != NULL ? p->field_mask : 0;
	const char *host = (m & ECX_REGISTRY_PARAM_BIND_HOST) && p->bind_host
	                       ? p->bind_host
	                       : "0.0.0.0";
	uint16_t port =
	    (m & ECX_REGISTRY_PARAM_PORT) ? p->port : ECX_REGISTRY_PORT_DEFAULT;
	const char *token =
	    (m & ECX_REGISTRY_PARAM_TOKEN) && p->token && p->token[0] ? p->token
	                                                              : NULL;
	unsigned threads =
	    (m & ECX_REGISTRY_PARAM_THREADS) && p->threads ? p->threads : 2;
	const char *store =
	    (m & ECX_REGISTRY_PARAM_STORE) && p->store ? p->store : "memory";
	int entry_ttl = (m & ECX_REGISTRY_PARAM_ENTRY_TTL)
	                    ? p->entry_ttl_s
	                    : ECX_ENTRY_TTL_DEFAULT;
	if (threads > 64)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "at most 64 registry threads");
	if (entry_ttl < 0 || entry_ttl > ECX_TTL_MAX_S)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "the entry TTL is 0 to %d seconds, not %d",
		               ECX_TTL_MAX_S, entry_ttl);
	if (strcmp(store, "memory") != 0 && !ecx_store_is_redis_url(store))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "unknown registry store '%s' (memory, or "
		               "redis://host:port[/db])",
		               store);

	ecx_registry *r = calloc(1, sizeof(*r));
	if (r == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	r->epoch = (ecx_now_ns() ^ ((uint64_t)getpid() << 40)) %
	               (ECX_JSON_INT_MAX - 1) +
	           1;
	r->entry_ttl_s = entry_ttl;
	r->token_reads = (m & ECX_REGISTRY_PARAM_TOKEN_READS) &&
	                 p->token_reads && token != NULL;
	int rc = ECX_ENOMEM;
	if (token != NULL) {
		r->token = strdup(token);
		r->token_len = strlen(token);
		if (r->token == NULL)
			goto fail;
	}
	if (ecx_store_is_redis_url(store)) {
		r->store = ecx_store_redis_create(store, 5000, 0, why, whylen);
		if (r->store == NULL) {
			rc = ECX_EINVAL;
			goto fail;
		}
		r->redis = true;
		/* It starts anyway (Redis may come later); /healthz says. */
		char down[256];
		if (ecx_store_redis_ping(r->store, down, sizeof(down)) != 0)
			ecx_warn(MOD,
			         "%s (/healthz answers 503 until it "
			         "answers)",
			         down);
	} else {
		r->store = ecx_store_mem_create();
		if (r->store == NULL)
			goto fail;
	}
	int fd = -1;
	rc = reg_listen(host, port, &fd, &r->port, why, whylen);
	if (rc != 0)
		goto fail;
	r->mhd = MHD_start_daemon(
	    MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL |
	        MHD_USE_ERROR_LOG | MHD_USE_SUPPRESS_DATE_NO_CLOCK,
	    0, NULL, NULL, reg_handle, r, MHD_OPTION_LISTEN_SOCKET, fd,
	    MHD_OPTION_THREAD_POOL_SIZE, threads, MHD_OPTION_NOTIFY_COMPLETED,
	    reg_completed, r, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)60,
	    MHD_OPTION_CONNECTION_LIMIT, (unsigned)1000,
	    MHD_OPTION_EXTERNAL_LOGGER, reg_mhd_log, NULL,
	    MHD_OPTION_UNESCAPE_CALLBACK, reg_unescape, NULL, MHD_OPTION_END);
	if (r->mhd == NULL) {
		close(fd);
		rc = ecx_why(why, whylen, ECX_EIO,
		             "libmicrohttpd could not start on %s:%u", host,
		             r->port);
		goto fail;
	}
	bool v6 = strchr(host, ':') != NULL; /* a URL brackets IPv6 */
	ecx_info(MOD, "listening on http://%s%s%s:%u (store %s%s)",
	         v6 ? "[" : "", host, v6 ? "]" : "", r->port, store,
	         token ? ", token required for writes" : "");
	*out = r;
	return 0;
fail:
	if (rc == ECX_ENOMEM)
		ecx_why(why, whylen, rc, "out of memory");
	ecx_store_destroy(r->store);
	free(r->token);
	free(r);
	return rc;
}

uint16_t ecx_registry_port(const ecx_registry *r)
{
	return r->port;
}

ecx_store *ecx_registry_store(ecx_registry *r)
{
	return r->store;
}

void ecx_registry_count_publish(ecx_registry *r, bool removal)
{
	count(removal ? &r->removals : &r->publishes, 1);
}

void ecx_registry_destroy(ecx_registry *r)
{
	if (r == NULL)
		return;
	if (r->mhd != NULL)
		MHD_stop_daemon(r->mhd); /* closes the listening socket */
	ecx_store_destroy(r->store);
	if (r->token != NULL)
		memset(r->token, 0, r->token_len);
	free(r->token);
	free(r);
}

int ecx_registry_create_detached(const char *token, ecx_registry **out)
{
	ecx_registry *r = calloc(1, sizeof(*r));
	if (r == NULL)
		return ECX_ENOMEM;
	r->store = ecx_store_mem_create();
	r->entry_ttl_s = ECX_ENTRY_TTL_DEFAULT;
	if (token != NULL) {
		r->token = strdup(token);
		r->token_len = strlen(token);
	}
	if (r->store == NULL || (token != NULL && r->token == NULL)) {
		ecx_registry_destroy(r);
		return ECX_ENOMEM;
	}
	*out = r;
	return 0;
}
