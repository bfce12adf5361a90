/*
 * store.h - where a registry keeps its entries, behind a small ops table:
 * memory (store_mem.c) and Redis (store_redis.c). All operations are safe to
 * call from many threads at once; none blocks longer than the store's own
 * timeout (memory: never). Part of dir/ (see dir.h for its rules).
 */
#ifndef ECX_REGISTRY_STORE_H
#define ECX_REGISTRY_STORE_H

#include "wire/wire.h"

typedef struct ecx_store ecx_store;

/* One row of a listing. */
typedef struct ecx_store_row {
	char id[ECX_ID_MAX + 1];
	ecx_entry entry;
} ecx_store_row;

typedef struct ecx_store_ops {
	const char *name;
	/* Inserts or replaces e->producer_zmq's entry for id (the memory store
	 * keeps up to ECX_HOLDERS_MAX producers' entries per id; Redis one).
	 * An entry with e->ttl_s > 0 lives that long unless renewed; 0: until
	 * removed. */
	int (*put)(ecx_store *s, const char *id, const ecx_entry *e, char *why,
	           size_t whylen);
	/* One live holder's entry (the most recently renewed), with age_ms.
	 * ECX_ENOTFOUND when absent. */
	int (*get)(ecx_store *s, const char *id, ecx_entry *out, char *why,
	           size_t whylen);
	/* Removes id; when producer_zmq is not NULL, only that producer's
	 * entry. ECX_ENOTFOUND when nothing was removed. */
	int (*del)(ecx_store *s, const char *id, const char *producer_zmq,
	           char *why, size_t whylen);
	/* Fills items[i].found/.entry/.alt for n ids, in one round trip. */
	int (*mget)(ecx_store *s, ecx_lookup_item *items, size_t n, char *why,
	            size_t whylen);
	/* Renews every entry of producer_zmq whose epoch is `epoch` for ttl_s
	 * more seconds; *renewed is set to how many. NULL for a store whose
	 * producers renew by writing their entries again (Redis). */
	int (*renew)(ecx_store *s, const char *producer_zmq, uint64_t epoch,
	             uint32_t ttl_s, size_t *renewed, char *why, size_t whylen);
	/* Up to limit rows with ids sorted after `after` ("" for the first
	 * page) into rows; *nrows is set, and *total to the store's size. */
	int (*list)(ecx_store *s, const char *after, size_t limit,
	            ecx_store_row *rows, size_t *nrows, size_t *total,
	            char *why, size_t whylen);
	size_t (*count)(ecx_store *s);
	void (*destroy)(ecx_store *s);
} ecx_store_ops;

struct ecx_store {
	const ecx_store_ops *ops;
};

/* ecx_store_mem_create makes an empty in-memory store. NULL when out of
 * memory. */
ecx_store *ecx_store_mem_create(void);

/* ecx_store_redis_create makes a store in the Redis at url
 * (redis://[:password@]host[:port][/db]); it connects at the first call.
 * Entries written get a TTL of ttl_s seconds (0: none). NULL, with why,
 * for a bad URL or out of memory. */
ecx_store *ecx_store_redis_create(const char *url, int timeout_ms, int ttl_s,
                                  char *why, size_t whylen);
bool ecx_store_is_redis_url(const char *url);

/* Adds to each found item the other live holders of its id (items[].alt,
 * freed with ecx_lookup_items_clear), in one round trip. Does nothing for a
 * store that is not Redis (the memory store's mget fills them). */
int ecx_store_redis_holders(ecx_store *s, ecx_lookup_item *items, size_t n,
                            char *why, size_t whylen);

/* PINGs the Redis behind s (connecting if needed): 0 when it answers.
 * ECX_EINVAL for a store that is not Redis. */
int ecx_store_redis_ping(ecx_store *s, char *why, size_t whylen);

/* Writes n entries again (renewing their TTL, and restoring them if Redis
 * lost them) in one round trip (a pipeline). Does nothing for a store that
 * is not Redis. */
int ecx_store_redis_refresh(ecx_store *s, const char *const *ids,
                            const ecx_entry *entries, size_t n, char *why,
                            size_t whylen);

/* For entries that do not expire (no TTL: nothing to renew): asks
 * whether each of the n is still there (its holder and its entry), in one
 * round trip, and writes again those that are not, in another; *restored
 * says how many. Does nothing for a store that is not Redis. */
int ecx_store_redis_restore(ecx_store *s, const char *const *ids,
                            const ecx_entry *entries, size_t n,
                            size_t *restored, char *why, size_t whylen);

static inline void ecx_store_destroy(ecx_store *s)
{
	if (s != NULL)
		s->ops->destroy(s);
}

#endif /* ECX_REGISTRY_STORE_H */
