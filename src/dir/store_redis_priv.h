/* store_redis_priv.h - what the Redis store's files share: its state, its
 * key names and its connection helpers. store_redis.c (the ops) calls
 * store_redis_sentinel.c and store_redis_dial.c; store_redis_sync.c calls
 * store_redis.c and store_redis_sentinel.c; store_redis_sentinel.c calls
 * store_redis_dial.c; each one way. Nothing outside these files includes
 * it. */
#ifndef ECX_DIR_STORE_REDIS_PRIV_H
#define ECX_DIR_STORE_REDIS_PRIV_H

#include "dir/store.h"

#include <stdbool.h>
#include <stdint.h>

#include <hiredis/hiredis.h>
#include <pthread.h>

#define KEY_PREFIX "ecx:"
/* Every holder of an id: a hash "ecxh:<id>" of producer_zmq -> "<expiry,
 * unix ms, 0: never>|<entry JSON>", beside the entry "ecx:<id>" (the
 * latest writer's, which lookups read with one MGET). Not under "ecx:", so
 * listings do not see it. */
#define HOLD_PREFIX "ecxh:"

/* The most sentinels one redis+sentinel:// URL names. */
#define RS_SENTINELS_MAX 8

typedef struct rs_addr {
	char host[256];
	int port;
} rs_addr;

typedef struct redis_store {
	ecx_store base;
	pthread_mutex_t lock;
	redisContext *ctx; /* NULL until connected, and after a failure */
	char host[256];    /* redis+sentinel://: the master last found */
	int port, db;
	char *password;
	int timeout_ms;
	int ttl_s; /* 0: entries do not expire */
	/* redis+sentinel:// (nsent > 0): the sentinels that name the master
	 * (store_redis_sentinel.c). */
	int nsent;
	rs_addr sent[RS_SENTINELS_MAX];
	int sent_first;       /* asked first: the last one that answered */
	char master[128];     /* the master's name the sentinels monitor */
	redisContext *sub;    /* one sentinel's +switch-master notices */
	uint64_t deadline_ms; /* of the call under way (ecx_now_ms) */
	int tries;            /* of the call under way, after the first */
	uint64_t masters;     /* how many times a master was found */
	char url[160];        /* for messages, without the password */
} redis_store;

/* The Redis store s is, or NULL when s is another kind of store. */
redis_store *rs_of(ecx_store *s);
/* Connects r when it has no connection. Called with r->lock. For a
 * redis+sentinel:// store, the first call of an operation also starts its
 * deadline (the store's timeout), which bounds the master's discovery, the
 * connection and the commands that follow. */
int rs_connect(redis_store *r, char *why, size_t whylen);
/* store_redis_dial.c: opens a connection to host:port within ms, with
 * AUTH and SELECT as r says: 0 and *out, or the error (ECX_EAUTH for a
 * refused password). */
int rs_dial(redis_store *r, const char *host, int port, int ms,
            redisContext **out, char *why, size_t whylen);
/* The error of a connection c to host:port that failed (c NULL: no
 * memory), in words a user can act on: refused, no answer within ms (the
 * bound named), closed, not Redis; hiredis's text follows. dialing: it
 * failed while connecting. */
int rs_io_err(const char *host, int port, const redisContext *c, bool dialing,
              int ms, char *why, size_t whylen);
/* Parses redis+sentinel://[:password@]HOST[:PORT][,HOST[:PORT]...]/MASTER
 * [/DB] into r: 0, or ECX_EINVAL with why. */
int rs_sentinel_parse(redis_store *r, const char *url, char *why,
                      size_t whylen);
/* rs_connect for a redis+sentinel:// store: follows a +switch-master
 * notice, then, without a connection, asks the sentinels for the master
 * and connects to it when its ROLE says master, trying again until the
 * call's deadline. Called with r->lock. */
int rs_sentinel_connect(redis_store *r, char *why, size_t whylen);
/* Whether an error reply says the server is not (or not yet) a master
 * that takes writes: -READONLY, -LOADING, -MASTERDOWN. Behind Sentinel
 * (only) such a reply gives the connection up, as ECX_ECONNECT. */
bool rs_moved_reply(const redisReply *rep);
/* Whether an operation that ended with rc should run once more: a
 * redis+sentinel:// store that lost its master during the operation's
 * first try, with time left before its deadline. Called with r->lock, at
 * the end of every try (it resets the count when it answers false). */
bool rs_again(redis_store *r, int rc);
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
