/*
 * memory.c - where loads land: the receive arena (registered once, handed
 * out by ecx_consumer_alloc) and a bounded cache of registrations of the
 * caller's own memory, invalidated by UCX's unmap events; the Mooncake
 * receiver's buffers (where a WRITE may land) follow these regions.
 */
#define _GNU_SOURCE /* process_vm_readv, process_vm_writev */
#include "consumer/consumer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#define MOD "consumer"

/* ---- memory ---- */

void cons_on_unmap(ucm_event_type_t type, ucm_event_t *ev, void *arg)
{
	(void)type;
	regcache *q = arg;
	uint64_t a = (uint64_t)(uintptr_t)ev->vm_unmapped.address;
	uint64_t e = a + ev->vm_unmapped.size;
	/* Runs inside munmap of any thread, maybe under our lock: atomics
	 * only. */
	unsigned n = __atomic_load_n(&q->n, __ATOMIC_ACQUIRE);
	for (unsigned i = 0; i < n; i++) {
		region *r = &q->r[i];
		uint64_t b = __atomic_load_n(&r->base, __ATOMIC_ACQUIRE);
		uint64_t l = __atomic_load_n(&r->len, __ATOMIC_ACQUIRE);
		if (l != 0 && b < e && a < b + l)
			__atomic_store_n(&r->stale, 1, __ATOMIC_RELEASE);
	}
}

void cons_mc_region(ecx_consumer *c, const region *r, bool add)
{
	if (c->mc == NULL)
		return;
	if (add)
		(void)ecx_mc_recv_buffer_add(c->mc, r->base, r->len);
	else
		ecx_mc_recv_buffer_remove(c->mc, r->base);
}

void cons_region_drop(ecx_consumer *c, region *r)
{
	cons_mc_region(c, r, false);
	ecx_ucx_mem_unmap(c->ucx, r->memh);
	free(r->rkey);
	__atomic_store_n(&r->len, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&r->base, 0, __ATOMIC_RELEASE);
	r->memh = NULL;
	r->rkey = NULL;
	r->live = false;
	__atomic_store_n(&r->stale, 0, __ATOMIC_RELEASE);
}

/* The region that covers [p, p + n): the arena, a cached registration, or
 * a new one of [span_lo, span_hi) (the run of this pull's items that
 * touch each other, so one buffer holding many items is registered once).
 * Called with the lock; pins the region (inuse). */
region *cons_region_for(ecx_consumer *c, void *ptr, uint64_t n,
                        uint64_t span_lo, uint64_t span_hi, int *err)
{
	uint64_t a = (uint64_t)(uintptr_t)ptr;
	if (c->arena.live && a >= c->arena.base &&
	    a + n <= c->arena.base + c->arena.len) {
		c->arena.inuse++;
		return &c->arena;
	}
	region *free_slot = NULL, *lru = NULL;
	for (unsigned i = 0; i < c->rcache->n; i++) {
		region *r = &c->rcache->r[i];
		if (r->live && __atomic_load_n(&r->stale, __ATOMIC_ACQUIRE) &&
		    r->inuse == 0)
			cons_region_drop(c, r);
		if (!r->live) {
			if (free_slot == NULL)
				free_slot = r;
			continue;
		}
		if (!__atomic_load_n(&r->stale, __ATOMIC_ACQUIRE) &&
		    a >= r->base && a + n <= r->base + r->len) {
			r->inuse++;
			r->used_at = ecx_now_ns();
			c->st.regcache_hits++;
			return r;
		}
		if (r->inuse == 0 && (lru == NULL || r->used_at < lru->used_at))
			lru = r;
	}
	if (free_slot == NULL && lru != NULL) {
		cons_region_drop(c, lru);
		free_slot = lru;
	}
	if (free_slot == NULL) {
		*err = ECX_EBUSY;
		return NULL;
	}
	uint64_t base = span_lo / PAGE * PAGE;
	uint64_t end = (span_hi + PAGE - 1) / PAGE * PAGE;
	if (end == base)
		end = base + PAGE;
	region *r = free_slot;
	char why[200];
	*err = ecx_ucx_mem_reg(c->ucx, (void *)(uintptr_t)base, end - base,
	                       &r->memh, why, sizeof(why));
	if (*err != 0) {
		ecx_warn(MOD, "%s", why);
		return NULL;
	}
	*err = ecx_ucx_rkey_pack(c->ucx, r->memh, &r->rkey, &r->rkey_len);
	if (*err != 0) {
		ecx_ucx_mem_unmap(c->ucx, r->memh);
		r->memh = NULL;
		return NULL;
	}
	r->live = true;
	r->inuse = 1;
	r->used_at = ecx_now_ns();
	__atomic_store_n(&r->stale, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&r->base, base, __ATOMIC_RELEASE);
	__atomic_store_n(&r->len, end - base, __ATOMIC_RELEASE);
	c->st.registrations++;
	cons_mc_region(c, r, true);
	return r;
}

/* Pages of residency asked of mincore at a time: 16 MiB. */
#define POP_VEC 4096

/* Write-faults the pages [a, a + npages * PAGE) in, keeping their bytes,
 * where the kernel has no MADV_POPULATE_WRITE (before 5.14): one byte of
 * each page, the first at or past lo (the destination's own, so no other
 * thread's write to the page can be lost), read and written back by this
 * process's own process_vm_readv/writev, which fail (EFAULT) where a
 * touch would crash (memory not writable). False when they cannot. */
static bool touch_pages(uintptr_t a, size_t npages, uintptr_t lo)
{
	enum { N = 512 };
	unsigned char b[N];
	struct iovec loc[N], rem[N];
	pid_t self = getpid();
	for (size_t k = 0; k < npages;) {
		size_t m = npages - k < N ? npages - k : N;
		for (size_t i = 0; i < m; i++) {
			uintptr_t at = a + (k + i) * PAGE;
			loc[i] =
			    (struct iovec){.iov_base = &b[i], .iov_len = 1};
			rem[i] = (struct iovec){.iov_base =
			                            (void *)(at > lo ? at : lo),
			                        .iov_len = 1};
		}
		if (process_vm_readv(self, loc, m, rem, m, 0) != (ssize_t)m ||
		    process_vm_writev(self, loc, m, rem, m, 0) != (ssize_t)m)
			return false;
		k += m;
	}
	return true;
}

/* Makes the pages of [a, a + npages * PAGE) resident and writable (lo:
 * where the destination starts, in the first of them). */
static bool populate(uintptr_t a, size_t npages, uintptr_t lo)
{
	if (madvise((void *)a, npages * PAGE, MADV_POPULATE_WRITE) == 0)
		return true;
	return errno == EINVAL && touch_pages(a, npages, lo);
}

uint64_t cons_span_populate(ecx_consumer *c, uint64_t lo, uint64_t hi)
{
	uintptr_t a = (uintptr_t)(lo / PAGE * PAGE);
	uintptr_t end = (uintptr_t)((hi + PAGE - 1) / PAGE * PAGE);
	if (end <= a)
		return 0;
	/* Memory registered already was populated before it was. */
	bool known = false;
	pthread_mutex_lock(&c->lock);
	if (c->arena.live && a >= c->arena.base &&
	    end <= c->arena.base + c->arena.len)
		known = true;
	for (unsigned i = 0; i < c->rcache->n && !known; i++) {
		region *r = &c->rcache->r[i];
		known = r->live &&
		        !__atomic_load_n(&r->stale, __ATOMIC_ACQUIRE) &&
		        a >= r->base && end <= r->base + r->len;
	}
	pthread_mutex_unlock(&c->lock);
	if (known)
		return 0;
	unsigned char vec[POP_VEC];
	uint64_t done = 0;
	bool failed = false;
	while (a < end && !failed) {
		size_t np =
		    (end - a) / PAGE < POP_VEC ? (end - a) / PAGE : POP_VEC;
		/* What is resident costs nothing more: populating pages
		 * that are already there walks them all again. */
		if (mincore((void *)a, np * PAGE, vec) != 0) {
			ecx_debug(MOD, "mincore: %m; pages left to the write");
			break;
		}
		for (size_t i = 0; i < np && !failed;) {
			if (vec[i] & 1) {
				i++;
				continue;
			}
			size_t j = i;
			while (j < np && !(vec[j] & 1))
				j++;
			if (populate(a + i * PAGE, j - i, (uintptr_t)lo)) {
				done += j - i;
			} else {
				ecx_debug(MOD,
				          "cannot populate %zu pages: %m; "
				          "left to the write",
				          j - i);
				failed = true;
			}
			i = j;
		}
		a += np * PAGE;
	}
	if (done > 0) {
		pthread_mutex_lock(&c->lock);
		c->st.pages_populated += done;
		pthread_mutex_unlock(&c->lock);
	}
	return done;
}

void *cons_arena(ecx_consumer *c, uint64_t *capacity)
{
	bool live = c->arena.live;
	if (capacity != NULL)
		*capacity = live ? c->alloc.capacity : 0;
	return live ? c->arena_base : NULL;
}

void *cons_alloc(ecx_consumer *c, size_t nbytes)
{
	uint64_t off;
	pthread_mutex_lock(&c->lock);
	if (!c->arena.live || !ecx_alloc_take(&c->alloc, nbytes, &off)) {
		pthread_mutex_unlock(&c->lock);
		ecx_set_error(ECX_ENOSPC,
		              "receive arena has no room for %zu bytes",
		              nbytes);
		return NULL;
	}
	if (c->nallocs == c->cap_allocs) {
		size_t cap = c->cap_allocs ? c->cap_allocs * 2 : 64;
		arena_alloc *a = realloc(c->allocs, cap * sizeof(*a));
		if (a == NULL) {
			ecx_alloc_give(&c->alloc, off, nbytes);
			pthread_mutex_unlock(&c->lock);
			ecx_set_error(ECX_ENOMEM, "out of memory");
			return NULL;
		}
		c->allocs = a;
		c->cap_allocs = cap;
	}
	c->allocs[c->nallocs++] = (arena_alloc){.off = off, .size = nbytes};
	pthread_mutex_unlock(&c->lock);
	return (char *)c->arena_base + off;
}

void cons_free(ecx_consumer *c, void *ptr)
{
	uint64_t off = (uint64_t)((char *)ptr - (char *)c->arena_base);
	pthread_mutex_lock(&c->lock);
	for (size_t i = 0; i < c->nallocs; i++) {
		if (c->allocs[i].off == off) {
			/* Quarantined: a timed-out pull may still write
			 * here, so the range is not handed out again yet. */
			if (c->allocs[i].zombies > 0) {
				c->allocs[i].freed = true;
				break;
			}
			ecx_alloc_give(&c->alloc, off, c->allocs[i].size);
			c->allocs[i] = c->allocs[--c->nallocs];
			break;
		}
	}
	pthread_mutex_unlock(&c->lock);
}

arena_alloc *cons_arena_alloc_at(ecx_consumer *c, uint64_t addr)
{
	uint64_t base = (uint64_t)(uintptr_t)c->arena_base;
	if (!c->arena.live || addr < base || addr >= base + c->arena.len)
		return NULL;
	uint64_t off = addr - base;
	for (size_t i = 0; i < c->nallocs; i++)
		if (off >= c->allocs[i].off &&
		    off < c->allocs[i].off + c->allocs[i].size)
			return &c->allocs[i];
	return NULL;
}

void cons_arena_unquarantine(ecx_consumer *c, uint64_t off)
{
	for (size_t i = 0; i < c->nallocs; i++) {
		arena_alloc *a = &c->allocs[i];
		if (a->off != off)
			continue;
		if (--a->zombies == 0 && a->freed) {
			ecx_alloc_give(&c->alloc, a->off, a->size);
			c->allocs[i] = c->allocs[--c->nallocs];
		}
		break;
	}
	c->st_quarantined--;
}

void cons_zombie_make(ecx_consumer *c, pull *p)
{
	p->zombie = true;
	/* p->quar was made when the pull was sent, room for every item. */
	for (size_t k = 0; p->quar != NULL && k < p->n; k++) {
		const ecx_item *x = &p->load->items[p->idx[k]];
		if (x->desc.nbytes == 0)
			continue;
		arena_alloc *a =
		    cons_arena_alloc_at(c, (uint64_t)(uintptr_t)x->dst);
		if (a == NULL)
			continue;
		a->zombies++;
		p->quar[p->nquar++] = a->off;
	}
	p->load = NULL;
	c->st_quarantined += p->nquar;
	ecx_info(MOD,
	         "pull %llu to %s timed out: %zu receive-arena buffers "
	         "quarantined until the producer answers",
	         (unsigned long long)p->req, p->pc->address, p->nquar);
}

void cons_zombie_end(ecx_consumer *c, pull *p)
{
	for (size_t g = 0; g < p->nregs; g++)
		p->regs[g]->inuse--;
	for (size_t q = 0; q < p->nquar; q++)
		cons_arena_unquarantine(c, p->quar[q]);
	free(p->quar);
	free(p->regs);
	free(p->idx);
	free(p->dstat);
	free(p);
}
