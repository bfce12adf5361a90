/*
 * ucx.h - the data plane: one UCX context and worker (and, for peers whose
 * endpoints must go when they leave, a side worker each), progressed by a
 * thread of its own that sleeps on the workers' event descriptors when idle.
 *
 * The worker is created in UCX's multi-thread mode, so any thread may post
 * operations on it; a thread that waits for an operation progresses the
 * worker itself for a short while (lower latency than a wake-up), then lets
 * the progress thread carry on. ecx's UCX defaults (fast TCP segment sizes,
 * transports, the network device of the bind address) are applied only
 * where the user's UCX_* environment says nothing.
 *
 * May include: core/, wire/ (the active-message header). Never: ZeroMQ, a
 * registry, or a role's state (roles pass callbacks).
 */
#ifndef ECX_XFER_UCX_H
#define ECX_XFER_UCX_H

#include "wire/wire.h"

#include <ucp/api/ucp.h>

typedef struct ecx_ucx ecx_ucx;

typedef struct ecx_ucx_opts {
	/* "auto" (UCX picks: shared memory on one host, else TCP or RDMA),
	 * "tcp", or "shm". NULL is "auto". */
	const char *transport;
	/* An address of this host; TCP is restricted to its interface. NULL,
	 * "", "0.0.0.0" or "::" leave UCX's choice. */
	const char *bind_host;
	/* Called by the progress thread after each round of progress (the
	 * producer serves queued pulls there). May be NULL. */
	void (*on_progress)(void *arg);
	void *arg;
	/* How long the progress thread keeps polling after activity before it
	 * sleeps on the event descriptor. The producer's serves batches of
	 * pulls without wake-ups; the consumer's is 0, since a waiting caller
	 * polls the worker itself and two pollers on two cores starve TCP. */
	unsigned spin_ns;
	/* How long the progress thread stays asleep after the last caller
	 * that progressed the worker itself is done (ecx_ucx_waiting),
	 * unless ecx_ucx_wake wakes it: a caller that waits on load after
	 * load then has the worker to itself, without a wake-up of the
	 * thread per load. 0: it takes the worker back at once. */
	unsigned linger_ns;
	/* Active-message handlers to set before the thread starts. */
	struct {
		unsigned id;
		ucp_am_recv_callback_t cb;
		void *arg;
	} am[4];
	unsigned nam;
} ecx_ucx_opts;

int ecx_ucx_create(const ecx_ucx_opts *o, ecx_ucx **out, char *why,
                   size_t whylen);
/* Stops the progress thread (idempotent); the worker stays usable by the
 * caller's own waits. */
void ecx_ucx_stop(ecx_ucx *u);
/* Stops the progress thread, then destroys the worker and the context. The
 * caller has closed its endpoints and unmapped its memory first. */
void ecx_ucx_destroy(ecx_ucx *u);

ucp_context_h ecx_ucx_context(ecx_ucx *u);
ucp_worker_h ecx_ucx_worker(ecx_ucx *u);
/* The largest active-message header worker w takes (UCX's
 * max_am_header); 0 when UCX does not say. */
size_t ecx_ucx_max_am_header(ucp_worker_h w);
/* One progress of the worker and of every side (below); the number of
 * events. For a caller that waits on a load itself (ecx_ucx_waiting). */
unsigned ecx_ucx_progress(ecx_ucx *u);
/* Wakes the progress thread (after queueing work for on_progress, or an
 * operation that needs progress when no caller may wait for it). */
void ecx_ucx_wake(ecx_ucx *u);

/* A caller starts (on) or stops (off) progressing the worker itself while
 * it waits; meanwhile, and for linger_ns after, the progress thread
 * stands aside. */
void ecx_ucx_waiting(ecx_ucx *u, bool on);

/* The worker's packed address (valid until destroy). */
void ecx_ucx_address(ecx_ucx *u, const void **addr, size_t *len);

/* UCX's allocation methods for arenas where the user's UCX_ALLOC_PRIO
 * says nothing: UCX's default without the posix allocator (ucx.c says
 * why). */
#define ECX_UCX_ALLOC_PRIO "md:sysv,huge,thp,mmap,heap"

/* Maps len bytes of memory that UCX allocates (shared-memory transports
 * then move data at memcpy speed), and touches every page now so no page
 * fault lands on a transfer. Refused first, with ECX_ENOMEM and a detail
 * naming len and what is available, when len is more than this host's
 * available memory (MemAvailable) or, where the user's UCX_ALLOC_PRIO
 * lets UCX's posix allocator in, the free space of its directory. */
int ecx_ucx_mem_alloc(ecx_ucx *u, size_t len, void **addr, ucp_mem_h *memh,
                      char *why, size_t whylen);
/* Registers memory the caller owns. */
int ecx_ucx_mem_reg(ecx_ucx *u, void *addr, size_t len, ucp_mem_h *memh,
                    char *why, size_t whylen);
void ecx_ucx_mem_unmap(ecx_ucx *u, ucp_mem_h memh);
/* Packs memh's remote key into a malloc'd buffer. */
int ecx_ucx_rkey_pack(ecx_ucx *u, ucp_mem_h memh, void **buf, size_t *len);

/* The transports this context may use (ECX_TR_SHM, ECX_TR_TCP), from its
 * "transport" option: what a hello offers or accepts. */
unsigned ecx_ucx_transports(const ecx_ucx *u);

/* Creates an endpoint to a peer worker's address, for the transport the
 * hello agreed on (ECX_TR_SHM or ECX_TR_TCP); both ends of a connection
 * must make theirs for the same one, or UCX refuses the pair ("error
 * handling level mismatch"). Over TCP the endpoint asks for peer-failure
 * handling, which also keeps UCX off shared memory, and on_error runs in a
 * progress context when the peer fails; UCX's shared-memory transports
 * cannot report that, so over shm the consumer watches the producer's
 * process instead (consumer/failures.c). */
int ecx_ucx_ep_create(ecx_ucx *u, const void *addr, size_t len,
                      unsigned transport, ucp_err_handler_cb_t on_error,
                      void *arg, ucp_ep_h *ep, char *why, size_t whylen);
/* Closes an endpoint made for transport, bounded by timeout_ms: forced (no
 * flush) over TCP, where the endpoint has peer error handling, in flush
 * mode otherwise, as UCX requires. Used on failed peers and at shutdown. */
void ecx_ucx_ep_close(ecx_ucx *u, ucp_ep_h ep, unsigned transport,
                      int timeout_ms);

/* A side: a second worker on the context, for one peer. Its endpoints go
 * with it when it is destroyed, which is the only way UCX (1.13) lets go of
 * an endpoint the peer has wired up to over shared memory: ucp_ep_close_nbx
 * in flush mode keeps such an endpoint ("destroyed only when the worker is
 * destroyed", ucp_ep_disconnected), with its transport endpoints attached
 * to the peer's FIFO and receive segments, and a forced close is refused
 * (UCS_ERR_INVALID_PARAM) without peer error handling, which shared memory
 * lacks. Any active message longer than UCX's short limit makes both ends
 * exchange wireup messages, so every ecx connection is such a pair.
 *
 * ecx_ucx_side_create makes one (a worker with the same active-message
 * handlers, progressed and polled by the progress thread) and may be called
 * from any thread; ecx_ucx_side_destroy destroys it with its endpoints,
 * from any thread but the one thread that owns the side (nothing else may
 * use it or its endpoints then: it is unlinked under the lock the progress
 * thread and ecx_ucx_progress hold while they progress sides), after the
 * caller has destroyed the remote keys it unpacked on them. The producer
 * makes one per consumer connection (over TCP, destroying it is how the
 * connection closes: see producer/conns.c prod_conn_goes_with_side), the
 * consumer one per producer connection where shared memory may be used:
 * each end then lets go of the other's segments when the connection goes.
 * Each side holds
 * its own shared-memory FIFOs and receive buffers while it lives (measured:
 * 4 MiB resident, 2 MiB each for sysv and posix). */
typedef struct ecx_ucx_side ecx_ucx_side;
/* At most this many sides at once; past it ecx_ucx_side_create fails
 * (ECX_EBUSY) and the caller uses the main worker, as before sides. */
#define ECX_UCX_SIDES_MAX 128
int ecx_ucx_side_create(ecx_ucx *u, ecx_ucx_side **out, char *why,
                        size_t whylen);
/* The side's worker (for ucp_am_recv_data_nbx on a message it got). */
ucp_worker_h ecx_ucx_side_worker(const ecx_ucx_side *s);
/* The side's packed worker address (valid until its destroy). */
void ecx_ucx_side_address(const ecx_ucx_side *s, const void **addr,
                          size_t *len);
void ecx_ucx_side_destroy(ecx_ucx *u, ecx_ucx_side *s);
/* ecx_ucx_ep_create and ecx_ucx_ep_close on side's worker (u's when side
 * is NULL). */
int ecx_ucx_side_ep_create(ecx_ucx *u, ecx_ucx_side *side, const void *addr,
                           size_t len, unsigned transport,
                           ucp_err_handler_cb_t on_error, void *arg,
                           ucp_ep_h *ep, char *why, size_t whylen);
void ecx_ucx_side_ep_close(ecx_ucx *u, ecx_ucx_side *side, ucp_ep_h ep,
                           unsigned transport, int timeout_ms);
/* Progresses side's worker alone until it has had nothing to do for
 * ECX_SIDE_QUIET_NS, at most ECX_SIDE_DRAIN_NS: what its endpoints still
 * had to send meanwhile goes out. For a side about to be destroyed with no
 * progress after its endpoint's close (ecx_ucx_side_destroy_forced): UCX
 * 1.13 asserts (ucp_request_send_state_ff, "got REP message") when a
 * worker is destroyed while a wireup reply waits on a TCP endpoint still
 * connecting (fixed in UCX 1.14 by openucx/ucx#8175; Debian 12 has 1.13.1).
 * Called from the one thread that progresses side. */
#define ECX_SIDE_QUIET_NS 1000000u
#define ECX_SIDE_DRAIN_NS 5000000u
void ecx_ucx_side_drain(ecx_ucx_side *side);
/* Closes ep (a TCP endpoint of side's worker, or NULL) forced, which
 * fails its requests in flight, and destroys side at once, with no
 * progress in between: UCX 1.13 crashes when a TCP endpoint closed forced
 * with a zero-copy send in flight is progressed later (a NULL call in
 * uct_tcp_iface_progress once the socket turns writable), and asserts
 * (ucp_ep_destroy_base, proto_reqs) when a worker is destroyed under an
 * endpoint whose requests are still in flight. Called from the one thread
 * that progresses side. */
void ecx_ucx_side_destroy_forced(ecx_ucx *u, ecx_ucx_side *side, ucp_ep_h ep);

/* Waits for req (a status pointer from a *_nbx call) until deadline_ns on
 * the monotonic clock, progressing the worker. Returns 0, ECX_ETIMEDOUT
 * (the request is then cancelled and freed) or ECX_EIO. */
int ecx_ucx_wait(ecx_ucx *u, ucs_status_ptr_t req, uint64_t deadline_ns);

/* Sends active message id on ep with header {conn, req} and body, a
 * malloc'd NUL-terminated string that the send owns from here on (freed
 * when UCX is done with it, or now on failure). Sent eagerly. Returns 0
 * when the send completed or was posted, else the ecx error; *pending
 * (may be NULL) says whether it was posted and still needs progress. */
int ecx_ucx_am_send(ucp_ep_h ep, unsigned id, uint64_t conn, uint64_t req,
                    char *body, bool *pending);

/* Maps a UCX status to an ecx error. */
int ecx_ucx_err(ucs_status_t st);

#endif /* ECX_XFER_UCX_H */
