/*
 * push.c - bytes pushed into this consumer's receive arena over Mooncake's
 * TCP wire, as upstream vLLM's push mode has its encoder write them: the
 * receiver's session, and a window per reservation in which a writer may
 * land bytes into exactly that reservation's range, before its deadline.
 * The control protocol (which reservation, when) is the caller's; this
 * file only opens and closes the receiver's windows (mooncake/receiver.h)
 * over memory ecx_consumer_alloc handed out. A window opened hashed has
 * its bytes hashed as they land (XXH3, the receiver's thread), so a caller
 * that checks a writer's hash need not read the bytes again where they
 * came in order.
 */
#include "consumer/consumer.h"

#include <stdint.h>

/* Whether [p, p + n) lies inside one allocation of the receive arena.
 * Called with c->lock. */
static bool in_allocation(const ecx_consumer *c, uintptr_t p, uint64_t n)
{
	uintptr_t base = (uintptr_t)c->arena_base;
	if (!c->arena.live || p < base)
		return false;
	uint64_t off = (uint64_t)(p - base);
	for (size_t i = 0; i < c->nallocs; i++) {
		const arena_alloc *a = &c->allocs[i];
		if (off >= a->off && off - a->off <= a->size &&
		    n <= a->size - (off - a->off))
			return true;
	}
	return false;
}

/* Starts the receiver under the lock; 0 or the error, set. */
static int receiver(ecx_consumer *c)
{
	if (c->mc_mode == CONS_MC_OFF)
		return ecx_set_error(ECX_EUNSUPPORTED,
		                     "this consumer was created with the "
		                     "Mooncake wire off (mooncake=off)");
	char why[256];
	int rc = cons_mc_ensure(c, why, sizeof(why));
	if (rc != 0)
		return ecx_set_error(rc, "Mooncake receiver: %s", why);
	return 0;
}

int cons_mc_session(ecx_consumer *c, const char **session)
{
	pthread_mutex_lock(&c->lock);
	int rc = receiver(c);
	if (rc == 0)
		*session = ecx_mc_recv_session(c->mc);
	pthread_mutex_unlock(&c->lock);
	return rc;
}

static uint64_t expiry(uint64_t timeout_ms)
{
	uint64_t now = ecx_now_ns();
	uint64_t max = (UINT64_MAX - now) / 1000000u;
	return now + (timeout_ms < max ? timeout_ms : max) * 1000000u;
}

int cons_push_open(ecx_consumer *c, const void *dst, uint64_t nbytes,
                   uint64_t timeout_ms, bool hashed, uint64_t *id)
{
	pthread_mutex_lock(&c->lock);
	int rc = receiver(c);
	if (rc == 0 && !in_allocation(c, (uintptr_t)dst, nbytes))
		rc =
		    ecx_set_error(ECX_EINVAL,
		                  "[%p, +%llu) is not inside one allocation of "
		                  "the receive arena (ecx_consumer_alloc)",
		                  dst, (unsigned long long)nbytes);
	if (rc == 0) {
		uint64_t at = (uint64_t)(uintptr_t)dst;
		*id = hashed ? ecx_mc_recv_reserve_hashed(c->mc, at, nbytes,
		                                          expiry(timeout_ms))
		             : ecx_mc_recv_reserve(c->mc, at, nbytes,
		                                   expiry(timeout_ms));
		if (*id == 0)
			rc = ecx_set_error(ECX_ENOMEM, "out of memory");
	}
	pthread_mutex_unlock(&c->lock);
	return rc;
}

int cons_push_renew(ecx_consumer *c, uint64_t id, uint64_t timeout_ms)
{
	pthread_mutex_lock(&c->lock);
	bool found =
	    c->mc != NULL && ecx_mc_recv_extend(c->mc, id, expiry(timeout_ms));
	pthread_mutex_unlock(&c->lock);
	return found ? 0
	             : ecx_set_error(ECX_ENOTFOUND, "no open push window %llu",
	                             (unsigned long long)id);
}

uint64_t cons_push_close(ecx_consumer *c, uint64_t id, uint64_t *xxh3,
                         bool *whole)
{
	pthread_mutex_lock(&c->lock);
	ecx_mc_recv *r = c->mc;
	pthread_mutex_unlock(&c->lock);
	/* The receiver lives as long as the consumer; release takes its own
	 * lock and waits at most for one recv into the range. */
	*whole = false;
	return r != NULL ? ecx_mc_recv_release_hashed(r, id, xxh3, whole) : 0;
}
