/*
 * server.h - the registry layer: the HTTP server (libmicrohttpd) and its
 * router, serving a store from dir/ (memory or Redis). The public calls
 * (ecx_registry_create, ...) are in ecx.h; this adds what the embedding
 * producer and the router's fuzzer need.
 *
 * May include: core/, wire/, dir/. Never: UCX, ZeroMQ, or a role.
 */
#ifndef ECX_REGISTRY_H
#define ECX_REGISTRY_H

#include "dir/dir.h"

#define ECX_REG_MAX_BODY                                               \
	(1u << 20)            /* largest request body the server takes \
	                       */
#define ECX_REG_MAX_PAGE 1000 /* rows in one GET /ec/list page */

/* The store behind a running server; the embedding producer publishes into
 * it directly (no HTTP), and its counters count those too. */
ecx_store *ecx_registry_store(ecx_registry *r);
void ecx_registry_count_publish(ecx_registry *r, bool removal);
/* How many PUTs and DELETEs came by HTTP so far: while it stays the same,
 * the embedding producer's entries are as it wrote them. */
uint64_t ecx_registry_http_writes(ecx_registry *r);

/* The engines of ecx_registry_create, _port and _destroy (api/registry.c;
 * ecx.h has their contracts). With starting (an embedding producer's
 * registry), it listens, but its /healthz answers 503 {"ok": false,
 * "starting": true, ...} until ecx_registry_set_starting(r, false). */
int reg_server_create(const ecx_registry_params *p, bool starting,
                      ecx_registry **out, char *why, size_t whylen);
uint16_t reg_server_port(const ecx_registry *r);
void reg_server_destroy(ecx_registry *r);
void ecx_registry_set_starting(ecx_registry *r, bool starting);

/* Lines the embedding producer adds to /metrics: fn writes them into buf
 * (at most len bytes) and returns what snprintf would. It runs on the
 * server's threads, until its destroy. Set before serving
 * matters; NULL removes it. */
typedef size_t (*ecx_registry_metrics_fn)(void *arg, char *buf, size_t len);
void ecx_registry_set_metrics(ecx_registry *r, ecx_registry_metrics_fn fn,
                              void *arg);

/* A lookup that asks for leases ("ecx_lease_ms" in POST /ec/lookup's body,
 * or the query of GET /ec/info/{id}) is answered with the embedding
 * producer's leases: after the store found items[0..n), fn leases for ms
 * those of them its producer holds (setting entry.lease) and makes a miss
 * (found false) each of them whose lease it refuses; the others it leaves
 * as they are (the client leases those at their producers). It runs on
 * the server's threads, until its destroy, only for callers
 * with the registry's token where it has one. Set before serving. */
typedef void (*ecx_registry_lease_fn)(void *arg, ecx_lookup_item *items,
                                      size_t n, uint64_t ms);
void ecx_registry_set_leaser(ecx_registry *r, ecx_registry_lease_fn fn,
                             void *arg);

/* One HTTP request as the router sees it, apart from libmicrohttpd (so
 * the fuzzer drives the router directly). */
typedef struct ecx_reg_http {
	const char *method, *url;
	const char *arg_after, *arg_limit, *arg_producer; /* query, or NULL */
	const char *arg_lease_ms;                         /* query, or NULL */
	const char *authorization;                        /* header, or NULL */
	const char *body;
	size_t len;
	bool too_big; /* the body was over ECX_REG_MAX_BODY and dropped */
} ecx_reg_http;

typedef struct ecx_reg_answer {
	unsigned status;
	char *body; /* malloc'd, NUL-terminated */
	const char *ctype;
} ecx_reg_answer;

/* Answers one request; never fails (out of memory is a 500 answer). */
void ecx_registry_route(ecx_registry *r, const ecx_reg_http *q,
                        ecx_reg_answer *a);

/* A registry with its store and counters but no listener, for the router's
 * fuzzer. Destroy with reg_server_destroy. */
int ecx_registry_create_detached(const char *token, ecx_registry **out);

#endif /* ECX_REGISTRY_H */
