/*
 * receiver.h - a consumer's end of Mooncake TransferEngine's TCP wire: a
 * handshake server that answers the segment's metadata (its data port and
 * the memory it advertises), and a data port that takes WRITEs into that
 * memory (frame.h has the bytes).
 *
 * Stricter than Mooncake, which takes a write into any registered range:
 * a WRITE lands only when [addr, addr + size) lies inside one reservation
 * that the consumer made for exactly one item of a pull in flight
 * (ecx_mc_recv_reserve), and only before that reservation's expiry (the
 * load's deadline). Anything else (outside every reservation, past the
 * expiry, a reservation ended meanwhile, a READ, size 0, a range that
 * wraps) writes nothing, is answered with the reject status (acknowledged
 * requests), is counted by reason, and leaves the process as it was; its
 * body, when small enough to read, is read and dropped so the connection
 * stays usable, else the connection is closed. Handshake connections are
 * served one request each, with bounded time and a bounded number open at
 * once, so a flood of them or a peer that stops mid-frame stalls nothing.
 *
 * One thread (epoll, non-blocking sockets) serves both ports. It never
 * takes a lock of the consumer's; the consumer's callers take the
 * receiver's lock only for short table updates, and
 * ecx_mc_recv_release waits at most for one non-blocking recv into the
 * range it ends (and, for a hashed reservation, the hashing of what that
 * recv took: at most the socket's buffer). After ecx_mc_recv_release returns,
 * no byte lands in that range any more (a load is final on this wire too).
 *
 * May include: core/, mooncake/frame.h, cJSON, libxxhash. Never: UCX, ZeroMQ, a
 * role's state or locks, or a write into memory that no live reservation
 * covers.
 */
#ifndef ECX_MOONCAKE_RECEIVER_H
#define ECX_MOONCAKE_RECEIVER_H

#include "core/core.h"

#include <stdint.h>

typedef struct ecx_mc_recv ecx_mc_recv;

/* Open at once: handshake connections (more are accepted and closed at
 * once, counted as refused) and data connections (more are refused the
 * same way). */
#define ECX_MC_HS_CONNS_MAX 32
#define ECX_MC_DATA_CONNS_MAX 64
/* A handshake connection lives at most this long (Mooncake's server
 * gives a request 5 s). */
#define ECX_MC_HS_TIMEOUT_MS 2000
/* A data connection in the middle of a request that sends nothing for
 * this long is closed; one idle between requests, after the longer. */
#define ECX_MC_DATA_STALL_MS 10000
#define ECX_MC_DATA_IDLE_MS 120000
/* The body of a refused WRITE of at most this many bytes is read and
 * dropped (the connection stays); a larger one closes the connection. */
#define ECX_MC_DRAIN_MAX (64u << 20)
/* Mid-body, how long the thread asks a data connection again for more
 * bytes before it goes back to epoll_wait (ns). */
#define ECX_MC_SPIN_NS 50000u

/* What the receiver did, counted since create. */
typedef struct ecx_mc_recv_stats {
	uint64_t writes;      /* WRITEs accepted, all their bytes landed */
	uint64_t bytes;       /* bytes of those */
	uint64_t rej_range;   /* WRITE outside every reservation */
	uint64_t rej_expired; /* WRITE past its reservation's expiry, or
	                         into one that ended while it came */
	uint64_t rej_read;    /* READ (any opcode but WRITE) */
	uint64_t rej_header;  /* size 0, or a range that wraps */
	uint64_t cut;         /* data connections that closed or stalled
	                         in the middle of a request */
	uint64_t hs_served;   /* handshakes answered (metadata, probe,
	                         notify) */
	uint64_t hs_refused;  /* handshakes closed unanswered: a bad
	                         frame, JSON, type (RDMA), over the cap,
	                         or out of time */
} ecx_mc_recv_stats;

/* ecx_mc_recv_create binds both ports (port 0: the kernel's choice) at
 * bind_host, or on every address, dual-stack, when bind_host is NULL or
 * "", and starts the thread. The session name is adv_host (bind_host when
 * NULL; this host's default address, ecx_default_host, when both are) and
 * the handshake port: "host:port", "[v6]:port". Returns 0 or an ecx_err
 * with why. */
int ecx_mc_recv_create(const char *bind_host, const char *adv_host,
                       ecx_mc_recv **out, char *why, size_t whylen);

/* The session name writers are given (dst_session): valid until destroy. */
const char *ecx_mc_recv_session(const ecx_mc_recv *r);

/* Advertises [addr, addr + len) in the metadata; remove takes the buffer
 * that starts at addr out of it. Neither lets a write in by itself:
 * only reservations do. add returns 0 or ECX_ENOMEM. */
int ecx_mc_recv_buffer_add(ecx_mc_recv *r, uint64_t addr, uint64_t len);
void ecx_mc_recv_buffer_remove(ecx_mc_recv *r, uint64_t addr);

/* ecx_mc_recv_reserve lets writes into [addr, addr + len) (one item's
 * destination) until expiry_ns (ecx_now_ns's clock). Returns its number
 * (never 0), or 0 when out of memory or len is 0. */
uint64_t ecx_mc_recv_reserve(ecx_mc_recv *r, uint64_t addr, uint64_t len,
                             uint64_t expiry_ns);

/* ecx_mc_recv_reserve_hashed is ecx_mc_recv_reserve that also makes the
 * XXH3 of the range as its bytes land, each recv's bytes hashed by the
 * thread just after it wrote them (in the cache): see
 * ecx_mc_recv_release_hashed. */
uint64_t ecx_mc_recv_reserve_hashed(ecx_mc_recv *r, uint64_t addr, uint64_t len,
                                    uint64_t expiry_ns);

/* ecx_mc_recv_extend moves reservation id's expiry to expiry_ns (later or
 * earlier). Returns false for an unknown id. */
bool ecx_mc_recv_extend(ecx_mc_recv *r, uint64_t id, uint64_t expiry_ns);

/* ecx_mc_recv_landed returns the bytes of the WRITEs into reservation id
 * that were accepted and landed whole, so far (never blocks). */
uint64_t ecx_mc_recv_landed(ecx_mc_recv *r, uint64_t id);

/* ecx_mc_recv_release ends reservation id and returns what landed; once
 * it returns nothing more lands in that range through it (a WRITE under
 * way is cut off: the rest of its body is dropped and it is rejected).
 * Waits at most for one non-blocking recv the thread is making into the
 * range (and its hashing, ecx_mc_recv_reserve_hashed). Unknown ids
 * return 0. */
uint64_t ecx_mc_recv_release(ecx_mc_recv *r, uint64_t id);

/* ecx_mc_recv_release_hashed is ecx_mc_recv_release that also sets *whole
 * (neither pointer may be NULL): true when id was reserved hashed and
 * every byte of its range landed exactly once, in order, through id
 * (writes that followed each other from its start to its end), and then
 * *xxh3 is the XXH3 of the range as they landed; false otherwise (a gap,
 * bytes written twice, bytes landed in the range through another
 * reservation that overlaps it, out of memory), when the caller hashes
 * the range itself. A write cut off before its end leaves a gap: always
 * when the release cut it, when its connection went unless the next
 * write through id goes on from the byte where it stopped. */
uint64_t ecx_mc_recv_release_hashed(ecx_mc_recv *r, uint64_t id, uint64_t *xxh3,
                                    bool *whole);

void ecx_mc_recv_stats_get(ecx_mc_recv *r, ecx_mc_recv_stats *out);

/* Stops the thread, closes every socket and frees r. Ends every
 * reservation first. Accepts NULL. */
void ecx_mc_recv_destroy(ecx_mc_recv *r);

#endif /* ECX_MOONCAKE_RECEIVER_H */
