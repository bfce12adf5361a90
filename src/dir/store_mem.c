/* store_mem.c - the in-memory store: a chained hash table under a
 * reader-writer lock. */
#include "dir/store.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct mem_node {
	struct mem_node *next;
	uint64_t hash;
	ecx_entry entry;
	char id[]; /* NUL-terminated */
} mem_node;

typedef struct mem_store {
	ecx_store base;
	pthread_rwlock_t lock;
	mem_node **buckets;
	size_t nbuckets; /* a power of two */
	size_t count;
} mem_store;

static uint64_t mem_hash(const char *s)
{
	return ecx_hash_str(s);
}

static mem_node **mem_find(mem_store *m, const char *id, uint64_t h)
{
	mem_node **p = &m->buckets[h & (m->nbuckets - 1)];
	for (; *p != NULL; p = &(*p)->next)
		if ((*p)->hash == h && strcmp((*p)->id, id) == 0)
			return p;
	return p;
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

static int mem_put(ecx_store *s, const char *id, const ecx_entry *e, char *why,
                   size_t whylen)
{
	mem_store *m = (mem_store *)s;
	uint64_t h = mem_hash(id);
	size_t idlen = strlen(id);
	mem_node *fresh = malloc(sizeof(*fresh) + idlen + 1);
	if (fresh == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	fresh->hash = h;
	fresh->entry = *e;
	memcpy(fresh->id, id, idlen + 1);
	pthread_rwlock_wrlock(&m->lock);
	mem_node **p = mem_find(m, id, h);
	if (*p != NULL) {
		(*p)->entry = *e;
		pthread_rwlock_unlock(&m->lock);
		free(fresh);
		return 0;
	}
	fresh->next = NULL;
	*p = fresh;
	if (++m->count > m->nbuckets)
		mem_grow(m);
	pthread_rwlock_unlock(&m->lock);
	return 0;
}

static int mem_get(ecx_store *s, const char *id, ecx_entry *out, char *why,
                   size_t whylen)
{
	mem_store *m = (mem_store *)s;
	uint64_t h = mem_hash(id);
	int rc = 0;
	pthread_rwlock_rdlock(&m->lock);
	mem_node *n = *mem_find(m, id, h);
	if (n != NULL)
		*out = n->entry;
	else
		rc = ecx_why(why, whylen, ECX_ENOTFOUND, "unknown mm_hash");
	pthread_rwlock_unlock(&m->lock);
	return rc;
}

static int mem_del(ecx_store *s, const char *id, const char *producer_zmq,
                   char *why, size_t whylen)
{
	mem_store *m = (mem_store *)s;
	uint64_t h = mem_hash(id);
	mem_node *gone = NULL;
	pthread_rwlock_wrlock(&m->lock);
	mem_node **p = mem_find(m, id, h);
	if (*p != NULL &&
	    (producer_zmq == NULL ||
	     strcmp((*p)->entry.producer_zmq, producer_zmq) == 0)) {
		gone = *p;
		*p = gone->next;
		m->count--;
	}
	pthread_rwlock_unlock(&m->lock);
	if (gone == NULL)
		return ecx_why(why, whylen, ECX_ENOTFOUND, "unknown mm_hash");
	free(gone);
	return 0;
}

static int mem_mget(ecx_store *s, ecx_lookup_item *items, size_t n, char *why,
                    size_t whylen)
{
	(void)why;
	(void)whylen;
	mem_store *m = (mem_store *)s;
	pthread_rwlock_rdlock(&m->lock);
	for (size_t i = 0; i < n; i++) {
		mem_node *x = *mem_find(m, items[i].id, mem_hash(items[i].id));
		items[i].found = x != NULL;
		if (x != NULL)
			items[i].entry = x->entry;
	}
	pthread_rwlock_unlock(&m->lock);
	return 0;
}

static int row_cmp(const void *a, const void *b)
{
	return strcmp(((const ecx_store_row *)a)->id,
	              ((const ecx_store_row *)b)->id);
}

/* A listing is for people and tools, not the hot path: it walks the table
 * and keeps the `limit` smallest ids above `after`. */
static int mem_list(ecx_store *s, const char *after, size_t limit,
                    ecx_store_row *rows, size_t *nrows, size_t *total,
                    char *why, size_t whylen)
{
	(void)why;
	(void)whylen;
	mem_store *m = (mem_store *)s;
	size_t n = 0, big = 0; /* rows[big] is the largest id kept when full */
	pthread_rwlock_rdlock(&m->lock);
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
			rows[slot].entry = x->entry;
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
	qsort(rows, n, sizeof(*rows), row_cmp);
	*nrows = n;
	return 0;
}

static size_t mem_count(ecx_store *s)
{
	mem_store *m = (mem_store *)s;
	pthread_rwlock_rdlock(&m->lock);
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
