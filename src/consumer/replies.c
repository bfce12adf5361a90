/*
 * replies.c - what producers send back on a connection: the reply that ends
 * each pull (ECX_AM_REPLY), and, for a pull that asked for its data as
 * active messages (over TCP), the data (ECX_AM_DATA), received into the
 * items' destinations by rendezvous (UCX copies out of its receive
 * segment what it had read into it first: up to all of a message of 1
 * MiB or less). Both run in a progress call
 * of the worker (the waiting caller's or the progress thread's).
 *
 * A data_am pull ends when its reply has come (alone, or inside the header
 * of its only data message) and none of its receives is still landing; an item
 * the reply calls done whose bytes did not all land fails. Data for a pull that
 * is no longer waited for (its load timed out, or it is unknown) is refused,
 * and the producer's send fails with it: no byte lands after a load has
 * returned.
 *
 * With integrity on, each item whose bytes are in (a data receive done, or
 * ECX_AM_LANDED from a producer that puts) is marked for the caller
 * waiting for its load, which hashes it between progress calls while the
 * rest of the batch lands (cons_load_hash_landed): then, where it sits in
 * the CPU's caches, and beside the producer's copy of the next item rather
 * than after the last; cons_load_verify compares the hashes once the pulls
 * are over.
 */
#include "consumer/consumer.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "consumer"

/* A data_am pull's dstat per item: its bytes have not come, are landing;
 * else 0 (landed) or the receive's error (ecx errors are negative: these
 * two are none of them). */
#define DATA_NONE INT_MIN
#define DATA_LANDING (INT_MIN + 1)

/* Copies n bytes from src to dst (not overlapping) as memcpy does, but
 * from the end down where dst lies a little past src modulo 4 KiB: there a
 * forward copy (glibc's memcpy takes `rep movsb` from 2 KiB to 512 KiB)
 * loads each line soon after storing to an address with the same low 12
 * bits, and waits on each of those false dependencies (many times slower
 * on the AMD EPYC of docs/deploy.md); a copy downwards stores behind its
 * loads. An eager message's bytes sit a few bytes past the start of a
 * segment of UCX's, so its items' page-aligned destinations often lie just
 * there. */
static void copy_out(void *dst, const void *src, size_t n)
{
	uintptr_t dist = ((uintptr_t)dst - (uintptr_t)src) & 4095;
	if (dist == 0 || dist >= 64 || n < 4096) {
		memcpy(dst, src, n);
		return;
	}
	char *d = (char *)dst + n;
	const char *s = (const char *)src + n;
	for (; n >= 64; n -= 64) {
		d -= 64;
		s -= 64;
		memcpy(d, s, 64);
	}
	memcpy(dst, src, n);
}

/* Data messages taken, by every consumer of this process (atomic): what
 * tests read to tell which way a pull's data came. */
uint64_t cons_data_messages, cons_reply_messages, cons_lead_messages;
uint64_t cons_landed_messages, cons_hashed_early;

static pull *pull_find(ecx_consumer *c, uint64_t req)
{
	for (pull *p = c->inflight; p != NULL; p = p->next)
		if (p->req == req)
			return p;
	return NULL;
}

pull *cons_pull_take(ecx_consumer *c, uint64_t req)
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

static void pull_fail_items(pull *p, int err)
{
	for (size_t i = 0; i < p->n; i++)
		p->load->items[p->idx[i]].status = err;
}

/* Ends pull p with err for every item it carries. Called with the lock. */
void cons_pull_fail(pull *p, int err)
{
	pull_fail_items(p, err);
	__atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
}

/* Items first..first+count-1 of p (checked by the caller to be p's) have
 * landed: marked for the waiting caller to hash, with integrity on. Called
 * with the lock. */
static void items_landed(pull *p, uint32_t first, uint32_t count)
{
	if (p->zombie || p->load == NULL || p->load->hstate == NULL)
		return;
	for (uint32_t k = 0; k < count; k++)
		__atomic_store_n(&p->load->hstate[p->idx[first + k]],
		                 HASH_LANDED, __ATOMIC_RELEASE);
}

/* Item first of p (checked by the caller to be p's) has its first upto
 * bytes in: marked for the waiting caller to hash on, or as landed when
 * that is all of it. A count past the item, or one that goes back, is
 * dropped. Called with the lock. */
static void item_piece_landed(pull *p, uint32_t first, uint64_t upto)
{
	if (p->zombie || p->load == NULL || p->load->hupto == NULL)
		return;
	ecx_load *l = p->load;
	size_t i = p->idx[first];
	uint64_t nb = l->items[i].desc.nbytes;
	if (upto > nb ||
	    upto <= __atomic_load_n(&l->hupto[i], __ATOMIC_RELAXED))
		return;
	if (upto == nb)
		items_landed(p, first, 1);
	else
		__atomic_store_n(&l->hupto[i], upto, __ATOMIC_RELEASE);
}

bool cons_load_hash_init(ecx_load *l, size_t n)
{
	l->hstate = calloc(n + 1, 1);
	l->mine = calloc(n + 1, sizeof(*l->mine));
	l->hupto = calloc(n + 1, sizeof(*l->hupto));
	l->hashed = calloc(n + 1, sizeof(*l->hashed));
	l->hst = calloc(n + 1, sizeof(*l->hst));
	return l->hstate != NULL && l->mine != NULL && l->hupto != NULL &&
	       l->hashed != NULL && l->hst != NULL;
}

void cons_load_hash_free(ecx_load *l)
{
	for (size_t i = 0; l->hst != NULL && i < l->n; i++)
		if (l->hst[i] != NULL)
			ecx_xxh3_free(l->hst[i]);
	free(l->hstate);
	free(l->mine);
	free(l->hupto);
	free(l->hashed);
	free(l->hst);
}

uint64_t cons_item_xxh3(ecx_load *l, size_t i)
{
	const ecx_item *x = &l->items[i];
	if (l->hstate[i] == HASH_DONE)
		return l->mine[i];
	/* Landed and not written again (a repeat is refused): its bytes
	 * stay as they are while the load is waited for. */
	void *st = l->hst[i];
	l->hst[i] = NULL;
	if (st == NULL) {
		l->mine[i] = ecx_hash_bytes(ECX_HASH_XXH3, x->dst,
		                            (size_t)x->desc.nbytes);
	} else {
		ecx_xxh3_feed(st, (const char *)x->dst + l->hashed[i],
		              (size_t)(x->desc.nbytes - l->hashed[i]));
		l->mine[i] = ecx_xxh3_end(st);
	}
	l->hashed[i] = x->desc.nbytes;
	__atomic_store_n(&l->hstate[i], HASH_DONE, __ATOMIC_RELEASE);
	return l->mine[i];
}

int cons_load_hash_landed(ecx_load *l)
{
	for (size_t i = 0; l->hstate != NULL && i < l->n; i++) {
		int s = __atomic_load_n(&l->hstate[i], __ATOMIC_ACQUIRE);
		if (s == HASH_LANDED) {
			cons_item_xxh3(l, i);
			__atomic_add_fetch(&cons_hashed_early, 1,
			                   __ATOMIC_RELAXED);
			return 1;
		}
		uint64_t up = __atomic_load_n(&l->hupto[i], __ATOMIC_ACQUIRE);
		if (s == HASH_DONE || up <= l->hashed[i])
			continue;
		/* A piece has landed: hashed on from where the last one
		 * stopped (pieces come in order). */
		if (l->hst[i] == NULL && (l->hst[i] = ecx_xxh3_new()) == NULL)
			continue; /* hashed whole once all is in, then */
		const char *b = l->items[i].dst;
		ecx_xxh3_feed(l->hst[i], b + l->hashed[i],
		              (size_t)(up - l->hashed[i]));
		l->hashed[i] = up;
		return 1;
	}
	return 0;
}

void cons_pull_data_init(pull *p)
{
	for (size_t i = 0; i < p->n; i++)
		p->dstat[i] = DATA_NONE;
}

/* Ends p, answered and taken out of c->inflight. The producer answers
 * after its last write of the pull (and a data_am pull ends only after its
 * last receive), so a zombie's quarantine ends here. Called with the
 * lock. */
static void pull_end(ecx_consumer *c, pull *p)
{
	if (p->zombie) {
		cons_zombie_end(c, p);
		return;
	}
	for (size_t i = 0; p->dstat != NULL && i < p->n; i++) {
		ecx_item *x = &p->load->items[p->idx[i]];
		if (x->status == 0 && x->desc.nbytes > 0 && p->dstat[i] != 0)
			/* Done, says the reply, but its bytes did not land. */
			x->status = p->dstat[i] == DATA_NONE ||
			                    p->dstat[i] == DATA_LANDING
			                ? ECX_EPROTO
			                : p->dstat[i];
	}
	__atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
}

/* Applies the producer's reply (rc: its decoding) to p's items; pull_end
 * ends p. Called with the lock. */
static void reply_apply(pull *p, int rc, const ecx_pull_resp *r,
                        const char *why)
{
	if (rc != 0) {
		ecx_warn(MOD, "unreadable reply from %s: %s", p->pc->address,
		         why);
		pull_fail_items(p, ECX_EPROTO);
	} else if (r->err != 0) {
		ecx_warn(MOD, "pull refused by %s: %s", p->pc->address,
		         r->detail);
		pull_fail_items(p, r->err);
	} else if (r->nitems != p->n) {
		pull_fail_items(p, ECX_EPROTO);
	} else {
		p->pc->used_ms = ecx_now_ms();
		/* A producer that put the items (one older than data_am) has
		 * flushed them before this reply: nothing more to wait for. */
		if (!r->data_am && p->dstat != NULL)
			for (size_t i = 0; i < p->n; i++)
				p->dstat[i] = 0;
		ecx_load *l = p->load;
		for (size_t i = 0; i < p->n; i++) {
			l->items[p->idx[i]].status = r->status[i];
			if (l->xxh != NULL && r->hash != NULL &&
			    r->has_hash[i]) {
				l->xxh[p->idx[i]] = r->hash[i];
				l->has_xxh[p->idx[i]] =
				    (unsigned char)r->hash_kind;
			}
		}
	}
}

/* Takes the producer's reply to p (rc: its decoding; from ECX_AM_REPLY or
 * inside a data message): applied, and p ended unless receives of its
 * data are still landing (the last ends it then). Called with the
 * lock. */
static void reply_take(ecx_consumer *c, pull *p, int rc, const ecx_pull_resp *r,
                       const char *why)
{
	if (!p->zombie)
		reply_apply(p, rc, r, why);
	p->replied = true;
	if (p->recving > 0) {
		p->answered = true;
	} else {
		cons_pull_take(c, p->req);
		pull_end(c, p);
	}
}

ucs_status_t cons_am_reply(void *arg, const void *header, size_t header_len,
                           void *data, size_t len,
                           const ucp_am_recv_param_t *param)
{
	ecx_consumer *c = arg;
	if (header_len != sizeof(ecx_am_hdr) ||
	    (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
		return UCS_OK;
	ecx_am_hdr h;
	memcpy(&h, header, sizeof(h));
	__atomic_add_fetch(&cons_reply_messages, 1, __ATOMIC_RELAXED);
	cons_reply_take(c, NULL, h.req, data, len);
	return UCS_OK;
}

void cons_reply_take(ecx_consumer *c, const cons_lane *lane, uint64_t req,
                     const void *body, size_t len)
{
	ecx_pull_resp r;
	char why[200];
	int rc = ecx_pull_resp_decode(body, len, &r, why, sizeof(why));
	pthread_mutex_lock(&c->lock);
	pull *p = pull_find(c, req);
	/* From a lane: a pull of that lane's connection only (connection
	 * numbers are per producer). */
	if (p != NULL && (lane == NULL || p->pc->lane == lane))
		reply_take(c, p, rc, &r, why);
	pthread_mutex_unlock(&c->lock);
	if (rc == 0)
		ecx_pull_resp_free(&r);
}

/* ---- data as active messages ---- */

/* The most padding a data message sent by rendezvous may have before its
 * items' bytes (a producer sends 43). */
#define LEAD_PAD_MAX 64

/* A receive of items first..first+count-1 of pull req in flight. */
typedef struct data_recv {
	ecx_consumer *c;
	uint64_t req;
	uint32_t first, count;
	size_t len; /* with the padding */
	/* A body with a lead (padding, then the items' bytes): its two
	 * parts, which UCX may write until the receive completes. */
	ucp_dt_iov_t iov[2];
	char pad[LEAD_PAD_MAX];
} data_recv;

static void data_recv_done(void *request, ucs_status_t st, size_t length,
                           void *user_data)
{
	data_recv *d = user_data;
	ecx_consumer *c = d->c;
	if (request != NULL)
		ucp_request_free(request);
	int s = st != UCS_OK       ? ecx_ucx_err(st)
	        : length != d->len ? ECX_EPROTO
	                           : 0;
	cons_data_end(c, d->req, d->first, d->count, s);
	free(d);
}

void cons_data_end(ecx_consumer *c, uint64_t req, uint32_t first,
                   uint32_t count, int status)
{
	pthread_mutex_lock(&c->lock);
	pull *p = pull_find(c, req);
	if (p != NULL) {
		p->recving--;
		for (uint32_t k = 0; k < count; k++)
			p->dstat[first + k] = status;
		if (status == 0)
			items_landed(p, first, count);
		if (p->answered && p->recving == 0) {
			cons_pull_take(c, req);
			pull_end(c, p);
		}
	}
	pthread_mutex_unlock(&c->lock);
}

/* Where items first..first+count-1 of p go, when they lie one after
 * another there, make len bytes and have not come yet; else NULL. Called
 * with the lock. */
static char *data_dst(const pull *p, uint32_t first, uint32_t count, size_t len)
{
	if (count == 0 || first >= p->n || count > p->n - first)
		return NULL;
	const ecx_load *l = p->load;
	char *dst = l->items[p->idx[first]].dst;
	uint64_t total = 0;
	for (uint32_t k = 0; k < count; k++) {
		const ecx_item *x = &l->items[p->idx[first + k]];
		if ((char *)x->dst != dst + total || x->desc.nbytes == 0 ||
		    p->dstat[first + k] != DATA_NONE)
			return NULL;
		total += x->desc.nbytes;
	}
	return total == len ? dst : NULL;
}

ucs_status_t cons_am_data(void *arg, const void *header, size_t header_len,
                          void *data, size_t len,
                          const ucp_am_recv_param_t *param)
{
	ecx_consumer *c = arg;
	bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
	/* What is refused: the sender's send fails with it (rendezvous), or
	 * the bytes are dropped (eager, which cannot be refused). */
	ucs_status_t refuse = rndv ? UCS_ERR_CANCELED : UCS_OK;
	ecx_am_data_hdr h;
	if (header_len < sizeof(h))
		return refuse;
	memcpy(&h, header, sizeof(h));
	/* A longer header carries the pull's reply (its last data): in it,
	 * after the data header, or, in the lead form, at the front of the
	 * body, before the items' bytes. */
	const char *reply = NULL;
	size_t reply_len = 0, pad = 0;
	ecx_am_lead_hdr lh;
	if (header_len >= sizeof(lh) &&
	    (memcpy(&lh, header, sizeof(lh)), lh.magic == ECX_AM_LEAD_MAGIC)) {
		/* Eager: the reply at the front of the body. By rendezvous:
		 * padding there, received apart, and the reply (if any)
		 * after the lead header. */
		if (lh.lead >= len || lh.reply_len > lh.lead ||
		    (rndv ? lh.reply_len != 0 || lh.lead > LEAD_PAD_MAX
		          : header_len != sizeof(lh)))
			return refuse;
		__atomic_add_fetch(&cons_lead_messages, 1, __ATOMIC_RELAXED);
		if (!rndv) {
			reply = data;
			reply_len = lh.reply_len;
			data = (char *)data + lh.lead;
		} else if (header_len > sizeof(lh)) {
			reply = (const char *)header + sizeof(lh);
			reply_len = header_len - sizeof(lh);
		}
		pad = lh.lead;
		len -= lh.lead;
	} else if (header_len > sizeof(h)) {
		reply = (const char *)header + sizeof(h);
		reply_len = header_len - sizeof(h);
	}
	bool folded = reply != NULL;
	ecx_pull_resp r;
	char why[200];
	int rc = folded ? ecx_pull_resp_decode(reply, reply_len, &r, why,
	                                       sizeof(why))
	                : 0;
	pthread_mutex_lock(&c->lock);
	pull *p = pull_find(c, h.req);
	if (p != NULL && p->pc->id != h.conn)
		p = NULL;
	char *dst = NULL;
	if (p != NULL && !p->zombie && !p->done && p->dstat != NULL)
		dst = data_dst(p, h.first, h.count, len);
	ucs_status_t ret = UCS_OK;
	if (dst == NULL) {
		ecx_debug(MOD,
		          "data for pull %llu refused (%zu bytes): not waited "
		          "for, or not where its items go",
		          (unsigned long long)h.req, len);
		ret = refuse;
	} else if (!rndv) {
		__atomic_add_fetch(&cons_data_messages, 1, __ATOMIC_RELAXED);
		/* Copied under the lock: a load that times out meanwhile
		 * waits for it, and then refuses the rest. */
		copy_out(dst, data, len);
		for (uint32_t k = 0; k < h.count; k++)
			p->dstat[h.first + k] = 0;
		items_landed(p, h.first, h.count);
	} else {
		__atomic_add_fetch(&cons_data_messages, 1, __ATOMIC_RELAXED);
		data_recv *d = malloc(sizeof(*d));
		if (d == NULL) {
			ret = UCS_ERR_NO_MEMORY;
		} else {
			*d = (data_recv){.c = c,
			                 .req = h.req,
			                 .first = h.first,
			                 .count = h.count,
			                 .len = pad + len};
			d->iov[0] =
			    (ucp_dt_iov_t){.buffer = d->pad, .length = pad};
			d->iov[1] =
			    (ucp_dt_iov_t){.buffer = dst, .length = len};
			/* A repeat is refused. */
			for (uint32_t k = 0; k < h.count; k++)
				p->dstat[h.first + k] = DATA_LANDING;
			p->recving++;
		}
		ucp_worker_h w = p->pc->side != NULL
		                     ? ecx_ucx_side_worker(p->pc->side)
		                     : ecx_ucx_worker(c->ucx);
		/* (With its receive in flight, p is not ended here.) */
		if (folded)
			reply_take(c, p, rc, &r, why);
		pthread_mutex_unlock(&c->lock);
		if (folded && rc == 0)
			ecx_pull_resp_free(&r);
		if (d == NULL)
			return ret;
		/* A load that times out from here on cuts this TCP
		 * connection before it returns, which takes this receive's
		 * transport with it: nothing lands after. */
		ucp_request_param_t rp = {.op_attr_mask =
		                              UCP_OP_ATTR_FIELD_CALLBACK |
		                              UCP_OP_ATTR_FIELD_USER_DATA,
		                          .cb.recv_am = data_recv_done,
		                          .user_data = d};
		if (pad > 0) {
			rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
			rp.datatype = ucp_dt_make_iov();
		}
		ucs_status_ptr_t q =
		    pad > 0 ? ucp_am_recv_data_nbx(w, data, d->iov, 2, &rp)
		            : ucp_am_recv_data_nbx(w, data, dst, len, &rp);
		if (q == NULL) {
			data_recv_done(NULL, UCS_OK, pad + len, d);
		} else if (UCS_PTR_IS_ERR(q)) {
			/* The producer's send fails with it too: both sides
			 * agree. */
			data_recv_done(NULL, UCS_PTR_STATUS(q), 0, d);
			return UCS_PTR_STATUS(q);
		}
		return UCS_OK;
	}
	/* The reply it carries, for a pull (or a zombie) of this connection,
	 * whatever became of the bytes: a refused message's items fail (the
	 * reply calls them done, their bytes did not land). */
	if (folded && p != NULL)
		reply_take(c, p, rc, &r, why);
	pthread_mutex_unlock(&c->lock);
	if (folded && rc == 0)
		ecx_pull_resp_free(&r);
	return ret;
}

/* ---- landed notices (a producer that puts, for a pull with "landed") ---- */

ucs_status_t cons_am_landed(void *arg, const void *header, size_t header_len,
                            void *data, size_t len,
                            const ucp_am_recv_param_t *param)
{
	ecx_consumer *c = arg;
	(void)param;
	ecx_am_data_hdr h;
	if (header_len != sizeof(h))
		return UCS_OK;
	memcpy(&h, header, sizeof(h));
	__atomic_add_fetch(&cons_landed_messages, 1, __ATOMIC_RELAXED);
	pthread_mutex_lock(&c->lock);
	pull *p = pull_find(c, h.req);
	/* Only items of this connection's pull: a notice only moves their
	 * hashing earlier (the reply still ends the pull); one that names
	 * anything else is dropped. */
	uint64_t upto = 0;
	if (len == sizeof(upto))
		memcpy(&upto, data, sizeof(upto));
	bool ours = p != NULL && p->pc->id == h.conn && h.count > 0 &&
	            h.first < p->n && h.count <= p->n - h.first &&
	            (len == 0 || (len == sizeof(upto) && h.count == 1));
	if (ours && upto != 0)
		item_piece_landed(p, h.first, upto);
	else if (ours && len == 0)
		items_landed(p, h.first, h.count);
	pthread_mutex_unlock(&c->lock);
	return UCS_OK;
}

/* With integrity on: every item that arrived is hashed where it landed (or
 * was, as it landed: cons_load_hash_landed) and compared with the
 * producer's hash of its arena copy, of the kind the producer sent. */
void cons_load_verify(ecx_load *l)
{
	for (size_t i = 0; i < l->n; i++) {
		ecx_item *x = &l->items[i];
		if (x->status != 0)
			continue;
		if (!l->has_xxh[i]) {
			ecx_warn(MOD,
			         "%s: producer %s sends no hash (start it with "
			         "integrity on, ecx serve --verify-hash)",
			         x->id, x->producer);
			x->status = ECX_EUNSUPPORTED;
			continue;
		}
		int kind = l->has_xxh[i];
		uint64_t h =
		    kind == ECX_HASH_XXH3
		        ? cons_item_xxh3(l, i)
		        : ecx_hash_bytes(
		              kind, x->desc.nbytes == 0 ? l->c->zero : x->dst,
		              x->desc.nbytes);
		if (h != l->xxh[i]) {
			ecx_warn(MOD,
			         "%s from %s: %s %016llx, the producer's "
			         "%016llx: bytes corrupted",
			         x->id, x->producer, ecx_hash_name(kind),
			         (unsigned long long)h,
			         (unsigned long long)l->xxh[i]);
			x->status = ECX_ECORRUPT;
		}
	}
}

/* ---- the data lane (consumer/lane.c reads it) ---- */

char *cons_data_begin(ecx_consumer *c, const cons_lane *lane, uint64_t req,
                      uint32_t first, uint32_t count, size_t len)
{
	pthread_mutex_lock(&c->lock);
	pull *p = pull_find(c, req);
	char *dst = NULL;
	if (p != NULL && p->pc->lane == lane && !p->zombie && !p->done &&
	    p->dstat != NULL)
		dst = data_dst(p, first, count, len);
	if (dst != NULL) {
		for (uint32_t k = 0; k < count; k++)
			p->dstat[first + k] = DATA_LANDING;
		p->recving++;
	}
	pthread_mutex_unlock(&c->lock);
	return dst;
}

void cons_data_piece(ecx_consumer *c, const cons_lane *lane, uint64_t req,
                     uint32_t first, uint64_t upto)
{
	pthread_mutex_lock(&c->lock);
	pull *p = pull_find(c, req);
	if (p != NULL && p->pc->lane == lane && first < p->n)
		item_piece_landed(p, first, upto);
	pthread_mutex_unlock(&c->lock);
}
