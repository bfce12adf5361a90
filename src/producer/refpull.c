/*
 * refpull.c - the reference's pull served for real: {"op":"pull",
 * "mm_hash","dst_session","dst_ptr","nbytes"} writes the item into that
 * Mooncake session at that address over Mooncake's TCP wire
 * (mooncake/writer.h) and answers as the reference does.
 *
 * The rendezvous thread only checks the item and pins it; the write runs on
 * a writer thread of this file and its answer goes back through the
 * request's ticket (rdv.h), so the rendezvous socket keeps serving hellos,
 * leases and other pulls while a receiver is slow. Each write is bounded
 * by the producer's timeout from the pull's arrival.
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "producer"

static const char *const ref_reason[REF_NREASONS] = {
    [REF_UNKNOWN_ID] = "unknown_mm_hash",
    [REF_SIZE] = "size_mismatch",
    [REF_TOKEN] = "token",
    [REF_DISABLED] = "disabled",
    [REF_BUSY] = "busy",
    [REF_DESTINATION] = "destination",
    [REF_TIMEOUT] = "timeout",
    [REF_UNREACHABLE] = "unreachable",
    [REF_FAILED] = "failed",
};

void prod_ref_refuse(ecx_producer *p, int reason)
{
	__atomic_fetch_add(&p->ref_refused[reason], 1, __ATOMIC_RELAXED);
}

/* Unpins a task's item and counts the pull. Takes the lock. */
static void ref_unpin(ecx_producer *p, ref_task *t, bool served)
{
	pthread_mutex_lock(&p->lock);
	prod_item_unpin(p, t->it);
	p->st.pulls++;
	if (served) {
		p->st.items_served++;
		p->st.bytes_served += t->nbytes;
	} else {
		p->st.items_failed++;
	}
	pthread_mutex_unlock(&p->lock);
}

static int ref_reason_of(int rc)
{
	switch (rc) {
	case ECX_EINVAL:
	case ECX_EUNSUPPORTED:
		return REF_DESTINATION;
	case ECX_ETIMEDOUT:
		return REF_TIMEOUT;
	case ECX_ECONNECT:
		return REF_UNREACHABLE;
	default:
		return REF_FAILED;
	}
}

/* Writes one task and answers it. */
static void ref_run(ecx_producer *p, ref_task *t)
{
	char why[320];
	int rc = ecx_mc_write(p->mc, t->session, t->dst_ptr, t->src, t->nbytes,
	                      t->deadline_ns, why, sizeof(why));
	if (rc == 0) {
		__atomic_fetch_add(&p->ref_pulls, 1, __ATOMIC_RELAXED);
		__atomic_fetch_add(&p->ref_bytes, t->nbytes, __ATOMIC_RELAXED);
	} else {
		prod_ref_refuse(p, ref_reason_of(rc));
		/* Before the unpin: the item may go with it. */
		ecx_warn(MOD, "reference pull of %.64s into %s failed: %s",
		         t->it->id, t->session, why);
	}
	ref_unpin(p, t, rc == 0);
	ecx_rdv_answer(t->ticket,
	               ecx_zresp_encode_ref_pull(rc, rc == 0 ? NULL : why));
	free(t);
}

static void *ref_thread(void *arg)
{
	ecx_producer *p = arg;
	pthread_mutex_lock(&p->ref_lock);
	for (;;) {
		while (p->ref_head == NULL && !p->ref_stop) {
			p->ref_idle++;
			pthread_cond_wait(&p->ref_cond, &p->ref_lock);
			p->ref_idle--;
		}
		ref_task *t = p->ref_head;
		if (t == NULL)
			break; /* stopping, nothing left */
		p->ref_head = t->next;
		if (p->ref_head == NULL)
			p->ref_tail = NULL;
		p->ref_queued--;
		pthread_mutex_unlock(&p->ref_lock);
		ref_run(p, t);
		pthread_mutex_lock(&p->ref_lock);
	}
	pthread_mutex_unlock(&p->ref_lock);
	return NULL;
}

/* Queues t, starting a thread when none is idle. false when the queue is
 * full or stopping (t is not queued then). */
static bool ref_queue(ecx_producer *p, ref_task *t)
{
	pthread_mutex_lock(&p->ref_lock);
	if (p->ref_stop || p->ref_queued >= REF_QUEUE_MAX) {
		pthread_mutex_unlock(&p->ref_lock);
		return false;
	}
	if (p->ref_tail != NULL)
		p->ref_tail->next = t;
	else
		p->ref_head = t;
	p->ref_tail = t;
	p->ref_queued++;
	if (p->ref_idle < p->ref_queued && p->ref_threads < REF_THREADS) {
		if (pthread_create(&p->ref_thr[p->ref_threads], NULL,
		                   ref_thread, p) == 0)
			p->ref_threads++;
		else
			ecx_warn(MOD, "cannot start a reference pull thread");
	}
	bool ok = p->ref_threads > 0;
	if (!ok) {
		/* No thread to run it: take it back. */
		p->ref_head = p->ref_tail = NULL;
		p->ref_queued = 0;
	}
	pthread_cond_signal(&p->ref_cond);
	pthread_mutex_unlock(&p->ref_lock);
	return ok;
}

char *prod_ref_pull(ecx_producer *p, const ecx_zreq *r)
{
	if (!p->mooncake) {
		prod_ref_refuse(p, REF_DISABLED);
		return ecx_zresp_encode_error(
		    ECX_EUNSUPPORTED,
		    "this producer does not serve the reference's pull (it "
		    "was started with the Mooncake wire off)");
	}
	ref_task *t = calloc(1, sizeof(*t));
	if (t == NULL)
		return ecx_zresp_encode_error(ECX_ENOMEM, NULL);
	uint64_t start = ecx_now_ns();
	pthread_mutex_lock(&p->lock);
	item *it = prod_item_find(p, r->mm_hash);
	int rc = it == NULL || !it->ready       ? ECX_ENOTFOUND
	         : it->desc.nbytes != r->nbytes ? ECX_ESIZE
	                                        : 0;
	if (rc == 0) {
		prod_item_pin(p, it);
		prod_item_touch(p, it);
		t->it = it;
		t->src = (const char *)p->base + it->off;
	}
	pthread_mutex_unlock(&p->lock);
	if (rc != 0) {
		free(t);
		prod_ref_refuse(p, rc == ECX_ENOTFOUND ? REF_UNKNOWN_ID
		                                       : REF_SIZE);
		/* Exactly the reference's words: "unknown mm_hash", "size
		 * mismatch" (core_strerror). */
		return ecx_zresp_encode_error(rc, NULL);
	}
	t->nbytes = r->nbytes;
	t->dst_ptr = r->dst_ptr;
	t->deadline_ns = start + (uint64_t)p->timeout_ms * 1000000u;
	ecx_strlcpy(t->session, r->dst_session, sizeof(t->session));
	t->ticket = ecx_rdv_defer();
	if (t->ticket != NULL && ref_queue(p, t))
		return ECX_RDV_LATER;
	ecx_rdv_ticket *tk = t->ticket;
	ref_unpin(p, t, false);
	free(t);
	prod_ref_refuse(p, REF_BUSY);
	char *ans = ecx_zresp_encode_ref_pull(
	    ECX_EBUSY, "too many reference pulls in flight");
	if (tk == NULL)
		return ans;
	ecx_rdv_answer(tk, ans);
	return ECX_RDV_LATER;
}

int prod_ref_init(ecx_producer *p, char *why, size_t whylen)
{
	pthread_mutex_init(&p->ref_lock, NULL);
	pthread_cond_init(&p->ref_cond, NULL);
	return p->mooncake ? ecx_mc_writer_create(NULL, &p->mc, why, whylen)
	                   : 0;
}

void prod_ref_named(ecx_producer *p)
{
	/* Our metadata requests name this producer's rendezvous address. */
	const char *h = strstr(p->address, "://");
	if (p->mc != NULL)
		ecx_mc_writer_set_name(p->mc, h != NULL ? h + 3 : p->address);
}

void prod_ref_stop(ecx_producer *p)
{
	ecx_mc_writer_shutdown(p->mc);
	pthread_mutex_lock(&p->ref_lock);
	p->ref_stop = true;
	pthread_cond_broadcast(&p->ref_cond);
	unsigned n = p->ref_threads;
	pthread_mutex_unlock(&p->ref_lock);
	/* The threads drain the queue: each write left ends at once. */
	for (unsigned i = 0; i < n; i++)
		pthread_join(p->ref_thr[i], NULL);
	p->ref_threads = 0;
	ecx_mc_writer_destroy(p->mc);
	p->mc = NULL;
}

size_t prod_ref_metrics(ecx_producer *p, char *buf, size_t len)
{
	size_t off = 0;
#define P(...)                                                          \
	do {                                                            \
		int k_ = snprintf(buf + off, off < len ? len - off : 0, \
		                  __VA_ARGS__);                         \
		off += k_ > 0 ? (size_t)k_ : 0;                         \
	} while (0)
	P("# HELP ecx_producer_reference_pulls_total Reference pulls "
	  "written into a Mooncake session.\n"
	  "# TYPE ecx_producer_reference_pulls_total counter\n"
	  "ecx_producer_reference_pulls_total %llu\n"
	  "# HELP ecx_producer_reference_pull_bytes_total Bytes written by "
	  "reference pulls.\n"
	  "# TYPE ecx_producer_reference_pull_bytes_total counter\n"
	  "ecx_producer_reference_pull_bytes_total %llu\n"
	  "# HELP ecx_producer_reference_pulls_refused_total Reference "
	  "pulls refused or failed, by reason.\n"
	  "# TYPE ecx_producer_reference_pulls_refused_total counter\n",
	  (unsigned long long)__atomic_load_n(&p->ref_pulls, __ATOMIC_RELAXED),
	  (unsigned long long)__atomic_load_n(&p->ref_bytes, __ATOMIC_RELAXED));
	for (int i = 0; i < REF_NREASONS; i++)
		P("ecx_producer_reference_pulls_refused_total{reason=\"%s\"} "
		  "%llu\n",
		  ref_reason[i],
		  (unsigned long long)__atomic_load_n(&p->ref_refused[i],
		                                      __ATOMIC_RELAXED));
#undef P
	return off;
}
