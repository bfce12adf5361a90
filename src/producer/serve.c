/*
 * serve.c - the pull service. A pull arrives as an active message on the
 * progress thread, is queued as a job, started (items pinned, remote keys
 * unpacked, one put per run of neighbouring items, then a flush; or, for a
 * pull over TCP that asks for it, one data send per run and no keys), and
 * answered once with a status per item when the flush (or every send) has
 * completed, or, for a pull over TCP whose bytes are one data send and that
 * asks for it, inside that send (serve_data.c); a job's reply, counts, pins and
 * release are in jobs.c. Connections made by hellos are
 * closed when they fail, when the consumer says goodbye, or when they have been
 * idle for p->idle_ms (a consumer that died over shared memory shows no
 * failure: idleness is how it is noticed): conns.c. Closing one unmaps the
 * consumer's memory here.
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD "producer"

/* Items adjacent in both memories are written by one put of at most this
 * much (run_continues): no more than one large item, so a pull that
 * expires still stops within about one item's write. */
#define PUT_RUN_MAX ((uint64_t)8 << 20)
/* Neighbouring items go in one data send of at most this much (an item
 * larger than it goes alone): across the veth one 2 MiB message was much
 * slower than four of 512 KiB in flight at once (docs/deploy.md, "How
 * 64 KiB x32 got past 0.7x"). 512 KiB was measured, not derived; no other
 * size was tried, and why one larger message is slower was not found. */
#define AM_RUN_MAX ((uint64_t)512 << 10)
/* Puts for a pull that asked for landed notices go at most this much at
 * a time (an item larger than it in pieces of it), so that the consumer
 * hashes each as it lands, while it is still in the CPU's caches, rather
 * than all after one long put. */
#define LANDED_RUN_MAX ((uint64_t)1 << 20)
/* ---- pulls ---- */

ucs_status_t prod_am_pull(void *arg, const void *header, size_t header_len,
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

/* Whether job j's pull is past its expiry, judged on the monotonic clock:
 * the expiry is in the wall clock this producer sent in the hello, turned
 * into monotonic time by the pair recorded then. */
static bool pull_expired(const job *j)
{
	const conn *c = j->c;
	if (j->pr.expires_ms == 0)
		return false;
	if (j->pr.expires_ms <= c->hello_wall_ms)
		return true;
	return ecx_now_ms() >=
	       c->hello_mono_ms + (j->pr.expires_ms - c->hello_wall_ms);
}

/* Whether item k of j's pull may join the put (or data send) that starts
 * at item i and has len bytes so far: right after it in this arena and in
 * the same region of the consumer's memory, right after it there too, and
 * within PUT_RUN_MAX (AM_RUN_MAX for a data send). */
static bool run_continues(const job *j, size_t i, size_t k, uint64_t len)
{
	const item *a = j->items[i], *b = j->items[k];
	const ecx_pull_item *pa = &j->pr.items[i], *pb = &j->pr.items[k];
	uint64_t max = j->pr.data_am ? AM_RUN_MAX
	               : j->landed   ? LANDED_RUN_MAX
	                             : PUT_RUN_MAX;
	return b != NULL && b->desc.nbytes > 0 && j->status[k] == 0 &&
	       len + b->desc.nbytes <= max && pb->region == pa->region &&
	       b->off == a->off + len && pb->addr == pa->addr + len;
}

/* Releases job j, taking the lock. */
static void job_drop(ecx_producer *p, job *j)
{
	pthread_mutex_lock(&p->lock);
	prod_job_release(p, j);
	pthread_mutex_unlock(&p->lock);
}

/* Job j's connection: found, counted as used by j, and given its endpoint
 * at its first pull. False when j cannot be served on it: gone, failed
 * (its endpoint too), or closing. */
static bool job_connect(ecx_producer *p, job *j)
{
	pthread_mutex_lock(&p->lock);
	j->c = prod_conn_find(p, j->conn_id);
	if (j->c != NULL) {
		j->c->jobs++;
		j->c->used_ns = ecx_now_ns();
	}
	pthread_mutex_unlock(&p->lock);
	/* Nothing starts on a connection that gets a goodbye. */
	bool closing =
	    j->c != NULL && __atomic_load_n(&j->c->closing, __ATOMIC_ACQUIRE);
	if (j->c != NULL && j->c->ep == NULL &&
	    !__atomic_load_n(&j->c->failed, __ATOMIC_ACQUIRE) && !closing) {
		char ewhy[200];
		if (ecx_ucx_side_ep_create(p->ucx, j->c->side, j->c->addr,
		                           j->c->addr_len, j->c->transport,
		                           prod_conn_on_error, j->c, &j->c->ep,
		                           ewhy, sizeof(ewhy)) != 0) {
			ecx_warn(MOD, "connection %llu: %s",
			         (unsigned long long)j->c->id, ewhy);
			__atomic_store_n(&j->c->failed, true, __ATOMIC_RELEASE);
		}
	}
	return !(j->c == NULL ||
	         __atomic_load_n(&j->c->failed, __ATOMIC_ACQUIRE) || closing);
}

/* Checks job j's decoded pull before a byte of it is written: its token,
 * and its expiry (a load is final: the consumer has given up on a pull
 * past its expiry, so not one byte of it is written; its items are counted
 * failed). 0, or the error with why. */
static int job_check(ecx_producer *p, job *j, char *why, size_t whylen)
{
	if (p->token != NULL && !ecx_ct_equal(j->pr.token, strlen(j->pr.token),
	                                      p->token, p->token_len)) {
		snprintf(why, whylen, "bad or missing token");
		return ECX_EAUTH;
	}
	if (j->pr.expires_ms != 0 && pull_expired(j)) {
		snprintf(why, whylen, "the pull expired before it started");
		pthread_mutex_lock(&p->lock);
		p->st.items_failed += j->pr.nitems;
		pthread_mutex_unlock(&p->lock);
		return ECX_ETIMEDOUT;
	}
	return 0;
}

/* Answers job j's pull, refused before it started, with err and why
 * (counted as a pull), and releases j. */
static void job_refuse(ecx_producer *p, job *j, int err, const char *why)
{
	ecx_pull_req_free(&j->pr);
	pthread_mutex_lock(&p->lock);
	p->st.pulls++;
	pthread_mutex_unlock(&p->lock);
	prod_job_reply(j, err, why);
	job_drop(p, j);
}

/* Job j's state for its items: their pins, statuses and remote keys, the
 * hashes its pull asks for, and whether it gets landed notices, with room
 * for its sends (data sends or notices). False when out of memory. */
static bool job_prepare(ecx_producer *p, job *j)
{
	size_t n = j->pr.nitems;
	j->pending = 1; /* the flush, or the end of posting the sends */
	j->items = calloc(n + 1, sizeof(*j->items));
	j->status = calloc(n + 1, sizeof(*j->status));
	j->rkeys = calloc(j->pr.nregions + 1, sizeof(*j->rkeys));
	/* Hashes of the kind the pull asks for: XXH3, or xxh64 for one that
	 * does not say (an older consumer); none for one that does not
	 * check. */
	int want = p->test_hash_legacy ? ECX_HASH_DEFAULT : j->pr.hash;
	j->hash_kind = want == ECX_HASH_XXH3 ? ECX_HASH_XXH3 : ECX_HASH_XXH64;
	if (p->integrity && want != ECX_HASH_NONE)
		j->xxh = calloc(n + 1, sizeof(*j->xxh));
	/* Notices only help a consumer that hashes what this producer
	 * hashed. */
	j->landed = p->integrity && j->xxh != NULL && j->pr.landed &&
	            !j->pr.data_am && !p->test_hash_legacy && n > 1;
	/* One per data send, or landed notice: one per put, at most one
	 * per LANDED_RUN_MAX of an item put in pieces. */
	size_t nsends = n + 1;
	for (size_t i = 0; j->landed && i < n; i++)
		nsends += (size_t)(j->pr.items[i].nbytes / LANDED_RUN_MAX);
	if (j->pr.data_am || j->landed)
		j->sends = calloc(nsends, sizeof(*j->sends));
	return !(j->items == NULL || j->status == NULL || j->rkeys == NULL ||
	         (p->integrity && want != ECX_HASH_NONE && j->xxh == NULL) ||
	         ((j->pr.data_am || j->landed) && j->sends == NULL));
}

/* Resolves job j's items: each one held, ready and of the size the pull
 * names is pinned, marked recently used and its hash taken; each other
 * gets its status. Takes the lock. */
static void job_pin(ecx_producer *p, job *j)
{
	pthread_mutex_lock(&p->lock);
	for (size_t i = 0; i < j->pr.nitems; i++) {
		item *it = prod_item_find(p, j->pr.items[i].id);
		if (it == NULL || !it->ready) {
			j->status[i] = ECX_ENOTFOUND;
			continue;
		}
		if (it->desc.nbytes != j->pr.items[i].nbytes) {
			j->status[i] = ECX_ESIZE;
			continue;
		}
		prod_item_pin(p, it);
		/* Pinned by the pull now: the lease its lookup took ends. */
		if (j->pr.items[i].lease != 0)
			prod_lease_use(p, j->pr.items[i].lease, it);
		prod_item_touch(p, it);
		j->items[i] = it;
		if (j->xxh != NULL)
			j->xxh[i] = j->hash_kind == ECX_HASH_XXH3 ? it->xxh3
			                                          : it->xxh64;
	}
	pthread_mutex_unlock(&p->lock);
}

/* The remote key of each region of job j's pull: the connection's cached
 * one, or j's own when every cache entry is held by pulls in flight (NULL
 * when it cannot be unpacked). Data sent as active messages needs none. */
static void job_rkeys(job *j)
{
	for (size_t g = 0; g < j->pr.nregions && !j->pr.data_am; g++) {
		j->rkeys[g] = prod_rkey_get(j->c, &j->pr.regions[g]);
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
}

/* Puts items i..k-1 of job j (len bytes from src, neighbours in both
 * memories) with remote key re: one put, or, with landed notices, an item
 * larger than LANDED_RUN_MAX in pieces, each told as it lands. Returns the
 * last put's request; completion is the flush (job_flush). */
static ucs_status_ptr_t run_put(job *j, size_t i, size_t k, void *src,
                                uint64_t len, rkey_ent *re)
{
	size_t n = j->pr.nitems;
	ucs_status_ptr_t req = NULL;
	prod_rkey_prefault(re, j->pr.items[i].addr, len);
	uint64_t piece = j->landed && k == i + 1 ? LANDED_RUN_MAX : len;
	for (uint64_t off = 0; off < len; off += piece) {
		uint64_t m = len - off < piece ? len - off : piece;
		ucp_request_param_t rp = {.op_attr_mask = 0};
		req = ucp_put_nbx(j->c->ep, (char *)src + off, m,
		                  j->pr.items[i].addr + off, re->h, &rp);
		if (UCS_PTR_IS_ERR(req))
			break;
		if (req != NULL)
			ucp_request_free(req);
		/* (The last run's last notice would come just before the
		 * reply: none.) */
		if (j->landed && (k < n || off + m < len))
			prod_landed_after(j, i, k, piece < len ? off + m : 0);
	}
	return req;
}

/* Posts job j's writes: each run of items that follow each other in both
 * memories (run_continues) as one put (run_put) or data send (prod_data_send).
 * An item that cannot go gets its status: no remote key, the pull expired
 * meanwhile, or its post failed. */
static void job_post(ecx_producer *p, job *j)
{
	size_t n = j->pr.nitems;
	for (size_t i = 0; i < n;) {
		item *it = j->items[i];
		if (it == NULL || it->desc.nbytes == 0 || j->status[i] != 0) {
			i++;
			continue;
		}
		rkey_ent *re = j->rkeys[j->pr.items[i].region];
		ucp_rkey_h rk = re != NULL ? re->h : NULL;
		if (rk == NULL && !j->pr.data_am) {
			j->status[i++] = ECX_EPROTO;
			continue;
		}
		if (p->test_delay_ms > 0)
			usleep(p->test_delay_ms * 1000u);
		/* Checked before each put: a producer stopped (or slow) in
		 * the middle of a pull writes nothing after it expired. */
		if (j->pr.expires_ms != 0 && pull_expired(j)) {
			j->status[i++] = ECX_ETIMEDOUT;
			continue;
		}
		/* The items that follow it in both memories (a batch put in
		 * order, loaded into memory allocated in order) go in the
		 * same put or data send (run_continues): one operation
		 * instead of many small ones. */
		uint64_t len = it->desc.nbytes;
		size_t k = i + 1;
		/* (Not with the test-only delay, which is per item.) */
		while (k < n && p->test_delay_ms == 0 &&
		       run_continues(j, i, k, len))
			len += j->items[k++]->desc.nbytes;
		void *src = (char *)p->base + it->off;
		ucs_status_ptr_t req =
		    j->pr.data_am ? prod_data_send(p, j, i, k, src, len)
		                  : run_put(j, i, k, src, len, re);
		for (; i < k; i++)
			if (UCS_PTR_IS_ERR(req))
				j->status[i] = ecx_ucx_err(UCS_PTR_STATUS(req));
	}
}

/* Ends the posting of job j: its deadline starts, and its flush is posted
 * (its completion ends the puts); for data sends, whose completions are
 * what is left, the end of posting is one of j's completions. */
static void job_flush(ecx_producer *p, job *j)
{
	j->deadline_ns = ecx_now_ns() + (uint64_t)p->timeout_ms * 1000000u;
	j->flushing = true;
	if (j->pr.data_am) {
		/* Posting is over: the sends' completions are what is left
		 * (they are the consumer's receipts, not a flush's). */
		prod_job_part_done(j, UCS_OK);
		return;
	}
	ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA,
	                          .cb.send = prod_flush_done,
	                          .user_data = j};
	ucs_status_ptr_t req = ucp_ep_flush_nbx(j->c->ep, &fp);
	if (req == NULL || UCS_PTR_IS_ERR(req))
		prod_job_part_done(j, UCS_PTR_STATUS(req));
}

/* Starts job j: its connection, the checks of its pull, its items pinned,
 * remote keys, then its writes and a flush. Called from the progress
 * thread without the lock. Returns false when the job was answered (or,
 * without a connection to answer on, dropped) and released at once. */
static bool job_start(ecx_producer *p, job *j)
{
	char why[200];
	int rc = ecx_pull_req_decode(j->msg, j->len, &j->pr, why, sizeof(why));
	if (p->test_put_only)
		j->pr.data_am = false;
	if (!job_connect(p, j)) {
		job_drop(p, j);
		return false;
	}
	/* Data sends only where the connection closes without progress after
	 * its endpoint's close (past ECX_UCX_SIDES_MAX workers a TCP
	 * connection shares the producer's): elsewhere, puts. */
	if (!prod_conn_goes_with_side(j->c))
		j->pr.data_am = false;
	if (rc == 0)
		rc = job_check(p, j, why, sizeof(why));
	if (rc != 0) {
		job_refuse(p, j, rc, why);
		return false;
	}
	/* Over the connection's lane where the pull asks for it and there
	 * is one: its data as frames there, its reply after them, no reply
	 * inside a data message. */
	if (j->pr.data_am && j->pr.lane && j->c->transport == ECX_TR_TCP)
		j->lane = __atomic_load_n(&j->c->lane, __ATOMIC_ACQUIRE);
	if (j->lane != NULL)
		j->pr.fold = j->pr.lead = false;
	if (!job_prepare(p, j)) {
		prod_job_reply(j, ECX_ENOMEM, "out of memory");
		job_drop(p, j);
		return false;
	}
	job_pin(p, j);
	if (j->xxh != NULL && j->hash_kind == ECX_HASH_XXH64)
		prod_job_hash_legacy(p, j);
	job_rkeys(j);
	job_post(p, j);
	job_flush(p, j);
	return true;
}

/* Finishes job j after its flush (or its sends): statuses, stats, reply,
 * unpin. */
static void job_finish(ecx_producer *p, job *j)
{
	uint64_t served, bytes, failed;
	for (size_t s = 0; s < j->nsends; s++)
		for (uint32_t k = 0; k < j->sends[s].h.count; k++)
			if (j->status[j->sends[s].h.first + k] == 0)
				j->status[j->sends[s].h.first + k] =
				    j->sends[s].status;
	for (size_t i = 0; i < j->pr.nitems; i++)
		if (j->status[i] == 0 && j->flush_status != 0)
			j->status[i] = j->flush_status;
	prod_job_tally(j, &served, &failed, &bytes);
	ecx_debug(MOD, "pull %llu done: %llu served, %llu failed, flush %s",
	          (unsigned long long)j->req, (unsigned long long)served,
	          (unsigned long long)failed, core_err_name(j->flush_status));
	/* A folded reply that told the truth is the answer; one whose send
	 * failed is followed by this one (the consumer takes the first it
	 * gets). */
	bool answered = j->folded && served == j->pre_served;
	/* Unpin and count before the reply goes: a consumer that has its
	 * answer sees the producer's state after the pull (its pins may
	 * outlive a folded reply by the send's completion). */
	pthread_mutex_lock(&p->lock);
	prod_job_uncount(p, j);
	p->st.pulls++;
	p->st.items_served += served;
	p->st.items_failed += failed;
	p->st.bytes_served += bytes;
	prod_job_unpin(p, j);
	pthread_mutex_unlock(&p->lock);
	if (!answered)
		prod_job_reply(j, 0, NULL);
	pthread_mutex_lock(&p->lock);
	prod_job_release(p, j);
	pthread_mutex_unlock(&p->lock);
}

/* The progress thread's hook: starts queued jobs, finishes flushed ones,
 * fails jobs past their deadline, and reaps failed connections. */
void prod_progress(void *arg)
{
	ecx_producer *p = arg;
	prod_lanes_complete(p);
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
			    !__atomic_load_n(&j->c->failed, __ATOMIC_ACQUIRE)) {
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
	prod_conns_reap(p);
}

/* Says goodbye (ECX_AM_BYE) on every closing connection, so its consumer
 * fails what it still waits for at once: over shared memory nothing else
 * tells it, unless this process exits. The progress thread has stopped;
 * the sends are progressed here, briefly. */
static void serve_byes(ecx_producer *p)
{
	bool pending = false;
	for (conn *c = p->conns; c != NULL; c = c->next) {
		if (!__atomic_load_n(&c->closing, __ATOMIC_ACQUIRE) ||
		    __atomic_load_n(&c->failed, __ATOMIC_ACQUIRE) ||
		    c->closed || c->jobs > 0 || c->ep == NULL)
			continue;
		char *body = malloc(3);
		if (body == NULL)
			continue;
		memcpy(body, "{}", 3);
		bool more = false;
		if (ecx_ucx_am_send(c->ep, ECX_AM_BYE, c->id, p->epoch, body,
		                    &more) == 0)
			pending = pending || more;
	}
	uint64_t until = ecx_now_ns() + 20000000u;
	while (pending && ecx_now_ns() < until)
		if (ecx_ucx_progress(p->ucx) == 0)
			usleep(100);
}

void prod_serve_shutdown(ecx_producer *p)
{
	/* Fail what is in flight, then close every endpoint. A shared-memory
	 * connection with no pull in progress is closing instead: nothing
	 * starts on it, and it gets a goodbye below. */
	pthread_mutex_lock(&p->lock);
	for (conn *c = p->conns; c != NULL; c = c->next) {
		if (c->transport == ECX_TR_SHM && c->jobs == 0 &&
		    c->ep != NULL &&
		    !__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE))
			__atomic_store_n(&c->closing, true, __ATOMIC_RELEASE);
		else
			__atomic_store_n(&c->failed, true, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&p->lock);
	uint64_t until = ecx_now_ns() + 500000000u;
	for (;;) {
		/* The progress thread still runs: read under its lock. */
		pthread_mutex_lock(&p->lock);
		bool busy = p->active != NULL;
		pthread_mutex_unlock(&p->lock);
		if (!busy || ecx_now_ns() >= until)
			break;
		usleep(1000);
	}
	ecx_ucx_stop(p->ucx); /* joins it: what follows is this thread's */
	/* The lanes' writers stop sending (what they had fails), and their
	 * frames complete here, before any job is given up below. */
	for (conn *c = p->conns; c != NULL; c = c->next)
		prod_lane_quiesce(c->lane);
	prod_lanes_complete(p);
	serve_byes(p);
	while (p->queue != NULL) {
		job *j = p->queue;
		p->queue = j->next;
		prod_job_release(p, j);
	}
	while (p->active != NULL) {
		job *j = p->active;
		p->active = j->next;
		if (j->flushing &&
		    !__atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) {
			/* Its flush (or sends) may still call back, when
			 * its worker goes below: the last callback frees it
			 * then (else it is left, a few hundred bytes, at
			 * exit). */
			j->abandoned = true;
			prod_job_release_parts(p, j);
		} else {
			prod_job_release(p, j);
		}
	}
	while (p->conns != NULL) {
		conn *c = p->conns;
		p->conns = c->next;
		prod_rkeys_drop(c);
		if (prod_conn_goes_with_side(c)) {
			ecx_ucx_side_destroy_forced(p->ucx, c->side, c->ep);
		} else {
			ecx_ucx_side_ep_close(p->ucx, c->side, c->ep,
			                      c->transport, 100);
			ecx_ucx_side_destroy(p->ucx, c->side);
		}
		prod_lane_free(c->lane);
		free(c->addr);
		free(c);
	}
	/* What the lanes' writers failed as they stopped. */
	prod_lanes_complete(p);
}
