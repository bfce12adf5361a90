/* store_redis_priv.h - what store_redis.c and store_redis_sync.c share:
 * the Redis store's state, its key names and its connection helpers.
 * Nothing outside these two files includes it. */
#ifndef ECX_DIR_STORE_REDIS_PRIV_H
#define ECX_DIR_STORE_REDIS_PRIV_H

#include "dir/store.h"

#include <hiredis/hiredis.h>
#include <pthread.h>

#define KEY_PREFIX "ecx:"
/* Every holder of an id: a hash "ecxh:<id>" of producer_zmq -> "<expiry,
 * unix ms, 0: never>|<entry JSON>", beside the entry "ecx:<id>" (the
 * latest writer's, which lookups read with one MGET). Not under "ecx:", so
 * listings do not see it. */
#define HOLD_PREFIX "ecxh:"

typedef struct redis_store {
	ecx_store base;
	pthread_mutex_t lock;
	redisContext *ctx; /* NULL until connected, and after a failure */
	char host[256];
	int port, db;
	char *password;
	int timeout_ms;
	int ttl_s; /* 0: entries do not expire */
} redis_store;

/* The Redis store s is, or NULL when s is another kind of store. */
redis_store *rs_of(ecx_store *s);
/* Connects r when it has no connection. Called with r->lock. */
int rs_connect(redis_store *r, char *why, size_t whylen);
/* A failed command: the error, with the connection dropped so the next
 * call reconnects. Called with r->lock. */
int rs_fail(redis_store *r, redisReply *rep, char *why, size_t whylen);
/* Appends the three commands that write e (json) as id's entry and as its
 * producer's holder entry, with a TTL of ttl seconds (0: none); -1 when
 * hiredis could not append. */
int rs_append_put(redis_store *r, const char *id, const ecx_entry *e,
                  const char *json, int ttl);
/* Reads k replies of a pipeline; the first error wins. */
int rs_replies(redis_store *r, size_t k, char *why, size_t whylen);

#endif
