/*
 * notify.c - loads whose end the library says on a socket the caller gave
 * (ecx_consumer_load_notify), as one message: its bytes, then each item's
 * status; the caller's thread neither waits for a handshake nor has to
 * run for the load to end. A caller in an interpreter with a global lock
 * (Python) thus learns of the end without a thread of its own that must
 * win that lock, in another process too.
 *
 * A load whose producers are all connected starts in the caller's thread
 * (its pulls go at once, as ecx_consumer_load_start's); any other starts
 * in the load's thread (the handshakes). The thread then waits for the
 * load as a caller of ecx_load_wait does, progressing the worker itself
 * (the progress thread stands aside meanwhile) and yielding its core
 * between polls, where no other notified load's thread of the consumer
 * does so already (else it polls its load every 20 us until it has
 * ended or the other is done: bg_sleep). Left to the progress thread's
 * wake-ups instead, a 64 KiB load took 71-101 us against 14-18 us waited
 * for, 1 MiB 152-370 us against 39-46 (docs/bench.md, "Loads said on a
 * socket"). The thread ends the load (failover and integrity check
 * included) and says it, unless a caller's ecx_load_test found every item
 * loaded first (claim, below): that caller ends it and says it. The
 * handle is an ecx_load whose bg is set; ecx_load_wait joins the thread
 * and frees it.
 */
#include "consumer/consumer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MOD "consumer"
/* How often a notified load's thread that is not driving the worker
 * looks whether its load has ended (bg_sleep). */
#define ECX_BG_POLL_NS 20000L
#define CLAIM_NONE 0
#define CLAIM_THREAD 1
#define CLAIM_CALLER 2

struct cons_bgload {
	ecx_consumer *c;
	ecx_item *items;
	size_t n;
	uint64_t deadline_ns;
	int fd; /* the library's duplicate of the caller's socket, or -1 */
	unsigned char *msg;
	size_t len;
	pthread_t th;
	/* mu guards load and claim: the load (once started) is touched only
	 * under it until one side has claimed it, and then by that side. */
	pthread_mutex_t mu;
	ecx_load *load;
	int claim;    /* CLAIM_*: who ends the load */
	int done;     /* atomic: the load has ended (statuses final) */
	bool driving; /* its thread holds the consumer's bg_driver */
	int rc;
	char why[512]; /* the thread's last error detail, for the waiter */
};

/* Sends the message and the statuses as one send, never blocking: a
 * receiver that is gone or full misses it (the caller's next test finds
 * the end regardless). */
static void bg_say(struct cons_bgload *b)
{
	size_t total = b->len + b->n * sizeof(int32_t);
	unsigned char *buf = malloc(total + 1);
	if (buf == NULL) {
		ecx_warn(MOD, "load end not sent: out of memory");
		return;
	}
	if (b->len > 0)
		memcpy(buf, b->msg, b->len);
	for (size_t i = 0; i < b->n; i++) {
		int32_t s = b->items[i].status;
		memcpy(buf + b->len + i * sizeof(s), &s, sizeof(s));
	}
	if (send(b->fd, buf, total, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
		ecx_debug(MOD, "load end not sent (%zu bytes): %s", total,
		          strerror(errno));
	free(buf);
}

/* Until l is this thread's to end: at once where no other notified load
 * of the consumer is driving the worker (this one then drives it, in
 * bg_end's wait, as a caller of ecx_load_wait does: b->driving), else
 * when l has ended or its deadline (and grace) has passed, polling every
 * ECX_BG_POLL_NS meanwhile: the driving thread's progress moves every
 * load's bytes, and one thread spinning on the worker is enough (several
 * took the cores of each other and of the producer). Meanwhile it hashes
 * what has landed (integrity), takes the reference pulls' answers and
 * watches shared-memory producers, as a waiting caller does. Returns true
 * when this thread is to end l, false when a caller's test has claimed
 * it. */
static bool bg_sleep(struct cons_bgload *b, ecx_load *l)
{
	uint64_t until = l->deadline_ns + ECX_LOAD_GRACE_NS;
	for (;;) {
		pthread_mutex_lock(&b->mu);
		if (b->claim != CLAIM_NONE) {
			pthread_mutex_unlock(&b->mu);
			return false;
		}
		bool end = cons_load_done(l) || ecx_now_ns() >= until;
		if (!end && __atomic_exchange_n(&l->c->bg_driver, 1,
		                                __ATOMIC_ACQ_REL) == 0) {
			__atomic_store_n(&b->driving, true, __ATOMIC_RELAXED);
			end = true;
		}
		if (end) {
			b->claim = CLAIM_THREAD;
			pthread_mutex_unlock(&b->mu);
			return true;
		}
		int did = cons_load_hash_landed(l);
		did += cons_load_read_lanes(l);
		did += cons_mc_poll(l);
		cons_pconns_watch(l->c, false);
		pthread_mutex_unlock(&b->mu);
		if (did == 0) {
			struct timespec ts = {0, ECX_BG_POLL_NS};
			nanosleep(&ts, NULL);
		}
	}
}

/* Ends started load l (its wait, failover included) as the one that
 * claimed it, and says so. */
static void bg_end(struct cons_bgload *b, ecx_load *l)
{
	int rc = cons_load_wait(l);
	if (rc != 0)
		snprintf(b->why, sizeof(b->why), "%s", core_last_error());
	b->rc = rc;
	/* Ended before it is said, so a caller that hears of the end finds
	 * it ended (the thread still runs: the wait joins it). */
	__atomic_store_n(&b->done, 1, __ATOMIC_RELEASE);
	if (b->fd >= 0)
		bg_say(b);
}

static void *bg_main(void *arg)
{
	struct cons_bgload *b = arg;
	pthread_mutex_lock(&b->mu);
	ecx_load *l = b->load;
	bool claimed = b->claim != CLAIM_NONE;
	pthread_mutex_unlock(&b->mu);
	if (claimed) /* started and ended by the caller already */
		return NULL;
	/* Its wait's sleeps (after 2 ms) are short: no timer slack on top
	 * of them. */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	if (l == NULL) {
		int rc = cons_load_start(b->c, b->items, b->n, b->deadline_ns,
		                         false, false, &l);
		if (rc != 0) {
			for (size_t i = 0; i < b->n; i++)
				b->items[i].status = rc;
			snprintf(b->why, sizeof(b->why), "%s",
			         core_last_error());
			b->rc = rc;
			__atomic_store_n(&b->done, 1, __ATOMIC_RELEASE);
			if (b->fd >= 0)
				bg_say(b);
			return NULL;
		}
		l->passive = true;
		pthread_mutex_lock(&b->mu);
		b->load = l;
		pthread_mutex_unlock(&b->mu);
	}
	if (bg_sleep(b, l)) {
		bool drove = __atomic_load_n(&b->driving, __ATOMIC_RELAXED);
		bg_end(b, l);
		if (drove)
			__atomic_store_n(&b->c->bg_driver, 0, __ATOMIC_RELEASE);
		return NULL;
	}
	/* A caller's test ends it (l is its to free): wait for that. */
	while (!__atomic_load_n(&b->done, __ATOMIC_ACQUIRE)) {
		struct timespec ts = {0, ECX_BG_POLL_NS};
		nanosleep(&ts, NULL);
	}
	return NULL;
}

static void bg_free(struct cons_bgload *b)
{
	pthread_mutex_destroy(&b->mu);
	if (b->fd >= 0)
		close(b->fd);
	free(b->msg);
	free(b);
}

/* Whether every item (by producer and epoch) has a working connection now,
 * as conns.c's pconn_find judges one, so that a load of them sends its
 * pulls without a hello (one that fails meanwhile is made again by the
 * load, within its deadline). Items that need no hello count. Takes
 * c->lock. */
static bool bg_connected(ecx_consumer *c, const ecx_item *items, size_t n)
{
	uint64_t now_ms = ecx_now_ms();
	bool ok = true;
	pthread_mutex_lock(&c->lock);
	for (size_t i = 0; i < n && ok; i++) {
		const ecx_item *x = &items[i];
		/* No hello for these: they fail at once, or go over
		 * Mooncake's wire. */
		if (x->producer[0] == '\0' || cons_mc_wants(c, x))
			continue;
		ok = false;
		for (const pconn *pc = c->conns; pc != NULL && !ok;
		     pc = pc->next) {
			if (strcmp(pc->address, x->producer) != 0 ||
			    pc->connecting || pc->failed || pc->ep == NULL)
				continue;
			/* As pconn_find: neither another epoch nor idle. */
			bool restarted = x->epoch != 0 &&
			                 pc->epoch != x->epoch &&
			                 pc->stale_epoch != x->epoch;
			ok = !restarted && !cons_pconn_idle(pc, now_ms);
		}
	}
	pthread_mutex_unlock(&c->lock);
	return ok;
}

int cons_load_notify(ecx_consumer *c, ecx_item *items, size_t n,
                     uint64_t deadline_ns, int fd, const void *msg, size_t len,
                     ecx_load **out)
{
	if (fd >= 0) {
		int type = 0;
		socklen_t tl = sizeof(type);
		if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0)
			return ecx_set_error(
			    ECX_EINVAL, "descriptor %d is not a socket: %s", fd,
			    strerror(errno));
	}
	if (len > ECX_NOTIFY_MSG_MAX)
		return ecx_set_error(ECX_EINVAL,
		                     "a load's message is at most %u bytes, "
		                     "not %zu",
		                     ECX_NOTIFY_MSG_MAX, len);
	ecx_load *l = calloc(1, sizeof(*l));
	struct cons_bgload *b = calloc(1, sizeof(*b));
	if (l == NULL || b == NULL ||
	    (len > 0 && (b->msg = malloc(len)) == NULL)) {
		free(l);
		if (b != NULL)
			free(b->msg);
		free(b);
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	}
	pthread_mutex_init(&b->mu, NULL);
	b->c = c;
	b->items = items;
	b->n = n;
	b->deadline_ns = deadline_ns;
	b->fd = -1;
	if (len > 0)
		memcpy(b->msg, msg, len);
	b->len = len;
	if (fd >= 0 && (b->fd = dup(fd)) < 0) {
		int e = errno;
		bg_free(b);
		free(l);
		return ecx_set_error(ECX_ENOMEM, "dup of descriptor %d: %s", fd,
		                     strerror(e));
	}
	/* Connected to every producer: the pulls go now, from here. */
	if (bg_connected(c, items, n)) {
		ecx_load *in = NULL;
		int rc = cons_load_start(c, items, n, deadline_ns, false, false,
		                         &in);
		if (rc != 0) {
			bg_free(b);
			free(l);
			return rc;
		}
		in->passive = true;
		b->load = in;
	}
	int e = pthread_create(&b->th, NULL, bg_main, b);
	if (e != 0) {
		if (b->load != NULL)
			cons_load_wait(b->load); /* ended here, then */
		bg_free(b);
		free(l);
		return ecx_set_error(ECX_ENOMEM, "no thread for the load: %s",
		                     strerror(e));
	}
	l->c = c;
	l->bg = b;
	*out = l;
	return 0;
}

/* Whether every item of started load l has loaded and its end needs no
 * hashing: the caller's test may then end it. */
static bool bg_clean(ecx_load *l)
{
	if (l->xxh != NULL || !cons_load_done(l))
		return false;
	for (size_t i = 0; i < l->n; i++)
		if (__atomic_load_n(&l->items[i].status, __ATOMIC_ACQUIRE) != 0)
			return false;
	return true;
}

int cons_bg_test(ecx_load *l)
{
	struct cons_bgload *b = l->bg;
	if (__atomic_load_n(&b->done, __ATOMIC_ACQUIRE))
		return 0;
	/* Busy: its thread is looking at it (or hashing): test again. */
	if (pthread_mutex_trylock(&b->mu) != 0)
		return ECX_EBUSY;
	ecx_load *in = b->load;
	if (in != NULL && b->claim == CLAIM_NONE) {
		/* One progress, as ecx_load_test of any load: a caller that
		 * polls helps the bytes in, and ends a load that has loaded
		 * at once (its wait returns at once). */
		ecx_ucx_progress(l->c->ucx);
		cons_load_read_lanes(in);
		if (bg_clean(in)) {
			b->claim = CLAIM_CALLER;
			bg_end(b, in);
			b->load = NULL;
		}
	}
	pthread_mutex_unlock(&b->mu);
	return __atomic_load_n(&b->done, __ATOMIC_ACQUIRE) ? 0 : ECX_EBUSY;
}

int cons_bg_wait(ecx_load *l)
{
	struct cons_bgload *b = l->bg;
	pthread_join(b->th, NULL);
	int rc = b->rc;
	if (rc != 0)
		ecx_set_error(rc, "%s", b->why);
	bg_free(b);
	free(l);
	return rc;
}
