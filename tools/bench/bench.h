/* bench.h - what the files of `ecx bench` share. Where things are:
 *   cmd_bench.c       the entry point: --help, options, dispatch
 *   bench_report.c    what every benchmark uses: repetitions, the targets
 *                     and --check (with how the --quick floors were
 *                     chosen), JSON rows
 *   bench_registry.c  registry: lookups, the reference's way and ecx's
 *   bench_transfer.c  transfer: rows (one entry per transport, vias[]),
 *                     orchestration
 *   bench_integrity.c transfer: the price of integrity (the hash rows)
 *   bench_buffers.c   transfer: item sizes, memory and socket I/O
 *   bench_peers.c     transfer: the producer and the raw TCP source it
 *                     runs as child processes (--producer-for-bench,
 *                     --tcp-source-for-bench), and starting them
 *   bench_file.c      file: the file-per-item baseline
 * Calls go one way: cmd_bench.c to the benchmarks, bench_transfer.c to
 * bench_integrity.c, the benchmarks to bench_buffers.c, bench_peers.c and
 * bench_report.c, never back. */
#ifndef ECX_TOOL_BENCH_H
#define ECX_TOOL_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- options (parsed by cmd_bench.c, passed to every benchmark) ---- */

typedef struct bench_opts {
	bool quick, json, check;
	const char *redis_url; /* --redis: a Redis to compare lookups with */
	/* transfer: which rows (--via: bits of bench_via_bit), and where the
	 * producer and the raw TCP sender run (--peer-wrap, --peer-addr:
	 * another host's namespace). */
	unsigned via_mask;
	const char *peer_wrap;
	const char *peer_addr;
} bench_opts;

/* via_mask with no --via: the shm, user and tcp rows (mooncake only when
 * named). */
#define BENCH_VIA_DEFAULT \
	(bench_via_bit("shm") | bench_via_bit("user") | bench_via_bit("tcp"))
/* The via_mask bit of the rows --via names name (shm, user, tcp,
 * mooncake); 0 for a name that is none of them (bench_transfer.c). */
unsigned bench_via_bit(const char *name);

/* ---- repetitions (bench_report.c) ---- */

#define MAXREPS 16

typedef struct reps {
	double v[MAXREPS];
	int n;
} reps;

/* Repetitions of a row: 5, 3 with --quick. */
int nreps(const bench_opts *o);
/* Adds one repetition's value (beyond MAXREPS: dropped). */
void reps_add(reps *r, double x);
/* Median, min and max of the repetitions; 0 when there are none. */
double reps_med(const reps *r);
double reps_min(const reps *r);
double reps_max(const reps *r);

/* ---- targets and --check (bench_report.c) ---- */

typedef struct targets {
	double shm7_ratio;  /* shm 7 MiB warm loads, x memcpy, at least */
	double shm64_p50;   /* shm 64 KiB x1 warm p50 in us, below */
	double reg_p50;     /* registry persistent p50 in us, below */
	double reg_batch_x; /* batched ids/s over single ids/s, at least */
	double tcp_ratio;   /* tcp warm >= 1 MiB, x raw TCP, at least */
	double p99_x;       /* small x1 warm rows: p99 over p50, at most */
} targets;

/* The targets in force: the stated ones, or with --quick the floors. */
const targets *tgt(const bench_opts *o);
/* Records one check (--check): a row that misses is named on stderr and
 * counted (bench_missed). */
void check_row(const bench_opts *o, bool ok, const char *row, const char *fmt,
               ...) __attribute__((format(printf, 4, 5)));
/* Reports a row (--check) that is compared but not checked: one that
 * misses is named on stderr and does not fail the run. For --quick rows
 * whose floor cannot both hold on a loaded machine and fail a 2x
 * regression (bench_report.c says which). Counted (bench_reported). */
void report_row(const bench_opts *o, bool ok, const char *row, const char *fmt,
                ...) __attribute__((format(printf, 4, 5)));
/* The rows check_row and report_row named so far in this process. */
int bench_missed(void);
int bench_reported(void);

/* ---- output (bench_report.c) ---- */

/* Prints one JSON result line: the fields fmt gives, as a JSON fragment,
 * with "bench" and "case". */
void row_json(const char *bench, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* "0.85 [0.80-0.90]": median [min-max] with dec decimals, in buf. */
const char *fmt_reps(const reps *r, int dec, char *buf, size_t len);

/* ---- item sizes (bench_buffers.c; the file benchmark's too) ---- */

typedef struct bench_size {
	const char *name;
	uint64_t rows, cols; /* bfloat16 */
	int pool;            /* distinct items the producer holds */
} bench_size;

#define NSIZES 3
extern const bench_size sizes[NSIZES]; /* 64 KiB, 1 MiB, 7 MiB */

/* TCP_NODELAY on a socket (bench_peers.c; the registry's floor too). */
void tcp_tune(int fd);
/* The kernel's TCP buffer ceilings and congestion control, as "up to S
 * send, R receive, congestion control C", for a table header
 * (bench_peers.c). */
void tcp_limits(char *buf, size_t len);
/* The congestion control new TCP connections of this process's network
 * namespace take (net.ipv4.tcp_congestion_control: ecx's, through UCX,
 * and the raw TCP baseline's alike; with --peer-wrap the sender's
 * namespace may differ, bench/two_hosts.sh sets both), into buf; "unknown" when
 * it cannot be read. Returns buf. With bbr, pacing held both to about 2.2 GB/s
 * on this machine kind where cubic let them move 6-9 (docs/deploy.md, "The
 * congestion control decides these figures"). */
const char *tcp_cc(char *buf, size_t len);

/* bench_buffers.c: the bytes of one item of size s; a pool of as many
 * items as the producer holds of it, holding the producer's bytes; memory
 * never touched before (fresh_map: each call maps afresh) or pre-faulted
 * (warm_alloc); whether every page of [p, p+n) is in memory (resident,
 * by mincore). */
size_t size_bytes(int s);
char *pool_alloc(int s);
void *fresh_map(size_t n);
void *warm_alloc(size_t n);
bool resident(const void *p, size_t n);
/* Loads per timed block of loads of bytes each (bench_buffers.c). */
int block_iters(const bench_opts *o, size_t bytes);

/* A request to the raw TCP source: send `count` items of `bytes` from
 * its pool, starting at item `first`. */
typedef struct tcp_req {
	uint64_t bytes;
	uint32_t first, count;
} tcp_req;

/* IO_RECV: receive blocking in recv. IO_POLL: receive without sleeping,
 * polling the socket as ecx's consumer polls its worker during a load
 * (faster across a veth, docs/bench.md); but on a 2-core machine over
 * loopback a spinning receiver can take the core its sender needs. So the raw
 * TCP baseline receives both ways in each repetition and counts the faster
 * (bench_row). IO_POLL gives up after 30 s without a byte (ETIMEDOUT),
 * as IO_RECV does on the consumer's socket (SO_RCVTIMEO, set in
 * tcp_source_start); an end of file fails with ECONNRESET. */
typedef enum { IO_SEND, IO_RECV, IO_POLL } io_mode;
/* All n bytes at p sent or received on fd the way m says; false on an
 * error or end of file (errno says which). */
bool full_io(int fd, void *p, size_t n, io_mode m);

/* The transfer benchmark's side of its peers (bench_peers.c): starts the
 * raw TCP source (through --peer-wrap, at --peer-addr) and connects *fd to
 * it; waits (up to 60 s) until a lookup through c finds every item of the
 * producer's pools, so that no row runs while it is still publishing. */
struct proc;
struct ecx_consumer;
bool tcp_source_start(const bench_opts *o, struct proc *pr, int *fd);
bool producer_settled(struct ecx_consumer *c);

/* ---- the benchmarks: each returns an exit code ---- */

int bench_registry(const bench_opts *o); /* bench_registry.c */
int bench_transfer(const bench_opts *o); /* bench_transfer.c */
int bench_file(const bench_opts *o);     /* bench_file.c */
/* The price of integrity (bench_integrity.c): warm loads of nb items (at
 * most INTEGRITY_MAXBATCH) of size s into the receive arena by a consumer
 * that checks each item's hash (hashed) beside the same loads by one that
 * does not (plain), alternating blocks, each first in turn; a `hash` row
 * labelled label (json in --json). False when a load fails. */
#define INTEGRITY_MAXBATCH 32
bool bench_integrity(const bench_opts *o, struct ecx_consumer *plain,
                     struct ecx_consumer *hashed, const char *label,
                     const char *json, int s, int nb);
/* The transfer benchmark's child processes (bench_peers.c), run as
 * `ecx bench --producer-for-bench TRANSPORT` (serves until SIGTERM) and
 * `ecx bench --tcp-source-for-bench` (until its connection ends). */
int bench_producer(const bench_opts *o, const char *transport);
int bench_tcp_source(const bench_opts *o);

#endif
