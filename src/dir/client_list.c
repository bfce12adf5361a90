/* client_list.c - the registry client's listings (GET /ec/list, paged, or
 * the Redis store's scan) and health checks (GET /healthz, or a Redis
 * PING), over the connections of client.c. */
#include "dir/regclient.h"

#include <curl/curl.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "regclient"

/* Reads one GET /ec/list answer into rows (room for cap). */
static int list_decode(const reg_conn *g, const buf *b, ecx_store_row *rows,
                       size_t cap, size_t *nrows, const char **next_id,
                       cJSON **tree, uint64_t *total, char *why, size_t whylen)
{
	cJSON *o = ecx_json_parse(b->p != NULL ? b->p : "", b->len,
	                          ECX_WIRE_MAX, why, whylen);
	const cJSON *items = cJSON_GetObjectItemCaseSensitive(o, "items");
	const cJSON *next = cJSON_GetObjectItemCaseSensitive(o, "next");
	char sub[160] = "";
	int rc = 0;
	if (!cJSON_IsArray(items) ||
	    (!cJSON_IsString(next) && !cJSON_IsNull(next)) ||
	    ecx_json_get_u64(o, "total", total, sub, sizeof(sub)) != 0) {
		rc = ECX_EPROTO;
		goto out;
	}
	size_t n = 0;
	const cJSON *x;
	cJSON_ArrayForEach (x, items) {
		if (n == cap) {
			snprintf(sub, sizeof(sub), "more rows than asked for");
			rc = ECX_EPROTO;
			goto out;
		}
		if (ecx_json_get_str(x, "id", rows[n].id, sizeof(rows[n].id),
		                     sub, sizeof(sub)) != 0 ||
		    core_id_check(rows[n].id, sub, sizeof(sub)) != 0 ||
		    ecx_entry_from_json(x, &rows[n].entry, sub, sizeof(sub)) !=
		        0) {
			rc = ECX_EPROTO;
			goto out;
		}
		n++;
	}
	*nrows = n;
	*next_id = cJSON_IsString(next) ? next->valuestring : "";
out:
	if (rc != 0) {
		ecx_why(why, whylen, rc,
		        "registry %s answered a listing ecx cannot read%s%s",
		        g->url, sub[0] ? ": " : "", sub);
		cJSON_Delete(o);
		return rc;
	}
	*tree = o;
	return 0;
}

int ecx_regclient_list(ecx_regclient *c, const char *after, size_t limit,
                       ecx_store_row *rows, size_t *nrows, char *next,
                       size_t nextlen, uint64_t *total, char *why,
                       size_t whylen)
{
	if (after == NULL)
		after = "";
	if (limit < 1 || limit > ECX_LIST_MAX)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "a listing page is 1 to %d entries, not %zu",
		               ECX_LIST_MAX, limit);
	if (after[0] != '\0' && core_id_check(after, why, whylen) != 0)
		return ECX_EID;
	/* One row more than asked says whether another page follows, so
	 * `next` is "" exactly when the listing is complete (HTTP pages of
	 * the largest size take the server's word instead). */
	size_t ask = limit < ECX_LIST_MAX ? limit + 1 : limit;
	ecx_store_row *all = calloc(ask, sizeof(*all));
	if (all == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	reg_conn *g = &c->regs[0];
	size_t n = 0;
	uint64_t tot = 0;
	const char *more = "";
	cJSON *tree = NULL;
	int rc;
	if (g->redis != NULL) {
		size_t st = 0;
		rc = g->redis->ops->list(g->redis, after, ask, all, &n, &st,
		                         why, whylen);
		tot = st;
	} else {
		char *esc = curl_easy_escape(NULL, after, 0);
		if (esc == NULL) {
			free(all);
			return ecx_why(why, whylen, ECX_ENOMEM,
			               "out of memory");
		}
		char path[3 * ECX_ID_MAX + 64];
		snprintf(path, sizeof(path), "/ec/list?limit=%zu%s%s", ask,
		         esc[0] ? "&after=" : "", esc);
		curl_free(esc);
		buf b = {0};
		long status = 0;
		rc = regc_request(c, g, "GET", path, NULL, &status, &b, why,
		                  whylen);
		if (rc == 0 && status != 200)
			rc = regc_http_err(status, &b, g->url, why, whylen);
		if (rc == 0)
			rc = list_decode(g, &b, all, ask, &n, &more, &tree,
			                 &tot, why, whylen);
		free(b.p);
	}
	if (rc == 0) {
		if (ask > limit)
			more = n > limit ? all[limit - 1].id : "";
		if (n > limit)
			n = limit;
		if (strlen(more) >= nextlen)
			rc = ecx_why(why, whylen, ECX_EINVAL,
			             "no room for the next id");
	}
	if (rc == 0) {
		memcpy(rows, all, n * sizeof(*rows));
		*nrows = n;
		*total = tot;
		/* more may point into all or the tree: copy before freeing. */
		ecx_strlcpy(next, more, nextlen);
	}
	cJSON_Delete(tree);
	free(all);
	return rc;
}

/* GET /healthz: the registry's epoch. */
static int http_health(ecx_regclient *c, reg_conn *g, uint64_t *epoch,
                       char *why, size_t whylen)
{
	buf b = {0};
	long status = 0;
	int rc = regc_request(c, g, "GET", "/healthz", NULL, &status, &b, why,
	                      whylen);
	if (rc == 0 && status != 200)
		rc = regc_http_err(status, &b, g->url, why, whylen);
	if (rc == 0) {
		cJSON *o =
		    b.p != NULL ? cJSON_ParseWithLength(b.p, b.len) : NULL;
		if (ecx_json_get_u64(o, "epoch", epoch, why, whylen) != 0)
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "registry %s: /healthz has no epoch",
			             g->url);
		cJSON_Delete(o);
	}
	free(b.p);
	return rc;
}

int ecx_regclient_health(ecx_regclient *c, uint64_t *epoch, char *why,
                         size_t whylen)
{
	reg_conn *g = &c->regs[0];
	if (g->redis != NULL) {
		int rc = ecx_store_redis_ping(g->redis, why, whylen);
		if (rc == 0)
			*epoch = 0;
		return rc;
	}
	uint64_t e = 0;
	int rc = http_health(c, g, &e, why, whylen);
	if (rc == 0)
		*epoch = e;
	return rc;
}
