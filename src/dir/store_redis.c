/*
 * store_redis.c - a registry store in Redis (hiredis): entries are the
 * registry's JSON under "ecx:<id>", optionally with a TTL that the producer
 * that wrote them refreshes while it lives. One connection per store,
 * guarded by a mutex, reconnected after a failure; every command is bounded
 * by the store's timeout.
 */
#include "dir/store.h"
#include "dir/store_redis_priv.h"

#include <hiredis/hiredis.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>

#define MOD "redis"
/* The store behind a redis:// URL gets its own ops; these are for the
 * functions below to recognise it. */
static const ecx_store_ops redis_ops;

int rs_connect(redis_store *r, char *why, size_t whylen)
{
	if (r->nsent > 0)
		return rs_sentinel_connect(r, why, whylen);
	if (r->ctx != NULL)
		return 0;
	return rs_dial(r, r->host, r->port, r->timeout_ms, &r->ctx, why,
	               whylen);
}

/* A failed command: the error, with the connection dropped so the next
 * call reconnects. */
int rs_fail(redis_store *r, redisReply *rep, char *why, size_t whylen)
{
	int rc;
	bool moved = r->nsent > 0 && rs_moved_reply(rep);
	if (moved) {
		/* Behind Sentinel: the master became a replica, or is
		 * loading; the next try asks the sentinels again. */
		rc = ecx_why(why, whylen, ECX_ECONNECT,
		             "redis://%s:%d: %s (following the master)",
		             r->host, r->port, rep->str);
	} else if (rep != NULL && rep->type == REDIS_REPLY_ERROR) {
		rc = ecx_why(why, whylen, ECX_EIO, "redis://%s:%d: %s", r->host,
		             r->port, rep->str);
	} else if (r->ctx == NULL) {
		rc = ecx_why(why, whylen, ECX_ECONNECT,
		             "Redis at %s:%d: not connected", r->host, r->port);
	} else {
		rc = rs_io_err(r->host, r->port, r->ctx, false, r->timeout_ms,
		               why, whylen);
	}
	freeReplyObject(rep);
	if (r->ctx != NULL && (r->ctx->err || moved)) {
		redisFree(r->ctx);
		r->ctx = NULL;
	}
	return rc;
}

static uint64_t wall_ms(void)
{
	struct timeval tv;
	gettimeofday(&tv, NULL);
	return (uint64_t)tv.tv_sec * 1000 + (uint64_t)tv.tv_usec / 1000;
}

/* Appends to the pipeline the three commands that write e (json) as id's
 * entry and as its producer's holder entry, with a TTL of ttl seconds (0:
 * none). Returns 0, or -1 when hiredis could not append. */
int rs_append_put(redis_store *r, const char *id, const ecx_entry *e,
                  const char *json, int ttl)
{
	size_t vl = strlen(json) + 32;
	char *val = malloc(vl);
	if (val == NULL)
		return -1;
	snprintf(val, vl, "%llu|%s",
	         ttl > 0
	             ? (unsigned long long)(wall_ms() + (uint64_t)ttl * 1000)
	             : 0ull,
	         json);
	int st = ttl > 0 ? redisAppendCommand(r->ctx,
	                                      "SET " KEY_PREFIX "%s %s EX %d",
	                                      id, json, ttl)
	                 : redisAppendCommand(r->ctx, "SET " KEY_PREFIX "%s %s",
	                                      id, json);
	if (st == REDIS_OK)
		st = redisAppendCommand(r->ctx, "HSET " HOLD_PREFIX "%s %s %s",
		                        id, e->producer_zmq, val);
	if (st == REDIS_OK)
		st = ttl > 0
		         ? redisAppendCommand(r->ctx,
		                              "PEXPIRE " HOLD_PREFIX "%s %d",
		                              id, ttl * 1000)
		         : redisAppendCommand(r->ctx,
		                              "PERSIST " HOLD_PREFIX "%s", id);
	free(val);
	return st == REDIS_OK ? 0 : -1;
}

/* Reads k replies of a pipeline; the first error wins. */
int rs_replies(redis_store *r, size_t k, char *why, size_t whylen)
{
	int rc = 0;
	bool moved = false;
	for (size_t i = 0; i < k; i++) {
		redisReply *rep = NULL;
		if (redisGetReply(r->ctx, (void **)&rep) != REDIS_OK)
			return rs_fail(r, rep, why, whylen);
		if (r->nsent > 0 && rs_moved_reply(rep) && !moved) {
			moved = true;
			rc = ecx_why(why, whylen, ECX_ECONNECT,
			             "redis://%s:%d: %s (following the master)",
			             r->host, r->port, rep->str);
		} else if (rep != NULL && rep->type == REDIS_REPLY_ERROR &&
		           rc == 0) {
			rc = ecx_why(why, whylen, ECX_EIO, "redis://%s:%d: %s",
			             r->host, r->port, rep->str);
		}
		freeReplyObject(rep);
	}
	if (moved) { /* every reply is read: the next try asks again */
		redisFree(r->ctx);
		r->ctx = NULL;
	}
	return rc;
}

static int rs_put(ecx_store *s, const char *id, const ecx_entry *e, char *why,
                  size_t whylen)
{
	redis_store *r = (redis_store *)s;
	/* The entry's own lease, else the store's. */
	int ttl = e->ttl_s > 0 ? (int)e->ttl_s : r->ttl_s;
	char *json = ecx_entry_encode(e);
	if (json == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_lock(&r->lock);
	int rc;
	do {
		rc = rs_connect(r, why, whylen);
		if (rc == 0) {
			if (rs_append_put(r, id, e, json, ttl) != 0)
				rc = rs_fail(r, NULL, why, whylen);
			else
				rc = rs_replies(r, 3, why, whylen);
		}
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	free(json);
	return rc;
}

static int entry_of(const redisReply *v, ecx_entry *out)
{
	if (v == NULL || v->type != REDIS_REPLY_STRING)
		return ECX_ENOTFOUND;
	char why[64];
	/* An entry that is not ecx's JSON counts as absent. */
	return ecx_entry_decode(v->str, v->len, out, why, sizeof(why)) == 0
	           ? 0
	           : ECX_ENOTFOUND;
}

static int rs_get(ecx_store *s, const char *id, ecx_entry *out, char *why,
                  size_t whylen)
{
	ecx_lookup_item it = {.id = id};
	int rc = s->ops->mget(s, &it, 1, why, whylen);
	if (rc != 0)
		return rc;
	if (!it.found)
		return ecx_why(why, whylen, ECX_ENOTFOUND, "unknown mm_hash");
	*out = it.entry;
	return 0;
}

static int rs_mget(ecx_store *s, ecx_lookup_item *items, size_t n, char *why,
                   size_t whylen)
{
	redis_store *r = (redis_store *)s;
	if (n == 0)
		return 0;
	const char **argv = malloc((n + 1) * sizeof(*argv));
	size_t *lens = malloc((n + 1) * sizeof(*lens));
	char *keys = malloc(n * (ECX_ID_MAX + sizeof(KEY_PREFIX)));
	if (argv == NULL || lens == NULL || keys == NULL) {
		free(argv);
		free(lens);
		free(keys);
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	}
	argv[0] = "MGET";
	lens[0] = 4;
	for (size_t i = 0; i < n; i++) {
		char *k = keys + i * (ECX_ID_MAX + sizeof(KEY_PREFIX));
		size_t il = strnlen(items[i].id, ECX_ID_MAX);
		memcpy(k, KEY_PREFIX, sizeof(KEY_PREFIX) - 1);
		memcpy(k + sizeof(KEY_PREFIX) - 1, items[i].id, il);
		lens[i + 1] = sizeof(KEY_PREFIX) - 1 + il;
		argv[i + 1] = k;
	}
	pthread_mutex_lock(&r->lock);
	int rc;
	do {
		rc = rs_connect(r, why, whylen);
		if (rc != 0)
			continue;
		redisReply *rep =
		    redisCommandArgv(r->ctx, (int)n + 1, argv, lens);
		if (rep == NULL || rep->type != REDIS_REPLY_ARRAY ||
		    rep->elements != n) {
			rc = rs_fail(r, rep, why, whylen);
			continue;
		}
		for (size_t i = 0; i < n; i++) {
			items[i].nalt = 0;
			items[i].alt = NULL;
			items[i].found =
			    entry_of(rep->element[i], &items[i].entry) == 0;
		}
		freeReplyObject(rep);
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	free(argv);
	free(lens);
	free(keys);
	return rc;
}

/* Removes a producer's holder entry of an id and, when the id's entry is
 * that producer's, puts another live holder's in its place (or deletes it);
 * with no producer (ARGV[1] ''), removes every holder. One step on the
 * server. KEYS: ecx:<id>, ecxh:<id>; ARGV: producer, the text that marks
 * its entry. */
static const char del_script[] =
    "if ARGV[1] == '' then return redis.call('DEL', KEYS[1], KEYS[2]) end "
    "local n = redis.call('HDEL', KEYS[2], ARGV[1]) "
    "local v = redis.call('GET', KEYS[1]) "
    "if v and string.find(v, ARGV[2], 1, true) then "
    " redis.call('DEL', KEYS[1]) n = 1 "
    " local t = redis.call('TIME') "
    " local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "
    " local all = redis.call('HGETALL', KEYS[2]) "
    " for i = 1, #all, 2 do "
    "  local val = all[i + 1] "
    "  local bar = string.find(val, '|', 1, true) "
    "  if bar then "
    "   local exp = tonumber(string.sub(val, 1, bar - 1)) "
    "   if exp == 0 then "
    "    redis.call('SET', KEYS[1], string.sub(val, bar + 1)) break "
    "   elseif exp > now then "
    "    redis.call('SET', KEYS[1], string.sub(val, bar + 1), 'PX', "
    "               exp - now) break end end end end "
    "return n";

static int rs_del(ecx_store *s, const char *id, const char *producer_zmq,
                  char *why, size_t whylen)
{
	redis_store *r = (redis_store *)s;
	char match[ECX_ADDR_MAX + 32] = "";
	if (producer_zmq != NULL)
		snprintf(match, sizeof(match), "\"producer_zmq\":\"%s\"",
		         producer_zmq);
	pthread_mutex_lock(&r->lock);
	int rc;
	do {
		rc = rs_connect(r, why, whylen);
		if (rc != 0)
			continue;
		redisReply *rep = redisCommand(
		    r->ctx,
		    "EVAL %s 2 " KEY_PREFIX "%s " HOLD_PREFIX "%s %s %s",
		    del_script, id, id,
		    producer_zmq != NULL ? producer_zmq : "", match);
		if (rep == NULL || rep->type != REDIS_REPLY_INTEGER) {
			rc = rs_fail(r, rep, why, whylen);
			continue;
		}
		if (rep->integer == 0)
			rc = ecx_why(why, whylen, ECX_ENOTFOUND,
			             "unknown mm_hash");
		freeReplyObject(rep);
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	return rc;
}

typedef struct idvec {
	char **v;
	size_t n, cap;
} idvec;

static int str_cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every id in the store, by SCAN (for listings, not the hot path). Called
 * with the lock. */
static int rs_scan(redis_store *r, idvec *out, char *why, size_t whylen)
{
	char cursor[32] = "0";
	do {
		redisReply *rep = redisCommand(
		    r->ctx, "SCAN %s MATCH " KEY_PREFIX "* COUNT 1000", cursor);
		if (rep == NULL || rep->type != REDIS_REPLY_ARRAY ||
		    rep->elements != 2)
			return rs_fail(r, rep, why, whylen);
		ecx_strlcpy(cursor, rep->element[0]->str, sizeof(cursor));
		redisReply *keys = rep->element[1];
		for (size_t i = 0; i < keys->elements; i++) {
			if (out->n == out->cap) {
				size_t cap = out->cap ? out->cap * 2 : 256;
				char **v = realloc(out->v, cap * sizeof(*v));
				if (v == NULL) {
					freeReplyObject(rep);
					return ecx_why(why, whylen, ECX_ENOMEM,
					               "out of memory");
				}
				out->v = v;
				out->cap = cap;
			}
			char *id =
			    strdup(keys->element[i]->str + strlen(KEY_PREFIX));
			if (id == NULL) {
				freeReplyObject(rep);
				return ecx_why(why, whylen, ECX_ENOMEM,
				               "out of memory");
			}
			out->v[out->n++] = id;
		}
		freeReplyObject(rep);
	} while (strcmp(cursor, "0") != 0);
	return 0;
}

static void idvec_free(idvec *v)
{
	for (size_t i = 0; i < v->n; i++)
		free(v->v[i]);
	free(v->v);
}

/* Sorts the ids and drops repeats: SCAN may return a key more than once. */
static void idvec_sort_unique(idvec *ids)
{
	if (ids->n < 2)
		return; /* qsort's pointer must not be NULL, even for 0 items */
	qsort(ids->v, ids->n, sizeof(*ids->v), str_cmp);
	size_t m = 0;
	for (size_t i = 0; i < ids->n; i++) {
		if (m > 0 && strcmp(ids->v[m - 1], ids->v[i]) == 0) {
			free(ids->v[i]);
			continue;
		}
		ids->v[m++] = ids->v[i];
	}
	ids->n = m;
}

/* A page is the ids after `after` in sorted order. Keys that expire between
 * SCAN and MGET are skipped and the page is filled from the ids after them,
 * so a short page always means the listing is complete. */
static int rs_list(ecx_store *s, const char *after, size_t limit,
                   ecx_store_row *rows, size_t *nrows, size_t *total, char *why,
                   size_t whylen)
{
	redis_store *r = (redis_store *)s;
	if (after == NULL)
		after = "";
	idvec ids = {0};
	pthread_mutex_lock(&r->lock);
	int rc;
	do {
		rc = rs_connect(r, why, whylen);
		if (rc == 0)
			rc = rs_scan(r, &ids, why, whylen);
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	if (rc != 0) {
		idvec_free(&ids);
		return rc;
	}
	idvec_sort_unique(&ids);
	size_t next = 0;
	while (next < ids.n && strcmp(ids.v[next], after) <= 0)
		next++;
	ecx_lookup_item *it = calloc(limit + 1, sizeof(*it));
	if (it == NULL) {
		idvec_free(&ids);
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	}
	size_t m = 0, gone = 0;
	while (rc == 0 && m < limit && next < ids.n) {
		size_t want = limit - m;
		size_t n = ids.n - next < want ? ids.n - next : want;
		for (size_t i = 0; i < n; i++)
			it[i].id = ids.v[next + i];
		next += n;
		rc = rs_mget(s, it, n, why, whylen);
		for (size_t i = 0; rc == 0 && i < n; i++) {
			if (!it[i].found) {
				gone++; /* expired between SCAN and MGET */
				continue;
			}
			ecx_strlcpy(rows[m].id, it[i].id, sizeof(rows[m].id));
			rows[m++].entry = it[i].entry;
		}
	}
	if (rc == 0) {
		*nrows = m;
		*total = ids.n - gone;
	}
	free(it);
	idvec_free(&ids);
	return rc;
}

static size_t rs_count(ecx_store *s)
{
	redis_store *r = (redis_store *)s;
	idvec ids = {0};
	char why[128];
	pthread_mutex_lock(&r->lock);
	if (rs_connect(r, why, sizeof(why)) == 0)
		rs_scan(r, &ids, why, sizeof(why));
	pthread_mutex_unlock(&r->lock);
	idvec_sort_unique(&ids);
	size_t n = ids.n;
	idvec_free(&ids);
	return n;
}

static void rs_destroy(ecx_store *s)
{
	redis_store *r = (redis_store *)s;
	if (r->ctx != NULL)
		redisFree(r->ctx);
	if (r->sub != NULL)
		redisFree(r->sub);
	if (r->password != NULL)
		memset(r->password, 0, strlen(r->password));
	free(r->password);
	pthread_mutex_destroy(&r->lock);
	free(r);
}

static const ecx_store_ops redis_ops = {
    .name = "redis",
    .put = rs_put,
    .get = rs_get,
    .del = rs_del,
    .mget = rs_mget,
    .list = rs_list,
    .count = rs_count,
    .destroy = rs_destroy,
};

redis_store *rs_of(ecx_store *s)
{
	return s != NULL && s->ops == &redis_ops ? (redis_store *)s : NULL;
}

int ecx_store_redis_ping(ecx_store *s, char *why, size_t whylen)
{
	redis_store *r = (redis_store *)s;
	if (s->ops != &redis_ops)
		return ecx_why(why, whylen, ECX_EINVAL, "not a Redis store");
	pthread_mutex_lock(&r->lock);
	int rc;
	do {
		rc = rs_connect(r, why, whylen);
		if (rc != 0)
			continue;
		redisReply *rep = redisCommand(r->ctx, "PING");
		if (rep == NULL || rep->type == REDIS_REPLY_ERROR)
			rc = rs_fail(r, rep, why, whylen);
		else
			freeReplyObject(rep);
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	return rc;
}

bool ecx_store_is_redis_url(const char *url)
{
	return url != NULL && (strncasecmp(url, "redis://", 8) == 0 ||
	                       strncasecmp(url, "redis+sentinel://", 17) == 0);
}

ecx_store *ecx_store_redis_create(const char *url, int timeout_ms, int ttl_s,
                                  char *why, size_t whylen)
{
	if (!ecx_store_is_redis_url(url)) {
		ecx_why(why, whylen, ECX_EINVAL,
		        "'%s' is not redis:// or redis+sentinel://", url);
		return NULL;
	}
	redis_store *r = calloc(1, sizeof(*r));
	if (r == NULL) {
		ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		return NULL;
	}
	pthread_mutex_init(&r->lock, NULL);
	r->base.ops = &redis_ops;
	r->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
	r->ttl_s = ttl_s;
	r->port = 6379;
	if (strncasecmp(url, "redis+sentinel://", 17) == 0) {
		if (rs_sentinel_parse(r, url, why, whylen) != 0) {
			rs_destroy(&r->base);
			return NULL;
		}
		return &r->base;
	}
	/* redis://[:password@]host[:port][/db] */
	const char *p = url + 8;
	const char *at = strchr(p, '@');
	if (at != NULL) {
		const char *pw = memchr(p, ':', (size_t)(at - p));
		pw = pw != NULL ? pw + 1 : p;
		r->password = strndup(pw, (size_t)(at - pw));
		p = at + 1;
	}
	/* An IPv6 address is in brackets: redis://[::1]:6379. */
	const char *close = *p == '[' ? strchr(p, ']') : NULL;
	size_t hl = close != NULL ? (size_t)(close - p - 1) : strcspn(p, ":/");
	if (hl == 0 || hl >= sizeof(r->host)) {
		ecx_why(why, whylen, ECX_EINVAL, "redis URL has no host");
		rs_destroy(&r->base);
		return NULL;
	}
	memcpy(r->host, close != NULL ? p + 1 : p, hl);
	r->host[hl] = '\0';
	p += close != NULL ? hl + 2 : hl;
	char *end;
	if (*p == ':') {
		long port = strtol(p + 1, &end, 10);
		if (end == p + 1 || port < 1 || port > 65535) {
			ecx_why(why, whylen, ECX_EINVAL,
			        "bad port in redis URL");
			rs_destroy(&r->base);
			return NULL;
		}
		r->port = (int)port;
		p = end;
	}
	if (*p == '/' && p[1] != '\0') {
		long db = strtol(p + 1, &end, 10);
		if (end == p + 1 || *end != '\0' || db < 0 || db > 1000) {
			ecx_why(why, whylen, ECX_EINVAL, "bad db in redis URL");
			rs_destroy(&r->base);
			return NULL;
		}
		r->db = (int)db;
	} else if (*p != '\0' && strcmp(p, "/") != 0) {
		ecx_why(why, whylen, ECX_EINVAL,
		        "redis URL is redis://[:password@]host[:port][/db]");
		rs_destroy(&r->base);
		return NULL;
	}
	return &r->base;
}
