/*
 * lease.c - leases: a lookup asks the producer to pin ids for a while, so
 * that eviction cannot take them before the pull that follows ("a hit will
 * load"). A lease ends at the first of: the pull that names it, a release,
 * its expiry, the item's removal. Leased items take at most lease_cap bytes
 * of the arena (counted once per item however many leases it has), so a
 * put always has the rest; a lease beyond it is refused, never queued.
 * The producer's own process leases too (ecx_producer_lease): an ecx
 * encoder holds an item it sent in a push-mode ecx_fetch for the pull.
 */
#include "producer/producer.h"

#include <stdlib.h>
#include <string.h>

#define MOD "producer"

static size_t lbucket(uint64_t num)
{
	return (size_t)((num * 0x9E3779B97F4A7C15ull) >> 52) &
	       (LEASE_BUCKETS - 1);
}

static lease *lease_find(ecx_producer *p, uint64_t num)
{
	for (lease *l = p->lbuckets[lbucket(num)]; l != NULL; l = l->hnext)
		if (l->num == num)
			return l;
	return NULL;
}

/* A new lease number: random below 2^53 (so JSON carries it exactly), not
 * 0, not in use. Random, so a number from before a restart, or another
 * consumer's, is unlikely to name a live lease; a pull's lease is checked
 * against its item anyway. */
static uint64_t lease_number(ecx_producer *p)
{
	for (;;) {
		uint64_t x = p->lease_rng += 0x9E3779B97F4A7C15ull;
		x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
		x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
		x = (x ^ (x >> 31)) & (ECX_JSON_INT_MAX - 1);
		if (x != 0 && lease_find(p, x) == NULL)
			return x;
	}
}

static void lease_end(ecx_producer *p, lease *l)
{
	lease **pp = &p->lbuckets[lbucket(l->num)];
	while (*pp != l)
		pp = &(*pp)->hnext;
	*pp = l->hnext;
	if (l->prev)
		l->prev->next = l->next;
	else
		p->lhead = l->next;
	if (l->next)
		l->next->prev = l->prev;
	else
		p->ltail = l->prev;
	if (--l->it->leases == 0)
		p->st.leased_bytes -= ecx_alloc_size(l->it->desc.nbytes);
	p->st.leases--;
	free(l);
}

void prod_leases_expire(ecx_producer *p)
{
	uint64_t now = ecx_now_ns();
	while (p->lhead != NULL && p->lhead->expires_ns <= now) {
		lease_end(p, p->lhead);
		p->st.leases_expired++;
	}
}

bool prod_lease_use(ecx_producer *p, uint64_t num, item *it)
{
	lease *l = lease_find(p, num);
	if (l == NULL || l->it != it)
		return false;
	lease_end(p, l);
	p->st.leases_used++;
	return true;
}

void prod_leases_drop_item(ecx_producer *p, item *it)
{
	for (lease *l = p->lhead; l != NULL && it->leases > 0;) {
		lease *next = l->next;
		if (l->it == it) {
			lease_end(p, l);
			p->st.leases_released++;
		}
		l = next;
	}
}

void prod_leases_clear(ecx_producer *p)
{
	while (p->lhead != NULL)
		lease_end(p, p->lhead);
}

/* Takes a lease of ms on id into *num. ECX_ENOTFOUND when not held,
 * ECX_ENOSPC when it would take the leased bytes past their cap, ECX_EBUSY
 * when MAX_LEASES are held. */
static int lease_take(ecx_producer *p, const char *id, uint64_t ms,
                      uint64_t *num)
{
	item *it = prod_item_find(p, id);
	if (it == NULL || !it->ready)
		return ECX_ENOTFOUND;
	uint64_t size = ecx_alloc_size(it->desc.nbytes);
	if (it->leases == 0 && p->st.leased_bytes + size > p->lease_cap)
		return ECX_ENOSPC;
	if (p->st.leases >= MAX_LEASES)
		return ECX_EBUSY;
	lease *l = calloc(1, sizeof(*l));
	if (l == NULL)
		return ECX_ENOMEM;
	l->num = lease_number(p);
	l->it = it;
	l->expires_ns = ecx_now_ns() + ms * 1000000u;
	size_t b = lbucket(l->num);
	l->hnext = p->lbuckets[b];
	p->lbuckets[b] = l;
	/* Into the expiry list, from the tail. */
	lease *after = p->ltail;
	while (after != NULL && after->expires_ns > l->expires_ns)
		after = after->prev;
	l->prev = after;
	l->next = after != NULL ? after->next : p->lhead;
	if (l->next != NULL)
		l->next->prev = l;
	else
		p->ltail = l;
	if (after != NULL)
		after->next = l;
	else
		p->lhead = l;
	if (it->leases++ == 0)
		p->st.leased_bytes += size;
	p->st.leases++;
	/* Leased: the most recently wanted. */
	prod_item_touch(p, it);
	*num = l->num;
	return 0;
}

void prod_lease_lookup(void *arg, ecx_lookup_item *items, size_t n, uint64_t ms)
{
	ecx_producer *p = arg;
	if (ms > p->lease_max_ms)
		ms = p->lease_max_ms;
	uint64_t granted = 0, refused = 0;
	pthread_mutex_lock(&p->lock);
	if (p->closing) {
		pthread_mutex_unlock(&p->lock);
		return;
	}
	prod_leases_expire(p);
	for (size_t i = 0; i < n; i++) {
		ecx_lookup_item *x = &items[i];
		/* Another producer's entry is leased at that producer. */
		if (!x->found || x->entry.epoch != p->epoch ||
		    strcmp(x->entry.producer_zmq, p->address) != 0)
			continue;
		uint64_t num = 0;
		int rc = lease_take(p, x->id, ms, &num);
		if (rc == 0) {
			x->entry.lease = num;
			granted++;
			continue;
		}
		/* Refused (or no longer held): a miss, as at the rendezvous. */
		x->found = false;
		refused += rc != ECX_ENOTFOUND;
	}
	p->st.leases_granted += granted;
	p->st.leases_refused += refused;
	pthread_mutex_unlock(&p->lock);
}

char *prod_lease_answer(ecx_producer *p, const ecx_zreq *r)
{
	size_t n = r->ids.n;
	uint64_t *nums = calloc(n + 1, sizeof(*nums));
	int *errs = calloc(n + 1, sizeof(*errs));
	if (nums == NULL || errs == NULL) {
		free(nums);
		free(errs);
		return ecx_zresp_encode_error(ECX_ENOMEM, NULL);
	}
	uint64_t ms = r->lease_ms == 0 || r->lease_ms > p->lease_max_ms
	                  ? p->lease_max_ms
	                  : r->lease_ms;
	uint64_t granted = 0, refused = 0;
	pthread_mutex_lock(&p->lock);
	prod_leases_expire(p);
	for (size_t i = 0; i < n; i++) {
		errs[i] = lease_take(p, r->ids.ids[i], ms, &nums[i]);
		if (errs[i] == 0)
			granted++;
		else if (errs[i] != ECX_ENOTFOUND)
			refused++;
	}
	p->st.leases_granted += granted;
	p->st.leases_refused += refused;
	pthread_mutex_unlock(&p->lock);
	ecx_debug(MOD, "lease of %zu ids for %llu ms: %llu granted", n,
	          (unsigned long long)ms, (unsigned long long)granted);
	char *out = ecx_zresp_encode_lease(p->epoch, ms, nums, errs, n);
	free(nums);
	free(errs);
	return out;
}

int prod_lease_own(ecx_producer *p, const char *id, int ms, uint64_t *num)
{
	uint64_t t = ms == 0 || (uint64_t)ms > p->lease_max_ms ? p->lease_max_ms
	                                                       : (uint64_t)ms;
	pthread_mutex_lock(&p->lock);
	prod_leases_expire(p);
	int rc = lease_take(p, id, t, num);
	if (rc == 0)
		p->st.leases_granted++;
	else if (rc != ECX_ENOTFOUND)
		p->st.leases_refused++;
	pthread_mutex_unlock(&p->lock);
	if (rc == 0)
		return 0;
	return ecx_set_error(rc, "lease of %s: %s", id,
	                     rc == ECX_ENOTFOUND ? "not held"
	                     : rc == ECX_ENOSPC  ? "the lease share of the "
	                                           "arena is taken"
	                     : rc == ECX_EBUSY   ? "too many leases are held"
	                                         : "no memory");
}

bool prod_lease_end_own(ecx_producer *p, uint64_t num)
{
	pthread_mutex_lock(&p->lock);
	lease *l = lease_find(p, num);
	bool held = l != NULL;
	if (held) {
		lease_end(p, l);
		p->st.leases_released++;
	}
	prod_leases_expire(p);
	pthread_mutex_unlock(&p->lock);
	return held;
}

char *prod_release_answer(ecx_producer *p, const ecx_zreq *r)
{
	uint64_t released = 0;
	pthread_mutex_lock(&p->lock);
	for (size_t i = 0; i < r->nleases; i++) {
		lease *l = lease_find(p, r->leases[i]);
		if (l != NULL) {
			lease_end(p, l);
			released++;
		}
	}
	p->st.leases_released += released;
	prod_leases_expire(p);
	pthread_mutex_unlock(&p->lock);
	return ecx_zresp_encode_release(released);
}
