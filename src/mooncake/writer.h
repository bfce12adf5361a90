/*
 * writer.h - puts bytes into a Mooncake session over its TCP wire: the
 * producer's side of the reference's pull (a segment's metadata from its
 * handshake port, then acknowledged WRITEs on its data port; frame.h has
 * the bytes).
 *
 * A writer keeps, per session it has written to, the segment descriptor it
 * was told (re-asked after ECX_MC_SEGMENT_TTL_MS, and at once after a
 * failure) and up to ECX_MC_POOL idle data connections (TCP_NODELAY), so
 * a write costs no handshake and no connect once a session is known. A
 * write is checked against the session's advertised buffers before a byte
 * is sent, goes as the 24-byte header and the bytes straight from the
 * caller's memory (one sendmsg, no copy), and ends when the receiver's
 * status says the bytes are in place.
 *
 * Never: write to a session that does not advertise acknowledged framing
 * (tcp_proto_version 2; an older one could not say whether the bytes
 * landed), write outside its advertised buffers, READ from a peer, wait
 * past a call's deadline (a getaddrinfo of a host name aside), or hold its
 * lock across a network wait.
 *
 * May include: core/, mooncake/frame.h. Thread-safe: any number of
 * threads may write at once, each call blocking only its caller.
 */
#ifndef ECX_MOONCAKE_WRITER_H
#define ECX_MOONCAKE_WRITER_H

#include "mooncake/frame.h"

#define ECX_MC_POOL 4               /* idle data connections per session */
#define ECX_MC_SEGMENT_TTL_MS 60000 /* a descriptor is asked again after */
#define ECX_MC_PEERS_MAX 256        /* sessions remembered at once */

typedef struct ecx_mc_writer ecx_mc_writer;

/* What a writer has done, for tests and metrics. */
typedef struct ecx_mc_writer_stats {
	uint64_t handshakes; /* metadata handshakes completed */
	uint64_t connects;   /* data connections opened */
	uint64_t writes;     /* writes acknowledged */
	uint64_t bytes;      /* bytes of those writes */
	uint64_t rejected;   /* writes the receiver answered with a reject */
	uint64_t failed;     /* other failed writes (every cause) */
} ecx_mc_writer_stats;

/* ecx_mc_writer_create makes a writer. self_name is the session name its
 * metadata requests carry as their own segment's (Mooncake's server
 * ignores it; the writer has no data port, so it says 0); NULL gives
 * "ecx-writer:1". ECX_ENOMEM or ECX_EIO, with why. */
int ecx_mc_writer_create(const char *self_name, ecx_mc_writer **out, char *why,
                         size_t whylen);

/* ecx_mc_writer_set_name changes the session name later metadata requests
 * carry (at most ECX_MC_NAME_MAX-1 bytes; longer is cut). Thread-safe. */
void ecx_mc_writer_set_name(ecx_mc_writer *w, const char *self_name);

/* ecx_mc_writer_shutdown makes every wait of every call, now and later,
 * end at once with ECX_ECLOSED (for a destroy that must not wait for
 * a slow receiver). Does not block. */
void ecx_mc_writer_shutdown(ecx_mc_writer *w);

/* ecx_mc_writer_destroy closes every connection and frees the writer. No
 * call may be in progress. Accepts NULL. */
void ecx_mc_writer_destroy(ecx_mc_writer *w);

/* ecx_mc_write writes n bytes from src to address dst of session
 * ("host:port" or "[v6]:port", its handshake port), blocking until the
 * receiver acknowledges them or deadline_ns (monotonic clock) passes. A
 * failure on a pooled connection, or on a descriptor that may be stale, is
 * tried once more on a fresh connection after a fresh handshake (a WRITE
 * of the same bytes to the same place may be repeated).
 * Returns 0, or:
 *   ECX_EINVAL   bad session name, n 0, or [dst, dst+n) outside every
 *                buffer the session advertises (nothing was sent), or
 *                the receiver answered the write with its reject status;
 *   ECX_EUNSUPPORTED  the session is not a "tcp" segment with
 *                acknowledged framing (nothing was sent);
 *   ECX_ECONNECT the handshake or data port cannot be reached;
 *   ECX_ETIMEDOUT the deadline passed;
 *   ECX_ECLOSED  the receiver closed the connection without a status, or
 *                the writer is shutting down;
 *   ECX_EPROTO   the receiver's answers are not Mooncake's frames;
 *   ECX_ENOMEM, ECX_EIO.
 * why has the one-line detail. */
int ecx_mc_write(ecx_mc_writer *w, const char *session, uint64_t dst,
                 const void *src, uint64_t n, uint64_t deadline_ns, char *why,
                 size_t whylen);

/* ecx_mc_writer_stats_get copies the counters. */
void ecx_mc_writer_stats_get(ecx_mc_writer *w, ecx_mc_writer_stats *out);

#endif /* ECX_MOONCAKE_WRITER_H */
