/*
 * store_redis_dial.c - one connection to one Redis server, opened within a
 * time with the store's AUTH and SELECT: the master of a redis:// store
 * (store_redis.c) and of a redis+sentinel:// one, once the sentinels named
 * it (store_redis_sentinel.c). Calls neither.
 */
#include "dir/store_redis_priv.h"

#include <hiredis/hiredis.h>

#include <sys/time.h>

int rs_dial(redis_store *r, const char *host, int port, int ms,
            redisContext **out, char *why, size_t whylen)
{
	uint64_t t0 = ecx_now_ms();
	struct timeval tv = {.tv_sec = ms / 1000,
	                     .tv_usec = (ms % 1000) * 1000};
	redisContext *c = redisConnectWithTimeout(host, port, tv);
	if (c == NULL || c->err) {
		int rc = ecx_why(why, whylen, ECX_ECONNECT, "redis://%s:%d: %s",
		                 host, port, c ? c->errstr : "out of memory");
		redisFree(c);
		return rc;
	}
	/* AUTH and SELECT get what the connection left of ms; the commands
	 * that follow, all of it again. */
	int rest = ms - (int)(ecx_now_ms() - t0);
	rest = rest < 1 ? 1 : rest;
	struct timeval tr = {.tv_sec = rest / 1000,
	                     .tv_usec = (rest % 1000) * 1000};
	redisSetTimeout(c, tr);
	redisReply *rep = NULL;
	if (r->password != NULL)
		rep = redisCommand(c, "AUTH %s", r->password);
	if (rep == NULL && r->password != NULL) {
		redisFree(c);
		return ecx_why(why, whylen, ECX_ECONNECT,
		               "redis://%s:%d: AUTH got no answer", host, port);
	}
	if (rep != NULL && rep->type == REDIS_REPLY_ERROR) {
		int rc = ecx_why(why, whylen, ECX_EAUTH, "redis://%s:%d: %s",
		                 host, port, rep->str);
		freeReplyObject(rep);
		redisFree(c);
		return rc;
	}
	freeReplyObject(rep);
	if (r->db != 0) {
		rep = redisCommand(c, "SELECT %d", r->db);
		bool bad = rep == NULL || rep->type == REDIS_REPLY_ERROR;
		freeReplyObject(rep);
		if (bad) {
			redisFree(c);
			return ecx_why(why, whylen, ECX_EIO,
			               "redis://%s:%d: cannot select db %d",
			               host, port, r->db);
		}
	}
	redisSetTimeout(c, tv);
	*out = c;
	return 0;
}
