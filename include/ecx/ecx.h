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
#define ECX_VERSION_STRING "0.1.0"
/* One integer that orders versions: major * 10000 + minor * 100 + patch. */
#define ECX_VERSION_NUMBER                                                     \
	(ECX_VERSION_MAJOR * 10000 + ECX_VERSION_MINOR * 100 + ECX_VERSION_PATCH)

/* ecx_version returns the library's version string ("0.1.0"); it never
 * fails and the string is static. Compare with ECX_VERSION_STRING to detect a
 * header and library that disagree. */
ECX_API const char *ecx_version(void);

/* ecx_version_number returns ECX_VERSION_NUMBER of the library as built. */
ECX_API int ecx_version_number(void);

/* ---- Errors ------------------------------------------------------------- */

/* The error table. Codes are only ever appended, never renumbered. */
#define ECX_ERR_MAP(XX)                                                        \
	XX(OK, 0, "success")                                                   \
	XX(EINVAL, -1, "invalid argument")                                     \
	XX(ENOMEM, -2, "out of memory")                                        \
	XX(EPROTO, -3, "malformed message")                                    \
	XX(ETOOBIG, -4, "too large")                                           \
	XX(ENOTFOUND, -5, "unknown mm_hash")                                   \
	XX(ESIZE, -6, "size mismatch")                                         \
	XX(ETIMEDOUT, -7, "timed out")                                         \
	XX(ECONNECT, -8, "cannot connect")                                     \
	XX(EAUTH, -9, "bad or missing token")                                  \
	XX(ENOSPC, -10, "no room in arena")                                    \
	XX(EIO, -11, "transport error")                                        \
	XX(EADDRINUSE, -12, "address already in use")                          \
	XX(ECLOSED, -13, "peer closed")                                        \
	XX(EBUSY, -14, "busy")                                                 \
	XX(EDTYPE, -15, "unknown dtype")                                       \
	XX(EID, -16, "invalid id")                                             \
	XX(EUNSUPPORTED, -17, "not supported")                                 \
	XX(EINTERNAL, -18, "internal error")

typedef enum ecx_err {
#define ECX_ERR_ENUM(name, code, msg) ECX_##name = code,
	ECX_ERR_MAP(ECX_ERR_ENUM)
#undef ECX_ERR_ENUM
} ecx_err;

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
#define ECX_DTYPE_MAP(XX)                                                      \
	XX(FLOAT16, "float16", 2)                                              \
	XX(BFLOAT16, "bfloat16", 2)                                            \
	XX(FLOAT32, "float32", 4)                                              \
	XX(FLOAT64, "float64", 8)                                              \
	XX(INT8, "int8", 1)                                                    \
	XX(UINT8, "uint8", 1)                                                  \
	XX(INT16, "int16", 2)                                                  \
	XX(INT32, "int32", 4)                                                  \
	XX(INT64, "int64", 8)                                                  \
	XX(BOOL, "bool", 1)                                                    \
	XX(FLOAT8_E4M3FN, "float8_e4m3fn", 1)                                  \
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
};

/* Fields not named in field_mask take their defaults. */
typedef struct ecx_registry_params {
	uint64_t field_mask;
	const char *bind_host; /* default "0.0.0.0", as the reference */
	uint16_t port;         /* default 9018; 0 picks a free port */
	const char *token;     /* default none: writes are open */
	int token_reads;       /* default 0: reads need no token */
	unsigned threads;      /* default 2 serving threads */
	const char *store;     /* default "memory" */
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

#ifdef __cplusplus
}
#endif

#endif /* ECX_ECX_H */
