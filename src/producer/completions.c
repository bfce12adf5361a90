/*
 * completions.c - the completions a pull job waits for (serve.c posts
 * them): its flush, its data sends, and the landed notices that tell a
 * consumer hashing as items land which bytes are in. The last completion
 * marks the job done, or frees it when it was abandoned meanwhile. Runs
 * on the progress thread (UCX callbacks); calls nothing in serve.c.
 */
#include "producer/producer.h"

#include <stdlib.h>

void prod_job_free(job *j)
{
	free(j->sends);
	free(j->fold_hdr);
	free(j);
}

/* One of the completions job j waits for has come (st: the flush's): the
 * last marks j done, or frees it if it was abandoned meanwhile. */
void prod_job_part_done(job *j, ucs_status_t st)
{
	if (st != UCS_OK && j->flush_status == 0)
		j->flush_status = ecx_ucx_err(st);
	if (__atomic_sub_fetch(&j->pending, 1, __ATOMIC_ACQ_REL) > 0)
		return;
	if (j->abandoned)
		prod_job_free(j);
	else
		__atomic_store_n(&j->done, true, __ATOMIC_RELEASE);
}

void prod_flush_done(void *request, ucs_status_t st, void *user_data)
{
	ucp_request_free(request);
	prod_job_part_done(user_data, st);
}

/* A send of a job's data completed: its items get its status. */
void prod_send_done(void *request, ucs_status_t st, void *user_data)
{
	job_send *s = user_data;
	ucp_request_free(request);
	if (st != UCS_OK)
		s->status = ecx_ucx_err(st);
	prod_job_part_done(s->j, UCS_OK);
}

/* A landed notice went (or failed: the reply tells the consumer all the
 * same). */
static void landed_sent(void *request, ucs_status_t st, void *user_data)
{
	(void)st;
	ucp_request_free(request);
	prod_job_part_done(user_data, UCS_OK);
}

/* Sends the landed notice s (items s->h.first.. of its job), their put
 * having completed at the consumer, counting it in flight as one of the
 * job's completions. */
static void landed_post(job_send *s)
{
	job *j = s->j;
	if (j->abandoned || j->c == NULL ||
	    __atomic_load_n(&j->c->failed, __ATOMIC_ACQUIRE))
		return;
	ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA |
	                                          UCP_OP_ATTR_FIELD_FLAGS,
	                          .cb.send = landed_sent,
	                          .user_data = j,
	                          .flags = UCP_AM_SEND_FLAG_EAGER};
	ucs_status_ptr_t req =
	    ucp_am_send_nbx(j->c->ep, ECX_AM_LANDED, &s->h, sizeof(s->h),
	                    s->upto != 0 ? &s->upto : NULL,
	                    s->upto != 0 ? sizeof(s->upto) : 0, &rp);
	if (req != NULL && !UCS_PTR_IS_ERR(req))
		__atomic_add_fetch(&j->pending, 1, __ATOMIC_ACQ_REL);
}

static void landed_flushed(void *request, ucs_status_t st, void *user_data)
{
	job_send *s = user_data;
	job *j = s->j;
	ucp_request_free(request);
	if (st == UCS_OK)
		landed_post(s);
	prod_job_part_done(j, UCS_OK);
}

/* After the put of items i..k-1 of job j (or, upto not 0, of item i's
 * first upto bytes): once it has completed at the consumer (a flush; over
 * shared memory puts complete as they are made, so at once), tells it
 * those bytes are in (ECX_AM_LANDED). */
void prod_landed_after(job *j, size_t i, size_t k, uint64_t upto)
{
	job_send *s = &j->sends[j->nsends++];
	s->j = j;
	s->upto = upto;
	s->h = (ecx_am_data_hdr){.conn = j->conn_id,
	                         .req = j->req,
	                         .first = (uint32_t)i,
	                         .count = (uint32_t)(k - i)};
	ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA,
	                          .cb.send = landed_flushed,
	                          .user_data = s};
	ucs_status_ptr_t req = ucp_ep_flush_nbx(j->c->ep, &fp);
	if (req == NULL)
		landed_post(s);
	else if (!UCS_PTR_IS_ERR(req))
		__atomic_add_fetch(&j->pending, 1, __ATOMIC_ACQ_REL);
}
