/*
 * serve_data.c - a pull's data sent as active messages over TCP (a pull
 * with data_am; serve.c posts them): one ECX_AM_DATA message per run of
 * neighbouring items, the reply folded into the pull's only one (in its
 * header, or at the front of its body for a pull with lead), and, for a
 * pull with lead from a producer whose CPU needs it (p->rndv_lead), the
 * only message of a pull, sent by rendezvous, with padding before the
 * items' bytes.
 */
#include "producer/producer.h"

#include <stdlib.h>
#include <string.h>

#define MOD "producer"

/* Data sends (a pull with data_am) of at least this much are forced to
 * rendezvous, so the consumer names their destinations (UCX receives
 * there what it has not already read into its receive segment, and
 * copies that part out); UCX chooses for smaller ones (eager, mostly).
 * Eager 2 MiB messages were slower across the veth (docs/deploy.md). */
#define AM_RNDV_MIN ((uint64_t)64 << 10)
/* A pull's only data message, when it carries the reply, goes eagerly up
 * to this much (no rendezvous handshake), else as any other. */
#define FOLD_EAGER_MAX ((uint64_t)64 << 10)

/* Whether items i..k-1 of job j carry all the bytes its pull still has to
 * send: no item after them has any (those before are sent or failed), so
 * every status its reply gives is final once they are posted. */
static bool run_is_last(const job *j, size_t k)
{
	for (size_t m = k; m < j->pr.nitems; m++)
		if (j->items[m] != NULL && j->items[m]->desc.nbytes > 0 &&
		    j->status[m] == 0)
			return false;
	return true;
}

/* Bytes UCX 1.13 frames before an eager active message's body over TCP
 * (its TCP header, 5, and its active-message header, 8): a lead that
 * ends 64 bytes into the message puts the items' bytes, from the
 * page-aligned arena, 64-byte aligned in the kernel's socket buffer too.
 * Another UCX may frame differently: then only the speed changes. */
#define UCX_EAGER_PREFIX 13
/* Bytes UCX 1.13 over TCP writes before a rendezvous body's (its TCP
 * header, 5, and its put header, 16). */
#define UCX_RNDV_PREFIX 21
/* The lead of a pull's only data message sent by rendezvous (a pull with
 * lead):
 * bytes of padding before the items' after UCX's, so that the first piece of
 * the items' bytes starts 64 bytes into the kernel's socket buffer (the rest
 * follow at other distances, never a few bytes past their source). Sent only
 * where this CPU copies slowly there (p->rndv_lead): on one that does not,
 * the two-part message cost 19-47 us of a 1 MiB load across a veth
 * (docs/deploy.md, "The rendezvous lead, where the CPU needs it"). */
#define RNDV_LEAD (64 - UCX_RNDV_PREFIX)
/* Padding only for messages up to this much: at 1 MiB (UCX's piece over
 * TCP, RX_SEG_SIZE 1m) the padded first piece is all of it; a 7 MiB item
 * padded (UCX then receives a body in two parts in pieces of 256 KiB)
 * moved less across the veth (docs/deploy.md). */
#define RNDV_LEAD_MAX ((uint64_t)2 << 20)

/* The padding a rendezvous lead sends (never written). */
static char rndv_pad[RNDV_LEAD];

bool prod_rndv_lead(void)
{
	const char *env = getenv("ECX_TEST_RNDV_LEAD");
	if (env != NULL) {
		bool on = strcmp(env, "0") != 0;
		ecx_debug(MOD, "rendezvous lead %s (ECX_TEST_RNDV_LEAD)",
		          on ? "on" : "off");
		return on;
	}
	double r = 0;
	bool on = ecx_copy_offset_slow(UCX_RNDV_PREFIX, &r);
	if (r == 0)
		ecx_debug(MOD, "rendezvous lead on (this CPU's copies not "
		               "measured)");
	else
		ecx_debug(MOD,
		          "rendezvous lead %s (a copy %d bytes off a page: "
		          "%.1fx one 64 bytes off)",
		          on ? "on" : "off", UCX_RNDV_PREFIX, r);
	return on;
}

/* A folded reply at the front of an eager data message's body (lead):
 * its header, the body's two parts, and the lead's bytes, which UCX may
 * read until the send completes (j->fold_hdr; freed with j). */
typedef struct fold_lead {
	ecx_am_lead_hdr h;
	ucp_dt_iov_t iov[2];
	char lead[];
} fold_lead;

/* How a data message of a pull with lead is framed: no lead, the reply
 * at the front of an eager body, or padding at the front of a body sent
 * by rendezvous (ecx_am_lead_hdr). */
enum { LEAD_NONE, LEAD_EAGER, LEAD_RNDV };

/* Puts job j's reply after data header h in one header for the data
 * message that carries the pull's last bytes (a pull with fold): after
 * the data header (LEAD_NONE) or after a lead header (LEAD_RNDV), or, for
 * LEAD_EAGER, at the front of its body, len bytes from src after it
 * (j->fold_iov); and counts the pull in the stats as that reply says:
 * j->fold_hdr and its length, or 0 when it cannot (no memory, or a header
 * larger than UCX takes: the reply then goes apart). */
static size_t job_fold(ecx_producer *p, job *j, const ecx_am_data_hdr *h,
                       int lead, void *src, uint64_t len)
{
	if (p->am_hdr_max == 0)
		p->am_hdr_max = ecx_ucx_max_am_header(ecx_ucx_worker(p->ucx));
	ecx_pull_resp r = prod_job_resp(j, 0, NULL);
	char *body = ecx_pull_resp_encode(&r);
	size_t blen = body != NULL ? strlen(body) : 0;
	/* The eager lead: the JSON, then spaces up to a multiple of 64
	 * bytes into the message. */
	size_t llen =
	    ((UCX_EAGER_PREFIX + blen + 63) & ~(size_t)63) - UCX_EAGER_PREFIX;
	if (lead == LEAD_EAGER &&
	    (llen > UINT16_MAX || sizeof(ecx_am_lead_hdr) > p->am_hdr_max))
		lead = LEAD_NONE;
	size_t pre = lead == LEAD_RNDV ? sizeof(ecx_am_lead_hdr) : sizeof(*h);
	size_t hlen = lead == LEAD_EAGER ? sizeof(ecx_am_lead_hdr) : pre + blen;
	if (body == NULL || hlen > p->am_hdr_max ||
	    (j->fold_hdr = malloc(lead == LEAD_EAGER ? sizeof(fold_lead) + llen
	                                             : hlen)) == NULL) {
		free(body);
		return 0;
	}
	if (lead == LEAD_EAGER) {
		fold_lead *f = (fold_lead *)(void *)j->fold_hdr;
		f->h = (ecx_am_lead_hdr){.d = *h,
		                         .magic = ECX_AM_LEAD_MAGIC,
		                         .lead = (uint16_t)llen,
		                         .reply_len = (uint16_t)blen};
		memcpy(f->lead, body, blen);
		memset(f->lead + blen, ' ', llen - blen);
		f->iov[0] = (ucp_dt_iov_t){.buffer = f->lead, .length = llen};
		f->iov[1] = (ucp_dt_iov_t){.buffer = src, .length = len};
		j->fold_iov = f->iov;
	} else {
		ecx_am_lead_hdr lh = {
		    .d = *h, .magic = ECX_AM_LEAD_MAGIC, .lead = RNDV_LEAD};
		memcpy(j->fold_hdr, lead == LEAD_RNDV ? (void *)&lh : (void *)h,
		       pre);
		memcpy(j->fold_hdr + pre, body, blen);
	}
	free(body);
	prod_job_tally(j, &j->pre_served, &j->pre_failed, &j->pre_bytes);
	pthread_mutex_lock(&p->lock);
	p->st.pulls++;
	p->st.items_served += j->pre_served;
	p->st.items_failed += j->pre_failed;
	p->st.bytes_served += j->pre_bytes;
	pthread_mutex_unlock(&p->lock);
	j->folded = true;
	return hlen;
}

ucs_status_ptr_t prod_data_send(ecx_producer *p, job *j, size_t i, size_t k,
                                void *src, uint64_t len)
{
	job_send *s = &j->sends[j->nsends++];
	s->j = j;
	s->h = (ecx_am_data_hdr){.conn = j->conn_id,
	                         .req = j->req,
	                         .first = (uint32_t)i,
	                         .count = (uint32_t)(k - i)};
	if (j->lane != NULL)
		return prod_lane_data(j->lane, s, src, len);
	const void *hdr = &s->h;
	size_t hlen = sizeof(s->h);
	uint32_t flags = len >= AM_RNDV_MIN ? UCP_AM_SEND_FLAG_RNDV : 0;
	bool fold = j->pr.fold && j->nsends == 1 && run_is_last(j, k);
	/* Padding only for a pull's only message: with several in flight
	 * the kernel's socket pages are not fresh at each, and the padded
	 * receive (UCX's for a body in two parts) moved batches less. */
	int lead = !j->pr.lead || !fold    ? LEAD_NONE
	           : len <= FOLD_EAGER_MAX ? LEAD_EAGER
	           : (flags & UCP_AM_SEND_FLAG_RNDV) && len <= RNDV_LEAD_MAX &&
	                   p->rndv_lead
	               ? LEAD_RNDV
	               : LEAD_NONE;
	size_t flen = fold ? job_fold(p, j, &s->h, lead, src, len) : 0;
	if (flen > 0) {
		hdr = j->fold_hdr;
		hlen = flen;
		if (len <= FOLD_EAGER_MAX)
			flags = UCP_AM_SEND_FLAG_EAGER;
	} else if (lead == LEAD_RNDV) {
		/* Not folded: the lead header alone. */
		s->lh = (ecx_am_lead_hdr){
		    .d = s->h, .magic = ECX_AM_LEAD_MAGIC, .lead = RNDV_LEAD};
		hdr = &s->lh;
		hlen = sizeof(s->lh);
	}
	ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA |
	                                          UCP_OP_ATTR_FIELD_FLAGS,
	                          .cb.send = prod_send_done,
	                          .user_data = s,
	                          .flags = flags};
	const void *buf = src;
	size_t count = len;
	if (flen > 0 && j->fold_iov != NULL) {
		buf = j->fold_iov;
		count = 2;
	} else if (lead == LEAD_RNDV) {
		s->iov[0] =
		    (ucp_dt_iov_t){.buffer = rndv_pad, .length = RNDV_LEAD};
		s->iov[1] = (ucp_dt_iov_t){.buffer = src, .length = len};
		buf = s->iov;
		count = 2;
	}
	if (buf != src) {
		rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
		rp.datatype = ucp_dt_make_iov();
	}
	ucs_status_ptr_t req =
	    ucp_am_send_nbx(j->c->ep, ECX_AM_DATA, hdr, hlen, buf, count, &rp);
	if (req != NULL && !UCS_PTR_IS_ERR(req))
		__atomic_add_fetch(&j->pending, 1, __ATOMIC_ACQ_REL);
	return req;
}
