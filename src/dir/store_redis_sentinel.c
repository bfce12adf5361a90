/*
 * store_redis_sentinel.c - the Redis store behind Redis Sentinel
 * (redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER): the sentinels are
 * asked for the master's address (SENTINEL get-master-addr-by-name), the
 * master is used only once its ROLE says master, and it is given up, to be
 * asked for again, on a dropped connection, on a -READONLY, -LOADING or
 * -MASTERDOWN reply, or on a sentinel's +switch-master notice (one
 * sentinel connection stays subscribed to them). Each operation has one
 * deadline, the store's timeout, that bounds all of it: the sentinels, the
 * master's connection and its commands, however many of them are down.
 */
#include "dir/store.h"
#include "dir/store_redis_priv.h"

#include <hiredis/hiredis.h>

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define MOD "redis"
#define SENTINEL_PORT 26379
/* The pause between rounds of the sentinels while no master takes
 * writes (a failover under way). */
#define ROUND_PAUSE_MS 100
/* The least a sentinel is given to answer, when the time left allows. */
#define SENTINEL_MIN_MS 250

int rs_sentinel_parse(redis_store *r, const char *url, char *why, size_t whylen)
{
	const char *p = url + strlen("redis+sentinel://");
	const char *slash = strchr(p, '/');
	const char *at =
	    memchr(p, '@', slash != NULL ? (size_t)(slash - p) : strlen(p));
	if (at != NULL) {
		const char *pw = memchr(p, ':', (size_t)(at - p));
		pw = pw != NULL ? pw + 1 : p;
		r->password = strndup(pw, (size_t)(at - pw));
		p = at + 1;
	}
	const char *usage = "a Sentinel URL is redis+sentinel://[:PASSWORD@]"
	                    "HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]";
	if (slash == NULL || slash[1] == '\0' || slash[1] == '/')
		return ecx_why(why, whylen, ECX_EINVAL, "%s (no MASTER)",
		               usage);
	/* The sentinels, comma-separated, up to the slash. */
	while (p < slash) {
		while (*p == ' ')
			p++;
		size_t n = strcspn(p, ",/");
		while (n > 0 && p[n - 1] == ' ')
			n--;
		if (r->nsent == RS_SENTINELS_MAX)
			return ecx_why(why, whylen, ECX_EINVAL,
			               "at most %d sentinels in one URL",
			               RS_SENTINELS_MAX);
		rs_addr *a = &r->sent[r->nsent];
		const char *colon = memchr(p, ':', n);
		size_t hl = colon != NULL ? (size_t)(colon - p) : n;
		if (hl == 0 || hl >= sizeof(a->host))
			return ecx_why(why, whylen, ECX_EINVAL,
			               "%s (a sentinel without a host)", usage);
		memcpy(a->host, p, hl);
		a->host[hl] = '\0';
		a->port = SENTINEL_PORT;
		if (colon != NULL) {
			char *end;
			long port = strtol(colon + 1, &end, 10);
			if (end != p + n || port < 1 || port > 65535)
				return ecx_why(why, whylen, ECX_EINVAL,
				               "%s (bad port for sentinel %s)",
				               usage, a->host);
			a->port = (int)port;
		}
		r->nsent++;
		p += n;
		while (*p == ' ')
			p++;
		if (*p == ',')
			p++;
	}
	if (r->nsent == 0)
		return ecx_why(why, whylen, ECX_EINVAL, "%s (no sentinel)",
		               usage);
	/* /MASTER[/DB] */
	p = slash + 1;
	size_t ml = strcspn(p, "/");
	if (memchr(p, ',', ml) != NULL || memchr(p, ' ', ml) != NULL)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "%s (MASTER '%.*s' has a comma or a space)",
		               usage, (int)(ml > 64 ? 64 : ml), p);
	if (ml >= sizeof(r->master))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "master name longer than %zu bytes",
		               sizeof(r->master) - 1);
	memcpy(r->master, p, ml);
	r->master[ml] = '\0';
	p += ml;
	if (*p == '/' && p[1] != '\0') {
		char *end;
		long db = strtol(p + 1, &end, 10);
		if (end == p + 1 || *end != '\0' || db < 0 || db > 1000)
			return ecx_why(why, whylen, ECX_EINVAL, "%s (bad DB)",
			               usage);
		r->db = (int)db;
	} else if (*p != '\0' && strcmp(p, "/") != 0) {
		return ecx_why(why, whylen, ECX_EINVAL, "%s", usage);
	}
	/* The URL without its password, for messages. */
	int off = snprintf(r->url, sizeof(r->url), "redis+sentinel://");
	for (int i = 0; i < r->nsent && off < (int)sizeof(r->url); i++)
		off += snprintf(r->url + off, sizeof(r->url) - (size_t)off,
		                "%s%s:%d", i ? "," : "", r->sent[i].host,
		                r->sent[i].port);
	if (off < (int)sizeof(r->url))
		snprintf(r->url + off, sizeof(r->url) - (size_t)off, "/%s",
		         r->master);
	ecx_strlcpy(r->host, r->sent[0].host, sizeof(r->host));
	r->port = r->sent[0].port;
	return 0;
}

bool rs_moved_reply(const redisReply *rep)
{
	return rep != NULL && rep->type == REDIS_REPLY_ERROR &&
	       rep->str != NULL &&
	       (strncmp(rep->str, "READONLY", 8) == 0 ||
	        strncmp(rep->str, "LOADING", 7) == 0 ||
	        strncmp(rep->str, "MASTERDOWN", 10) == 0);
}

static int left_ms(const redis_store *r)
{
	uint64_t now = ecx_now_ms();
	return now >= r->deadline_ms ? 0 : (int)(r->deadline_ms - now);
}

static void drop_sub(redis_store *r)
{
	redisFree(r->sub);
	r->sub = NULL;
}

/* Whether a +switch-master payload ("NAME OLDIP OLDPORT NEWIP NEWPORT")
 * moves r's master somewhere it is not connected: a late notice of the
 * failover that brought it to its master changes nothing. */
static bool switch_moves(const redis_store *r, const char *msg)
{
	size_t ml = strlen(r->master);
	if (strncmp(msg, r->master, ml) != 0 || msg[ml] != ' ')
		return false;
	char oldh[256], newh[256];
	int oldp, newp;
	if (sscanf(msg + ml, " %255s %d %255s %d", oldh, &oldp, newh, &newp) !=
	    4)
		return true; /* unreadable: ask the sentinels */
	return strcmp(newh, r->host) != 0 || newp != r->port;
}

/* Reads the notices the subscribed sentinel has sent, without blocking:
 * a +switch-master that moves this store's master gives its connection
 * up. */
static void poll_switch(redis_store *r)
{
	while (r->sub != NULL) {
		struct pollfd pf = {.fd = r->sub->fd, .events = POLLIN};
		if (poll(&pf, 1, 0) != 1)
			return;
		if ((pf.revents & POLLIN) == 0 ||
		    redisBufferRead(r->sub) != REDIS_OK) {
			drop_sub(r); /* the next discovery subscribes again */
			return;
		}
		void *v = NULL;
		while (redisGetReplyFromReader(r->sub, &v) == REDIS_OK &&
		       v != NULL) {
			redisReply *m = v;
			/* ["message", "+switch-master", "NAME OLDIP OLDPORT
			 * NEWIP NEWPORT"] */
			if (m->type == REDIS_REPLY_ARRAY && m->elements == 3 &&
			    m->element[2]->type == REDIS_REPLY_STRING &&
			    r->ctx != NULL &&
			    switch_moves(r, m->element[2]->str)) {
				ecx_info(MOD,
				         "%s: the sentinels moved the master "
				         "(%s): following it",
				         r->url, m->element[2]->str);
				redisFree(r->ctx);
				r->ctx = NULL;
			}
			freeReplyObject(m);
			v = NULL;
		}
		if (r->sub->err)
			drop_sub(r);
	}
}

/* Asks sentinel a for the master within ms: 0 with host and port, 1 when
 * it knows no master of that name, or an error. Keeps the connection as
 * the subscription to +switch-master when there is none. */
static int ask_sentinel(redis_store *r, const rs_addr *a, int ms, char *host,
                        size_t hostlen, int *port, char *why, size_t whylen)
{
	uint64_t t0 = ecx_now_ms();
	struct timeval tv = {.tv_sec = ms / 1000,
	                     .tv_usec = (ms % 1000) * 1000};
	redisContext *c = redisConnectWithTimeout(a->host, a->port, tv);
	if (c == NULL || c->err) {
		int rc = ecx_why(why, whylen, ECX_ECONNECT,
		                 "sentinel %s:%d: %s", a->host, a->port,
		                 c != NULL ? c->errstr : "out of memory");
		redisFree(c);
		return rc;
	}
	/* The connection and the question share the ms. */
	int rest = ms - (int)(ecx_now_ms() - t0);
	if (rest < 1)
		rest = 1;
	tv.tv_sec = rest / 1000;
	tv.tv_usec = (rest % 1000) * 1000;
	redisSetTimeout(c, tv);
	redisReply *rep =
	    redisCommand(c, "SENTINEL get-master-addr-by-name %s", r->master);
	if (rep != NULL && rep->type == REDIS_REPLY_ERROR &&
	    strncmp(rep->str, "NOAUTH", 6) == 0 && r->password != NULL) {
		/* A sentinel with a password of its own: the URL's. */
		freeReplyObject(rep);
		rep = redisCommand(c, "AUTH %s", r->password);
		bool ok = rep != NULL && rep->type != REDIS_REPLY_ERROR;
		freeReplyObject(rep);
		rep =
		    ok ? redisCommand(c, "SENTINEL get-master-addr-by-name %s",
		                      r->master)
		       : NULL;
	}
	int rc;
	if (rep == NULL) {
		bool slow = c->err == REDIS_ERR_IO &&
		            strstr(c->errstr, "temporarily") != NULL;
		rc = slow ? ecx_why(why, whylen, ECX_ETIMEDOUT,
		                    "sentinel %s:%d: no answer within %d ms",
		                    a->host, a->port, ms)
		          : ecx_why(why, whylen, ECX_ECONNECT,
		                    "sentinel %s:%d: %s", a->host, a->port,
		                    c->err ? c->errstr : "no answer");
	} else if (rep->type == REDIS_REPLY_NIL) {
		rc = 1;
	} else if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
	           rep->element[0]->type == REDIS_REPLY_STRING &&
	           rep->element[1]->type == REDIS_REPLY_STRING) {
		ecx_strlcpy(host, rep->element[0]->str, hostlen);
		*port = atoi(rep->element[1]->str);
		rc = 0;
	} else {
		rc = ecx_why(why, whylen, ECX_EPROTO, "sentinel %s:%d: %s",
		             a->host, a->port,
		             rep->type == REDIS_REPLY_ERROR
		                 ? rep->str
		                 : "an answer that names no master");
	}
	freeReplyObject(rep);
	if (rc == 0 && r->sub == NULL) {
		rep = redisCommand(c, "SUBSCRIBE +switch-master");
		bool ok = rep != NULL && rep->type == REDIS_REPLY_ARRAY;
		freeReplyObject(rep);
		if (ok) {
			r->sub = c;
			return 0;
		}
	}
	redisFree(c);
	return rc;
}

/* Connects to the master at host:port within ms and asks its ROLE: 0 with
 * the connection in *out when it is the master; ECX_ECONNECT when it is a
 * replica (a failover under way), or another error. */
static int dial_master(redis_store *r, const char *host, int port, int ms,
                       redisContext **out, char *why, size_t whylen)
{
	redisContext *c = NULL;
	int rc = rs_dial(r, host, port, ms, &c, why, whylen);
	if (rc != 0)
		return rc;
	redisReply *rep = redisCommand(c, "ROLE");
	if (rep != NULL && rep->type == REDIS_REPLY_ARRAY &&
	    rep->elements > 0 && rep->element[0]->type == REDIS_REPLY_STRING &&
	    strcmp(rep->element[0]->str, "master") == 0) {
		freeReplyObject(rep);
		*out = c;
		return 0;
	}
	if (rep == NULL)
		rc = rs_io_err(host, port, c, false, ms, why, whylen);
	else if (rep->type == REDIS_REPLY_ERROR)
		rc = ecx_why(why, whylen,
		             strncmp(rep->str, "NOAUTH", 6) == 0 ? ECX_EAUTH
		                                                 : ECX_ECONNECT,
		             "redis://%s:%d: %s", host, port, rep->str);
	else
		rc = ecx_why(why, whylen, ECX_ECONNECT,
		             "redis://%s:%d, named by the sentinels, is not a "
		             "master (ROLE %s): waiting for the failover",
		             host, port,
		             rep->type == REDIS_REPLY_ARRAY &&
		                     rep->elements > 0 &&
		                     rep->element[0]->type == REDIS_REPLY_STRING
		                 ? rep->element[0]->str
		                 : "?");
	freeReplyObject(rep);
	redisFree(c);
	return rc;
}

int rs_sentinel_connect(redis_store *r, char *why, size_t whylen)
{
	/* The deadline keeps a margin (a tenth, at most 50 ms) for the
	 * wake-ups of a loaded host, so that the caller's bound holds. */
	if (r->tries == 0)
		r->deadline_ms =
		    ecx_now_ms() + (uint64_t)r->timeout_ms -
		    (uint64_t)(r->timeout_ms / 10 < 50 ? r->timeout_ms / 10
		                                       : 50);
	poll_switch(r);
	int rc = ECX_ETIMEDOUT;
	char last[320] = "";
	while (r->ctx == NULL) {
		int answered = 0, unknown = 0;
		bool moved = false;
		for (int k = 0; k < r->nsent && r->ctx == NULL; k++) {
			int left = left_ms(r);
			if (left <= 0)
				break;
			/* Each sentinel left its share of the time (a stopped
			 * one must not take it all), but at least
			 * SENTINEL_MIN_MS. */
			int each = left / (r->nsent - k);
			if (each < SENTINEL_MIN_MS)
				each = left < SENTINEL_MIN_MS ? left
				                              : SENTINEL_MIN_MS;
			int i = (r->sent_first + k) % r->nsent;
			char host[256];
			int port = 0;
			int q = ask_sentinel(r, &r->sent[i], each, host,
			                     sizeof(host), &port, last,
			                     sizeof(last));
			if (q == 1) {
				answered++, unknown++;
				/* a long name may be cut; using the length
				 * keeps -Wformat-truncation quiet at -O0 */
				int n = snprintf(
				    last, sizeof(last),
				    "sentinel %s:%d knows no master named "
				    "'%s'",
				    r->sent[i].host, r->sent[i].port,
				    r->master);
				(void)n;
				continue;
			}
			if (q != 0) {
				rc = q;
				continue;
			}
			answered++;
			r->sent_first = i;
			left = left_ms(r);
			redisContext *c = NULL;
			q = left > 0 ? dial_master(r, host, port, left, &c,
			                           last, sizeof(last))
			             : ECX_ETIMEDOUT;
			if (q == ECX_EAUTH) {
				return ecx_why(why, whylen, ECX_EAUTH,
				               "%s: master %s:%d refused the "
				               "password: %s",
				               r->url, host, port, last);
			}
			/* Not a master (yet): the sentinels are asked
			 * again after a pause. */
			if (q != 0) {
				rc = q;
				break;
			}
			moved = r->masters > 0 &&
			        (strcmp(host, r->host) != 0 || port != r->port);
			ecx_strlcpy(r->host, host, sizeof(r->host));
			r->port = port;
			r->masters++;
			r->ctx = c;
		}
		if (r->ctx != NULL) {
			if (moved)
				ecx_info(MOD, "%s: master now %s:%d", r->url,
				         r->host, r->port);
			break;
		}
		if (answered > 0 && unknown == answered)
			return ecx_why(why, whylen, ECX_EINVAL,
			               "%s: %s (a wrong MASTER in the URL?)",
			               r->url, last);
		int left = left_ms(r);
		if (left <= 0)
			return ecx_why(why, whylen,
			               rc == ECX_ETIMEDOUT ? ECX_ETIMEDOUT
			                                   : ECX_ECONNECT,
			               "%s: no master within %d ms: %s", r->url,
			               r->timeout_ms,
			               last[0] ? last : "no sentinel answered");
		int pause = left < ROUND_PAUSE_MS ? left : ROUND_PAUSE_MS;
		struct timespec ts = {.tv_sec = 0,
		                      .tv_nsec = (long)pause * 1000000};
		nanosleep(&ts, NULL);
	}
	/* The commands that follow get what is left of the deadline. */
	int left = left_ms(r);
	if (left < 1)
		left = 1;
	struct timeval tv = {.tv_sec = left / 1000,
	                     .tv_usec = (left % 1000) * 1000};
	redisSetTimeout(r->ctx, tv);
	return 0;
}

bool rs_again(redis_store *r, int rc)
{
	if (r->nsent > 0 && rc != 0 && r->tries == 0 && r->ctx == NULL &&
	    (rc == ECX_ECONNECT || rc == ECX_ETIMEDOUT) && left_ms(r) > 0) {
		r->tries = 1;
		return true;
	}
	r->tries = 0;
	return false;
}
