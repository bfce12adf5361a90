/* registry_priv.h - what routes.c and server.c share inside src/registry:
 * the registry's structure, the bounds of its request-latency histogram,
 * and the counters' increment. Nothing outside src/registry includes it. */
#ifndef ECX_REGISTRY_PRIV_H
#define ECX_REGISTRY_PRIV_H

#include "registry/server.h"

#include <stdbool.h>
#include <stdint.h>

/* Request latency histogram bounds, in microseconds. */
static const uint64_t lat_bounds_us[] = {50,   100,  250,   500,  1000,
                                         2500, 5000, 10000, 50000};
#define NLAT (sizeof(lat_bounds_us) / sizeof(lat_bounds_us[0]))

struct ecx_registry {
	int pid; /* the creating process: destroy from another leaks */
	struct MHD_Daemon *mhd;
	ecx_store *store;
	uint16_t port;
	char *token;
	size_t token_len;
	bool token_reads;
	bool redis; /* the store is Redis: /healthz asks it */
	uint64_t
	    epoch; /* changes each start: producers republish on a change */
	int entry_ttl_s; /* the lease of entries PUT without one (0: none) */
	/* Its producer is still putting what it serves: /healthz says so
	 * (503). Atomic; set before it listens. */
	bool starting;
	/* counters, updated with relaxed atomics */
	uint64_t lookups, hits, misses, publishes, removals, requests;
	/* PUTs and DELETEs that came by HTTP (not the embedding producer's) */
	uint64_t http_writes;
	uint64_t lat_count, lat_sum_us, lat_buckets[NLAT + 1];
	/* the embedding producer's lines; set once, before they are read */
	ecx_registry_metrics_fn metrics_fn;
	void *metrics_arg;
	/* the embedding producer's leases in lookups; set once, before
	 * serving */
	ecx_registry_lease_fn lease_fn;
	void *lease_arg;
};

static inline void count(uint64_t *c, uint64_t n)
{
	__atomic_add_fetch(c, n, __ATOMIC_RELAXED);
}

#endif /* ECX_REGISTRY_PRIV_H */
