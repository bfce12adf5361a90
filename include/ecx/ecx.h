/*
 * ecx.h - the public API of libecx, the encoder-cache exchange library.
 *
 * This header is the whole API: anything not declared here is internal and
 * hidden in the shared library. Conventions:
 *   - Functions return ecx_err: 0 on success, a negative ECX_E* on failure.
 *   - Handles are opaque; ecx_<object>_create() makes one and
 *     ecx_<object>_destroy() (which accepts NULL) releases it.
 *   - Output parameters come last and are written only on success.
 *   - Where a failure has a one-line detail, it is written to the caller's
 *     buffer (why, whylen) or kept on the handle (ecx_<object>_last_error()).
 */
#ifndef ECX_ECX_H
#define ECX_ECX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(ECX_BUILDING) && defined(__GNUC__)
#define ECX_API __attribute__((visibility("default")))
#else
#define ECX_API
#endif

/* ---- Version ------------------------------------------------------------ */

#define ECX_VERSION_MAJOR 0
#define ECX_VERSION_MINOR 1
#define ECX_VERSION_PATCH 0
/* The version's one home: CMake (project version, soname, ecx.pc) and the
 * Python binding read the three numbers above from this file. */
#define ECX_VERSION_STR_(x) #x
#define ECX_VERSION_XSTR_(x) ECX_VERSION_STR_(x)
#define ECX_VERSION_STRING                                              \
	ECX_VERSION_XSTR_(ECX_VERSION_MAJOR)                            \
	"." ECX_VERSION_XSTR_(ECX_VERSION_MINOR) "." ECX_VERSION_XSTR_( \
	    ECX_VERSION_PATCH)
/* One integer that orders versions: major * 10000 + minor * 100 + patch. */
#define ECX_VERSION_NUMBER                                     \
	(ECX_VERSION_MAJOR * 10000 + ECX_VERSION_MINOR * 100 + \
	 ECX_VERSION_PATCH)

/* ecx_version returns the library's version string ("MAJOR.MINOR.PATCH"); it
 * never fails and the string is static. Compare with ECX_VERSION_STRING to
 * detect a header and library that disagree. */
ECX_API const char *ecx_version(void);

/* ecx_version_number returns ECX_VERSION_NUMBER of the library as built. */
ECX_API int ecx_version_number(void);

/* ---- Errors ------------------------------------------------------------- */

/* The error table. Codes are only ever appended, never renumbered. */
#define ECX_ERR_MAP(XX)                                            \
	XX(OK, 0, "success")                                       \
	XX(EINVAL, -1, "invalid argument")                         \
	XX(ENOMEM, -2, "out of memory")                            \
	XX(EPROTO, -3, "malformed message")                        \
	XX(ETOOBIG, -4, "too large")                               \
	XX(ENOTFOUND, -5, "unknown mm_hash")                       \
	XX(ESIZE, -6, "size mismatch")                             \
	XX(ETIMEDOUT, -7, "timed out")                             \
	XX(ECONNECT, -8, "cannot connect")                         \
	XX(EAUTH, -9, "bad or missing token")                      \
	XX(ENOSPC, -10, "no room in arena")                        \
	XX(EIO, -11, "transport error")                            \
	XX(EADDRINUSE, -12, "address already in use")              \
	XX(ECLOSED, -13, "peer closed")                            \
	XX(EBUSY, -14, "busy")                                     \
	XX(EDTYPE, -15, "unknown dtype")                           \
	XX(EID, -16, "invalid id")                                 \
	XX(EUNSUPPORTED, -17, "not supported")                     \
	XX(EINTERNAL, -18, "internal error")                       \
	XX(ECORRUPT, -19, "bytes differ from the producer's hash") \
	XX(EFORK, -20, "handle used in another process (after fork)")

typedef enum ecx_err {
#define ECX_ERR_ENUM(name, code, msg) ECX_##name = code,
	ECX_ERR_MAP(ECX_ERR_ENUM)
#undef ECX_ERR_ENUM
} ecx_err;

/* Handles (ecx_producer, ecx_consumer, ecx_load, ecx_client, ecx_registry)
 * belong to the process that created them. In a forked child, every call
 * on an inherited handle returns ECX_EFORK (a call that returns a pointer
 * returns NULL, a stats call fills zeros) with ecx_last_error naming both
 * processes, and touches none of the handle's state: its UCX, ZeroMQ and
 * libcurl state is a copy of the parent's, shared-memory FIFOs included,
 * and its locks are as the parent's other threads held them. A destroy
 * there does nothing: the child's copy is leaked on purpose (it goes when
 * the child exits or execs). Create new handles in the child; the
 * parent's keep working. */

/* ecx_strerror returns a short static description of err ("unknown
 * mm_hash"); for a value outside the table it returns "unknown error". */
ECX_API const char *ecx_strerror(int err);

/* ecx_err_name returns the code's name without prefix ("ENOTFOUND"), or
 * "UNKNOWN" for a value outside the table. Static storage. */
ECX_API const char *ecx_err_name(int err);

/* ---- Item ids ----------------------------------------------------------- */

/* An item id (vLLM's mm_hash) is 1 to ECX_ID_MAX bytes, each from
 * [A-Za-z0-9._:@+=-]. */
#define ECX_ID_MAX 255

/* ecx_id_check returns 0 when id (NUL-terminated) follows the rules, else
 * ECX_EID with a one-line reason naming the first bad byte and its offset
 * written to why (when why is not NULL and whylen > 0). Never blocks. */
ECX_API int ecx_id_check(const char *id, char *why, size_t whylen);

/* ---- dtypes and tensor descriptors -------------------------------------- */

/* Element types, named as torch names them. */
#define ECX_DTYPE_MAP(XX)                     \
	XX(FLOAT16, "float16", 2)             \
	XX(BFLOAT16, "bfloat16", 2)           \
	XX(FLOAT32, "float32", 4)             \
	XX(FLOAT64, "float64", 8)             \
	XX(INT8, "int8", 1)                   \
	XX(UINT8, "uint8", 1)                 \
	XX(INT16, "int16", 2)                 \
	XX(INT32, "int32", 4)                 \
	XX(INT64, "int64", 8)                 \
	XX(BOOL, "bool", 1)                   \
	XX(FLOAT8_E4M3FN, "float8_e4m3fn", 1) \
	XX(FLOAT8_E5M2, "float8_e5m2", 1)

typedef enum ecx_dtype {
	ECX_DTYPE_INVALID = 0,
#define ECX_DTYPE_ENUM(name, str, size) ECX_DTYPE_##name,
	ECX_DTYPE_MAP(ECX_DTYPE_ENUM)
#undef ECX_DTYPE_ENUM
	    ECX_DTYPE_COUNT
} ecx_dtype;

/* ecx_dtype_name returns torch's name for dt ("bfloat16"), or NULL for a
 * value that is not a dtype. */
ECX_API const char *ecx_dtype_name(ecx_dtype dt);

/* ecx_dtype_size returns the size of one element in bytes, 0 for a value
 * that is not a dtype. */
ECX_API size_t ecx_dtype_size(ecx_dtype dt);

/* ecx_dtype_parse sets *out to the dtype called name and returns 0, or
 * returns ECX_EDTYPE. Accepts torch's names, also with a "torch." prefix. */
ECX_API int ecx_dtype_parse(const char *name, ecx_dtype *out);

/* ---- Sizes -------------------------------------------------------------- */

/* ecx_size_parse reads a size written for people (NUL-terminated s) into
 * *out, in bytes, and returns 0; or returns ECX_EINVAL, *out untouched,
 * with a one-line reason that lists the units written to why (when why is
 * not NULL and whylen > 0). A size is a number (digits with an optional
 * fraction and exponent: "1.5", "2e9") and an optional unit, case ignored,
 * spaces allowed around them:
 *   none, B              bytes
 *   KiB, MiB, GiB, TiB   powers of 1024 (K, M, G, T too)
 *   KB, MB, GB, TB       powers of 1000
 * so "100MB" is 100000000 and "512MiB" 536870912. The result is exact, a
 * fraction of a byte dropped ("1.5B" is 1); 2^53 bytes or more is refused
 * (what a JSON peer reading doubles gets exactly). The ecx command and the
 * Python connector read every size through it. Never blocks. */
ECX_API int ecx_size_parse(const char *s, uint64_t *out, char *why,
                           size_t whylen);

/* ecx_url_mask writes text (NUL-terminated; NULL reads as "") into buf,
 * len bytes, cut and terminated if need be, with the password of every
 * URL in it replaced by three asterisks: in "redis://:PASSWORD@HOST" and
 * "redis://user:PASSWORD@HOST" what follows the ':' up to the URL's last
 * '@', in "redis://PASSWORD@HOST" (a password too, to libecx) all of it.
 * A comma before another SCHEME:// ends a URL, as in registry lists. The
 * library's log masks every line so, and the ecx command what it prints.
 * Never blocks. */
ECX_API void ecx_url_mask(const char *text, char *buf, size_t len);

/* ecx_xxh3 returns the XXH3 (XXH3_64bits, no seed) of n bytes at p, the
 * hash integrity uses; a push-mode consumer checks landed bytes with it. */
ECX_API uint64_t ecx_xxh3(const void *p, size_t n);

#define ECX_MAX_DIMS 8

/* What an item is: element type, shape and total size. nbytes is declared by
 * whoever made the descriptor and must equal the product of the shape and
 * the element size. A zero-dimensional descriptor is a scalar. */
typedef struct ecx_tensor_desc {
	ecx_dtype dtype;
	uint32_t ndim;
	uint64_t shape[ECX_MAX_DIMS];
	uint64_t nbytes;
} ecx_tensor_desc;

/* ecx_tensor_nbytes computes the size of a tensor of this dtype and shape
 * (ignoring d->nbytes) into *out. Returns ECX_EDTYPE, ECX_EINVAL (more than
 * ECX_MAX_DIMS dimensions) or ECX_ETOOBIG (the product overflows 2^53, the
 * largest integer every JSON peer reads exactly). */
ECX_API int ecx_tensor_nbytes(const ecx_tensor_desc *d, uint64_t *out);

/* ecx_tensor_check returns 0 when d is well formed and d->nbytes agrees with
 * its shape; otherwise the error of ecx_tensor_nbytes or ECX_ESIZE, with a
 * one-line reason in why. */
ECX_API int ecx_tensor_check(const ecx_tensor_desc *d, char *why,
                             size_t whylen);

/* ecx_tensor_set fills *d from dtype and shape, computing nbytes. Returns
 * as ecx_tensor_nbytes. */
ECX_API int ecx_tensor_set(ecx_tensor_desc *d, ecx_dtype dtype, uint32_t ndim,
                           const uint64_t *shape);

/* ---- Registry server --------------------------------------------------- */

/* The HTTP registry: GET /ec/info/{id} (the reference's route), POST
 * /ec/lookup, PUT and DELETE /ec/info/{id}, GET /ec/list, /metrics and
 * /healthz. docs/registry.md describes each route. It serves from threads of
 * its own; the calls below are safe from any thread. */
typedef struct ecx_registry ecx_registry;

#define ECX_REGISTRY_PORT_DEFAULT 9018

enum {
	ECX_REGISTRY_PARAM_BIND_HOST = 1u << 0,
	ECX_REGISTRY_PARAM_PORT = 1u << 1,
	ECX_REGISTRY_PARAM_TOKEN = 1u << 2,
	ECX_REGISTRY_PARAM_TOKEN_READS = 1u << 3,
	ECX_REGISTRY_PARAM_THREADS = 1u << 4,
	ECX_REGISTRY_PARAM_STORE = 1u << 5,
	ECX_REGISTRY_PARAM_ENTRY_TTL = 1u << 6,
};

/* Fields not named in field_mask take their defaults. */
typedef struct ecx_registry_params {
	uint64_t field_mask;
	const char *bind_host; /* default "0.0.0.0", as the reference */
	uint16_t port;         /* default 9018; 0 picks a free port */
	const char *token;     /* default none: writes are open */
	int token_reads;       /* default 0: reads need no token */
	unsigned threads;      /* default 2 serving threads */
	const char *store;     /* default "memory"; or redis://HOST:PORT[/DB]
	                          (HTTP clients then share a Redis) */
	int entry_ttl_s;       /* entries PUT without a lease of their own
	                          ("ecx_ttl_s") leave this long after their
	                          last renewal; default 30, 0: never */
} ecx_registry_params;

/* ecx_registry_create binds and starts serving before it returns. Fails
 * with ECX_EADDRINUSE when the port is taken, ECX_EINVAL for a bad address
 * or parameter, each with a one-line reason in why. */
ECX_API int ecx_registry_create(const ecx_registry_params *params,
                                ecx_registry **out, char *why, size_t whylen);

/* ecx_registry_port returns the port it listens on (useful after port 0). */
ECX_API uint16_t ecx_registry_port(const ecx_registry *r);

/* ecx_registry_destroy stops serving, waiting for requests in flight, and
 * frees everything. Accepts NULL. */
ECX_API void ecx_registry_destroy(ecx_registry *r);

/* ecx_last_error returns the one-line detail of the calling thread's last
 * failed ecx call ("" if none). Valid until that thread's next ecx call;
 * ecx_producer_last_error and ecx_consumer_last_error are the same. */
ECX_API const char *ecx_last_error(void);

/* ---- Producer ------------------------------------------------------------ */

/* A producer keeps items in an arena registered with UCX once, publishes
 * them to a registry, and serves pulls from its own threads. put and remove
 * may be called from any thread. */
typedef struct ecx_producer ecx_producer;

enum {
	ECX_PRODUCER_PARAM_CAPACITY = 1u << 0,
	ECX_PRODUCER_PARAM_BIND_HOST = 1u << 1,
	ECX_PRODUCER_PARAM_ADVERTISE_HOST = 1u << 2,
	ECX_PRODUCER_PARAM_ZMQ_PORT = 1u << 3,
	ECX_PRODUCER_PARAM_REGISTRY_PORT = 1u << 4,
	ECX_PRODUCER_PARAM_REGISTRY = 1u << 5,
	ECX_PRODUCER_PARAM_TOKEN = 1u << 6,
	ECX_PRODUCER_PARAM_TRANSPORT = 1u << 7,
	ECX_PRODUCER_PARAM_TIMEOUT = 1u << 8,
	ECX_PRODUCER_PARAM_REGISTRY_TTL = 1u << 9,
	ECX_PRODUCER_PARAM_INTEGRITY = 1u << 10,
	ECX_PRODUCER_PARAM_LEASE_MAX_MS = 1u << 11,
	ECX_PRODUCER_PARAM_LEASE_SHARE = 1u << 12,
	ECX_PRODUCER_PARAM_IDLE = 1u << 13,
	ECX_PRODUCER_PARAM_STARTING = 1u << 14,
	ECX_PRODUCER_PARAM_MOONCAKE = 1u << 15,
};

/* Leases: the time a lookup's lease pins an item when the consumer asks
 * for no other, and the producer's default cap on it; the share of the
 * arena that leased items may take, in percent. */
#define ECX_LEASE_MS_DEFAULT 30000
#define ECX_LEASE_SHARE_DEFAULT 50

#define ECX_CAPACITY_DEFAULT ((uint64_t)1 << 30)

typedef struct ecx_producer_params {
	uint64_t field_mask;
	uint64_t capacity_bytes;    /* arena size, default 1 GiB */
	const char *bind_host;      /* where ZeroMQ and the embedded registry
	                               listen; default "0.0.0.0" */
	const char *advertise_host; /* host named in producer_zmq; default the
	                               bind host, or this host's first
	                               non-loopback IPv4 address */
	uint16_t zmq_port;          /* default 0: a free port */
	int registry_port;          /* embedded registry: default 9018, 0 a
	                               free port, -1 none */
	const char *registry;       /* publish to this remote registry instead
	                               of an embedded one: http://HOST:PORT, or
	                               redis://[:password@]HOST:PORT[/DB] */
	const char *token;          /* required on pulls and registry writes */
	const char *transport;      /* "auto" (default), "tcp", "shm" */
	int timeout_ms;             /* bound on transfers and registry calls,
	                               default 5000 */
	int registry_ttl_s;         /* entries in a remote registry (HTTP or
	                               Redis) expire this long after the
	                               producer stops renewing them (it renews
	                               every third of it, at most every 2 s),
	                               so a producer that dies leaves nothing
	                               behind; default 30; 0: never on Redis,
	                               the registry's own lease on HTTP. With
	                               the embedded registry: the lease of
	                               entries other producers PUT into it */
	int integrity;              /* hash each item at put (XXH3) and send
	                               the hash with every pull's answer, for
	                               consumers that check (xxh64 to older
	                               consumers); default false */
	int lease_max_ms;    /* longest lease granted (a longer ask is cut to
	                        it); default ECX_LEASE_MS_DEFAULT */
	int lease_share_pct; /* at most this percent of the arena leased at
	                        once, 0 to 100; default 50; 0: no leases */
	int idle_ms;         /* a consumer connection with no pull in
	                        flight and none for this long is closed
	                        and the consumer's memory unmapped (a
	                        consumer that died is forgotten within
	                        idle_ms + about 200 ms); a live consumer
	                        makes a new connection by itself on its
	                        next load. Default ECX_IDLE_MS_DEFAULT */
	int starting;        /* with the embedded registry: its /healthz
	                        answers 503 {"ok": false, "starting": true}
	                        until ecx_producer_set_ready, for a caller
	                        that puts what it serves first. Default
	                        false: healthy once create returns (before
	                        that, starting, whatever this says) */
	int mooncake;        /* answer the reference's pull op
	                        ({"op":"pull","dst_session",...}) by writing
	                        the item into that Mooncake session over
	                        Mooncake's TCP wire (docs/protocol.md);
	                        default true; false: such pulls are refused
	                        (EUNSUPPORTED) */
} ecx_producer_params;

#define ECX_IDLE_MS_DEFAULT 15000

/* ecx_producer_create maps and populates the arena (capacity bytes touched
 * once, now), binds its sockets, starts its threads, and returns once it
 * serves. Blocks for as long as populating takes. Errors: ECX_EADDRINUSE
 * (a port is taken), ECX_EINVAL, ECX_ENOMEM, ECX_EIO; the detail is in
 * why. */
ECX_API int ecx_producer_create(const ecx_producer_params *params,
                                ecx_producer **out, char *why, size_t whylen);

/* ecx_producer_put copies desc->nbytes bytes from src into the arena and
 * publishes id once they are in place. When the arena is full it evicts
 * least-recently-used items that no pull is reading, and unpublishes them.
 * An id already held with the same descriptor is kept as is (ids are
 * content hashes) and only marked recently used. Errors: ECX_EID,
 * ECX_ESIZE (bad descriptor), ECX_ETOOBIG (larger than the arena),
 * ECX_ENOSPC (no room: everything is pinned), ECX_EINVAL (id held with
 * another descriptor), or the registry's error (the item is then not kept).
 * On failure the store is as it was. Blocks on the copy and, with a remote
 * registry, on its publish (at most timeout_ms; refused at once, ECX_ECONNECT,
 * while that registry is known to be down). Evicted ids leave the registry
 * before their bytes are written over; where it cannot be reached their
 * removal is queued and made when it is back (tried with back-off). */
ECX_API int ecx_producer_put(ecx_producer *p, const char *id,
                             const ecx_tensor_desc *desc, const void *src);

/* ecx_producer_put_stored is ecx_producer_put that also says what it did:
 * on success *stored is 1 when it copied src in and published id, 0 when
 * id was already held with the same descriptor (nothing copied). Blocks
 * and fails as put; *stored is set only on success. */
ECX_API int ecx_producer_put_stored(ecx_producer *p, const char *id,
                                    const ecx_tensor_desc *desc,
                                    const void *src, int *stored);

/* ecx_producer_reserve is put in two steps, for callers that write the
 * bytes themselves (a GPU copy straight into the arena, no staging copy):
 * it takes room for id as put does and sets *dst to it; the caller writes
 * desc->nbytes bytes there, then calls ecx_producer_commit, which publishes
 * id (and hashes it, with integrity on), or ecx_producer_cancel, which
 * gives the room back. Until then id is invisible to lookups and pulls,
 * cannot be evicted, and a put or reserve of it fails with ECX_EBUSY: a
 * reservation never committed nor cancelled keeps its room for good. When
 * id is already held with the same descriptor, reserve returns 0 with *dst
 * NULL: nothing to write, nothing to commit (as put keeps the first bytes).
 * Errors as put. commit and cancel belong to the caller that reserved:
 * ECX_ENOTFOUND when id is not reserved; a commit whose publish fails
 * frees the room, as a failed put does. */
ECX_API int ecx_producer_reserve(ecx_producer *p, const char *id,
                                 const ecx_tensor_desc *desc, void **dst);
ECX_API int ecx_producer_commit(ecx_producer *p, const char *id);
ECX_API int ecx_producer_cancel(ecx_producer *p, const char *id);

/* The arena's address and size (*capacity), e.g. to page-lock it for
 * device copies (cudaHostRegister). Valid until ecx_producer_destroy. */
ECX_API void *ecx_producer_arena(ecx_producer *p, uint64_t *capacity);

/* ecx_producer_remove unpublishes id and frees its space once no pull reads
 * it. ECX_ENOTFOUND if not held. */
ECX_API int ecx_producer_remove(ecx_producer *p, const char *id);

typedef struct ecx_producer_stats {
	uint64_t items;         /* items held */
	uint64_t bytes_used;    /* arena bytes taken */
	uint64_t capacity;      /* arena size */
	uint64_t pinned;        /* items a pull is reading now */
	uint64_t evictions;     /* items evicted to make room */
	uint64_t pulls;         /* pull requests answered */
	uint64_t items_served;  /* items written to consumers */
	uint64_t items_failed;  /* items answered with an error */
	uint64_t bytes_served;  /* bytes written to consumers */
	uint64_t registrations; /* memory registrations made (1: the arena) */
	uint64_t connections;   /* consumer connections open now (from hello
	                           to goodbye, idle close or failure) */
	/* Leases (docs/protocol.md "a hit will load"): */
	uint64_t leases;          /* leases held now */
	uint64_t leased_bytes;    /* arena bytes pinned by leases now */
	uint64_t leases_granted;  /* leases granted */
	uint64_t leases_refused;  /* refused: the share was taken */
	uint64_t leases_expired;  /* ended by their expiry */
	uint64_t leases_released; /* ended by an explicit release */
	uint64_t leases_used;     /* ended by the pull that followed */
} ecx_producer_stats;

ECX_API void ecx_producer_stats_get(ecx_producer *p, ecx_producer_stats *out);

/* The producer_zmq address it publishes ("tcp://HOST:PORT"). */
ECX_API const char *ecx_producer_address(const ecx_producer *p);

/* The embedded registry's port, 0 when it runs none. */
ECX_API uint16_t ecx_producer_registry_port(const ecx_producer *p);

/* ecx_producer_set_ready ends the embedded registry's starting state of a
 * producer created with params.starting: its /healthz answers 200 from
 * now on. Call it once what it serves is put (and so published). Does
 * nothing without an embedded registry, or when called again. */
ECX_API void ecx_producer_set_ready(ecx_producer *p);

/* One write of a push (ecx_producer_push_batch): the held item id, all
 * nbytes of it, into Mooncake session dst_session ("host:port" or
 * "[v6]:port", its handshake port) at address dst_ptr, which the session's
 * owner chose (a push-mode reservation). status is set by the call: 0, or
 * that write's error. */
typedef struct ecx_push_item {
	const char *id;
	const char *dst_session;
	uint64_t dst_ptr;
	uint64_t nbytes;
	int status; /* out */
} ecx_push_item;

/* ecx_producer_push writes the held item id into Mooncake session
 * dst_session at dst_ptr over Mooncake's TCP wire, blocking until the
 * receiver acknowledges all nbytes or timeout_ms (0: the producer's
 * timeout) has passed since the call. The item is pinned while it is
 * written (no eviction, a remove waits). nbytes must be the item's size.
 * Errors: ECX_ENOTFOUND (not held), ECX_ESIZE (nbytes is not its size),
 * ECX_EUNSUPPORTED (the producer was created with mooncake off, or the
 * session does not speak acknowledged TCP framing), ECX_EINVAL (the
 * range is outside every buffer the session advertises, or the receiver
 * refused the write), ECX_ECONNECT, ECX_ETIMEDOUT, ECX_ECLOSED,
 * ECX_EPROTO; the detail (item, session, address, why) is in
 * ecx_last_error. A failed write may have left part of the bytes there. */
ECX_API int ecx_producer_push(ecx_producer *p, const char *id,
                              const char *dst_session, uint64_t dst_ptr,
                              uint64_t nbytes, uint64_t timeout_ms);

/* ecx_producer_push_batch is ecx_producer_push for n items at once (any
 * sessions), up to four writes in flight, all ending by one deadline
 * timeout_ms from the call. Every entry's status is set; returns 0 when
 * all succeeded, else the status of the first entry that failed (its
 * detail in ecx_last_error). The caller owns items. */
ECX_API int ecx_producer_push_batch(ecx_producer *p, ecx_push_item *items,
                                    size_t n, uint64_t timeout_ms);

/* ecx_producer_item_xxh3 sets *out to the XXH3 (XXH3_64bits, no seed: the
 * hash integrity uses) of the held item id, what a push carries to its
 * consumer: the hash made at put where the producer has integrity on (so
 * bytes changed in the arena since are caught), else one made now from the
 * item's bytes, the item pinned meanwhile. Does not wait on the network.
 * Errors: ECX_EINVAL, ECX_ENOTFOUND (not held, or not committed yet). */
ECX_API int ecx_producer_item_xxh3(ecx_producer *p, const char *id,
                                   uint64_t *out);

/* ecx_producer_lease takes a lease on the held item id for a pull that
 * another process will make (docs/protocol.md "a hit will load"), as a
 * lookup's lease is taken at the producer: while it holds, the item is not
 * evicted; it ends at the first of the pull that names it (the number
 * travels in ecx_item.lease, or a push-mode "ecx_lease"),
 * ecx_producer_lease_end, its expiry after ms (0: the producer's
 * lease_max_ms, which also cuts a longer ms) or the item's removal. Under
 * the same bounds as a lookup's: leased items take at most lease_share_pct
 * of the arena, at most 65536 leases are held; a lease beyond them is
 * refused, never waited for. Sets *lease (1 to 2^53 - 1) on success.
 * Errors: ECX_EINVAL, ECX_ENOTFOUND (not held, or not committed yet),
 * ECX_ENOSPC (the lease share is taken), ECX_EBUSY (65536 leases held),
 * ECX_ENOMEM. */
ECX_API int ecx_producer_lease(ecx_producer *p, const char *id, int ms,
                               uint64_t *lease);

/* ecx_producer_lease_end ends lease (one ecx_producer_lease or a lookup
 * took) now. Returns 1 when it was still held, 0 when it had ended
 * already (or lease is 0), or ECX_EINVAL / ECX_EFORK. */
ECX_API int ecx_producer_lease_end(ecx_producer *p, uint64_t lease);

ECX_API const char *ecx_producer_last_error(void);

/* ecx_producer_destroy stops serving, unpublishes every item, says goodbye
 * to its consumers over shared memory (their loads then fail with
 * ECX_ECLOSED at once, docs/protocol.md), closes its endpoints and frees
 * everything. Accepts NULL. */
ECX_API void ecx_producer_destroy(ecx_producer *p);

/* ---- Consumer ------------------------------------------------------------ */

/* A consumer looks ids up and loads items into its memory: buffers from
 * its receive arena (ecx_consumer_alloc; fastest) or memory the caller
 * brings (registered once, through a bounded cache). Calls are safe from
 * any thread. */
typedef struct ecx_consumer ecx_consumer;

enum {
	ECX_CONSUMER_PARAM_REGISTRY = 1u << 0,
	ECX_CONSUMER_PARAM_TOKEN = 1u << 1,
	ECX_CONSUMER_PARAM_TIMEOUT = 1u << 2,
	ECX_CONSUMER_PARAM_RECV_CAPACITY = 1u << 3,
	ECX_CONSUMER_PARAM_TRANSPORT = 1u << 4,
	ECX_CONSUMER_PARAM_BIND_HOST = 1u << 5,
	ECX_CONSUMER_PARAM_REGCACHE_MAX = 1u << 6,
	ECX_CONSUMER_PARAM_INTEGRITY = 1u << 7,
	ECX_CONSUMER_PARAM_MOONCAKE = 1u << 8,
	ECX_CONSUMER_PARAM_MOONCAKE_HOST = 1u << 9,
};

typedef struct ecx_consumer_params {
	uint64_t field_mask;
	const char *registry; /* registry URLs, comma-separated; none (or
	                         "") for a push-only consumer, whose
	                         lookups then fail with ECX_EINVAL */
	const char *token;
	int timeout_ms;         /* bound on every wait, default 5000 */
	uint64_t recv_capacity; /* receive arena, default 256 MiB; 0: none */
	const char *transport;  /* "auto" (default), "tcp", "shm" */
	const char *bind_host;  /* restrict UCX TCP to this address's
	                           interface; default none */
	unsigned regcache_max;  /* caller-memory registrations kept, default
	                           64 */
	int integrity;          /* check each loaded item against the hash
	                           (XXH3; xxh64 from older producers) its
	                           producer computed at put: a mismatch
	                           fails the item with ECX_ECORRUPT, and a
	                           producer that sends no hash fails it with
	                           ECX_EUNSUPPORTED; default false */
	/* Mooncake TransferEngine's TCP wire, which producers that speak only
	 * the reference's protocol (ECX_EPOCH_REFERENCE) write with:
	 * "auto" (default): their items are loaded with the reference's pull
	 * op into this consumer's Mooncake receiver, started at the first;
	 * "off": no receiver, their items fail with ECX_EUNSUPPORTED;
	 * "force": every item is loaded that way, an ecx producer's too (for
	 * tests and benchmarks; the reference's pull sends no token). The
	 * environment variable ECX_MOONCAKE sets it when this field is not
	 * given. */
	const char *mooncake;
	/* The host in the receiver's session name (what producers connect
	 * to); default bind_host, else this host's first non-loopback IPv4
	 * address. The receiver listens on every address unless bind_host is
	 * given. */
	const char *mooncake_host;
} ecx_consumer_params;

ECX_API int ecx_consumer_create(const ecx_consumer_params *params,
                                ecx_consumer **out, char *why, size_t whylen);

/* An item's epoch when its registry entry is in the reference's shape
 * (nbytes, shape, dtype, producer_zmq and none of ecx's fields): its
 * producer speaks only the reference's protocol, so a load sends it the
 * reference's pull op and takes the bytes over Mooncake's TCP wire
 * (ecx_consumer_params.mooncake), with no hello and no lease. */
#define ECX_EPOCH_REFERENCE UINT64_MAX

/* One item of a lookup or a load. lookup fills desc, producer and epoch
 * (status 0, or ECX_ENOTFOUND); load reads id, desc, producer and epoch
 * (as lookup left them, or as they came from another process) and dst, and
 * sets status: 0 when the bytes are in place, else why this item failed. */
typedef struct ecx_item {
	const char *id;
	int status;
	ecx_tensor_desc desc;
	char producer[256];
	uint64_t epoch;
	void *dst; /* desc.nbytes bytes of the caller's or the arena's */
	/* A lease a lookup took (ecx_consumer_lookup_lease), 0 for none: the
	 * load names it (its pull ends it), ecx_consumer_release ends it. */
	uint64_t lease;
} ecx_item;

/* ecx_consumer_lookup asks the registries for n ids in one round trip each.
 * Returns 0 when the registries answered (each item's status says found or
 * not), else the registry error: ECX_EINVAL when a registry URL names a
 * server that is no ecx or reference registry (a 404 other than their
 * {"detail": "unknown mm_hash"}), which is not a miss; ECX_EINVAL at once
 * without a consumer, or without items for n > 0; ECX_EID before any
 * request when an id breaks the rules (ecx_id_check; a NULL id too): that
 * item's status is ECX_EID, every other's ECX_ENOTFOUND. ecx_client_lookup
 * does the same, through the same code. Blocks up to the timeout per
 * registry. */
ECX_API int ecx_consumer_lookup(ecx_consumer *c, ecx_item *items, size_t n);

/* ecx_consumer_lookup_lease is ecx_consumer_lookup that also takes a lease
 * on each item found: "a hit will load". Each item's producer pins it for
 * lease_ms (0: ECX_LEASE_MS_DEFAULT; the producer may cut it to its
 * lease_max_ms), so that eviction cannot take it before the load that
 * follows. What the registries found is leased even when one of them
 * failed (the call then returns that registry's error, as the lookup);
 * after ECX_EID nothing is. An item's lease ends at the first of: a pull
 * that names it (ecx_consumer_load of the item, from this or another
 * process: the lease number travels in the item), ecx_consumer_release,
 * its expiry, or an explicit ecx_producer_remove of the item.
 *
 * One round trip per producer (in parallel) for up to 200 ids of it, after
 * the registry lookup. A lease the producer cannot grant (its lease share
 * of the arena is taken, the item has gone, the producer does not answer
 * within the timeout) is a miss: the item's status is ECX_ENOTFOUND and the
 * caller encodes it again. Never blocks beyond the timeout for the
 * registry and then the timeout for the producers. Sets items[i].lease (0
 * where none) and returns as ecx_consumer_lookup.
 *
 * What a lease guarantees: while it holds, its item is not evicted, so a
 * load that starts before the lease ends finds it (it can still fail for
 * another reason: a dead producer, a timeout). Its bounds: a lease lasts at
 * most lease_ms and the producer's lease_max_ms; leased items take at most
 * the producer's lease_share_pct of its arena, so a put never waits on
 * leases beyond their expiry, and puts keep the rest of the arena. */
ECX_API int ecx_consumer_lookup_lease(ecx_consumer *c, ecx_item *items,
                                      size_t n, int lease_ms);

/* ecx_consumer_release ends the leases of the n items (those with a lease
 * not 0), one round trip per producer, and sets each item's lease to 0.
 * A lease that has ended already is no error. Returns 0, or the error of a
 * producer that could not be told (its leases then end at their expiry).
 * Blocks up to the timeout. */
ECX_API int ecx_consumer_release(ecx_consumer *c, ecx_item *items, size_t n);

/* A load in flight. */
typedef struct ecx_load ecx_load;

/* ecx_consumer_load_start sends one pull per producer for the n items
 * (producers are served in parallel) and returns at once with the load in
 * *out; items and their dst memory must stay valid until the load ends.
 * Connecting to producers not connected yet blocks for those handshakes,
 * all at once (pulls to producers already connected, and to each producer
 * as soon as its handshake is answered, go first): bounded by the load's
 * deadline, the timeout counted from this call, however many producers
 * are dead or stalled. No lock is held across the network. */
ECX_API int ecx_consumer_load_start(ecx_consumer *c, ecx_item *items, size_t n,
                                    ecx_load **out);

/* ecx_load_test returns 0 when the load has ended, ECX_EBUSY while not.
 * The ecx_load_wait that follows a 0 returns at once, unless items failed
 * on a holder that is gone: then it first tries their other holders
 * (bounded by the load's deadline). */
ECX_API int ecx_load_test(ecx_load *l);

/* ecx_load_wait blocks until the load ends or the consumer's timeout from
 * its start passes (its items then fail with ECX_ETIMEDOUT), frees the load,
 * and returns 0 when every item loaded, else the first item's error.
 * A load is final: once this returns, with any status, no byte of its
 * destinations is written again (producers write nothing of a pull past
 * its expiry; receive-arena buffers a late producer could still reach are
 * kept out of ecx_consumer_alloc until it answers, says goodbye, or its
 * connection is known closed; a TCP connection whose pull timed out is
 * closed before this returns, so nothing in transit lands later). Returns
 * within the timeout + 200 ms of ecx_consumer_load_start's call,
 * handshakes included; docs/protocol.md has the contract and its one
 * window (caller memory over shared memory, a producer stopped mid-copy).
 * An item that fails on its holder with ECX_ECONNECT, ECX_ECLOSED, ECX_EIO
 * or ECX_ENOTFOUND is loaded from another holder the registry names,
 * within the same deadline (its producer and epoch are then that
 * holder's); ecx_last_error names the first failed item's holder and how
 * long ago its entry was renewed. */
ECX_API int ecx_load_wait(ecx_load *l);

/* ecx_consumer_load_notify starts loading the n items and returns at once
 * with the load in *out, without waiting for a handshake: where every
 * producer is connected its pulls go from this call, as
 * ecx_consumer_load_start's; else a thread of the library's makes the
 * connections and sends them (where a connection fails between the check
 * and the send, this call makes the handshake itself, within timeout_ms).
 * That thread then waits for the load as ecx_load_wait does, driving the
 * transfer itself (polling the worker, yielding its core between polls,
 * sleeping between them after 2 ms) where no other notified load's thread
 * of the consumer drives it already (else it looks every 20 us whether
 * its load has ended or the other is done), and ends it so (failover and
 * integrity check included, within the same bounds), unless a caller's
 * ecx_load_test found every item loaded with nothing left to check and
 * ended it first. Whichever ends it then, where fd is a socket (-1: none),
 * sends on it once, without blocking, len bytes of msg followed by one
 * int32_t per item in host order, its final status (0: loaded). A
 * connected datagram socket (AF_UNIX, SOCK_DGRAM) keeps that message
 * whole; a receiver that is gone or full misses it (logged at debug). The
 * library sends on a duplicate of fd, so the caller may close fd at any
 * time. So a caller that must not run a thread of its own (an interpreter
 * with a global lock) learns of the end from the socket, in another
 * process too. ecx_load_test progresses the worker once and returns 0
 * once the load has ended (its statuses are then final; it never blocks);
 * ecx_load_wait waits for the thread, frees the load and returns as
 * ecx_load_wait does. items and their dst memory must stay valid until
 * then. Errors: ECX_EINVAL (fd is not a socket, len above 65536),
 * ECX_ENOMEM (no memory, no thread). */
ECX_API int ecx_consumer_load_notify(ecx_consumer *c, ecx_item *items, size_t n,
                                     int fd, const void *msg, size_t len,
                                     ecx_load **out);

/* ecx_consumer_load is start then wait. */
ECX_API int ecx_consumer_load(ecx_consumer *c, ecx_item *items, size_t n);

/* ecx_consumer_alloc returns nbytes from the receive arena, or NULL when it
 * has no room (ecx_last_error says so). ecx_consumer_free gives it back. */
ECX_API void *ecx_consumer_alloc(ecx_consumer *c, size_t nbytes);
ECX_API void ecx_consumer_free(ecx_consumer *c, void *ptr);

/* The receive arena's address and size (*capacity), e.g. to page-lock it
 * for device copies (cudaHostRegister); NULL and 0 without one. Valid
 * until ecx_consumer_destroy. */
ECX_API void *ecx_consumer_arena(ecx_consumer *c, uint64_t *capacity);

/* Push windows: writes over Mooncake's TCP wire into this consumer's
 * receive arena, as upstream vLLM's push mode has an encoder make them
 * (the reservation protocol is the caller's: python/ecx/vllm/push/).
 *
 * ecx_consumer_mooncake_session starts the Mooncake receiver if it is not
 * running and sets *session to its name ("host:port", the dst_session
 * writers are given), valid until ecx_consumer_destroy. ECX_EUNSUPPORTED
 * when the consumer has the Mooncake wire off; the receiver's error when
 * it cannot start.
 *
 * ecx_consumer_push_open lets writes land in [dst, dst + nbytes), which
 * must lie inside one allocation of ecx_consumer_alloc, for timeout_ms
 * from now; nothing else of the arena takes a write. *id names the window
 * (never 0). ECX_EINVAL for a range outside one allocation,
 * ECX_EUNSUPPORTED with the Mooncake wire off. Its bytes are hashed as
 * they land (see ecx_consumer_push_close_hashed);
 * ecx_consumer_push_open_unhashed opens one whose bytes are not (where no
 * writer's hash will come to check them against, the receiver then spends
 * nothing on them; close_hashed sets *hashed to 0).
 * ecx_consumer_push_renew moves an open window's deadline to timeout_ms
 * from now (ECX_ENOTFOUND: not open).
 * ecx_consumer_push_close ends the window: once it returns, no byte lands
 * in the range through it (a write under way is cut off and refused);
 * *landed (may be NULL) is the bytes of the writes that landed whole.
 * ecx_consumer_push_close_hashed also sets *hashed to 1 where every byte
 * of the window landed exactly once, in order, through it (writes that
 * followed each other from its start to its end), with *xxh3 the XXH3 of
 * the range as they landed (ecx_xxh3's), made by the receiver as the
 * bytes came in; else to 0 (a gap, bytes written twice, bytes written
 * through another window that overlaps it; a write cut off before its
 * end leaves a gap unless the next write through the window goes on from
 * the byte where it stopped): hash the range yourself then. Close the
 * window before freeing its memory. */
ECX_API int ecx_consumer_mooncake_session(ecx_consumer *c,
                                          const char **session);
ECX_API int ecx_consumer_push_open(ecx_consumer *c, const void *dst,
                                   uint64_t nbytes, uint64_t timeout_ms,
                                   uint64_t *id);
ECX_API int ecx_consumer_push_open_unhashed(ecx_consumer *c, const void *dst,
                                            uint64_t nbytes,
                                            uint64_t timeout_ms, uint64_t *id);
ECX_API int ecx_consumer_push_renew(ecx_consumer *c, uint64_t id,
                                    uint64_t timeout_ms);
ECX_API int ecx_consumer_push_close(ecx_consumer *c, uint64_t id,
                                    uint64_t *landed);
ECX_API int ecx_consumer_push_close_hashed(ecx_consumer *c, uint64_t id,
                                           uint64_t *landed, uint64_t *xxh3,
                                           int *hashed);

typedef struct ecx_consumer_stats {
	uint64_t lookups;       /* ids looked up */
	uint64_t loads;         /* items asked for */
	uint64_t loaded;        /* items loaded */
	uint64_t failed;        /* items failed */
	uint64_t bytes;         /* bytes loaded */
	uint64_t registrations; /* memory registrations made */
	uint64_t regcache_hits; /* caller memory found registered */
	uint64_t connections;   /* producer handshakes made */
	/* pages of the caller's memory that were not resident, faulted in
	 * by the consumer before a pull into them */
	uint64_t pages_populated;
	/* Over Mooncake's wire (ecx_consumer_params.mooncake): reference
	 * pulls sent, and the bytes they landed; then what its receiver
	 * refused, by reason: a write outside every range a pull of this
	 * consumer reserved for exactly that item, one past its pull's
	 * expiry (or after its load ended), a READ, a bad header (size 0, a
	 * range that wraps), and handshakes closed unanswered (bad frame,
	 * JSON, RDMA, over the cap, out of time). */
	uint64_t mc_pulls, mc_bytes;
	uint64_t mc_rej_range, mc_rej_expired, mc_rej_read, mc_rej_header;
	uint64_t mc_hs_refused;
} ecx_consumer_stats;

ECX_API void ecx_consumer_stats_get(ecx_consumer *c, ecx_consumer_stats *out);
ECX_API const char *ecx_consumer_last_error(void);

/* ecx_consumer_destroy says goodbye to every producer it is connected to
 * (all at once; each closes its connection and unmaps this consumer's
 * memory, and answers once none of its pulls is in flight), closes its
 * endpoints and frees everything, the receive arena included. Blocks up to
 * min(timeout, 1 s) for the goodbyes: a producer that does not answer by
 * then (dead, or stopped) is left to forget this consumer by its idle
 * bound. Wait for loads in flight first (ecx_load_wait returns within the
 * timeout). Accepts NULL. */
ECX_API void ecx_consumer_destroy(ecx_consumer *c);

/* ---- Registry client ------------------------------------------------------
 */

/* Largest address (producer_zmq, registry URL) ecx keeps, with its NUL. */
#define ECX_ADDR_MAX 256

/* A registry client: lookups, listings, publishing and health of one or
 * several registries, with no data plane (no UCX context, no threads). Each
 * registry keeps one persistent connection; a registry that fails is
 * skipped for a back-off period (500 ms, doubling to 10 s) instead of
 * costing its timeout on every call. One thread uses a client at a time;
 * distinct clients are independent. */
typedef struct ecx_client ecx_client;

enum {
	ECX_CLIENT_PARAM_REGISTRY = 1u << 0,
	ECX_CLIENT_PARAM_TOKEN = 1u << 1,
	ECX_CLIENT_PARAM_TIMEOUT = 1u << 2,
	ECX_CLIENT_PARAM_CONNECT_TIMEOUT = 1u << 3,
	ECX_CLIENT_PARAM_REGISTRY_TTL = 1u << 4,
	ECX_CLIENT_PARAM_SPIN = 1u << 5,
};

typedef struct ecx_client_params {
	uint64_t field_mask;
	const char *registry;   /* required: comma-separated http://HOST:PORT
	                           or redis://[:password@]HOST[:PORT][/DB] */
	const char *token;      /* sent as Authorization: Bearer */
	int timeout_ms;         /* bound on each request, default 5000 */
	int connect_timeout_ms; /* bound on connecting, default 1000 */
	int registry_ttl_s;     /* the lease of entries it publishes (at most
	                           86400 s); default 0: the registry's own
	                           (HTTP: 30 s unless set; Redis: never) */
	int spin_us;            /* how long a request polls its connection for
	                           the answer before sleeping, 0 to 100000,
	                           default 200; 0 sleeps at once. Waking a
	                           sleeping thread can cost more than the
	                           answer takes; the poll costs CPU */
} ecx_client_params;

/* ecx_client_create checks the URLs and makes a client; nothing is
 * connected until the first request. ECX_EINVAL for a URL that is neither
 * http:// nor redis://, with the reason in why. Never blocks. */
ECX_API int ecx_client_create(const ecx_client_params *params, ecx_client **out,
                              char *why, size_t whylen);

/* ecx_client_destroy closes the connections. Accepts NULL. */
ECX_API void ecx_client_destroy(ecx_client *c);

/* ecx_client_lookup asks for n ids (items[i].id) in one round trip per
 * registry; ids missing from one registry are asked of the next. Sets each
 * item's status (0 or ECX_ENOTFOUND), and for those found desc, producer
 * and epoch. Returns 0 when every registry asked answered; otherwise the
 * last registry's error (ecx_last_error has the detail; ECX_EINVAL for a
 * URL that is no registry, as ecx_consumer_lookup), with what other
 * registries found still filled in. Blocks up to the timeout per
 * registry. */
ECX_API int ecx_client_lookup(ecx_client *c, ecx_item *items, size_t n);

/* ecx_client_lookup_lease and ecx_client_release are
 * ecx_consumer_lookup_lease and ecx_consumer_release on a registry client
 * (the client then also talks to producers' ZeroMQ sockets), for a process
 * that looks up and leases while others load: a scheduler. */
ECX_API int ecx_client_lookup_lease(ecx_client *c, ecx_item *items, size_t n,
                                    int lease_ms);
ECX_API int ecx_client_release(ecx_client *c, ecx_item *items, size_t n);

/* ecx_client_publish writes the entry of item (id, desc, producer, epoch)
 * to the first registry, as item->producer's entry for the id (other
 * producers' entries for it stay). It lives by a lease: registry_ttl_s
 * when given, else the registry's own (30 s by default on HTTP; never on
 * Redis); publish it again to renew it. Blocks for one request. */
ECX_API int ecx_client_publish(ecx_client *c, const ecx_item *item);

/* ecx_client_remove deletes id's entry from the first registry; with
 * producer not NULL, only if the entry is that producer's. ECX_ENOTFOUND
 * when nothing was removed. */
ECX_API int ecx_client_remove(ecx_client *c, const char *id,
                              const char *producer);

/* Called by ecx_client_list once per entry, in id order; item and its
 * strings are valid during the call only. A non-zero return stops the
 * listing, and ecx_client_list returns it. */
typedef int (*ecx_list_fn)(void *arg, const ecx_item *item);

/* ecx_client_list lists up to limit (1 to 1000) entries of the first
 * registry whose ids sort after `after` ("" or NULL: from the start),
 * calling fn for each. Writes the id to continue after into next (""
 * when the listing is complete) and, when total is not NULL, the number of
 * entries the registry holds. Works on HTTP registries (GET /ec/list) and
 * Redis (SCAN, sorted per page). Blocks for one request. */
ECX_API int ecx_client_list(ecx_client *c, const char *after, size_t limit,
                            ecx_list_fn fn, void *arg, char *next,
                            size_t nextlen, uint64_t *total);

/* ecx_client_health asks the first registry whether it serves, and sets
 * *epoch to its epoch (changes at each start of an HTTP registry; 0 for
 * Redis). */
ECX_API int ecx_client_health(ecx_client *c, uint64_t *epoch);

/* ecx_client_connections returns the connections opened so far, over all
 * registries (a persistent client opens one per registry). */
ECX_API long ecx_client_connections(const ecx_client *c);

/* ecx_item_to_json returns the registry entry of item ({"nbytes", "shape",
 * "dtype", "producer_zmq", "ecx_epoch"}) as a NUL-terminated string to free
 * with ecx_free, or NULL when out of memory or item's descriptor is bad. */
ECX_API char *ecx_item_to_json(const ecx_item *item);

/* ecx_item_from_json reads a registry entry (len bytes, not NUL-terminated)
 * into item's desc, producer and epoch; id and dst are left alone.
 * ECX_EPROTO, with why, when it is not a valid entry. */
ECX_API int ecx_item_from_json(const char *json, size_t len, ecx_item *item,
                               char *why, size_t whylen);

/* ecx_free frees memory that an ecx call returned to the caller. */
ECX_API void ecx_free(void *p);

#ifdef __cplusplus
}
#endif

#endif /* ECX_ECX_H */
