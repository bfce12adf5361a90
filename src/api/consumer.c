/*
 * consumer.c - the public entry points of a consumer (ecx_consumer_*,
 * ecx_load_test, ecx_load_wait): the checks of the arguments and of the
 * handle's process, then one call into the consumer role (consumer/
 * consumer.c, load.c, failover.c, notify.c, memory.c, push.c) or, for
 * lookups and leases, into the path it shares with ecx_client_*
 * (lookup.c); each reports its failures through the calling thread's last
 * error.
 */
#include "consumer/consumer.h"
#include "api/api.h"

#include <string.h>

int ecx_consumer_create(const ecx_consumer_params *params, ecx_consumer **out,
                        char *why, size_t whylen)
{
	return cons_create(params, out, why, whylen);
}

void ecx_consumer_destroy(ecx_consumer *c)
{
	/* In a forked child: the parent's state, left as it is (leaked). */
	if (c == NULL || ecx_forked(c->pid, "consumer"))
		return;
	cons_destroy(c);
}

void ecx_consumer_stats_get(ecx_consumer *c, ecx_consumer_stats *out)
{
	if (c != NULL && ecx_forked(c->pid, "consumer")) {
		memset(out, 0, sizeof(*out));
		return;
	}
	cons_stats_get(c, out);
}

const char *ecx_consumer_last_error(void)
{
	return core_last_error();
}

/* ---- lookups and leases ---- */

/* A lookup through lookup.c, on a consumer that has a registry; the ids
 * asked are counted in its stats. */
static int lookup(ecx_consumer *c, ecx_item *items, size_t n, uint64_t lease_ms)
{
	if (n == 0)
		return 0;
	if (c->rc == NULL) {
		for (size_t i = 0; i < n; i++)
			items[i].status = ECX_EINVAL;
		return ecx_set_error(ECX_EINVAL,
		                     "this consumer has no registry "
		                     "(created without one: push "
		                     "only), so it cannot look up");
	}
	api_lookup lk = {.rc = c->rc,
	                 .rc_lock = &c->reg_lock,
	                 .leaser = c->leaser,
	                 .token = c->token,
	                 .timeout_ms = c->timeout_ms};
	size_t asked = 0;
	int rc = api_lookup_run(&lk, items, n, lease_ms, &asked);
	if (asked > 0)
		cons_lookups_count(c, asked);
	return rc;
}

int ecx_consumer_lookup(ecx_consumer *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	int rc = api_lookup_check(c, "consumer", items, n, 0);
	return rc != 0 ? rc : lookup(c, items, n, 0);
}

int ecx_consumer_lookup_lease(ecx_consumer *c, ecx_item *items, size_t n,
                              int lease_ms)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	int rc = api_lookup_check(c, "consumer", items, n, lease_ms);
	if (rc != 0)
		return rc;
	uint64_t ms = lease_ms > 0 ? (uint64_t)lease_ms : ECX_LEASE_MS_DEFAULT;
	return lookup(c, items, n, ms);
}

int ecx_consumer_release(ecx_consumer *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	int rc = api_lookup_check(c, "consumer", items, n, 0);
	if (rc != 0)
		return rc;
	api_lookup lk = {.leaser = c->leaser,
	                 .token = c->token,
	                 .timeout_ms = c->timeout_ms};
	return api_release(&lk, items, n);
}

/* ---- loads ---- */

int ecx_consumer_load_start(ecx_consumer *c, ecx_item *items, size_t n,
                            ecx_load **out)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	return cons_load_start(
	    c, items, n, ecx_now_ns() + (uint64_t)c->timeout_ms * 1000000u,
	    false, false, out);
}

int ecx_consumer_load_notify(ecx_consumer *c, ecx_item *items, size_t n, int fd,
                             const void *msg, size_t len, ecx_load **out)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	if (c == NULL || out == NULL || (items == NULL && n > 0) ||
	    (msg == NULL && len > 0))
		return ecx_set_error(ECX_EINVAL,
		                     "no consumer, items, message or out");
	return cons_load_notify(
	    c, items, n, ecx_now_ns() + (uint64_t)c->timeout_ms * 1000000u, fd,
	    msg, len, out);
}

int ecx_load_test(ecx_load *l)
{
	if (l != NULL && ecx_forked(l->c->pid, "consumer"))
		return ECX_EFORK;
	return l->bg != NULL ? cons_bg_test(l) : cons_load_test(l);
}

int ecx_load_wait(ecx_load *l)
{
	if (l != NULL && ecx_forked(l->c->pid, "consumer"))
		return ECX_EFORK;
	return l->bg != NULL ? cons_bg_wait(l) : cons_load_wait(l);
}

int ecx_consumer_load(ecx_consumer *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	ecx_load *l;
	int rc = cons_load_start(
	    c, items, n, ecx_now_ns() + (uint64_t)c->timeout_ms * 1000000u,
	    false, true, &l);
	return rc != 0 ? rc : cons_load_wait(l);
}

/* ---- memory: the receive arena ---- */

void *ecx_consumer_arena(ecx_consumer *c, uint64_t *capacity)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return NULL;
	return cons_arena(c, capacity);
}

void *ecx_consumer_alloc(ecx_consumer *c, size_t nbytes)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return NULL;
	return cons_alloc(c, nbytes);
}

void ecx_consumer_free(ecx_consumer *c, void *ptr)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return;
	if (c == NULL || ptr == NULL)
		return;
	cons_free(c, ptr);
}

/* ---- push windows ---- */

int ecx_consumer_mooncake_session(ecx_consumer *c, const char **session)
{
	if (c == NULL || session == NULL)
		return ecx_set_error(ECX_EINVAL,
		                     "mooncake_session needs a consumer and a "
		                     "place for the session");
	*session = NULL;
	if (ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	return cons_mc_session(c, session);
}

static int push_open(ecx_consumer *c, const void *dst, uint64_t nbytes,
                     uint64_t timeout_ms, bool hashed, uint64_t *id)
{
	if (c == NULL || dst == NULL || id == NULL || nbytes == 0)
		return ecx_set_error(ECX_EINVAL,
		                     "push_open%s needs a consumer, a "
		                     "destination, nbytes > 0 and a place for "
		                     "the id",
		                     hashed ? "" : "_unhashed");
	if (ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	*id = 0;
	return cons_push_open(c, dst, nbytes, timeout_ms, hashed, id);
}

int ecx_consumer_push_open(ecx_consumer *c, const void *dst, uint64_t nbytes,
                           uint64_t timeout_ms, uint64_t *id)
{
	return push_open(c, dst, nbytes, timeout_ms, true, id);
}

int ecx_consumer_push_open_unhashed(ecx_consumer *c, const void *dst,
                                    uint64_t nbytes, uint64_t timeout_ms,
                                    uint64_t *id)
{
	return push_open(c, dst, nbytes, timeout_ms, false, id);
}

int ecx_consumer_push_renew(ecx_consumer *c, uint64_t id, uint64_t timeout_ms)
{
	if (c == NULL || id == 0)
		return ecx_set_error(ECX_EINVAL, "push_renew needs a consumer "
		                                 "and an open window's id");
	return cons_push_renew(c, id, timeout_ms);
}

int ecx_consumer_push_close_hashed(ecx_consumer *c, uint64_t id,
                                   uint64_t *landed, uint64_t *xxh3,
                                   int *hashed)
{
	if (landed != NULL)
		*landed = 0;
	if (hashed != NULL)
		*hashed = 0;
	if (c == NULL || id == 0)
		return ecx_set_error(ECX_EINVAL, "push_close needs a consumer "
		                                 "and an open window's id");
	uint64_t h = 0;
	bool whole = false;
	uint64_t n = cons_push_close(c, id, &h, &whole);
	if (landed != NULL)
		*landed = n;
	if (whole && hashed != NULL && xxh3 != NULL) {
		*xxh3 = h;
		*hashed = 1;
	}
	return 0;
}

int ecx_consumer_push_close(ecx_consumer *c, uint64_t id, uint64_t *landed)
{
	return ecx_consumer_push_close_hashed(c, id, landed, NULL, NULL);
}
