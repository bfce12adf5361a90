/*
 * items.c - the producer's puts (reserve and commit, or one copy) and
 * removals, with eviction from the LRU tail (the table, the list and the
 * pins are table.c's). An evicted or removed id is unpublished; its bytes
 * are given back once no pull reads them.
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MOD "producer"

/* Puts of at least this many bytes write the arena with non-temporal
 * stores: the destination is cold (fresh or evicted space), and the bytes
 * are read next by a pull, not by this thread, so they go to memory
 * without first reading each line in and without evicting the cache's
 * working set. Smaller items are memcpy'd. At 64 KiB such a copy took
 * 3.8-4.4 us where memcpy took 5.0-5.7, and a read of it from the other
 * CPU right after 5.5-5.9 us against 4.3-5.0: about even in all for a
 * pull that comes at once, the save a third shorter (ecx-bench-arena-copy,
 * docs/bench.md, "Small saves"); under 64 KiB the two are closer. With
 * integrity on, the hash reads the bytes right after (commit): see
 * STREAM_MIN_HASHED. */
#define STREAM_MIN ((uint64_t)64 << 10)
/* With integrity on, commit hashes the bytes right after the copy, and
 * reads them back from memory after non-temporal stores: a 64 KiB put
 * took 13.8-14.7 us that way against 11.8-12.1 with memcpy (the hash then
 * reads them from the cache). So from here only, as before. */
#define STREAM_MIN_HASHED ((uint64_t)256 << 10)

/* ---- put, remove ---- */

/* Ids evicted under the lock, unpublished after it is released. */
typedef struct evicted {
	size_t n, cap;
	char (*ids)[ECX_ID_MAX + 1];
} evicted;

static void evicted_add(evicted *e, const char *id)
{
	if (e->n == e->cap) {
		size_t cap = e->cap ? e->cap * 2 : 8;
		void *ids = realloc(e->ids, cap * sizeof(*e->ids));
		if (ids == NULL)
			return; /* it stays in the registry; pulls get ENOTFOUND
			         */
		e->ids = ids;
		e->cap = cap;
	}
	ecx_strlcpy(e->ids[e->n++], id, ECX_ID_MAX + 1);
}

/* Finds room for n bytes, evicting unpinned items from the LRU tail. A dry
 * run on a copy of the free list finds how many must go first, so a put
 * that cannot succeed (everything pinned, or pinned items fragmenting the
 * space) evicts nothing. */
static int make_room(ecx_producer *p, uint64_t n, uint64_t *off, evicted *ev)
{
	if (ecx_alloc_take(&p->alloc, n, off))
		return 0;
	/* Leases past their expiry give their items back first. */
	prod_leases_expire(p);
	ecx_alloc dry;
	if (!ecx_alloc_clone(&dry, &p->alloc))
		return ECX_ENOMEM;
	item *last = NULL;
	uint64_t scratch;
	for (item *v = p->lru_tail; v != NULL; v = v->lru_prev) {
		if (v->pins > 0 || v->leases > 0 || !v->ready)
			continue;
		ecx_alloc_give(&dry, v->off, v->desc.nbytes);
		if (ecx_alloc_take(&dry, n, &scratch)) {
			last = v;
			break;
		}
	}
	ecx_alloc_fini(&dry);
	if (last == NULL)
		return ECX_ENOSPC;
	item *v = p->lru_tail;
	for (;;) {
		item *prev = v->lru_prev;
		if (v->pins == 0 && v->leases == 0 && v->ready) {
			bool done = v == last;
			prod_item_unlink(p, v);
			evicted_add(ev, v->id);
			prod_item_free(p, v);
			p->st.evictions++;
			if (done)
				break;
		}
		v = prev;
	}
	return ecx_alloc_take(&p->alloc, n, off) ? 0 : ECX_ENOSPC;
}

/* Checks and takes room for id: *dst is its place in the arena, or NULL
 * (and 0) when id is already held with the same descriptor. The item is
 * in the table, not ready: invisible to lookups, pulls and eviction. */
int prod_reserve(ecx_producer *p, const char *op, const char *id,
                 const ecx_tensor_desc *desc, void **dst)
{
	char why[256];
	if (core_id_check(id, why, sizeof(why)) != 0)
		return ecx_set_error(ECX_EID, "%s: %s", op, why);
	int rc = core_tensor_check(desc, why, sizeof(why));
	if (rc != 0)
		return ecx_set_error(rc, "%s %s: %s", op, id, why);
	if (ecx_alloc_size(desc->nbytes) > p->alloc.capacity)
		return ecx_set_error(ECX_ETOOBIG,
		                     "%s %s: %llu bytes do not fit in an arena "
		                     "of %llu bytes",
		                     op, id, (unsigned long long)desc->nbytes,
		                     (unsigned long long)p->alloc.capacity);
	evicted ev = {0};
	pthread_mutex_lock(&p->lock);
	item *old = prod_item_find(p, id);
	if (old != NULL) {
		bool same = old->desc.dtype == desc->dtype &&
		            old->desc.ndim == desc->ndim &&
		            old->desc.nbytes == desc->nbytes &&
		            memcmp(old->desc.shape, desc->shape,
		                   desc->ndim * sizeof(uint64_t)) == 0;
		/* Read under the lock: once it is released, old may be
		 * evicted and freed by another thread. */
		bool ready = old->ready;
		if (same && ready)
			prod_item_touch(p, old);
		pthread_mutex_unlock(&p->lock);
		if (!same)
			return ecx_set_error(
			    ECX_EINVAL,
			    "%s %s: held with another dtype or "
			    "shape; remove it first",
			    op, id);
		if (!ready)
			return ecx_set_error(ECX_EBUSY,
			                     "%s %s: another put of it is in "
			                     "progress",
			                     op, id);
		*dst = NULL;
		return 0;
	}
	uint64_t off = 0;
	rc = make_room(p, desc->nbytes, &off, &ev);
	item *it = NULL;
	if (rc == 0) {
		it = calloc(1, sizeof(*it));
		if (it == NULL) {
			ecx_alloc_give(&p->alloc, off, desc->nbytes);
			rc = ECX_ENOMEM;
		}
	}
	if (it != NULL) {
		it->off = off;
		it->desc = *desc;
		ecx_strlcpy(it->id, id, sizeof(it->id));
		prod_item_insert(p, it); /* not ready: invisible to pulls */
	}
	pthread_mutex_unlock(&p->lock);
	/* The evicted ids leave the registry (or are queued for it) before
	 * their bytes are written over. */
	prod_unpublish_many(p, (const char(*)[ECX_ID_MAX + 1]) ev.ids, ev.n);
	free(ev.ids);
	if (rc == ECX_ENOSPC)
		return ecx_set_error(
		    rc,
		    "%s %s: no room for %llu bytes: every item "
		    "is being read by a pull or leased",
		    op, id, (unsigned long long)desc->nbytes);
	if (rc != 0)
		return ecx_set_error(rc, "%s %s: out of memory", op, id);
	*dst = (char *)p->base + off;
	return 0;
}

/* The reservation of id (an item not ready), or NULL. With the lock. */
static item *reserved(ecx_producer *p, const char *id)
{
	item *it = id != NULL ? prod_item_find(p, id) : NULL;
	return it != NULL && !it->ready ? it : NULL;
}

int prod_commit(ecx_producer *p, const char *id)
{
	pthread_mutex_lock(&p->lock);
	item *it = reserved(p, id);
	uint64_t off = it != NULL ? it->off : 0;
	ecx_tensor_desc desc;
	if (it != NULL)
		desc = it->desc;
	pthread_mutex_unlock(&p->lock);
	/* Nothing but cancel or commit removes an item that is not ready,
	 * and both are the reserving caller's: it stays while unlocked. */
	if (it == NULL)
		return ecx_set_error(ECX_ENOTFOUND, "commit %s: not reserved",
		                     id != NULL ? id : "(null)");
	/* Hashed from the arena, after the copy: what pulls will send. */
	uint64_t xxh = p->integrity
	                   ? ecx_hash_bytes(ECX_HASH_XXH3,
	                                    (char *)p->base + off, desc.nbytes)
	                   : 0;
	char why[256];
	int rc = prod_publish(p, id, &desc, why, sizeof(why));
	pthread_mutex_lock(&p->lock);
	if (rc == 0) {
		it->xxh3 = xxh;
		it->has_xxh64 = false;
		it->ready = true;
	} else {
		prod_item_unlink(p, it);
		prod_item_free(p, it);
	}
	pthread_mutex_unlock(&p->lock);
	if (rc != 0)
		return ecx_set_error(rc, "put %s: cannot publish: %s", id, why);
	ecx_debug(MOD, "put %s (%llu bytes at offset %llu)", id,
	          (unsigned long long)desc.nbytes, (unsigned long long)off);
	return 0;
}

int prod_cancel(ecx_producer *p, const char *id)
{
	pthread_mutex_lock(&p->lock);
	item *it = reserved(p, id);
	if (it != NULL) {
		prod_item_unlink(p, it);
		prod_item_free(p, it);
	}
	pthread_mutex_unlock(&p->lock);
	if (it == NULL)
		return ecx_set_error(ECX_ENOTFOUND, "cancel %s: not reserved",
		                     id != NULL ? id : "(null)");
	return 0;
}

/* dst <- n bytes of src, with non-temporal stores from min bytes where
 * the CPU has them; they are ordered before the caller's next store (the
 * commit). */
static void copy_into_arena(void *dst, const void *src, uint64_t n,
                            uint64_t min)
{
	(void)min; /* (without SSE2: memcpy whatever the size) */
#if defined(__SSE2__)
	if (n >= min) {
		char *d = dst;
		const char *s = src;
		size_t head = (16 - ((uintptr_t)d & 15)) & 15;
		memcpy(d, s, head);
		d += head;
		s += head;
		n -= head;
		for (; n >= 64; n -= 64, d += 64, s += 64) {
			const __m128i *q = (const __m128i *)(const void *)s;
			__m128i a = _mm_loadu_si128(q);
			__m128i b = _mm_loadu_si128(q + 1);
			__m128i c = _mm_loadu_si128(q + 2);
			__m128i e = _mm_loadu_si128(q + 3);
			__m128i *o = (__m128i *)(void *)d;
			_mm_stream_si128(o, a);
			_mm_stream_si128(o + 1, b);
			_mm_stream_si128(o + 2, c);
			_mm_stream_si128(o + 3, e);
		}
		memcpy(d, s, n);
		_mm_sfence();
		return;
	}
#endif
	memcpy(dst, src, n);
}

int prod_put(ecx_producer *p, const char *id, const ecx_tensor_desc *desc,
             const void *src, int *stored)
{
	void *dst = NULL;
	int rc = prod_reserve(p, "put", id, desc, &dst);
	if (rc != 0)
		return rc;
	if (dst == NULL) {
		if (stored != NULL)
			*stored = 0;
		return 0;
	}
	if (desc->nbytes > 0)
		copy_into_arena(dst, src, desc->nbytes,
		                p->integrity ? STREAM_MIN_HASHED : STREAM_MIN);
	rc = prod_commit(p, id);
	if (rc == 0 && stored != NULL)
		*stored = 1;
	return rc;
}

int prod_remove(ecx_producer *p, const char *id)
{
	pthread_mutex_lock(&p->lock);
	item *it = prod_item_find(p, id);
	if (it == NULL || !it->ready) {
		pthread_mutex_unlock(&p->lock);
		return ecx_set_error(ECX_ENOTFOUND, "remove %s: not held", id);
	}
	prod_leases_drop_item(p, it);
	prod_item_unlink(p, it);
	if (it->pins > 0)
		it->doomed = true;
	else
		prod_item_free(p, it);
	pthread_mutex_unlock(&p->lock);
	prod_unpublish(p, id);
	return 0;
}
