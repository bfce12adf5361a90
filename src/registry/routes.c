/* routes.c - the HTTP registry's routes and the router, apart from the
 * transport: answers and errors, authorization, /ec/info/{id}, /ec/renew,
 * /ec/lookup, /ec/list, /metrics and /healthz. */
#include "registry/registry_priv.h"

#include <microhttpd.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

void ecx_registry_set_leaser(ecx_registry *r, ecx_registry_lease_fn fn,
                             void *arg)
{
	r->lease_arg = arg;
	__atomic_store_n(&r->lease_fn, fn, __ATOMIC_RELEASE);
}

/* The lease a lookup asks for: 0 for none, or when there is no one here
 * to take it, or the caller lacks the token. */
static uint64_t lease_asked(ecx_registry *r, const ecx_reg_http *q, uint64_t ms)
{
	if (ms == 0 || __atomic_load_n(&r->lease_fn, __ATOMIC_ACQUIRE) == NULL)
		return 0;
	return authorized(r, q) ? ms : 0;
}

static int item_id_cmp(const void *a, const void *b)
{
	const ecx_lookup_item *x = *(const ecx_lookup_item *const *)a;
	const ecx_lookup_item *y = *(const ecx_lookup_item *const *)b;
	return strcmp(x->id, y->id);
}

/* Leases what the lookup found, where the embedding producer holds it. An
 * id asked more than once is left to the client, which leases it at its
 * producer once per time asked (the answer carries one entry per id). */
static void lease_found(ecx_registry *r, ecx_lookup_item *items, size_t n,
                        uint64_t ms)
{
	if (ms == 0)
		return;
	if (n == 1) {
		r->lease_fn(r->lease_arg, items, 1, ms);
		return;
	}
	ecx_lookup_item **ord = malloc(n * sizeof(*ord));
	if (ord == NULL)
		return; /* the client leases them at their producers */
	for (size_t i = 0; i < n; i++)
		ord[i] = &items[i];
	qsort(ord, n, sizeof(*ord), item_id_cmp);
	for (size_t i = 0; i < n;) {
		size_t j = i + 1;
		while (j < n && strcmp(ord[j]->id, ord[i]->id) == 0)
			j++;
		if (j == i + 1)
			r->lease_fn(r->lease_arg, ord[i], 1, ms);
		i = j;
	}
	free(ord);
}

static int route_info_get(ecx_registry *r, ecx_reg_answer *a, const char *id,
                          const ecx_reg_http *q)
{
	char why[200];
	ecx_lookup_item it = {.id = id};
	count(&r->lookups, 1);
	int rc = r->store->ops->get(r->store, id, &it.entry, why, sizeof(why));
	if (rc != 0 && rc != ECX_ENOTFOUND)
		return answer_error(a, status_of(rc), why);
	it.found = rc == 0;
	uint64_t ms = 0;
	if (it.found && q->arg_lease_ms != NULL) {
		char *end = NULL;
		errno = 0;
		unsigned long long v = strtoull(q->arg_lease_ms, &end, 10);
		if (errno == 0 && end != q->arg_lease_ms && *end == '\0')
			ms = lease_asked(r, q, v);
	}
	lease_found(r, &it, 1, ms);
	if (!it.found) {
		count(&r->misses, 1);
		return answer_error(a, MHD_HTTP_NOT_FOUND, "unknown mm_hash");
	}
	count(&r->hits, 1);
	return answer_json(a, MHD_HTTP_OK, ecx_entry_encode(&it.entry));
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
	e.lease = 0; /* a lease is an answer's, never stored */
	if (rc == 0)
		rc = r->store->ops->put(r->store, id, &e, why, sizeof(why));
	if (rc != 0)
		return answer_error(a, status_of(rc), why);
	count(&r->publishes, 1);
	count(&r->http_writes, 1);
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
	count(&r->http_writes, 1);
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
	/* The store sets each item's found, entry (when found) and holders:
	 * nothing else needs clearing. */
	ecx_lookup_item *items = malloc((l.n + 1) * sizeof(*items));
	if (items == NULL) {
		free(l.ids);
		return answer_error(a, 500, "out of memory");
	}
	for (size_t i = 0; i < l.n; i++) {
		items[i].id = l.ids[i];
		items[i].found = false;
		items[i].nalt = 0;
		items[i].alt = NULL;
	}
	rc = r->store->ops->mget(r->store, items, l.n, why, sizeof(why));
	if (rc == 0)
		rc = ecx_store_redis_holders(r->store, items, l.n, why,
		                             sizeof(why));
	if (rc == 0)
		lease_found(r, items, l.n, lease_asked(r, q, l.lease_ms));
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
	else if (after[0] != '\0' && core_id_check(after, NULL, 0) != 0)
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
	size_t cap = 16384, off = 0;
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
		 * does not answer makes the registry unhealthy (503), and so
		 * does an embedding producer still putting its items (a
		 * lookup now would miss what it is about to serve). */
		char why[256] = "";
		bool starting = __atomic_load_n(&r->starting, __ATOMIC_ACQUIRE);
		if (starting)
			snprintf(why, sizeof(why),
			         "starting: the producer is still putting and "
			         "publishing its items");
		bool ok = !starting &&
		          (!r->redis || ecx_store_redis_ping(r->store, why,
		                                             sizeof(why)) == 0);
		cJSON *o = cJSON_CreateObject();
		cJSON_AddBoolToObject(o, "ok", ok);
		cJSON_AddNumberToObject(o, "epoch", (double)r->epoch);
		if (starting)
			cJSON_AddBoolToObject(o, "starting", true);
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
		if (core_id_check(id, why, sizeof(why)) != 0)
			return answer_error(a, MHD_HTTP_BAD_REQUEST, why);
		if (get)
			return route_info_get(r, a, id, q);
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
