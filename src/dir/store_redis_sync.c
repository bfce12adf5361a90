/*
 * store_redis_sync.c - what producers and clients ask of a Redis store
 * beyond its ops table (store_redis.c): refreshing their entries' TTLs,
 * putting back entries that went missing, and every holder of the ids a
 * lookup found. Each is one pipeline, under the store's lock.
 */
#include "dir/store.h"
#include "dir/store_redis_priv.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "redis"

/* Writes entries[i] as ids[i] for each i where which is NULL or which[i],
 * in one pipeline (one round trip), each with its own TTL or the store's;
 * *written: how many. The replies of what was sent are read even after a
 * failure. Called with r->lock, connected (rc: rs_connect's). */
static int rs_put_many(redis_store *r, int rc, const char *const *ids,
                       const ecx_entry *entries, const bool *which, size_t n,
                       size_t *written, char *why, size_t whylen)
{
	size_t sent = 0;
	for (size_t i = 0; rc == 0 && i < n; i++) {
		if (which != NULL && !which[i])
			continue;
		char *json = ecx_entry_encode(&entries[i]);
		if (json == NULL) {
			rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
			break;
		}
		int ttl =
		    entries[i].ttl_s > 0 ? (int)entries[i].ttl_s : r->ttl_s;
		if (rs_append_put(r, ids[i], &entries[i], json, ttl) != 0)
			rc = rs_fail(r, NULL, why, whylen);
		else
			sent++;
		free(json);
	}
	if (r->ctx != NULL && sent > 0) {
		int rr = rs_replies(r, 3 * sent, why, whylen);
		if (rc == 0)
			rc = rr;
	}
	*written = sent;
	return rc;
}

int ecx_store_redis_refresh(ecx_store *s, const char *const *ids,
                            const ecx_entry *entries, size_t n, char *why,
                            size_t whylen)
{
	redis_store *r = rs_of(s);
	if (r == NULL || n == 0)
		return 0;
	pthread_mutex_lock(&r->lock);
	int rc;
	do {
		rc = rs_connect(r, why, whylen);
		/* One round trip for all of them, which also puts back what
		 * a restarted (emptied) Redis, or a new master that missed
		 * the last writes, lost. */
		size_t sent;
		rc = rs_put_many(r, rc, ids, entries, NULL, n, &sent, why,
		                 whylen);
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	return rc;
}

int ecx_store_redis_restore(ecx_store *s, const char *const *ids,
                            const ecx_entry *entries, size_t n,
                            size_t *restored, char *why, size_t whylen)
{
	redis_store *r = rs_of(s);
	*restored = 0;
	if (r == NULL || n == 0)
		return 0;
	bool *gone = calloc(n, sizeof(*gone));
	if (gone == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_lock(&r->lock);
	int rc;
	size_t put = 0;
	do {
		memset(gone, 0, n * sizeof(*gone));
		rc = rs_connect(r, why, whylen);
		/* One pipeline asks whether each entry is there (the holder's
		 * field and the entry lookups read), a second writes those
		 * that are not. */
		size_t sent = 0;
		for (size_t i = 0; rc == 0 && i < n; i++) {
			if (redisAppendCommand(
			        r->ctx, "HEXISTS " HOLD_PREFIX "%s %s", ids[i],
			        entries[i].producer_zmq) != REDIS_OK ||
			    redisAppendCommand(r->ctx,
			                       "EXISTS " KEY_PREFIX "%s",
			                       ids[i]) != REDIS_OK) {
				rc = rs_fail(r, NULL, why, whylen);
				break;
			}
			sent++;
		}
		for (size_t i = 0; r->ctx != NULL && i < 2 * sent; i++) {
			redisReply *rep = NULL;
			if (redisGetReply(r->ctx, (void **)&rep) != REDIS_OK) {
				rc = rs_fail(r, rep, why, whylen);
				break;
			}
			if (rep == NULL || rep->type != REDIS_REPLY_INTEGER ||
			    rep->integer == 0)
				gone[i / 2] = true;
			freeReplyObject(rep);
		}
		rc = rs_put_many(r, rc, ids, entries, gone, n, &put, why,
		                 whylen);
	} while (rs_again(r, rc));
	pthread_mutex_unlock(&r->lock);
	free(gone);
	if (rc == 0)
		*restored = put;
	return rc;
}

int ecx_store_redis_holders(ecx_store *s, ecx_lookup_item *items, size_t n,
                            char *why, size_t whylen)
{
	redis_store *r = rs_of(s);
	if (r == NULL)
		return 0;
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		k += items[i].found;
	if (k == 0)
		return 0;
	pthread_mutex_lock(&r->lock);
	int rc = rs_connect(r, why, whylen);
	if (rc == 0 && redisAppendCommand(r->ctx, "TIME") != REDIS_OK)
		rc = rs_fail(r, NULL, why, whylen);
	for (size_t i = 0; rc == 0 && i < n; i++)
		if (items[i].found &&
		    redisAppendCommand(r->ctx, "HGETALL " HOLD_PREFIX "%s",
		                       items[i].id) != REDIS_OK)
			rc = rs_fail(r, NULL, why, whylen);
	redisReply *t = NULL;
	if (rc == 0 &&
	    (redisGetReply(r->ctx, (void **)&t) != REDIS_OK || t == NULL ||
	     t->type != REDIS_REPLY_ARRAY || t->elements != 2))
		rc = rs_fail(r, t, why, whylen), t = NULL;
	uint64_t now = t != NULL
	                   ? strtoull(t->element[0]->str, NULL, 10) * 1000 +
	                         strtoull(t->element[1]->str, NULL, 10) / 1000
	                   : 0;
	freeReplyObject(t);
	for (size_t i = 0; rc == 0 && i < n; i++) {
		if (!items[i].found)
			continue;
		redisReply *h = NULL;
		if (redisGetReply(r->ctx, (void **)&h) != REDIS_OK) {
			rc = rs_fail(r, h, why, whylen);
			break;
		}
		for (size_t f = 0; h != NULL && h->type == REDIS_REPLY_ARRAY &&
		                   f + 1 < h->elements;
		     f += 2) {
			const char *prod = h->element[f]->str;
			const char *val = h->element[f + 1]->str;
			const char *bar = val != NULL ? strchr(val, '|') : NULL;
			if (prod == NULL || bar == NULL ||
			    strcmp(prod, items[i].entry.producer_zmq) == 0 ||
			    items[i].nalt == ECX_HOLDERS_MAX - 1)
				continue;
			uint64_t exp = strtoull(val, NULL, 10);
			ecx_entry e;
			char w[64];
			if ((exp != 0 && exp <= now) ||
			    ecx_entry_decode(bar + 1, strlen(bar + 1), &e, w,
			                     sizeof(w)) != 0)
				continue;
			if (items[i].alt == NULL) {
				items[i].alt = malloc((ECX_HOLDERS_MAX - 1) *
				                      sizeof(*items[i].alt));
				if (items[i].alt == NULL)
					break;
			}
			items[i].alt[items[i].nalt++] = e;
		}
		freeReplyObject(h);
	}
	pthread_mutex_unlock(&r->lock);
	return rc;
}
