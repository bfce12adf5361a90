/*
 * client.c - the public registry client (ecx_client_*): a directory
 * client (dir/) and, for leases, a leaser (rdv/), its lookups through
 * the consumer's path (lookup.c); and the public entry JSON codecs.
 * Failures are reported once, here, through the calling thread's last
 * error.
 */
#include "api/api.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ecx_client {
	int pid; /* the creating process: calls from another are refused */
	ecx_regclient *rc;
	/* leases (rdv/lease.c): the producers' ZeroMQ sockets */
	ecx_rdv_leaser *leaser;
	char *token;
	int timeout_ms;
	int ttl_s; /* the lease its publishes ask for (0: the registry's) */
};

int ecx_client_create(const ecx_client_params *params, ecx_client **out,
                      char *why, size_t whylen)
{
	char w[256] = "";
	if (params == NULL || out == NULL ||
	    !(params->field_mask & ECX_CLIENT_PARAM_REGISTRY) ||
	    params->registry == NULL || params->registry[0] == '\0') {
		ecx_why(why, whylen, ECX_EINVAL, "no registry URL given");
		return ecx_set_error(ECX_EINVAL, "no registry URL given");
	}
	uint64_t m = params->field_mask;
	ecx_regclient_opts o = {
	    .urls = params->registry,
	    .token = m & ECX_CLIENT_PARAM_TOKEN ? params->token : NULL,
	    .timeout_ms = m & ECX_CLIENT_PARAM_TIMEOUT ? params->timeout_ms : 0,
	    .connect_timeout_ms = m & ECX_CLIENT_PARAM_CONNECT_TIMEOUT
	                              ? params->connect_timeout_ms
	                              : 0,
	    .ttl_s =
	        m & ECX_CLIENT_PARAM_REGISTRY_TTL ? params->registry_ttl_s : 0,
	    /* 0 asks for the default there; here it asks for none */
	    .spin_us = !(m & ECX_CLIENT_PARAM_SPIN) ? 0
	               : params->spin_us == 0       ? ECX_REGC_SPIN_NONE
	                                            : params->spin_us};
	if (o.timeout_ms < 0 || o.connect_timeout_ms < 0 || o.ttl_s < 0) {
		ecx_why(why, whylen, ECX_EINVAL,
		        "timeouts and the TTL cannot be negative");
		return ecx_set_error(ECX_EINVAL,
		                     "timeouts and the TTL cannot be negative");
	}
	if ((m & ECX_CLIENT_PARAM_SPIN) &&
	    (params->spin_us < 0 || params->spin_us > ECX_REGC_SPIN_MAX)) {
		ecx_why(why, whylen, ECX_EINVAL,
		        "the spin is 0 to %d us, not %d", ECX_REGC_SPIN_MAX,
		        params->spin_us);
		return ecx_set_error(ECX_EINVAL,
		                     "the spin is 0 to %d us, not %d",
		                     ECX_REGC_SPIN_MAX, params->spin_us);
	}
	ecx_client *c = calloc(1, sizeof(*c));
	if (c != NULL)
		c->pid = (int)getpid();
	if (c == NULL) {
		ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	}
	if (o.ttl_s > ECX_TTL_MAX_S) {
		free(c);
		ecx_why(why, whylen, ECX_EINVAL, "the TTL is at most %d s",
		        ECX_TTL_MAX_S);
		return ecx_set_error(ECX_EINVAL, "the TTL is at most %d s",
		                     ECX_TTL_MAX_S);
	}
	c->ttl_s = o.ttl_s;
	c->leaser = ecx_rdv_leaser_create();
	c->token = o.token != NULL ? strdup(o.token) : NULL;
	c->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : 5000;
	int rc = c->leaser == NULL || (o.token != NULL && c->token == NULL)
	             ? ECX_ENOMEM
	             : ecx_regclient_create(&o, &c->rc, w, sizeof(w));
	if (rc == ECX_ENOMEM && c->rc == NULL)
		ecx_strlcpy(w, "out of memory", sizeof(w));
	if (rc != 0) {
		ecx_rdv_leaser_destroy(c->leaser);
		free(c->token);
		free(c);
		ecx_why(why, whylen, rc, "%s", w);
		return ecx_set_error(rc, "%s", w);
	}
	*out = c;
	return 0;
}

void ecx_client_destroy(ecx_client *c)
{
	/* In a forked child: the parent's state, left as it is (leaked). */
	if (c != NULL && ecx_forked(c->pid, "client"))
		return;
	if (c == NULL)
		return;
	ecx_regclient_destroy(c->rc);
	ecx_rdv_leaser_destroy(c->leaser);
	free(c->token);
	free(c);
}

/* What lookup.c asks through. */
static api_lookup client_lookup(const ecx_client *c)
{
	return (api_lookup){.rc = c->rc,
	                    .rc_lock = NULL,
	                    .leaser = c->leaser,
	                    .token = c->token,
	                    .timeout_ms = c->timeout_ms};
}

int ecx_client_lookup(ecx_client *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	int rc = api_lookup_check(c, "client", items, n, 0);
	if (rc != 0)
		return rc;
	api_lookup lk = client_lookup(c);
	size_t asked;
	return api_lookup_run(&lk, items, n, 0, &asked);
}

int ecx_client_lookup_lease(ecx_client *c, ecx_item *items, size_t n,
                            int lease_ms)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	int rc = api_lookup_check(c, "client", items, n, lease_ms);
	if (rc != 0)
		return rc;
	uint64_t ms = lease_ms > 0 ? (uint64_t)lease_ms : ECX_LEASE_MS_DEFAULT;
	api_lookup lk = client_lookup(c);
	size_t asked;
	return api_lookup_run(&lk, items, n, ms, &asked);
}

int ecx_client_release(ecx_client *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	int rc = api_lookup_check(c, "client", items, n, 0);
	if (rc != 0)
		return rc;
	api_lookup lk = client_lookup(c);
	return api_release(&lk, items, n);
}

/* The registry entry of item, checked as a producer would publish it. */
static int entry_of_item(const ecx_item *item, ecx_entry *e, char *why,
                         size_t whylen)
{
	memset(e, 0, sizeof(*e));
	if (item == NULL)
		return ecx_why(why, whylen, ECX_EINVAL, "no item");
	size_t pl = strnlen(item->producer, sizeof(item->producer));
	if (pl == 0 || pl == sizeof(item->producer))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "item's producer is empty or not terminated");
	int rc = core_tensor_check(&item->desc, why, whylen);
	if (rc != 0)
		return rc;
	e->desc = item->desc;
	memcpy(e->producer_zmq, item->producer, pl + 1);
	e->epoch = ecx_item_entry_epoch(item->epoch);
	return 0;
}

int ecx_client_publish(ecx_client *c, const ecx_item *item)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	char why[256] = "";
	ecx_entry e;
	if (c == NULL)
		return ecx_set_error(ECX_EINVAL, "no client");
	if (item == NULL || item->id == NULL)
		return ecx_set_error(ECX_EID, "no id");
	if (core_id_check(item->id, why, sizeof(why)) != 0)
		return ecx_set_error(ECX_EID, "publish '%.80s': %s", item->id,
		                     why);
	int rc = entry_of_item(item, &e, why, sizeof(why));
	e.ttl_s = (uint32_t)c->ttl_s; /* 0: the registry's lease */
	if (rc == 0)
		rc = ecx_regclient_put(c->rc, item->id, &e, why, sizeof(why));
	return rc != 0 ? ecx_set_error(rc, "publish %s: %s", item->id, why) : 0;
}

int ecx_client_remove(ecx_client *c, const char *id, const char *producer)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	char why[256] = "";
	if (c == NULL)
		return ecx_set_error(ECX_EINVAL, "no client");
	if (id == NULL)
		return ecx_set_error(ECX_EID, "no id");
	int rc = ecx_regclient_delete(c->rc, id, producer, why, sizeof(why));
	return rc != 0 ? ecx_set_error(rc, "remove %s: %s", id, why) : 0;
}

int ecx_client_list(ecx_client *c, const char *after, size_t limit,
                    ecx_list_fn fn, void *arg, char *next, size_t nextlen,
                    uint64_t *total)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	if (c == NULL || fn == NULL || next == NULL || nextlen == 0)
		return ecx_set_error(ECX_EINVAL,
		                     "list needs a client, a callback and room "
		                     "for the next id");
	if (limit < 1 || limit > ECX_LIST_MAX)
		return ecx_set_error(
		    ECX_EINVAL, "a listing page is 1 to %d entries, not %zu",
		    ECX_LIST_MAX, limit);
	ecx_store_row *rows = calloc(limit, sizeof(*rows));
	if (rows == NULL)
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	char why[256] = "", nx[ECX_ID_MAX + 1] = "";
	size_t n = 0;
	uint64_t tot = 0;
	int rc = ecx_regclient_list(c->rc, after, limit, rows, &n, nx,
	                            sizeof(nx), &tot, why, sizeof(why));
	if (rc != 0) {
		free(rows);
		return ecx_set_error(rc, "%s", why);
	}
	for (size_t i = 0; i < n; i++) {
		ecx_item it = {.id = rows[i].id,
		               .desc = rows[i].entry.desc,
		               .epoch = ecx_entry_item_epoch(&rows[i].entry)};
		ecx_strlcpy(it.producer, rows[i].entry.producer_zmq,
		            sizeof(it.producer));
		rc = fn(arg, &it);
		if (rc != 0) {
			free(rows);
			return rc;
		}
	}
	free(rows);
	if (strlen(nx) >= nextlen)
		return ecx_set_error(ECX_EINVAL,
		                     "next id needs %zu bytes, %zu given",
		                     strlen(nx) + 1, nextlen);
	ecx_strlcpy(next, nx, nextlen);
	if (total != NULL)
		*total = tot;
	return 0;
}

int ecx_client_health(ecx_client *c, uint64_t *epoch)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return ECX_EFORK;
	if (c == NULL)
		return ecx_set_error(ECX_EINVAL, "no client");
	char why[256] = "";
	uint64_t e = 0;
	int rc = ecx_regclient_health(c->rc, &e, why, sizeof(why));
	if (rc != 0)
		return ecx_set_error(rc, "%s", why);
	if (epoch != NULL)
		*epoch = e;
	return 0;
}

long ecx_client_connections(const ecx_client *c)
{
	if (c != NULL && ecx_forked(c->pid, "client"))
		return 0;
	return c != NULL ? ecx_regclient_connects(c->rc) : 0;
}

char *ecx_item_to_json(const ecx_item *item)
{
	char why[256] = "";
	ecx_entry e;
	int rc = entry_of_item(item, &e, why, sizeof(why));
	if (rc != 0) {
		ecx_set_error(rc, "%s", why);
		return NULL;
	}
	char *s = ecx_entry_encode(&e);
	if (s == NULL)
		ecx_set_error(ECX_ENOMEM, "out of memory");
	return s;
}

int ecx_item_from_json(const char *json, size_t len, ecx_item *item, char *why,
                       size_t whylen)
{
	char w[256] = "";
	ecx_entry e;
	if (json == NULL || item == NULL) {
		ecx_why(why, whylen, ECX_EINVAL, "no entry or no item");
		return ecx_set_error(ECX_EINVAL, "no entry or no item");
	}
	if (ecx_entry_decode(json, len, &e, w, sizeof(w)) != 0) {
		ecx_why(why, whylen, ECX_EPROTO, "%s", w);
		return ecx_set_error(ECX_EPROTO, "%s", w);
	}
	item->desc = e.desc;
	ecx_strlcpy(item->producer, e.producer_zmq, sizeof(item->producer));
	item->epoch = ecx_entry_item_epoch(&e);
	return 0;
}
