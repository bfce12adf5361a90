/*
 * producer.c - the producer role: an arena of items with LRU eviction and
 * pins, publication to a registry, the ZeroMQ rendezvous socket, and the
 * pull service on UCX.
 *
 * Threads: the caller's (put, remove, stats), the ZeroMQ thread (hellos and
 * the reference's pull), and the UCX progress thread (pulls: queued by the
 * active-message handler, served in on_progress). p->lock guards the items,
 * the allocator, the LRU list, the connections and the pull jobs; it is
 * never held across a registry call or a memcpy of item bytes.
 */
#include "ctrl/ctrl.h"
#include "mem/alloc.h"
#include "registry/server.h"
#include "xfer/ucx.h"

#include <zmq.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MOD "producer"
#define MAX_CONNS 4096
#define RKEY_CACHE 64 /* as many as one pull may name */
#define PREFAULT_CHUNK (2u << 20)
#define HELLO_TTL_NS (60ull * 1000000000u)

typedef struct item {
	struct item *hnext;               /* hash chain */
	struct item *lru_prev, *lru_next; /* most recent at the head */
	uint64_t hash;
	uint64_t off;  /* in the arena */
	unsigned pins; /* pulls reading it now */
	bool ready;    /* bytes in place and published */
	bool doomed;   /* removed while pinned: freed at the last unpin */
	ecx_tensor_desc desc;
	char id[ECX_ID_MAX + 1];
} item;

/* A consumer's remote key, unpacked once and kept: for shared memory,
 * unpacking maps the consumer's segment into this process, and a fresh
 * mapping costs a page fault per page on the next write. */
typedef struct rkey_ent {
	uint64_t base, len;
	unsigned char *kbuf;
	size_t klen;
	ucp_rkey_h h;
	unsigned refs; /* jobs using it now */
	uint64_t used;
	char *local;      /* the region mapped here (shared memory), or NULL */
	uint8_t *touched; /* per PREFAULT_CHUNK of it: pages mapped here */
} rkey_ent;

typedef struct conn {
	uint64_t id;
	ucp_ep_h ep; /* made at the first pull */
	void *addr;  /* the consumer's worker address, from its hello */
	size_t addr_len;
	uint64_t born_ns; /* hellos that never pull are reaped */
	bool failed;      /* the endpoint reported an error: close it */
	bool closed;      /* its endpoint is closed; freed when jobs is 0 */
	unsigned jobs;    /* active jobs on it */
	rkey_ent rk[RKEY_CACHE];
	struct conn *next;
	struct ecx_producer *p;
} conn;

/* One pull, from its arrival to its reply. */
typedef struct job {
	struct job *next;
	uint64_t conn_id, req;
	char *msg; /* the JSON body */
	size_t len;
	/* while writing: */
	ecx_pull_req pr;
	item **items;     /* pinned item per request item, NULL if failed */
	int *status;      /* per request item */
	rkey_ent **rkeys; /* per region, entries of the connection's cache */
	rkey_ent *own;    /* per region, the job's own when the cache is full */
	conn *c;
	uint64_t deadline_ns;
	bool flushing, done;
	int flush_status;
} job;

struct ecx_producer {
	pthread_mutex_t lock;
	/* arena */
	void *base;
	ucp_mem_h memh;
	ecx_alloc alloc;
	/* items */
	item **buckets;
	size_t nbuckets, nitems;
	item *lru_head, *lru_tail;
	/* identity */
	char address[ECX_ADDR_MAX]; /* producer_zmq */
	uint64_t epoch;
	char *token;
	size_t token_len;
	int timeout_ms;
	/* registry */
	ecx_registry *registry; /* embedded, or NULL */
	ecx_regclient *remote;  /* remote, or NULL */
	int ttl_s; /* of Redis entries; renewed every third of it */
	bool redis;
	uint64_t next_refresh_ms;
	pthread_mutex_t remote_lock; /* the client is one thread at a time */
	/* data plane */
	ecx_ucx *ucx;
	conn *conns;
	size_t nconns;
	uint64_t next_conn;
	job *queue, *queue_tail; /* arrived, not yet started */
	job *active;             /* writing or flushing */
	/* ZeroMQ */
	void *zctx, *zsock;
	pthread_t zthread;
	bool zthread_started;
	int stop;
	ecx_producer_stats st;
};

/* ---- items ---- */

static uint64_t id_hash(const char *s)
{
	return ecx_hash_str(s);
}

static item *item_find(ecx_producer *p, const char *id)
{
	uint64_t h = id_hash(id);
	for (item *it = p->buckets[h & (p->nbuckets - 1)]; it; it = it->hnext)
		if (it->hash == h && strcmp(it->id, id) == 0)
			return it;
	return NULL;
}

static void lru_unlink(ecx_producer *p, item *it)
{
	if (it->lru_prev)
		it->lru_prev->lru_next = it->lru_next;
	else
		p->lru_head = it->lru_next;
	if (it->lru_next)
		it->lru_next->lru_prev = it->lru_prev;
	else
		p->lru_tail = it->lru_prev;
	it->lru_prev = it->lru_next = NULL;
}

static void lru_push(ecx_producer *p, item *it)
{
	it->lru_prev = NULL;
	it->lru_next = p->lru_head;
	if (p->lru_head)
		p->lru_head->lru_prev = it;
	p->lru_head = it;
	if (p->lru_tail == NULL)
		p->lru_tail = it;
}

static void item_insert(ecx_producer *p, item *it)
{
	it->hash = id_hash(it->id);
	size_t b = it->hash & (p->nbuckets - 1);
	it->hnext = p->buckets[b];
	p->buckets[b] = it;
	p->nitems++;
	lru_push(p, it);
}

/* Takes it out of the table and the LRU list; the caller frees or dooms. */
static void item_unlink(ecx_producer *p, item *it)
{
	item **pp = &p->buckets[it->hash & (p->nbuckets - 1)];
	while (*pp != it)
		pp = &(*pp)->hnext;
	*pp = it->hnext;
	p->nitems--;
	lru_unlink(p, it);
}

static void item_free(ecx_producer *p, item *it)
{
	ecx_alloc_give(&p->alloc, it->off, it->desc.nbytes);
	free(it);
}

/* ---- registry ---- */

static int publish(ecx_producer *p, const char *id, const ecx_tensor_desc *d,
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
	pthread_mutex_lock(&p->remote_lock);
	int rc = ecx_regclient_put(p->remote, id, &e, why, whylen);
	pthread_mutex_unlock(&p->remote_lock);
	return rc;
}

/* Removes id from the registry if it is still this producer's entry. */
static void unpublish(ecx_producer *p, const char *id)
{
	char why[256];
	int rc;
	if (p->registry != NULL) {
		ecx_store *s = ecx_registry_store(p->registry);
		rc = s->ops->del(s, id, p->address, why, sizeof(why));
		if (rc == 0)
			ecx_registry_count_publish(p->registry, true);
	} else {
		pthread_mutex_lock(&p->remote_lock);
		rc = ecx_regclient_delete(p->remote, id, p->address, why,
		                          sizeof(why));
		pthread_mutex_unlock(&p->remote_lock);
	}
	if (rc != 0 && rc != ECX_ENOTFOUND)
		ecx_warn(MOD, "cannot unpublish %s: %s", id, why);
}

/* ---- put, remove ---- */

/* Ids evicted under the lock, unpublished after it is released. */
typedef struct evicted {
	size_t n, cap;
	char (*ids)[ECX_ID_MAX + 1];
} evicted;

static void evicted_add(evicted *e, const char *id)
{
	if (e->n == e->cap) {
		size_t cap = e->cap ? e->cap * 2 : 8;
		void *ids = realloc(e->ids, cap * sizeof(*e->ids));
		if (ids == NULL)
			return; /* it stays in the registry; pulls get ENOTFOUND
			         */
		e->ids = ids;
		e->cap = cap;
	}
	ecx_strlcpy(e->ids[e->n++], id, ECX_ID_MAX + 1);
}

/* Finds room for n bytes, evicting unpinned items from the LRU tail. A dry
 * run on a copy of the free list finds how many must go first, so a put
 * that cannot succeed (everything pinned, or pinned items fragmenting the
 * space) evicts nothing. */
static int make_room(ecx_producer *p, uint64_t n, uint64_t *off, evicted *ev)
{
	if (ecx_alloc_take(&p->alloc, n, off))
		return 0;
	ecx_alloc dry;
	if (!ecx_alloc_clone(&dry, &p->alloc))
		return ECX_ENOMEM;
	item *last = NULL;
	uint64_t scratch;
	for (item *v = p->lru_tail; v != NULL; v = v->lru_prev) {
		if (v->pins > 0 || !v->ready)
			continue;
		ecx_alloc_give(&dry, v->off, v->desc.nbytes);
		if (ecx_alloc_take(&dry, n, &scratch)) {
			last = v;
			break;
		}
	}
	ecx_alloc_fini(&dry);
	if (last == NULL)
		return ECX_ENOSPC;
	item *v = p->lru_tail;
	for (;;) {
		item *prev = v->lru_prev;
		if (v->pins == 0 && v->ready) {
			bool done = v == last;
			item_unlink(p, v);
			evicted_add(ev, v->id);
			item_free(p, v);
			p->st.evictions++;
			if (done)
				break;
		}
		v = prev;
	}
	return ecx_alloc_take(&p->alloc, n, off) ? 0 : ECX_ENOSPC;
}

int ecx_producer_put(ecx_producer *p, const char *id,
                     const ecx_tensor_desc *desc, const void *src)
{
	char why[256];
	if (p == NULL || desc == NULL || (src == NULL && desc->nbytes > 0))
		return ecx_set_error(ECX_EINVAL, "put: missing argument");
	if (ecx_id_check(id, why, sizeof(why)) != 0)
		return ecx_set_error(ECX_EID, "put: %s", why);
	int rc = ecx_tensor_check(desc, why, sizeof(why));
	if (rc != 0)
		return ecx_set_error(rc, "put %s: %s", id, why);
	if (ecx_alloc_size(desc->nbytes) > p->alloc.capacity)
		return ecx_set_error(
		    ECX_ETOOBIG,
		    "put %s: %llu bytes do not fit in an arena "
		    "of %llu bytes",
		    id, (unsigned long long)desc->nbytes,
		    (unsigned long long)p->alloc.capacity);
	evicted ev = {0};
	pthread_mutex_lock(&p->lock);
	item *old = item_find(p, id);
	if (old != NULL) {
		bool same = old->desc.dtype == desc->dtype &&
		            old->desc.ndim == desc->ndim &&
		            old->desc.nbytes == desc->nbytes &&
		            memcmp(old->desc.shape, desc->shape,
		                   desc->ndim * sizeof(uint64_t)) == 0;
		if (same && old->ready) {
			lru_unlink(p, old);
			lru_push(p, old);
		}
		pthread_mutex_unlock(&p->lock);
		if (!same)
			return ecx_set_error(
			    ECX_EINVAL,
			    "put %s: held with another dtype or "
			    "shape; remove it first",
			    id);
		if (!old->ready)
			return ecx_set_error(ECX_EBUSY,
			                     "put %s: another put of it is in "
			                     "progress",
			                     id);
		return 0;
	}
	uint64_t off = 0;
	rc = make_room(p, desc->nbytes, &off, &ev);
	item *it = NULL;
	if (rc == 0) {
		it = calloc(1, sizeof(*it));
		if (it == NULL) {
			ecx_alloc_give(&p->alloc, off, desc->nbytes);
			rc = ECX_ENOMEM;
		}
	}
	if (it != NULL) {
		it->off = off;
		it->desc = *desc;
		ecx_strlcpy(it->id, id, sizeof(it->id));
		item_insert(p, it); /* not ready: invisible to pulls */
	}
	pthread_mutex_unlock(&p->lock);
	for (size_t i = 0; i < ev.n; i++)
		unpublish(p, ev.ids[i]);
	free(ev.ids);
	if (rc == ECX_ENOSPC)
		return ecx_set_error(
		    rc,
		    "put %s: no room for %llu bytes: every item "
		    "is being read by a pull",
		    id, (unsigned long long)desc->nbytes);
	if (rc != 0)
		return ecx_set_error(rc, "put %s: out of memory", id);

	if (desc->nbytes > 0)
		memcpy((char *)p->base + off, src, desc->nbytes);
	rc = publish(p, id, desc, why, sizeof(why));
	pthread_mutex_lock(&p->lock);
	if (rc == 0) {
		it->ready = true;
	} else {
		item_unlink(p, it);
		item_free(p, it);
	}
	pthread_mutex_unlock(&p->lock);
	if (rc != 0)
		return ecx_set_error(rc, "put %s: cannot publish: %s", id, why);
	ecx_debug(MOD, "put %s (%llu bytes at offset %llu)", id,
	          (unsigned long long)desc->nbytes, (unsigned long long)off);
	return 0;
}

int ecx_producer_remove(ecx_producer *p, const char *id)
{
	pthread_mutex_lock(&p->lock);
	item *it = item_find(p, id);
	if (it == NULL || !it->ready) {
		pthread_mutex_unlock(&p->lock);
		return ecx_set_error(ECX_ENOTFOUND, "remove %s: not held", id);
	}
	item_unlink(p, it);
	if (it->pins > 0)
		it->doomed = true;
	else
		item_free(p, it);
	pthread_mutex_unlock(&p->lock);
	unpublish(p, id);
	return 0;
}

/* ---- connections ---- */

static void conn_on_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	(void)ep;
	conn *c = arg;
	ecx_info(MOD, "consumer connection %llu failed: %s",
	         (unsigned long long)c->id, ucs_status_string(st));
	/* Runs in a progress call; on_progress closes the endpoint. */
	__atomic_store_n(&c->failed, true, __ATOMIC_RELEASE);
}

static conn *conn_find(ecx_producer *p, uint64_t id)
{
	for (conn *c = p->conns; c != NULL; c = c->next)
		if (c->id == id)
			return c;
	return NULL;
}

/* ---- pulls ---- */

static ucs_status_t am_pull(void *arg, const void *header, size_t header_len,
                            void *data, size_t len,
                            const ucp_am_recv_param_t *param)
{
	ecx_producer *p = arg;
	if (header_len != sizeof(ecx_am_hdr)) {
		ecx_warn(MOD, "pull with a %zu-byte header dropped",
		         header_len);
		return UCS_OK;
	}
	if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
		/* Consumers send pulls eagerly; this peer did not. */
		ecx_warn(MOD, "pull of %zu bytes dropped (rendezvous)", len);
		return UCS_OK;
	}
	job *j = calloc(1, sizeof(*j));
	char *msg = malloc(len + 1);
	if (j == NULL || msg == NULL) {
		free(j);
		free(msg);
		return UCS_OK;
	}
	ecx_am_hdr h;
	memcpy(&h, header, sizeof(h));
	ecx_debug(MOD, "pull %llu on connection %llu (%zu bytes)",
	          (unsigned long long)h.req, (unsigned long long)h.conn, len);
	memcpy(msg, data, len);
	msg[len] = '\0';
	j->conn_id = h.conn;
	j->req = h.req;
	j->msg = msg;
	j->len = len;
	pthread_mutex_lock(&p->lock);
	if (p->queue_tail)
		p->queue_tail->next = j;
	else
		p->queue = j;
	p->queue_tail = j;
	pthread_mutex_unlock(&p->lock);
	return UCS_OK;
}

static void send_done(void *request, ucs_status_t st, void *user_data)
{
	if (st != UCS_OK)
		ecx_warn(MOD, "reply send failed: %s", ucs_status_string(st));
	ecx_am_out_free(user_data);
	ucp_request_free(request);
}

/* Sends the reply of job j (when its connection still works). */
static void job_reply(job *j, int err, const char *detail)
{
	ecx_pull_resp r = {.req = j->req,
	                   .err = err,
	                   .nitems = j->pr.nitems,
	                   .status = j->status};
	if (detail != NULL)
		ecx_strlcpy(r.detail, detail, sizeof(r.detail));
	if (j->c == NULL || __atomic_load_n(&j->c->failed, __ATOMIC_ACQUIRE))
		return;
	ecx_am_out *o = calloc(1, sizeof(*o));
	if (o == NULL || (o->body = ecx_pull_resp_encode(&r)) == NULL) {
		free(o);
		return;
	}
	o->h = (ecx_am_hdr){.conn = j->conn_id, .req = j->req};
	ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA |
	                                          UCP_OP_ATTR_FIELD_FLAGS,
	                          .cb.send = send_done,
	                          .user_data = o,
	                          .flags = UCP_AM_SEND_FLAG_EAGER};
	ucs_status_ptr_t req =
	    ucp_am_send_nbx(j->c->ep, ECX_AM_REPLY, &o->h, sizeof(o->h),
	                    o->body, strlen(o->body), &rp);
	if (req == NULL || UCS_PTR_IS_ERR(req))
		ecx_am_out_free(o);
}

/* Unpins the job's items. Called with the lock. */
static void job_unpin(ecx_producer *p, job *j)
{
	for (size_t i = 0; j->items != NULL && i < j->pr.nitems; i++) {
		item *it = j->items[i];
		if (it == NULL)
			continue;
		j->items[i] = NULL;
		if (--it->pins == 0) {
			p->st.pinned--;
			if (it->doomed)
				item_free(p, it);
		}
	}
}

/* Unpins what is still pinned and frees what the job holds. Called with
 * the lock. */
static void job_release(ecx_producer *p, job *j)
{
	job_unpin(p, j);
	for (size_t i = 0; j->rkeys != NULL && i < j->pr.nregions; i++) {
		if (j->rkeys[i] == NULL)
			continue;
		if (j->own != NULL && j->rkeys[i] == &j->own[i])
			ucp_rkey_destroy(j->own[i].h);
		else
			j->rkeys[i]->refs--;
	}
	free(j->own);
	if (j->c != NULL)
		j->c->jobs--;
	ecx_pull_req_free(&j->pr);
	free(j->items);
	free(j->status);
	free(j->rkeys);
	free(j->msg);
	free(j);
}

static void flush_done(void *request, ucs_status_t st, void *user_data)
{
	job *j = user_data;
	j->flush_status = st == UCS_OK ? 0 : ecx_ucx_err(st);
	__atomic_store_n(&j->done, true, __ATOMIC_RELEASE);
	ucp_request_free(request);
}

/* The connection's unpacked key for region g, unpacking it on a miss (and
 * dropping the least recently used entry no job holds). Progress thread
 * only. NULL when the key cannot be unpacked or every entry is held. */
static rkey_ent *rkey_get(conn *c, const ecx_region *g)
{
	rkey_ent *victim = NULL;
	for (int i = 0; i < RKEY_CACHE; i++) {
		rkey_ent *e = &c->rk[i];
		if (e->h != NULL && e->base == g->base && e->len == g->len &&
		    e->klen == g->rkey_len &&
		    memcmp(e->kbuf, g->rkey, g->rkey_len) == 0) {
			e->refs++;
			e->used = ecx_now_ns();
			return e;
		}
		if (e->refs == 0 &&
		    (victim == NULL || e->h == NULL ||
		     (victim->h != NULL && e->used < victim->used)))
			victim = e;
	}
	if (victim == NULL)
		return NULL;
	if (victim->h != NULL) {
		ucp_rkey_destroy(victim->h);
		free(victim->touched);
		free(victim->kbuf);
		memset(victim, 0, sizeof(*victim));
	}
	victim->kbuf = malloc(g->rkey_len);
	if (victim->kbuf == NULL)
		return NULL;
	if (ucp_ep_rkey_unpack(c->ep, g->rkey, &victim->h) != UCS_OK) {
		free(victim->kbuf);
		memset(victim, 0, sizeof(*victim));
		return NULL;
	}
	void *local;
	if (ucp_rkey_ptr(victim->h, g->base, &local) == UCS_OK) {
		victim->touched =
		    calloc(g->len / PREFAULT_CHUNK + 2, sizeof(uint8_t));
		if (victim->touched != NULL)
			victim->local = local;
	}
	memcpy(victim->kbuf, g->rkey, g->rkey_len);
	victim->klen = g->rkey_len;
	victim->base = g->base;
	victim->len = g->len;
	victim->refs = 1;
	victim->used = ecx_now_ns();
	return victim;
}

/* Where the consumer's memory is mapped into this process (shared
 * memory), maps the pages of [addr, addr + n) that this process has not
 * touched yet, a 2 MiB chunk at a time: one madvise instead of a page fault
 * per page inside the write (page faults are slow on these machines). */
static void rkey_prefault(rkey_ent *e, uint64_t addr, uint64_t n)
{
	if (e->local == NULL || n == 0)
		return;
	uint64_t first = (addr - e->base) / PREFAULT_CHUNK;
	uint64_t last = (addr + n - 1 - e->base) / PREFAULT_CHUNK;
	for (uint64_t k = first; k <= last; k++) {
		if (e->touched[k])
			continue;
		uint64_t lo = k * PREFAULT_CHUNK;
		uint64_t hi =
		    lo + PREFAULT_CHUNK < e->len ? lo + PREFAULT_CHUNK : e->len;
		uintptr_t a = (uintptr_t)(e->local + lo) / 4096 * 4096;
		uintptr_t b = (uintptr_t)(e->local + hi);
		if (madvise((void *)a, b - a, MADV_POPULATE_WRITE) != 0)
			ecx_debug(MOD, "cannot prefault: %m");
		e->touched[k] = 1;
	}
}

static void rkeys_drop(conn *c)
{
	for (int i = 0; i < RKEY_CACHE; i++) {
		if (c->rk[i].h != NULL)
			ucp_rkey_destroy(c->rk[i].h);
		free(c->rk[i].touched);
		free(c->rk[i].kbuf);
		memset(&c->rk[i], 0, sizeof(c->rk[i]));
	}
}

/* Starts job j: checks, pins, unpacks keys, posts the writes and a flush.
 * Called from the progress thread without the lock. Returns false when the
 * job was answered and released at once. */
static bool job_start(ecx_producer *p, job *j)
{
	char why[200];
	int rc = ecx_pull_req_decode(j->msg, j->len, &j->pr, why, sizeof(why));
	pthread_mutex_lock(&p->lock);
	j->c = conn_find(p, j->conn_id);
	if (j->c != NULL)
		j->c->jobs++;
	pthread_mutex_unlock(&p->lock);
	if (j->c != NULL && j->c->ep == NULL && !j->c->failed) {
		char ewhy[200];
		if (ecx_ucx_ep_create(p->ucx, j->c->addr, j->c->addr_len,
		                      conn_on_error, j->c, &j->c->ep, ewhy,
		                      sizeof(ewhy)) != 0) {
			ecx_warn(MOD, "connection %llu: %s",
			         (unsigned long long)j->c->id, ewhy);
			j->c->failed = true;
		}
	}
	if (j->c == NULL || j->c->failed) {
		pthread_mutex_lock(&p->lock);
		job_release(p, j);
		pthread_mutex_unlock(&p->lock);
		return false;
	}
	if (rc == 0 && p->token != NULL &&
	    !ecx_ct_equal(j->pr.token, strlen(j->pr.token), p->token,
	                  p->token_len)) {
		rc = ECX_EAUTH;
		snprintf(why, sizeof(why), "bad or missing token");
	}
	if (rc != 0) {
		ecx_pull_req_free(&j->pr);
		pthread_mutex_lock(&p->lock);
		p->st.pulls++;
		pthread_mutex_unlock(&p->lock);
		job_reply(j, rc, why);
		pthread_mutex_lock(&p->lock);
		job_release(p, j);
		pthread_mutex_unlock(&p->lock);
		return false;
	}
	size_t n = j->pr.nitems;
	j->items = calloc(n + 1, sizeof(*j->items));
	j->status = calloc(n + 1, sizeof(*j->status));
	j->rkeys = calloc(j->pr.nregions + 1, sizeof(*j->rkeys));
	if (j->items == NULL || j->status == NULL || j->rkeys == NULL) {
		job_reply(j, ECX_ENOMEM, "out of memory");
		pthread_mutex_lock(&p->lock);
		job_release(p, j);
		pthread_mutex_unlock(&p->lock);
		return false;
	}
	pthread_mutex_lock(&p->lock);
	for (size_t i = 0; i < n; i++) {
		item *it = item_find(p, j->pr.items[i].id);
		if (it == NULL || !it->ready) {
			j->status[i] = ECX_ENOTFOUND;
			continue;
		}
		if (it->desc.nbytes != j->pr.items[i].nbytes) {
			j->status[i] = ECX_ESIZE;
			continue;
		}
		if (it->pins++ == 0)
			p->st.pinned++;
		lru_unlink(p, it);
		lru_push(p, it);
		j->items[i] = it;
	}
	pthread_mutex_unlock(&p->lock);
	for (size_t g = 0; g < j->pr.nregions; g++) {
		j->rkeys[g] = rkey_get(j->c, &j->pr.regions[g]);
		if (j->rkeys[g] != NULL)
			continue;
		/* Every cache entry is held by pulls in flight: this pull
		 * unpacks its own, for its own life. */
		if (j->own == NULL)
			j->own = calloc(j->pr.nregions, sizeof(*j->own));
		if (j->own != NULL &&
		    ucp_ep_rkey_unpack(j->c->ep, j->pr.regions[g].rkey,
		                       &j->own[g].h) == UCS_OK)
			j->rkeys[g] = &j->own[g];
	}
	for (size_t i = 0; i < n; i++) {
		item *it = j->items[i];
		if (it == NULL || it->desc.nbytes == 0)
			continue;
		rkey_ent *re = j->rkeys[j->pr.items[i].region];
		ucp_rkey_h rk = re != NULL ? re->h : NULL;
		if (rk == NULL) {
			j->status[i] = ECX_EPROTO;
			continue;
		}
		rkey_prefault(re, j->pr.items[i].addr, it->desc.nbytes);
		ucp_request_param_t rp = {.op_attr_mask = 0};
		ucs_status_ptr_t req =
		    ucp_put_nbx(j->c->ep, (char *)p->base + it->off,
		                it->desc.nbytes, j->pr.items[i].addr, rk, &rp);
		if (UCS_PTR_IS_ERR(req))
			j->status[i] = ecx_ucx_err(UCS_PTR_STATUS(req));
		else if (req != NULL)
			ucp_request_free(req); /* completion: the flush below */
	}
	j->deadline_ns = ecx_now_ns() + (uint64_t)p->timeout_ms * 1000000u;
	ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA,
	                          .cb.send = flush_done,
	                          .user_data = j};
	j->flushing = true;
	ucs_status_ptr_t req = ucp_ep_flush_nbx(j->c->ep, &fp);
	if (req == NULL) {
		j->done = true;
	} else if (UCS_PTR_IS_ERR(req)) {
		j->flush_status = ecx_ucx_err(UCS_PTR_STATUS(req));
		j->done = true;
	}
	return true;
}

/* Finishes job j after its flush: statuses, stats, reply, unpin. */
static void job_finish(ecx_producer *p, job *j)
{
	uint64_t served = 0, bytes = 0, failed = 0;
	for (size_t i = 0; i < j->pr.nitems; i++) {
		if (j->status[i] == 0 && j->flush_status != 0)
			j->status[i] = j->flush_status;
		if (j->status[i] == 0) {
			served++;
			bytes += j->pr.items[i].nbytes;
		} else {
			failed++;
		}
	}
	ecx_debug(MOD, "pull %llu done: %llu served, %llu failed, flush %s",
	          (unsigned long long)j->req, (unsigned long long)served,
	          (unsigned long long)failed, ecx_err_name(j->flush_status));
	/* Unpin and count before the reply goes: a consumer that has its
	 * answer sees the producer's state after the pull. */
	pthread_mutex_lock(&p->lock);
	p->st.pulls++;
	p->st.items_served += served;
	p->st.items_failed += failed;
	p->st.bytes_served += bytes;
	job_unpin(p, j);
	pthread_mutex_unlock(&p->lock);
	job_reply(j, 0, NULL);
	pthread_mutex_lock(&p->lock);
	job_release(p, j);
	pthread_mutex_unlock(&p->lock);
}

/* Closes the endpoints of failed connections (which completes their jobs'
 * flushes with an error), and frees a closed connection once no job uses
 * it. Hellos that never pulled go after HELLO_TTL_NS. */
static void conns_reap(ecx_producer *p)
{
	for (;;) {
		conn *close_it = NULL, *free_it = NULL;
		pthread_mutex_lock(&p->lock);
		for (conn **cp = &p->conns; *cp != NULL; cp = &(*cp)->next) {
			conn *c = *cp;
			bool unused = c->ep == NULL && !c->closed &&
			              ecx_now_ns() - c->born_ns > HELLO_TTL_NS;
			if (unused)
				c->failed = true;
			if (!__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE))
				continue;
			if (!c->closed) {
				c->closed = true;
				close_it = c;
				break;
			}
			if (c->jobs == 0) {
				*cp = c->next;
				p->nconns--;
				free_it = c;
				break;
			}
		}
		pthread_mutex_unlock(&p->lock);
		if (close_it == NULL && free_it == NULL)
			return;
		if (close_it != NULL) {
			/* The keys go first: they refer to the endpoint. Jobs
			 * holding them finish with the flush's error. */
			if (close_it->jobs == 0)
				rkeys_drop(close_it);
			ecx_ucx_ep_close(p->ucx, close_it->ep, 100);
			close_it->ep = NULL;
			continue;
		}
		rkeys_drop(free_it);
		ecx_debug(MOD, "closed connection %llu",
		          (unsigned long long)free_it->id);
		free(free_it->addr);
		free(free_it);
	}
}

/* The progress thread's hook: starts queued jobs, finishes flushed ones,
 * fails jobs past their deadline, and reaps failed connections. */
static void producer_progress(void *arg)
{
	ecx_producer *p = arg;
	for (;;) {
		pthread_mutex_lock(&p->lock);
		job *j = p->queue;
		if (j != NULL) {
			p->queue = j->next;
			if (p->queue == NULL)
				p->queue_tail = NULL;
			j->next = NULL;
		}
		pthread_mutex_unlock(&p->lock);
		if (j == NULL)
			break;
		if (job_start(p, j)) {
			pthread_mutex_lock(&p->lock);
			j->next = p->active;
			p->active = j;
			pthread_mutex_unlock(&p->lock);
		}
	}
	uint64_t now = ecx_now_ns();
	for (;;) {
		job *fin = NULL;
		pthread_mutex_lock(&p->lock);
		for (job **jp = &p->active; *jp != NULL; jp = &(*jp)->next) {
			job *j = *jp;
			if (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE) &&
			    now > j->deadline_ns && j->c != NULL &&
			    !j->c->failed) {
				/* A consumer that stalls: give up on it. */
				ecx_warn(MOD,
				         "pull %llu on connection %llu timed "
				         "out; closing the connection",
				         (unsigned long long)j->req,
				         (unsigned long long)j->conn_id);
				__atomic_store_n(&j->c->failed, true,
				                 __ATOMIC_RELEASE);
				j->deadline_ns = UINT64_MAX; /* warned once */
			}
			if (__atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) {
				*jp = j->next;
				fin = j;
				break;
			}
		}
		pthread_mutex_unlock(&p->lock);
		if (fin == NULL)
			break;
		job_finish(p, fin);
	}
	conns_reap(p);
}

/* ---- the ZeroMQ socket ---- */

/* A hello records the consumer's worker address; the endpoint to it is
 * made at its first pull (conn_connect), once the consumer's own endpoint
 * to this worker is wired up. Creating both at once races in UCX's
 * endpoint matching, and a pull then loses its reply. */
static char *zmq_hello(ecx_producer *p, const ecx_zreq *r)
{
	if (p->token != NULL &&
	    !ecx_ct_equal(r->token, strlen(r->token), p->token, p->token_len))
		return ecx_zresp_encode_error(ECX_EAUTH, NULL);
	conn *c = calloc(1, sizeof(*c));
	void *addr = malloc(r->worker_len);
	if (c == NULL || addr == NULL) {
		free(c);
		free(addr);
		return ecx_zresp_encode_error(ECX_ENOMEM, NULL);
	}
	memcpy(addr, r->worker, r->worker_len);
	c->addr = addr;
	c->addr_len = r->worker_len;
	c->p = p;
	c->born_ns = ecx_now_ns();
	pthread_mutex_lock(&p->lock);
	if (p->nconns >= MAX_CONNS) {
		pthread_mutex_unlock(&p->lock);
		free(addr);
		free(c);
		return ecx_zresp_encode_error(ECX_EBUSY,
		                              "too many consumer connections");
	}
	uint64_t id = c->id = ++p->next_conn;
	c->next = p->conns;
	p->conns = c;
	p->nconns++;
	/* c belongs to the progress thread from here on. */
	pthread_mutex_unlock(&p->lock);
	const void *waddr;
	size_t alen;
	ecx_ucx_address(p->ucx, &waddr, &alen);
	ecx_debug(MOD, "consumer connection %llu", (unsigned long long)id);
	return ecx_zresp_encode_hello(waddr, alen, p->epoch, id);
}

/* The reference's {"op":"pull",...}: answered in its reply shape. ecx
 * cannot write into a Mooncake session, so a pull that would succeed there
 * is refused with the reason. */
static char *zmq_ref_pull(ecx_producer *p, const ecx_zreq *r)
{
	if (p->token != NULL &&
	    !ecx_ct_equal(r->token, strlen(r->token), p->token, p->token_len))
		return ecx_zresp_encode_error(ECX_EAUTH, NULL);
	pthread_mutex_lock(&p->lock);
	item *it = item_find(p, r->mm_hash);
	int rc = it == NULL || !it->ready       ? ECX_ENOTFOUND
	         : it->desc.nbytes != r->nbytes ? ECX_ESIZE
	                                        : ECX_EUNSUPPORTED;
	pthread_mutex_unlock(&p->lock);
	if (rc != ECX_EUNSUPPORTED)
		return ecx_zresp_encode_error(rc, NULL);
	return ecx_zresp_encode_error(
	    rc, "ecx cannot write into a Mooncake session; pull with an ecx "
	        "consumer");
}

/* Keeps this producer's entries in a remote registry: with Redis, writes
 * them again every third of their TTL; with HTTP, checks every 2 s whether
 * the registry restarted and then publishes them again. Runs on the
 * ZeroMQ thread, which wakes every 100 ms. */
static void registry_sync(ecx_producer *p)
{
	if (p->remote == NULL || ecx_now_ms() < p->next_refresh_ms)
		return;
	uint64_t period = p->ttl_s > 0 ? (uint64_t)p->ttl_s * 1000 / 3 : 2000;
	p->next_refresh_ms = ecx_now_ms() + (period < 2000 ? period : 2000);
	if (p->redis && p->ttl_s <= 0)
		return;
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
			n++;
		}
	}
	pthread_mutex_unlock(&p->lock);
	char why[256];
	size_t again = 0;
	pthread_mutex_lock(&p->remote_lock);
	int rc = ecx_regclient_sync(p->remote, ptrs, es, n, &again, why,
	                            sizeof(why));
	pthread_mutex_unlock(&p->remote_lock);
	if (rc != 0)
		ecx_warn(MOD, "registry: %s (publishing again when it is back)",
		         why);
	else if (again > 0 && !p->redis)
		ecx_info(MOD,
		         "the registry restarted: published %zu items "
		         "again",
		         again);
	free(ids);
	free(ptrs);
	free(es);
}

static void *zmq_thread(void *arg)
{
	ecx_producer *p = arg;
	while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
		registry_sync(p);
		zmq_pollitem_t pi = {.socket = p->zsock, .events = ZMQ_POLLIN};
		int n = zmq_poll(&pi, 1, 100);
		if (n <= 0)
			continue;
		zmq_msg_t m;
		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, p->zsock, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&m);
			continue;
		}
		/* A request of several frames is read whole, then refused. */
		bool multi = false;
		while (zmq_msg_more(&m)) {
			multi = true;
			zmq_msg_close(&m);
			zmq_msg_init(&m);
			if (zmq_msg_recv(&m, p->zsock, 0) < 0)
				break;
		}
		char *reply;
		char why[200];
		ecx_zreq r;
		if (multi) {
			reply = ecx_zresp_encode_error(ECX_EPROTO,
			                               "expected one frame");
		} else {
			int rc =
			    ecx_zreq_decode(zmq_msg_data(&m), zmq_msg_size(&m),
			                    &r, why, sizeof(why));
			if (rc != 0)
				reply = ecx_zresp_encode_error(rc, why);
			else if (r.op == ECX_ZOP_HELLO)
				reply = zmq_hello(p, &r);
			else
				reply = zmq_ref_pull(p, &r);
			if (rc == 0)
				ecx_zreq_free(&r);
		}
		zmq_msg_close(&m);
		if (reply == NULL)
			reply =
			    strdup("{\"ok\":false,\"err\":\"out of memory\"}");
		if (reply != NULL)
			zmq_send(p->zsock, reply, strlen(reply), 0);
		free(reply);
	}
	return NULL;
}

/* The first non-loopback IPv4 address of this host, else 127.0.0.1. */
static void default_host(char *out, size_t len)
{
	ecx_strlcpy(out, "127.0.0.1", len);
	struct ifaddrs *ifs = NULL;
	if (getifaddrs(&ifs) != 0)
		return;
	for (struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
		if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET)
			continue;
		struct in_addr a =
		    ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
		if ((ntohl(a.s_addr) >> 24) == 127)
			continue;
		inet_ntop(AF_INET, &a, out, (socklen_t)len);
		break;
	}
	freeifaddrs(ifs);
}

static uint64_t random_epoch(void)
{
	uint64_t v = 0;
	int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		if (read(fd, &v, sizeof(v)) != (ssize_t)sizeof(v))
			v = 0;
		close(fd);
	}
	v ^= ecx_now_ns() ^ ((uint64_t)getpid() << 32);
	v &= ECX_JSON_INT_MAX - 1;
	return v != 0 ? v : 1;
}

static int zmq_start(ecx_producer *p, const char *bind, const char *adv,
                     uint16_t port, char *why, size_t whylen)
{
	p->zctx = zmq_ctx_new();
	if (p->zctx == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "zmq_ctx_new failed");
	zmq_ctx_set(p->zctx, ZMQ_IO_THREADS, 1);
	p->zsock = zmq_socket(p->zctx, ZMQ_REP);
	int64_t maxmsg = ECX_ZMQ_MAX_MSG;
	int linger = 0;
	zmq_setsockopt(p->zsock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	zmq_setsockopt(p->zsock, ZMQ_LINGER, &linger, sizeof(linger));
	char ep[ECX_ADDR_MAX];
	if (port == 0)
		snprintf(ep, sizeof(ep), "tcp://%s:*", bind);
	else
		snprintf(ep, sizeof(ep), "tcp://%s:%u", bind, port);
	if (zmq_bind(p->zsock, ep) != 0) {
		int e = zmq_errno();
		return ecx_why(
		    why, whylen, e == EADDRINUSE ? ECX_EADDRINUSE : ECX_EINVAL,
		    "cannot bind ZeroMQ socket at %s: %s", ep, zmq_strerror(e));
	}
	char last[ECX_ADDR_MAX];
	size_t ll = sizeof(last);
	zmq_getsockopt(p->zsock, ZMQ_LAST_ENDPOINT, last, &ll);
	const char *colon = strrchr(last, ':');
	snprintf(p->address, sizeof(p->address), "tcp://%.200s:%.16s", adv,
	         colon != NULL ? colon + 1 : "0");
	if (pthread_create(&p->zthread, NULL, zmq_thread, p) != 0)
		return ecx_why(why, whylen, ECX_ENOMEM, "cannot start thread");
	p->zthread_started = true;
	return 0;
}

/* ---- create, stats, destroy ---- */

int ecx_producer_create(const ecx_producer_params *pp, ecx_producer **out,
                        char *why, size_t whylen)
{
	uint64_t m = pp != NULL ? pp->field_mask : 0;
#define HAS(f) ((m & ECX_PRODUCER_PARAM_##f) != 0)
	uint64_t cap =
	    HAS(CAPACITY) ? pp->capacity_bytes : ECX_CAPACITY_DEFAULT;
	const char *bind =
	    HAS(BIND_HOST) && pp->bind_host ? pp->bind_host : "0.0.0.0";
	const char *token =
	    HAS(TOKEN) && pp->token && pp->token[0] ? pp->token : NULL;
	int timeout =
	    HAS(TIMEOUT) && pp->timeout_ms > 0 ? pp->timeout_ms : 5000;
	int reg_port =
	    HAS(REGISTRY_PORT) ? pp->registry_port : ECX_REGISTRY_PORT_DEFAULT;
	const char *remote = HAS(REGISTRY) && pp->registry && pp->registry[0]
	                         ? pp->registry
	                         : NULL;
	char adv[ECX_ADDR_MAX];
	if (HAS(ADVERTISE_HOST) && pp->advertise_host && pp->advertise_host[0])
		ecx_strlcpy(adv, pp->advertise_host, sizeof(adv));
	else if (strcmp(bind, "0.0.0.0") == 0 || strcmp(bind, "::") == 0)
		default_host(adv, sizeof(adv));
	else
		ecx_strlcpy(adv, bind, sizeof(adv));
	if (cap < ECX_ALLOC_ALIGN || cap >= ECX_JSON_INT_MAX)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "capacity must be 4 KiB to 2^53 bytes");
	if (reg_port < -1 || reg_port > 65535)
		return ecx_why(why, whylen, ECX_EINVAL, "bad registry port %d",
		               reg_port);
	if (remote != NULL && HAS(REGISTRY_PORT) && reg_port >= 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "give a remote registry or an embedded registry "
		               "port, not both");
	if (remote == NULL && reg_port < 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "no registry: give a remote registry URL or an "
		               "embedded registry port");
#undef HAS
	ecx_producer *p = calloc(1, sizeof(*p));
	if (p == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_init(&p->lock, NULL);
	pthread_mutex_init(&p->remote_lock, NULL);
	p->epoch = random_epoch();
	p->timeout_ms = timeout;
	p->st.capacity = cap;
	int rc = ECX_ENOMEM;
	p->nbuckets = 1024;
	p->buckets = calloc(p->nbuckets, sizeof(*p->buckets));
	if (p->buckets == NULL || !ecx_alloc_init(&p->alloc, cap))
		goto fail_msg;
	if (token != NULL) {
		p->token = strdup(token);
		if (p->token == NULL)
			goto fail_msg;
		p->token_len = strlen(token);
	}
	if (remote != NULL) {
		p->redis = strncmp(remote, "redis://", 8) == 0;
		p->ttl_s = (m & ECX_PRODUCER_PARAM_REGISTRY_TTL)
		               ? pp->registry_ttl_s
		               : 30;
		ecx_regclient_opts ro = {.urls = remote,
		                         .token = token,
		                         .connect_timeout_ms = timeout,
		                         .timeout_ms = timeout,
		                         .ttl_s = p->ttl_s};
		rc = ecx_regclient_create(&ro, &p->remote, why, whylen);
		if (rc != 0)
			goto fail;
	} else {
		ecx_registry_params rp = {.field_mask =
		                              ECX_REGISTRY_PARAM_BIND_HOST |
		                              ECX_REGISTRY_PARAM_PORT |
		                              ECX_REGISTRY_PARAM_TOKEN,
		                          .bind_host = bind,
		                          .port = (uint16_t)reg_port,
		                          .token = token};
		rc = ecx_registry_create(&rp, &p->registry, why, whylen);
		if (rc != 0)
			goto fail;
	}
	ecx_ucx_opts uo = {.transport = (m & ECX_PRODUCER_PARAM_TRANSPORT)
	                                    ? pp->transport
	                                    : NULL,
	                   .bind_host = bind,
	                   .on_progress = producer_progress,
	                   .arg = p,
	                   .spin_ns = 200000,
	                   .nam = 1};
	uo.am[0].id = ECX_AM_PULL;
	uo.am[0].cb = am_pull;
	uo.am[0].arg = p;
	rc = ecx_ucx_create(&uo, &p->ucx, why, whylen);
	if (rc != 0)
		goto fail;
	rc = ecx_ucx_mem_alloc(p->ucx, cap, &p->base, &p->memh, why, whylen);
	if (rc != 0)
		goto fail;
	p->st.registrations = 1;
	rc = zmq_start(p, bind, adv,
	               (m & ECX_PRODUCER_PARAM_ZMQ_PORT) ? pp->zmq_port : 0,
	               why, whylen);
	if (rc != 0)
		goto fail;
	ecx_info(MOD, "serving at %s, arena %llu bytes, registry %s",
	         p->address, (unsigned long long)cap,
	         remote != NULL ? remote : "embedded");
	*out = p;
	return 0;
fail_msg:
	ecx_why(why, whylen, rc, "out of memory");
fail:
	ecx_producer_destroy(p);
	return rc;
}

const char *ecx_producer_address(const ecx_producer *p)
{
	return p->address;
}

uint16_t ecx_producer_registry_port(const ecx_producer *p)
{
	return p->registry != NULL ? ecx_registry_port(p->registry) : 0;
}

void ecx_producer_stats_get(ecx_producer *p, ecx_producer_stats *out)
{
	pthread_mutex_lock(&p->lock);
	*out = p->st;
	out->items = p->nitems;
	out->bytes_used = p->alloc.used;
	out->connections = p->nconns;
	pthread_mutex_unlock(&p->lock);
}

void ecx_producer_destroy(ecx_producer *p)
{
	if (p == NULL)
		return;
	__atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
	if (p->zthread_started)
		pthread_join(p->zthread, NULL);
	if (p->zsock != NULL)
		zmq_close(p->zsock);
	if (p->zctx != NULL)
		zmq_ctx_term(p->zctx);
	/* Unpublish everything this producer published. */
	for (size_t b = 0; p->buckets != NULL && b < p->nbuckets; b++)
		for (item *it = p->buckets[b]; it != NULL; it = it->hnext)
			if (it->ready)
				unpublish(p, it->id);
	if (p->ucx != NULL) {
		/* Fail what is in flight, then close every endpoint. */
		pthread_mutex_lock(&p->lock);
		for (conn *c = p->conns; c != NULL; c = c->next)
			c->failed = true;
		pthread_mutex_unlock(&p->lock);
		uint64_t until = ecx_now_ns() + 500000000u;
		while (p->active != NULL && ecx_now_ns() < until)
			usleep(1000);
		ecx_ucx_stop(p->ucx);
		while (p->queue != NULL) {
			job *j = p->queue;
			p->queue = j->next;
			job_release(p, j);
		}
		while (p->active != NULL) {
			job *j = p->active;
			p->active = j->next;
			job_release(p, j);
		}
		while (p->conns != NULL) {
			conn *c = p->conns;
			p->conns = c->next;
			rkeys_drop(c);
			ecx_ucx_ep_close(p->ucx, c->ep, 100);
			free(c->addr);
			free(c);
		}
		ecx_ucx_mem_unmap(p->ucx, p->memh);
		ecx_ucx_destroy(p->ucx);
	}
	for (size_t b = 0; p->buckets != NULL && b < p->nbuckets; b++) {
		item *it = p->buckets[b];
		while (it != NULL) {
			item *next = it->hnext;
			free(it);
			it = next;
		}
	}
	free(p->buckets);
	ecx_alloc_fini(&p->alloc);
	ecx_registry_destroy(p->registry);
	ecx_regclient_destroy(p->remote);
	if (p->token != NULL)
		memset(p->token, 0, p->token_len);
	free(p->token);
	pthread_mutex_destroy(&p->lock);
	pthread_mutex_destroy(&p->remote_lock);
	free(p);
}
