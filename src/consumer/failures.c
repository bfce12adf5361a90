/*
 * failures.c - what fails a consumer's connection to a producer, and what
 * that fails: an error UCX reports on its endpoint, a goodbye the producer
 * sends when it is destroyed (ECX_AM_BYE), its process seen to exit (over
 * shared memory, which reports no failed peer); the pulls in flight on the
 * connection fail with it, its zombies end, and a producer that left is
 * remembered so that a load of its items fails at once. (conns.c makes
 * and ends the connections.)
 */
#include "consumer/consumer.h"

#include <stdio.h>
#include <string.h>

#define MOD "consumer"

/* ---- failures ---- */

void cons_pconn_fail_locked(ecx_consumer *c, pconn *pc, int err,
                            const char *why)
{
	pc->failed = true;
	for (;;) {
		pull *p = NULL;
		for (pull *q = c->inflight; q != NULL && p == NULL; q = q->next)
			if (q->pc == pc)
				p = q;
		if (p == NULL)
			break;
		cons_pull_take(c, p->req);
		if (p->zombie) {
			cons_zombie_end(c, p);
			continue;
		}
		if (why != NULL && p->load != NULL && p->load->why_err == 0) {
			snprintf(p->load->why, sizeof(p->load->why), "%s", why);
			p->load->why_err = err;
		}
		cons_pull_fail(p, err);
	}
}

void cons_pconn_fail_live_locked(ecx_consumer *c, pconn *pc, int err)
{
	pc->failed = true;
	for (;;) {
		pull *p = NULL;
		for (pull *q = c->inflight; q != NULL && p == NULL; q = q->next)
			if (q->pc == pc && !q->zombie)
				p = q;
		if (p == NULL)
			break;
		cons_pull_take(c, p->req);
		cons_pull_fail(p, err);
	}
}

bool cons_pconn_idle(const pconn *pc, uint64_t now_ms)
{
	return pc->idle_ms != 0 && now_ms > pc->used_ms &&
	       now_ms - pc->used_ms > pc->idle_ms / 2;
}

/* Why an error UCX reports on pc's endpoint is no failure, or NULL when
 * it is one. UCX reports the peer closing its end as an error too (over
 * TCP "Endpoint timeout": the producer closed the socket), and the
 * producer closes its end after a goodbye and when the connection idles
 * (prod_conns_reap). Neither is a failure where no load uses the
 * connection: it is ecx's own doing, or a connection no load sends on any
 * more (cons_pconn_idle), the next load makes a new one. A pull in flight
 * on it, or about to go, makes it a failure whatever the cause: that load
 * fails. Called with c->lock. */
static const char *pconn_error_expected(const ecx_consumer *c, const pconn *pc,
                                        uint64_t now_ms)
{
	if (pc->users > 0)
		return NULL;
	for (const pull *q = c->inflight; q != NULL; q = q->next)
		if (q->pc == pc && !q->zombie)
			return NULL;
	if (pc->bye_sent)
		return "after its goodbye";
	if (pc->failed)
		return "given up before";
	if (cons_pconn_idle(pc, now_ms))
		return "idle";
	return NULL;
}

void cons_pconn_on_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	(void)ep;
	pconn *pc = arg;
	ecx_consumer *c = pc->c;
	pthread_mutex_lock(&c->lock);
	const char *expected = pconn_error_expected(c, pc, ecx_now_ms());
	cons_pconn_fail_locked(c, pc, ECX_ECLOSED, NULL);
	pthread_mutex_unlock(&c->lock);
	if (expected != NULL)
		ecx_debug(MOD,
		          "connection to producer %s closed (%s, no load on "
		          "it): %s",
		          pc->address, expected, ucs_status_string(st));
	else
		ecx_warn(MOD, "connection to producer %s failed: %s",
		         pc->address, ucs_status_string(st));
}

/* ---- producers that exit (shared memory) ---- */

void cons_dead_detail(const char *address, long pid, bool bye, char *why,
                      size_t len)
{
	snprintf(why, len, "producer %s (process %ld on this host) has %s",
	         address, pid, bye ? "closed (its goodbye)" : "exited");
}

/* Remembers pc's producer dead and fails pc with its pulls. Called with
 * c->lock. */
static void pconn_dead_locked(ecx_consumer *c, pconn *pc, bool bye)
{
	pc->gone = true;
	dead_peer *d = &c->dead[c->ndead++ % ECX_DEAD_MAX];
	ecx_strlcpy(d->address, pc->address, sizeof(d->address));
	d->epoch = pc->epoch;
	d->pid = pc->pid;
	d->bye = bye;
	char why[400];
	cons_dead_detail(pc->address, pc->pid, bye, why, sizeof(why));
	ecx_info(MOD, "%s: its loads fail", why);
	cons_pconn_fail_locked(c, pc, ECX_ECLOSED, why);
}

ucs_status_t cons_am_bye(void *arg, const void *header, size_t header_len,
                         void *data, size_t length,
                         const ucp_am_recv_param_t *param)
{
	(void)data;
	(void)length;
	(void)param;
	ecx_consumer *c = arg;
	if (header_len != sizeof(ecx_am_hdr))
		return UCS_OK;
	ecx_am_hdr h;
	memcpy(&h, header, sizeof(h));
	pthread_mutex_lock(&c->lock);
	for (pconn *pc = c->conns; pc != NULL; pc = pc->next)
		if (!pc->connecting && !pc->gone && pc->id == h.conn &&
		    pc->epoch == h.req)
			pconn_dead_locked(c, pc, true);
	pthread_mutex_unlock(&c->lock);
	return UCS_OK;
}

bool cons_pconn_gone_locked(ecx_consumer *c, pconn *pc)
{
	if (pc->gone)
		return true;
	if (pc->connecting)
		return false;
	bool gone = pc->pidfd >= 0 ? ecx_pid_gone(pc->pidfd)
	            : pc->pid_poll ? ecx_pid_exited(pc->pid, pc->pid_start)
	                           : false;
	if (!gone)
		return false;
	pconn_dead_locked(c, pc, false);
	return true;
}

const dead_peer *cons_dead_find(const ecx_consumer *c, const char *address,
                                uint64_t epoch)
{
	unsigned n = c->ndead < ECX_DEAD_MAX ? c->ndead : ECX_DEAD_MAX;
	for (unsigned i = 0; epoch != 0 && i < n; i++)
		if (c->dead[i].epoch == epoch &&
		    strcmp(c->dead[i].address, address) == 0)
			return &c->dead[i];
	return NULL;
}

void cons_pconns_watch(ecx_consumer *c, bool force)
{
	uint64_t now = ecx_now_ns();
	uint64_t last = __atomic_load_n(&c->watch_ns, __ATOMIC_RELAXED);
	if (!force && now - last < 1000000u)
		return;
	__atomic_store_n(&c->watch_ns, now, __ATOMIC_RELAXED);
	pthread_mutex_lock(&c->lock);
	for (pconn *pc = c->conns; pc != NULL; pc = pc->next)
		cons_pconn_gone_locked(c, pc);
	pthread_mutex_unlock(&c->lock);
}
