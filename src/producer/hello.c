/*
 * hello.c - what the producer answers on its rendezvous socket: ecx's
 * hello (records the consumer's worker address, sends this worker's) and
 * the reference's single-item pull (refpull.c writes it into its Mooncake
 * session).
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD "producer"

/* ---- the ZeroMQ socket ---- */

static const char *tr_setting(unsigned t)
{
	return t == (ECX_TR_SHM | ECX_TR_TCP) ? "auto"
	       : t == ECX_TR_TCP              ? "tcp"
	       : t == ECX_TR_SHM              ? "shm"
	                                      : "none";
}

/* The transport of a new connection: shared memory where both sides allow
 * it and the consumer can map this producer's memory (same host, user and
 * namespaces), else TCP where both allow it; 0, with why naming both
 * sides' settings, where nothing fits. A consumer from before transports
 * were agreed gets what it got then. */
static unsigned agree(ecx_producer *p, const ecx_zreq *r, char *why,
                      size_t whylen)
{
	unsigned mine = ecx_ucx_transports(p->ucx), theirs = r->transports;
	if (theirs == 0)
		return mine == ECX_TR_TCP ? ECX_TR_TCP : ECX_TR_SHM;
	unsigned both = mine & theirs;
	bool near = strcmp(r->domain, p->domain) == 0;
	if ((both & ECX_TR_SHM) && near)
		return ECX_TR_SHM;
	if (both & ECX_TR_TCP)
		return ECX_TR_TCP;
	if (both == 0)
		snprintf(
		    why, whylen,
		    "no transport in common: this producer's transport "
		    "is %s, the consumer's is %s (use auto or tcp on both)",
		    tr_setting(mine), tr_setting(theirs));
	else
		snprintf(why, whylen,
		         "shared memory is the only transport both allow "
		         "(producer %s, consumer %s), and the consumer cannot "
		         "map this producer's memory (another host, user or "
		         "namespace): allow tcp on the %s",
		         tr_setting(mine), tr_setting(theirs),
		         !(mine & ECX_TR_TCP) && !(theirs & ECX_TR_TCP)
		             ? "producer and the consumer"
		         : !(mine & ECX_TR_TCP) ? "producer"
		                                : "consumer");
	return 0;
}

/* A hello records the consumer's worker address; the endpoint to it is
 * made at its first pull (conn_connect), once the consumer's own endpoint
 * to this worker is wired up. Creating both at once races in UCX's
 * endpoint matching, and a pull then loses its reply. */
static char *hello_answer(ecx_producer *p, const ecx_zreq *r)
{
	char why[320];
	unsigned transport = agree(p, r, why, sizeof(why));
	if (transport == 0) {
		ecx_warn(MOD, "hello refused: %s", why);
		return ecx_zresp_encode_error(ECX_EUNSUPPORTED, why);
	}
	conn *c = calloc(1, sizeof(*c));
	void *addr = malloc(r->worker_len);
	if (c == NULL || addr == NULL) {
		free(c);
		free(addr);
		return ecx_zresp_encode_error(ECX_ENOMEM, NULL);
	}
	memcpy(addr, r->worker, r->worker_len);
	/* The connection gets a worker of its own: closing it then lets go
	 * of the consumer's shared-memory segments (ucx.h), and over TCP of
	 * every socket to it at once (conns.c prod_conn_goes_with_side). */
	if (ecx_ucx_side_create(p->ucx, &c->side, why, sizeof(why)) != 0)
		ecx_warn(MOD,
		         "no worker of its own for a consumer connection (%s): "
		         "it uses the producer's%s",
		         why,
		         transport == ECX_TR_SHM
		             ? ", which keeps the consumer's shared-memory "
		               "queues until the producer stops"
		             : "");
	/* The answer carries a copy of the worker's address: once c is on
	 * the list, the progress thread may destroy its side. */
	const void *waddr;
	size_t alen;
	if (c->side != NULL)
		ecx_ucx_side_address(c->side, &waddr, &alen);
	else
		ecx_ucx_address(p->ucx, &waddr, &alen);
	void *wcopy = malloc(alen);
	if (wcopy == NULL) {
		ecx_ucx_side_destroy(p->ucx, c->side);
		free(addr);
		free(c);
		return ecx_zresp_encode_error(ECX_ENOMEM, NULL);
	}
	memcpy(wcopy, waddr, alen);
	c->addr = addr;
	c->addr_len = r->worker_len;
	c->transport = transport;
	/* Its lane's key, kept here too: c is the progress thread's once
	 * published. */
	unsigned char lane_key[ECX_LANE_KEY_LEN] = {0};
	if (transport == ECX_TR_TCP && p->lane_port != 0)
		prod_lane_key(lane_key);
	memcpy(c->lane_key, lane_key, sizeof(lane_key));
	c->p = p;
	c->used_ns = ecx_now_ns();
	c->hello_wall_ms = ecx_wall_ms();
	c->hello_mono_ms = c->used_ns / 1000000u;
	pthread_mutex_lock(&p->lock);
	if (p->nconns >= MAX_CONNS) {
		pthread_mutex_unlock(&p->lock);
		ecx_ucx_side_destroy(p->ucx, c->side);
		free(wcopy);
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
	ecx_debug(MOD, "consumer connection %llu over %s",
	          (unsigned long long)id,
	          transport == ECX_TR_SHM ? "shared memory" : "tcp");
	/* Over shared memory the consumer is on this host and watches this
	 * process (consumer/failures.c); over TCP the pid would mean
	 * nothing. */
	uint64_t pid = transport == ECX_TR_SHM ? (uint64_t)getpid() : 0;
	char *ans = ecx_zresp_encode_hello(
	    wcopy, alen, p->epoch, id, hello_wall, transport,
	    (uint64_t)p->idle_ms, pid, p->pid_start,
	    transport == ECX_TR_TCP ? p->lane_port : 0, lane_key);
	free(wcopy);
	return ans;
}

/* A consumer's goodbye: its connection is closed, its memory unmapped, and
 * the answer says "closed" once nothing of its pulls is in flight (jobs
 * that have not started then never will: they find no connection). The
 * wait is bounded by BYE_WAIT_MS (and the producer's timeout); it holds
 * up this thread, which is why it is short: a consumer told "not yet"
 * asks again, and a goodbye for a connection already gone, or another
 * epoch's, is answered closed at once: nothing of it is here. */
static char *bye_answer(ecx_producer *p, const ecx_zreq *r)
{
	if (r->epoch != p->epoch || !prod_conn_drop(p, r->conn))
		return ecx_zresp_encode_bye(true);
	int wait_ms = p->timeout_ms < BYE_WAIT_MS ? p->timeout_ms : BYE_WAIT_MS;
	uint64_t until = ecx_now_ns() + (uint64_t)wait_ms * 1000000u;
	bool gone = false;
	while (!(gone = !prod_conn_exists(p, r->conn)) && ecx_now_ns() < until)
		usleep(500);
	ecx_debug(MOD, "goodbye from connection %llu: %s",
	          (unsigned long long)r->conn,
	          gone ? "closed" : "still in flight");
	return ecx_zresp_encode_bye(gone);
}

/* Keeps this producer's entries in a remote registry: with Redis, writes
 * them again every third of their TTL; with HTTP, checks every 2 s whether
 * the registry restarted and then publishes them again. Runs on the
 * ZeroMQ thread, which wakes every 100 ms. */

char *prod_rdv_handle(void *arg, const ecx_zreq *r)
{
	ecx_producer *p = arg;
	if (p->token != NULL &&
	    !ecx_ct_equal(r->token, strlen(r->token), p->token, p->token_len)) {
		if (r->op != ECX_ZOP_PULL)
			return ecx_zresp_encode_error(ECX_EAUTH, NULL);
		/* The reference's pull carries no token. */
		prod_ref_refuse(p, REF_TOKEN);
		return ecx_zresp_encode_error(
		    ECX_EAUTH, r->token[0] == '\0'
		                   ? "this producer requires a token and the "
		                     "reference's pull carries none: start it "
		                     "without a token to serve reference "
		                     "consumers"
		                   : "bad token");
	}
	if (r->op == ECX_ZOP_LEASE)
		return prod_lease_answer(p, r);
	if (r->op == ECX_ZOP_RELEASE)
		return prod_release_answer(p, r);
	if (r->op == ECX_ZOP_BYE)
		return bye_answer(p, r);
	return r->op == ECX_ZOP_HELLO ? hello_answer(p, r)
	                              : prod_ref_pull(p, r);
}
