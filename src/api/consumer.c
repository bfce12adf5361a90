/*
 * consumer.c - the public entry points of a consumer's lookups and loads
 * (ecx_consumer_lookup, _lookup_lease, _release, _load_start, _load,
 * _load_notify, ecx_load_test, ecx_load_wait): the checks of the arguments and
 * of the handle's process, then one call into the consumer role
 * (consumer/load.c, consumer/failover.c, consumer/notify.c), which reports its
 * failures through the calling thread's last error.
 */
#include "consumer/consumer.h"

int ecx_consumer_lookup(ecx_consumer *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	if (c == NULL || (items == NULL && n > 0))
		return ecx_set_error(ECX_EINVAL, "no consumer or no items");
	return cons_lookup(c, items, n, 0);
}

int ecx_consumer_lookup_lease(ecx_consumer *c, ecx_item *items, size_t n,
                              int lease_ms)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	if (c == NULL || (items == NULL && n > 0))
		return ecx_set_error(ECX_EINVAL, "no consumer or no items");
	if (lease_ms < 0)
		return ecx_set_error(ECX_EINVAL, "lease_ms cannot be negative");
	uint64_t ms = lease_ms > 0 ? (uint64_t)lease_ms : ECX_LEASE_MS_DEFAULT;
	return cons_lookup_lease(c, items, n, ms);
}

int ecx_consumer_release(ecx_consumer *c, ecx_item *items, size_t n)
{
	if (c != NULL && ecx_forked(c->pid, "consumer"))
		return ECX_EFORK;
	if (c == NULL || (items == NULL && n > 0))
		return ecx_set_error(ECX_EINVAL, "no consumer or no items");
	return cons_release(c, items, n);
}

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
