/*
 * conns.c - the producer's consumer connections after their hello
 * (hello.c makes them): found by number, failed by UCX or a goodbye, and
 * reaped by the progress thread: closed when failed or idle, and freed
 * with their worker once no pull job uses them.
 */
#include "producer/producer.h"

#include <stdlib.h>

#define MOD "producer"

void prod_conn_on_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	(void)ep;
	conn *c = arg;
	ecx_info(MOD, "consumer connection %llu failed: %s",
	         (unsigned long long)c->id, ucs_status_string(st));
	/* Runs in a progress call; on_progress closes the endpoint. */
	__atomic_store_n(&c->failed, true, __ATOMIC_RELEASE);
}

/* Whether closing connection c is destroying its worker right after its
 * endpoint's forced close, with no progress in between
 * (ecx_ucx_side_destroy_forced): a TCP connection with a worker of its
 * own, which may have a zero-copy data send in flight to a consumer that
 * stopped reading. */
bool prod_conn_goes_with_side(const conn *c)
{
	return c->transport == ECX_TR_TCP && c->side != NULL;
}

conn *prod_conn_find(ecx_producer *p, uint64_t id)
{
	for (conn *c = p->conns; c != NULL; c = c->next)
		if (c->id == id)
			return c;
	return NULL;
}

bool prod_conn_drop(ecx_producer *p, uint64_t id)
{
	pthread_mutex_lock(&p->lock);
	conn *c = prod_conn_find(p, id);
	if (c != NULL)
		__atomic_store_n(&c->failed, true, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&p->lock);
	if (c != NULL)
		ecx_ucx_wake(p->ucx);
	return c != NULL;
}

bool prod_conn_exists(ecx_producer *p, uint64_t id)
{
	pthread_mutex_lock(&p->lock);
	bool there = prod_conn_find(p, id) != NULL;
	pthread_mutex_unlock(&p->lock);
	return there;
}

/* Closes the endpoints of failed connections (which completes their jobs'
 * flushes with an error), and frees a closed connection once no job uses
 * it (its remote keys go with it: that unmaps the consumer's memory
 * here). A connection with no job for p->idle_ms is closed the same
 * way. */
/* Stops c's lane and completes what its writer was done with, so that no
 * thread reads a job's items once it is given up. Called with p->lock,
 * on the progress thread. */
static void lane_settle(ecx_producer *p, conn *c)
{
	prod_lane *l = __atomic_load_n(&c->lane, __ATOMIC_ACQUIRE);
	if (l == NULL)
		return;
	prod_lane_quiesce(l);
	prod_lanes_complete(p);
}

void prod_conns_reap(ecx_producer *p)
{
	uint64_t idle_ns = (uint64_t)p->idle_ms * 1000000u;
	for (;;) {
		conn *close_it = NULL, *free_it = NULL, *drain_it = NULL;
		pthread_mutex_lock(&p->lock);
		uint64_t now = ecx_now_ns();
		for (conn **cp = &p->conns; *cp != NULL; cp = &(*cp)->next) {
			conn *c = *cp;
			if (!c->closed && c->jobs == 0 &&
			    now - c->used_ns > idle_ns &&
			    !__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE)) {
				ecx_info(MOD,
				         "consumer connection %llu idle for "
				         "%d ms: closing it",
				         (unsigned long long)c->id, p->idle_ms);
				__atomic_store_n(&c->failed, true,
				                 __ATOMIC_RELEASE);
			}
			if (!__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE))
				continue;
			if (!c->closed && !c->drained &&
			    prod_conn_goes_with_side(c)) {
				/* Its worker progressed alone first (below,
				 * out of the lock), while its jobs still
				 * stand: what its endpoints had queued goes
				 * out before no progress may run. */
				c->drained = true;
				drain_it = c;
				break;
			}
			if (!c->closed) {
				c->closed = true;
				c->closed_ns = now;
				if (!prod_conn_goes_with_side(c)) {
					close_it = c;
					break;
				}
				/* Its unfinished jobs are given up now, and
				 * its worker goes below, in this same pass:
				 * no progress in between. Its lane's writer
				 * first stops reading their items. */
				lane_settle(p, c);
				prod_jobs_abandon(p, c);
			}
			if (c->jobs > 0 && now - c->closed_ns > 100000000u) {
				lane_settle(p, c);
				prod_jobs_abandon(p, c);
			}
			if (c->jobs == 0) {
				/* Counted until its memory is let go of
				 * (below): a count of 0 means nothing of the
				 * consumer is held here. */
				*cp = c->next;
				free_it = c;
				break;
			}
		}
		pthread_mutex_unlock(&p->lock);
		if (drain_it != NULL) {
			/* Only this thread frees a connection: it stays. */
			ecx_ucx_side_drain(drain_it->side);
			continue;
		}
		if (close_it == NULL && free_it == NULL)
			return;
		if (close_it != NULL) {
			/* The keys go first: they refer to the endpoint. Jobs
			 * holding them finish with the flush's error. */
			if (close_it->jobs == 0)
				prod_rkeys_drop(close_it);
			/* Its lane's frames fail now, not at their deadline. */
			prod_lane_shutdown(
			    __atomic_load_n(&close_it->lane, __ATOMIC_ACQUIRE));
			ecx_ucx_side_ep_close(p->ucx, close_it->side,
			                      close_it->ep, close_it->transport,
			                      100);
			close_it->ep = NULL;
			continue;
		}
		prod_rkeys_drop(free_it);
		/* Its worker goes last: its endpoints with it, and with them
		 * UCX's hold on the consumer's shared memory. */
		if (prod_conn_goes_with_side(free_it))
			ecx_ucx_side_destroy_forced(p->ucx, free_it->side,
			                            free_it->ep);
		else
			ecx_ucx_side_destroy(p->ucx, free_it->side);
		pthread_mutex_lock(&p->lock);
		p->nconns--;
		pthread_mutex_unlock(&p->lock);
		ecx_debug(MOD, "closed connection %llu",
		          (unsigned long long)free_it->id);
		prod_lane_free(free_it->lane);
		free(free_it->addr);
		free(free_it);
	}
}
