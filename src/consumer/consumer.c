/*
 * consumer.c - the consumer role's lifecycle: create (registry client, UCX,
 * receive arena, rendezvous client), stats, destroy.
 */
#include "consumer/consumer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MOD "consumer"

/* ThreadSanitizer's own annotation (its runtime has it): this thread's
 * accesses between begin and end (reads and writes, a free included) are
 * not checked, for memory whose last reader synchronised with this thread
 * through a lock TSan cannot see. gcc says TSan by __SANITIZE_THREAD__,
 * clang by __has_feature(thread_sanitizer). */
#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif
#if defined(UNDER_TSAN)
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
#define TSAN_IGNORE_WRITES_BEGIN() AnnotateIgnoreWritesBegin(__FILE__, __LINE__)
#define TSAN_IGNORE_WRITES_END() AnnotateIgnoreWritesEnd(__FILE__, __LINE__)
#else
#define TSAN_IGNORE_WRITES_BEGIN() ((void)0)
#define TSAN_IGNORE_WRITES_END() ((void)0)
#endif

/* ---- create, stats, destroy ---- */

int cons_create(const ecx_consumer_params *pp, ecx_consumer **out, char *why,
                size_t whylen)
{
	uint64_t m = pp != NULL ? pp->field_mask : 0;
#define HAS(f) ((m & ECX_CONSUMER_PARAM_##f) != 0)
	/* Without a registry the consumer serves pushes alone (its receive
	 * arena and the Mooncake receiver); its lookups fail. */
	const char *registry = HAS(REGISTRY) ? pp->registry : NULL;
	if (registry != NULL && registry[0] == '\0')
		registry = NULL;
	uint64_t recv = HAS(RECV_CAPACITY) ? pp->recv_capacity : 256u << 20;
	unsigned rcmax =
	    HAS(REGCACHE_MAX) && pp->regcache_max ? pp->regcache_max : 64;
	ecx_consumer *c = calloc(1, sizeof(*c));
	if (c != NULL)
		c->pid = (int)getpid();
	if (c == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_init(&c->lock, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&c->conn_cv, &ca);
	pthread_condattr_destroy(&ca);
	pthread_mutex_init(&c->reg_lock, NULL);
	c->timeout_ms =
	    HAS(TIMEOUT) && pp->timeout_ms > 0 ? pp->timeout_ms : 5000;
	c->integrity = HAS(INTEGRITY) && pp->integrity;
	c->test_hash_legacy = getenv("ECX_TEST_HASH_XXH64") != NULL;
	c->test_no_lead = getenv("ECX_TEST_NO_LEAD") != NULL;
	int rc = ECX_ENOMEM;
	const char *data = getenv("ECX_TCP_DATA");
	c->tcp_data_am =
	    data == NULL || data[0] == '\0' || strcmp(data, "am") == 0;
	if (!c->tcp_data_am && strcmp(data, "put") != 0) {
		rc = ecx_why(why, whylen, ECX_EINVAL,
		             "ECX_TCP_DATA=%s: use am (the default) or put",
		             data);
		goto fail;
	}
	rc = cons_lane_min(c->tcp_data_am, &c->lane_min, why, whylen);
	if (rc != 0)
		goto fail;
	rc = cons_mc_mode(HAS(MOONCAKE) ? pp->mooncake : NULL, &c->mc_mode, why,
	                  whylen);
	if (rc != 0)
		goto fail;
	rc = ECX_ENOMEM;
	if (HAS(BIND_HOST) && pp->bind_host && pp->bind_host[0] &&
	    (c->mc_bind = strdup(pp->bind_host)) == NULL)
		goto fail_msg;
	if (HAS(MOONCAKE_HOST) && pp->mooncake_host && pp->mooncake_host[0] &&
	    (c->mc_host = strdup(pp->mooncake_host)) == NULL)
		goto fail_msg;
	if (HAS(TOKEN) && pp->token && pp->token[0] &&
	    (c->token = strdup(pp->token)) == NULL)
		goto fail_msg;
	/* rcmax is an unsigned: the product fits a 64-bit size_t. */
	c->rcache = calloc(1, sizeof(regcache) + rcmax * sizeof(region));
	if (c->rcache == NULL)
		goto fail_msg;
	/* Released: the unmap hook may run on any thread, one started by a
	 * library (a ZeroMQ context's) that saw nothing of this create. */
	__atomic_store_n(&c->rcache->n, rcmax, __ATOMIC_RELEASE);
	/* Lookups poll for their answers (ECX_REGC_SPIN_US): they are on
	 * the caller's path (vLLM's scheduler). */
	ecx_regclient_opts ro = {.urls = registry,
	                         .token = c->token,
	                         .connect_timeout_ms = c->timeout_ms,
	                         .timeout_ms = c->timeout_ms};
	rc = registry != NULL ? ecx_regclient_create(&ro, &c->rc, why, whylen)
	                      : 0;
	if (rc != 0)
		goto fail;
	/* Loads are waited for by their callers, who progress the worker
	 * themselves; the progress thread stays asleep for a while after
	 * each (ECX_LINGER_NS) so that a caller loading again finds the
	 * worker free of it. */
	ecx_ucx_opts uo = {.transport = HAS(TRANSPORT) ? pp->transport : NULL,
	                   .bind_host = HAS(BIND_HOST) ? pp->bind_host : NULL,
	                   .linger_ns = ECX_LINGER_NS,
	                   .nam = 4};
	uo.am[0].id = ECX_AM_REPLY;
	uo.am[0].cb = cons_am_reply;
	uo.am[0].arg = c;
	uo.am[1].id = ECX_AM_DATA;
	uo.am[1].cb = cons_am_data;
	uo.am[1].arg = c;
	uo.am[2].id = ECX_AM_BYE;
	uo.am[2].cb = cons_am_bye;
	uo.am[2].arg = c;
	uo.am[3].id = ECX_AM_LANDED;
	uo.am[3].cb = cons_am_landed;
	uo.am[3].arg = c;
	rc = ecx_ucx_create(&uo, &c->ucx, why, whylen);
	if (rc != 0)
		goto fail;
	if (recv > 0) {
		rc = ecx_ucx_mem_alloc(c->ucx, recv, &c->arena_base,
		                       &c->arena.memh, why, whylen);
		if (rc != 0)
			goto fail;
		rc = ecx_ucx_rkey_pack(c->ucx, c->arena.memh, &c->arena.rkey,
		                       &c->arena.rkey_len);
		if (rc != 0 || !ecx_alloc_init(&c->alloc, recv)) {
			rc = rc ? rc : ECX_ENOMEM;
			ecx_why(why, whylen, rc, "cannot set up receive arena");
			goto fail;
		}
		c->arena.base = (uint64_t)(uintptr_t)c->arena_base;
		c->arena.len = recv;
		c->arena.live = true;
		c->st.registrations++;
	}
	rc = ecx_rdv_client_create(&c->rdv, why, whylen);
	if (rc != 0)
		goto fail;
	char domain[ECX_DOMAIN_MAX];
	ecx_shm_domain(domain, sizeof(domain));
	ecx_rdv_client_offer(c->rdv, ecx_ucx_transports(c->ucx), domain);
	c->leaser = ecx_rdv_leaser_create();
	if (c->leaser == NULL) {
		rc = ECX_ENOMEM;
		goto fail_msg;
	}
	c->hooked = ucm_set_event_handler(UCM_EVENT_VM_UNMAPPED, 0,
	                                  cons_on_unmap, c->rcache) == UCS_OK;
	if (!c->hooked)
		ecx_warn(MOD, "no unmap events: cached registrations of freed "
		              "memory are not invalidated");
#undef HAS
	*out = c;
	return 0;
fail_msg:
	ecx_why(why, whylen, rc, "out of memory");
fail:
	cons_destroy(c);
	return rc;
}

void cons_stats_get(ecx_consumer *c, ecx_consumer_stats *out)
{
	pthread_mutex_lock(&c->lock);
	*out = c->st;
	cons_mc_stats(c, out);
	pthread_mutex_unlock(&c->lock);
}

void cons_lookups_count(ecx_consumer *c, size_t n)
{
	pthread_mutex_lock(&c->lock);
	c->st.lookups += n;
	pthread_mutex_unlock(&c->lock);
}

void cons_destroy(ecx_consumer *c)
{
	/* Returns once no run of the hook is left (libucm's event lock). */
	if (c->hooked)
		ucm_unset_event_handler(UCM_EVENT_VM_UNMAPPED, cons_on_unmap,
		                        c->rcache);
	/* The receiver first: nothing lands once it is gone. */
	cons_mc_destroy(c);
	if (c->ucx != NULL) {
		/* Goodbyes first, while the progress thread still runs: the
		 * producers close their endpoints to this worker. */
		if (c->rdv != NULL)
			cons_pconns_bye(c);
		ecx_ucx_stop(c->ucx);
		pthread_mutex_lock(&c->lock);
		while (c->inflight != NULL) {
			pull *p = cons_pull_take(c, c->inflight->req);
			if (p->zombie)
				cons_zombie_end(c, p);
		}
		pthread_mutex_unlock(&c->lock);
		while (c->conns != NULL) {
			pconn *pc = c->conns;
			c->conns = pc->next;
			cons_pconn_close(c, pc);
		}
		for (unsigned i = 0; c->rcache != NULL && i < c->rcache->n; i++)
			if (c->rcache->r[i].live)
				cons_region_drop(c, &c->rcache->r[i]);
		free(c->arena.rkey);
		ecx_ucx_mem_unmap(c->ucx, c->arena.memh);
		ecx_ucx_destroy(c->ucx);
	}
	ecx_rdv_leaser_destroy(c->leaser);
	ecx_rdv_client_destroy(c->rdv);
	ecx_alloc_fini(&c->alloc);
	free(c->allocs);
	/* All that the hook read (c->rcache, its own allocation): freed after
	 * the hook's last run, which TSan cannot see. Only this free is not
	 * checked; c's own is. */
	TSAN_IGNORE_WRITES_BEGIN();
	free(c->rcache);
	TSAN_IGNORE_WRITES_END();
	ecx_regclient_destroy(c->rc);
	if (c->token != NULL)
		memset(c->token, 0, strlen(c->token));
	free(c->token);
	pthread_mutex_destroy(&c->lock);
	pthread_cond_destroy(&c->conn_cv);
	pthread_mutex_destroy(&c->reg_lock);
	free(c);
}
