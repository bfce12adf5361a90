/*
 * wire.h - JSON codecs for everything ecx sends: registry entries, batched
 * lookups, pulls and their replies, and the ZeroMQ rendezvous messages.
 *
 * Decoders are strict and total: they take a byte buffer and its length
 * (not NUL-terminated), refuse inputs over their size limit, wrong types,
 * negative, fractional or out-of-range numbers (integers must be below 2^53),
 * missing fields, ids that break the rules and shapes that disagree with
 * nbytes, each with a one-line reason in why, and never read out of bounds.
 * Unknown fields are ignored so that newer peers can add fields. Encoders
 * return a malloc'd NUL-terminated string (free with free()), or NULL when
 * out of memory. Nothing here blocks or keeps state.
 *
 * May include: core/, cJSON and libxxhash (the item hashes a reply names).
 * Never: I/O of any kind (wire/ is pure, so the fuzzers drive it
 * directly).
 */
#ifndef ECX_WIRE_H
#define ECX_WIRE_H

#include "core/core.h"

#include <cjson/cJSON.h>

#define ECX_TOKEN_MAX 256        /* tokens, including the NUL */
#define ECX_WIRE_MAX (4u << 20)  /* largest message any decoder takes */
#define ECX_ENTRY_MAX 4096       /* largest registry entry */
#define ECX_LOOKUP_MAX_IDS 4096  /* ids in one batched lookup */
#define ECX_PULL_MAX_ITEMS 4096  /* items in one pull */
#define ECX_PULL_MAX_REGIONS 64  /* consumer regions named by one pull */
#define ECX_RKEY_MAX 4096        /* bytes of one packed UCX remote key */
#define ECX_WORKER_ADDR_MAX 8192 /* bytes of one packed UCX worker address */

/* ---- registry entry: {"nbytes","shape","dtype","producer_zmq", ...} ---- */

/* What the registry says about one item. The first four fields are exactly
 * what the reference publishes; epoch is ecx's (0 when absent): it changes
 * each time a producer starts, so a consumer can tell a restarted producer
 * at the same address from the one it knew. */
typedef struct ecx_entry {
	ecx_tensor_desc desc;
	char producer_zmq[ECX_ADDR_MAX];
	uint64_t epoch;
	/* ecx's lease ("ecx_ttl_s"; 0 when absent): a producer asks that the
	 * entry live this long past each renewal; 0 takes the registry's. */
	uint32_t ttl_s;
	/* In a registry's answers ("ecx_age_ms"): how long ago the holder
	 * renewed it (0 when absent). */
	uint64_t age_ms;
	/* In a leased lookup's answer from a producer's embedded registry
	 * ("ecx_lease"; 0 when absent): the lease it took on the item. */
	uint64_t lease;
} ecx_entry;

/* Holders of one id a registry keeps: each producer's entry, live ones
 * only. A lookup answers the most recently renewed first. */
#define ECX_HOLDERS_MAX 4
#define ECX_TTL_MAX_S 86400      /* the longest lease an entry may ask for */
#define ECX_ENTRY_TTL_DEFAULT 30 /* seconds, on both stores */

/* An item's epoch from its entry's, and back: an entry with no epoch is in
 * the reference's shape, and its item's epoch is ECX_EPOCH_REFERENCE. */
static inline uint64_t ecx_entry_item_epoch(const ecx_entry *e)
{
	return e->epoch != 0 ? e->epoch : ECX_EPOCH_REFERENCE;
}
static inline uint64_t ecx_item_entry_epoch(uint64_t item_epoch)
{
	return item_epoch != ECX_EPOCH_REFERENCE ? item_epoch : 0;
}

cJSON *ecx_entry_to_json(const ecx_entry *e);
char *ecx_entry_encode(const ecx_entry *e);
int ecx_entry_from_json(const cJSON *o, ecx_entry *out, char *why,
                        size_t whylen);
int ecx_entry_decode(const char *buf, size_t len, ecx_entry *out, char *why,
                     size_t whylen);

/* ---- batched lookup: {"ids":[...]} -> {"found":{id:entry},"missing":[]} */

/* A list of ids in one allocation; free with free(). */
typedef struct ecx_idlist {
	size_t n;
	char (*ids)[ECX_ID_MAX + 1];
	uint64_t lease_ms; /* a lookup's "ecx_lease_ms" (0: none asked) */
} ecx_idlist;

char *ecx_lookup_req_encode(const char *const *ids, size_t n);
/* The same with "ecx_lease_ms": M when lease_ms is not 0: a producer's
 * embedded registry then leases the items of that producer it finds. */
char *ecx_lookup_req_encode_lease(const char *const *ids, size_t n,
                                  uint64_t lease_ms);
/* On success *out holds a malloc'd list (free out->ids). Duplicate ids are
 * kept; at most ECX_LOOKUP_MAX_IDS. */
int ecx_lookup_req_decode(const char *buf, size_t len, ecx_idlist *out,
                          char *why, size_t whylen);

/* One id's answer in a batched lookup. */
typedef struct ecx_lookup_item {
	const char *id;
	bool found;
	ecx_entry entry; /* the holder to try first */
	/* The other holders ("ecx_holders": {id: [entry, ...]}, the first
	 * included, in the reply), in the order to try them: nalt entries,
	 * malloc'd (NULL when none). Whoever fills items frees them with
	 * ecx_lookup_items_clear. (Out of line: most ids have one holder, and
	 * a batch of items stays small.) */
	uint32_t nalt;
	ecx_entry *alt;
} ecx_lookup_item;

/* A hash of an id for tables of ids (the batch's own, the memory store's),
 * eight bytes at a time: not for anything an attacker should not
 * collide. */
size_t ecx_id_hash(const char *id);

/* Frees the other holders of n items (alt) and sets nalt to 0. */
void ecx_lookup_items_clear(ecx_lookup_item *items, size_t n);

char *ecx_lookup_resp_encode(const ecx_lookup_item *items, size_t n);
/* Fills items[i].found, .entry and .alt/.nalt (the other holders; set, not
 * freed, so items need not be initialised beyond .id) for the n ids
 * already set in items[i].id.
 * Every requested id must be under "found" or in "missing", and nothing
 * else may be; otherwise ECX_EPROTO. */
int ecx_lookup_resp_decode(const char *buf, size_t len, ecx_lookup_item *items,
                           size_t n, char *why, size_t whylen);

/* ---- ecx's batched pull (UCX active message) ---- */

/* The hash of an item's bytes that a pull asks for ("hash") and that its
 * reply carries. */
enum {
	/* A pull that does not say (an older consumer): a producer with
	 * integrity on answers with xxh64, as before "hash" existed. */
	ECX_HASH_DEFAULT = 0,
	ECX_HASH_NONE = 1,  /* "none": no hashes in the reply */
	ECX_HASH_XXH64 = 2, /* "xxh64": XXH64, seed 0 */
	ECX_HASH_XXH3 = 3,  /* "xxh3": XXH3_64bits, no seed */
};

/* The wire name of hash kind XXH64 or XXH3 (the reply's field), else
 * NULL. */
const char *ecx_hash_name(int kind);
/* Hash kind XXH64 or XXH3 of n bytes at p (0 for any other kind). */
uint64_t ecx_hash_bytes(int kind, const void *p, size_t n);
/* XXH3 of bytes given in pieces, in order: a state from ecx_xxh3_new
 * (NULL: out of memory), fed, then ended (which frees it and returns the
 * hash ecx_hash_bytes(ECX_HASH_XXH3, ...) of the whole); ecx_xxh3_free
 * frees one not ended. */
void *ecx_xxh3_new(void);
void ecx_xxh3_feed(void *st, const void *p, size_t n);
uint64_t ecx_xxh3_end(void *st);
void ecx_xxh3_free(void *st);

/* A piece of the consumer's memory, registered with UCX, that writes of this
 * pull may land in: [base, base + len), with its packed remote key. */
typedef struct ecx_region {
	uint64_t base;
	uint64_t len;
	size_t rkey_len;
	unsigned char *rkey; /* points into the request's allocation */
} ecx_region;

typedef struct ecx_pull_item {
	char id[ECX_ID_MAX + 1];
	uint64_t nbytes;
	uint32_t region; /* index into regions */
	uint64_t addr;   /* destination, inside that region */
	uint64_t lease;  /* the lease a lookup took on it, ended by this pull;
	                    0: none */
} ecx_pull_item;

typedef struct ecx_pull_req {
	uint64_t req; /* the consumer's request number, echoed in the reply */
	/* The producer's wall clock (ms since 1970) after which no byte of
	 * this pull may be written: a pull that arrives later is refused, and
	 * one that is being written stops. 0: none (older consumers). */
	uint64_t expires_ms;
	/* Sent as "data": "am": the consumer asks for the items' bytes as
	 * active messages ECX_AM_DATA (below), which it receives into the
	 * destinations, instead of puts. Over TCP UCX (1.13) emulates puts
	 * with copies on both sides; rendezvous active messages land in the
	 * destination from the socket, but for what UCX had already read
	 * into its receive segment (copied out). Producers that do not know it
	 * put as before. */
	bool data_am;
	/* "hash": the item hash the consumer checks (ECX_HASH_*; DEFAULT:
	 * absent, or a name this producer does not know). */
	int hash;
	/* "landed": true: where the producer puts, it tells the consumer
	 * which items have landed as it goes (ECX_AM_LANDED, below), so they
	 * can be checked while the rest of the pull is written. Producers
	 * that do not know it send none. */
	bool landed;
	/* Sent as "reply": "data" (with data_am): the consumer takes the
	 * reply inside the pull's data message (ECX_AM_DATA, below) when all
	 * the pull's bytes go in one. Producers that do not know it answer
	 * with ECX_AM_REPLY as before. */
	bool fold;
	/* Sent as "lead": true (with fold): the reply may come at the front
	 * of an eager data message's body (ecx_am_lead_hdr). Producers that
	 * do not know it put the reply in the header as for fold alone. */
	bool lead;
	/* Sent as "lane": true (with data_am): the data and the reply go
	 * over the connection's data lane (ecx_lane_hdr) where it has one.
	 * Producers that do not know it, or have no lane for it, send them
	 * as active messages. */
	bool lane;
	char token[ECX_TOKEN_MAX];
	size_t nregions;
	ecx_region *regions;
	size_t nitems;
	ecx_pull_item *items;
	void *mem; /* the one allocation behind regions, items and rkeys */
} ecx_pull_req;

char *ecx_pull_req_encode(const ecx_pull_req *r);
/* Checks every item's [addr, addr + nbytes) lies inside its region. Free
 * with ecx_pull_req_free. */
int ecx_pull_req_decode(const char *buf, size_t len, ecx_pull_req *out,
                        char *why, size_t whylen);
void ecx_pull_req_free(ecx_pull_req *r);

/* The reply: a whole-request status (err, for a bad token or a malformed
 * request, with no items) or one status per item, in the request's order. */
typedef struct ecx_pull_resp {
	uint64_t req;
	int err;
	/* "data": "am": the items' bytes went as ECX_AM_DATA messages, as the
	 * pull asked. Absent (a producer that puts): they went as puts. */
	bool data_am;
	char detail[160];
	size_t nitems;
	int *status; /* ecx_err per item */
	/* The hash of each item's bytes, from a producer with integrity on
	 * (on items that succeeded, as 16 hex digits in the field named by
	 * the kind: "xxh64", or "xxh3" for a pull that asked for it); NULL
	 * when the reply carries none, else has_hash[i] says which do. */
	uint64_t *hash;
	unsigned char *has_hash;
	/* Their kind, ECX_HASH_XXH64 or ECX_HASH_XXH3, one for the whole
	 * reply (the decoder refuses a mix); encoding DEFAULT sends
	 * "xxh64". */
	int hash_kind;
} ecx_pull_resp;

char *ecx_pull_resp_encode(const ecx_pull_resp *r);
/* Free what it allocates with ecx_pull_resp_free. */
int ecx_pull_resp_decode(const char *buf, size_t len, ecx_pull_resp *out,
                         char *why, size_t whylen);
void ecx_pull_resp_free(ecx_pull_resp *r);

/* ---- the pull's framing on UCX active messages ---- */

/* After the ZeroMQ hello (below) the consumer sends each pull as active
 * message ECX_AM_PULL with header ecx_am_hdr and an ecx_pull_req body; the
 * producer writes the items with UCX puts, flushes, and answers with
 * ECX_AM_REPLY, the same header and an ecx_pull_resp body. A pull with
 * data_am gets its items as ECX_AM_DATA messages instead of puts: header
 * ecx_am_data_hdr, body the bytes of items first..first+count-1 (neighbours
 * in both memories), sent by rendezvous from 64 KiB; the reply goes when
 * every such send has completed. A pull with "landed" that the producer
 * puts gets, after each put (of one item or neighbours) has completed
 * remotely, ECX_AM_LANDED: header ecx_am_data_hdr naming those items, no
 * body; an item put in pieces gets one after each piece, with count 1
 * and an 8-byte body, a u64: how many of its leading bytes are in.
 * For a pull with fold whose bytes all go in one data message, that
 * message's header is ecx_am_data_hdr followed by the reply's JSON (no
 * terminating NUL), and no ECX_AM_REPLY follows it unless the send
 * fails; for a pull with lead that message may instead have the header
 * ecx_am_lead_hdr (below): eager, with the reply at the front of its
 * body; by rendezvous, with padding before the items' bytes. */
#define ECX_AM_PULL 17
#define ECX_AM_REPLY 18
#define ECX_AM_DATA 19
/* The producer's goodbye on a shared-memory connection when it is
 * destroyed (a TCP connection's end shows by itself): header ecx_am_hdr
 * with conn and, in req, the producer's epoch; body "{}". Sent only where
 * no pull of the connection is in progress, after which none starts. */
#define ECX_AM_BYE 20
#define ECX_AM_LANDED 21

typedef struct ecx_am_hdr {
	uint64_t conn; /* the connection number the hello gave */
	uint64_t req;  /* the consumer's request number */
} ecx_am_hdr;

typedef struct ecx_am_data_hdr {
	uint64_t conn, req;    /* as ecx_am_hdr */
	uint32_t first, count; /* the pull's items these bytes are */
} ecx_am_data_hdr;

/* The header of a data message with the reply at the front of its body
 * (a pull with lead, sent eagerly): the body is lead bytes (the reply's
 * JSON, reply_len bytes, then spaces) and then the items' bytes. The
 * producer pads so that the items' bytes start at a multiple of 64 bytes
 * into the message as UCX frames it, where the kernel's copy into the
 * socket and the consumer's copy out of UCX's segment run at full speed
 * (docs/deploy.md). Sent by rendezvous (a pull's only data message up to
 * 2 MiB) it has reply_len 0, the reply's JSON (if any) after it in the
 * header, and a body of lead bytes of padding before the items' bytes.
 * 32 bytes; a data header with a reply is 24 bytes and JSON, which
 * starts with '{', never with the magic's first byte. */
#define ECX_AM_LEAD_MAGIC 0x4c584345u /* "ECXL" in memory order */
typedef struct ecx_am_lead_hdr {
	ecx_am_data_hdr d;
	uint32_t magic; /* ECX_AM_LEAD_MAGIC */
	uint16_t lead;  /* bytes before the items' */
	uint16_t reply_len;
} ecx_am_lead_hdr;

/* The data lane (TCP; docs/protocol.md, "The data lane"): a plain TCP
 * connection beside a connection's UCX endpoint, over which a pull that
 * asks for it ("lane": true) gets its data and then its reply, so that the
 * consumer receives the bytes from the socket straight into the items'
 * destinations. The producer offers it in the hello's answer (a port and
 * a key of ECX_LANE_KEY_LEN random bytes for that connection); the
 * consumer connects, sends ecx_lane_hello, and the producer answers with
 * the same 32 bytes once the lane is the connection's. Then only the
 * producer sends: frames of an ecx_lane_hdr and len bytes, kind
 * ECX_LANE_DATA (the bytes of items first..first+count-1 of pull req,
 * neighbours in both memories, as an ECX_AM_DATA message's body) or
 * ECX_LANE_REPLY (the pull's reply, an ecx_pull_resp's JSON, at most
 * ECX_LANE_REPLY_MAX bytes, after every data frame of that pull). Host
 * byte order, as the active messages' headers. */
#define ECX_LANE_MAGIC 0x4e584345u /* "ECXN" in memory order */
#define ECX_LANE_VERSION 1u
#define ECX_LANE_KEY_LEN 16
#define ECX_LANE_DATA 1u
#define ECX_LANE_REPLY 2u
#define ECX_LANE_REPLY_MAX ((uint64_t)4 << 20)
typedef struct ecx_lane_hello {
	uint32_t magic;   /* ECX_LANE_MAGIC */
	uint32_t version; /* ECX_LANE_VERSION */
	uint64_t conn;    /* the connection number from the hello's answer */
	unsigned char key[ECX_LANE_KEY_LEN]; /* and its key */
} ecx_lane_hello;
typedef struct ecx_lane_hdr {
	uint32_t magic; /* ECX_LANE_MAGIC */
	uint32_t kind;  /* ECX_LANE_DATA or ECX_LANE_REPLY */
	uint32_t first, count;
	uint64_t req, len;
} ecx_lane_hdr;

/* Largest ZeroMQ message the producer accepts. */
#define ECX_ZMQ_MAX_MSG (64 * 1024)

/* ---- the ZeroMQ socket: rendezvous and the reference's pull ---- */

typedef enum ecx_zop {
	ECX_ZOP_HELLO = 1,   /* ecx: exchange UCX worker addresses */
	ECX_ZOP_PULL = 2,    /* the reference's single-item pull */
	ECX_ZOP_LEASE = 3,   /* ecx: pin ids for a while (a lookup's lease) */
	ECX_ZOP_RELEASE = 4, /* ecx: end leases */
	ECX_ZOP_BYE = 5,     /* ecx: a consumer closes its connection */
} ecx_zop;

/* Transports a side allows, and the one a hello's answer agrees on. */
#define ECX_TR_SHM 1u /* shared memory: same host, user and namespaces */
#define ECX_TR_TCP 2u
#define ECX_DOMAIN_MAX 160

/* Ids in one lease request, and lease numbers in one release: both fit in
 * ECX_ZMQ_MAX_MSG whatever the ids (255 bytes each at most). */
#define ECX_LEASE_MAX_IDS 200

/* {"op":"hello","worker":"<base64>","token":"...","transports":["shm",
 * "tcp"],"domain":"..."}, {"op":"bye","conn":C,"epoch":E,"token":"..."}
 * or the reference's
 * {"op":"pull","mm_hash","dst_session","dst_ptr","nbytes"}. */
typedef struct ecx_zreq {
	ecx_zop op;
	char token[ECX_TOKEN_MAX];
	/* hello */
	size_t worker_len;
	unsigned char *worker; /* malloc'd; free with ecx_zreq_free */
	unsigned transports;   /* ECX_TR_* the consumer allows; 0: not sent */
	char domain[ECX_DOMAIN_MAX]; /* where shared memory works for it */
	/* bye: the connection the hello gave, at the producer of epoch */
	uint64_t conn, epoch;
	/* pull */
	char mm_hash[ECX_ID_MAX + 1];
	char dst_session[ECX_ADDR_MAX];
	uint64_t dst_ptr;
	uint64_t nbytes;
	/* lease: ids (malloc'd) and the time asked for; release: leases */
	uint64_t lease_ms;
	ecx_idlist ids;
	size_t nleases;
	uint64_t *leases; /* malloc'd */
} ecx_zreq;

char *ecx_zreq_encode_hello(const void *worker, size_t worker_len,
                            const char *token, unsigned transports,
                            const char *domain);
char *ecx_zreq_encode_bye(uint64_t conn, uint64_t epoch, const char *token);
char *ecx_zreq_encode_pull(const char *mm_hash, const char *dst_session,
                           uint64_t dst_ptr, uint64_t nbytes);
/* {"op":"lease","ids":[...],"ms":M,"token":T}: at most ECX_LEASE_MAX_IDS. */
char *ecx_zreq_encode_lease(const char *const *ids, size_t n, uint64_t ms,
                            const char *token);
/* {"op":"release","leases":[L,...],"token":T}: at most ECX_LEASE_MAX_IDS. */
char *ecx_zreq_encode_release(const uint64_t *leases, size_t n,
                              const char *token);
/* An unknown op gives ECX_EUNSUPPORTED with why "unknown op". */
int ecx_zreq_decode(const char *buf, size_t len, ecx_zreq *out, char *why,
                    size_t whylen);
void ecx_zreq_free(ecx_zreq *r);

/* Replies on the ZeroMQ socket, in the reference's shape: {"ok":true, ...}
 * or {"ok":false,"err":"..."}; ecx adds "code" (the ecx_err name). */
typedef struct ecx_zresp {
	bool ok;
	int err;
	char detail[320];
	size_t worker_len; /* hello reply */
	unsigned char *worker;
	uint64_t epoch;  /* the producer's epoch */
	uint64_t conn;   /* the consumer's connection number at the producer */
	uint64_t now_ms; /* the producer's wall clock when it answered; 0 when
	                    absent (then pulls carry no expiry) */
	unsigned transport; /* ECX_TR_SHM or ECX_TR_TCP, the producer's choice
	                       for this connection; 0 when absent */
	uint64_t idle_ms;   /* hello: the producer closes a connection idle this
	                       long; 0 when absent */
	/* hello, over TCP: the producer's data lane (its port, 0 when
	 * absent, and this connection's key) */
	unsigned lane_port;
	unsigned char lane_key[ECX_LANE_KEY_LEN];
	/* hello: the producer's process id and its start time
	 * (ecx_pid_start), for a consumer on the same host to notice its end;
	 * 0 when absent */
	uint64_t pid, pid_start;
	bool closed; /* bye: nothing of the connection is in flight any more */
	/* lease reply: per id, a lease number (0: refused, see lease_err),
	 * and the time granted; release reply: how many ended */
	size_t nleases;
	uint64_t *leases; /* malloc'd */
	int *lease_err;   /* malloc'd */
	uint64_t lease_ms;
	uint64_t released;
} ecx_zresp;

/* The reference's answer to its pull: {"ok": true, "mooncake_ret": 0}, or
 * {"ok": false, "err": "..."} with or without "mooncake_ret". *ok, *ret
 * (0 when absent; a number that is not an integer is ECX_EPROTO) and err
 * (the "err" string, "" when absent). ECX_EPROTO when "ok" is not a
 * boolean. */
int ecx_ref_reply_decode(const char *buf, size_t len, bool *ok, int64_t *ret,
                         char *err, size_t errlen, char *why, size_t whylen);

char *ecx_zresp_encode_error(int err, const char *detail);
char *ecx_zresp_encode_hello(const void *worker, size_t worker_len,
                             uint64_t epoch, uint64_t conn, uint64_t now_ms,
                             unsigned transport, uint64_t idle_ms, uint64_t pid,
                             uint64_t pid_start, unsigned lane_port,
                             const unsigned char *lane_key);
/* {"ok":true,"epoch":E,"ms":M,"items":[{"lease":L} or {"code":"ENOSPC"},
 * ...]}: one entry per id asked, in order. */
char *ecx_zresp_encode_lease(uint64_t epoch, uint64_t ms,
                             const uint64_t *leases, const int *errs, size_t n);
/* The answer to the reference's pull, in its shape: {"ok":true,
 * "mooncake_ret":0} when err is 0, else {"ok":false,"mooncake_ret":-1,
 * "err":detail (or core_strerror),"code":NAME} (-1 is what Mooncake's
 * batch_transfer_sync_write returns for a failed transfer). */
char *ecx_zresp_encode_ref_pull(int err, const char *detail);
/* {"ok":true,"released":N} */
char *ecx_zresp_encode_release(uint64_t released);
/* {"ok":true,"closed":B}: whether the connection is gone (B false: the
 * producer's wait for its pulls in flight ran out). */
char *ecx_zresp_encode_bye(bool closed);
int ecx_zresp_decode(const char *buf, size_t len, ecx_zresp *out, char *why,
                     size_t whylen);
void ecx_zresp_free(ecx_zresp *r);

/* ---- shared JSON helpers for the other layers ---- */

/* Parses len bytes (not NUL-terminated) into a cJSON tree, refusing more
 * than max bytes. */
cJSON *ecx_json_parse(const char *buf, size_t len, size_t max, char *why,
                      size_t whylen);
/* A raw integer node: cJSON's own numbers print large values in exponent
 * form. */
cJSON *ecx_json_u64(uint64_t v);
/* A JSON number read as a double d, as the non-negative integer below 2^53
 * that key must hold: 0, or ECX_EPROTO with the reason (negative, not an
 * integer, out of range). */
int ecx_json_double_u64(double d, const char *key, uint64_t *out, char *why,
                        size_t whylen);
int ecx_json_get_u64(const cJSON *o, const char *key, uint64_t *out, char *why,
                     size_t whylen);
/* Copies a string field of at most cap-1 bytes; missing or too long fails. */
int ecx_json_get_str(const cJSON *o, const char *key, char *out, size_t cap,
                     char *why, size_t whylen);
/* Maps an error code's name ("ENOTFOUND") back to its value; EIO for an
 * unknown name. */
int ecx_err_from_name(const char *name);

#endif /* ECX_WIRE_H */
