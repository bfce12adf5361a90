/*
 * frame.h - the bytes of Mooncake TransferEngine's TCP wire, as its source
 * defines them (kvcache-ai/Mooncake, mooncake-transfer-engine/): the
 * handshake frame (include/common.h writeString/readString), the segment
 * descriptor a metadata handshake answers (src/transfer_metadata.cpp
 * encodeSegmentDesc/decodeSegmentDesc), and the data port's 24-byte request
 * header and 8-byte status (src/transport/tcp_transport/
 * tcp_transport_session_impl.h). Our own code, written from that source.
 *
 * This folder (src/mooncake/) owns ecx's side of that wire: this codec, the
 * writer that puts an item into a Mooncake session, and the receiver that
 * takes writes into a consumer's memory.
 *
 * Decoders are strict and total: they take a byte buffer and its length,
 * refuse what Mooncake refuses (and what this file says more), give a
 * one-line reason in why, and never read out of bounds. Encoders write into
 * the caller's buffer or return a malloc'd string. Nothing here blocks,
 * keeps state or does I/O (so the fuzzers drive it directly).
 *
 * May include: core/, wire/ (its JSON helpers), cJSON.
 * Never: I/O, threads, or trust of any length, address or count read from
 * the network before it is checked here or by the caller.
 */
#ifndef ECX_MOONCAKE_FRAME_H
#define ECX_MOONCAKE_FRAME_H

#include "core/core.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- handshake frames (include/common.h) ----
 *
 * A frame is a u64 length in the sender's native byte order (little-endian
 * on every host ecx runs on; ecx always writes and reads little-endian),
 * then that many bytes: a u8 type, then JSON. The length counts the type
 * byte. One request and one answer per connection. */

#define ECX_MC_HS_LEN_BYTES 8
#define ECX_MC_HS_PREFIX 9       /* length + type */
#define ECX_MC_HS_MAX (1u << 20) /* largest length Mooncake reads */

enum {
	ECX_MC_HS_CONNECTION = 0, /* RDMA queue pairs: not spoken by ecx */
	ECX_MC_HS_METADATA = 1,
	ECX_MC_HS_NOTIFY = 2,
	ECX_MC_HS_PROBE = 3,
	/* The older untyped protocol: the whole body is JSON (a first
	 * body byte in 4..0x7f, e.g. '{'). Mooncake serves it as a
	 * connection request. */
	ECX_MC_HS_UNTYPED = 0xff,
};

/* ecx_mc_hs_prefix_encode writes the 9-byte prefix of a frame of type
 * type whose JSON is json_len bytes (the length written is json_len + 1).
 * The JSON follows it on the wire. */
void ecx_mc_hs_prefix_encode(uint8_t out[ECX_MC_HS_PREFIX], uint8_t type,
                             size_t json_len);

/* ecx_mc_hs_frame_encode returns a malloc'd frame (prefix + json, not
 * NUL-terminated) of *out_len bytes, or NULL when out of memory or when
 * json_len + 1 is over ECX_MC_HS_MAX. */
uint8_t *ecx_mc_hs_frame_encode(uint8_t type, const char *json, size_t json_len,
                                size_t *out_len);

/* ecx_mc_hs_len_decode reads the 8-byte length into *body_len, the bytes
 * that follow it (type + JSON). ECX_EPROTO for 0; ECX_ETOOBIG over
 * ECX_MC_HS_MAX (Mooncake reads nothing more and closes). */
int ecx_mc_hs_len_decode(const uint8_t in[ECX_MC_HS_LEN_BYTES],
                         uint64_t *body_len, char *why, size_t whylen);

/* ecx_mc_hs_body_decode classifies a frame's body of len bytes (what
 * follows the length): a first byte 0..3 is the type, the JSON follows it;
 * 4..0x7f is the untyped protocol (*type ECX_MC_HS_UNTYPED, the whole body
 * is JSON); 0x80..0xff is refused with ECX_EPROTO (Mooncake compares the
 * byte as a signed char, finds no such type and closes). *json points into
 * body. The JSON itself is not checked here. */
int ecx_mc_hs_body_decode(const uint8_t *body, size_t len, uint8_t *type,
                          const char **json, size_t *json_len, char *why,
                          size_t whylen);

/* The answers Mooncake's handshake server gives to a probe and a notify
 * (src/transfer_metadata.cpp receivePeerProbe/receivePeerNotify, written by
 * jsoncpp's FastWriter, which ends with a newline). A probe asks "{}". */
#define ECX_MC_PROBE_REPLY "{\"status\":\"success\"}\n"
#define ECX_MC_NOTIFY_REPLY "{\"name\":\"\",\"notify_msg\":\"success\"}\n"

/* ---- segment descriptor (src/transfer_metadata.cpp) ---- */

#define ECX_MC_NAME_MAX 288 /* a session name host:port, with its NUL */
#define ECX_MC_TIME_MAX 40  /* "YYYY-MM-DD HH:MM:SS.uuuuuu" and NUL */

/* One registered memory range: addr is an absolute virtual address in the
 * segment owner's process. */
typedef struct ecx_mc_buffer {
	const char *name; /* never empty; Mooncake writes the session name */
	uint64_t addr;    /* never 0 */
	uint64_t length;  /* never 0 */
} ecx_mc_buffer;

/* What a metadata handshake answers. name is the host:port at whose host
 * a writer opens the data port (Mooncake's writer connects there, not to
 * the host it handshook with). */
typedef struct ecx_mc_segment {
	char name[ECX_MC_NAME_MAX];
	uint16_t tcp_data_port;
	uint8_t tcp_proto_version;       /* 1 when the field is absent */
	char timestamp[ECX_MC_TIME_MAX]; /* "" when absent */
	size_t n_buffers;
	ecx_mc_buffer *buffers; /* decode: one allocation with the names */
} ecx_mc_segment;

/* ecx_mc_segment_encode returns the descriptor as Mooncake's FastWriter
 * prints it for a "tcp" segment: keys in sorted order, integers as digits,
 * a newline at the end; protocol "tcp"; timestamp s->timestamp, or local
 * time now when it is "". malloc'd and NUL-terminated (*out_len bytes
 * without the NUL when out_len is not NULL); NULL when out of memory. */
char *ecx_mc_segment_encode(const ecx_mc_segment *s, size_t *out_len);

/* ecx_mc_segment_decode parses len bytes of JSON (at most ECX_MC_HS_MAX)
 * into *out; free it with ecx_mc_segment_free. Refused with ECX_EPROTO,
 * whole, as Mooncake refuses it: a buffer whose name is empty or whose addr
 * or length is 0. Refused as well (Mooncake takes these and fails later):
 * not an object, name missing or not "host:port", tcp_data_port missing or
 * outside 1..65535, a tcp_proto_version that is not a small integer, a
 * buffer whose range wraps past 2^64, or a number that is negative,
 * fractional or at or above 2^53 (JSON numbers are read as doubles; no
 * Linux user address reaches 2^53). A protocol other than "tcp" (RDMA,
 * several protocols) is ECX_EUNSUPPORTED. Unknown fields are ignored. */
int ecx_mc_segment_decode(const char *json, size_t len, ecx_mc_segment *out,
                          char *why, size_t whylen);

/* ecx_mc_segment_free frees what decode allocated and zeroes *s (NULL
 * and a zeroed segment are fine). */
void ecx_mc_segment_free(ecx_mc_segment *s);

/* ecx_mc_range_within says whether [addr, addr + size) lies inside
 * [base, base + length), as Mooncake's receiver checks (validateTcpAddress):
 * false for size 0 and for any range that wraps. */
bool ecx_mc_range_within(uint64_t addr, uint64_t size, uint64_t base,
                         uint64_t length);

/* ecx_mc_segment_find returns the index of the buffer that holds all of
 * [addr, addr + size), or -1 when none does. */
long ecx_mc_segment_find(const ecx_mc_segment *s, uint64_t addr, uint64_t size);

/* ecx_mc_host_port splits a session name "host:port" or "[v6]:port" into
 * host (brackets removed, at most cap-1 bytes) and port (1..65535).
 * ECX_EINVAL, with why, for anything else (Mooncake would fall back to a
 * default port; ecx asks for one). */
int ecx_mc_host_port(const char *name, char *host, size_t cap, uint16_t *port,
                     char *why, size_t whylen);

/* ---- data port (src/transport/tcp_transport/
 * tcp_transport_session_impl.h) ----
 *
 * Each request is a 24-byte header (struct SessionHeader: u64 size, u64
 * addr, u8 opcode, 7 bytes of padding whose value is not defined), both
 * integers little-endian. A WRITE's size bytes follow it; a version-2
 * (acknowledged) request has 0x80 in its opcode and is answered with an
 * 8-byte little-endian status once the bytes are in place. */

#define ECX_MC_HDR_LEN 24
#define ECX_MC_STATUS_LEN 8

enum {
	ECX_MC_OP_READ = 0,
	ECX_MC_OP_WRITE = 1,
	ECX_MC_OP_V2 = 0x80, /* flag: acknowledged framing */
};

typedef struct ecx_mc_hdr {
	uint64_t size;
	uint64_t addr;
	uint8_t opcode; /* as on the wire, flag included */
} ecx_mc_hdr;

/* ecx_mc_hdr_encode writes the header, padding zeroed. */
void ecx_mc_hdr_encode(const ecx_mc_hdr *h, uint8_t out[ECX_MC_HDR_LEN]);
/* ecx_mc_hdr_decode reads any 24 bytes (padding ignored); the caller
 * checks size and addr. */
void ecx_mc_hdr_decode(const uint8_t in[ECX_MC_HDR_LEN], ecx_mc_hdr *h);

/* Whether a header asks for an acknowledged request, and whether it is a
 * WRITE (Mooncake serves any other opcode, flag masked off, as a READ). */
static inline bool ecx_mc_hdr_v2(const ecx_mc_hdr *h)
{
	return (h->opcode & ECX_MC_OP_V2) != 0;
}
static inline bool ecx_mc_hdr_is_write(const ecx_mc_hdr *h)
{
	return (uint8_t)(h->opcode & ~ECX_MC_OP_V2) == ECX_MC_OP_WRITE;
}

/* Status frames: "MCTV" in the high half, 0 (success) or a reason in the
 * low half (Mooncake sends 1 for an address it does not accept). */
#define ECX_MC_STATUS_MAGIC 0x4D43545600000000ull
#define ECX_MC_STATUS_OK (ECX_MC_STATUS_MAGIC | 0u)
#define ECX_MC_STATUS_REJECTED (ECX_MC_STATUS_MAGIC | 1u)

void ecx_mc_status_encode(uint64_t status, uint8_t out[ECX_MC_STATUS_LEN]);
uint64_t ecx_mc_status_decode(const uint8_t in[ECX_MC_STATUS_LEN]);
/* Whether a status frame carries the magic (a peer without it speaks the
 * unacknowledged protocol, or something else). */
static inline bool ecx_mc_status_valid(uint64_t status)
{
	return (status & 0xFFFFFFFF00000000ull) == ECX_MC_STATUS_MAGIC;
}

#endif /* ECX_MOONCAKE_FRAME_H */
