/*
 * store_redis_dial.c - one connection to one Redis server, opened within a
 * time with the store's AUTH and SELECT: the master of a redis:// store
 * (store_redis.c) and of a redis+sentinel:// one, once the sentinels named
 * it (store_redis_sentinel.c). Calls neither.
 */
#include "dir/store_redis_priv.h"

#include <hiredis/hiredis.h>

#include <stdio.h>
#include <string.h>
#include <sys/time.h>

int rs_io_err(const char *host, int port, const redisContext *c, bool dialing,
              int ms, char *why, size_t whylen)
{
	if (c == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	bool v6 = strchr(host, ':') != NULL;
	char at[300];
	snprintf(at, sizeof(at), "%s%s%s:%d", v6 ? "[" : "", host,
	         v6 ? "]" : "", port);
	const char *raw = c->err != 0 ? c->errstr : "no answer";
	bool timed_out =
	    c->err == REDIS_ERR_IO && (strstr(raw, "temporarily") != NULL ||
	                               strstr(raw, "timed out") != NULL);
	if (c->err == 0 || timed_out)
		return ecx_why(why, whylen, ECX_ETIMEDOUT,
		               dialing ? "Redis at %s: no connection within "
		                         "%d ms (is the host up, and the port "
		                         "open?) (hiredis: %s)"
		                       : "Redis at %s did not answer within "
		                         "%d ms (is it Redis, and is it up? a "
		                         "stopped or overloaded server looks "
		                         "like this) (hiredis: %s)",
		               at, ms, raw);
	if (c->err == REDIS_ERR_IO && strstr(raw, "refused") != NULL)
		return ecx_why(why, whylen, ECX_ECONNECT,
		               "Redis at %s refused the connection: nothing "
		               "listens on that port (is redis-server running "
		               "there, and is the port right?) (hiredis: %s)",
		               at, raw);
	if (c->err == REDIS_ERR_EOF)
		return ecx_why(why, whylen, ECX_ECONNECT,
		               "Redis at %s closed the connection (it stopped "
		               "or restarted, or it is no Redis server; an ecx "
		               "registry is http://) (hiredis: %s)",
		               at, raw);
	if (c->err == REDIS_ERR_PROTOCOL)
		return ecx_why(
		    why, whylen, ECX_EPROTO,
		    "%s does not answer as Redis does: is it a Redis "
		    "server? (hiredis: %s)",
		    at, raw);
	return ecx_why(why, whylen, ECX_ECONNECT, "Redis at %s: %s", at, raw);
}

int rs_dial(redis_store *r, const char *host, int port, int ms,
            redisContext **out, char *why, size_t whylen)
{
	uint64_t t0 = ecx_now_ms();
	struct timeval tv = {.tv_sec = ms / 1000,
	                     .tv_usec = (ms % 1000) * 1000};
	redisContext *c = redisConnectWithTimeout(host, port, tv);
	if (c == NULL || c->err) {
		int rc = rs_io_err(host, port, c, true, ms, why, whylen);
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
		int rc = rs_io_err(host, port, c, false, rest, why, whylen);
		redisFree(c);
		return rc;
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
