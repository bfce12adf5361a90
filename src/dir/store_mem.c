/* store_mem.c - the in-memory store: a chained hash table under a
 * reader-writer lock. Each id keeps the entries of up to ECX_HOLDERS_MAX
 * producers, each living by its lease (ttl_s past its last renewal, in
 * this process's monotonic clock); expired entries are invisible to reads
 * and dropped by the next write that meets them. */
#include "dir/store.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct holder {
	ecx_entry entry;
	uint64_t renewed_ms; /* monotonic */
	uint64_t expires_ms; /* monotonic; 0: never */
} holder;

typedef struct mem_node {
	struct mem_node *next;
	uint64_t hash;
	size_t nh, cap; /* holders used, room in h (most ids have one) */
	holder *h;
	char id[]; /* NUL-terminated */
} mem_node;

typedef struct mem_store {
	ecx_store base;
	pthread_rwlock_t lock;
	mem_node **buckets;
	size_t nbuckets; /* a power of two */
	size_t count;    /* ids with at least one holder, live or not */
} mem_store;

static uint64_t mem_hash(const char *s)
{
	return ecx_id_hash(s);
}

static bool holder_live(const holder *h, uint64_t now)
{
	return h->expires_ms == 0 || now < h->expires_ms;
}

static mem_node **mem_find(mem_store *m, const char *id, uint64_t h)
{
	mem_node **p = &m->buckets[h & (m->nbuckets - 1)];
	for (; *p != NULL; p = &(*p)->next)
		if ((*p)->hash == h && strcmp((*p)->id, id) == 0)
			return p;
	return p;
}

/* Drops expired holders of *p, and the node when none is left; returns
 * whether the node is gone. Called with the write lock. */
static bool mem_sweep(mem_store *m, mem_node **p, uint64_t now)
{
	mem_node *n = *p;
	size_t k = 0;
	for (size_t i = 0; i < n->nh; i++)
		if (holder_live(&n->h[i], now))
			n->h[k++] = n->h[i];
	n->nh = k;
	if (k > 0)
		return false;
	*p = n->next;
	m->count--;
	free(n->h);
	free(n);
	return true;
}

static void mem_grow(mem_store *m)
{
	size_t nb = m->nbuckets * 2;
	mem_node **b = calloc(nb, sizeof(*b));
	if (b == NULL)
		return; /* longer chains, still correct */
	for (size_t i = 0; i < m->nbuckets; i++) {
		mem_node *n = m->buckets[i];
		while (n != NULL) {
			mem_node *next = n->next;
			n->next = b[n->hash & (nb - 1)];
			b[n->hash & (nb - 1)] = n;
			n = next;
		}
	}
	free(m->buckets);
	m->buckets = b;
	m->nbuckets = nb;
}

static void holder_set(holder *h, const ecx_entry *e, uint64_t now)
{
	h->entry = *e;
	h->entry.age_ms = 0;
	h->renewed_ms = now;
	h->expires_ms = e->ttl_s > 0 ? now + (uint64_t)e->ttl_s * 1000 : 0;
}

static int mem_put(ecx_store *s, const char *id, const ecx_entry *e, char *why,
                   size_t whylen)
{
	mem_store *m = (mem_store *)s;
	uint64_t h = mem_hash(id);
	size_t idlen = strlen(id);
	mem_node *fresh = malloc(sizeof(*fresh) + idlen + 1);
	holder *one = malloc(sizeof(*one));
	if (fresh == NULL || one == NULL) {
		free(fresh);
		free(one);
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	}
	uint64_t now = ecx_now_ms();
	fresh->hash = h;
	fresh->nh = fresh->cap = 1;
	fresh->h = one;
	holder_set(&fresh->h[0], e, now);
	memcpy(fresh->id, id, idlen + 1);
	pthread_rwlock_wrlock(&m->lock);
	mem_node **p = mem_find(m, id, h);
	if (*p != NULL && !mem_sweep(m, p, now)) {
		mem_node *n = *p;
		size_t slot = n->nh;
		for (size_t i = 0; i < n->nh; i++)
			if (strcmp(n->h[i].entry.producer_zmq,
			           e->producer_zmq) == 0)
				slot = i;
		if (slot == ECX_HOLDERS_MAX) {
			/* Full: the holder renewed longest ago makes room. */
			slot = 0;
			for (size_t i = 1; i < n->nh; i++)
				if (n->h[i].renewed_ms < n->h[slot].renewed_ms)
					slot = i;
		}
		if (slot == n->nh && n->nh == n->cap) {
			holder *g = realloc(n->h, (n->cap + 1) * sizeof(*g));
			if (g == NULL) {
				pthread_rwlock_unlock(&m->lock);
				free(one);
				free(fresh);
				return ecx_why(why, whylen, ECX_ENOMEM,
				               "out of memory");
			}
			n->h = g;
			n->cap++;
		}
		if (slot == n->nh)
			n->nh++;
		holder_set(&n->h[slot], e, now);
		pthread_rwlock_unlock(&m->lock);
		free(one);
		free(fresh);
		return 0;
	}
	p = mem_find(m, id, h); /* the sweep may have unlinked it */
	fresh->next = NULL;
	*p = fresh;
	if (++m->count > m->nbuckets)
		mem_grow(m);
	pthread_rwlock_unlock(&m->lock);
	return 0;
}

/* Fills it from node n (NULL: not found): the most recently renewed live
 * holder first, then, when want_alt, the others, newest first (it->alt
 * malloc'd; when that fails, the first alone). */
static void mem_answer(const mem_node *n, uint64_t now, bool want_alt,
                       ecx_lookup_item *it)
{
	it->found = false;
	it->nalt = 0;
	it->alt = NULL;
	if (n == NULL)
		return;
	const holder *order[ECX_HOLDERS_MAX];
	size_t k = 0;
	for (size_t i = 0; i < n->nh; i++) {
		if (!holder_live(&n->h[i], now))
			continue;
		size_t j = k++;
		while (j > 0 && order[j - 1]->renewed_ms < n->h[i].renewed_ms) {
			order[j] = order[j - 1];
			j--;
		}
		order[j] = &n->h[i];
	}
	if (k > 1 && want_alt)
		it->alt = malloc((k - 1) * sizeof(*it->alt));
	for (size_t i = 0; i < k; i++) {
		if (i > 0 && it->alt == NULL)
			break;
		ecx_entry *e = i == 0 ? &it->entry : &it->alt[it->nalt++];
		*e = order[i]->entry;
		/* A renewal stamped after `now` was read reads as just
		 * renewed, never as a wrapped age. Keep age_ms nonzero on
		 * the wire: 0 reads as "unknown". */
		uint64_t r = order[i]->renewed_ms;
		e->age_ms = now > r ? now - r : 1;
	}
	it->found = k > 0;
}

static int mem_get(ecx_store *s, const char *id, ecx_entry *out, char *why,
                   size_t whylen)
{
	mem_store *m = (mem_store *)s;
	uint64_t h = mem_hash(id);
	ecx_lookup_item it = {.id = id};
	pthread_rwlock_rdlock(&m->lock);
	mem_answer(*mem_find(m, id, h), ecx_now_ms(), false, &it);
	pthread_rwlock_unlock(&m->lock);
	if (!it.found)
		return ecx_why(why, whylen, ECX_ENOTFOUND, "unknown mm_hash");
	*out = it.entry;
	return 0;
}

static int mem_del(ecx_store *s, const char *id, const char *producer_zmq,
                   char *why, size_t whylen)
{
	mem_store *m = (mem_store *)s;
	uint64_t h = mem_hash(id);
	bool gone = false;
	uint64_t now = ecx_now_ms();
	pthread_rwlock_wrlock(&m->lock);
	mem_node **p = mem_find(m, id, h);
	mem_node *n = *p;
	if (n != NULL) {
		size_t k = 0;
		for (size_t i = 0; i < n->nh; i++) {
			bool mine = producer_zmq == NULL ||
			            strcmp(n->h[i].entry.producer_zmq,
			                   producer_zmq) == 0;
			if (mine && holder_live(&n->h[i], now))
				gone = true;
			if (!mine)
				n->h[k++] = n->h[i];
		}
		n->nh = k;
		mem_sweep(m, p, now);
	}
	pthread_rwlock_unlock(&m->lock);
	if (!gone)
		return ecx_why(why, whylen, ECX_ENOTFOUND, "unknown mm_hash");
	return 0;
}

static int mem_mget(ecx_store *s, ecx_lookup_item *items, size_t n, char *why,
                    size_t whylen)
{
	(void)why;
	(void)whylen;
	mem_store *m = (mem_store *)s;
	pthread_rwlock_rdlock(&m->lock);
	uint64_t now = ecx_now_ms();
	for (size_t i = 0; i < n; i++)
		mem_answer(*mem_find(m, items[i].id, mem_hash(items[i].id)),
		           now, true, &items[i]);
	pthread_rwlock_unlock(&m->lock);
	return 0;
}

static int mem_renew(ecx_store *s, const char *producer_zmq, uint64_t epoch,
                     uint32_t ttl_s, size_t *renewed, char *why, size_t whylen)
{
	(void)why;
	(void)whylen;
	mem_store *m = (mem_store *)s;
	uint64_t now = ecx_now_ms();
	size_t k = 0;
	pthread_rwlock_wrlock(&m->lock);
	for (size_t b = 0; b < m->nbuckets; b++) {
		mem_node **p = &m->buckets[b];
		while (*p != NULL) {
			mem_node *n = *p;
			for (size_t i = 0; i < n->nh; i++) {
				holder *h = &n->h[i];
				if (!holder_live(h, now) ||
				    h->entry.epoch != epoch ||
				    strcmp(h->entry.producer_zmq,
				           producer_zmq) != 0)
					continue;
				h->renewed_ms = now;
				h->entry.ttl_s = ttl_s;
				h->expires_ms =
				    ttl_s > 0 ? now + (uint64_t)ttl_s * 1000
				              : 0;
				k++;
			}
			if (!mem_sweep(m, p, now))
				p = &n->next;
		}
	}
	pthread_rwlock_unlock(&m->lock);
	*renewed = k;
	return 0;
}

static int row_cmp(const void *a, const void *b)
{
	return strcmp(((const ecx_store_row *)a)->id,
	              ((const ecx_store_row *)b)->id);
}

/* Drops every expired holder. Called with the write lock. */
static void mem_sweep_all(mem_store *m, uint64_t now)
{
	for (size_t b = 0; b < m->nbuckets; b++) {
		mem_node **p = &m->buckets[b];
		while (*p != NULL) {
			mem_node *n = *p;
			if (!mem_sweep(m, p, now))
				p = &n->next;
		}
	}
}

/* A listing is for people and tools, not the hot path: it walks the table
 * (dropping what expired) and keeps the `limit` smallest ids above `after`.
 * A row shows the id's first holder. */
static int mem_list(ecx_store *s, const char *after, size_t limit,
                    ecx_store_row *rows, size_t *nrows, size_t *total,
                    char *why, size_t whylen)
{
	(void)why;
	(void)whylen;
	mem_store *m = (mem_store *)s;
	size_t n = 0, big = 0; /* rows[big] is the largest id kept when full */
	pthread_rwlock_wrlock(&m->lock);
	uint64_t now = ecx_now_ms();
	mem_sweep_all(m, now);
	for (size_t b = 0; b < m->nbuckets && limit > 0; b++) {
		for (mem_node *x = m->buckets[b]; x != NULL; x = x->next) {
			if (strcmp(x->id, after) <= 0)
				continue;
			size_t slot = n;
			if (n == limit) {
				if (strcmp(x->id, rows[big].id) >= 0)
					continue;
				slot = big;
			}
			ecx_strlcpy(rows[slot].id, x->id,
			            sizeof(rows[slot].id));
			ecx_lookup_item it = {.id = x->id};
			mem_answer(x, now, false, &it);
			rows[slot].entry = it.entry;
			if (n < limit)
				n++;
			if (n == limit) {
				big = 0;
				for (size_t i = 1; i < n; i++)
					if (strcmp(rows[i].id, rows[big].id) >
					    0)
						big = i;
			}
		}
	}
	*total = m->count;
	pthread_rwlock_unlock(&m->lock);
	if (n > 0)
		qsort(rows, n, sizeof(*rows), row_cmp);
	*nrows = n;
	return 0;
}

static size_t mem_count(ecx_store *s)
{
	mem_store *m = (mem_store *)s;
	pthread_rwlock_wrlock(&m->lock);
	mem_sweep_all(m, ecx_now_ms());
	size_t n = m->count;
	pthread_rwlock_unlock(&m->lock);
	return n;
}

static void mem_destroy(ecx_store *s)
{
	mem_store *m = (mem_store *)s;
	for (size_t b = 0; b < m->nbuckets; b++) {
		mem_node *x = m->buckets[b];
		while (x != NULL) {
			mem_node *next = x->next;
			free(x->h);
			free(x);
			x = next;
		}
	}
	free(m->buckets);
	pthread_rwlock_destroy(&m->lock);
	free(m);
}

static const ecx_store_ops mem_ops = {
    .name = "memory",
    .put = mem_put,
    .get = mem_get,
    .del = mem_del,
    .mget = mem_mget,
    .renew = mem_renew,
    .list = mem_list,
    .count = mem_count,
    .destroy = mem_destroy,
};

ecx_store *ecx_store_mem_create(void)
{
	mem_store *m = calloc(1, sizeof(*m));
	if (m == NULL)
		return NULL;
	m->nbuckets = 64;
	m->buckets = calloc(m->nbuckets, sizeof(*m->buckets));
	if (m->buckets == NULL || pthread_rwlock_init(&m->lock, NULL) != 0) {
		free(m->buckets);
		free(m);
		return NULL;
	}
	m->base.ops = &mem_ops;
	return &m->base;
}
