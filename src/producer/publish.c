/*
 * publish.c - the producer's entries in a registry. The embedded registry's
 * store is written directly (it is in this process and never waits); the
 * publisher thread only puts back what HTTP writes removed from it. A
 * remote registry (HTTP or Redis) is written by the publisher thread alone:
 * puts, removals and evictions hand it their work and wait for it (bounded);
 * it keeps the entries alive, restores them after a registry restart, and
 * keeps the removals it could not make, retrying with exponential back-off,
 * so an evicted id leaves the registry when it comes back. No other thread
 * waits on the registry: the rendezvous thread never does, and a put waits
 * at most the producer's timeout.
 */
#include "producer/producer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MOD "producer"
#define BACKOFF_MIN_MS 100
#define BACKOFF_MAX_MS 2000
#define SYNC_MAX_MS 2000
/* While the registry stays down, how often the log says so again. */
#define PUB_REMIND_MS 60000

/* One piece of work for the publisher. A caller that waits owns the op
 * until it is done, unless it gave up (abandoned), in which case the
 * publisher frees it; an op nobody waits for is the publisher's. */
typedef struct pub_op {
	struct pub_op *next;
	bool del; /* unpublish; otherwise publish */
	bool waited, done, abandoned;
	int rc;
	char why[256];
	ecx_entry e;
	char id[ECX_ID_MAX + 1];
} pub_op;

/* A transport-level failure: the registry may come back. */
static bool pub_transient(int rc)
{
	return rc == ECX_ECONNECT || rc == ECX_ETIMEDOUT || rc == ECX_EIO ||
	       rc == ECX_EPROTO;
}

static void pub_deadline(struct timespec *ts, uint64_t ms)
{
	clock_gettime(CLOCK_MONOTONIC, ts);
	ts->tv_sec += (time_t)(ms / 1000);
	ts->tv_nsec += (long)(ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

/* Called with pub_lock held. */
static void pub_enqueue(ecx_producer *p, pub_op *op, bool front)
{
	if (front) {
		op->next = p->pub_head;
		p->pub_head = op;
		if (p->pub_tail == NULL)
			p->pub_tail = op;
	} else {
		op->next = NULL;
		if (p->pub_tail != NULL)
			p->pub_tail->next = op;
		else
			p->pub_head = op;
		p->pub_tail = op;
	}
	if (op->del)
		p->pub_dels++;
	pthread_cond_broadcast(&p->pub_cond);
}

static pub_op *pub_pop(ecx_producer *p)
{
	pub_op *op = p->pub_head;
	if (op == NULL)
		return NULL;
	p->pub_head = op->next;
	if (p->pub_head == NULL)
		p->pub_tail = NULL;
	op->next = NULL;
	if (op->del)
		p->pub_dels--;
	return op;
}

/* Finishes op with rc. Called with pub_lock held. */
static void pub_finish(ecx_producer *p, pub_op *op, int rc, const char *why)
{
	op->rc = rc;
	ecx_strlcpy(op->why, why != NULL ? why : "", sizeof(op->why));
	if (!op->waited || op->abandoned) {
		free(op);
		return;
	}
	op->done = true;
	pthread_cond_broadcast(&p->pub_done);
}

/* A removal nobody waits for, made from op (which a caller waits for). */
static pub_op *pub_del_copy(const pub_op *op)
{
	pub_op *copy = calloc(1, sizeof(*copy));
	if (copy == NULL) {
		ecx_warn(MOD, "out of memory: %s stays in the registry",
		         op->id);
		return NULL;
	}
	copy->del = true;
	ecx_strlcpy(copy->id, op->id, sizeof(copy->id));
	return copy;
}

/* Keeps a removal the registry did not take, first for the next try. */
static void pub_keep(ecx_producer *p, pub_op *op)
{
	pub_op *copy = op->waited ? pub_del_copy(op) : op;
	if (copy != NULL)
		pub_enqueue(p, copy, true);
}

/* Records the registry's state after a call that ended with rc (0 when
 * it answered). An outage is logged once, when a failure that no caller
 * reports shows it (said: a renewal, a removal; a put's caller reports its
 * own), then at most every PUB_REMIND_MS while it lasts, and once more
 * when the registry answers again. */
static void pub_mark(ecx_producer *p, int rc, const char *why, bool said)
{
	uint64_t now = ecx_now_ms();
	if (rc == 0) {
		if (p->pub_down_until != 0 && p->pub_down_said)
			ecx_warn(MOD,
			         "the registry answers again, after %.1f s "
			         "(%zu removals queued)",
			         (double)(now - p->pub_down_since) / 1000.0,
			         p->pub_dels);
		else if (p->pub_down_until != 0)
			ecx_info(MOD, "the registry answers again");
		p->pub_down_until = 0;
		p->pub_down_said = false;
		p->pub_backoff_ms = BACKOFF_MIN_MS;
		return;
	}
	if (p->pub_down_until == 0) {
		p->pub_down_since = now;
		p->pub_down_said = false;
	}
	if (said && !p->pub_down_said) {
		ecx_warn(MOD,
		         "%s (trying it again with back-off until it answers; "
		         "removals are queued until then)",
		         why);
		p->pub_down_said = true;
		p->pub_down_told = now;
	} else if (said && now - p->pub_down_told >= PUB_REMIND_MS) {
		ecx_warn(MOD,
		         "the registry still does not answer after %llu s: %s",
		         (unsigned long long)((now - p->pub_down_since) / 1000),
		         why);
		p->pub_down_told = now;
	}
	p->pub_down_until = now + p->pub_backoff_ms;
	ecx_strlcpy(p->pub_down_why, why, sizeof(p->pub_down_why));
	p->pub_backoff_ms *= 2;
	if (p->pub_backoff_ms > BACKOFF_MAX_MS)
		p->pub_backoff_ms = BACKOFF_MAX_MS;
}

/* The registry is known to be down: publishes fail at once (the put says
 * so), removals stay queued for when it is back. Called with pub_lock
 * held. */
static void pub_refuse_publishes(ecx_producer *p)
{
	pub_op *head = p->pub_head;
	p->pub_head = p->pub_tail = NULL;
	p->pub_dels = 0;
	while (head != NULL) {
		pub_op *op = head;
		head = op->next;
		op->next = NULL;
		if (op->del && !op->waited) {
			pub_enqueue(p, op, false);
			continue;
		}
		if (op->del) {
			pub_op *copy = pub_del_copy(op);
			if (copy != NULL)
				pub_enqueue(p, copy, false);
			pub_finish(p, op, ECX_ECONNECT, p->pub_down_why);
			continue;
		}
		char why[320];
		snprintf(why, sizeof(why),
		         "%s (the registry is down; trying it again with "
		         "back-off)",
		         p->pub_down_why);
		pub_finish(p, op, ECX_ECONNECT, why);
	}
}

/* Keeps the remote registry's entries alive and restores what a registry
 * restart lost. Called by the publisher without any lock. */
static int pub_sync(ecx_producer *p, size_t *held, char *why, size_t whylen)
{
	pthread_mutex_lock(&p->lock);
	size_t n = 0;
	char(*ids)[ECX_ID_MAX + 1] = malloc((p->nitems + 1) * sizeof(*ids));
	const char **ptrs = malloc((p->nitems + 1) * sizeof(*ptrs));
	ecx_entry *es = malloc((p->nitems + 1) * sizeof(*es));
	for (size_t b = 0; ids && ptrs && es && b < p->nbuckets; b++) {
		for (item *it = p->buckets[b]; it != NULL; it = it->hnext) {
			if (!it->ready)
				continue;
			ecx_strlcpy(ids[n], it->id, sizeof(ids[n]));
			ptrs[n] = ids[n];
			memset(&es[n], 0, sizeof(es[n]));
			es[n].desc = it->desc;
			ecx_strlcpy(es[n].producer_zmq, p->address,
			            sizeof(es[n].producer_zmq));
			es[n].epoch = p->epoch;
			es[n].ttl_s = (uint32_t)p->ttl_s;
			n++;
		}
	}
	pthread_mutex_unlock(&p->lock);
	*held = n;
	int rc = 0;
	size_t again = 0;
	if (ids == NULL || ptrs == NULL || es == NULL)
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	else
		rc = ecx_regclient_sync(p->remote, ptrs, es, n, &again, why,
		                        whylen);
	/* Redis with a TTL writes every entry again each time. */
	if (rc == 0 && again > 0 && (!p->redis || p->ttl_s <= 0))
		ecx_info(MOD,
		         "the registry restarted or lost entries: published "
		         "%zu items again",
		         again);
	free(ids);
	free(ptrs);
	free(es);
	return rc;
}

/* The embedded registry: after an HTTP write (someone DELETEd or replaced
 * an entry), counts this producer's entries; when fewer than it holds,
 * puts every item it holds again. The puts are made under p->lock, each
 * only while its item is still held, so a removal (which unpublishes
 * after it lets the lock go) always comes after them. Returns how many
 * were put again. Called by the publisher without any lock. */
static size_t pub_sync_embedded(ecx_producer *p, uint64_t *seen)
{
	uint64_t w = ecx_registry_http_writes(p->registry);
	if (w == *seen)
		return 0;
	*seen = w;
	ecx_store *s = ecx_registry_store(p->registry);
	char why[256];
	size_t listed = 0;
	if (s->ops->renew(s, p->address, p->epoch, 0, &listed, why,
	                  sizeof(why)) != 0)
		return 0;
	size_t again = 0;
	pthread_mutex_lock(&p->lock);
	size_t held = 0;
	for (size_t b = 0; b < p->nbuckets; b++)
		for (item *it = p->buckets[b]; it != NULL; it = it->hnext)
			held += it->ready;
	for (size_t b = 0; listed < held && b < p->nbuckets; b++) {
		for (item *it = p->buckets[b]; it != NULL; it = it->hnext) {
			if (!it->ready)
				continue;
			ecx_entry e;
			memset(&e, 0, sizeof(e));
			e.desc = it->desc;
			ecx_strlcpy(e.producer_zmq, p->address,
			            sizeof(e.producer_zmq));
			e.epoch = p->epoch;
			if (s->ops->put(s, it->id, &e, why, sizeof(why)) == 0)
				again++;
		}
	}
	pthread_mutex_unlock(&p->lock);
	if (again > 0)
		ecx_info(MOD,
		         "%zu of the %zu items held had left the embedded "
		         "registry (removed by HTTP): published %zu again",
		         held - listed, held, again);
	return again;
}

static void *pub_main(void *arg)
{
	ecx_producer *p = arg;
	uint64_t period = p->ttl_s > 0 ? (uint64_t)p->ttl_s * 1000 / 3 : 0;
	if (period == 0 || period > SYNC_MAX_MS)
		period = SYNC_MAX_MS;
	uint64_t next_sync = ecx_now_ms() + period;
	uint64_t seen_writes = 0;
	char why[256];
	pthread_mutex_lock(&p->pub_lock);
	while (!p->pub_stop) {
		uint64_t now = ecx_now_ms();
		bool down = p->pub_down_until != 0 && now < p->pub_down_until;
		if (down)
			pub_refuse_publishes(p);
		uint64_t wake = down                  ? p->pub_down_until
		                : p->pub_head != NULL ? now
		                                      : next_sync;
		/* After an outage, the retry is the oldest removal, or the
		 * sync when there is none. */
		bool retry = p->pub_down_until != 0 && !down;
		if (wake > now && !retry) {
			struct timespec ts;
			pub_deadline(&ts, wake - now);
			pthread_cond_timedwait(&p->pub_cond, &p->pub_lock, &ts);
			continue;
		}
		pub_op *op = pub_pop(p);
		if (op != NULL) {
			pthread_mutex_unlock(&p->pub_lock);
			int rc;
			why[0] = '\0';
			if (op->del)
				rc = ecx_regclient_delete(p->remote, op->id,
				                          p->address, why,
				                          sizeof(why));
			else
				rc =
				    ecx_regclient_put(p->remote, op->id, &op->e,
				                      why, sizeof(why));
			pthread_mutex_lock(&p->pub_lock);
			if (op->del && rc == ECX_ENOTFOUND)
				rc = 0; /* gone already: what was wanted */
			bool transient = pub_transient(rc);
			/* A put's caller reports its failure. */
			pub_mark(p, transient ? rc : 0, why, op->del);
			if (rc != 0 && !transient && op->del)
				ecx_warn(MOD, "cannot unpublish %s: %s", op->id,
				         why);
			if (transient && op->del) {
				pub_keep(p, op);
				if (op->waited)
					pub_finish(p, op, rc, why);
			} else {
				pub_finish(p, op, rc, why);
			}
			continue;
		}
		if (p->remote == NULL && now >= next_sync) {
			pthread_mutex_unlock(&p->pub_lock);
			pub_sync_embedded(p, &seen_writes);
			pthread_mutex_lock(&p->pub_lock);
			next_sync = ecx_now_ms() + period;
		} else if (retry || now >= next_sync) {
			pthread_mutex_unlock(&p->pub_lock);
			size_t held = 0;
			int rc = pub_sync(p, &held, why, sizeof(why));
			pthread_mutex_lock(&p->pub_lock);
			next_sync = ecx_now_ms() + period;
			/* Said when entries lapse or removals wait: with
			 * neither, only the next put, which says it, cares. */
			pub_mark(p, pub_transient(rc) ? rc : 0, why,
			         held > 0 || p->pub_dels > 0);
			if (rc != 0 && !pub_transient(rc))
				ecx_warn(MOD, "registry: %s", why);
		}
	}
	pthread_mutex_unlock(&p->pub_lock);
	return NULL;
}

int prod_publisher_start(ecx_producer *p, char *why, size_t whylen)
{
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&p->pub_cond, &ca);
	pthread_cond_init(&p->pub_done, &ca);
	pthread_condattr_destroy(&ca);
	pthread_mutex_init(&p->pub_lock, NULL);
	p->pub_backoff_ms = BACKOFF_MIN_MS;
	p->pub_inited = true;
	/* With the embedded registry the publisher only keeps the entries
	 * there (pub_sync_embedded); every other write is made directly. */
	if (p->remote == NULL && p->registry == NULL)
		return 0;
	int e = pthread_create(&p->pub_thread, NULL, pub_main, p);
	if (e != 0)
		return ecx_why(why, whylen, ECX_ENOMEM,
		               "cannot start the publisher thread: %s",
		               strerror(e));
	p->pub_running = true;
	return 0;
}

/* Tries the removals still queued once each, stopping at the first the
 * registry does not take; what is left is logged. Called by destroy after
 * the publisher stopped. */
static void pub_drain(ecx_producer *p)
{
	char why[256];
	bool reachable = p->pub_down_until == 0;
	size_t left = 0;
	pub_op *op;
	while ((op = pub_pop(p)) != NULL) {
		int rc = ECX_ECONNECT;
		if (op->del && reachable) {
			rc = ecx_regclient_delete(p->remote, op->id, p->address,
			                          why, sizeof(why));
			if (pub_transient(rc))
				reachable = false;
		}
		if (op->del && rc != 0 && rc != ECX_ENOTFOUND)
			left++;
		if (op->waited && !op->abandoned) {
			op->done = true;
			op->rc = ECX_ECONNECT;
		} else {
			free(op);
		}
	}
	if (left > 0)
		ecx_warn(MOD,
		         "%zu entries stay in the registry (it cannot be "
		         "reached); they expire with their TTL",
		         left);
}

void prod_publisher_stop(ecx_producer *p)
{
	if (!p->pub_inited)
		return;
	if (p->pub_running) {
		pthread_mutex_lock(&p->pub_lock);
		p->pub_stop = true;
		pthread_cond_broadcast(&p->pub_cond);
		pthread_mutex_unlock(&p->pub_lock);
		pthread_join(p->pub_thread, NULL);
		p->pub_running = false;
	}
	if (p->remote != NULL) {
		/* Everything still held leaves with the producer. */
		for (size_t b = 0; p->buckets != NULL && b < p->nbuckets; b++)
			for (item *it = p->buckets[b]; it != NULL;
			     it = it->hnext)
				if (it->ready)
					prod_unpublish_queue(p, it->id);
		pub_drain(p);
	}
	pthread_cond_destroy(&p->pub_cond);
	pthread_cond_destroy(&p->pub_done);
	pthread_mutex_destroy(&p->pub_lock);
	p->pub_inited = false;
}

/* Waits for op to be done, at most the producer's timeout; gives it up
 * (the publisher frees it) when the time is over. Called with pub_lock
 * held; returns op's rc with why. */
static int pub_wait(ecx_producer *p, pub_op *op, char *why, size_t whylen)
{
	struct timespec ts;
	pub_deadline(&ts, (uint64_t)p->timeout_ms);
	while (!op->done) {
		if (pthread_cond_timedwait(&p->pub_done, &p->pub_lock, &ts) ==
		        ETIMEDOUT &&
		    !op->done) {
			/* Still queued: take it out; started: the publisher
			 * frees it when it ends. */
			pub_op **pp = &p->pub_head;
			pub_op *prev = NULL;
			while (*pp != NULL && *pp != op) {
				prev = *pp;
				pp = &(*pp)->next;
			}
			if (*pp == op && op->del) {
				/* A removal is never given up: it stays
				 * queued, nobody's to wait for, and is made
				 * when the registry answers. */
				op->waited = false;
			} else if (*pp == op) {
				*pp = op->next;
				if (p->pub_tail == op)
					p->pub_tail = prev;
				free(op);
			} else {
				op->abandoned = true;
			}
			return ecx_why(why, whylen, ECX_ETIMEDOUT,
			               "the registry did not answer within "
			               "%d ms",
			               p->timeout_ms);
		}
	}
	int rc = op->rc;
	if (rc != 0)
		ecx_strlcpy(why, op->why, whylen);
	free(op);
	return rc;
}

/* ---- what the other files call ---- */

int prod_publish(ecx_producer *p, const char *id, const ecx_tensor_desc *d,
                 char *why, size_t whylen)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	e.desc = *d;
	ecx_strlcpy(e.producer_zmq, p->address, sizeof(e.producer_zmq));
	e.epoch = p->epoch;
	if (p->registry != NULL) {
		ecx_store *s = ecx_registry_store(p->registry);
		int rc = s->ops->put(s, id, &e, why, whylen);
		if (rc == 0)
			ecx_registry_count_publish(p->registry, false);
		return rc;
	}
	pub_op *op = calloc(1, sizeof(*op));
	if (op == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	e.ttl_s = (uint32_t)p->ttl_s; /* renewed by the publisher */
	op->e = e;
	op->waited = true;
	ecx_strlcpy(op->id, id, sizeof(op->id));
	pthread_mutex_lock(&p->pub_lock);
	pub_enqueue(p, op, false);
	int rc = pub_wait(p, op, why, whylen);
	if (rc == ECX_ETIMEDOUT) {
		/* The publish may land after all: take it back. */
		pub_op *d = calloc(1, sizeof(*d));
		if (d != NULL) {
			d->del = true;
			ecx_strlcpy(d->id, id, sizeof(d->id));
			pub_enqueue(p, d, false);
		}
	}
	pthread_mutex_unlock(&p->pub_lock);
	return rc;
}

/* Hands the removal of id to the publisher without waiting. */
void prod_unpublish_queue(ecx_producer *p, const char *id)
{
	pub_op *op = calloc(1, sizeof(*op));
	if (op == NULL) {
		ecx_warn(MOD, "out of memory: %s stays in the registry", id);
		return;
	}
	op->del = true;
	ecx_strlcpy(op->id, id, sizeof(op->id));
	pub_enqueue(p, op, false);
}

void prod_unpublish_many(ecx_producer *p, const char (*ids)[ECX_ID_MAX + 1],
                         size_t n)
{
	char why[256];
	if (n == 0)
		return;
	if (p->registry != NULL) {
		ecx_store *s = ecx_registry_store(p->registry);
		for (size_t i = 0; i < n; i++) {
			int rc = s->ops->del(s, ids[i], p->address, why,
			                     sizeof(why));
			if (rc == 0)
				ecx_registry_count_publish(p->registry, true);
			else if (rc != ECX_ENOTFOUND)
				ecx_warn(MOD, "cannot unpublish %s: %s", ids[i],
				         why);
		}
		return;
	}
	pthread_mutex_lock(&p->pub_lock);
	for (size_t i = 0; i + 1 < n; i++)
		prod_unpublish_queue(p, ids[i]);
	/* The last is waited for: the publisher takes them in order, so
	 * when it is settled (gone, or kept for when the registry is back)
	 * so are the others. */
	pub_op *op = calloc(1, sizeof(*op));
	if (op == NULL) {
		prod_unpublish_queue(p, ids[n - 1]);
		pthread_mutex_unlock(&p->pub_lock);
		return;
	}
	op->del = true;
	op->waited = true;
	ecx_strlcpy(op->id, ids[n - 1], sizeof(op->id));
	pub_enqueue(p, op, false);
	int rc = pub_wait(p, op, why, sizeof(why));
	pthread_mutex_unlock(&p->pub_lock);
	if (rc == ECX_ETIMEDOUT)
		ecx_warn(MOD, "unpublishing %zu ids: %s (they stay queued)", n,
		         why);
}

void prod_unpublish(ecx_producer *p, const char *id)
{
	char one[1][ECX_ID_MAX + 1];
	ecx_strlcpy(one[0], id, sizeof(one[0]));
	prod_unpublish_many(p, (const char(*)[ECX_ID_MAX + 1]) one, 1);
}

size_t prod_unpublish_pending(ecx_producer *p)
{
	if (!p->pub_inited || p->remote == NULL)
		return 0;
	pthread_mutex_lock(&p->pub_lock);
	size_t n = p->pub_dels;
	pthread_mutex_unlock(&p->pub_lock);
	return n;
}
