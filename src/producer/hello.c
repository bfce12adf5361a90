/*
 * hello.c - what the producer answers on its rendezvous socket: ecx's
 * hello (records the consumer's worker address, sends this worker's) and
 * the reference's single-item pull (answered in the reference's shape).
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "producer"

/* ---- the ZeroMQ socket ---- */

/* A hello records the consumer's worker address; the endpoint to it is
 * made at its first pull (conn_connect), once the consumer's own endpoint
 * to this worker is wired up. Creating both at once races in UCX's
 * endpoint matching, and a pull then loses its reply. */
static char *hello_answer(ecx_producer *p, const ecx_zreq *r)
{
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
	c->hello_wall_ms = ecx_wall_ms();
	c->hello_mono_ms = c->born_ns / 1000000u;
	pthread_mutex_lock(&p->lock);
	if (p->nconns >= MAX_CONNS) {
		pthread_mutex_unlock(&p->lock);
		free(addr);
		free(c);
		return ecx_zresp_encode_error(ECX_EBUSY,
		                              "too many consumer connections");
	}
	uint64_t id = c->id = ++p->next_conn;
	uint64_t hello_wall = c->hello_wall_ms;
	c->next = p->conns;
	p->conns = c;
	p->nconns++;
	/* c belongs to the progress thread from here on. */
	pthread_mutex_unlock(&p->lock);
	const void *waddr;
	size_t alen;
	ecx_ucx_address(p->ucx, &waddr, &alen);
	ecx_debug(MOD, "consumer connection %llu", (unsigned long long)id);
	return ecx_zresp_encode_hello(waddr, alen, p->epoch, id, hello_wall);
}

/* The reference's {"op":"pull",...}: answered in its reply shape. ecx
 * cannot write into a Mooncake session, so a pull that would succeed there
 * is refused with the reason. */
static char *ref_pull_answer(ecx_producer *p, const ecx_zreq *r)
{
	pthread_mutex_lock(&p->lock);
	item *it = prod_item_find(p, r->mm_hash);
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

char *prod_rdv_handle(void *arg, const ecx_zreq *r)
{
	ecx_producer *p = arg;
	if (p->token != NULL &&
	    !ecx_ct_equal(r->token, strlen(r->token), p->token, p->token_len))
		return ecx_zresp_encode_error(ECX_EAUTH, NULL);
	if (r->op == ECX_ZOP_LEASE)
		return prod_lease_answer(p, r);
	if (r->op == ECX_ZOP_RELEASE)
		return prod_release_answer(p, r);
	return r->op == ECX_ZOP_HELLO ? hello_answer(p, r)
	                              : ref_pull_answer(p, r);
}
