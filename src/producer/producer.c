/*
 * producer.c - the producer role's lifecycle: create (arena, registry,
 * UCX, rendezvous), stats, destroy. The threads: the caller's (put,
 * remove, stats), the rendezvous thread (hellos, the reference's pull),
 * the UCX progress thread (pulls) and the publisher thread (publish.c:
 * with a remote registry, every call to it; with the embedded one, it
 * puts back entries removed by HTTP).
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD "producer"

/* ---- create, stats, destroy ---- */

int prod_create(const ecx_producer_params *pp, ecx_producer **out, char *why,
                size_t whylen)
{
	uint64_t m = pp != NULL ? pp->field_mask : 0;
#define HAS(f) ((m & ECX_PRODUCER_PARAM_##f) != 0)
	uint64_t cap =
	    HAS(CAPACITY) ? pp->capacity_bytes : ECX_CAPACITY_DEFAULT;
	const char *bind =
	    HAS(BIND_HOST) && pp->bind_host ? pp->bind_host : "0.0.0.0";
	const char *token =
	    HAS(TOKEN) && pp->token && pp->token[0] ? pp->token : NULL;
	int timeout =
	    HAS(TIMEOUT) && pp->timeout_ms > 0 ? pp->timeout_ms : 5000;
	int idle =
	    HAS(IDLE) && pp->idle_ms > 0 ? pp->idle_ms : ECX_IDLE_MS_DEFAULT;
	int reg_port =
	    HAS(REGISTRY_PORT) ? pp->registry_port : ECX_REGISTRY_PORT_DEFAULT;
	int lease_ms = HAS(LEASE_MAX_MS) && pp->lease_max_ms > 0
	                   ? pp->lease_max_ms
	                   : ECX_LEASE_MS_DEFAULT;
	int lease_pct =
	    HAS(LEASE_SHARE) ? pp->lease_share_pct : ECX_LEASE_SHARE_DEFAULT;
	const char *remote = HAS(REGISTRY) && pp->registry && pp->registry[0]
	                         ? pp->registry
	                         : NULL;
	char adv[ECX_ADDR_MAX];
	if (HAS(ADVERTISE_HOST) && pp->advertise_host && pp->advertise_host[0])
		ecx_strlcpy(adv, pp->advertise_host, sizeof(adv));
	else if (strcmp(bind, "0.0.0.0") == 0 || strcmp(bind, "::") == 0)
		ecx_default_host(adv, sizeof(adv));
	else
		ecx_strlcpy(adv, bind, sizeof(adv));
	if (cap < ECX_ALLOC_ALIGN || cap >= ECX_JSON_INT_MAX)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "capacity must be 4 KiB to 2^53 bytes");
	if (lease_pct < 0 || lease_pct > 100)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "lease share must be 0 to 100 percent, not %d",
		               lease_pct);
	if ((m & ECX_PRODUCER_PARAM_REGISTRY_TTL) &&
	    (pp->registry_ttl_s < 0 || pp->registry_ttl_s > ECX_TTL_MAX_S))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "registry TTL is 0 to %d seconds, not %d",
		               ECX_TTL_MAX_S, pp->registry_ttl_s);
	if (reg_port < -1 || reg_port > 65535)
		return ecx_why(why, whylen, ECX_EINVAL, "bad registry port %d",
		               reg_port);
	if (remote != NULL && HAS(REGISTRY_PORT) && reg_port >= 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "give a remote registry or an embedded registry "
		               "port, not both");
	if (remote == NULL && reg_port < 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "no registry: give a remote registry URL or an "
		               "embedded registry port");
#undef HAS
	ecx_producer *p = calloc(1, sizeof(*p));
	if (p != NULL)
		p->pid = (int)getpid();
	if (p == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_init(&p->lock, NULL);
	p->lane_ls = p->lane_wake[0] = p->lane_wake[1] = -1;
	pthread_mutex_init(&p->lane_mu, NULL);
	p->mooncake = !(m & ECX_PRODUCER_PARAM_MOONCAKE) || pp->mooncake;
	int rc = prod_ref_init(p, why, whylen);
	if (rc != 0)
		goto fail;
	p->epoch = ecx_random_epoch();
	ecx_shm_domain(p->domain, sizeof(p->domain));
	p->timeout_ms = timeout;
	p->idle_ms = idle;
	p->pid_start = ecx_pid_start((long)getpid());
	p->integrity = (m & ECX_PRODUCER_PARAM_INTEGRITY) && pp->integrity;
	const char *delay = getenv("ECX_TEST_PULL_DELAY_MS");
	p->test_delay_ms = delay != NULL ? (unsigned)atoi(delay) : 0;
	p->test_put_only = getenv("ECX_TEST_PUT_ONLY") != NULL;
	p->test_hash_legacy = getenv("ECX_TEST_HASH_XXH64") != NULL;
	p->rndv_lead = prod_rndv_lead();
	p->st.capacity = cap;
	p->lease_max_ms = (uint64_t)lease_ms;
	p->lease_cap = cap * (uint64_t)lease_pct / 100;
	p->lease_rng = p->epoch;
	rc = ECX_ENOMEM;
	p->nbuckets = 1024;
	p->buckets = calloc(p->nbuckets, sizeof(*p->buckets));
	if (p->buckets == NULL || !ecx_alloc_init(&p->alloc, cap))
		goto fail_msg;
	if (token != NULL) {
		p->token = strdup(token);
		if (p->token == NULL)
			goto fail_msg;
		p->token_len = strlen(token);
	}
	if (remote != NULL) {
		p->redis = ecx_store_is_redis_url(remote);
		p->ttl_s = (m & ECX_PRODUCER_PARAM_REGISTRY_TTL)
		               ? pp->registry_ttl_s
		               : 30;
		/* The publisher sleeps on its answers: its requests are off
		 * any load's path, and polling would take the core a pull's
		 * copy may need (two cores here). */
		ecx_regclient_opts ro = {.urls = remote,
		                         .token = token,
		                         .connect_timeout_ms = timeout,
		                         .timeout_ms = timeout,
		                         .ttl_s = p->ttl_s,
		                         .spin_us = ECX_REGC_SPIN_NONE};
		rc = ecx_regclient_create(&ro, &p->remote, why, whylen);
		if (rc != 0)
			goto fail;
	} else {
		ecx_registry_params rp = {.field_mask =
		                              ECX_REGISTRY_PARAM_BIND_HOST |
		                              ECX_REGISTRY_PARAM_PORT |
		                              ECX_REGISTRY_PARAM_TOKEN,
		                          .bind_host = bind,
		                          .port = (uint16_t)reg_port,
		                          .token = token};
		/* Its own entries never expire (they live in this process);
		 * the TTL is the lease of other producers' PUTs. */
		if (m & ECX_PRODUCER_PARAM_REGISTRY_TTL) {
			rp.field_mask |= ECX_REGISTRY_PARAM_ENTRY_TTL;
			rp.entry_ttl_s = pp->registry_ttl_s;
		}
		/* Unhealthy until this producer serves, or, when the caller
		 * asked, until it says its items are in. */
		p->hold_ready =
		    (m & ECX_PRODUCER_PARAM_STARTING) && pp->starting;
		rc = reg_server_create(&rp, true, &p->registry, why, whylen);
		if (rc != 0)
			goto fail;
	}
	ecx_ucx_opts uo = {.transport = (m & ECX_PRODUCER_PARAM_TRANSPORT)
	                                    ? pp->transport
	                                    : NULL,
	                   .bind_host = bind,
	                   .on_progress = prod_progress,
	                   .arg = p,
	                   .spin_ns = 200000,
	                   .nam = 1};
	uo.am[0].id = ECX_AM_PULL;
	uo.am[0].cb = prod_am_pull;
	uo.am[0].arg = p;
	rc = ecx_ucx_create(&uo, &p->ucx, why, whylen);
	if (rc != 0)
		goto fail;
	rc = ecx_ucx_mem_alloc(p->ucx, cap, &p->base, &p->memh, why, whylen);
	if (rc != 0)
		goto fail;
	p->st.registrations = 1;
	/* Before the rendezvous socket: its hellos offer the lane. */
	if ((ecx_ucx_transports(p->ucx) & ECX_TR_TCP) &&
	    (rc = prod_lanes_start(p, bind, why, whylen)) != 0)
		goto fail;
	ecx_rdv_server_opts zo = {
	    .bind = bind,
	    .advertise = adv,
	    .port = (m & ECX_PRODUCER_PARAM_ZMQ_PORT) ? pp->zmq_port : 0,
	    .handle = prod_rdv_handle,
	    .tick = NULL,
	    .arg = p};
	rc = ecx_rdv_server_create(&zo, &p->rdv, why, whylen);
	if (rc != 0)
		goto fail;
	ecx_strlcpy(p->address, ecx_rdv_server_address(p->rdv),
	            sizeof(p->address));
	prod_ref_named(p);
	rc = prod_publisher_start(p, why, whylen);
	if (rc != 0)
		goto fail;
	if (p->registry != NULL) {
		ecx_registry_set_metrics(p->registry, prod_metrics, p);
		ecx_registry_set_leaser(p->registry, prod_lease_lookup, p);
	}
	if (p->registry != NULL && !p->hold_ready)
		ecx_registry_set_starting(p->registry, false);
	ecx_info(MOD, "serving at %s, arena %llu bytes, registry %s",
	         p->address, (unsigned long long)cap,
	         remote != NULL ? remote : "embedded");
	*out = p;
	return 0;
fail_msg:
	ecx_why(why, whylen, rc, "out of memory");
fail:
	prod_destroy(p);
	return rc;
}

void prod_set_ready(ecx_producer *p)
{
	if (p->registry != NULL)
		ecx_registry_set_starting(p->registry, false);
}

uint16_t prod_registry_port(const ecx_producer *p)
{
	return p->registry != NULL ? reg_server_port(p->registry) : 0;
}

void prod_stats_get(ecx_producer *p, ecx_producer_stats *out)
{
	pthread_mutex_lock(&p->lock);
	prod_leases_expire(p);
	*out = p->st;
	out->items = p->nitems;
	out->bytes_used = p->alloc.used;
	out->connections = p->nconns;
	pthread_mutex_unlock(&p->lock);
}

size_t prod_metrics(void *arg, char *buf, size_t len)
{
	ecx_producer_stats s;
	prod_stats_get(arg, &s);
	int n = snprintf(
	    buf, len,
	    "# HELP ecx_producer_connections Consumer connections open.\n"
	    "# TYPE ecx_producer_connections gauge\n"
	    "ecx_producer_connections %llu\n"
	    "# HELP ecx_producer_items Items held in the arena.\n"
	    "# TYPE ecx_producer_items gauge\n"
	    "ecx_producer_items %llu\n"
	    "# HELP ecx_producer_bytes Arena bytes taken by items.\n"
	    "# TYPE ecx_producer_bytes gauge\n"
	    "ecx_producer_bytes %llu\n"
	    "# HELP ecx_producer_pinned_bytes Arena bytes pinned by leases.\n"
	    "# TYPE ecx_producer_pinned_bytes gauge\n"
	    "ecx_producer_pinned_bytes %llu\n"
	    "# HELP ecx_producer_pinned_items Items a pull is reading now.\n"
	    "# TYPE ecx_producer_pinned_items gauge\n"
	    "ecx_producer_pinned_items %llu\n"
	    "# HELP ecx_producer_leases Leases held now.\n"
	    "# TYPE ecx_producer_leases gauge\n"
	    "ecx_producer_leases %llu\n"
	    "# HELP ecx_producer_leases_total Leases by how they ended (or "
	    "were refused).\n"
	    "# TYPE ecx_producer_leases_total counter\n"
	    "ecx_producer_leases_total{result=\"granted\"} %llu\n"
	    "ecx_producer_leases_total{result=\"refused\"} %llu\n"
	    "ecx_producer_leases_total{result=\"used\"} %llu\n"
	    "ecx_producer_leases_total{result=\"released\"} %llu\n"
	    "ecx_producer_leases_total{result=\"expired\"} %llu\n",
	    (unsigned long long)s.connections, (unsigned long long)s.items,
	    (unsigned long long)s.bytes_used,
	    (unsigned long long)s.leased_bytes, (unsigned long long)s.pinned,
	    (unsigned long long)s.leases, (unsigned long long)s.leases_granted,
	    (unsigned long long)s.leases_refused,
	    (unsigned long long)s.leases_used,
	    (unsigned long long)s.leases_released,
	    (unsigned long long)s.leases_expired);
	if (n < 0)
		return 0;
	ecx_producer *p = arg;
	int m = snprintf(
	    (size_t)n < len ? buf + n : buf,
	    (size_t)n < len ? len - (size_t)n : 0,
	    "# HELP ecx_producer_lanes_total Data lanes consumers opened, "
	    "taken or refused (a wrong key, no such connection).\n"
	    "# TYPE ecx_producer_lanes_total counter\n"
	    "ecx_producer_lanes_total{result=\"taken\"} %llu\n"
	    "ecx_producer_lanes_total{result=\"refused\"} %llu\n",
	    (unsigned long long)__atomic_load_n(&p->lanes_taken,
	                                        __ATOMIC_RELAXED),
	    (unsigned long long)__atomic_load_n(&p->lanes_refused,
	                                        __ATOMIC_RELAXED));
	if (m < 0)
		return 0;
	n += m;
	return (size_t)n +
	       prod_ref_metrics(arg, (size_t)n < len ? buf + n : buf,
	                        (size_t)n < len ? len - (size_t)n : 0);
}

void prod_destroy(ecx_producer *p)
{
	pthread_mutex_lock(&p->lock);
	p->closing = true;
	pthread_mutex_unlock(&p->lock);
	/* Reference pulls in flight end now and are answered, while the
	 * rendezvous server can still send the answers. */
	prod_ref_stop(p);
	ecx_rdv_server_destroy(p->rdv);
	p->rdv = NULL;
	/* After the hellos (which offer the lane's port) have stopped. */
	prod_lanes_stop(p);
	/* Unpublish everything this producer published; with the embedded
	 * registry, once its publisher (which puts entries back) stopped. */
	if (p->registry != NULL) {
		prod_publisher_stop(p);
		for (size_t b = 0; p->buckets != NULL && b < p->nbuckets; b++)
			for (item *it = p->buckets[b]; it != NULL;
			     it = it->hnext)
				if (it->ready)
					prod_unpublish(p, it->id);
	}
	prod_publisher_stop(p);
	if (p->ucx != NULL) {
		prod_serve_shutdown(p);
		ecx_ucx_mem_unmap(p->ucx, p->memh);
		ecx_ucx_destroy(p->ucx);
	}
	prod_leases_clear(p);
	for (size_t b = 0; p->buckets != NULL && b < p->nbuckets; b++) {
		item *it = p->buckets[b];
		while (it != NULL) {
			item *next = it->hnext;
			free(it);
			it = next;
		}
	}
	free(p->buckets);
	ecx_alloc_fini(&p->alloc);
	reg_server_destroy(p->registry);
	ecx_regclient_destroy(p->remote);
	if (p->token != NULL)
		memset(p->token, 0, p->token_len);
	free(p->token);
	pthread_mutex_destroy(&p->lock);
	pthread_mutex_destroy(&p->lane_mu);
	free(p);
}
