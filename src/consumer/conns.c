/*
 * conns.c - the consumer's connections to producers: the hello over the
 * rendezvous client, then a UCX endpoint, kept per producer address and
 * epoch; the pull replies that arrive on them; and what a failed peer
 * fails.
 */
#include "consumer/consumer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "consumer"

/* ---- replies and failures ---- */

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

/* Ends pull p with err for every item it carries. Called with the lock. */
void cons_pull_fail(pull *p, int err)
{
	for (size_t i = 0; i < p->n; i++)
		p->load->items[p->idx[i]].status = err;
	__atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
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
	ecx_pull_resp r;
	char why[200];
	int rc = ecx_pull_resp_decode(data, len, &r, why, sizeof(why));
	pthread_mutex_lock(&c->lock);
	pull *p = cons_pull_take(c, h.req);
	if (p == NULL || p->zombie) {
		/* Late: its load timed out already. The producer answers
		 * after its last write of the pull, so a zombie's
		 * quarantine ends here. */
		if (p != NULL)
			cons_zombie_end(c, p);
		pthread_mutex_unlock(&c->lock);
		if (rc == 0)
			ecx_pull_resp_free(&r);
		return UCS_OK;
	}
	if (rc != 0) {
		ecx_warn(MOD, "unreadable reply from %s: %s", p->pc->address,
		         why);
		cons_pull_fail(p, ECX_EPROTO);
	} else if (r.err != 0) {
		ecx_warn(MOD, "pull refused by %s: %s", p->pc->address,
		         r.detail);
		cons_pull_fail(p, r.err);
	} else if (r.nitems != p->n) {
		cons_pull_fail(p, ECX_EPROTO);
	} else {
		ecx_load *l = p->load;
		for (size_t i = 0; i < p->n; i++) {
			l->items[p->idx[i]].status = r.status[i];
			if (l->xxh != NULL && r.hash != NULL && r.has_hash[i]) {
				l->xxh[p->idx[i]] = r.hash[i];
				l->has_xxh[p->idx[i]] = 1;
			}
		}
		__atomic_store_n(&p->done, true, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&c->lock);
	if (rc == 0)
		ecx_pull_resp_free(&r);
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
		cons_pull_take(c, p->req);
		if (p->zombie)
			cons_zombie_end(c, p);
		else
			cons_pull_fail(p, ECX_ECLOSED);
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

ucp_ep_h cons_pconn_cut_locked(pconn *pc)
{
	pc->failed = true;
	if (pc->transport != ECX_TR_TCP || pc->ep == NULL)
		return NULL;
	if (pc->sending > 0) {
		pc->cut = true; /* the last sender closes it */
		return NULL;
	}
	ucp_ep_h ep = pc->ep;
	pc->ep = NULL;
	return ep;
}

void cons_pconn_cut(ecx_consumer *c, ucp_ep_h ep)
{
	/* Forced: nothing is flushed, in either direction. */
	ecx_ucx_ep_close(c->ucx, ep, ECX_TR_TCP, 100);
}

void cons_pconn_close(ecx_consumer *c, pconn *pc)
{
	ecx_ucx_ep_close(c->ucx, pc->ep, pc->transport, 100);
	free(pc);
}

/* Returns a working connection to address (for epoch, when not 0),
 * making one if needed. */
pconn *cons_pconn_get(ecx_consumer *c, const char *address, uint64_t epoch,
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
		cons_pconn_close(c, stale);
		stale = next;
	}
	if (found != NULL) {
		pthread_mutex_unlock(&c->conn_lock);
		return found;
	}
	ecx_zresp z;
	uint64_t sent_ms = ecx_now_ms();
	*err = hello(c, address, &z, why, whylen);
	uint64_t got_ms = ecx_now_ms();
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
	pc->has_clock = z.now_ms != 0;
	pc->hello_now_ms = z.now_ms;
	pc->hello_mono_ms = (sent_ms + got_ms) / 2;
	/* A producer from before transports were agreed: what it does. */
	pc->transport = z.transport != 0                           ? z.transport
	                : ecx_ucx_transports(c->ucx) == ECX_TR_TCP ? ECX_TR_TCP
	                                                           : ECX_TR_SHM;
	*err = ecx_ucx_ep_create(c->ucx, z.worker, z.worker_len, pc->transport,
	                         pconn_on_error, pc, &pc->ep, why, whylen);
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
