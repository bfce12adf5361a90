/* bench_transfer.c - the transfer benchmark (`ecx bench transfer`). */
#include "tool.h"

#include "bench.h"
#include "gen.h"
#include "proc.h"
#include "stats.h"

#include <errno.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- transfer: batches ---- */

static const int batches[] = {1, 8, 32};
#define NBATCH 3
#define MAXBATCH 32

/* ---- transfer: rows ---- */

/* The rows' transports, one entry each (the order they run in): the
 * --via name, the table's label, the JSON "case", the transport the
 * producer and consumer use, whether the baseline is raw TCP from another
 * process (else memcpy) and whether the loads go into the caller's memory
 * (else into the receive arena). A transport's rows are its entry here;
 * the --check targets name the rows they hold for (bench_row). */
/* mc: over TCP, each item a reference pull op answered by a write over
 * Mooncake's TCP wire (the consumer's mooncake=force), against the same
 * raw TCP baseline; the consumers of the other rows have mooncake off. It
 * runs only when --via names it. */
typedef enum { VIA_SHM, VIA_USER, VIA_TCP, VIA_MC, NVIA } via;
static const struct via_row {
	const char *opt, *label, *json, *transport, *mooncake;
	bool raw_tcp, user_memory;
} vias[NVIA] = {
    [VIA_SHM] = {"shm", "shm", "shm", "shm", "off", false, false},
    [VIA_USER] = {"user", "shm*", "shm_user_memory", "shm", "off", false, true},
    [VIA_TCP] = {"tcp", "tcp", "tcp", "tcp", "off", true, false},
    [VIA_MC] = {"mooncake", "mc", "mooncake", "tcp", "force", true, false},
};

unsigned bench_via_bit(const char *name)
{
	for (int v = 0; v < NVIA; v++)
		if (strcmp(name, vias[v].opt) == 0)
			return 1u << v;
	return 0;
}

/* --quick: the warm rows' median ratios of the shm 7 MiB rows (GROUP_SHM7)
 * and of the tcp rows of 1 MiB and 7 MiB (GROUP_TCP), checked as groups. */
enum { GROUP_SHM7, GROUP_TCP, NGROUP };

typedef struct bench_ctx {
	const bench_opts *o;
	reps *groups; /* [NGROUP], bench_transfer's */
	via v;
	ecx_consumer *c;
	int tcp;                   /* connection to the raw TCP source */
	char *bsrc, *bdst;         /* baseline pools of the current size */
	void *wdst[MAXBATCH];      /* warm destinations (ecx) */
	void **cdst;               /* cold destinations (ecx, arena): a ring */
	ecx_item witems[MAXBATCH]; /* warm items, looked up once a row */
	bool wlooked;
	bool warmed; /* the connection's first messages sent (WARM_LOADS) */
	int cur_ecx, cur_base; /* cold rotations */
} bench_ctx;

/* Untimed loads before the first row of a connection. Over shared memory
 * UCX's receive FIFO and its descriptors are touched for the first time,
 * page by page, by each side over about the first 64 messages of a
 * connection: on this kind of machine a load then and again took 30-70
 * us instead of 9 (loads 18-19, 28-29, 38-41 and 60-62 of the
 * connection, every run; docs/bench.md, "Where the small loads' tail
 * comes from"), a cost once per connection that the first row's tail
 * would otherwise carry. */
#define WARM_LOADS 128

/* The pool index of a load's first item: 0 when warm; when cold, the
 * rotation *cur, which moves on by the nb items taken. */
static int load_first(int *cur, int nb, bool cold, int pool)
{
	int first = cold ? *cur : 0;
	if (cold)
		*cur = (*cur + nb) % pool;
	return first;
}

/* Poison written over a destination before a load whose bytes are checked,
 * untimed: a load that wrote nothing there must not pass on bytes an
 * earlier load left. */
#define POISON 0x5a

/* Whether the nb destinations hold items first.. of size s's pool, as the
 * producer made them; else fails naming who (what) wrote them. */
static bool check_items(const char *what, int s, int first, int nb,
                        void *const *dst)
{
	for (int k = 0; k < nb; k++) {
		char id[64];
		snprintf(id, sizeof(id), "%s-%d", sizes[s].name,
		         (first + k) % sizes[s].pool);
		if (!gen_check(id, dst[k], size_bytes(s))) {
			tool_fail("bench", EXIT_FAIL, "%s: %s: bytes differ",
			          what, id);
			return false;
		}
	}
	return true;
}

/* One baseline load of nb items of size s: memcpy or raw TCP (received
 * the way rm says: IO_RECV or IO_POLL), from items `first`.. of the pool
 * into destinations prepared as ecx's are. verify: poison them first and
 * check every byte after (untimed). */
static bool base_load(bench_ctx *x, int s, int nb, bool cold, io_mode rm,
                      bool verify, uint64_t *ns)
{
	size_t sz = size_bytes(s);
	int pool = sizes[s].pool;
	int first = load_first(&x->cur_base, nb, cold, pool);
	char *dst[MAXBATCH];
	for (int k = 0; k < nb; k++) {
		if (cold && vias[x->v].user_memory)
			dst[k] = fresh_map(sz);
		else
			dst[k] = x->bdst + (size_t)((first + k) % pool) * sz;
		if (dst[k] == NULL)
			return false;
		if (verify)
			memset(dst[k], POISON, sz);
	}
	bool ok = true;
	uint64_t t0 = tool_now_ns();
	if (vias[x->v].raw_tcp) {
		tcp_req q = {.bytes = sz,
		             .first = (uint32_t)first,
		             .count = (uint32_t)nb};
		ok = full_io(x->tcp, &q, sizeof(q), IO_SEND);
		for (int k = 0; k < nb && ok; k++)
			ok = full_io(x->tcp, dst[k], sz, rm);
		if (!ok)
			tool_fail("bench", EXIT_FAIL, "raw TCP baseline: %m");
	} else {
		for (int k = 0; k < nb; k++)
			memcpy(dst[k],
			       x->bsrc + (size_t)((first + k) % pool) * sz, sz);
	}
	*ns = tool_now_ns() - t0;
	if (ok && verify)
		ok = check_items(vias[x->v].raw_tcp ? "raw TCP baseline"
		                                    : "memcpy baseline",
		                 s, first, nb, (void *const *)dst);
	if (cold && vias[x->v].user_memory)
		for (int k = 0; k < nb; k++)
			munmap(dst[k], sz);
	return ok;
}

/* One ecx load of nb items of size s. Lookups and allocations are not
 * timed; the load is. verify: poison the destinations first and check
 * every byte after (untimed). */
static bool ecx_load_one(bench_ctx *x, int s, int nb, bool cold, bool verify,
                         uint64_t *ns)
{
	size_t sz = size_bytes(s);
	int pool = sizes[s].pool;
	int first = load_first(&x->cur_ecx, nb, cold, pool);
	ecx_item it[MAXBATCH];
	char ids[MAXBATCH][64];
	memset(it, 0, sizeof(it));
	for (int k = 0; k < nb; k++) {
		snprintf(ids[k], sizeof(ids[k]), "%s-%d", sizes[s].name,
		         (first + k) % pool);
		it[k].id = ids[k];
	}
	/* Warm: looked up once, at the row's first load. */
	if (!cold && x->wlooked) {
		memcpy(it, x->witems, sizeof(it[0]) * (size_t)nb);
		for (int k = 0; k < nb; k++)
			it[k].id = ids[k];
	} else if (ecx_consumer_lookup(x->c, it, (size_t)nb) != 0) {
		tool_fail("bench", EXIT_FAIL, "lookup: %s", ecx_last_error());
		return false;
	} else if (!cold) {
		memcpy(x->witems, it, sizeof(it[0]) * (size_t)nb);
		x->wlooked = true;
	}
	bool ok = true;
	for (int k = 0; k < nb; k++) {
		if (!cold)
			it[k].dst = x->wdst[k];
		else if (vias[x->v].user_memory)
			it[k].dst = fresh_map(sz);
		else
			it[k].dst = x->cdst[(first + k) % pool];
		if (it[k].dst == NULL) {
			tool_fail("bench", EXIT_FAIL, "no memory for %s",
			          ids[k]);
			nb = k;
			ok = false;
		} else if (verify && !(cold && vias[x->v].user_memory)) {
			memset(it[k].dst, POISON, sz); /* fresh maps are 0 */
		}
	}
	if (ok) {
		uint64_t t0 = tool_now_ns();
		int e = ecx_consumer_load(x->c, it, (size_t)nb);
		*ns = tool_now_ns() - t0;
		if (e != 0) {
			tool_fail("bench", EXIT_FAIL, "load: %s",
			          ecx_last_error());
			ok = false;
		}
	}
	for (int k = 0; k < nb && ok && verify; k++)
		if (!gen_check(it[k].id, it[k].dst, sz)) {
			tool_fail("bench", EXIT_FAIL, "%s: bytes differ",
			          it[k].id);
			ok = false;
		}
	if (cold && vias[x->v].user_memory)
		for (int k = 0; k < nb; k++)
			munmap(it[k].dst, sz);
	return ok;
}

/* One row: repetitions of a baseline block then an ecx block. Raw TCP
 * runs two baseline blocks, a blocking receiver's and a polling one's (in
 * turn first), and the faster is the repetition's baseline. */
static bool bench_row(bench_ctx *x, int s, int bi, bool cold)
{
	const bench_opts *o = x->o;
	int nb = batches[bi];
	size_t bytes = size_bytes(s) * (size_t)nb;
	int iters = block_iters(o, bytes), R = nreps(o);
	int nbase = vias[x->v].raw_tcp ? 2 : 1;
	reps ratio = {0}, eg = {0}, bg = {0}, p50r = {0}, bmode[2];
	memset(bmode, 0, sizeof(bmode)); /* 0: IO_RECV, 1: IO_POLL */
	/* Every ecx load of the row; every load of each repetition's
	 * baseline (the faster mode's, for raw TCP). */
	samples lat = {0}, blat = {0};
	/* The untimed first loads of single-load blocks, ecx's and the
	 * baseline's: what a load costs after the other's block (--json). */
	samples first = {0}, bfirst = {0};
	uint64_t ns;
	bool ok = true;
	x->wlooked = false;
	/* Warm rows load into the same destinations every time: the
	 * receive arena's, or the caller's memory faulted in beforehand. */
	for (int k = 0; k < nb && !cold; k++) {
		x->wdst[k] = vias[x->v].user_memory
		                 ? warm_alloc(size_bytes(s))
		                 : ecx_consumer_alloc(x->c, size_bytes(s));
		if (x->wdst[k] == NULL)
			ok =
			    tool_fail("bench", EXIT_FAIL, "out of memory") == 0;
	}
	/* Cold rows into the receive arena take their destinations from a
	 * ring of allocations as large as the pool, in the order the
	 * baseline takes its own (bdst): each is used again only after at
	 * least 32 MiB of loads, so neither side writes to cached memory.
	 * (An allocation made and freed per load would come back at the
	 * same place every time, and stay in the cache.) */
	int pool = sizes[s].pool;
	if (cold && !vias[x->v].user_memory) {
		x->cdst = calloc((size_t)pool, sizeof(*x->cdst));
		if (x->cdst == NULL)
			ok =
			    tool_fail("bench", EXIT_FAIL, "out of memory") == 0;
		for (int k = 0; k < pool && ok; k++)
			ok = (x->cdst[k] = ecx_consumer_alloc(
			          x->c, size_bytes(s))) != NULL;
		if (!ok && x->cdst != NULL)
			tool_fail("bench", EXIT_FAIL,
			          "no room in the receive arena for %d cold "
			          "destinations",
			          pool);
		/* Then one untimed pass over the ring. A producer maps a
		 * consumer's arena part by part, at the first pull into each
		 * part (producer/rkeys.c, prod_rkey_prefault): a cost once
		 * per connection, not the cache misses a cold row measures
		 * (docs/bench.md gives what it added). Every pool is a
		 * multiple of every batch, so pool / nb loads cover the
		 * ring. */
		for (int k = 0; k < pool / nb && ok; k++)
			ok = ecx_load_one(x, s, nb, true, false, &ns);
	}
	/* One of each, untimed, so first-time costs of the row (a first
	 * registration of warm destinations) fall outside. */
	for (int m = 0; m < nbase && ok; m++)
		ok =
		    base_load(x, s, nb, cold, m ? IO_POLL : IO_RECV, true, &ns);
	ok = ok && ecx_load_one(x, s, nb, cold, true, &ns);
	for (int k = 0; k < WARM_LOADS && ok && !x->warmed; k++)
		ok = ecx_load_one(x, s, nb, cold, false, &ns);
	x->warmed = true;
	/* Every byte is checked in untimed loads, this one and one after the
	 * repetitions: checking between timed loads would let the
	 * producer's progress thread go to sleep before each. */
	for (int r = 0; r < R && ok; r++) {
		samples b[2] = {{0}}, e = {0};
		double bgb = 0;
		for (int j = 0; j < nbase && ok; j++) {
			int m = (j + r) % nbase; /* 0: IO_RECV, 1: IO_POLL */
			if (nb == 1) {
				ok = base_load(x, s, nb, cold,
				               m ? IO_POLL : IO_RECV, false,
				               &ns);
				samples_add(&bfirst, ns);
			}
			for (int i = 0; i < iters && ok; i++) {
				ok = base_load(x, s, nb, cold,
				               m ? IO_POLL : IO_RECV, false,
				               &ns);
				samples_add(&b[m], ns);
			}
		}
		/* A single load's block, ecx's and the baseline's alike,
		 * starts with one untimed load: the other's block before it
		 * (1.6 ms of memcpy at 1 MiB, more for raw TCP) let the
		 * producer's progress thread go to sleep (after 200 us idle),
		 * and waking a thread that slept 1 ms costs 50-70 us on this
		 * kind of machine (bench/machine_tail.c): five such first
		 * loads of a row's 200 made its p99 the wake-up's, which a
		 * row of back-to-back loads is not about. */
		if (nb == 1 && ok) {
			ok = ecx_load_one(x, s, nb, cold, false, &ns);
			samples_add(&first, ns);
		}
		for (int i = 0; i < iters && ok; i++) {
			ok = ecx_load_one(x, s, nb, cold, false, &ns);
			samples_add(&e, ns);
			samples_add(&lat, ns);
		}
		if (ok) {
			int best = 0;
			for (int m = 0; m < nbase; m++) {
				double g = (double)bytes /
				           (double)samples_pct(&b[m], 50);
				reps_add(&bmode[m], g);
				if (g > bgb)
					best = m;
				bgb = g > bgb ? g : bgb;
			}
			for (size_t q = 0; q < b[best].n; q++)
				samples_add(&blat, b[best].v[q]);
			double egb =
			    (double)bytes / (double)samples_pct(&e, 50);
			reps_add(&bg, bgb);
			reps_add(&eg, egb);
			reps_add(&ratio, egb / bgb);
			reps_add(&p50r, (double)samples_pct(&e, 50) / 1e3);
		}
		samples_free(&b[0]);
		samples_free(&b[1]);
		samples_free(&e);
	}
	ok = ok && ecx_load_one(x, s, nb, cold, true, &ns);
	for (int k = 0; k < pool && x->cdst != NULL; k++)
		if (x->cdst[k] != NULL)
			ecx_consumer_free(x->c, x->cdst[k]);
	free(x->cdst);
	x->cdst = NULL;
	for (int k = 0; k < nb && !cold; k++) {
		if (vias[x->v].user_memory)
			free(x->wdst[k]);
		else if (x->wdst[k] != NULL)
			ecx_consumer_free(x->c, x->wdst[k]);
		x->wdst[k] = NULL;
	}
	if (!ok) {
		samples_free(&lat);
		samples_free(&blat);
		samples_free(&first);
		samples_free(&bfirst);
		return false;
	}
	double p50 = (double)samples_pct(&lat, 50) / 1e3;
	double p99 = (double)samples_pct(&lat, 99) / 1e3;
	/* The baseline's own tail, the same percentiles of its loads: what
	 * the machine does to a load that has no ecx in it, for judging
	 * ecx's p99 over p50 (the x1 rows' check). */
	double b50 = (double)samples_pct(&blat, 50) / 1e3;
	double b99 = (double)samples_pct(&blat, 99) / 1e3;
	const char *cache = cold ? "cold" : "warm";
	char buf[96], row[96], modes[384] = "", cc[32];
	size_t off = 0;
	if (vias[x->v].raw_tcp)
		off = (size_t)snprintf(modes, sizeof(modes),
		                       ", \"baseline_blocking_gbps\": %.3f, "
		                       "\"baseline_polling_gbps\": %.3f, "
		                       "\"tcp_cc\": \"%s\"",
		                       reps_med(&bmode[0]), reps_med(&bmode[1]),
		                       tcp_cc(cc, sizeof(cc)));
	if (nb == 1 && off < sizeof(modes))
		snprintf(modes + off, sizeof(modes) - off,
		         ", \"first_load_p50_us\": %.1f, "
		         "\"baseline_first_load_p50_us\": %.1f",
		         (double)samples_pct(&first, 50) / 1e3,
		         (double)samples_pct(&bfirst, 50) / 1e3);
	snprintf(row, sizeof(row), "transfer %s %s x%d %s", vias[x->v].label,
	         sizes[s].name, nb, cache);
	if (o->json)
		row_json(
		    "transfer", vias[x->v].json,
		    "\"size\": \"%s\", \"batch\": %d, \"cache\": \"%s\", "
		    "\"gbps\": %.3f, \"p50_us\": %.1f, \"p99_us\": %.1f, "
		    "\"baseline\": \"%s\", \"baseline_gbps\": %.3f, "
		    "\"ratio\": %.3f, \"ratio_min\": %.3f, "
		    "\"ratio_max\": %.3f, \"p50_us_best_rep\": %.1f, "
		    "\"ratio_of_bests\": %.3f, \"reps\": %d, \"loads\": %d, "
		    "\"baseline_p50_us\": %.1f, \"baseline_p99_us\": %.1f%s",
		    sizes[s].name, nb, cache, reps_med(&eg), p50, p99,
		    vias[x->v].raw_tcp ? "raw_tcp" : "memcpy", reps_med(&bg),
		    reps_med(&ratio), reps_min(&ratio), reps_max(&ratio),
		    reps_min(&p50r), reps_max(&eg) / reps_max(&bg), R, iters,
		    b50, b99, modes);
	else
		printf("  %-4s %6s x%-3d %-4s %8.2f %9.1f %9.1f %9.2f   %s\n",
		       vias[x->v].label, sizes[s].name, nb, cache,
		       reps_med(&eg), p50, p99, reps_med(&bg),
		       fmt_reps(&ratio, 2, buf, sizeof(buf)));
	fflush(stdout);
	/* --check: each row against its target; --quick: the median of a
	 * group's rows (shm 7 MiB, tcp >= 1 MiB), and the best repetition's
	 * p50 (load only adds to a latency), against its floor. */
	const targets *t = tgt(o);
	if (!cold && x->v == VIA_SHM && s == 2) {
		if (o->quick)
			reps_add(&x->groups[GROUP_SHM7], reps_med(&ratio));
		else
			check_row(o, reps_med(&ratio) >= t->shm7_ratio, row,
			          "%.2fx memcpy, below %.2fx", reps_med(&ratio),
			          t->shm7_ratio);
	}
	if (!cold && x->v == VIA_SHM && s == 0 && nb == 1) {
		double v = o->quick ? reps_min(&p50r) : p50;
		(o->quick ? report_row : check_row)(
		    o, v < t->shm64_p50, row,
		    "%sp50 %.1f us, not below %.0f us",
		    o->quick ? "best repetition's " : "", v, t->shm64_p50);
	}
	/* The small single loads keep their tail near their median: p99 of
	 * every load of the row at most p99_x times its p50. */
	if (!cold && nb == 1 && s <= 1 && (x->v == VIA_SHM || x->v == VIA_TCP))
		(o->quick ? report_row : check_row)(
		    o, p99 <= t->p99_x * p50, row,
		    "p99 %.1f us is %.1fx its p50 %.1f us, over %.0fx "
		    "(the baseline's loads in the same run: p99 %.1fx p50)",
		    p99, p50 > 0 ? p99 / p50 : 0, p50, t->p99_x,
		    b50 > 0 ? b99 / b50 : 0);
	/* Mooncake's wire: 7 MiB x1 warm against 0.9x raw TCP, reported. */
	if (!cold && x->v == VIA_MC && s == 2 && nb == 1)
		report_row(o, reps_med(&ratio) >= 0.9, row,
		           "%.2fx raw TCP, below 0.90x", reps_med(&ratio));
	if (!cold && x->v == VIA_TCP && s >= 1) {
		if (o->quick)
			reps_add(&x->groups[GROUP_TCP], reps_med(&ratio));
		else
			check_row(o, reps_med(&ratio) >= t->tcp_ratio, row,
			          "%.2fx raw TCP, below %.2fx",
			          reps_med(&ratio), t->tcp_ratio);
	}
	samples_free(&lat);
	samples_free(&blat);
	samples_free(&first);
	samples_free(&bfirst);
	return true;
}

/* One transport's rows. */
static int bench_transfer_one(const bench_opts *o, reps *groups, via v)
{
	const char *transport = vias[v].transport;
	proc pr = {0}, src = {0};
	char *a[] = {"bench",
	             "--peer-addr",
	             (char *)o->peer_addr,
	             "--producer-for-bench",
	             (char *)transport,
	             NULL};
	char line[256];
	unsigned port = 0;
	if (!proc_start_via(&pr, o->peer_wrap, a) ||
	    !proc_line(&pr, line, sizeof(line), 60000) ||
	    sscanf(line, "ready %u", &port) != 1) {
		if (pr.pid > 0)
			proc_stop(&pr, SIGTERM, 5000);
		return tool_fail("bench", EXIT_FAIL,
		                 "the benchmark's producer did not start");
	}
	bench_ctx x = {.o = o, .groups = groups, .v = v, .tcp = -1};
	int rc = EXIT_OK;
	if (vias[v].raw_tcp && !tcp_source_start(o, &src, &x.tcp)) {
		rc = tool_fail("bench", EXIT_FAIL,
		               "the raw TCP baseline's sender did not start");
		goto out;
	}
	char url[64], why[256];
	snprintf(url, sizeof(url), "http://%s:%u", o->peer_addr, port);
	ecx_consumer_params cp = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_RECV_CAPACITY |
	        ECX_CONSUMER_PARAM_TRANSPORT | ECX_CONSUMER_PARAM_MOONCAKE,
	    .registry = url,
	    .recv_capacity = 240u << 20,
	    .transport = transport,
	    .mooncake = vias[v].mooncake};
	if (ecx_consumer_create(&cp, &x.c, why, sizeof(why)) != 0) {
		rc = tool_fail("bench", EXIT_FAIL, "%s", why);
		goto out;
	}
	if (!producer_settled(x.c))
		rc =
		    tool_fail("bench", EXIT_FAIL,
		              "the producer's items were not all listed within "
		              "60 s");
	for (int s = 0; s < NSIZES && rc == EXIT_OK; s++) {
		size_t sz = size_bytes(s), pool = (size_t)sizes[s].pool * sz;
		if (!vias[v].raw_tcp && (x.bsrc = pool_alloc(s)) == NULL)
			rc = tool_fail("bench", EXIT_FAIL, "out of memory");
		if (rc == EXIT_OK && (x.bdst = warm_alloc(pool)) == NULL)
			rc = tool_fail("bench", EXIT_FAIL, "out of memory");
		/* The baseline copies (or receives) the producer's bytes into
		 * memory faulted in, from memory that holds them: checked, not
		 * assumed. */
		char id0[64];
		snprintf(id0, sizeof(id0), "%s-0", sizes[s].name);
		if (rc == EXIT_OK &&
		    (!resident(x.bdst, pool) ||
		     (!vias[v].raw_tcp && (!resident(x.bsrc, pool) ||
		                           !gen_check(id0, x.bsrc, sz)))))
			rc = tool_fail("bench", EXIT_FAIL,
			               "the baseline's memory is not prepared: "
			               "pages not in memory, or a source "
			               "without the producer's bytes");
		for (int bi = 0; bi < NBATCH && rc == EXIT_OK; bi++) {
			if (!bench_row(&x, s, bi, false))
				rc = EXIT_FAIL;
			if (rc == EXIT_OK && batches[bi] <= 8 &&
			    !bench_row(&x, s, bi, true))
				rc = EXIT_FAIL;
		}
		free(x.bsrc);
		free(x.bdst);
		x.bsrc = x.bdst = NULL;
	}
	/* Integrity's price, into the receive arena, 1 MiB and 7 MiB x8
	 * (the reference's pull carries no hash: not for mc). */
	if (rc == EXIT_OK && !vias[v].user_memory && v != VIA_MC) {
		ecx_consumer *hashed = NULL;
		cp.field_mask |= ECX_CONSUMER_PARAM_INTEGRITY;
		cp.integrity = 1;
		cp.recv_capacity = 64u << 20;
		if (ecx_consumer_create(&cp, &hashed, why, sizeof(why)) != 0)
			rc = tool_fail("bench", EXIT_FAIL, "%s", why);
		for (int s = 1; s < NSIZES && rc == EXIT_OK; s++)
			if (!bench_integrity(o, x.c, hashed, vias[v].label,
			                     vias[v].json, s, 8))
				rc = EXIT_FAIL;
		ecx_consumer_destroy(hashed);
	}
out:
	ecx_consumer_destroy(x.c);
	if (x.tcp >= 0)
		close(x.tcp);
	if (src.pid > 0)
		proc_stop(&src, SIGTERM, 5000);
	int st = proc_stop(&pr, SIGTERM, 10000);
	if (rc == EXIT_OK && (!WIFEXITED(st) || WEXITSTATUS(st) != 0))
		rc = tool_fail("bench", EXIT_FAIL,
		               "the benchmark's producer failed");
	return rc;
}

int bench_transfer(const bench_opts *o)
{
	if (!o->json) {
		char lim[160];
		tcp_limits(lim, sizeof(lim));
		printf(
		    "transfer: producer process -> consumer process, "
		    "%s; %d repetitions of (baseline block, ecx "
		    "block), GB/s and base GB/s: medians of the blocks' "
		    "median loads, ratio: ecx/baseline of adjacent blocks, "
		    "median [min-max]; p50/p99: of every ecx load of the "
		    "row (a whole batch lands by its end)\n"
		    "  shm: into the receive arena, baseline: single-thread "
		    "memcpy into pre-faulted memory; shm*: into the "
		    "caller's memory, baseline: memcpy into memory prepared "
		    "the same way\n"
		    "  tcp: into the receive arena, baseline: raw TCP from "
		    "another process, 1 stream (ecx uses 1 endpoint), "
		    "TCP_NODELAY, kernel-tuned socket buffers as UCX's "
		    "(%s), the faster of a blocking and a polling receiver "
		    "in each repetition\n"
		    "  mc: as tcp, each item a reference pull op answered by "
		    "a write over Mooncake's TCP wire (the consumer's "
		    "mooncake=force), same baseline\n"
		    "  warm: the same ids into the same destinations; cold: "
		    "ids unused for 32+ MiB of loads, into destinations "
		    "unused as long (shm*: never-touched memory), baselines "
		    "alike\n"
		    "  hash: warm loads into the receive arena by a consumer "
		    "checking each item's XXH3 (integrity on); base: the "
		    "same loads by one that does not, alternating\n",
		    o->peer_wrap != NULL ? "producer reached at --peer-addr "
		                           "through --peer-wrap"
		                         : "loopback",
		    nreps(o), lim);
		printf("  %-4s %6s %-4s %-4s %8s %9s %9s %9s   %s\n", "via",
		       "item", "batch", "", "GB/s", "p50 us", "p99 us",
		       "base GB/s", "ratio");
	}
	int rc = EXIT_OK;
	reps groups[NGROUP] = {{{0}, 0}};
	for (int v = 0; v < NVIA && rc == EXIT_OK; v++)
		if (o->via_mask & (1u << v))
			rc = bench_transfer_one(o, groups, (via)v);
	const reps *group_shm7 = &groups[GROUP_SHM7],
	           *group_tcp = &groups[GROUP_TCP];
	/* --quick: the groups are reported, not checked (bench_report.c says
	 * why). */
	if (rc == EXIT_OK && o->quick && group_shm7->n > 0)
		report_row(o, reps_med(group_shm7) >= tgt(o)->shm7_ratio,
		           "transfer shm 7MiB warm (median of its rows)",
		           "%.2fx memcpy, below %.2fx", reps_med(group_shm7),
		           tgt(o)->shm7_ratio);
	if (rc == EXIT_OK && o->quick && group_tcp->n > 0)
		report_row(o, reps_med(group_tcp) >= tgt(o)->tcp_ratio,
		           "transfer tcp 1MiB and 7MiB warm (median of their "
		           "rows)",
		           "%.2fx raw TCP, below %.2fx", reps_med(group_tcp),
		           tgt(o)->tcp_ratio);
	if (!o->json)
		printf("  targets%s: shm 7MiB warm >= %.2fx memcpy; shm 64KiB "
		       "x1 warm p50 < %.0f us; tcp warm 1MiB and 7MiB >= "
		       "%.2fx raw TCP; 64KiB and 1MiB x1 warm, shm and tcp: "
		       "p99 <= %.0fx p50\n",
		       o->quick ? " (--quick floors, reported, not checked)"
		                : "",
		       tgt(o)->shm7_ratio, tgt(o)->shm64_p50, tgt(o)->tcp_ratio,
		       tgt(o)->p99_x);
	if (o->quick && (group_shm7->n > 0 || group_tcp->n > 0)) {
		if (o->json)
			row_json("transfer", "quick_groups",
			         "\"shm_7mib_warm_x_memcpy\": %.3f, "
			         "\"tcp_warm_x_raw_tcp\": %.3f",
			         reps_med(group_shm7), reps_med(group_tcp));
		else
			printf("  group medians: shm 7MiB warm %.2fx memcpy, "
			       "tcp 1MiB and 7MiB warm %.2fx raw TCP\n",
			       reps_med(group_shm7), reps_med(group_tcp));
	}
	return rc;
}
