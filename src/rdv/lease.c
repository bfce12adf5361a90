/*
 * lease.c - the consumer's side of leases: "lease" and "release" requests
 * on the producers' ZeroMQ sockets. A REQ socket per producer address is
 * kept between calls (a new TCP connection per lookup would cost more than
 * the lease); one that misses an answer is closed, as a REQ socket cannot
 * send again before its answer. The requests to several producers go out
 * together and are waited for together, up to one deadline. A producer
 * that did not answer is skipped (its items are misses at once) for a
 * back-off, 500 ms doubling to 10 s, so a dead producer costs a lookup its
 * timeout once, not every time.
 */
#include "rdv/rdv.h"

#include <zmq.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BACKOFF_MIN_MS 500
#define BACKOFF_MAX_MS 10000

typedef struct chan {
	struct chan *next;
	void *sock;        /* NULL while backing off */
	uint64_t retry_ns; /* no request before this */
	unsigned backoff_ms;
	char address[ECX_ADDR_MAX];
} chan;

struct ecx_rdv_leaser {
	pthread_mutex_t lock;
	void *zctx;
	chan *chans;
};

/* One request of a call: the message for a producer, the items it is
 * about (indexes into the caller's array) and the answer. */
typedef struct req {
	const char *address;
	size_t *idx;
	size_t n;
	chan *ch;
	char *msg;
	ecx_zresp resp;
	int rc;
	bool got;
} req;

ecx_rdv_leaser *ecx_rdv_leaser_create(void)
{
	ecx_rdv_leaser *l = calloc(1, sizeof(*l));
	if (l != NULL)
		pthread_mutex_init(&l->lock, NULL);
	return l;
}

void ecx_rdv_leaser_destroy(ecx_rdv_leaser *l)
{
	if (l == NULL)
		return;
	while (l->chans != NULL) {
		chan *ch = l->chans;
		l->chans = ch->next;
		if (ch->sock != NULL)
			zmq_close(ch->sock);
		free(ch);
	}
	if (l->zctx != NULL)
		zmq_ctx_term(l->zctx);
	pthread_mutex_destroy(&l->lock);
	free(l);
}

/* The producer at ch did not answer: its socket goes (a REQ socket cannot
 * send again before its answer) and it is skipped for a back-off. */
static void chan_fail(chan *ch)
{
	if (ch->sock != NULL)
		zmq_close(ch->sock);
	ch->sock = NULL;
	unsigned b = ch->backoff_ms * 2;
	ch->backoff_ms = b < BACKOFF_MIN_MS   ? BACKOFF_MIN_MS
	                 : b > BACKOFF_MAX_MS ? BACKOFF_MAX_MS
	                                      : b;
	ch->retry_ns = ecx_now_ns() + (uint64_t)ch->backoff_ms * 1000000u;
}

/* A new REQ socket for ch; false when ZeroMQ cannot make one. */
static bool chan_connect(void *zctx, chan *ch)
{
	ch->sock = zmq_socket(zctx, ZMQ_REQ);
	int zero = 0, one = 1;
	int64_t maxmsg = ECX_ZMQ_MAX_MSG;
	if (ch->sock == NULL ||
	    zmq_setsockopt(ch->sock, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
	    zmq_setsockopt(ch->sock, ZMQ_IMMEDIATE, &one, sizeof(one)) != 0 ||
	    /* producers may be at IPv6 addresses (tcp://[::1]:PORT) */
	    zmq_setsockopt(ch->sock, ZMQ_IPV6, &one, sizeof(one)) != 0 ||
	    zmq_setsockopt(ch->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg)) !=
	        0 ||
	    zmq_connect(ch->sock, ch->address) != 0) {
		if (ch->sock != NULL)
			zmq_close(ch->sock);
		ch->sock = NULL;
		return false;
	}
	return true;
}

/* The kept socket to address, connecting one if there is none; NULL while
 * the address backs off, or when no socket can be made. */
static chan *chan_get(ecx_rdv_leaser *l, const char *address)
{
	for (chan *ch = l->chans; ch != NULL; ch = ch->next) {
		if (strcmp(ch->address, address) != 0)
			continue;
		if (ch->sock != NULL)
			return ch;
		if (ecx_now_ns() < ch->retry_ns)
			return NULL;
		return chan_connect(l->zctx, ch) ? ch : NULL;
	}
	if (l->zctx == NULL) {
		l->zctx = zmq_ctx_new();
		if (l->zctx == NULL)
			return NULL;
		zmq_ctx_set(l->zctx, ZMQ_IO_THREADS, 1);
	}
	chan *ch = calloc(1, sizeof(*ch));
	if (ch == NULL)
		return NULL;
	ecx_strlcpy(ch->address, address, sizeof(ch->address));
	if (!chan_connect(l->zctx, ch)) {
		free(ch);
		return NULL;
	}
	ch->next = l->chans;
	l->chans = ch;
	return ch;
}

/* How long a request waits for its producer's connection (made, or
 * still there) before the producer counts as gone: a dead producer costs
 * a lookup this much, not its whole timeout. */
#define CONNECT_MS 500

/* Sends every request once its socket is connected (ZMQ_IMMEDIATE: a
 * request is never queued for a peer that is not there), and waits for the
 * answers until deadline_ns. A request whose producer cannot be reached
 * within CONNECT_MS fails with ECX_ECONNECT, one that gets no answer with
 * ECX_ETIMEDOUT; either way its address backs off. At most one request per
 * address. */
static void reqs_run(ecx_rdv_leaser *l, req *rq, size_t n, uint64_t deadline_ns)
{
	zmq_pollitem_t *pi = calloc(n + 1, sizeof(*pi));
	size_t *which = calloc(n + 1, sizeof(*which));
	bool *sent = calloc(n + 1, sizeof(*sent));
	uint64_t connect_ns = ecx_now_ns() + (uint64_t)CONNECT_MS * 1000000u;
	if (connect_ns > deadline_ns)
		connect_ns = deadline_ns;
	size_t waiting = 0;
	for (size_t k = 0; k < n; k++) {
		req *r = &rq[k];
		r->got = false;
		if (r->rc != 0)
			continue;
		r->ch = chan_get(l, r->address);
		if (r->ch == NULL) {
			r->rc = ECX_ECONNECT;
			continue;
		}
		waiting++;
	}
	while (waiting > 0 && pi != NULL && which != NULL && sent != NULL) {
		uint64_t now = ecx_now_ns();
		size_t m = 0;
		bool connecting = false;
		for (size_t k = 0; k < n; k++) {
			req *r = &rq[k];
			if (r->rc != 0 || r->got || r->ch == NULL)
				continue;
			if (!sent[k] && now >= connect_ns) {
				r->rc = ECX_ECONNECT;
				chan_fail(r->ch);
				r->ch = NULL;
				waiting--;
				continue;
			}
			connecting |= !sent[k];
			pi[m] = (zmq_pollitem_t){
			    .socket = r->ch->sock,
			    .events = sent[k] ? ZMQ_POLLIN : ZMQ_POLLOUT};
			which[m++] = k;
		}
		uint64_t until = connecting ? connect_ns : deadline_ns;
		if (m == 0 || now >= deadline_ns)
			break;
		long ms =
		    now >= until ? 0 : (long)((until - now + 999999) / 1000000);
		if (zmq_poll(pi, (int)m, ms) < 0)
			break;
		for (size_t j = 0; j < m; j++) {
			req *r = &rq[which[j]];
			if (pi[j].revents & ZMQ_POLLOUT) {
				if (zmq_send(r->ch->sock, r->msg,
				             strlen(r->msg), ZMQ_DONTWAIT) >= 0)
					sent[which[j]] = true;
				continue;
			}
			if (!(pi[j].revents & ZMQ_POLLIN))
				continue;
			zmq_msg_t msg;
			zmq_msg_init(&msg);
			if (zmq_msg_recv(&msg, r->ch->sock, ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(&msg);
				continue;
			}
			char why[160];
			r->rc = ecx_zresp_decode(zmq_msg_data(&msg),
			                         zmq_msg_size(&msg), &r->resp,
			                         why, sizeof(why));
			zmq_msg_close(&msg);
			if (r->rc == 0 && !r->resp.ok)
				r->rc = r->resp.err;
			r->got = true;
			r->ch->backoff_ms = 0;
			waiting--;
		}
	}
	for (size_t k = 0; k < n; k++) {
		req *r = &rq[k];
		if (r->rc == 0 && !r->got) {
			r->rc = ECX_ETIMEDOUT;
			if (r->ch != NULL)
				chan_fail(r->ch);
		}
		r->ch = NULL;
	}
	free(pi);
	free(which);
	free(sent);
}

/* Groups the items that pick(items[i]) keeps by producer address, in
 * chunks of ECX_LEASE_MAX_IDS: *out gets the requests, in rounds (a round
 * holds at most one request per address, so it can go out at once). */
typedef bool (*pick_fn)(const ecx_item *x);

static size_t reqs_make(const ecx_item *items, size_t n, pick_fn pick,
                        req **out)
{
	req *rq = calloc(n + 1, sizeof(*rq));
	size_t *idx = calloc(n + 1, sizeof(*idx));
	if (rq == NULL || idx == NULL) {
		free(rq);
		free(idx);
		*out = NULL;
		return 0;
	}
	/* Ordered by address, then by position: a chunk's indexes are one
	 * run of idx. */
	size_t m = 0;
	for (size_t i = 0; i < n; i++)
		if (pick(&items[i]))
			idx[m++] = i;
	for (size_t a = 1; a < m; a++) {
		size_t v = idx[a], b = a;
		while (b > 0 && strcmp(items[idx[b - 1]].producer,
		                       items[v].producer) > 0) {
			idx[b] = idx[b - 1];
			b--;
		}
		idx[b] = v;
	}
	size_t nr = 0;
	for (size_t a = 0; a < m;) {
		size_t b = a;
		while (b < m && b - a < ECX_LEASE_MAX_IDS &&
		       strcmp(items[idx[b]].producer, items[idx[a]].producer) ==
		           0)
			b++;
		rq[nr].address = items[idx[a]].producer;
		rq[nr].idx = &idx[a];
		rq[nr].n = b - a;
		nr++;
		a = b;
	}
	if (nr == 0)
		free(idx);
	*out = rq;
	return nr;
}

static void reqs_free(req *rq, size_t nr)
{
	if (rq == NULL)
		return;
	if (nr > 0)
		free(rq[0].idx); /* the one allocation behind every idx */
	for (size_t k = 0; k < nr; k++) {
		free(rq[k].msg);
		ecx_zresp_free(&rq[k].resp);
	}
	free(rq);
}

/* Runs the requests in rounds: each round sends the next chunk of every
 * address at once. */
static void reqs_rounds(ecx_rdv_leaser *l, req *rq, size_t nr,
                        uint64_t deadline_ns)
{
	size_t done = 0;
	while (done < nr) {
		size_t end = done + 1;
		/* A round ends before an address comes again. */
		while (end < nr) {
			bool again = false;
			for (size_t k = done; k < end && !again; k++)
				again =
				    strcmp(rq[k].address, rq[end].address) == 0;
			if (again)
				break;
			end++;
		}
		reqs_run(l, &rq[done], end - done, deadline_ns);
		done = end;
	}
}

static bool found_item(const ecx_item *x)
{
	/* A producer that speaks only the reference's protocol has no
	 * leases: its items stay found, unleased. */
	return x->status == 0 && x->producer[0] != '\0' && x->lease == 0 &&
	       x->epoch != ECX_EPOCH_REFERENCE;
}

void ecx_rdv_lease(ecx_rdv_leaser *l, ecx_item *items, size_t n,
                   uint64_t lease_ms, const char *token, int timeout_ms,
                   uint64_t *refused)
{
	uint64_t deadline = ecx_now_ns() + (uint64_t)timeout_ms * 1000000u;
	req *rq;
	size_t nr = reqs_make(items, n, found_item, &rq);
	if (rq == NULL) {
		for (size_t i = 0; i < n; i++)
			if (found_item(&items[i]))
				items[i].status = ECX_ENOTFOUND;
		return;
	}
	const char *ids[ECX_LEASE_MAX_IDS];
	for (size_t k = 0; k < nr; k++) {
		for (size_t j = 0; j < rq[k].n; j++)
			ids[j] = items[rq[k].idx[j]].id;
		rq[k].msg =
		    ecx_zreq_encode_lease(ids, rq[k].n, lease_ms, token);
		if (rq[k].msg == NULL)
			rq[k].rc = ECX_ENOMEM;
	}
	pthread_mutex_lock(&l->lock);
	reqs_rounds(l, rq, nr, deadline);
	pthread_mutex_unlock(&l->lock);
	uint64_t misses = 0;
	for (size_t k = 0; k < nr; k++) {
		req *r = &rq[k];
		bool good = r->rc == 0 && r->resp.nleases == r->n;
		for (size_t j = 0; j < r->n; j++) {
			ecx_item *x = &items[r->idx[j]];
			if (good && r->resp.leases[j] != 0) {
				x->lease = r->resp.leases[j];
				x->epoch = r->resp.epoch;
			} else {
				x->status = ECX_ENOTFOUND;
				misses++;
			}
		}
		if (r->rc != 0)
			ecx_info("consumer", "no leases from %s: %s",
			         r->address, core_strerror(r->rc));
	}
	reqs_free(rq, nr);
	if (refused != NULL)
		*refused += misses;
}

static bool leased_item(const ecx_item *x)
{
	return x->lease != 0 && x->producer[0] != '\0';
}

int ecx_rdv_release(ecx_rdv_leaser *l, ecx_item *items, size_t n,
                    const char *token, int timeout_ms, char *why, size_t whylen)
{
	uint64_t deadline = ecx_now_ns() + (uint64_t)timeout_ms * 1000000u;
	req *rq;
	size_t nr = reqs_make(items, n, leased_item, &rq);
	int rc = 0;
	if (rq == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		goto out;
	}
	uint64_t leases[ECX_LEASE_MAX_IDS];
	for (size_t k = 0; k < nr; k++) {
		for (size_t j = 0; j < rq[k].n; j++)
			leases[j] = items[rq[k].idx[j]].lease;
		rq[k].msg = ecx_zreq_encode_release(leases, rq[k].n, token);
		if (rq[k].msg == NULL)
			rq[k].rc = ECX_ENOMEM;
	}
	pthread_mutex_lock(&l->lock);
	reqs_rounds(l, rq, nr, deadline);
	pthread_mutex_unlock(&l->lock);
	for (size_t k = 0; k < nr && rc == 0; k++)
		if (rq[k].rc != 0)
			rc = ecx_why(why, whylen, rq[k].rc,
			             "cannot release leases at %s: %s",
			             rq[k].address, core_strerror(rq[k].rc));
	reqs_free(rq, nr);
out:
	for (size_t i = 0; i < n; i++)
		items[i].lease = 0;
	return rc;
}
