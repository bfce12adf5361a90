/*
 * dir.h - the directory layer: where registry entries live and how a
 * process reaches them. Owns the stores (store.h: memory, Redis) and the
 * registry client (client.c: a list of registries, each reached over HTTP
 * with libcurl or, for redis://, through the Redis store directly), with
 * per-registry back-off.
 *
 * May include: core/, wire/. Never: ZeroMQ (rdv/), UCX or any role; the
 * registry server (registry/), the roles and the public client
 * (api/client.c, which adds rdv/'s leases) sit above and use this.
 */
#ifndef ECX_DIR_H
#define ECX_DIR_H

#include "dir/store.h"

typedef struct ecx_regclient ecx_regclient;

typedef struct ecx_regclient_opts {
	const char *urls;  /* one or more, comma-separated: http://host:port,
	                      or redis://[:password@]host:port[/db] (used
	                      directly, no HTTP) */
	const char *token; /* sent as Authorization: Bearer, NULL for none */
	int connect_timeout_ms; /* default 1000 */
	int timeout_ms;         /* whole request, default 5000 */
	int ttl_s;              /* entries put into Redis expire after it (0:
	                           never); see ecx_regclient_refresh */
	int spin_us; /* how long a request polls for its answer before
	                sleeping: 0 for ECX_REGC_SPIN_US, ECX_REGC_SPIN_NONE
	                for never */
} ecx_regclient_opts;

/* The default poll before sleeping on an answer. Waking a sleeping thread
 * costs 50-150 us on this project's virtual machines (an idle vCPU halts,
 * and the wake-up is an interrupt through the hypervisor), more than a
 * registry takes to answer; docs/architecture.md has the figures. */
#define ECX_REGC_SPIN_US 200
#define ECX_REGC_SPIN_NONE (-1)
/* The most a caller may ask (ECX_CLIENT_PARAM_SPIN): 100 ms. */
#define ECX_REGC_SPIN_MAX 100000

/* Creates a client. Nothing is connected until the first request; each
 * registry then keeps one persistent connection. ECX_EINVAL for a URL that
 * is not http://. Not thread-safe per call: one thread uses a client at a
 * time (the consumer serialises), but distinct clients are independent. */
int ecx_regclient_create(const ecx_regclient_opts *o, ecx_regclient **out,
                         char *why, size_t whylen);
void ecx_regclient_destroy(ecx_regclient *c);

/* Looks n ids up: one GET /ec/info for one id, one POST /ec/lookup for
 * more, per registry; ids missing from the first registry are asked of the
 * next. A registry that fails is skipped for a back-off period (starting at
 * 500 ms, doubling to 10 s) instead of costing its timeout on every call;
 * while every registry of the list is backing off, the soonest due is asked
 * anyway, at most once a second, so a directory that comes back is seen
 * within a second.
 * Returns 0 when every registry that was asked answered (items[].found says
 * which ids were found); otherwise the last registry's error, with the
 * items found elsewhere still filled in. items[].alt (the other holders,
 * from the batched route) is set, not freed: free it with
 * ecx_lookup_items_clear. */
int ecx_regclient_lookup(ecx_regclient *c, ecx_lookup_item *items, size_t n,
                         char *why, size_t whylen);

/* The same, with every holder of each id (items[].alt): always the
 * batched route, even for one id (GET /ec/info answers one holder). */
int ecx_regclient_lookup_holders(ecx_regclient *c, ecx_lookup_item *items,
                                 size_t n, char *why, size_t whylen);

/* ecx_regclient_lookup that also asks for leases of lease_ms: a producer's
 * embedded registry leases the items of that producer it finds
 * (items[].entry.lease, not 0) and answers a miss for each it cannot
 * lease; other registries (standalone, Redis, the reference's) lease
 * nothing, which leaves entry.lease 0. */
int ecx_regclient_lookup_lease(ecx_regclient *c, ecx_lookup_item *items,
                               size_t n, uint64_t lease_ms, char *why,
                               size_t whylen);

/* PUT and DELETE against the first registry in the list (a producer
 * publishes to one). producer_zmq, when not NULL, makes the delete conditional
 * on the entry being that producer's. */
int ecx_regclient_put(ecx_regclient *c, const char *id, const ecx_entry *e,
                      char *why, size_t whylen);
int ecx_regclient_delete(ecx_regclient *c, const char *id,
                         const char *producer_zmq, char *why, size_t whylen);

/* Keeps a producer's n entries in the first registry: with Redis, writes
 * them again in one round trip (renewing their TTL, restoring what a
 * restarted Redis lost); with HTTP, asks /healthz for the registry's epoch
 * and, when it changed (the registry restarted) or the registry was
 * unreachable at the last call, publishes them all again. *republished is
 * set to how many were written. */
int ecx_regclient_sync(ecx_regclient *c, const char *const *ids,
                       const ecx_entry *entries, size_t n, size_t *republished,
                       char *why, size_t whylen);

/* GET path (e.g. "/ec/list?limit=10") on the first registry; the body is
 * returned malloc'd in *body with its HTTP status. */
int ecx_regclient_get_raw(ecx_regclient *c, const char *path, long *status,
                          char **body, size_t *len, char *why, size_t whylen);

/* Lists a page of the first registry: up to limit (1 to ECX_LIST_MAX) rows
 * whose ids sort after `after` ("" for the first page), in id order, into
 * rows (room for limit). Sets *nrows, next to the id to continue after (""
 * when no entry follows the page) and *total to the registry's size. Over
 * HTTP, one GET /ec/list; on Redis, the store's SCAN-based listing. Blocks
 * for one request. */
#define ECX_LIST_MAX 1000
int ecx_regclient_list(ecx_regclient *c, const char *after, size_t limit,
                       ecx_store_row *rows, size_t *nrows, char *next,
                       size_t nextlen, uint64_t *total, char *why,
                       size_t whylen);

/* Asks the first registry whether it serves: GET /healthz over HTTP (sets
 * *epoch to the registry's epoch), PING on Redis (*epoch = 0). Blocks for
 * one request. */
int ecx_regclient_health(ecx_regclient *c, uint64_t *epoch, char *why,
                         size_t whylen);

/* Connections opened so far, over all registries (tests prove reuse). */
long ecx_regclient_connects(const ecx_regclient *c);

#endif /* ECX_DIR_H */
