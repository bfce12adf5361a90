/*
 * mooncake.c - loads from producers that speak only the reference's
 * protocol: each item is one reference pull op ({"op":"pull", "mm_hash",
 * "dst_session", "dst_ptr", "nbytes"}) on a ZeroMQ REQ socket of its own,
 * answered once the producer has written the bytes into this consumer's
 * Mooncake receiver (mooncake/receiver.h), which takes them only inside
 * the range reserved for that item and before the load's deadline. A
 * batch to one producer goes as parallel pulls, one socket each: the
 * producer's REP socket serves them one at a time.
 */
#include "consumer/consumer.h"

#include <zmq.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "consumer"

/* Idle REQ sockets kept for later pulls, all producers together. */
#define MC_IDLE_MAX 64

typedef struct mcsock {
	struct mcsock *next;
	char address[ECX_ADDR_MAX];
	void *sock;
	void *mon; /* PAIR socket taking sock's connection events (or NULL) */
	bool down; /* the connection went, or a connect was refused */
} mcsock;

typedef struct mczombie {
	struct mczombie *next;
	mcsock *ms;
	uint64_t off; /* the receive-arena allocation quarantined */
	bool quar;
	uint64_t until_ms;
} mczombie;

typedef struct mcpull {
	size_t idx;   /* the load's item */
	mcsock *ms;   /* its socket while the answer is awaited */
	uint64_t res; /* its reservation in the receiver (0: none) */
	region *reg;  /* the region its destination is in, pinned */
	bool done;
} mcpull;

int cons_mc_mode(const char *s, int *mode, char *why, size_t whylen)
{
	const char *from = "mooncake";
	if (s == NULL || s[0] == '\0') {
		s = getenv("ECX_MOONCAKE");
		from = "ECX_MOONCAKE";
	}
	if (s == NULL || s[0] == '\0' || strcmp(s, "auto") == 0)
		*mode = CONS_MC_AUTO;
	else if (strcmp(s, "off") == 0)
		*mode = CONS_MC_OFF;
	else if (strcmp(s, "force") == 0)
		*mode = CONS_MC_FORCE;
	else
		return ecx_why(why, whylen, ECX_EINVAL,
		               "%s=%s: use auto (the default), off or force",
		               from, s);
	return 0;
}

bool cons_mc_wants(const ecx_consumer *c, const ecx_item *x)
{
	return c->mc_mode == CONS_MC_FORCE ||
	       (x->epoch == ECX_EPOCH_REFERENCE && c->mc_mode != CONS_MC_OFF);
}

/* Starts the receiver and what it needs. Called with c->lock. */
int cons_mc_ensure(ecx_consumer *c, char *why, size_t whylen)
{
	if (c->mc != NULL)
		return 0;
	/* The rendezvous client's context: no threads of its own. */
	c->mc_zctx = ecx_rdv_client_zctx(c->rdv);
	int rc =
	    ecx_mc_recv_create(c->mc_bind, c->mc_host, &c->mc, why, whylen);
	if (rc != 0)
		return rc;
	if (c->arena.live)
		cons_mc_region(c, &c->arena, true);
	for (unsigned i = 0; i < c->rcache->n; i++)
		if (c->rcache->r[i].live)
			cons_mc_region(c, &c->rcache->r[i], true);
	return 0;
}

/* The connection events that end a pull at once: a REQ socket whose
 * connection goes loses the request it sent (the producer was killed, or
 * its host), and a refused connect means nothing listens there. */
#define MC_DOWN_EVENTS (ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECT_RETRIED)

static void sock_close(mcsock *m)
{
	if (m->mon != NULL) {
		zmq_socket_monitor(m->sock, NULL, 0);
		zmq_close(m->mon);
	}
	zmq_close(m->sock);
	free(m);
}

/* Reads m's connection events so far (never blocks); whether one of them
 * says the connection is down. */
static bool sock_down(mcsock *m)
{
	while (m->mon != NULL && !m->down) {
		zmq_msg_t ev;
		zmq_msg_init(&ev);
		if (zmq_msg_recv(&ev, m->mon, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&ev);
			break;
		}
		uint16_t id = 0;
		if (zmq_msg_size(&ev) >= sizeof(id))
			memcpy(&id, zmq_msg_data(&ev), sizeof(id));
		bool more = zmq_msg_more(&ev);
		zmq_msg_close(&ev);
		if (more) { /* the event's second frame: the endpoint */
			zmq_msg_init(&ev);
			zmq_msg_recv(&ev, m->mon, 0);
			zmq_msg_close(&ev);
		}
		if (id & MC_DOWN_EVENTS)
			m->down = true;
	}
	return m->down;
}

/* An idle socket to address whose connection is still up, or a new one;
 * NULL when ZeroMQ cannot. Called with c->lock. */
static mcsock *sock_take(ecx_consumer *c, const char *address)
{
	for (mcsock **pp = &c->mc_idle; *pp != NULL;) {
		mcsock *m = *pp;
		if (strcmp(m->address, address) != 0) {
			pp = &m->next;
			continue;
		}
		*pp = m->next;
		c->mc_nidle--;
		if (!sock_down(m))
			return m;
		sock_close(m); /* the producer went while it was idle */
	}
	mcsock *m = calloc(1, sizeof(*m));
	if (m == NULL)
		return NULL;
	ecx_strlcpy(m->address, address, sizeof(m->address));
	m->sock = zmq_socket(c->mc_zctx, ZMQ_REQ);
	int zero = 0, one = 1;
	int64_t maxmsg = ECX_ZMQ_MAX_MSG;
	if (m->sock == NULL ||
	    zmq_setsockopt(m->sock, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
	    zmq_setsockopt(m->sock, ZMQ_IPV6, &one, sizeof(one)) != 0 ||
	    zmq_setsockopt(m->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) !=
	        0) {
		if (m->sock != NULL)
			zmq_close(m->sock);
		free(m);
		return NULL;
	}
	/* Its connection events, watched before it connects. Without them
	 * (ZeroMQ cannot) a dead producer costs the load's timeout, as
	 * before. */
	/* A name never used before: a closed monitor's may linger. */
	static uint64_t mon_seq;
	char ep[64];
	snprintf(ep, sizeof(ep), "inproc://ecx-mc-mon-%p-%llu", (void *)c,
	         (unsigned long long)__atomic_add_fetch(&mon_seq, 1,
	                                                __ATOMIC_RELAXED));
	if (zmq_socket_monitor(m->sock, ep, MC_DOWN_EVENTS) == 0) {
		m->mon = zmq_socket(c->mc_zctx, ZMQ_PAIR);
		if (m->mon != NULL &&
		    zmq_setsockopt(m->mon, ZMQ_LINGER, &zero, sizeof(zero)) ==
		        0 &&
		    zmq_connect(m->mon, ep) != 0) {
			zmq_close(m->mon);
			m->mon = NULL;
		}
		if (m->mon == NULL)
			zmq_socket_monitor(m->sock, NULL, 0);
	}
	if (zmq_connect(m->sock, address) != 0) {
		sock_close(m);
		return NULL;
	}
	return m;
}

/* A socket that had its answer goes back to the idle ones; one that did
 * not (a REQ socket cannot send again before it) is closed. Called with
 * c->lock. */
static void sock_give(ecx_consumer *c, mcsock *m, bool answered)
{
	if (m == NULL)
		return;
	if (answered && c->mc_nidle < MC_IDLE_MAX) {
		m->next = c->mc_idle;
		c->mc_idle = m;
		c->mc_nidle++;
		return;
	}
	sock_close(m);
}

/* Item k of l failed with err; the first failure's words are kept. */
static void mc_fail(ecx_load *l, mcpull *p, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void mc_fail(ecx_load *l, mcpull *p, int err, const char *fmt, ...)
{
	ecx_item *x = &l->items[p->idx];
	x->status = err;
	if (l->why_err == 0) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(l->why, sizeof(l->why), fmt, ap);
		va_end(ap);
		l->why_err = err;
		ecx_debug(MOD, "%s", l->why);
	}
}

/* Ends the zombies that have their answer (the producer is done with the
 * range: its write came, or failed), whose connection went, or that are
 * past ECX_MC_ZOMBIE_MS; all of them when all. Called with c->lock. */
static void zombies_poll(ecx_consumer *c, bool all)
{
	uint64_t now = c->mc_zombies != NULL ? ecx_now_ms() : 0;
	for (mczombie **zp = &c->mc_zombies; *zp != NULL;) {
		mczombie *z = *zp;
		char buf[256];
		int n = zmq_recv(z->ms->sock, buf, sizeof(buf), ZMQ_DONTWAIT);
		if (n < 0 && !all && now < z->until_ms && !sock_down(z->ms)) {
			zp = &z->next;
			continue;
		}
		*zp = z->next;
		if (z->quar)
			cons_arena_unquarantine(c, z->off);
		sock_give(c, z->ms, n >= 0 && !all);
		free(z);
	}
}

void cons_mc_start(ecx_consumer *c, ecx_load *l, const size_t *idx, size_t n)
{
	l->mc = calloc(n, sizeof(*l->mc));
	if (l->mc == NULL) {
		for (size_t k = 0; k < n; k++)
			l->items[idx[k]].status = ECX_ENOMEM;
		return;
	}
	l->nmc = n;
	for (size_t k = 0; k < n; k++) {
		l->mc[k].idx = idx[k];
		const ecx_item *x = &l->items[idx[k]];
		uint64_t a = (uint64_t)(uintptr_t)x->dst;
		if (x->desc.nbytes > 0)
			cons_span_populate(c, a, a + x->desc.nbytes);
	}
	char why[256];
	pthread_mutex_lock(&c->lock);
	zombies_poll(c, false);
	int rc = cons_mc_ensure(c, why, sizeof(why));
	char session[ECX_ADDR_MAX] = "";
	if (rc == 0)
		ecx_strlcpy(session, ecx_mc_recv_session(c->mc),
		            sizeof(session));
	for (size_t k = 0; k < n; k++) {
		mcpull *p = &l->mc[k];
		ecx_item *x = &l->items[p->idx];
		p->done = true;
		if (rc != 0) {
			mc_fail(l, p, rc, "%s: no Mooncake receiver: %s", x->id,
			        why);
			continue;
		}
		int err = 0;
		uint64_t nb = x->desc.nbytes;
		void *dst = nb > 0 ? x->dst : c->zero;
		uint64_t a = (uint64_t)(uintptr_t)dst;
		p->reg =
		    cons_region_for(c, dst, nb, a, a + (nb ? nb : 1), &err);
		if (p->reg == NULL) {
			mc_fail(l, p, err,
			        "%s: no registration for its destination",
			        x->id);
			continue;
		}
		if (nb > 0 && (p->res = ecx_mc_recv_reserve(
		                   c->mc, a, nb, l->deadline_ns)) == 0) {
			mc_fail(l, p, ECX_ENOMEM, "%s: out of memory", x->id);
			continue;
		}
		p->ms = sock_take(c, x->producer);
		if (p->ms == NULL) {
			mc_fail(l, p, ECX_ECONNECT,
			        "%s: cannot open a ZeroMQ socket to %s: %s",
			        x->id, x->producer, zmq_strerror(zmq_errno()));
			continue;
		}
		p->done = false;
		c->st.mc_pulls++;
	}
	pthread_mutex_unlock(&c->lock);
	size_t left = 0;
	for (size_t k = 0; k < n; k++) {
		mcpull *p = &l->mc[k];
		if (p->done)
			continue;
		ecx_item *x = &l->items[p->idx];
		uint64_t nb = x->desc.nbytes;
		char *msg = ecx_zreq_encode_pull(
		    x->id, session,
		    (uint64_t)(uintptr_t)(nb > 0 ? x->dst : c->zero), nb);
		/* Queued at once, even while the socket connects. */
		int s = msg != NULL ? zmq_send(p->ms->sock, msg, strlen(msg),
		                               ZMQ_DONTWAIT)
		                    : -1;
		free(msg);
		if (s < 0) {
			p->done = true;
			mc_fail(l, p, ECX_ECONNECT,
			        "%s: cannot send the reference pull to %s: %s",
			        x->id, x->producer, zmq_strerror(zmq_errno()));
			continue;
		}
		left++;
	}
	__atomic_store_n(&l->mc_left, left, __ATOMIC_RELEASE);
}

bool cons_mc_done(const ecx_load *l)
{
	return __atomic_load_n(&l->mc_left, __ATOMIC_ACQUIRE) == 0;
}

/* What the producer's "err" says, as an ecx error. */
static int ref_err(const char *err)
{
	if (strcmp(err, "unknown mm_hash") == 0)
		return ECX_ENOTFOUND;
	if (strcmp(err, "size mismatch") == 0)
		return ECX_ESIZE;
	if (strcmp(err, "unknown op") == 0)
		return ECX_EUNSUPPORTED;
	/* An ecx producer with a token refuses a pull without it: another
	 * holder would too, and the cure is the token, not a failover. */
	if (strstr(err, "token") != NULL)
		return ECX_EAUTH;
	return ECX_EIO;
}

/* The answer buf (n bytes) to pull p. */
static void answer(ecx_load *l, mcpull *p, const char *buf, size_t n)
{
	ecx_consumer *c = l->c;
	ecx_item *x = &l->items[p->idx];
	bool ok = false;
	int64_t ret = 0;
	char err[200], why[200];
	int rc = ecx_ref_reply_decode(buf, n, &ok, &ret, err, sizeof(err), why,
	                              sizeof(why));
	/* Whatever it says, nothing more lands in the item's range. */
	uint64_t landed = p->res != 0 ? ecx_mc_recv_release(c->mc, p->res) : 0;
	p->res = 0;
	uint64_t nb = x->desc.nbytes;
	/* mooncake_ret only where the producer gave one. */
	char retbuf[48] = "";
	if (ret != 0)
		snprintf(retbuf, sizeof(retbuf), " (mooncake_ret %lld)",
		         (long long)ret);
	if (rc != 0)
		mc_fail(l, p, ECX_EPROTO,
		        "%s: reference pull from %s: it answers what is no "
		        "pull reply: %s",
		        x->id, x->producer, why);
	else if (!ok)
		mc_fail(l, p, ref_err(err),
		        "%s: reference pull from %s refused: %s%s", x->id,
		        x->producer, err[0] ? err : "no reason given", retbuf);
	else if (landed < nb)
		mc_fail(l, p, ECX_EIO,
		        "%s: reference pull from %s: it answered ok but %llu "
		        "of %llu bytes came into the Mooncake session",
		        x->id, x->producer, (unsigned long long)landed,
		        (unsigned long long)nb);
	else
		x->status = 0;
	pthread_mutex_lock(&c->lock);
	if (x->status == 0)
		c->st.mc_bytes += nb;
	sock_give(c, p->ms, true);
	pthread_mutex_unlock(&c->lock);
	p->ms = NULL;
	p->done = true;
	__atomic_sub_fetch(&l->mc_left, 1, __ATOMIC_ACQ_REL);
}

/* Pull p's bytes have all landed in its reservation before its answer:
 * the item is done. The reservation is released (nothing more lands in
 * the range), and the socket waits among the zombies, with nothing
 * quarantined, for the answer that frees it for reuse. The answer would
 * add nothing: every byte the item needs came in whole writes into
 * exactly its range, and it costs the producer two thread hand-offs and
 * the consumer a wake-up. */
static void landed_whole(ecx_load *l, mcpull *p)
{
	ecx_consumer *c = l->c;
	ecx_item *x = &l->items[p->idx];
	uint64_t nb = x->desc.nbytes;
	uint64_t landed = ecx_mc_recv_release(c->mc, p->res);
	p->res = 0;
	if (landed >= nb)
		x->status = 0;
	else /* cannot be: landed only grows */
		mc_fail(l, p, ECX_EIO, "%s: reference pull: %llu of %llu bytes",
		        x->id, (unsigned long long)landed,
		        (unsigned long long)nb);
	mczombie *z = calloc(1, sizeof(*z));
	pthread_mutex_lock(&c->lock);
	if (x->status == 0)
		c->st.mc_bytes += nb;
	if (z != NULL) {
		z->ms = p->ms;
		z->until_ms = ecx_now_ms() + ECX_MC_ZOMBIE_MS;
		z->next = c->mc_zombies;
		c->mc_zombies = z;
	} else {
		sock_give(c, p->ms, false);
	}
	pthread_mutex_unlock(&c->lock);
	p->ms = NULL;
	p->done = true;
	__atomic_sub_fetch(&l->mc_left, 1, __ATOMIC_ACQ_REL);
}

/* Pull p's connection went before its answer: the request is lost with
 * it (a REQ socket does not send it again). Ends the reservation; the item
 * fails, unless every byte had landed by then. */
static void lost(ecx_load *l, mcpull *p)
{
	ecx_consumer *c = l->c;
	ecx_item *x = &l->items[p->idx];
	uint64_t landed = p->res != 0 ? ecx_mc_recv_release(c->mc, p->res) : 0;
	p->res = 0;
	if (landed >= x->desc.nbytes)
		x->status = 0;
	else
		mc_fail(l, p, ECX_ECONNECT,
		        "%s: reference pull: the connection to %s went (or "
		        "was refused) before its answer",
		        x->id, x->producer);
	pthread_mutex_lock(&c->lock);
	if (x->status == 0)
		c->st.mc_bytes += x->desc.nbytes;
	sock_give(c, p->ms, false);
	pthread_mutex_unlock(&c->lock);
	p->ms = NULL;
	p->done = true;
	__atomic_sub_fetch(&l->mc_left, 1, __ATOMIC_ACQ_REL);
}

int cons_mc_poll(ecx_load *l)
{
	ecx_consumer *c = l->c;
	if (__atomic_load_n(&c->mc_zombies, __ATOMIC_RELAXED) != NULL &&
	    pthread_mutex_trylock(&c->lock) == 0) {
		zombies_poll(c, false);
		pthread_mutex_unlock(&c->lock);
	}
	if (l->nmc == 0 || cons_mc_done(l))
		return 0;
	int did = 0;
	char buf[4096];
	for (size_t k = 0; k < l->nmc; k++) {
		mcpull *p = &l->mc[k];
		if (p->done)
			continue;
		int n = zmq_recv(p->ms->sock, buf, sizeof(buf), ZMQ_DONTWAIT);
		if (n < 0) {
			uint64_t nb = l->items[p->idx].desc.nbytes;
			if (nb > 0 && p->res != 0 &&
			    ecx_mc_recv_landed(c->mc, p->res) >= nb) {
				landed_whole(l, p);
				did++;
			} else if (sock_down(p->ms)) {
				lost(l, p);
				did++;
			}
			continue;
		}
		answer(l, p, buf,
		       (size_t)n < sizeof(buf) ? (size_t)n : sizeof(buf));
		did++;
	}
	return did;
}

void cons_mc_finish(ecx_load *l)
{
	ecx_consumer *c = l->c;
	int ms = c->timeout_ms;
	for (size_t k = 0; k < l->nmc; k++) {
		mcpull *p = &l->mc[k];
		if (p->res != 0)
			ecx_mc_recv_release(c->mc, p->res);
		p->res = 0;
		if (!p->done) {
			ecx_item *x = &l->items[p->idx];
			mc_fail(l, p, ECX_ETIMEDOUT,
			        "%s: reference pull from %s: it did not answer "
			        "within the load's %d ms",
			        x->id, x->producer, ms);
		}
	}
	pthread_mutex_lock(&c->lock);
	for (size_t k = 0; k < l->nmc; k++) {
		mcpull *p = &l->mc[k];
		if (p->reg != NULL)
			p->reg->inuse--;
		if (p->ms == NULL)
			continue;
		if (p->done) { /* never sent */
			sock_give(c, p->ms, false);
			continue;
		}
		/* Unanswered: the producer may still be writing (refused now,
		 * the reservation is gone); its destination in the arena is
		 * not handed out again until it answers. */
		mczombie *z = calloc(1, sizeof(*z));
		ecx_item *x = &l->items[p->idx];
		arena_alloc *a =
		    x->desc.nbytes > 0
		        ? cons_arena_alloc_at(c, (uint64_t)(uintptr_t)x->dst)
		        : NULL;
		if (z == NULL) {
			sock_give(c, p->ms, false);
			continue;
		}
		z->ms = p->ms;
		z->until_ms = ecx_now_ms() + ECX_MC_ZOMBIE_MS;
		if (a != NULL) {
			a->zombies++;
			c->st_quarantined++;
			z->off = a->off;
			z->quar = true;
		}
		z->next = c->mc_zombies;
		c->mc_zombies = z;
	}
	pthread_mutex_unlock(&c->lock);
	free(l->mc);
	l->mc = NULL;
	l->nmc = 0;
	__atomic_store_n(&l->mc_left, 0, __ATOMIC_RELEASE);
}

void cons_mc_stats(ecx_consumer *c, ecx_consumer_stats *st)
{
	if (c->mc == NULL)
		return;
	ecx_mc_recv_stats s;
	ecx_mc_recv_stats_get(c->mc, &s);
	st->mc_rej_range = s.rej_range;
	st->mc_rej_expired = s.rej_expired;
	st->mc_rej_read = s.rej_read;
	st->mc_rej_header = s.rej_header;
	st->mc_hs_refused = s.hs_refused;
}

void cons_mc_destroy(ecx_consumer *c)
{
	ecx_mc_recv_destroy(c->mc);
	c->mc = NULL;
	pthread_mutex_lock(&c->lock);
	zombies_poll(c, true);
	pthread_mutex_unlock(&c->lock);
	while (c->mc_idle != NULL) {
		mcsock *m = c->mc_idle;
		c->mc_idle = m->next;
		sock_close(m);
	}
	c->mc_zctx = NULL; /* the rendezvous client's: it ends it */
	free(c->mc_bind);
	free(c->mc_host);
}
