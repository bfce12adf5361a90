/* client_lookup.c - the registry client's lookups: GET /ec/info/{id} one
 * item at a time, POST /ec/lookup for many (with holders and leases), on
 * client.c's connections, or the Redis store's. */
#include "dir/regclient.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "regclient"

/* Keeps b as g's answer buffer for the next lookup, unless a large answer
 * grew it past 1 MiB (a rare batch should not pin its memory). */
static void rx_keep(reg_conn *g, buf *b)
{
	if (b->cap > (1u << 20)) {
		free(b->p);
		b->p = NULL;
		b->len = b->cap = 0;
	}
	g->rx = *b;
}

static int reg_lookup_one(ecx_regclient *c, reg_conn *g, ecx_lookup_item *it,
                          uint64_t lease_ms, char *why, size_t whylen)
{
	char path[ECX_ID_MAX + 48];
	if (lease_ms != 0)
		snprintf(path, sizeof(path), "/ec/info/%s?ecx_lease_ms=%llu",
		         it->id, (unsigned long long)lease_ms);
	else
		snprintf(path, sizeof(path), "/ec/info/%s", it->id);
	buf b = g->rx;
	b.len = 0;
	long status = 0;
	int rc =
	    regc_request(c, g, "GET", path, NULL, &status, &b, why, whylen);
	if (rc == 0) {
		if (status == 200) {
			rc = ecx_entry_decode(b.p, b.len, &it->entry, why,
			                      whylen);
			if (rc != 0)
				rc = ecx_why(why, whylen, ECX_EPROTO,
				             "registry %s answered an entry "
				             "ecx cannot read",
				             g->url);
			it->found = rc == 0;
		} else if (status != 404 || !regc_is_miss(&b)) {
			/* Only the registries' miss is a miss: another 404
			 * says the URL is wrong. */
			rc = regc_http_err(status, &b, g->url, why, whylen);
		}
	}
	rx_keep(g, &b);
	return rc;
}

/* One GET /ec/info/{id} per item, for a registry without POST
 * /ec/lookup. */
static int reg_lookup_each(ecx_regclient *c, reg_conn *g,
                           ecx_lookup_item *items, size_t n, char *why,
                           size_t whylen)
{
	for (size_t i = 0; i < n; i++) {
		int rc = reg_lookup_one(c, g, &items[i], 0, why, whylen);
		if (rc != 0)
			return rc;
	}
	return 0;
}

static int reg_lookup_many(ecx_regclient *c, reg_conn *g,
                           ecx_lookup_item *items, size_t n, uint64_t lease_ms,
                           char *why, size_t whylen)
{
	if (g->no_batch)
		return reg_lookup_each(c, g, items, n, why, whylen);
	const char **ids = malloc(n * sizeof(*ids));
	if (ids == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++)
		ids[i] = items[i].id;
	char *body = ecx_lookup_req_encode_lease(ids, n, lease_ms);
	free(ids);
	if (body == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	buf b = g->rx;
	b.len = 0;
	long status = 0;
	int rc = regc_request(c, g, "POST", "/ec/lookup", body, &status, &b,
	                      why, whylen);
	free(body);
	if (rc == 0 && (status == 404 || status == 405 || status == 501)) {
		/* No POST /ec/lookup (the reference registry has only GET
		 * /ec/info/{id}): one GET each, which also tells a registry
		 * from a server that is none. */
		rx_keep(g, &b);
		g->no_batch = true;
		return reg_lookup_each(c, g, items, n, why, whylen);
	}
	if (rc == 0 && status != 200)
		rc = regc_http_err(status, &b, g->url, why, whylen);
	if (rc == 0) {
		rc = ecx_lookup_resp_decode(b.p, b.len, items, n, why, whylen);
		/* Out of memory here is not the registry's fault. */
		if (rc != 0 && rc != ECX_ENOMEM)
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "registry %s answered a lookup ecx cannot "
			             "read",
			             g->url);
	}
	rx_keep(g, &b);
	return rc;
}

static int lookup(ecx_regclient *c, ecx_lookup_item *items, size_t n,
                  bool all_holders, uint64_t lease_ms, char *why,
                  size_t whylen);

int ecx_regclient_lookup(ecx_regclient *c, ecx_lookup_item *items, size_t n,
                         char *why, size_t whylen)
{
	return lookup(c, items, n, false, 0, why, whylen);
}

int ecx_regclient_lookup_holders(ecx_regclient *c, ecx_lookup_item *items,
                                 size_t n, char *why, size_t whylen)
{
	return lookup(c, items, n, true, 0, why, whylen);
}

int ecx_regclient_lookup_lease(ecx_regclient *c, ecx_lookup_item *items,
                               size_t n, uint64_t lease_ms, char *why,
                               size_t whylen)
{
	return lookup(c, items, n, false, lease_ms, why, whylen);
}

static int lookup(ecx_regclient *c, ecx_lookup_item *items, size_t n,
                  bool all_holders, uint64_t lease_ms, char *why, size_t whylen)
{
	for (size_t i = 0; i < n; i++) {
		if (core_id_check(items[i].id, why, whylen) != 0)
			return ECX_EID;
		items[i].found = false;
		items[i].alt = NULL; /* output only */
		items[i].nalt = 0;
	}
	if (n > ECX_LOOKUP_MAX_IDS)
		return ecx_why(why, whylen, ECX_ETOOBIG,
		               "%zu ids in one lookup; at most %d", n,
		               ECX_LOOKUP_MAX_IDS);
	/* The first registry asked fills items in place; later ones get the
	 * ids still missing, gathered at the front of a scratch array
	 * (allocated when first needed). */
	ecx_lookup_item *miss = NULL;
	size_t *where = NULL;
	int last = 0;
	size_t asked = 0;
	uint64_t now = ecx_now_ms();
	size_t probe = regc_probe(c, now);
	for (size_t r = 0; r < c->nregs; r++) {
		reg_conn *g = &c->regs[r];
		size_t m = 0;
		for (size_t i = 0; i < n; i++)
			m += !items[i].found;
		if (m == 0)
			break;
		if (!regc_usable(g, now) && r != probe) {
			last = ecx_why(why, whylen, ECX_ECONNECT,
			               "registry %s is down (retrying later)",
			               g->url);
			continue;
		}
		ecx_lookup_item *ask = items;
		if (m < n) {
			if (miss == NULL) {
				miss = malloc(n * sizeof(*miss));
				where = malloc(n * sizeof(*where));
			}
			if (miss == NULL || where == NULL) {
				last = ecx_why(why, whylen, ECX_ENOMEM,
				               "out of memory");
				break;
			}
			m = 0;
			for (size_t i = 0; i < n; i++) {
				if (!items[i].found) {
					miss[m] = items[i];
					where[m++] = i;
				}
			}
			ask = miss;
		}
		asked++;
		int rc =
		    g->redis != NULL
		        ? g->redis->ops->mget(g->redis, ask, m, why, whylen)
		    : m == 1 && !all_holders
		        ? reg_lookup_one(c, g, ask, lease_ms, why, whylen)
		        : reg_lookup_many(c, g, ask, m, lease_ms, why, whylen);
		if (rc == 0 && g->redis != NULL && all_holders)
			rc = ecx_store_redis_holders(g->redis, ask, m, why,
			                             whylen);
		regc_mark(g, rc);
		if (rc != 0) {
			ecx_lookup_items_clear(ask, m);
			for (size_t k = 0; k < m; k++)
				ask[k].found = false;
			last = rc;
			continue;
		}
		for (size_t k = 0; k < m; k++) {
			/* Only a leased lookup's answer over HTTP carries a
			 * lease. */
			if (g->redis != NULL || lease_ms == 0)
				ask[k].entry.lease = 0;
			if (ask == miss && miss[k].found)
				items[where[k]] = miss[k];
		}
	}
	free(miss);
	free(where);
	/* Every registry that was asked answered: a plain miss is no error. */
	bool all_found = true;
	for (size_t i = 0; i < n; i++)
		all_found = all_found && items[i].found;
	return all_found ? 0 : last;
}
