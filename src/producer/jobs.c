/* jobs.c - a job's end: its reply (as it stands, or sent), what it counts
 * in the producer's stats, its pins and its release, the legacy hash of
 * older consumers, and the abandon of a closed connection's jobs. The pull
 * service (serve.c) starts and finishes jobs with these. */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "producer"

/* The reply of job j as it stands (err: for the whole pull). */
ecx_pull_resp prod_job_resp(const job *j, int err, const char *detail)
{
	ecx_pull_resp r = {.req = j->req,
	                   .err = err,
	                   .nitems = j->pr.nitems,
	                   .status = j->status,
	                   .hash = j->xxh,
	                   .hash_kind = j->hash_kind,
	                   .data_am = j->pr.data_am};
	if (detail != NULL)
		ecx_strlcpy(r.detail, detail, sizeof(r.detail));
	return r;
}

/* Sends the reply of job j (when its connection still works). */
void prod_job_reply(job *j, int err, const char *detail)
{
	ecx_pull_resp r = prod_job_resp(j, err, detail);
	if (j->c == NULL || __atomic_load_n(&j->c->failed, __ATOMIC_ACQUIRE))
		return;
	/* After its data, on the lane it went on. */
	if (j->lane != NULL) {
		prod_lane_reply(j->lane, j->req, ecx_pull_resp_encode(&r));
		return;
	}
	ecx_ucx_am_send(j->c->ep, ECX_AM_REPLY, j->conn_id, j->req,
	                ecx_pull_resp_encode(&r), NULL);
}

/* Job j's items as its statuses stand: served (and their bytes), failed. */
void prod_job_tally(const job *j, uint64_t *served, uint64_t *failed,
                    uint64_t *bytes)
{
	*served = *failed = *bytes = 0;
	for (size_t i = 0; i < j->pr.nitems; i++) {
		if (j->status[i] == 0) {
			(*served)++;
			*bytes += j->pr.items[i].nbytes;
		} else {
			(*failed)++;
		}
	}
}

/* Takes back what a folded reply counted before its send (job_fold).
 * Called with the lock. */
void prod_job_uncount(ecx_producer *p, job *j)
{
	if (!j->folded)
		return;
	p->st.pulls--;
	p->st.items_served -= j->pre_served;
	p->st.items_failed -= j->pre_failed;
	p->st.bytes_served -= j->pre_bytes;
	j->folded = false;
}

/* Unpins the job's items. Called with the lock. */
void prod_job_unpin(ecx_producer *p, job *j)
{
	for (size_t i = 0; j->items != NULL && i < j->pr.nitems; i++) {
		item *it = j->items[i];
		if (it == NULL)
			continue;
		j->items[i] = NULL;
		prod_item_unpin(p, it);
	}
}

/* Unpins what is still pinned and frees what the job holds but the job.
 * Called with the lock. */
void prod_job_release_parts(ecx_producer *p, job *j)
{
	prod_job_unpin(p, j);
	for (size_t i = 0; j->rkeys != NULL && i < j->pr.nregions; i++) {
		if (j->rkeys[i] == NULL)
			continue;
		if (j->own != NULL && j->rkeys[i] == &j->own[i])
			ucp_rkey_destroy(j->own[i].h);
		else
			j->rkeys[i]->refs--;
	}
	free(j->own);
	if (j->c != NULL) {
		j->c->jobs--;
		j->c->used_ns = ecx_now_ns();
	}
	ecx_pull_req_free(&j->pr);
	free(j->items);
	free(j->status);
	free(j->xxh);
	free(j->rkeys);
	free(j->msg);
	j->items = NULL;
	j->status = NULL;
	j->rkeys = NULL;
	j->own = NULL;
	j->msg = NULL;
	j->c = NULL;
}

/* Unpins what is still pinned and frees the job. Called with the lock. */
void prod_job_release(ecx_producer *p, job *j)
{
	prod_job_release_parts(p, j);
	prod_job_free(j);
}

/* The jobs on closed connection c whose flush (or sends) have not
 * completed: UCX can keep a flush to a peer that died over shared memory
 * waiting for room in the dead peer's queue for good, and a TCP
 * connection is given up on at once, before its worker goes
 * (prod_conn_goes_with_side). Nobody is answered: the items are unpinned and
 * counted failed, the job lets go of c, and the job itself is freed by
 * its last callback if that ever runs. Called with the lock, on the
 * progress thread (where those callbacks run). */
void prod_jobs_abandon(ecx_producer *p, conn *c)
{
	for (job **jp = &p->active; *jp != NULL;) {
		job *j = *jp;
		if (j->c != c || __atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) {
			jp = &j->next;
			continue;
		}
		*jp = j->next;
		ecx_info(MOD,
		         "pull %llu on closed connection %llu unfinished: "
		         "given up",
		         (unsigned long long)j->req, (unsigned long long)c->id);
		prod_job_uncount(p, j);
		p->st.pulls++;
		p->st.items_failed += j->pr.nitems;
		j->abandoned = true;
		prod_job_release_parts(p, j);
	}
}

/* The xxh64 of each item of j that has none yet (a pull from an older
 * consumer), made once and kept. Its bytes are checked against the XXH3
 * taken at put first: an item whose bytes changed since then fails with
 * ECX_ECORRUPT rather than get a hash of the changed bytes. Called from the
 * progress thread without the lock, the items pinned. */
void prod_job_hash_legacy(ecx_producer *p, job *j)
{
	size_t n = j->pr.nitems;
	for (size_t i = 0; i < n; i++) {
		item *it = j->items[i];
		if (it == NULL || it->has_xxh64)
			continue;
		const char *b = (const char *)p->base + it->off;
		size_t len = (size_t)it->desc.nbytes;
		if (ecx_hash_bytes(ECX_HASH_XXH3, b, len) != it->xxh3) {
			ecx_warn(MOD,
			         "%s: bytes changed since put (XXH3 differs): "
			         "failed, not hashed",
			         it->id);
			j->status[i] = ECX_ECORRUPT;
			continue;
		}
		j->xxh[i] = ecx_hash_bytes(ECX_HASH_XXH64, b, len);
	}
	pthread_mutex_lock(&p->lock);
	for (size_t i = 0; i < n; i++) {
		item *it = j->items[i];
		if (it != NULL && !it->has_xxh64 && j->status[i] == 0) {
			it->xxh64 = j->xxh[i];
			it->has_xxh64 = true;
		}
	}
	pthread_mutex_unlock(&p->lock);
}
