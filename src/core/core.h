/*
 * core.h - internal helpers every layer uses: logging, error details,
 * clocks, base64, safe string copies and facts about this host. Not part
 * of the public API.
 *
 * May include: the public header and libc only. Never: another layer, or
 * any I/O beyond the log, this host's addresses and
 * /dev/urandom.
 */
#ifndef ECX_CORE_H
#define ECX_CORE_H

#include <ecx/ecx.h>

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Largest integer that a JSON peer reading numbers as doubles gets exactly. */
#define ECX_JSON_INT_MAX ((uint64_t)1 << 53)

/* ---- logging ---- */

typedef enum ecx_log_level {
	ECX_LOG_OFF = 0,
	ECX_LOG_ERROR = 1,
	ECX_LOG_WARN = 2,
	ECX_LOG_INFO = 3,
	ECX_LOG_DEBUG = 4,
} ecx_log_level;

/* ecx_log_enabled says whether a message of this level is printed. The level
 * comes from the ECX_LOG environment variable (error, warn, info, debug,
 * off), read once; the default is warn. */
bool ecx_log_enabled(ecx_log_level lvl);

/* ecx_log_set_level overrides ECX_LOG (the command uses it for -v). */
void ecx_log_set_level(ecx_log_level lvl);

/* ecx_log_parse maps a level name to its value; -1 for an unknown name. */
int ecx_log_parse(const char *name);

/* ecx_logf writes one line to stderr: time, pid, level, module, message.
 * The line is written with a single write(2) so lines of threads and
 * processes do not interleave. */
void ecx_logf(ecx_log_level lvl, const char *mod, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define ECX_LOG_AT(lvl, mod, ...)                        \
	do {                                             \
		if (ecx_log_enabled(lvl))                \
			ecx_logf(lvl, mod, __VA_ARGS__); \
	} while (0)
#define ecx_error(mod, ...) ECX_LOG_AT(ECX_LOG_ERROR, mod, __VA_ARGS__)
#define ecx_warn(mod, ...) ECX_LOG_AT(ECX_LOG_WARN, mod, __VA_ARGS__)
#define ecx_info(mod, ...) ECX_LOG_AT(ECX_LOG_INFO, mod, __VA_ARGS__)
#define ecx_debug(mod, ...) ECX_LOG_AT(ECX_LOG_DEBUG, mod, __VA_ARGS__)

/* ---- error details ---- */

/* ecx_why formats a one-line reason into why (if why is not NULL and
 * whylen > 0) and returns err, so a failure reads
 * `return ecx_why(why, whylen, ECX_EPROTO, "...", ...);`. */
int ecx_why(char *why, size_t whylen, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- strings ---- */

/* ecx_hex_digit is the value of hex digit c (either case), or -1. */
int ecx_hex_digit(char c);
/* ecx_strlcpy copies at most n-1 bytes and terminates; returns strlen(src). */
size_t ecx_strlcpy(char *dst, const char *src, size_t n);

/* ecx_hash_str is FNV-1a of a NUL-terminated string (for hash tables and
 * seeds; not for anything an attacker should not collide). */
uint64_t ecx_hash_str(const char *s);

/* ecx_ct_equal compares two byte strings in time that depends only on their
 * lengths (for tokens). */
bool ecx_ct_equal(const char *a, size_t alen, const char *b, size_t blen);

/* ---- clocks ---- */

/* Monotonic time in nanoseconds and milliseconds. */
uint64_t ecx_now_ns(void);
static inline uint64_t ecx_now_ms(void)
{
	return ecx_now_ns() / 1000000u;
}
/* Wall-clock time in milliseconds since 1970: the one clock two processes
 * can compare (pull expiries, corrected by the offset the hello measures). */
uint64_t ecx_wall_ms(void);

/* ---- memory ---- */

/* The kernel's page size, sysconf(_SC_PAGESIZE) (4 KiB on most kernels,
 * 64 KiB on some arm64 ones, e.g. GH200), read once; 4096 if it cannot be
 * read. */
uint64_t ecx_page_size(void);

/* ---- base64 (RFC 4648, with padding) ---- */

/* Length of the encoding of n bytes, without the terminating NUL. */
static inline size_t ecx_b64_enclen(size_t n)
{
	return (n + 2) / 3 * 4;
}

/* ecx_b64_encode writes the encoding and a NUL into out, which holds at
 * least ecx_b64_enclen(n) + 1 bytes. */
void ecx_b64_encode(const void *in, size_t n, char *out);

/* ecx_b64_decode decodes len characters into out (room outcap). Returns the
 * decoded length, or -1 for bad characters, bad padding, or too little room. */
long ecx_b64_decode(const char *in, size_t len, void *out, size_t outcap);

/* ---- this host (host.c) ---- */

/* ecx_default_host writes this host's first non-loopback IPv4 address, or
 * 127.0.0.1, to out. */
void ecx_default_host(char *out, size_t len);
/* ecx_random_epoch returns a fresh non-zero number below 2^53 that tells
 * one start of a process from another. */
uint64_t ecx_random_epoch(void);
/* ecx_shm_domain writes who this process can share memory with: the boot,
 * the IPC, PID and mount namespaces, and the effective user. Two processes
 * with equal domains can map each other's segments (UCX's posix and sysv
 * transports) and write with cross-memory attach; otherwise they must use
 * TCP. */
void ecx_shm_domain(char *out, size_t len);
/* ecx_pid_start returns the start time of process pid (clock ticks after
 * boot, /proc/PID/stat), which tells it from a later process that gets
 * the same number; 0 when it cannot be read. */
uint64_t ecx_pid_start(long pid);
/* ecx_pid_watch returns a descriptor (pidfd, close-on-exec, the caller's to
 * close) that ecx_pid_gone polls for the end of process pid started at
 * start; -2 when that process is gone already; -3 when it lives but
 * pidfd_open is not there (Linux before 5.3, valgrind): ecx_pid_exited
 * then tells; -1 when it cannot be watched (no start time). */
int ecx_pid_watch(long pid, uint64_t start);
/* ecx_pid_exited says whether process pid started at start has ended
 * (exited, or a zombie), from /proc: no longer there, another process's
 * start time, or state Z or X. */
bool ecx_pid_exited(long pid, uint64_t start);
/* ecx_pid_gone says, without blocking, whether the process of a descriptor
 * from ecx_pid_watch has exited. */
bool ecx_pid_gone(int fd);
/* ecx_mem_fits returns 0 when len bytes of memory (what names them in a
 * failure: "an arena") fit in this host's available memory (MemAvailable
 * of /proc/meminfo), under the memory limit of its control group (v1 or
 * v2, page cache counted as room) and, with posix_dir not NULL, in the free
 * space of the file system there; else ECX_ENOMEM, with a detail naming len and
 * what is available. *sysv says whether len is within the System V
 * segment limits (kernel.shmmax and shmall). What cannot be read counts as
 * fitting. */
int ecx_mem_fits(const char *what, uint64_t len, const char *posix_dir,
                 bool *sysv, char *why, size_t whylen);

/* ---- copies (copy.c) ---- */

/* ecx_copy_offset_slow says whether this CPU copies much more slowly (4x
 * or more) into a destination off bytes (1-63) past its source modulo 4 KiB
 * than 64 bytes past it, measured at the first call (24 copies of 64 KiB:
 * well under a millisecond where there is no penalty) and kept; *ratio,
 * where not NULL, gets the measured slowdown (0 when it could not be
 * measured, which counts as slow). */
bool ecx_copy_offset_slow(size_t off, double *ratio);

/* ---- handles used after fork ---- */

/* ecx_forked says whether the calling process is not owner (the process
 * that created a handle, what names its kind: "consumer"); if so it sets
 * the last error (ECX_EFORK, naming both processes). A forked child holds
 * a copy of the handle's UCX, ZeroMQ and libcurl state, and of its locks
 * as other threads held them: a public call there must touch none of it
 * (UCX's shared-memory FIFOs are the parent's too). */
bool ecx_forked(int owner, const char *what);

/* ---- the calling thread's last error detail (ecx_last_error) ---- */

/* ecx_set_error formats the detail of a failure of a public call and
 * returns err. */
int ecx_set_error(int err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* core_last_error is the calling thread's detail, "" before any. */
const char *core_last_error(void);

/* ---- errors, ids, dtypes, tensors (err.c, types.c) ---- */

/* The engines of ecx_strerror, ecx_err_name, ecx_id_check,
 * ecx_dtype_name, ecx_dtype_size, ecx_dtype_parse, ecx_tensor_nbytes,
 * ecx_tensor_check and ecx_tensor_set (ecx.h has their contracts), which
 * every layer uses; api/common.c makes them public. */
const char *core_strerror(int err);
const char *core_err_name(int err);
int core_id_check(const char *id, char *why, size_t whylen);
const char *core_dtype_name(ecx_dtype dt);
size_t core_dtype_size(ecx_dtype dt);
int core_dtype_parse(const char *name, ecx_dtype *out);
int core_tensor_nbytes(const ecx_tensor_desc *d, uint64_t *out);
int core_tensor_check(const ecx_tensor_desc *d, char *why, size_t whylen);
int core_tensor_set(ecx_tensor_desc *d, ecx_dtype dtype, uint32_t ndim,
                    const uint64_t *shape);

/* ---- masked URLs (mask.c) ---- */

/* The engine of ecx_url_mask (ecx.h has its contract); the log masks
 * every line with it. */
void core_url_mask(const char *text, char *buf, size_t len);

/* ---- sizes (size.c) ---- */

/* The engine of ecx_size_parse (ecx.h has its contract). */
int core_size_parse(const char *s, uint64_t *out, char *why, size_t whylen);
#endif /* ECX_CORE_H */
