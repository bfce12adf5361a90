/*
 * push.c - writes items this producer holds into a Mooncake session at an
 * address the session's owner chose: the encoder's side of upstream vLLM's
 * push mode (a consumer shard reserved the destination and said where;
 * docs/protocol.md "Push mode: the producer side").
 *
 * Each item is checked (held, ready, nbytes its own) and pinned under the
 * producer's lock, written over the producer's Mooncake writer
 * (mooncake/writer.h: a known session costs no handshake and no connect),
 * and unpinned, so it cannot be evicted or removed from under a write. A
 * batch runs its writes on up to PUSH_THREADS threads at once, each taking
 * the next item, over the writer's pooled connections; every write ends by
 * one deadline counted from the call.
 */
#include "producer/producer.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "producer"

/* Writes in flight at once in one batch: the writer keeps ECX_MC_POOL
 * idle connections per session, so more would open connections it then
 * closes. */
#define PUSH_THREADS ECX_MC_POOL
/* Bytes below which a batch is written by the caller alone. */
#define PUSH_PARALLEL_MIN (1u << 20)

typedef struct push_job {
	ecx_producer *p;
	ecx_push_item *items;
	item **its;        /* the pinned item of each entry, or NULL */
	const void **src;  /* its bytes in the arena */
	size_t n;          /* entries */
	size_t next;       /* the next entry to write (atomic) */
	uint64_t deadline; /* monotonic ns */
	pthread_mutex_t lock;
	size_t failed_at; /* the first entry that failed, or n */
	char why[320];    /* its detail */
} push_job;

/* Records a failed entry k's detail when it is the first to fail. */
static void push_fail(push_job *j, size_t k, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void push_fail(push_job *j, size_t k, int rc, const char *fmt, ...)
{
	j->items[k].status = rc;
	pthread_mutex_lock(&j->lock);
	if (k < j->failed_at) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(j->why, sizeof(j->why), fmt, ap);
		va_end(ap);
		j->failed_at = k;
	}
	pthread_mutex_unlock(&j->lock);
}

/* Checks and pins every entry; an entry refused gets its status. Takes
 * the lock. */
static void push_pin(push_job *j)
{
	ecx_producer *p = j->p;
	pthread_mutex_lock(&p->lock);
	for (size_t k = 0; k < j->n; k++) {
		ecx_push_item *e = &j->items[k];
		item *it = e->id != NULL ? prod_item_find(p, e->id) : NULL;
		if (e->id == NULL || e->dst_session == NULL) {
			e->status = ECX_EINVAL;
			continue;
		}
		if (it == NULL || !it->ready) {
			e->status = ECX_ENOTFOUND;
			continue;
		}
		if (it->desc.nbytes != e->nbytes) {
			e->status = ECX_ESIZE;
			continue;
		}
		prod_item_pin(p, it);
		prod_item_touch(p, it);
		j->its[k] = it;
		j->src[k] = (const char *)p->base + it->off;
		e->status = 0;
	}
	pthread_mutex_unlock(&p->lock);
	/* The details of the refusals, outside the lock. */
	for (size_t k = 0; k < j->n; k++) {
		ecx_push_item *e = &j->items[k];
		if (e->status == ECX_EINVAL)
			push_fail(j, k, ECX_EINVAL,
			          "push %zu: missing id or "
			          "session",
			          k);
		else if (e->status == ECX_ENOTFOUND)
			push_fail(j, k, ECX_ENOTFOUND, "push %.64s: not held",
			          e->id);
		else if (e->status == ECX_ESIZE)
			push_fail(j, k, ECX_ESIZE,
			          "push %.64s: %" PRIu64 " bytes asked, the "
			          "item has another size",
			          e->id, e->nbytes);
	}
}

static void push_unpin(push_job *j)
{
	ecx_producer *p = j->p;
	pthread_mutex_lock(&p->lock);
	for (size_t k = 0; k < j->n; k++)
		if (j->its[k] != NULL)
			prod_item_unpin(p, j->its[k]);
	pthread_mutex_unlock(&p->lock);
}

static void push_one(push_job *j, size_t k)
{
	ecx_push_item *e = &j->items[k];
	char why[256];
	int rc = ecx_mc_write(j->p->mc, e->dst_session, e->dst_ptr, j->src[k],
	                      e->nbytes, j->deadline, why, sizeof(why));
	if (rc != 0)
		push_fail(j, k, rc, "push %.64s into %s at 0x%" PRIx64 ": %s",
		          e->id, e->dst_session, e->dst_ptr, why);
}

static void *push_thread(void *arg)
{
	push_job *j = arg;
	for (;;) {
		size_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
		if (k >= j->n)
			return NULL;
		if (j->its[k] != NULL)
			push_one(j, k);
	}
}

int prod_push_batch(ecx_producer *p, ecx_push_item *items, size_t n,
                    uint64_t timeout_ms)
{
	if (p->mc == NULL)
		return ecx_set_error(ECX_EUNSUPPORTED,
		                     "push: this producer was started with the "
		                     "Mooncake wire off");
	if (n == 0)
		return 0;
	uint64_t start = ecx_now_ns();
	uint64_t ms = timeout_ms > 0 ? timeout_ms : (uint64_t)p->timeout_ms;
	push_job j = {.p = p,
	              .items = items,
	              .n = n,
	              .deadline = start + ms * 1000000u,
	              .failed_at = n};
	j.its = calloc(n, sizeof(*j.its));
	j.src = calloc(n, sizeof(*j.src));
	if (j.its == NULL || j.src == NULL) {
		free(j.its);
		free(j.src);
		return ecx_set_error(ECX_ENOMEM, "push: %zu items", n);
	}
	pthread_mutex_init(&j.lock, NULL);
	push_pin(&j);
	pthread_t thr[PUSH_THREADS - 1];
	size_t started = 0;
	uint64_t total = 0;
	for (size_t k = 0; k < n; k++)
		total += j.its[k] != NULL ? items[k].nbytes : 0;
	/* Small batches are written by the caller alone: a thread's start
	 * costs more than their writes gain from running side by side. */
	size_t want = total < PUSH_PARALLEL_MIN ? 1
	              : n < PUSH_THREADS        ? n
	                                        : PUSH_THREADS;
	/* The caller's thread writes too: a single item starts no thread. */
	for (size_t t = 0; t + 1 < want; t++) {
		if (pthread_create(&thr[t], NULL, push_thread, &j) != 0)
			break; /* fewer threads: the caller writes the rest */
		started++;
	}
	push_thread(&j);
	for (size_t t = 0; t < started; t++)
		pthread_join(thr[t], NULL);
	push_unpin(&j);
	int rc = j.failed_at < n ? items[j.failed_at].status : 0;
	if (rc != 0) {
		if (rc != ECX_ENOTFOUND && rc != ECX_ESIZE && rc != ECX_EINVAL)
			ecx_warn(MOD, "%s", j.why);
		ecx_set_error(rc, "%s", j.why);
	}
	pthread_mutex_destroy(&j.lock);
	free(j.its);
	free(j.src);
	return rc;
}

int prod_item_xxh3(ecx_producer *p, const char *id, uint64_t *out)
{
	pthread_mutex_lock(&p->lock);
	item *it = prod_item_find(p, id);
	if (it == NULL || !it->ready) {
		pthread_mutex_unlock(&p->lock);
		return ecx_set_error(ECX_ENOTFOUND, "hash of %.64s: not held",
		                     id);
	}
	if (p->integrity) {
		*out = it->xxh3;
		pthread_mutex_unlock(&p->lock);
		return 0;
	}
	prod_item_pin(p, it);
	const void *src = (const char *)p->base + it->off;
	uint64_t n = it->desc.nbytes;
	pthread_mutex_unlock(&p->lock);
	uint64_t h = ecx_hash_bytes(ECX_HASH_XXH3, src, n);
	pthread_mutex_lock(&p->lock);
	prod_item_unpin(p, it);
	pthread_mutex_unlock(&p->lock);
	*out = h;
	return 0;
}
