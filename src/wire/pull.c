/* pull.c - ecx's batched pull request and its reply, and the item
 * hashes. Both are written with jstream (no tree, on every load's path:
 * 0.5 us a pull against 2.8 with a cJSON tree, the same bytes) and read
 * with cJSON (a tree-free read was no faster). */
#include "wire.h"

#include "wire/jstream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#ifdef ECX_HAVE_XXH3_DISPATCH
#include <xxh_x86dispatch.h> /* XXH3 with the widest vectors the CPU has */
#endif

int ecx_json_id(const cJSON *n, const char *what, char *out, char *why,
                size_t whylen);

static const char *const hash_names[] = {
    [ECX_HASH_NONE] = "none",
    [ECX_HASH_XXH64] = "xxh64",
    [ECX_HASH_XXH3] = "xxh3",
};

const char *ecx_hash_name(int kind)
{
	return kind == ECX_HASH_XXH64 || kind == ECX_HASH_XXH3
	           ? hash_names[kind]
	           : NULL;
}

uint64_t ecx_hash_bytes(int kind, const void *p, size_t n)
{
	if (kind == ECX_HASH_XXH64)
		return XXH64(p, n, 0);
	if (kind == ECX_HASH_XXH3)
		return XXH3_64bits(p, n);
	return 0;
}

void *ecx_xxh3_new(void)
{
	XXH3_state_t *st = XXH3_createState();
	if (st != NULL)
		XXH3_64bits_reset(st);
	return st;
}

void ecx_xxh3_feed(void *st, const void *p, size_t n)
{
	XXH3_64bits_update(st, p, n);
}

uint64_t ecx_xxh3_end(void *st)
{
	uint64_t h = XXH3_64bits_digest(st);
	XXH3_freeState(st);
	return h;
}

void ecx_xxh3_free(void *st)
{
	XXH3_freeState(st);
}

/* The kind a request's "hash" names; DEFAULT for none or one unknown. */
static int hash_kind_of(const cJSON *h)
{
	if (!cJSON_IsString(h) || h->valuestring == NULL)
		return ECX_HASH_DEFAULT;
	for (int k = ECX_HASH_NONE; k <= ECX_HASH_XXH3; k++)
		if (strcmp(h->valuestring, hash_names[k]) == 0)
			return k;
	return ECX_HASH_DEFAULT;
}

/* ---- writing ---- */

/* ",\"key\":" then v. */
#define JS_KEY_U64(o, key, v)                 \
	do {                                  \
		js_lit((o), ",\"" key "\":"); \
		js_u64((o), (v));             \
	} while (0)

char *ecx_pull_req_encode(const ecx_pull_req *r)
{
	js_out o = {0};
	js_lit(&o, "{\"op\":\"pullv\",\"req\":");
	js_u64(&o, r->req);
	if (r->expires_ms != 0)
		JS_KEY_U64(&o, "expires_ms", r->expires_ms);
	if (r->data_am)
		js_lit(&o, ",\"data\":\"am\"");
	if (r->hash >= ECX_HASH_NONE && r->hash <= ECX_HASH_XXH3) {
		js_lit(&o, ",\"hash\":");
		js_str(&o, hash_names[r->hash]);
	}
	if (r->landed)
		js_lit(&o, ",\"landed\":true");
	if (r->fold)
		js_lit(&o, ",\"reply\":\"data\"");
	if (r->fold && r->lead)
		js_lit(&o, ",\"lead\":true");
	if (r->data_am && r->lane)
		js_lit(&o, ",\"lane\":true");
	if (r->token[0] != '\0') {
		js_lit(&o, ",\"token\":");
		js_str(&o, r->token);
	}
	js_lit(&o, ",\"regions\":[");
	for (size_t i = 0; i < r->nregions; i++) {
		const ecx_region *g = &r->regions[i];
		if (i > 0)
			js_lit(&o, ",");
		js_lit(&o, "{\"base\":");
		js_u64(&o, g->base);
		JS_KEY_U64(&o, "len", g->len);
		js_lit(&o, ",\"rkey\":\"");
		/* Base64 needs no escaping: written in place (js_reserve
		 * keeps a byte past n for the NUL ecx_b64_encode writes). */
		size_t n = ecx_b64_enclen(g->rkey_len);
		if (js_reserve(&o, n)) {
			ecx_b64_encode(g->rkey, g->rkey_len, o.p + o.len);
			o.len += n;
		}
		js_lit(&o, "\"}");
	}
	js_lit(&o, "],\"items\":[");
	for (size_t i = 0; i < r->nitems; i++) {
		const ecx_pull_item *it = &r->items[i];
		if (i > 0)
			js_lit(&o, ",");
		js_lit(&o, "{\"id\":");
		js_str(&o, it->id);
		JS_KEY_U64(&o, "nbytes", it->nbytes);
		JS_KEY_U64(&o, "region", it->region);
		JS_KEY_U64(&o, "addr", it->addr);
		if (it->lease != 0)
			JS_KEY_U64(&o, "lease", it->lease);
		js_lit(&o, "}");
	}
	js_lit(&o, "]}");
	return js_done(&o);
}

/* ",\"err\":..., \"code\":..." of error e, with detail when given. */
static void js_err(js_out *o, int e, const char *detail)
{
	js_lit(o, ",\"err\":");
	js_str(o,
	       detail != NULL && detail[0] != '\0' ? detail : core_strerror(e));
	js_lit(o, ",\"code\":");
	js_str(o, core_err_name(e));
}

char *ecx_pull_resp_encode(const ecx_pull_resp *r)
{
	js_out o = {0};
	js_lit(&o, "{\"req\":");
	js_u64(&o, r->req);
	if (r->err != 0) {
		js_lit(&o, ",\"ok\":false");
		js_err(&o, r->err, r->detail);
		js_lit(&o, "}");
		return js_done(&o);
	}
	js_lit(&o, ",\"ok\":true");
	if (r->data_am)
		js_lit(&o, ",\"data\":\"am\"");
	js_lit(&o, ",\"items\":[");
	const char *hfield =
	    r->hash_kind == ECX_HASH_XXH3 ? ",\"xxh3\":\"" : ",\"xxh64\":\"";
	static const char hexd[] = "0123456789abcdef";
	for (size_t i = 0; i < r->nitems; i++) {
		if (i > 0)
			js_lit(&o, ",");
		if (r->status[i] != 0) {
			js_lit(&o, "{\"ok\":false");
			js_err(&o, r->status[i], NULL);
			js_lit(&o, "}");
			continue;
		}
		js_lit(&o, "{\"ok\":true");
		if (r->hash != NULL &&
		    (r->has_hash == NULL || r->has_hash[i])) {
			char hex[16];
			for (int k = 0; k < 16; k++)
				hex[k] =
				    hexd[(r->hash[i] >> (60 - 4 * k)) & 15];
			js_raw(&o, hfield, strlen(hfield));
			js_raw(&o, hex, sizeof(hex));
			js_lit(&o, "\"");
		}
		js_lit(&o, "}");
	}
	js_lit(&o, "]}");
	return js_done(&o);
}

void ecx_pull_req_free(ecx_pull_req *r)
{
	if (r == NULL)
		return;
	free(r->mem);
	r->mem = NULL;
	r->regions = NULL;
	r->items = NULL;
	r->nregions = r->nitems = 0;
}

int ecx_pull_req_decode(const char *buf, size_t len, ecx_pull_req *out,
                        char *why, size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_WIRE_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_WIRE_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	int rc;
	ecx_pull_req r;
	memset(&r, 0, sizeof(r));
	char op[16];
	rc = ecx_json_get_str(o, "op", op, sizeof(op), why, whylen);
	if (rc != 0)
		goto fail;
	if (strcmp(op, "pullv") != 0) {
		rc = ecx_why(why, whylen, ECX_EUNSUPPORTED, "unknown op");
		goto fail;
	}
	if ((rc = ecx_json_get_u64(o, "req", &r.req, why, whylen)) != 0)
		goto fail;
	if (cJSON_GetObjectItemCaseSensitive(o, "expires_ms") != NULL &&
	    (rc = ecx_json_get_u64(o, "expires_ms", &r.expires_ms, why,
	                           whylen)) != 0)
		goto fail;
	/* Any other "data" is a way this producer does not know: it puts,
	 * which every consumer takes. */
	const cJSON *d = cJSON_GetObjectItemCaseSensitive(o, "data");
	r.data_am = cJSON_IsString(d) && d->valuestring != NULL &&
	            strcmp(d->valuestring, "am") == 0;
	/* As "data": a hash this producer does not know is answered with
	 * xxh64, which every checking consumer takes. */
	r.hash = hash_kind_of(cJSON_GetObjectItemCaseSensitive(o, "hash"));
	r.landed = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "landed"));
	/* Any other "reply" is answered apart, which every consumer takes. */
	const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, "reply");
	r.fold = r.data_am && cJSON_IsString(f) && f->valuestring != NULL &&
	         strcmp(f->valuestring, "data") == 0;
	r.lead =
	    r.fold && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "lead"));
	r.lane = r.data_am &&
	         cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "lane"));
	if (cJSON_GetObjectItemCaseSensitive(o, "token") != NULL &&
	    (rc = ecx_json_get_str(o, "token", r.token, sizeof(r.token), why,
	                           whylen)) != 0)
		goto fail;
	const cJSON *regs = cJSON_GetObjectItemCaseSensitive(o, "regions");
	const cJSON *items = cJSON_GetObjectItemCaseSensitive(o, "items");
	if (!cJSON_IsArray(regs) || !cJSON_IsArray(items)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "pull needs \"regions\" and \"items\" arrays");
		goto fail;
	}
	int ng = cJSON_GetArraySize(regs), ni = cJSON_GetArraySize(items);
	if (ng > ECX_PULL_MAX_REGIONS || ni > ECX_PULL_MAX_ITEMS) {
		rc = ecx_why(why, whylen, ECX_ETOOBIG,
		             "pull has %d regions and %d items; at most %d "
		             "and %d",
		             ng, ni, ECX_PULL_MAX_REGIONS, ECX_PULL_MAX_ITEMS);
		goto fail;
	}
	/* One allocation: regions, items, then the decoded rkeys. */
	size_t rkey_room = 0;
	const cJSON *g;
	cJSON_ArrayForEach (g, regs) {
		const cJSON *k = cJSON_GetObjectItemCaseSensitive(g, "rkey");
		if (!cJSON_IsString(k) || k->valuestring == NULL) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "region's \"rkey\" is not a string");
			goto fail;
		}
		size_t kl = strlen(k->valuestring);
		if (kl > ecx_b64_enclen(ECX_RKEY_MAX)) {
			rc = ecx_why(why, whylen, ECX_ETOOBIG,
			             "region's \"rkey\" is too long");
			goto fail;
		}
		rkey_room += kl / 4 * 3;
	}
	size_t sz = (size_t)ng * sizeof(ecx_region) +
	            (size_t)ni * sizeof(ecx_pull_item) + rkey_room + 1;
	r.mem = calloc(1, sz);
	if (r.mem == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		goto fail;
	}
	r.regions = r.mem;
	r.items = (ecx_pull_item *)(r.regions + ng);
	unsigned char *kp = (unsigned char *)(r.items + ni);
	cJSON_ArrayForEach (g, regs) {
		ecx_region *x = &r.regions[r.nregions];
		if (!cJSON_IsObject(g)) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "region is not an object");
			goto fail;
		}
		if ((rc = ecx_json_get_u64(g, "base", &x->base, why, whylen)) ||
		    (rc = ecx_json_get_u64(g, "len", &x->len, why, whylen)))
			goto fail;
		if (x->len == 0 || x->base + x->len > ECX_JSON_INT_MAX) {
			rc =
			    ecx_why(why, whylen, ECX_EPROTO,
			            "region %zu is empty or wraps", r.nregions);
			goto fail;
		}
		const char *k =
		    cJSON_GetObjectItemCaseSensitive(g, "rkey")->valuestring;
		long kl = ecx_b64_decode(k, strlen(k), kp, rkey_room);
		if (kl <= 0) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "region %zu's \"rkey\" is not base64",
			             r.nregions);
			goto fail;
		}
		x->rkey = kp;
		x->rkey_len = (size_t)kl;
		kp += kl;
		rkey_room -= (size_t)kl;
		r.nregions++;
	}
	const cJSON *it;
	cJSON_ArrayForEach (it, items) {
		ecx_pull_item *x = &r.items[r.nitems];
		uint64_t region;
		char what[32];
		snprintf(what, sizeof(what), "item %zu's \"id\"", r.nitems);
		if (!cJSON_IsObject(it)) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "item is not an object");
			goto fail;
		}
		if ((rc =
		         ecx_json_id(cJSON_GetObjectItemCaseSensitive(it, "id"),
		                     what, x->id, why, whylen)) ||
		    (rc = ecx_json_get_u64(it, "nbytes", &x->nbytes, why,
		                           whylen)) ||
		    (rc = ecx_json_get_u64(it, "region", &region, why,
		                           whylen)) ||
		    (rc = ecx_json_get_u64(it, "addr", &x->addr, why, whylen)))
			goto fail;
		if (cJSON_GetObjectItemCaseSensitive(it, "lease") != NULL &&
		    (rc =
		         ecx_json_get_u64(it, "lease", &x->lease, why, whylen)))
			goto fail;
		if (region >= r.nregions) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "item %zu names region %llu of %zu",
			             r.nitems, (unsigned long long)region,
			             r.nregions);
			goto fail;
		}
		x->region = (uint32_t)region;
		const ecx_region *reg = &r.regions[region];
		if (x->addr < reg->base || x->nbytes > reg->len ||
		    x->addr - reg->base > reg->len - x->nbytes) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "item %zu's destination lies outside its "
			             "region",
			             r.nitems);
			goto fail;
		}
		r.nitems++;
	}
	cJSON_Delete(o);
	*out = r;
	return 0;
fail:
	cJSON_Delete(o);
	ecx_pull_req_free(&r);
	return rc;
}

/* An error code read off the wire: known names map back, anything else is a
 * transport error; 0 is never returned for a failure. */
static int wire_err(const cJSON *x)
{
	const cJSON *c = cJSON_GetObjectItemCaseSensitive(x, "code");
	int e = cJSON_IsString(c) ? ecx_err_from_name(c->valuestring) : ECX_EIO;
	return e != 0 ? e : ECX_EIO;
}

int ecx_pull_resp_decode(const char *buf, size_t len, ecx_pull_resp *out,
                         char *why, size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_WIRE_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_WIRE_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	int rc;
	ecx_pull_resp r;
	memset(&r, 0, sizeof(r));
	if ((rc = ecx_json_get_u64(o, "req", &r.req, why, whylen)) != 0)
		goto fail;
	const cJSON *ok = cJSON_GetObjectItemCaseSensitive(o, "ok");
	if (!cJSON_IsBool(ok)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "\"ok\" is missing or not a boolean");
		goto fail;
	}
	if (cJSON_IsFalse(ok)) {
		r.err = wire_err(o);
		const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "err");
		ecx_strlcpy(r.detail,
		            cJSON_IsString(e) ? e->valuestring
		                              : core_strerror(r.err),
		            sizeof(r.detail));
		cJSON_Delete(o);
		*out = r;
		return 0;
	}
	const cJSON *d = cJSON_GetObjectItemCaseSensitive(o, "data");
	r.data_am = cJSON_IsString(d) && d->valuestring != NULL &&
	            strcmp(d->valuestring, "am") == 0;
	const cJSON *items = cJSON_GetObjectItemCaseSensitive(o, "items");
	if (!cJSON_IsArray(items)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "\"items\" is missing or not an array");
		goto fail;
	}
	int n = cJSON_GetArraySize(items);
	if (n > ECX_PULL_MAX_ITEMS) {
		rc = ecx_why(why, whylen, ECX_ETOOBIG, "too many items");
		goto fail;
	}
	r.status = calloc(n > 0 ? (size_t)n : 1, sizeof(int));
	if (r.status == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		goto fail;
	}
	const cJSON *x;
	cJSON_ArrayForEach (x, items) {
		const cJSON *iok = cJSON_GetObjectItemCaseSensitive(x, "ok");
		if (!cJSON_IsBool(iok)) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "item %zu's \"ok\" is not a boolean",
			             r.nitems);
			goto fail;
		}
		int kind = ECX_HASH_XXH64;
		const cJSON *h = cJSON_GetObjectItemCaseSensitive(x, "xxh64");
		if (cJSON_GetObjectItemCaseSensitive(x, "xxh3") != NULL) {
			kind = ECX_HASH_XXH3;
			h = h == NULL
			        ? cJSON_GetObjectItemCaseSensitive(x, "xxh3")
			        : NULL;
			if (h == NULL) {
				rc = ecx_why(why, whylen, ECX_EPROTO,
				             "item %zu has two hashes",
				             r.nitems);
				goto fail;
			}
		}
		if (h != NULL) {
			const char *hn = hash_names[kind];
			char *end = NULL;
			if (r.hash_kind != 0 && r.hash_kind != kind) {
				rc = ecx_why(
				    why, whylen, ECX_EPROTO,
				    "item %zu's hash is %s, an earlier "
				    "one's %s",
				    r.nitems, hn, hash_names[r.hash_kind]);
				goto fail;
			}
			r.hash_kind = kind;
			if (!cJSON_IsString(h) ||
			    strlen(h->valuestring) != 16) {
				rc = ecx_why(why, whylen, ECX_EPROTO,
				             "item %zu's \"%s\" is not 16 "
				             "hex digits",
				             r.nitems, hn);
				goto fail;
			}
			if (r.hash == NULL)
				r.hash = calloc((size_t)n, sizeof(*r.hash));
			if (r.has_hash == NULL)
				r.has_hash = calloc((size_t)n, 1);
			if (r.hash == NULL || r.has_hash == NULL) {
				rc = ecx_why(why, whylen, ECX_ENOMEM,
				             "out of memory");
				goto fail;
			}
			r.hash[r.nitems] = strtoull(h->valuestring, &end, 16);
			if (end == NULL || *end != '\0') {
				rc = ecx_why(why, whylen, ECX_EPROTO,
				             "item %zu's \"%s\" is not hex",
				             r.nitems, hn);
				goto fail;
			}
			r.has_hash[r.nitems] = 1;
		}
		r.status[r.nitems++] = cJSON_IsTrue(iok) ? 0 : wire_err(x);
	}
	cJSON_Delete(o);
	*out = r;
	return 0;
fail:
	ecx_pull_resp_free(&r);
	cJSON_Delete(o);
	return rc;
}

void ecx_pull_resp_free(ecx_pull_resp *r)
{
	free(r->status);
	free(r->hash);
	free(r->has_hash);
	r->status = NULL;
	r->hash = NULL;
	r->has_hash = NULL;
}
