/* client_write.c - the registry client's writes: publishing an entry,
 * removing one, and keeping a producer's entries alive (renewing them by
 * POST /ec/renew, or writing them again where a registry cannot renew). */
#include "dir/regclient.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "regclient"

int ecx_regclient_put(ecx_regclient *c, const char *id, const ecx_entry *e,
                      char *why, size_t whylen)
{
	if (core_id_check(id, why, whylen) != 0)
		return ECX_EID;
	if (c->regs[0].redis != NULL)
		return c->regs[0].redis->ops->put(c->regs[0].redis, id, e, why,
		                                  whylen);
	char *body = ecx_entry_encode(e);
	if (body == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	char path[ECX_ID_MAX + 16];
	snprintf(path, sizeof(path), "/ec/info/%s", id);
	buf b = {0};
	long status = 0;
	int rc = regc_request(c, &c->regs[0], "PUT", path, body, &status, &b,
	                      why, whylen);
	if (rc == 0 && status != 200)
		rc = regc_http_err(status, &b, c->regs[0].url, why, whylen);
	free(body);
	free(b.p);
	return rc;
}

int ecx_regclient_delete(ecx_regclient *c, const char *id,
                         const char *producer_zmq, char *why, size_t whylen)
{
	if (core_id_check(id, why, whylen) != 0)
		return ECX_EID;
	if (c->regs[0].redis != NULL)
		return c->regs[0].redis->ops->del(c->regs[0].redis, id,
		                                  producer_zmq, why, whylen);
	char path[ECX_ID_MAX + ECX_ADDR_MAX * 3 + 40];
	int off = snprintf(path, sizeof(path), "/ec/info/%s", id);
	if (producer_zmq != NULL) {
		char *esc = curl_easy_escape(NULL, producer_zmq, 0);
		if (esc == NULL)
			return ecx_why(why, whylen, ECX_ENOMEM,
			               "out of memory");
		snprintf(path + off, sizeof(path) - (size_t)off,
		         "?producer_zmq=%s", esc);
		curl_free(esc);
	}
	buf b = {0};
	long status = 0;
	int rc = regc_request(c, &c->regs[0], "DELETE", path, NULL, &status, &b,
	                      why, whylen);
	if (rc == 0 && status != 200)
		rc = regc_http_err(status, &b, c->regs[0].url, why, whylen);
	free(b.p);
	return rc;
}

int ecx_regclient_get_raw(ecx_regclient *c, const char *path, long *status,
                          char **body, size_t *len, char *why, size_t whylen)
{
	if (c->regs[0].redis != NULL)
		return ecx_why(why, whylen, ECX_EUNSUPPORTED,
		               "%s: listing needs an HTTP registry (run 'ecx "
		               "registry --store %s' in front of it)",
		               c->regs[0].url, c->regs[0].url);
	buf b = {0};
	int rc = regc_request(c, &c->regs[0], "GET", path, NULL, status, &b,
	                      why, whylen);
	if (rc != 0) {
		free(b.p);
		return rc;
	}
	*body = b.p != NULL ? b.p : strdup("");
	*len = b.len;
	return *body != NULL ? 0 : ecx_why(why, whylen, ECX_ENOMEM, "oom");
}

/* Publishes the n entries again, one PUT each. */
static int republish(ecx_regclient *c, const char *const *ids,
                     const ecx_entry *entries, size_t n, size_t *republished,
                     char *why, size_t whylen)
{
	for (size_t i = 0; i < n; i++) {
		int rc = ecx_regclient_put(c, ids[i], &entries[i], why, whylen);
		if (rc != 0) {
			c->was_down = true; /* try the rest next time */
			return rc;
		}
		(*republished)++;
	}
	return 0;
}

/* POST /ec/renew for e's producer and epoch: sets *renewed. ECX_ENOTFOUND
 * from a registry without the route, ECX_EUNSUPPORTED from one whose store
 * renews by writes. */
static int http_renew(ecx_regclient *c, reg_conn *g, const ecx_entry *e,
                      size_t *renewed, char *why, size_t whylen)
{
	cJSON *o = cJSON_CreateObject();
	cJSON_AddStringToObject(o, "producer_zmq", e->producer_zmq);
	cJSON_AddItemToObject(o, "ecx_epoch", ecx_json_u64(e->epoch));
	cJSON_AddItemToObject(o, "ecx_ttl_s", ecx_json_u64((uint64_t)c->ttl_s));
	char *body = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	if (body == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	buf b = {0};
	long status = 0;
	int rc = regc_request(c, g, "POST", "/ec/renew", body, &status, &b, why,
	                      whylen);
	free(body);
	if (rc == 0 && status == 501)
		rc = ecx_why(why, whylen, ECX_EUNSUPPORTED,
		             "registry %s renews by writes", g->url);
	else if (rc == 0 && (status == 404 || status == 405))
		rc = ecx_why(why, whylen, ECX_ENOTFOUND,
		             "registry %s has no /ec/renew", g->url);
	else if (rc == 0 && status != 200)
		rc = regc_http_err(status, &b, g->url, why, whylen);
	if (rc == 0) {
		cJSON *r =
		    b.p != NULL ? cJSON_ParseWithLength(b.p, b.len) : NULL;
		uint64_t k = 0;
		if (ecx_json_get_u64(r, "renewed", &k, why, whylen) != 0)
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "registry %s: a renewal without a count",
			             g->url);
		cJSON_Delete(r);
		*renewed = (size_t)k;
	}
	free(b.p);
	return rc;
}

int ecx_regclient_sync(ecx_regclient *c, const char *const *ids,
                       const ecx_entry *entries, size_t n, size_t *republished,
                       char *why, size_t whylen)
{
	reg_conn *g = &c->regs[0];
	*republished = 0;
	/* Nothing to keep: whether the registry answers (a producer that
	 * waits for it to come back asks this). */
	if (g->redis != NULL && n == 0)
		return ecx_store_redis_ping(g->redis, why, whylen);
	if (g->redis != NULL && c->ttl_s <= 0) /* nothing expires */
		return ecx_store_redis_restore(g->redis, ids, entries, n,
		                               republished, why, whylen);
	if (g->redis != NULL) {
		int rc = ecx_store_redis_refresh(g->redis, ids, entries, n, why,
		                                 whylen);
		if (rc == 0)
			*republished = n;
		return rc;
	}
	uint64_t lease_ms = (uint64_t)(c->ttl_s > 0 ? c->ttl_s : 30) * 1000;
	if (n > 0 && c->renew_by_writes && !c->was_down &&
	    ecx_now_ms() - c->written_ms < lease_ms / 3)
		return 0;
	if (n > 0) {
		/* One request renews them all; a registry that answers with
		 * fewer than we hold lost some (a restart): all again. */
		size_t renewed = 0;
		int rc = http_renew(c, g, &entries[0], &renewed, why, whylen);
		if (rc == 0 && renewed >= n && !c->was_down)
			return 0;
		c->renew_by_writes = rc == ECX_EUNSUPPORTED;
		if (rc == 0 || rc == ECX_EUNSUPPORTED) {
			c->was_down = false;
			c->written_ms = ecx_now_ms();
			return republish(c, ids, entries, n, republished, why,
			                 whylen);
		}
		if (rc != ECX_ENOTFOUND) {
			c->was_down = true;
			return rc;
		}
		/* A registry without /ec/renew (before leases): its epoch
		 * says when it restarted. */
	}
	buf b = {0};
	long status = 0;
	int rc = regc_request(c, g, "GET", "/healthz", NULL, &status, &b, why,
	                      whylen);
	uint64_t epoch = 0;
	if (rc == 0) {
		cJSON *o =
		    b.p != NULL ? cJSON_ParseWithLength(b.p, b.len) : NULL;
		if (status != 200 ||
		    ecx_json_get_u64(o, "epoch", &epoch, why, whylen) != 0)
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "registry %s: /healthz has no epoch",
			             g->url);
		cJSON_Delete(o);
	}
	free(b.p);
	if (rc != 0) {
		c->was_down = true;
		return rc;
	}
	bool again =
	    c->was_down || (c->seen_epoch != 0 && epoch != c->seen_epoch);
	c->seen_epoch = epoch;
	c->was_down = false;
	if (!again)
		return 0;
	return republish(c, ids, entries, n, republished, why, whylen);
}
