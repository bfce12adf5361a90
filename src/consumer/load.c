/*
 * load.c - loads: the items are grouped by producer, one pull is sent to
 * each (all in flight at once), and every wait is bounded by the
 * consumer's timeout.
 */
#include "consumer/consumer.h"

#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD "consumer"

/* An item's status while its load runs: no error code, so an item a pull
 * failed with ECX_EBUSY (too many zombies, too many regions) keeps it. */
#define ITEM_PENDING INT_MIN

/* ---- loads ---- */

/* Where an item's bytes go; zero-byte items (whose tensors may have no
 * address at all) all name one small buffer of the consumer's. */
static void *item_dst(ecx_consumer *c, const ecx_item *x)
{
	return x->desc.nbytes == 0 ? c->zero : x->dst;
}

typedef struct span {
	uint64_t lo, hi;
} span;

static int span_cmp(const void *a, const void *b)
{
	const span *x = a, *y = b;
	return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sorts and merges the ranges of the pull's items (those within a page of
 * each other join); returns the count. */
static size_t spans_make(const ecx_load *l, const pull *p, span *s)
{
	for (size_t k = 0; k < p->n; k++) {
		const ecx_item *x = &l->items[p->idx[k]];
		s[k].lo = (uint64_t)(uintptr_t)item_dst(l->c, x);
		s[k].hi = s[k].lo + (x->desc.nbytes ? x->desc.nbytes : 1);
	}
	qsort(s, p->n, sizeof(*s), span_cmp);
	size_t m = 0;
	for (size_t k = 0; k < p->n; k++) {
		if (m > 0 && s[k].lo <= s[m - 1].hi + PAGE) {
			if (s[k].hi > s[m - 1].hi)
				s[m - 1].hi = s[k].hi;
		} else {
			s[m++] = s[k];
		}
	}
	return m;
}

static const span *span_find(const span *s, size_t m, uint64_t a)
{
	size_t lo = 0, hi = m;
	while (hi - lo > 1) {
		size_t mid = (lo + hi) / 2;
		if (s[mid].lo <= a)
			lo = mid;
		else
			hi = mid;
	}
	return &s[lo];
}

/* Builds and sends the pull for the items of load l at idx[0..n) on pc. */
/* p no longer needs p->pc held for it (it is in flight, or failed before
 * it was sent). Called with c->lock. */
static void pull_unuse(pull *p)
{
	if (p->pc != NULL && p->pc->users > 0)
		p->pc->users--;
}

static void pull_send(ecx_consumer *c, ecx_load *l, pull *p)
{
	ecx_pull_req r;
	memset(&r, 0, sizeof(r));
	if (c->token != NULL)
		ecx_strlcpy(r.token, c->token, sizeof(r.token));
	ecx_region regs[ECX_PULL_MAX_REGIONS];
	ecx_pull_item *it = calloc(p->n, sizeof(*it));
	span *spans = calloc(p->n, sizeof(*spans));
	p->regs = calloc(p->n, sizeof(*p->regs));
	/* The quarantine record, made now: a pull that times out must be
	 * able to quarantine its destinations, so one that could not is
	 * never sent. */
	p->quar = calloc(p->n + 1, sizeof(*p->quar));
	/* Over TCP the data comes as active messages (replies.c). */
	bool am = p->pc->transport == ECX_TR_TCP && c->tcp_data_am;
	if (am)
		p->dstat = calloc(p->n + 1, sizeof(*p->dstat));
	if (it == NULL || p->regs == NULL || spans == NULL || p->quar == NULL ||
	    (am && p->dstat == NULL)) {
		free(it);
		free(spans);
		pthread_mutex_lock(&c->lock);
		cons_pull_fail(p, ECX_ENOMEM);
		pull_unuse(p);
		pthread_mutex_unlock(&c->lock);
		return;
	}
	size_t nspans = spans_make(l, p, spans);
	for (size_t k = 0; k < nspans; k++)
		cons_span_populate(c, spans[k].lo, spans[k].hi);
	pthread_mutex_lock(&c->lock);
	size_t nz = 0;
	for (pull *q = c->inflight; q != NULL; q = q->next)
		nz += q->zombie && strcmp(q->pc->address, p->pc->address) == 0;
	if (nz >= ECX_ZOMBIES_MAX) {
		ecx_warn(MOD,
		         "%s has %zu timed-out pulls that may still write: "
		         "no more until they end",
		         p->pc->address, nz);
		cons_pull_fail(p, ECX_EBUSY);
		pull_unuse(p);
		pthread_mutex_unlock(&c->lock);
		free(it);
		free(spans);
		return;
	}
	size_t ni = 0;
	for (size_t k = 0; k < p->n; k++) {
		ecx_item *x = &l->items[p->idx[k]];
		int err = 0;
		void *dst = item_dst(c, x);
		const span *sp =
		    span_find(spans, nspans, (uint64_t)(uintptr_t)dst);
		region *g = cons_region_for(c, dst, x->desc.nbytes, sp->lo,
		                            sp->hi, &err);
		if (g == NULL) {
			x->status = err;
			continue;
		}
		size_t gi = 0;
		while (gi < p->nregs && p->regs[gi] != g)
			gi++;
		if (gi == p->nregs) {
			if (p->nregs == ECX_PULL_MAX_REGIONS) {
				g->inuse--;
				x->status = ECX_EBUSY;
				continue;
			}
			p->regs[p->nregs++] = g;
		} else {
			g->inuse--; /* named once per pull */
		}
		ecx_strlcpy(it[ni].id, x->id, sizeof(it[ni].id));
		it[ni].nbytes = x->desc.nbytes;
		it[ni].region = (uint32_t)gi;
		it[ni].addr = (uint64_t)(uintptr_t)dst;
		it[ni].lease = x->lease;
		p->idx[ni++] = p->idx[k];
	}
	p->n = ni;
	if (p->dstat != NULL)
		cons_pull_data_init(p);
	free(spans);
	for (size_t g = 0; g < p->nregs; g++)
		regs[g] = (ecx_region){p->regs[g]->base, p->regs[g]->len,
		                       p->regs[g]->rkey_len, p->regs[g]->rkey};
	r.req = p->req;
	if (p->pc->has_clock) {
		/* The pull expires with this load, in the producer's clock;
		 * a producer that gets to it later writes nothing. */
		uint64_t dl_ms = l->deadline_ns / 1000000u;
		uint64_t e = p->pc->hello_now_ms;
		if (dl_ms > p->pc->hello_mono_ms)
			e += dl_ms - p->pc->hello_mono_ms;
		r.expires_ms = e;
	}
	r.data_am = p->dstat != NULL;
	/* Over the connection's data lane where the pull moves enough for it
	 * to pay: 128 KiB by default; a single 64 KiB item, whose data and
	 * folded reply go as one eager message, does not (docs/deploy.md,
	 * "The data lane for every pull but the smallest"). */
	uint64_t total = 0;
	for (size_t k = 0; k < ni; k++)
		total += it[k].nbytes;
	r.lane = p->lane = r.data_am && p->pc->lane != NULL &&
	                   c->lane_min != 0 && total >= c->lane_min;
	if (p->lane)
		__atomic_store_n(&l->has_lane, true, __ATOMIC_RELEASE);
	/* The reply inside the data, where the data is one message. */
	r.fold = r.data_am;
	/* And at the front of its bytes, where it goes eagerly. */
	r.lead = r.fold && !c->test_no_lead;
	/* XXH3, and notices of what landed so it is hashed as it lands; no
	 * hashes at all for a consumer that does not check. */
	r.hash = !c->integrity         ? ECX_HASH_NONE
	         : c->test_hash_legacy ? ECX_HASH_DEFAULT
	                               : ECX_HASH_XXH3;
	r.landed = c->integrity && !c->test_hash_legacy;
	r.regions = regs;
	r.nregions = p->nregs;
	r.items = it;
	r.nitems = ni;
	char *msg = ni > 0 ? ecx_pull_req_encode(&r) : NULL;
	free(it);
	if (ni == 0 || msg == NULL) {
		if (ni > 0)
			cons_pull_fail(p, ECX_ENOMEM);
		p->done = true;
		pull_unuse(p);
		pthread_mutex_unlock(&c->lock);
		return;
	}
	p->next = c->inflight;
	c->inflight = p;
	pull_unuse(p); /* in flight keeps its connection now */
	pconn *pc = p->pc;
	ucp_ep_h ep = pc->ep;
	if (ep != NULL)
		pc->sending++;
	p->pc->used_ms = ecx_now_ms();
	/* The load's last pull to go (the others sent or failed): a caller
	 * that waits at once goes to progress the worker itself now. */
	bool last = true;
	for (size_t k = 0; k < l->npulls && last; k++)
		last = l->pulls[k] == p || l->pulls[k]->req != 0 ||
		       l->pulls[k]->done;
	pthread_mutex_unlock(&c->lock);
	/* Then it progresses the worker from before the send: the progress
	 * thread, should the answer wake it, leaves the worker alone instead
	 * of taking its lock from under the caller (on a busy core, for as
	 * long as the scheduler lets it spin). Earlier pulls of the load go
	 * while hellos are still being answered, with no caller progressing
	 * the worker: their sends are the progress thread's. */
	if (l->sync && last && !l->waiting) {
		ecx_ucx_waiting(c->ucx, true);
		l->waiting = true;
	}
	bool pending = false;
	int err = ep != NULL ? ecx_ucx_am_send(ep, ECX_AM_PULL, pc->id, p->req,
	                                       msg, &pending)
	                     : ECX_ECLOSED;
	if (ep == NULL)
		free(msg);
	pthread_mutex_lock(&c->lock);
	ucp_ep_h cut = NULL;
	if (ep != NULL && --pc->sending == 0 && pc->cut) {
		pc->cut = false;
		cut = pc->ep;
		pc->ep = NULL;
		pc->users++; /* kept (with its side) until it is closed */
	}
	if (err != 0 && cons_pull_take(c, p->req) != NULL)
		cons_pull_fail(p, err);
	pthread_mutex_unlock(&c->lock);
	if (cut != NULL) {
		cons_pconn_cut(c, pc->side, cut);
		pthread_mutex_lock(&c->lock);
		pc->users--;
		pthread_mutex_unlock(&c->lock);
	}
	/* A send still in flight needs progress, which the caller may not
	 * give (it need not wait, or has hellos to finish first): the
	 * progress thread does. One that went at once needs none, and the
	 * answer wakes the thread by itself (its event descriptor); waking
	 * it here anyway cost a context switch per load, on two cores often
	 * on the core of the producer's copy. */
	if (pending && !l->waiting)
		ecx_ucx_wake(c->ucx);
}

/* Pull p has its connection: number it and send it. */
static void pull_ready(ecx_consumer *c, ecx_load *l, pull *p)
{
	pthread_mutex_lock(&c->lock);
	p->req = ++c->next_req;
	bool go = p->pc != NULL && !p->done;
	if (!go)
		pull_unuse(p);
	pthread_mutex_unlock(&c->lock);
	if (go)
		pull_send(c, l, p);
}

/* Starts a load that ends by deadline_ns; a retry (a failover) is not
 * counted as new loads. */
int cons_load_start(ecx_consumer *c, ecx_item *items, size_t n,
                    uint64_t deadline_ns, bool retry, bool sync, ecx_load **out)
{
	ecx_load *l = calloc(1, sizeof(*l));
	if (l == NULL)
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	l->c = c;
	l->items = items;
	l->n = n;
	l->retry = retry;
	l->sync = sync;
	l->deadline_ns = deadline_ns;
	l->pulls = calloc(n + 1, sizeof(*l->pulls));
	size_t *group = calloc(n + 1, sizeof(*group));
	size_t *mcidx = calloc(n + 1, sizeof(*mcidx));
	size_t nmc = 0;
	if (c->integrity) {
		l->xxh = calloc(n + 1, sizeof(*l->xxh));
		l->has_xxh = calloc(n + 1, 1);
	}
	if (l->pulls == NULL || group == NULL || mcidx == NULL ||
	    (c->integrity && (l->xxh == NULL || l->has_xxh == NULL ||
	                      !cons_load_hash_init(l, n)))) {
		free(group);
		free(mcidx);
		free(l->pulls);
		free(l->xxh);
		free(l->has_xxh);
		cons_load_hash_free(l);
		free(l);
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	}
	/* Checks first, then groups by producer, in order of first sight. */
	for (size_t i = 0; i < n; i++) {
		ecx_item *x = &items[i];
		char why[200];
		x->status = ITEM_PENDING;
		group[i] = SIZE_MAX;
		if (core_id_check(x->id, why, sizeof(why)) != 0)
			x->status = ECX_EID;
		else if (x->producer[0] == '\0')
			x->status = ECX_ENOTFOUND;
		else if (core_tensor_check(&x->desc, why, sizeof(why)) != 0)
			x->status = ECX_ESIZE;
		else if (x->dst == NULL && x->desc.nbytes > 0)
			x->status = ECX_EINVAL;
		if (x->status == ITEM_PENDING &&
		    x->epoch == ECX_EPOCH_REFERENCE && !cons_mc_wants(c, x)) {
			x->status = ECX_EUNSUPPORTED;
			if (l->why_err == 0) {
				/* A long message may be cut; the check of
				 * the length keeps -Wformat-truncation quiet
				 * in builds without optimisation. */
				int n = snprintf(
				    l->why, sizeof(l->why),
				    "%s: its producer %s speaks only the "
				    "reference's protocol (its entry has "
				    "none of ecx's fields), whose data "
				    "moves over Mooncake's wire, and this "
				    "consumer's Mooncake receiver is off "
				    "(mooncake=off)",
				    x->id, x->producer);
				(void)n;
				l->why_err = ECX_EUNSUPPORTED;
			}
		}
		if (x->status != ITEM_PENDING)
			continue;
		if (cons_mc_wants(c, x)) {
			mcidx[nmc++] = i;
			continue;
		}
		for (size_t k = 0; k < l->npulls && group[i] == SIZE_MAX; k++)
			if (strcmp(items[l->pulls[k]->idx[0]].producer,
			           x->producer) == 0)
				group[i] = k;
		if (group[i] == SIZE_MAX) {
			pull *p = calloc(1, sizeof(*p));
			size_t *idx = calloc(n, sizeof(*idx));
			if (p == NULL || idx == NULL) {
				free(p);
				free(idx);
				x->status = ECX_ENOMEM;
				continue;
			}
			p->idx = idx;
			p->load = l;
			group[i] = l->npulls;
			l->pulls[l->npulls++] = p;
		}
		pull *p = l->pulls[group[i]];
		p->idx[p->n++] = i;
	}
	free(group);
	pthread_mutex_lock(&c->lock);
	if (!retry)
		c->st.loads += n;
	pthread_mutex_unlock(&c->lock);
	/* The reference's pulls go first: nothing of them waits. */
	if (nmc > 0)
		cons_mc_start(c, l, mcidx, nmc);
	free(mcidx);
	/* Every connection this load needs, the hellos in parallel, all
	 * within the load's deadline (counted from this call). */
	if (l->npulls > 0)
		cons_pconns_get(c, l, pull_ready);
	*out = l;
	return 0;
}

/* A lane to kill at a load's end, and its connection, both held. */
typedef struct lane_kill {
	cons_lane *lane;
	pconn *pc;
} lane_kill;

/* Adds pc's lane to kill (once), holding both; past cap (no memory for
 * more) pc only fails, as a connection given up does. Called with
 * c->lock. */
static void lane_kill_add(lane_kill *kill, size_t *n, size_t cap, pconn *pc)
{
	for (size_t i = 0; i < *n; i++)
		if (kill[i].pc == pc)
			return;
	if (*n == cap) {
		pc->failed = true;
		return;
	}
	pc->users++;
	kill[(*n)++] = (lane_kill){cons_lane_ref_locked(pc->lane), pc};
}

bool cons_load_done(ecx_load *l)
{
	if (!cons_mc_done(l))
		return false;
	for (size_t k = 0; k < l->npulls; k++)
		if (!__atomic_load_n(&l->pulls[k]->done, __ATOMIC_ACQUIRE))
			return false;
	return true;
}

int cons_load_test(ecx_load *l)
{
	ecx_ucx_progress(l->c->ucx);
	cons_load_read_lanes(l);
	cons_mc_poll(l);
	cons_pconns_watch(l->c, false);
	return cons_load_done(l) ||
	               ecx_now_ns() >= l->deadline_ns + ECX_LOAD_GRACE_NS
	           ? 0
	           : ECX_EBUSY;
}

/* Waits for l to end and frees it; returns the first item's error, with
 * the detail of a failure the load recorded (a producer's refusal) in why
 * when it was that error. */
int cons_load_wait_once(ecx_load *l, char *why, size_t whylen)
{
	ecx_consumer *c = l->c;
	uint64_t spin_until = ecx_now_ns() + 2000000u;
	if (!l->waiting)
		ecx_ucx_waiting(c->ucx, true);
	/* A producer stops writing a pull at its expiry (the deadline) and
	 * then answers; the grace lets that answer arrive, so a load from a
	 * live producer returns with nothing left to write. */
	uint64_t until = l->deadline_ns + ECX_LOAD_GRACE_NS;
	while (!cons_load_done(l)) {
		uint64_t now = ecx_now_ns();
		if (now >= until)
			break;
		/* With integrity on, what has landed is hashed meanwhile. */
		int did = (int)ecx_ucx_progress(c->ucx);
		did += cons_load_hash_landed(l);
		did += cons_load_read_lanes(l);
		did += cons_mc_poll(l);
		/* A producer over shared memory that exits says nothing:
		 * its process is watched (failures.c). */
		cons_pconns_watch(c, false);
		if (did != 0)
			continue;
		/* Nothing yet: poll on, but let a thread that waits for
		 * this CPU run first (on a shared core, the producer that
		 * is to answer), then, after 2 ms, sleep between polls. */
		if (now > spin_until)
			usleep(20);
		else
			sched_yield();
	}
	/* The reference's pulls not answered by now time out. */
	if (l->nmc > 0)
		cons_mc_finish(l);
	int first = 0;
	uint64_t ok = 0, bad = 0, bytes = 0;
	/* One pull per producer: at most npulls endpoints to close. */
	ucp_ep_h *cut = calloc(l->npulls + 1, sizeof(*cut));
	pconn **cutpc = calloc(l->npulls + 1, sizeof(*cutpc));
	size_t ncut = 0;
	if (cutpc == NULL) {
		free(cut);
		cut = NULL;
	}
	/* The lanes of pulls that ended without their reply (timed out, or
	 * their connection failed): killed before this returns, so that no
	 * thread reading them for another load goes on into these pulls'
	 * destinations; their connections fail with them. */
	lane_kill kbuf[16];
	size_t kcap = l->npulls <= 16 ? 16 : l->npulls;
	lane_kill *kill = kcap == 16 ? kbuf : calloc(kcap, sizeof(*kill));
	if (kill == NULL) {
		kill = kbuf;
		kcap = 16;
	}
	size_t nkill = 0;
	pthread_mutex_lock(&c->lock);
	for (size_t k = 0; k < l->npulls; k++) {
		pull *p = l->pulls[k];
		if (p->lane && !p->replied && p->pc != NULL &&
		    p->pc->lane != NULL)
			lane_kill_add(kill, &nkill, kcap, p->pc);
		if (!p->done) {
			/* Past the deadline: the items fail, and the
			 * connection is suspect, so the next load makes a new
			 * one. The producer may still be writing: the pull
			 * stays in flight as a zombie, holding its memory,
			 * until the producer's reply says it is done. */
			bool inflight = cons_pull_take(c, p->req) != NULL;
			cons_pull_fail(p, ECX_ETIMEDOUT);
			/* Suspect: the next load makes a new connection.
			 * Over TCP this one is closed before the load
			 * returns, so no put in transit lands later. */
			if (p->pc != NULL && cut != NULL)
				cut[ncut] = cons_pconn_cut_locked(p->pc);
			else if (p->pc != NULL)
				p->pc->failed = true; /* no memory: as before */
			if (cut != NULL && cut[ncut] != NULL) {
				/* Kept, with its side, until closed below. */
				cutpc[ncut++] = p->pc;
				p->pc->users++;
			}
			if (inflight) {
				cons_zombie_make(c, p);
				p->next = c->inflight;
				c->inflight = p;
				continue;
			}
		}
		for (size_t g = 0; g < p->nregs; g++)
			p->regs[g]->inuse--;
		free(p->regs);
		free(p->quar);
		free(p->idx);
		free(p->dstat);
		free(p);
	}
	pthread_mutex_unlock(&c->lock);
	for (size_t i = 0; i < nkill; i++)
		cons_lane_kill(kill[i].lane);
	if (nkill > 0) {
		pthread_mutex_lock(&c->lock);
		for (size_t i = 0; i < nkill; i++) {
			cons_pconn_fail_live_locked(c, kill[i].pc, ECX_ECLOSED);
			kill[i].pc->users--;
		}
		pthread_mutex_unlock(&c->lock);
	}
	for (size_t i = 0; i < nkill; i++)
		cons_lane_put(c, kill[i].lane);
	if (kill != kbuf)
		free(kill);
	for (size_t i = 0; i < ncut; i++)
		cons_pconn_cut(c, cutpc[i]->side, cut[i]);
	if (ncut > 0) {
		pthread_mutex_lock(&c->lock);
		for (size_t i = 0; i < ncut; i++)
			cutpc[i]->users--;
		pthread_mutex_unlock(&c->lock);
	}
	free(cutpc);
	free(cut);
	/* Only now may the progress thread progress the worker again: had it
	 * run between the deadline and the cut above, it could have landed a
	 * late put of a timed-out pull (TSan's timing showed it, in
	 * test_slow_producer_tcp_caller). */
	ecx_ucx_waiting(c->ucx, false);
	/* A load nobody waited on (notify.c) leaves no linger: the next one
	 * is the progress thread's at once. */
	if (l->passive)
		ecx_ucx_wake(c->ucx);
	/* Every item's status is final now (the pulls are gone): the
	 * integrity check needs no lock. */
	if (l->xxh != NULL)
		cons_load_verify(l);
	pthread_mutex_lock(&c->lock);
	for (size_t i = 0; i < l->n; i++) {
		int s = l->items[i].status;
		if (s == ITEM_PENDING)
			s = l->items[i].status = ECX_EINTERNAL;
		if (s == 0) {
			ok++;
			bytes += l->items[i].desc.nbytes;
			l->items[i].lease = 0; /* its pull ended it */
		} else {
			bad++;
			if (first == 0)
				first = s;
		}
	}
	c->st.loaded += ok;
	if (!l->retry)
		c->st.failed += bad;
	c->st.bytes += bytes;
	pthread_mutex_unlock(&c->lock);
	if (why != NULL)
		snprintf(why, whylen, "%s",
		         first != 0 && l->why_err == first ? l->why : "");
	free(l->pulls);
	free(l->xxh);
	free(l->has_xxh);
	cons_load_hash_free(l);
	free(l);
	return first;
}
