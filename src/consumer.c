/*
 * consumer.c - the consumer role: lookups through the registry client,
 * connections to producers (ZeroMQ hello, then a UCX endpoint), the
 * receive arena, the registration cache for the caller's memory, and
 * loads: one pull per producer, all producers in parallel, every wait
 * bounded.
 *
 * Locks: c->lock guards connections, pulls in flight, the arena allocator,
 * the registration cache and the stats; it is never held while the worker
 * is progressed (reply handlers take it). c->conn_lock serialises
 * handshakes, which block on the network; c->reg_lock serialises registry
 * lookups (the client is one thread at a time).
 */
#include "dir/dir.h"
#include "mem/alloc.h"
#include "rdv/rdv.h"
#include "xfer/ucx.h"

#include <ucm/api/ucm.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD "consumer"
#define PAGE 4096u

typedef struct pconn {
	struct pconn *next;
	char address[ECX_ADDR_MAX];
	uint64_t epoch, id;
	uint64_t stale_epoch; /* an entry's epoch known not to be this one's */
	ucp_ep_h ep;
	bool failed;
	struct ecx_consumer *c;
} pconn;

/* A registration of memory that loads write into. */
typedef struct region {
	uint64_t base, len; /* atomics: read by the unmap hook */
	ucp_mem_h memh;
	void *rkey;
	size_t rkey_len;
	unsigned inuse;   /* loads in flight that name it */
	uint64_t used_at; /* for LRU */
	int stale;        /* atomic: memory was unmapped */
	bool live;
} region;

typedef struct pull {
	struct pull *next; /* in c->inflight */
	uint64_t req;
	pconn *pc;
	ecx_load *load;
	size_t *idx; /* which of the load's items */
	size_t n;
	region **regs; /* regions named, to unpin */
	size_t nregs;
	bool done;
} pull;

struct ecx_load {
	ecx_consumer *c;
	ecx_item *items;
	size_t n;
	pull **pulls;
	size_t npulls;
	uint64_t deadline_ns;
};

typedef struct arena_alloc {
	uint64_t off, size;
} arena_alloc;

struct ecx_consumer {
	pthread_mutex_t lock, conn_lock, reg_lock;
	ecx_regclient *rc;
	char *token;
	int timeout_ms;
	ecx_ucx *ucx;
	ecx_rdv_client *rdv;
	pconn *conns;
	pull *inflight;
	uint64_t next_req;
	/* receive arena */
	region arena;
	void *arena_base;
	ecx_alloc alloc;
	arena_alloc *allocs;
	size_t nallocs, cap_allocs;
	/* zero-byte items name this, so every item has a destination */
	char zero[64];
	/* caller memory */
	region *cache;
	unsigned ncache;
	bool hooked;
	ecx_consumer_stats st;
};

/* ---- replies and failures ---- */

static pull *pull_take(ecx_consumer *c, uint64_t req)
{
	for (pull **pp = &c->inflight; *pp != NULL; pp = &(*pp)->next) {
		if ((*pp)->req == req) {
			pull *p = *pp;
			*pp = p->next;
			p->next = NULL;
			return p;
		}
	}
	return NULL;
}

/* Ends pull p with err for every item it carries. Called with the lock. */
static void pull_fail(pull *p, int err)
{
	for (size_t i = 0; i < p->n; i++)
		p->load->items[p->idx[i]].status = err;
	__atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
}

static ucs_status_t am_reply(void *arg, const void *header, size_t header_len,
                             void *data, size_t len,
                             const ucp_am_recv_param_t *param)
{
	ecx_consumer *c = arg;
	if (header_len != sizeof(ecx_am_hdr) ||
	    (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
		return UCS_OK;
	ecx_am_hdr h;
	memcpy(&h, header, sizeof(h));
	ecx_pull_resp r;
	char why[200];
	int rc = ecx_pull_resp_decode(data, len, &r, why, sizeof(why));
	pthread_mutex_lock(&c->lock);
	pull *p = pull_take(c, h.req);
	if (p == NULL) {
		/* Late: its load timed out already. */
		pthread_mutex_unlock(&c->lock);
		if (rc == 0)
			free(r.status);
		return UCS_OK;
	}
	if (rc != 0) {
		ecx_warn(MOD, "unreadable reply from %s: %s", p->pc->address,
		         why);
		pull_fail(p, ECX_EPROTO);
	} else if (r.err != 0) {
		ecx_warn(MOD, "pull refused by %s: %s", p->pc->address,
		         r.detail);
		pull_fail(p, r.err);
	} else if (r.nitems != p->n) {
		pull_fail(p, ECX_EPROTO);
	} else {
		for (size_t i = 0; i < p->n; i++)
			p->load->items[p->idx[i]].status = r.status[i];
		__atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&c->lock);
	if (rc == 0)
		free(r.status);
	return UCS_OK;
}

static void pconn_on_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	(void)ep;
	pconn *pc = arg;
	ecx_consumer *c = pc->c;
	ecx_warn(MOD, "connection to producer %s failed: %s", pc->address,
	         ucs_status_string(st));
	pthread_mutex_lock(&c->lock);
	pc->failed = true;
	for (;;) {
		pull *p = NULL;
		for (pull *q = c->inflight; q != NULL && p == NULL; q = q->next)
			if (q->pc == pc)
				p = q;
		if (p == NULL)
			break;
		pull_take(c, p->req);
		pull_fail(p, ECX_ECLOSED);
	}
	pthread_mutex_unlock(&c->lock);
}

/* ---- connections ---- */

/* The ZeroMQ hello: sends this worker's address, gets the producer's. */
static int hello(ecx_consumer *c, const char *address, ecx_zresp *out,
                 char *why, size_t whylen)
{
	const void *addr;
	size_t alen;
	ecx_ucx_address(c->ucx, &addr, &alen);
	return ecx_rdv_hello(c->rdv, address, addr, alen, c->token,
	                     c->timeout_ms, out, why, whylen);
}

static void pconn_close(ecx_consumer *c, pconn *pc)
{
	ecx_ucx_ep_close(c->ucx, pc->ep, 100);
	free(pc);
}

/* Returns a working connection to address (for epoch, when not 0),
 * making one if needed. */
static pconn *pconn_get(ecx_consumer *c, const char *address, uint64_t epoch,
                        int *err, char *why, size_t whylen)
{
	pthread_mutex_lock(&c->conn_lock);
	pconn *stale = NULL, *found = NULL;
	pthread_mutex_lock(&c->lock);
	for (pconn **pp = &c->conns; *pp != NULL;) {
		pconn *pc = *pp;
		if (strcmp(pc->address, address) != 0) {
			pp = &pc->next;
			continue;
		}
		/* Another epoch: the producer restarted since this connection
		 * was made, unless a reconnect already showed the entry is the
		 * stale one. */
		bool restarted = epoch != 0 && pc->epoch != epoch &&
		                 pc->stale_epoch != epoch;
		bool busy = false;
		for (pull *q = c->inflight; q != NULL && !busy; q = q->next)
			busy = q->pc == pc;
		if ((pc->failed || restarted) && !busy) {
			*pp = pc->next;
			pc->next = stale;
			stale = pc;
			continue;
		}
		if (!pc->failed && found == NULL)
			found = pc;
		pp = &pc->next;
	}
	pthread_mutex_unlock(&c->lock);
	while (stale != NULL) {
		pconn *next = stale->next;
		ecx_info(MOD, "reconnecting to %s", address);
		pconn_close(c, stale);
		stale = next;
	}
	if (found != NULL) {
		pthread_mutex_unlock(&c->conn_lock);
		return found;
	}
	ecx_zresp z;
	*err = hello(c, address, &z, why, whylen);
	if (*err != 0) {
		pthread_mutex_unlock(&c->conn_lock);
		return NULL;
	}
	pconn *pc = calloc(1, sizeof(*pc));
	if (pc == NULL) {
		ecx_zresp_free(&z);
		*err = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		pthread_mutex_unlock(&c->conn_lock);
		return NULL;
	}
	ecx_strlcpy(pc->address, address, sizeof(pc->address));
	pc->epoch = z.epoch;
	if (epoch != 0 && z.epoch != epoch)
		pc->stale_epoch = epoch; /* the entry outlived its producer */
	pc->id = z.conn;
	pc->c = c;
	*err = ecx_ucx_ep_create(c->ucx, z.worker, z.worker_len, pconn_on_error,
	                         pc, &pc->ep, why, whylen);
	ecx_zresp_free(&z);
	if (*err != 0) {
		free(pc);
		pthread_mutex_unlock(&c->conn_lock);
		return NULL;
	}
	pthread_mutex_lock(&c->lock);
	pc->next = c->conns;
	c->conns = pc;
	c->st.connections++;
	pthread_mutex_unlock(&c->lock);
	pthread_mutex_unlock(&c->conn_lock);
	ecx_debug(MOD, "connected to %s (epoch %llu)", address,
	          (unsigned long long)pc->epoch);
	return pc;
}

/* ---- memory ---- */

static void on_unmap(ucm_event_type_t type, ucm_event_t *ev, void *arg)
{
	(void)type;
	ecx_consumer *c = arg;
	uint64_t a = (uint64_t)(uintptr_t)ev->vm_unmapped.address;
	uint64_t e = a + ev->vm_unmapped.size;
	/* Runs inside munmap of any thread, maybe under our lock: atomics
	 * only. */
	for (unsigned i = 0; i < c->ncache; i++) {
		region *r = &c->cache[i];
		uint64_t b = __atomic_load_n(&r->base, __ATOMIC_ACQUIRE);
		uint64_t l = __atomic_load_n(&r->len, __ATOMIC_ACQUIRE);
		if (l != 0 && b < e && a < b + l)
			__atomic_store_n(&r->stale, 1, __ATOMIC_RELEASE);
	}
}

static void region_drop(ecx_consumer *c, region *r)
{
	ecx_ucx_mem_unmap(c->ucx, r->memh);
	free(r->rkey);
	__atomic_store_n(&r->len, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&r->base, 0, __ATOMIC_RELEASE);
	r->memh = NULL;
	r->rkey = NULL;
	r->live = false;
	__atomic_store_n(&r->stale, 0, __ATOMIC_RELEASE);
}

/* The region that covers [p, p + n): the arena, a cached registration, or
 * a new one of [span_lo, span_hi) (the run of this pull's items that
 * touch each other, so one buffer holding many items is registered once).
 * Called with the lock; pins the region (inuse). */
static region *region_for(ecx_consumer *c, void *ptr, uint64_t n,
                          uint64_t span_lo, uint64_t span_hi, int *err)
{
	uint64_t a = (uint64_t)(uintptr_t)ptr;
	if (c->arena.live && a >= c->arena.base &&
	    a + n <= c->arena.base + c->arena.len) {
		c->arena.inuse++;
		return &c->arena;
	}
	region *free_slot = NULL, *lru = NULL;
	for (unsigned i = 0; i < c->ncache; i++) {
		region *r = &c->cache[i];
		if (r->live && __atomic_load_n(&r->stale, __ATOMIC_ACQUIRE) &&
		    r->inuse == 0)
			region_drop(c, r);
		if (!r->live) {
			if (free_slot == NULL)
				free_slot = r;
			continue;
		}
		if (!__atomic_load_n(&r->stale, __ATOMIC_ACQUIRE) &&
		    a >= r->base && a + n <= r->base + r->len) {
			r->inuse++;
			r->used_at = ecx_now_ns();
			c->st.regcache_hits++;
			return r;
		}
		if (r->inuse == 0 && (lru == NULL || r->used_at < lru->used_at))
			lru = r;
	}
	if (free_slot == NULL && lru != NULL) {
		region_drop(c, lru);
		free_slot = lru;
	}
	if (free_slot == NULL) {
		*err = ECX_EBUSY;
		return NULL;
	}
	uint64_t base = span_lo / PAGE * PAGE;
	uint64_t end = (span_hi + PAGE - 1) / PAGE * PAGE;
	if (end == base)
		end = base + PAGE;
	region *r = free_slot;
	char why[200];
	*err = ecx_ucx_mem_reg(c->ucx, (void *)(uintptr_t)base, end - base,
	                       &r->memh, why, sizeof(why));
	if (*err != 0) {
		ecx_warn(MOD, "%s", why);
		return NULL;
	}
	*err = ecx_ucx_rkey_pack(c->ucx, r->memh, &r->rkey, &r->rkey_len);
	if (*err != 0) {
		ecx_ucx_mem_unmap(c->ucx, r->memh);
		r->memh = NULL;
		return NULL;
	}
	r->live = true;
	r->inuse = 1;
	r->used_at = ecx_now_ns();
	__atomic_store_n(&r->stale, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&r->base, base, __ATOMIC_RELEASE);
	__atomic_store_n(&r->len, end - base, __ATOMIC_RELEASE);
	c->st.registrations++;
	return r;
}

void *ecx_consumer_alloc(ecx_consumer *c, size_t nbytes)
{
	uint64_t off;
	pthread_mutex_lock(&c->lock);
	if (!c->arena.live || !ecx_alloc_take(&c->alloc, nbytes, &off)) {
		pthread_mutex_unlock(&c->lock);
		ecx_set_error(ECX_ENOSPC,
		              "receive arena has no room for %zu bytes",
		              nbytes);
		return NULL;
	}
	if (c->nallocs == c->cap_allocs) {
		size_t cap = c->cap_allocs ? c->cap_allocs * 2 : 64;
		arena_alloc *a = realloc(c->allocs, cap * sizeof(*a));
		if (a == NULL) {
			ecx_alloc_give(&c->alloc, off, nbytes);
			pthread_mutex_unlock(&c->lock);
			ecx_set_error(ECX_ENOMEM, "out of memory");
			return NULL;
		}
		c->allocs = a;
		c->cap_allocs = cap;
	}
	c->allocs[c->nallocs++] = (arena_alloc){off, nbytes};
	pthread_mutex_unlock(&c->lock);
	return (char *)c->arena_base + off;
}

void ecx_consumer_free(ecx_consumer *c, void *ptr)
{
	if (c == NULL || ptr == NULL)
		return;
	uint64_t off = (uint64_t)((char *)ptr - (char *)c->arena_base);
	pthread_mutex_lock(&c->lock);
	for (size_t i = 0; i < c->nallocs; i++) {
		if (c->allocs[i].off == off) {
			ecx_alloc_give(&c->alloc, off, c->allocs[i].size);
			c->allocs[i] = c->allocs[--c->nallocs];
			break;
		}
	}
	pthread_mutex_unlock(&c->lock);
}

/* ---- lookups ---- */

int ecx_consumer_lookup(ecx_consumer *c, ecx_item *items, size_t n)
{
	char why[256];
	if (n == 0)
		return 0;
	ecx_lookup_item *li = calloc(n, sizeof(*li));
	if (li == NULL)
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++)
		li[i].id = items[i].id;
	pthread_mutex_lock(&c->reg_lock);
	int rc = ecx_regclient_lookup(c->rc, li, n, why, sizeof(why));
	pthread_mutex_unlock(&c->reg_lock);
	for (size_t i = 0; i < n; i++) {
		items[i].status = li[i].found ? 0 : ECX_ENOTFOUND;
		if (li[i].found) {
			items[i].desc = li[i].entry.desc;
			ecx_strlcpy(items[i].producer, li[i].entry.producer_zmq,
			            sizeof(items[i].producer));
			items[i].epoch = li[i].entry.epoch;
		}
	}
	free(li);
	pthread_mutex_lock(&c->lock);
	c->st.lookups += n;
	pthread_mutex_unlock(&c->lock);
	if (rc != 0)
		return ecx_set_error(rc, "%s", why);
	return 0;
}

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
	if (it == NULL || p->regs == NULL || spans == NULL) {
		free(it);
		free(spans);
		pthread_mutex_lock(&c->lock);
		pull_fail(p, ECX_ENOMEM);
		pthread_mutex_unlock(&c->lock);
		return;
	}
	size_t nspans = spans_make(l, p, spans);
	pthread_mutex_lock(&c->lock);
	size_t ni = 0;
	for (size_t k = 0; k < p->n; k++) {
		ecx_item *x = &l->items[p->idx[k]];
		int err = 0;
		void *dst = item_dst(c, x);
		const span *sp =
		    span_find(spans, nspans, (uint64_t)(uintptr_t)dst);
		region *g =
		    region_for(c, dst, x->desc.nbytes, sp->lo, sp->hi, &err);
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
		p->idx[ni++] = p->idx[k];
	}
	p->n = ni;
	free(spans);
	for (size_t g = 0; g < p->nregs; g++)
		regs[g] = (ecx_region){p->regs[g]->base, p->regs[g]->len,
		                       p->regs[g]->rkey_len, p->regs[g]->rkey};
	r.req = p->req;
	r.regions = regs;
	r.nregions = p->nregs;
	r.items = it;
	r.nitems = ni;
	char *msg = ni > 0 ? ecx_pull_req_encode(&r) : NULL;
	free(it);
	if (ni == 0 || msg == NULL) {
		if (ni > 0)
			pull_fail(p, ECX_ENOMEM);
		p->done = true;
		pthread_mutex_unlock(&c->lock);
		return;
	}
	p->next = c->inflight;
	c->inflight = p;
	pthread_mutex_unlock(&c->lock);
	int err =
	    ecx_ucx_am_send(p->pc->ep, ECX_AM_PULL, p->pc->id, p->req, msg);
	if (err != 0) {
		pthread_mutex_lock(&c->lock);
		if (pull_take(c, p->req) != NULL)
			pull_fail(p, err);
		pthread_mutex_unlock(&c->lock);
	}
	ecx_ucx_wake(c->ucx);
}

int ecx_consumer_load_start(ecx_consumer *c, ecx_item *items, size_t n,
                            ecx_load **out)
{
	ecx_load *l = calloc(1, sizeof(*l));
	if (l == NULL)
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	l->c = c;
	l->items = items;
	l->n = n;
	l->deadline_ns = ecx_now_ns() + (uint64_t)c->timeout_ms * 1000000u;
	l->pulls = calloc(n + 1, sizeof(*l->pulls));
	size_t *group = calloc(n + 1, sizeof(*group));
	if (l->pulls == NULL || group == NULL) {
		free(group);
		free(l->pulls);
		free(l);
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	}
	/* Checks first, then groups by producer, in order of first sight. */
	for (size_t i = 0; i < n; i++) {
		ecx_item *x = &items[i];
		char why[200];
		x->status = ECX_EBUSY;
		group[i] = SIZE_MAX;
		if (ecx_id_check(x->id, why, sizeof(why)) != 0)
			x->status = ECX_EID;
		else if (x->producer[0] == '\0')
			x->status = ECX_ENOTFOUND;
		else if (ecx_tensor_check(&x->desc, why, sizeof(why)) != 0)
			x->status = ECX_ESIZE;
		else if (x->dst == NULL && x->desc.nbytes > 0)
			x->status = ECX_EINVAL;
		if (x->status != ECX_EBUSY)
			continue;
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
	c->st.loads += n;
	pthread_mutex_unlock(&c->lock);
	for (size_t k = 0; k < l->npulls; k++) {
		pull *p = l->pulls[k];
		ecx_item *first = &items[p->idx[0]];
		int err = 0;
		char why[256];
		p->pc = pconn_get(c, first->producer, first->epoch, &err, why,
		                  sizeof(why));
		pthread_mutex_lock(&c->lock);
		p->req = ++c->next_req;
		if (p->pc == NULL) {
			ecx_warn(MOD, "%s", why);
			pull_fail(p, err);
		}
		pthread_mutex_unlock(&c->lock);
		if (p->pc != NULL)
			pull_send(c, l, p);
	}
	*out = l;
	return 0;
}

static bool load_done(ecx_load *l)
{
	for (size_t k = 0; k < l->npulls; k++)
		if (!__atomic_load_n(&l->pulls[k]->done, __ATOMIC_ACQUIRE))
			return false;
	return true;
}

int ecx_load_test(ecx_load *l)
{
	ucp_worker_progress(ecx_ucx_worker(l->c->ucx));
	return load_done(l) || ecx_now_ns() >= l->deadline_ns ? 0 : ECX_EBUSY;
}

int ecx_load_wait(ecx_load *l)
{
	ecx_consumer *c = l->c;
	uint64_t spin_until = ecx_now_ns() + 2000000u;
	ecx_ucx_waiting(c->ucx, true);
	while (!load_done(l)) {
		uint64_t now = ecx_now_ns();
		if (now >= l->deadline_ns)
			break;
		if (ucp_worker_progress(ecx_ucx_worker(c->ucx)) == 0 &&
		    now > spin_until)
			usleep(20);
	}
	ecx_ucx_waiting(c->ucx, false);
	int first = 0;
	uint64_t ok = 0, bad = 0, bytes = 0;
	pthread_mutex_lock(&c->lock);
	for (size_t k = 0; k < l->npulls; k++) {
		pull *p = l->pulls[k];
		if (!p->done) {
			/* Past the deadline: its reply will be ignored. The
			 * connection is suspect, so the next load makes a new
			 * one. */
			pull_take(c, p->req);
			pull_fail(p, ECX_ETIMEDOUT);
			if (p->pc != NULL)
				p->pc->failed = true;
		}
		for (size_t g = 0; g < p->nregs; g++)
			p->regs[g]->inuse--;
		free(p->regs);
		free(p->idx);
		free(p);
	}
	for (size_t i = 0; i < l->n; i++) {
		int s = l->items[i].status;
		if (s == ECX_EBUSY)
			s = l->items[i].status = ECX_EINTERNAL;
		if (s == 0) {
			ok++;
			bytes += l->items[i].desc.nbytes;
		} else {
			bad++;
			if (first == 0)
				first = s;
		}
	}
	c->st.loaded += ok;
	c->st.failed += bad;
	c->st.bytes += bytes;
	pthread_mutex_unlock(&c->lock);
	free(l->pulls);
	free(l);
	if (first != 0)
		return ecx_set_error(
		    first, "%llu of %llu items failed; first: %s",
		    (unsigned long long)bad, (unsigned long long)(ok + bad),
		    ecx_strerror(first));
	return 0;
}

int ecx_consumer_load(ecx_consumer *c, ecx_item *items, size_t n)
{
	ecx_load *l;
	int rc = ecx_consumer_load_start(c, items, n, &l);
	return rc != 0 ? rc : ecx_load_wait(l);
}

/* ---- create, stats, destroy ---- */

int ecx_consumer_create(const ecx_consumer_params *pp, ecx_consumer **out,
                        char *why, size_t whylen)
{
	uint64_t m = pp != NULL ? pp->field_mask : 0;
#define HAS(f) ((m & ECX_CONSUMER_PARAM_##f) != 0)
	const char *registry = HAS(REGISTRY) ? pp->registry : NULL;
	if (registry == NULL || registry[0] == '\0')
		return ecx_why(why, whylen, ECX_EINVAL,
		               "a consumer needs a registry URL");
	uint64_t recv = HAS(RECV_CAPACITY) ? pp->recv_capacity : 256u << 20;
	unsigned rcmax =
	    HAS(REGCACHE_MAX) && pp->regcache_max ? pp->regcache_max : 64;
	ecx_consumer *c = calloc(1, sizeof(*c));
	if (c == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_init(&c->lock, NULL);
	pthread_mutex_init(&c->conn_lock, NULL);
	pthread_mutex_init(&c->reg_lock, NULL);
	c->timeout_ms =
	    HAS(TIMEOUT) && pp->timeout_ms > 0 ? pp->timeout_ms : 5000;
	int rc = ECX_ENOMEM;
	if (HAS(TOKEN) && pp->token && pp->token[0] &&
	    (c->token = strdup(pp->token)) == NULL)
		goto fail_msg;
	c->cache = calloc(rcmax, sizeof(*c->cache));
	if (c->cache == NULL)
		goto fail_msg;
	c->ncache = rcmax;
	ecx_regclient_opts ro = {.urls = registry,
	                         .token = c->token,
	                         .connect_timeout_ms = c->timeout_ms,
	                         .timeout_ms = c->timeout_ms};
	rc = ecx_regclient_create(&ro, &c->rc, why, whylen);
	if (rc != 0)
		goto fail;
	ecx_ucx_opts uo = {.transport = HAS(TRANSPORT) ? pp->transport : NULL,
	                   .bind_host = HAS(BIND_HOST) ? pp->bind_host : NULL,
	                   .nam = 1};
	uo.am[0].id = ECX_AM_REPLY;
	uo.am[0].cb = am_reply;
	uo.am[0].arg = c;
	rc = ecx_ucx_create(&uo, &c->ucx, why, whylen);
	if (rc != 0)
		goto fail;
	if (recv > 0) {
		rc = ecx_ucx_mem_alloc(c->ucx, recv, &c->arena_base,
		                       &c->arena.memh, why, whylen);
		if (rc != 0)
			goto fail;
		rc = ecx_ucx_rkey_pack(c->ucx, c->arena.memh, &c->arena.rkey,
		                       &c->arena.rkey_len);
		if (rc != 0 || !ecx_alloc_init(&c->alloc, recv)) {
			rc = rc ? rc : ECX_ENOMEM;
			ecx_why(why, whylen, rc, "cannot set up receive arena");
			goto fail;
		}
		c->arena.base = (uint64_t)(uintptr_t)c->arena_base;
		c->arena.len = recv;
		c->arena.live = true;
		c->st.registrations++;
	}
	rc = ecx_rdv_client_create(&c->rdv, why, whylen);
	if (rc != 0)
		goto fail;
	c->hooked = ucm_set_event_handler(UCM_EVENT_VM_UNMAPPED, 0, on_unmap,
	                                  c) == UCS_OK;
	if (!c->hooked)
		ecx_warn(MOD, "no unmap events: cached registrations of freed "
		              "memory are not invalidated");
#undef HAS
	*out = c;
	return 0;
fail_msg:
	ecx_why(why, whylen, rc, "out of memory");
fail:
	ecx_consumer_destroy(c);
	return rc;
}

void ecx_consumer_stats_get(ecx_consumer *c, ecx_consumer_stats *out)
{
	pthread_mutex_lock(&c->lock);
	*out = c->st;
	pthread_mutex_unlock(&c->lock);
}

void ecx_consumer_destroy(ecx_consumer *c)
{
	if (c == NULL)
		return;
	if (c->hooked)
		ucm_unset_event_handler(UCM_EVENT_VM_UNMAPPED, on_unmap, c);
	if (c->ucx != NULL) {
		ecx_ucx_stop(c->ucx);
		while (c->conns != NULL) {
			pconn *pc = c->conns;
			c->conns = pc->next;
			pconn_close(c, pc);
		}
		for (unsigned i = 0; c->cache != NULL && i < c->ncache; i++)
			if (c->cache[i].live)
				region_drop(c, &c->cache[i]);
		free(c->arena.rkey);
		ecx_ucx_mem_unmap(c->ucx, c->arena.memh);
		ecx_ucx_destroy(c->ucx);
	}
	ecx_rdv_client_destroy(c->rdv);
	ecx_alloc_fini(&c->alloc);
	free(c->allocs);
	free(c->cache);
	ecx_regclient_destroy(c->rc);
	if (c->token != NULL)
		memset(c->token, 0, strlen(c->token));
	free(c->token);
	pthread_mutex_destroy(&c->lock);
	pthread_mutex_destroy(&c->conn_lock);
	pthread_mutex_destroy(&c->reg_lock);
	free(c);
}
