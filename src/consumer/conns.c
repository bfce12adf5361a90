/*
 * conns.c - the consumer's connections to producers: the hello over the
 * rendezvous client, then a UCX endpoint, kept per producer address and
 * epoch; the goodbyes that end replaced ones and, at destroy, all of them.
 * (What fails a connection and its pulls is failures.c; what producers
 * send back on them, replies and data, is replies.c.)
 */
#include "consumer/consumer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MOD "consumer"

/* ---- connections ---- */

ucp_ep_h cons_pconn_cut_locked(pconn *pc)
{
	pc->failed = true;
	if (pc->transport != ECX_TR_TCP || pc->ep == NULL)
		return NULL;
	if (pc->sending > 0) {
		pc->cut = true; /* the last sender closes it */
		return NULL;
	}
	ucp_ep_h ep = pc->ep;
	pc->ep = NULL;
	return ep;
}

void cons_pconn_cut(ecx_consumer *c, ecx_ucx_side *side, ucp_ep_h ep)
{
	/* Forced: nothing is flushed, in either direction. */
	ecx_ucx_side_ep_close(c->ucx, side, ep, ECX_TR_TCP, 100);
}

void cons_pconn_close(ecx_consumer *c, pconn *pc)
{
	if (pc->lane != NULL) {
		cons_lane_kill(pc->lane);
		cons_lane_put(c, pc->lane);
	}
	ecx_ucx_side_ep_close(c->ucx, pc->side, pc->ep, pc->transport, 100);
	ecx_ucx_side_destroy(c->ucx, pc->side);
	if (pc->pidfd >= 0)
		close(pc->pidfd);
	free(pc);
}

/* A placeholder whose hello failed: nothing was made on its side yet. */
static void pconn_discard(ecx_consumer *c, pconn *pc)
{
	ecx_ucx_side_destroy(c->ucx, pc->side);
	if (pc->pidfd >= 0)
		close(pc->pidfd);
	free(pc);
}

static bool pconn_busy(ecx_consumer *c, const pconn *pc, bool *zombies_only)
{
	/* Given to a pull not in flight yet, or being sent on: live. */
	bool busy = pc->users > 0 || pc->sending > 0;
	bool live = busy;
	for (pull *q = c->inflight; q != NULL; q = q->next) {
		if (q->pc != pc)
			continue;
		busy = true;
		live = live || !q->zombie;
	}
	if (zombies_only != NULL)
		*zombies_only = busy && !live;
	return busy;
}

/* Ends every zombie on pc (its producer said nothing of it is in flight,
 * or the connection is known closed). Called with the lock. */
static void pconn_zombies_end(ecx_consumer *c, pconn *pc)
{
	for (pull **pp = &c->inflight; *pp != NULL;) {
		pull *q = *pp;
		if (q->pc != pc || !q->zombie) {
			pp = &q->next;
			continue;
		}
		*pp = q->next;
		cons_zombie_end(c, q);
	}
}

/* What a load needs from one producer. */
typedef struct want {
	struct getter *g;
	pull *p;
	const char *address;
	uint64_t epoch;
	pconn *mine; /* a placeholder this call connects */
	bool wait;   /* another thread is connecting to address */
} want;

/* Finds a working connection to w's address for w's epoch, unlinking the
 * stale ones that no pull uses into *stale, and putting the stale ones
 * that only zombies use on *bye (at most one goodbye each at a time).
 * Called with the lock. */
static pconn *pconn_find(ecx_consumer *c, want *w, uint64_t now_ms,
                         pconn **stale, pconn **bye, size_t *nbye,
                         size_t bye_cap)
{
	pconn *found = NULL;
	w->wait = false;
	for (pconn **pp = &c->conns; *pp != NULL;) {
		pconn *pc = *pp;
		if (strcmp(pc->address, w->address) != 0) {
			pp = &pc->next;
			continue;
		}
		if (pc->connecting) {
			w->wait = true;
			pp = &pc->next;
			continue;
		}
		/* Another epoch: the producer restarted since this connection
		 * was made, unless a reconnect already showed the entry is the
		 * stale one. Idle for half the producer's bound: it may be
		 * closing it, and a pull on a closed connection is lost. */
		bool restarted = w->epoch != 0 && pc->epoch != w->epoch &&
		                 pc->stale_epoch != w->epoch;
		bool idle = cons_pconn_idle(pc, now_ms);
		if (pc->failed || restarted || idle) {
			bool zombies_only = false;
			/* One with a goodbye in flight is its caller's to
			 * free. */
			if (!pc->byeing && !pconn_busy(c, pc, &zombies_only)) {
				*pp = pc->next;
				pc->next = *stale;
				*stale = pc;
				continue;
			}
			pc->failed = true;
			/* At most bye_cap goodbyes per call (an address may
			 * hold several such connections); the rest are said
			 * by a later load. */
			if (zombies_only && !pc->byeing && bye != NULL &&
			    *nbye < bye_cap) {
				pc->byeing = true;
				pc->bye_sent = true;
				bye[(*nbye)++] = pc;
			}
			pp = &pc->next;
			continue;
		}
		if (found == NULL)
			found = pc;
		pp = &pc->next;
	}
	return found;
}

/* Fills placeholder pc from the hello's answer z, making the endpoint.
 * Not under the lock (pc is invisible to others while connecting). */
static int pconn_fill(ecx_consumer *c, pconn *pc, ecx_zresp *z, uint64_t mid_ms,
                      char *why, size_t whylen)
{
	uint64_t asked = pc->epoch;
	pc->epoch = z->epoch;
	if (asked != 0 && z->epoch != asked)
		pc->stale_epoch = asked; /* the entry outlived its producer */
	pc->id = z->conn;
	pc->has_clock = z->now_ms != 0;
	pc->hello_now_ms = z->now_ms;
	pc->hello_mono_ms = mid_ms;
	pc->idle_ms = z->idle_ms;
	pc->used_ms = mid_ms;
	/* A producer from before transports were agreed: what it does. */
	pc->transport = z->transport != 0 ? z->transport
	                : ecx_ucx_transports(c->ucx) == ECX_TR_TCP ? ECX_TR_TCP
	                                                           : ECX_TR_SHM;
	/* UCX's shared-memory transports cannot report a peer that fails (a
	 * TCP endpoint does): over shared memory the producer is on this
	 * host, in this PID namespace (the hello agreed on its shm domain),
	 * so its process is watched instead. */
	if (pc->transport == ECX_TR_SHM && z->pid != 0) {
		pc->pid = (long)z->pid;
		pc->pid_start = z->pid_start;
		pc->pidfd = ecx_pid_watch(pc->pid, z->pid_start);
		if (pc->pidfd == -2) {
			pc->pidfd = -1;
			cons_dead_detail(pc->address, pc->pid, false, why,
			                 whylen);
			return ECX_ECLOSED;
		}
		if (pc->pidfd == -3) {
			pc->pidfd = -1;
			pc->pid_poll = true;
		}
	}
	int rc = ecx_ucx_side_ep_create(
	    c->ucx, pc->side, z->worker, z->worker_len, pc->transport,
	    cons_pconn_on_error, pc, &pc->ep, why, whylen);
	if (rc == 0)
		cons_lane_open(c, pc, z);
	return rc;
}

static void pconn_unlink(ecx_consumer *c, pconn *pc)
{
	for (pconn **pp = &c->conns; *pp != NULL; pp = &(*pp)->next) {
		if (*pp == pc) {
			*pp = pc->next;
			return;
		}
	}
}

/* Handles the answer of a goodbye to pc: "closed" ends its zombies and
 * pc with them. */
static void pconn_bye_done(ecx_consumer *c, pconn *pc, ecx_rdv_call *k)
{
	bool closed = k->err == 0 && k->resp.closed;
	pthread_mutex_lock(&c->lock);
	pc->byeing = false;
	if (closed) {
		pconn_zombies_end(c, pc);
		if (!pconn_busy(c, pc, NULL))
			pconn_unlink(c, pc);
		else
			closed = false;
	}
	pthread_mutex_unlock(&c->lock);
	if (k->err == 0)
		ecx_zresp_free(&k->resp);
	if (closed)
		cons_pconn_close(c, pc);
}

static void deadline_ts(uint64_t deadline_ns, struct timespec *ts)
{
	ts->tv_sec = (time_t)(deadline_ns / 1000000000u);
	ts->tv_nsec = (long)(deadline_ns % 1000000000u);
}

/* One cons_pconns_get call's state, for the round trips' callbacks. */
typedef struct getter {
	ecx_consumer *c;
	ecx_load *l;
	cons_ready_fn ready;
	uint64_t sent_ms;
} getter;

/* A hello ended: the placeholder becomes the connection (and the pull
 * goes at once), or goes. */
static void hello_done(void *arg, ecx_rdv_call *k)
{
	want *w = arg;
	getter *g = w->g;
	ecx_consumer *c = g->c;
	pconn *pc = w->mine;
	uint64_t mid_ms = (g->sent_ms + ecx_now_ms()) / 2;
	int err = k->err;
	char why[400];
	if (err == 0 && k->resp.worker == NULL)
		err =
		    ecx_why(why, sizeof(why), ECX_EPROTO,
		            "producer %s sent no worker address", pc->address);
	else if (err == 0)
		err = pconn_fill(c, pc, &k->resp, mid_ms, why, sizeof(why));
	else
		ecx_strlcpy(why, k->why, sizeof(why));
	if (k->err == 0)
		ecx_zresp_free(&k->resp);
	pthread_mutex_lock(&c->lock);
	if (err != 0) {
		pconn_unlink(c, pc);
		ecx_warn(MOD, "%s", why);
		/* The load's error names the first failed hello's detail. */
		if (g->l->why_err == 0) {
			snprintf(g->l->why, sizeof(g->l->why), "%s", why);
			g->l->why_err = err;
		}
		cons_pull_fail(w->p, err);
	} else {
		pc->connecting = false;
		w->p->pc = pc;
		pc->users++; /* until pull_send puts it in flight */
		c->st.connections++;
	}
	pthread_cond_broadcast(&c->conn_cv);
	pthread_mutex_unlock(&c->lock);
	w->mine = NULL;
	if (err != 0) {
		pconn_discard(c, pc);
		return;
	}
	ecx_debug(MOD, "connected to %s (epoch %llu)", pc->address,
	          (unsigned long long)pc->epoch);
	g->ready(c, g->l, w->p);
}

typedef struct byer {
	ecx_consumer *c;
	pconn *pc;
} byer;

static void bye_done(void *arg, ecx_rdv_call *k)
{
	byer *b = arg;
	pconn_bye_done(b->c, b->pc, k);
}

/* Whether a placeholder for one of the wants still waiting is there.
 * Called with the lock. */
static bool others_connecting(ecx_consumer *c, const want *w, size_t n)
{
	for (size_t k = 0; k < n; k++) {
		if (w[k].p->pc != NULL || w[k].p->done || !w[k].wait)
			continue;
		for (pconn *pc = c->conns; pc != NULL; pc = pc->next)
			if (pc->connecting &&
			    strcmp(pc->address, w[k].address) == 0)
				return true;
	}
	return false;
}

void cons_pconns_get(ecx_consumer *c, ecx_load *l, cons_ready_fn ready)
{
	size_t n = l->npulls;
	getter g = {.c = c, .l = l, .ready = ready};
	want *w = calloc(n + 1, sizeof(*w));
	ecx_rdv_call *calls = calloc(2 * n + 1, sizeof(*calls));
	char **msgs = calloc(2 * n + 1, sizeof(*msgs));
	pconn **bye = calloc(n + 1, sizeof(*bye));
	byer *byers = calloc(n + 1, sizeof(*byers));
	pull **go = calloc(n + 1, sizeof(*go));
	if (w == NULL || calls == NULL || msgs == NULL || bye == NULL ||
	    byers == NULL || go == NULL) {
		pthread_mutex_lock(&c->lock);
		for (size_t k = 0; k < n; k++)
			cons_pull_fail(l->pulls[k], ECX_ENOMEM);
		pthread_mutex_unlock(&c->lock);
		goto out;
	}
	for (size_t k = 0; k < n; k++) {
		const ecx_item *x = &l->items[l->pulls[k]->idx[0]];
		w[k] = (want){.p = l->pulls[k],
		              .address = x->producer,
		              .epoch = x->epoch,
		              .g = &g};
	}
	/* Producers seen to exit since the last look (at most one a
	 * millisecond: a pull to one that exits after it fails in the
	 * load's wait). */
	cons_pconns_watch(c, false);
	const void *waddr;
	size_t walen;
	ecx_ucx_address(c->ucx, &waddr, &walen);
	for (;;) {
		pconn *stale = NULL;
		size_t nbye = 0, nwait = 0, ngo = 0;
		uint64_t now_ms = ecx_now_ms();
		pthread_mutex_lock(&c->lock);
		for (size_t k = 0; k < n; k++) {
			if (w[k].p->pc != NULL || w[k].p->done)
				continue;
			pconn *pc =
			    pconn_find(c, &w[k], now_ms, &stale, bye, &nbye, n);
			if (pc != NULL) {
				w[k].p->pc = pc;
				pc->users++; /* until in flight */
				go[ngo++] = w[k].p;
			} else if (w[k].wait) {
				nwait++;
			} else if (cons_dead_find(c, w[k].address,
			                          w[k].epoch) != NULL) {
				/* Seen to leave: no hello would be answered. */
				const dead_peer *d =
				    cons_dead_find(c, w[k].address, w[k].epoch);
				if (l->why_err == 0) {
					cons_dead_detail(w[k].address, d->pid,
					                 d->bye, l->why,
					                 sizeof(l->why));
					l->why_err = ECX_ECLOSED;
				}
				cons_pull_fail(w[k].p, ECX_ECLOSED);
			} else if ((pc = calloc(1, sizeof(*pc))) == NULL) {
				cons_pull_fail(w[k].p, ECX_ENOMEM);
			} else {
				pc->pidfd = -1;
				ecx_strlcpy(pc->address, w[k].address,
				            sizeof(pc->address));
				pc->epoch = w[k].epoch;
				pc->connecting = true;
				pc->c = c;
				pc->next = c->conns;
				c->conns = pc;
				w[k].mine = pc;
			}
		}
		pthread_mutex_unlock(&c->lock);
		/* Pulls on connections made before go first. */
		for (size_t k = 0; k < ngo; k++)
			ready(c, l, go[k]);
		while (stale != NULL) {
			pconn *next = stale->next;
			ecx_info(MOD, "reconnecting to %s", stale->address);
			cons_pconn_close(c, stale);
			stale = next;
		}
		/* The hellos and goodbyes, all at once; each pull goes as
		 * soon as its hello is answered. */
		size_t ncalls = 0;
		for (size_t k = 0; k < n; k++) {
			if (w[k].mine == NULL)
				continue;
			/* Where shared memory may be used, the connection
			 * gets a worker of its own (ucx.h): the hello names
			 * it. */
			const void *a = waddr;
			size_t alen = walen;
			char swhy[200];
			if (ecx_ucx_transports(c->ucx) & ECX_TR_SHM) {
				if (ecx_ucx_side_create(c->ucx,
				                        &w[k].mine->side, swhy,
				                        sizeof(swhy)) == 0)
					ecx_ucx_side_address(w[k].mine->side,
					                     &a, &alen);
				else
					ecx_warn(
					    MOD,
					    "no worker of its own for the "
					    "connection to %s (%s): it uses "
					    "the consumer's",
					    w[k].address, swhy);
			}
			msgs[ncalls] =
			    ecx_rdv_hello_encode(c->rdv, a, alen, c->token);
			calls[ncalls] = (ecx_rdv_call){
			    .address = w[k].address,
			    .req = msgs[ncalls] ? msgs[ncalls] : "",
			    .done = hello_done,
			    .arg = &w[k]};
			ncalls++;
		}
		for (size_t b = 0; b < nbye; b++) {
			msgs[ncalls] = ecx_zreq_encode_bye(
			    bye[b]->id, bye[b]->epoch, c->token);
			byers[b] = (byer){.c = c, .pc = bye[b]};
			calls[ncalls] = (ecx_rdv_call){
			    .address = bye[b]->address,
			    .req = msgs[ncalls] ? msgs[ncalls] : "",
			    .done = bye_done,
			    .arg = &byers[b]};
			ncalls++;
		}
		g.sent_ms = ecx_now_ms();
		if (ncalls > 0)
			ecx_rdv_call_many(c->rdv, calls, ncalls,
			                  l->deadline_ns);
		for (size_t i = 0; i < ncalls; i++) {
			free(msgs[i]);
			msgs[i] = NULL;
		}
		if (nwait == 0)
			break;
		/* Another load is connecting to some of these producers:
		 * wait for it to settle, then look again. */
		pthread_mutex_lock(&c->lock);
		if (!others_connecting(c, w, n)) {
			pthread_mutex_unlock(&c->lock);
			continue;
		}
		if (ecx_now_ns() >= l->deadline_ns) {
			for (size_t k = 0; k < n; k++)
				if (w[k].p->pc == NULL && !w[k].p->done)
					cons_pull_fail(w[k].p, ECX_ETIMEDOUT);
			pthread_mutex_unlock(&c->lock);
			break;
		}
		struct timespec ts;
		deadline_ts(l->deadline_ns, &ts);
		pthread_cond_timedwait(&c->conn_cv, &c->lock, &ts);
		pthread_mutex_unlock(&c->lock);
	}
out:
	free(go);
	free(byers);
	free(bye);
	free(msgs);
	free(calls);
	free(w);
}

void cons_pconns_bye(ecx_consumer *c)
{
	size_t n = 0;
	pthread_mutex_lock(&c->lock);
	for (pconn *pc = c->conns; pc != NULL; pc = pc->next)
		n++;
	pthread_mutex_unlock(&c->lock);
	pconn **pcs = calloc(n + 1, sizeof(*pcs));
	ecx_rdv_call *calls = calloc(n + 1, sizeof(*calls));
	char **msgs = calloc(n + 1, sizeof(*msgs));
	bool *closed = calloc(n + 1, sizeof(*closed));
	if (pcs == NULL || calls == NULL || msgs == NULL || closed == NULL)
		goto out;
	size_t k = 0;
	pthread_mutex_lock(&c->lock);
	for (pconn *pc = c->conns; pc != NULL && k < n; pc = pc->next) {
		/* A producer seen to exit answers no goodbye. */
		if (pc->connecting || pc->byeing || pc->ep == NULL ||
		    cons_pconn_gone_locked(c, pc))
			continue;
		pc->byeing = true;
		pc->bye_sent = true;
		pcs[k] = pc;
		msgs[k] = ecx_zreq_encode_bye(pc->id, pc->epoch, c->token);
		k++;
	}
	pthread_mutex_unlock(&c->lock);
	int ms =
	    c->timeout_ms < ECX_BYE_WAIT_MS ? c->timeout_ms : ECX_BYE_WAIT_MS;
	uint64_t deadline = ecx_now_ns() + (uint64_t)ms * 1000000u;
	/* A producer answers "not yet" after a short wait of its own; ask
	 * again (a goodbye for a connection gone is answered "closed") until
	 * every one is closed or the bound. */
	for (;;) {
		size_t m = 0;
		for (size_t i = 0; i < k; i++) {
			if (closed[i])
				continue;
			calls[m] = (ecx_rdv_call){.address = pcs[i]->address,
			                          .req = msgs[i] ? msgs[i] : "",
			                          .arg = &closed[i]};
			m++;
		}
		if (m == 0 || ecx_now_ns() >= deadline)
			break;
		ecx_rdv_call_many(c->rdv, calls, m, deadline);
		bool answered = false;
		for (size_t j = 0; j < m; j++) {
			if (calls[j].err != 0)
				continue;
			answered = true;
			*(bool *)calls[j].arg = calls[j].resp.closed;
			ecx_zresp_free(&calls[j].resp);
		}
		if (!answered)
			break; /* none answers: dead or stopped */
		usleep(5000);
	}
	for (size_t i = 0; i < k; i++) {
		if (!closed[i])
			ecx_info(MOD,
			         "no goodbye from %s within %d ms: its pulls "
			         "that timed out may still write",
			         pcs[i]->address, ms);
		pthread_mutex_lock(&c->lock);
		pcs[i]->byeing = false;
		if (closed[i])
			pconn_zombies_end(c, pcs[i]);
		pthread_mutex_unlock(&c->lock);
		free(msgs[i]);
	}
out:
	free(closed);
	free(msgs);
	free(calls);
	free(pcs);
}
