/*
 * rdv.h - the rendezvous layer: the ZeroMQ socket at producer_zmq where a
 * consumer and a producer first meet (ecx's hello exchanges UCX worker
 * addresses; the reference's {"op":"pull",...} is answered there too).
 *
 * The server is a ROUTER socket (REQ peers see a REP) with a thread of its
 * own that decodes each request (wire/) and hands it to the role's
 * handler, which answers at once or later (ecx_rdv_defer); the client is
 * one bounded REQ round trip. May include: core/, wire/. Never: UCX, a
 * registry, or a role's state (the role answers through its handler).
 */
#ifndef ECX_RDV_H
#define ECX_RDV_H

#include "wire/wire.h"

/* Answers one decoded request with a malloc'd reply (ecx_zresp_encode_*),
 * or NULL when out of memory. Runs on the server's thread. A handler that
 * cannot answer at once takes the request's ticket (ecx_rdv_defer), returns
 * ECX_RDV_LATER, and answers it later with ecx_rdv_answer. */
typedef char *(*ecx_rdv_fn)(void *arg, const ecx_zreq *r);

/* A request whose answer is given later, from any thread. */
typedef struct ecx_rdv_ticket ecx_rdv_ticket;

extern char ecx_rdv_later[];
#define ECX_RDV_LATER (ecx_rdv_later)

/* ecx_rdv_defer, called by a handler (on the server's thread), takes the
 * ticket of the request it handles; NULL elsewhere. The server then sends
 * nothing for it until ecx_rdv_answer. */
ecx_rdv_ticket *ecx_rdv_defer(void);

/* ecx_rdv_answer sends reply (malloc'd, taken over; NULL: out of memory)
 * as the answer to t, from any thread, and frees t. Does not block. Every
 * ticket must be answered before its server is destroyed; answers that
 * reach a server after its thread stopped are dropped. */
void ecx_rdv_answer(ecx_rdv_ticket *t, char *reply);

typedef struct ecx_rdv_server_opts {
	const char *bind;      /* host or address to bind */
	const char *advertise; /* host named in the address peers are given */
	uint16_t port;         /* 0: a free port */
	ecx_rdv_fn handle;
	void (*tick)(void *arg); /* called about every 100 ms; may be NULL */
	void *arg;
} ecx_rdv_server_opts;

typedef struct ecx_rdv_server ecx_rdv_server;

/* Binds and starts the server's thread. ECX_EADDRINUSE when the port is
 * taken, ECX_EINVAL for an address ZeroMQ cannot bind, with why. */
int ecx_rdv_server_create(const ecx_rdv_server_opts *o, ecx_rdv_server **out,
                          char *why, size_t whylen);
/* "tcp://ADVERTISE:PORT", the address peers connect to. */
const char *ecx_rdv_server_address(const ecx_rdv_server *s);
/* Stops the thread (within about 100 ms) and closes the socket. Accepts
 * NULL. */
void ecx_rdv_server_destroy(ecx_rdv_server *s);

/* A client's ZeroMQ context, shared by its round trips. */
typedef struct ecx_rdv_client ecx_rdv_client;

int ecx_rdv_client_create(ecx_rdv_client **out, char *why, size_t whylen);
void ecx_rdv_client_destroy(ecx_rdv_client *c);
/* The client's ZeroMQ context, for other REQ sockets of its owner (the
 * consumer's reference pulls): valid until destroy, which closes it (its
 * owner closes those sockets first). */
void *ecx_rdv_client_zctx(ecx_rdv_client *c);
/* What every hello of this client offers: the transports it allows
 * (ECX_TR_*) and its shared-memory domain (ecx_shm_domain). Set once,
 * before the first hello. */
void ecx_rdv_client_offer(ecx_rdv_client *c, unsigned transports,
                          const char *domain);

/* One round trip of ecx_rdv_call_many. */
typedef struct ecx_rdv_call {
	const char *address; /* the producer's "tcp://HOST:PORT" */
	const char *req;     /* the request (ecx_zreq_encode_*) */
	int err;             /* out: 0, or why the call failed */
	ecx_zresp resp;      /* out when err is 0: free with ecx_zresp_free */
	char why[400];       /* out when err is not 0 */
	/* Called (when not NULL) in the calling thread as soon as this call
	 * ends, answered or not, so an answer is used before the slowest
	 * peer's. It owns k->resp then (when k->err is 0). */
	void (*done)(void *arg, struct ecx_rdv_call *k);
	void *arg;
} ecx_rdv_call;

/* Sends every call's request at once, each on a socket of its own, and
 * waits for all the answers until deadline_ns (monotonic clock): the time
 * is the slowest peer's, not the sum, with any number of dead or stalled
 * peers. A call with no answer by then fails with ECX_ETIMEDOUT; an
 * answer {"ok":false} fails with the producer's error and its detail.
 * Blocks on the network only; takes no lock. Safe from several threads at
 * once. */
void ecx_rdv_call_many(ecx_rdv_client *c, ecx_rdv_call *calls, size_t n,
                       uint64_t deadline_ns);

/* The hello's request: this worker's address, the token, and the client's
 * offer (transports, domain). Malloc'd; NULL when out of memory. */
char *ecx_rdv_hello_encode(ecx_rdv_client *c, const void *worker,
                           size_t worker_len, const char *token);

/* The hello: sends this worker's address (and token) to the producer at
 * address, and returns its answer in *out (free with ecx_zresp_free).
 * Blocks up to timeout_ms. A refusal is returned as the producer's error
 * with its detail in why. Safe from several threads at once. */
int ecx_rdv_hello(ecx_rdv_client *c, const char *address, const void *worker,
                  size_t worker_len, const char *token, int timeout_ms,
                  ecx_zresp *out, char *why, size_t whylen);

/* Leases (lease.c): a lookup's leases and their release, over a
 * persistent REQ socket per producer address, one round trip per producer
 * for up to ECX_LEASE_MAX_IDS ids, producers in parallel. One lock per
 * leaser serialises its calls (it is held across their round trips, and
 * guards nothing else). */
typedef struct ecx_rdv_leaser ecx_rdv_leaser;

/* NULL when out of memory. Its ZeroMQ context is made at the first call. */
ecx_rdv_leaser *ecx_rdv_leaser_create(void);
/* Closes its sockets. Accepts NULL. */
void ecx_rdv_leaser_destroy(ecx_rdv_leaser *l);

/* Asks each item's producer (items with status 0 and lease 0: one that
 * holds a lease already, taken by its registry's lookup, is left as it
 * is) for a lease of lease_ms on it. Sets lease (and epoch, to the
 * answering producer's) where granted; where not (refused, gone, no answer
 * by timeout_ms from the call), sets status to ECX_ENOTFOUND. Counts into
 * *refused those it turned into misses. Never fails as a whole. */
void ecx_rdv_lease(ecx_rdv_leaser *l, ecx_item *items, size_t n,
                   uint64_t lease_ms, const char *token, int timeout_ms,
                   uint64_t *refused);
/* Ends the leases of the items (lease not 0) and zeroes them. Returns 0,
 * or the error of the first producer that could not be told, with why. */
int ecx_rdv_release(ecx_rdv_leaser *l, ecx_item *items, size_t n,
                    const char *token, int timeout_ms, char *why,
                    size_t whylen);

#endif /* ECX_RDV_H */
