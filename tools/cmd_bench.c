/* cmd_bench.c - `ecx bench`: every benchmark, each interleaved with its
 * baseline in the same run (baseline, ecx, baseline, ecx, ...), ratios
 * from adjacent pairs, and --check to assert the targets. */
#include "tool.h"

#include "gen.h"
#include "proc.h"
#include "safetensors.h"
#include "stats.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx bench [--quick] [--check] [--json] [--redis URL]\n"
    "                 [--via LIST] [--peer-wrap PROG --peer-addr ADDR]\n"
    "                 [registry|transfer|file|all]\n"
    "\n"
    "Benchmarks, each interleaved with the baseline it is compared with\n"
    "in the same run: baseline, ecx, baseline, ecx, ... (5 repetitions,\n"
    "3 with --quick); a ratio comes from each adjacent pair, and tables\n"
    "give the median of the repetitions with [min-max] beside it.\n"
    "\n"
    "  registry  single lookups over one persistent connection against\n"
    "            the reference's way: a new HTTP client (a new libcurl\n"
    "            handle and connection) per lookup; batched lookups of\n"
    "            256 ids against single ones; beside them the machine's\n"
    "            floor, a 1-byte TCP round trip to another thread\n"
    "  transfer  loads of 64 KiB, 1 MiB and 7 MiB items (7 MiB: 1024 x\n"
    "            3584 bf16, one Qwen2.5-VL-7B image) in batches of 1, 8\n"
    "            and 32 from a producer process, over shared memory into\n"
    "            the receive arena (shm) and into the caller's memory\n"
    "            (shm*), and over TCP (tcp). Baselines: single-thread\n"
    "            memcpy into destinations prepared the same way (shm),\n"
    "            and raw TCP from another process, one stream as ecx uses\n"
    "            one endpoint, TCP_NODELAY, socket buffers kernel-tuned\n"
    "            as UCX leaves them, the faster of a receiver blocking in\n"
    "            recv and one polling its socket as ecx's consumer polls,\n"
    "            both measured in each repetition (tcp). warm: the same\n"
    "            ids into the same destinations each load; cold (batches\n"
    "            1 and 8): ids not loaded for at least 32 MiB of loads\n"
    "            (more than the CPU caches), into fresh destinations\n"
    "            (shm*: memory never touched, registered afresh), and the\n"
    "            baseline alike\n"
    "  file      the file-per-item baseline (vLLM's ECExampleConnector:\n"
    "            a safetensors file per item in /dev/shm) loaded (open,\n"
    "            parse, malloc, read) against malloc and memcpy\n"
    "  all       all of them (the default)\n"
    "\n"
    "Options:\n"
    "  --quick   fewer iterations (CI runs 'all --quick --check')\n"
    "  --check   assert the targets, exit 1 naming each row that misses:\n"
    "            shm 7 MiB warm loads >= 0.5x memcpy; shm 64 KiB x1 warm\n"
    "            p50 < 100 us; registry persistent p50 < 150 us and\n"
    "            batched >= 10x single ids/s; tcp warm loads of 1 MiB\n"
    "            and 7 MiB >= 0.9x raw TCP. With --quick, floors that\n"
    "            runs on a loaded 2-core machine met and a 2x regression\n"
    "            does not, on the median of a group's rows and the best\n"
    "            repetition's latency: shm 7 MiB >= 0.25x memcpy, 64 KiB\n"
    "            p50 < 400 us, registry p50 < 250 us and batched >= 5x,\n"
    "            tcp >= 0.4x raw TCP\n"
    "  --json    one JSON object per result line\n"
    "  --redis URL  registry: also batched lookups against this Redis\n"
    "            (redis://HOST:PORT; bench/redis_vs_http.sh starts one)\n"
    "  --via LIST  transfer: only these rows, comma-separated: shm,\n"
    "            user (shm*), tcp (default: all three)\n"
    "  --peer-wrap PROG  transfer: start the producer and the raw TCP\n"
    "            sender as 'PROG /path/to/ecx ARGS...'; PROG must exec\n"
    "            its arguments (e.g. a script entering another network\n"
    "            namespace: bench/two_hosts.sh). Needs --via tcp and\n"
    "            --peer-addr\n"
    "  --peer-addr ADDR  transfer: the IPv4 address they bind and are\n"
    "            reached at (default 127.0.0.1)\n"
    "  -h, --help\n"
    "\n"
    "Exit codes: 0 done (and, with --check, every target met), 1 a\n"
    "benchmark failed or a target was missed, 2 usage.\n";

static bool quick, json, check;
static const char *redis_url; /* --redis: a Redis to compare lookups with */
/* transfer: which rows (--via), and where the producer and the raw TCP
 * sender run (--peer-wrap, --peer-addr: another host's namespace). */
enum { VIA_BIT_SHM = 1, VIA_BIT_USER = 2, VIA_BIT_TCP = 4 };
static unsigned via_mask = VIA_BIT_SHM | VIA_BIT_USER | VIA_BIT_TCP;
static const char *peer_wrap;
static const char *peer_addr = "127.0.0.1";

#define MAXREPS 16
static int nreps(void)
{
	return quick ? 3 : 5;
}

/* ---- targets ---- */

typedef struct targets {
	double shm7_ratio;  /* shm 7 MiB warm loads, x memcpy, at least */
	double shm64_p50;   /* shm 64 KiB x1 warm p50 in us, below */
	double reg_p50;     /* registry persistent p50 in us, below */
	double reg_batch_x; /* batched ids/s over single ids/s, at least */
	double tcp_ratio;   /* tcp warm >= 1 MiB, x raw TCP, at least */
} targets;

/* The stated targets (--check). */
static const targets target_full = {0.5, 100, 150, 10, 0.9};
/* The --quick floors, chosen from 10 runs of 'bench all --quick' on this
 * 2-core machine while 5 engineers built and tested on it (load average
 * 4-11). Each value below is a group median, or for latencies the best
 * repetition's p50 (load only adds to a latency):
 *   shm 7 MiB warm, x memcpy    0.32-0.49 (worst 0.32)     floor 0.25
 *   shm 64 KiB x1 warm p50      17-282 us (worst 282)      floor 400 us
 *   registry persistent p50     49-143 us (worst 143)      floor 250 us
 *   registry batched / single   6.7-16.5x (worst 6.7)      floor 5x
 *   tcp >= 1 MiB warm, x raw    0.48-1.13 (worst 0.48)     (see below)
 * Each floor sits below the worst loaded value and at or above half the
 * typical loaded one (0.44, -, 80 us, 9x, 0.7), so a loaded CI machine
 * passes and a 2x regression of a typical run fails. Not the latency of
 * 64 KiB: on a quiet machine it is 13-20 us, and 2x that is far inside
 * what load alone does, so its floor catches only gross regressions.
 * tcp: those runs had raw TCP receive by blocking only; the baseline is now
 * the faster of a blocking and a polling receiver, measured in each
 * repetition. 6 runs of 'bench transfer --quick --via tcp' with it, at
 * load average 1.0-2.4 (TSan and another engineer's builds running), read
 * group medians of 0.68-0.93, typical 0.84: the floor is 0.4, about half
 * the typical as the other floors are, and below the worst by 1.7x. */
static const targets target_quick = {0.25, 400, 250, 5, 0.4};

static const targets *tgt(void)
{
	return quick ? &target_quick : &target_full;
}

static int nmissed;

/* Records one check: ok says whether the row meets its target. */
static void check_row(bool ok, const char *row, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void check_row(bool ok, const char *row, const char *fmt, ...)
{
	if (!check || ok)
		return;
	char msg[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr, "ecx bench: check: %s misses its %s: %s\n", row,
	        quick ? "--quick floor" : "target", msg);
	nmissed++;
}

/* ---- repetitions ---- */

typedef struct reps {
	double v[MAXREPS];
	int n;
} reps;

static void reps_add(reps *r, double x)
{
	if (r->n < MAXREPS)
		r->v[r->n++] = x;
}

static int dbl_cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Median (mean of the middle two for an even count), min and max. */
static double reps_med(const reps *r)
{
	if (r->n == 0)
		return 0;
	double v[MAXREPS];
	memcpy(v, r->v, sizeof(double) * (size_t)r->n);
	qsort(v, (size_t)r->n, sizeof(double), dbl_cmp);
	return r->n % 2 ? v[r->n / 2] : (v[r->n / 2 - 1] + v[r->n / 2]) / 2;
}

static double reps_min(const reps *r)
{
	double m = r->n ? r->v[0] : 0;
	for (int i = 1; i < r->n; i++)
		m = r->v[i] < m ? r->v[i] : m;
	return m;
}

static double reps_max(const reps *r)
{
	double m = r->n ? r->v[0] : 0;
	for (int i = 1; i < r->n; i++)
		m = r->v[i] > m ? r->v[i] : m;
	return m;
}

/* --quick: the warm rows' median ratios of the shm 7 MiB rows and of the
 * tcp rows of 1 MiB and 7 MiB, checked as groups. */
static reps group_shm7, group_tcp;

/* ---- output ---- */

static void row_json(const char *bench, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void row_json(const char *bench, const char *name, const char *fmt, ...)
{
	/* The fields come as a JSON fragment of this file's own keys and
	 * numbers; the row is built and printed by cJSON all the same. */
	char frag[2048];
	va_list ap;
	frag[0] = '{';
	va_start(ap, fmt);
	int k = vsnprintf(frag + 1, sizeof(frag) - 2, fmt, ap);
	va_end(ap);
	if (k < 0 || (size_t)k >= sizeof(frag) - 3)
		k = 0;
	frag[1 + k] = '}';
	frag[2 + k] = '\0';
	cJSON *o = cJSON_Parse(frag);
	if (o == NULL) { /* a bug here, not bad input: say so */
		fprintf(stderr, "ecx bench: internal: a row is not JSON: %s\n",
		        frag);
		o = cJSON_CreateObject();
	}
	cJSON_AddItemToObject(o, "bench", cJSON_CreateString(bench));
	cJSON_AddItemToObject(o, "case", cJSON_CreateString(name));
	char *s = cJSON_PrintUnformatted(o);
	if (s != NULL)
		printf("%s\n", s);
	free(s);
	cJSON_Delete(o);
	fflush(stdout);
}

/* "0.85 [0.80-0.90]" with dec decimals. */
static const char *fmt_reps(const reps *r, int dec, char *buf, size_t len)
{
	snprintf(buf, len, "%.*f [%.*f-%.*f]", dec, reps_med(r), dec,
	         reps_min(r), dec, reps_max(r));
	return buf;
}

/* ---- registry ---- */

typedef struct body {
	char buf[4096];
	size_t n;
} body;

static size_t body_write(char *p, size_t sz, size_t nm, void *arg)
{
	body *b = arg;
	size_t n = sz * nm;
	if (b->n + n >= sizeof(b->buf))
		return 0;
	memcpy(b->buf + b->n, p, n);
	b->n += n;
	return n;
}

/* One lookup as the reference's consumer makes it: a new HTTP client (a
 * new libcurl handle, so a new connection) for one GET /ec/info/{id}, its
 * JSON parsed; nothing else is set up. Returns 0 on a 200 with nbytes. */
static int ref_lookup(const char *url, const char *id)
{
	char u[256];
	snprintf(u, sizeof(u), "%s/ec/info/%s", url, id);
	CURL *h = curl_easy_init();
	if (h == NULL)
		return -1;
	body b = {.n = 0};
	curl_easy_setopt(h, CURLOPT_URL, u);
	curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, body_write);
	curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
	curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 5000L);
	long code = 0;
	int rc = -1;
	if (curl_easy_perform(h) == CURLE_OK &&
	    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code) == CURLE_OK &&
	    code == 200) {
		cJSON *o = cJSON_ParseWithLength(b.buf, b.n);
		if (cJSON_IsNumber(
		        cJSON_GetObjectItemCaseSensitive(o, "nbytes")))
			rc = 0;
		cJSON_Delete(o);
	}
	curl_easy_cleanup(h);
	return rc;
}

static void tcp_tune(int fd);

/* The calling thread's CPU time (user and system) in us. */
static double thread_cpu_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* The machine's floor for a lookup: a 1-byte TCP round trip over
 * loopback to another thread (as the registry answers from a thread of
 * its own), measured beside the lookups. */
static void *echo_thread(void *arg)
{
	int c = *(int *)arg;
	char b;
	while (recv(c, &b, 1, 0) == 1 && send(c, &b, 1, MSG_NOSIGNAL) == 1)
		;
	return NULL;
}

/* Connects fd[0] to an echo thread on loopback; fd[1] is its end. On
 * failure it closes what it opened and returns false with errno set (from
 * pthread_create's return where that failed). */
static bool echo_start(int fd[2], pthread_t *t)
{
	int l = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t sl = sizeof(sa);
	fd[0] = fd[1] = -1;
	if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
	    getsockname(l, (struct sockaddr *)&sa, &sl) != 0 ||
	    listen(l, 1) != 0 ||
	    (fd[0] = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
	    connect(fd[0], (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
	    (fd[1] = accept(l, NULL, NULL)) < 0) {
		int e = errno;
		if (l >= 0)
			close(l);
		if (fd[0] >= 0)
			close(fd[0]);
		fd[0] = -1;
		errno = e;
		return false;
	}
	close(l);
	tcp_tune(fd[0]);
	tcp_tune(fd[1]);
	int e = pthread_create(t, NULL, echo_thread, &fd[1]);
	if (e != 0) {
		close(fd[0]);
		close(fd[1]);
		fd[0] = fd[1] = -1;
		errno = e;
		return false;
	}
	return true;
}

enum { NIDS = 4096 };
static char reg_ids[NIDS][80];

static int bench_registry(void)
{
	ecx_registry_params rp = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                        ECX_REGISTRY_PARAM_PORT,
	                          .bind_host = "127.0.0.1",
	                          .port = 0};
	ecx_registry *reg;
	char why[256], url[64];
	if (ecx_registry_create(&rp, &reg, why, sizeof(why)) != 0)
		return tool_fail("bench", EXIT_FAIL, "%s", why);
	snprintf(url, sizeof(url), "http://127.0.0.1:%u",
	         ecx_registry_port(reg));
	/* Published through a client, as producers publish to a registry
	 * of their own (the time is not measured). */
	ecx_client_params o = {.field_mask = ECX_CLIENT_PARAM_REGISTRY |
	                                     ECX_CLIENT_PARAM_TIMEOUT,
	                       .registry = url,
	                       .timeout_ms = 5000};
	ecx_client *c, *cs;
	if (ecx_client_create(&o, &c, why, sizeof(why)) != 0) {
		ecx_registry_destroy(reg);
		return tool_fail("bench", EXIT_FAIL, "%s", why);
	}
	/* The same client sleeping at once on each answer (no poll first):
	 * what the default 200 us poll buys, and what it costs in CPU. */
	o.field_mask |= ECX_CLIENT_PARAM_SPIN;
	o.spin_us = 0;
	if (ecx_client_create(&o, &cs, why, sizeof(why)) != 0) {
		ecx_client_destroy(c);
		ecx_registry_destroy(reg);
		return tool_fail("bench", EXIT_FAIL, "%s", why);
	}
	static ecx_item entries[NIDS];
	for (int i = 0; i < NIDS; i++) {
		snprintf(reg_ids[i], sizeof(reg_ids[i]), "%016x%016x%016x%016x",
		         i, i * 7, i * 13, i * 31);
		ecx_item *e = &entries[i];
		memset(e, 0, sizeof(*e));
		e->id = reg_ids[i];
		uint64_t dims[2] = {gen_qwen_tokens((size_t)i), 3584};
		ecx_tensor_set(&e->desc, ECX_DTYPE_BFLOAT16, 2, dims);
		snprintf(e->producer, sizeof(e->producer),
		         "tcp://10.0.0.%d:5555", i % 8);
		if (ecx_client_publish(c, e) != 0) {
			ecx_client_destroy(c);
			ecx_registry_destroy(reg);
			return tool_fail("bench", EXIT_FAIL, "publish: %s",
			                 ecx_last_error());
		}
	}
	int R = quick ? 5 : 10, iters = quick ? 60 : 500,
	    biters = quick ? 6 : 30;
	reps ref50 = {0}, keep50 = {0}, keep99 = {0}, ref99 = {0},
	     batch50 = {0}, krate = {0}, frate = {0}, brate = {0}, xref = {0},
	     xbatch = {0}, rbrate = {0}, rtt50 = {0}, xrtt = {0}, sleep50 = {0},
	     sleep99 = {0}, srate = {0}, kcpu = {0}, scpu = {0};
	ecx_item *its = calloc(256, sizeof(*its));
	ecx_client *rcl = NULL;
	int rc = EXIT_OK;
	if (its == NULL) {
		rc = tool_fail("bench", EXIT_FAIL, "out of memory");
		goto out;
	}
	if (redis_url != NULL) {
		ecx_client_params ro = {.field_mask =
		                            ECX_CLIENT_PARAM_REGISTRY |
		                            ECX_CLIENT_PARAM_TIMEOUT,
		                        .registry = redis_url,
		                        .timeout_ms = 5000};
		if (ecx_client_create(&ro, &rcl, why, sizeof(why)) != 0) {
			rc = tool_fail("bench", EXIT_USAGE, "%s", why);
			goto out;
		}
		for (int i = 0; i < NIDS; i++)
			if (ecx_client_publish(rcl, &entries[i]) != 0) {
				rc = tool_fail("bench", EXIT_FAIL, "%s",
				               ecx_last_error());
				goto out;
			}
	}
	/* Warm up both ways. */
	for (int i = 0; i < 20; i++) {
		ecx_item it = {.id = reg_ids[i]};
		ecx_client_lookup(c, &it, 1);
		ecx_client_lookup(cs, &it, 1);
		ref_lookup(url, reg_ids[i]);
	}
	int echo[2];
	pthread_t echo_t;
	if (!echo_start(echo, &echo_t)) {
		rc = tool_fail("bench", EXIT_FAIL, "loopback echo: %m");
		goto out;
	}
	int next = 0;
	for (int r = 0; r < R && rc == EXIT_OK; r++) {
		samples fs = {0}, ks = {0}, bs = {0}, rs = {0}, es = {0},
		        ss = {0};
		/* The floor: 1-byte round trips to another thread. */
		for (int i = 0; i < iters && rc == EXIT_OK; i++) {
			char b = 'x';
			uint64_t a = tool_now_ns();
			if (send(echo[0], &b, 1, MSG_NOSIGNAL) != 1 ||
			    recv(echo[0], &b, 1, 0) != 1)
				rc = tool_fail("bench", EXIT_FAIL,
				               "loopback echo: %m");
			samples_add(&es, tool_now_ns() - a);
		}
		/* The baseline first, then ecx: adjacent blocks. */
		uint64_t t0 = tool_now_ns();
		for (int i = 0; i < iters && rc == EXIT_OK; i++) {
			const char *id = reg_ids[next++ % NIDS];
			uint64_t a = tool_now_ns();
			if (ref_lookup(url, id) != 0)
				rc = tool_fail("bench", EXIT_FAIL,
				               "reference lookup of %s failed",
				               id);
			samples_add(&fs, tool_now_ns() - a);
		}
		double fsec = (double)(tool_now_ns() - t0) / 1e9;
		double ssec = 0, ksec = 0, scu = 0, kcu = 0;
		for (int pass = 0; pass < 2; pass++) {
			/* sleeping at once, then the default: adjacent */
			ecx_client *pc = pass == 0 ? cs : c;
			samples *ps = pass == 0 ? &ss : &ks;
			double cu = thread_cpu_us();
			t0 = tool_now_ns();
			for (int i = 0; i < iters && rc == EXIT_OK; i++) {
				ecx_item it = {.id = reg_ids[next++ % NIDS]};
				uint64_t a = tool_now_ns();
				if (ecx_client_lookup(pc, &it, 1) != 0 ||
				    it.status != 0)
					rc = tool_fail("bench", EXIT_FAIL,
					               "lookup: %s",
					               ecx_last_error());
				samples_add(ps, tool_now_ns() - a);
			}
			*(pass == 0 ? &ssec : &ksec) =
			    (double)(tool_now_ns() - t0) / 1e9;
			*(pass == 0 ? &scu : &kcu) = thread_cpu_us() - cu;
		}
		t0 = tool_now_ns();
		for (int i = 0; i < biters && rc == EXIT_OK; i++) {
			for (int k = 0; k < 256; k++)
				its[k].id = reg_ids[next++ % NIDS];
			uint64_t a = tool_now_ns();
			if (ecx_client_lookup(c, its, 256) != 0)
				rc = tool_fail("bench", EXIT_FAIL, "lookup: %s",
				               ecx_last_error());
			samples_add(&bs, tool_now_ns() - a);
		}
		double bsec = (double)(tool_now_ns() - t0) / 1e9;
		double rbsec = 0;
		if (rcl != NULL) {
			t0 = tool_now_ns();
			for (int i = 0; i < biters && rc == EXIT_OK; i++) {
				for (int k = 0; k < 256; k++)
					its[k].id = reg_ids[next++ % NIDS];
				uint64_t a = tool_now_ns();
				if (ecx_client_lookup(rcl, its, 256) != 0)
					rc = tool_fail("bench", EXIT_FAIL,
					               "redis: %s",
					               ecx_last_error());
				samples_add(&rs, tool_now_ns() - a);
			}
			rbsec = (double)(tool_now_ns() - t0) / 1e9;
		}
		if (rc == EXIT_OK) {
			double f = (double)samples_pct(&fs, 50) / 1e3;
			double k = (double)samples_pct(&ks, 50) / 1e3;
			reps_add(&ref50, f);
			reps_add(&ref99, (double)samples_pct(&fs, 99) / 1e3);
			reps_add(&keep50, k);
			reps_add(&keep99, (double)samples_pct(&ks, 99) / 1e3);
			reps_add(&sleep50, (double)samples_pct(&ss, 50) / 1e3);
			reps_add(&sleep99, (double)samples_pct(&ss, 99) / 1e3);
			reps_add(&srate, iters / ssec);
			reps_add(&kcpu, kcu / iters);
			reps_add(&scpu, scu / iters);
			reps_add(&batch50, (double)samples_pct(&bs, 50) / 1e3);
			reps_add(&frate, iters / fsec);
			reps_add(&krate, iters / ksec);
			reps_add(&brate, 256.0 * biters / bsec);
			reps_add(&xref, k / f);
			double e50 = (double)samples_pct(&es, 50) / 1e3;
			reps_add(&rtt50, e50);
			reps_add(&xrtt, k / e50);
			reps_add(&xbatch,
			         256.0 * biters / bsec / (iters / ksec));
			if (rcl != NULL)
				reps_add(&rbrate, 256.0 * biters / rbsec);
		}
		samples_free(&fs);
		samples_free(&ks);
		samples_free(&bs);
		samples_free(&rs);
		samples_free(&es);
		samples_free(&ss);
	}
	close(echo[0]); /* the echo thread sees the end and returns */
	pthread_join(echo_t, NULL);
	close(echo[1]);
	if (rc != EXIT_OK)
		goto out;
	long conns = ecx_client_connections(c);
	char a[96], b[96];
	if (json) {
		row_json("registry", "tcp_round_trip",
		         "\"p50_us\": %.1f, \"p50_us_min\": %.1f, "
		         "\"p50_us_max\": %.1f, \"reps\": %d",
		         reps_med(&rtt50), reps_min(&rtt50), reps_max(&rtt50),
		         R);
		row_json("registry", "single_new_connection",
		         "\"p50_us\": %.1f, \"p99_us\": %.1f, \"ids_per_s\": "
		         "%.0f, \"reps\": %d",
		         reps_med(&ref50), reps_med(&ref99), reps_med(&frate),
		         R);
		row_json("registry", "single_persistent",
		         "\"p50_us\": %.1f, \"p50_us_min\": %.1f, "
		         "\"p50_us_max\": %.1f, \"p99_us\": %.1f, "
		         "\"ids_per_s\": %.0f, \"x_new_connection_p50\": %.2f, "
		         "\"x_tcp_round_trip_p50\": %.2f, \"connections\": %ld",
		         reps_med(&keep50), reps_min(&keep50),
		         reps_max(&keep50), reps_med(&keep99), reps_med(&krate),
		         reps_med(&xref), reps_med(&xrtt), conns);
		row_json("registry", "single_persistent_sleeping",
		         "\"p50_us\": %.1f, \"p50_us_min\": %.1f, "
		         "\"p50_us_max\": %.1f, \"p99_us\": %.1f, "
		         "\"ids_per_s\": %.0f, \"cpu_us_per_id\": %.1f, "
		         "\"cpu_us_per_id_polling\": %.1f",
		         reps_med(&sleep50), reps_min(&sleep50),
		         reps_max(&sleep50), reps_med(&sleep99),
		         reps_med(&srate), reps_med(&scpu), reps_med(&kcpu));
		row_json("registry", "batch_256",
		         "\"p50_us\": %.1f, \"ids_per_s\": %.0f, \"x_single\": "
		         "%.1f, \"x_single_min\": %.1f, \"x_single_max\": %.1f",
		         reps_med(&batch50), reps_med(&brate),
		         reps_med(&xbatch), reps_min(&xbatch),
		         reps_max(&xbatch));
		if (rcl != NULL)
			row_json("registry", "batch_256_redis",
			         "\"ids_per_s\": %.0f, \"x_http_batch\": %.2f",
			         reps_med(&rbrate),
			         reps_med(&rbrate) / reps_med(&brate));
	} else {
		printf("registry: loopback, %d entries; %d repetitions of: %d "
		       "lookups each with a new HTTP client and connection "
		       "(the reference), %d over one persistent connection, "
		       "%d batches of 256 ids; medians of the repetitions "
		       "[min-max]\n",
		       NIDS, R, iters, iters, biters);
		printf("  %-36s %-24s %9s %12s %9s\n", "", "p50 us", "p99 us",
		       "ids/s", "cpu us/id");
		printf("  %-36s %-24s\n", "TCP round trip, 1 byte (floor)",
		       fmt_reps(&rtt50, 1, a, sizeof(a)));
		printf("  %-36s %-24s %9.1f %12.0f\n",
		       "single, new connection (reference)",
		       fmt_reps(&ref50, 1, a, sizeof(a)), reps_med(&ref99),
		       reps_med(&frate));
		printf("  %-36s %-24s %9.1f %12.0f %9.1f\n",
		       "single, persistent, sleeping at once",
		       fmt_reps(&sleep50, 1, a, sizeof(a)), reps_med(&sleep99),
		       reps_med(&srate), reps_med(&scpu));
		printf("  %-36s %-24s %9.1f %12.0f %9.1f\n",
		       "single, persistent connection",
		       fmt_reps(&keep50, 1, a, sizeof(a)), reps_med(&keep99),
		       reps_med(&krate), reps_med(&kcpu));
		printf("  %-36s %-24s %9s %12.0f\n", "batch of 256 ids",
		       fmt_reps(&batch50, 1, a, sizeof(a)), "",
		       reps_med(&brate));
		if (rcl != NULL)
			printf("  %-36s %-24s %9s %12.0f   (%.2fx the HTTP "
			       "batch)\n",
			       "batch of 256 ids, Redis MGET", "", "",
			       reps_med(&rbrate),
			       reps_med(&rbrate) / reps_med(&brate));
		char d[96];
		printf("  persistent p50 / new-connection p50: %s; persistent "
		       "p50 / TCP round trip p50: %s; batched ids/s / single: "
		       "%s; %ld connection(s) for the persistent lookups\n",
		       fmt_reps(&xref, 2, a, sizeof(a)),
		       fmt_reps(&xrtt, 2, d, sizeof(d)),
		       fmt_reps(&xbatch, 1, b, sizeof(b)), conns);
		printf("  targets%s: persistent p50 < %.0f us, batched >= "
		       "%.0fx single\n",
		       quick ? " (--quick floors)" : "", tgt()->reg_p50,
		       tgt()->reg_batch_x);
	}
	double k50 = quick ? reps_min(&keep50) : reps_med(&keep50);
	check_row(k50 < tgt()->reg_p50,
	          "registry single, persistent connection",
	          "%sp50 %.1f us, not below %.0f us",
	          quick ? "best repetition's " : "", k50, tgt()->reg_p50);
	check_row(reps_med(&xbatch) >= tgt()->reg_batch_x,
	          "registry batch of 256 ids",
	          "%.1fx single ids/s, below %.0fx", reps_med(&xbatch),
	          tgt()->reg_batch_x);
out:
	if (rcl != NULL) {
		for (int i = 0; i < NIDS; i++)
			ecx_client_remove(rcl, reg_ids[i], NULL);
		ecx_client_destroy(rcl);
	}
	free(its);
	ecx_client_destroy(c);
	ecx_client_destroy(cs);
	ecx_registry_destroy(reg);
	return rc;
}

/* ---- transfer: sizes, pools, memory ---- */

static const struct {
	const char *name;
	uint64_t rows, cols; /* bfloat16 */
	int pool;            /* distinct items the producer holds */
} sizes[] = {
    {"64KiB", 32, 1024, 1024}, /* 64 MiB */
    {"1MiB", 512, 1024, 64},   /* 64 MiB */
    {"7MiB", 1024, 3584, 32},  /* 224 MiB */
};
static const int batches[] = {1, 8, 32};
#define NSIZES 3
#define NBATCH 3
#define MAXBATCH 32

static size_t size_bytes(int s)
{
	return (size_t)(sizes[s].rows * sizes[s].cols * 2);
}

/* Memory never touched before (so its first touch faults), and never
 * recycled by malloc: each call maps afresh. */
static void *fresh_map(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE,
	               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

/* Pre-faulted memory. */
static void *warm_alloc(size_t n)
{
	void *p = malloc(n);
	if (p != NULL)
		memset(p, 0, n);
	return p;
}

/* Loads per block: about budget bytes, within [lo, hi]. */
static int block_iters(size_t bytes)
{
	size_t budget = quick ? (64u << 20) : (256u << 20);
	int lo = quick ? 3 : 4, hi = quick ? 15 : 40;
	size_t n = budget / bytes;
	return n < (size_t)lo ? lo : n > (size_t)hi ? hi : (int)n;
}

/* ---- the producer and the raw TCP source, in child processes ---- */

/* The producer side of the transfer benchmark: each size's pool of items,
 * then serves until SIGTERM. */
static int bench_producer(const char *transport)
{
	tool_block_signals();
	/* With integrity on: it costs the producer a hash per put (not
	 * timed here), and only consumers that ask check it. */
	ecx_producer_params p = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_CAPACITY |
	        ECX_PRODUCER_PARAM_TRANSPORT | ECX_PRODUCER_PARAM_INTEGRITY,
	    .bind_host = peer_addr,
	    .registry_port = 0,
	    .capacity_bytes = 400u << 20,
	    .transport = transport,
	    .integrity = 1};
	ecx_producer *prod;
	char why[256];
	if (ecx_producer_create(&p, &prod, why, sizeof(why)) != 0)
		return tool_fail("bench", EXIT_FAIL, "producer: %s", why);
	void *buf = malloc(7u << 20);
	for (int s = 0; s < NSIZES; s++) {
		for (int i = 0; i < sizes[s].pool; i++) {
			char id[64];
			snprintf(id, sizeof(id), "%s-%d", sizes[s].name, i);
			uint64_t dims[2] = {sizes[s].rows, sizes[s].cols};
			ecx_tensor_desc d;
			ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
			gen_fill(id, buf, d.nbytes);
			if (ecx_producer_put(prod, id, &d, buf) != 0)
				return tool_fail("bench", EXIT_FAIL, "%s",
				                 ecx_last_error());
		}
	}
	free(buf);
	printf("ready %u\n", ecx_producer_registry_port(prod));
	fflush(stdout);
	tool_wait_signal();
	ecx_producer_destroy(prod);
	return EXIT_OK;
}

/* A request to the raw TCP source: send `count` items of `bytes` from
 * its pool, starting at item `first`. */
typedef struct tcp_req {
	uint64_t bytes;
	uint32_t first, count;
} tcp_req;

/* IO_RECV: receive blocking in recv. IO_POLL: receive without sleeping,
 * polling the socket as ecx's consumer polls its worker during a load
 * (across the veth this moved raw TCP from 1.0 to 1.3 GB/s at 7 MiB x8,
 * bench/two_hosts.sh); but on a 2-core machine over loopback a spinning
 * receiver can take the core its sender needs. So the raw TCP baseline
 * receives both ways in each repetition and counts the faster
 * (bench_row). IO_POLL gives up after 30 s without a byte (ETIMEDOUT),
 * as IO_RECV does on the consumer's socket (SO_RCVTIMEO, set in
 * tcp_source_start); an end of file fails with ECONNRESET. */
typedef enum { IO_SEND, IO_RECV, IO_POLL } io_mode;

#define POLL_IDLE_NS 30000000000ull

static bool full_io(int fd, void *p, size_t n, io_mode m)
{
	char *c = p;
	uint64_t idle_since = 0;
	while (n > 0) {
		ssize_t k = m == IO_SEND   ? send(fd, c, n, MSG_NOSIGNAL)
		            : m == IO_POLL ? recv(fd, c, n, MSG_DONTWAIT)
		                           : recv(fd, c, n, 0);
		if (k < 0 && m == IO_POLL &&
		    (errno == EAGAIN || errno == EINTR)) {
			uint64_t now = tool_now_ns();
			if (idle_since == 0)
				idle_since = now;
			else if (now - idle_since > POLL_IDLE_NS) {
				errno = ETIMEDOUT;
				return false;
			}
			continue;
		}
		if (k == 0)
			errno = ECONNRESET;
		else if (k < 0 && m == IO_RECV &&
		         (errno == EAGAIN || errno == EWOULDBLOCK))
			errno = ETIMEDOUT; /* SO_RCVTIMEO ran out */
		if (k <= 0)
			return false;
		idle_since = 0;
		c += k;
		n -= (size_t)k;
	}
	return true;
}

static void tcp_tune(int fd)
{
	/* TCP_NODELAY; socket buffers left to the kernel's autotuning, as
	 * UCX leaves its own (UCX_TCP_SNDBUF/RCVBUF=auto). Fixed 4 MiB
	 * buffers (the ceiling) read no better across the veth: 1.27 vs
	 * 1.29 GB/s at 7 MiB x8, 1.42 vs 1.23 at x32, 1.82 vs 1.89 at 64 KiB
	 * x32 (bench/two_hosts.sh). */
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* The raw TCP baseline's sender, a process of its own as ecx's producer
 * is: one connection, requests in, items out, until end of file. Each
 * size's pool is as large as the producer's, so cold rows read cold
 * memory here too. */
static int bench_tcp_source(void)
{
	int l = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET};
	inet_pton(AF_INET, peer_addr, &sa.sin_addr);
	socklen_t sl = sizeof(sa);
	if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
	    getsockname(l, (struct sockaddr *)&sa, &sl) != 0 ||
	    listen(l, 1) != 0)
		return tool_fail("bench", EXIT_FAIL, "tcp source: %m");
	printf("ready %u\n", ntohs(sa.sin_port));
	fflush(stdout);
	int c = accept(l, NULL, NULL);
	close(l);
	if (c < 0)
		return EXIT_FAIL;
	tcp_tune(c);
	char *pool = NULL;
	uint64_t have = 0;
	uint32_t n = 0;
	tcp_req q;
	while (full_io(c, &q, sizeof(q), IO_RECV)) {
		if (q.bytes != have) {
			free(pool);
			n = 0;
			for (int s = 0; s < NSIZES; s++)
				if (size_bytes(s) == q.bytes)
					n = (uint32_t)sizes[s].pool;
			if (n == 0 || (pool = warm_alloc(n * q.bytes)) == NULL)
				break;
			have = q.bytes;
		}
		bool ok = true;
		for (uint32_t k = 0; k < q.count && ok; k++)
			ok = full_io(c, pool + ((q.first + k) % n) * q.bytes,
			             q.bytes, IO_SEND);
		if (!ok)
			break;
	}
	free(pool);
	close(c);
	return EXIT_OK;
}

/* ---- transfer: rows ---- */

typedef enum { VIA_SHM, VIA_USER, VIA_TCP } via;
static const char *via_label[] = {"shm", "shm*", "tcp"};
static const char *via_json[] = {"shm", "shm_user_memory", "tcp"};

typedef struct bench_ctx {
	via v;
	ecx_consumer *c;
	int tcp;                   /* connection to the raw TCP source */
	char *bsrc, *bdst;         /* baseline pools of the current size */
	void *wdst[MAXBATCH];      /* warm destinations (ecx) */
	ecx_item witems[MAXBATCH]; /* warm items, looked up once a row */
	bool wlooked;
	int cur_ecx, cur_base; /* cold rotations */
} bench_ctx;

/* One baseline load of nb items of size s: memcpy or raw TCP (received
 * the way rm says: IO_RECV or IO_POLL), from items `first`.. of the pool
 * into destinations prepared as ecx's are. */
static bool base_load(bench_ctx *x, int s, int nb, bool cold, io_mode rm,
                      uint64_t *ns)
{
	size_t sz = size_bytes(s);
	int pool = sizes[s].pool;
	int first = cold ? x->cur_base : 0;
	if (cold)
		x->cur_base = (x->cur_base + nb) % pool;
	char *dst[MAXBATCH];
	for (int k = 0; k < nb; k++) {
		if (cold && x->v == VIA_USER)
			dst[k] = fresh_map(sz);
		else
			dst[k] = x->bdst + (size_t)((first + k) % pool) * sz;
		if (dst[k] == NULL)
			return false;
	}
	bool ok = true;
	uint64_t t0 = tool_now_ns();
	if (x->v == VIA_TCP) {
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
	if (cold && x->v == VIA_USER)
		for (int k = 0; k < nb; k++)
			munmap(dst[k], sz);
	return ok;
}

/* One ecx load of nb items of size s. Lookups and allocations are not
 * timed; the load is. verify: check every byte. */
static bool ecx_load_one(bench_ctx *x, int s, int nb, bool cold, bool verify,
                         uint64_t *ns)
{
	size_t sz = size_bytes(s);
	int pool = sizes[s].pool;
	int first = cold ? x->cur_ecx : 0;
	if (cold)
		x->cur_ecx = (x->cur_ecx + nb) % pool;
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
		else if (x->v == VIA_USER)
			it[k].dst = fresh_map(sz);
		else
			it[k].dst = ecx_consumer_alloc(x->c, sz);
		if (it[k].dst == NULL) {
			tool_fail("bench", EXIT_FAIL, "no memory for %s",
			          ids[k]);
			nb = k;
			ok = false;
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
	if (cold)
		for (int k = 0; k < nb; k++) {
			if (x->v == VIA_USER)
				munmap(it[k].dst, sz);
			else
				ecx_consumer_free(x->c, it[k].dst);
		}
	return ok;
}

/* One row: repetitions of a baseline block then an ecx block. Raw TCP
 * runs two baseline blocks, a blocking receiver's and a polling one's (in
 * turn first), and the faster is the repetition's baseline. */
static bool bench_row(bench_ctx *x, int s, int bi, bool cold)
{
	int nb = batches[bi];
	size_t bytes = size_bytes(s) * (size_t)nb;
	int iters = block_iters(bytes), R = nreps();
	int nbase = x->v == VIA_TCP ? 2 : 1;
	reps ratio = {0}, eg = {0}, bg = {0}, p50r = {0}, bmode[2];
	memset(bmode, 0, sizeof(bmode)); /* 0: IO_RECV, 1: IO_POLL */
	samples lat = {0};
	uint64_t ns;
	bool ok = true;
	x->wlooked = false;
	/* Warm rows load into the same destinations every time: the
	 * receive arena's, or the caller's memory faulted in beforehand. */
	for (int k = 0; k < nb && !cold; k++) {
		x->wdst[k] = x->v == VIA_USER
		                 ? warm_alloc(size_bytes(s))
		                 : ecx_consumer_alloc(x->c, size_bytes(s));
		if (x->wdst[k] == NULL)
			ok =
			    tool_fail("bench", EXIT_FAIL, "out of memory") == 0;
	}
	/* One of each, untimed, so first-time costs of the row (a first
	 * registration of warm destinations) fall outside. */
	for (int m = 0; m < nbase && ok; m++)
		ok = base_load(x, s, nb, cold, m ? IO_POLL : IO_RECV, &ns);
	ok = ok && ecx_load_one(x, s, nb, cold, true, &ns);
	for (int r = 0; r < R && ok; r++) {
		samples b[2] = {{0}}, e = {0};
		double bgb = 0;
		for (int j = 0; j < nbase && ok; j++) {
			int m = (j + r) % nbase; /* 0: IO_RECV, 1: IO_POLL */
			for (int i = 0; i < iters && ok; i++) {
				ok = base_load(x, s, nb, cold,
				               m ? IO_POLL : IO_RECV, &ns);
				samples_add(&b[m], ns);
			}
		}
		for (int i = 0; i < iters && ok; i++) {
			ok = ecx_load_one(x, s, nb, cold, r == R - 1, &ns);
			samples_add(&e, ns);
			samples_add(&lat, ns);
		}
		if (ok) {
			for (int m = 0; m < nbase; m++) {
				double g = (double)bytes /
				           (double)samples_pct(&b[m], 50);
				reps_add(&bmode[m], g);
				bgb = g > bgb ? g : bgb;
			}
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
	for (int k = 0; k < nb && !cold; k++) {
		if (x->v == VIA_USER)
			free(x->wdst[k]);
		else if (x->wdst[k] != NULL)
			ecx_consumer_free(x->c, x->wdst[k]);
		x->wdst[k] = NULL;
	}
	if (!ok) {
		samples_free(&lat);
		return false;
	}
	double p50 = (double)samples_pct(&lat, 50) / 1e3;
	double p99 = (double)samples_pct(&lat, 99) / 1e3;
	const char *cache = cold ? "cold" : "warm";
	char buf[96], row[96], modes[128] = "";
	if (x->v == VIA_TCP)
		snprintf(modes, sizeof(modes),
		         ", \"baseline_blocking_gbps\": %.3f, "
		         "\"baseline_polling_gbps\": %.3f",
		         reps_med(&bmode[0]), reps_med(&bmode[1]));
	snprintf(row, sizeof(row), "transfer %s %s x%d %s", via_label[x->v],
	         sizes[s].name, nb, cache);
	if (json)
		row_json("transfer", via_json[x->v],
		         "\"size\": \"%s\", \"batch\": %d, \"cache\": \"%s\", "
		         "\"gbps\": %.3f, \"p50_us\": %.1f, \"p99_us\": %.1f, "
		         "\"baseline\": \"%s\", \"baseline_gbps\": %.3f, "
		         "\"ratio\": %.3f, \"ratio_min\": %.3f, "
		         "\"ratio_max\": %.3f, \"p50_us_best_rep\": %.1f, "
		         "\"reps\": %d, \"loads\": %d%s",
		         sizes[s].name, nb, cache, reps_med(&eg), p50, p99,
		         x->v == VIA_TCP ? "raw_tcp" : "memcpy", reps_med(&bg),
		         reps_med(&ratio), reps_min(&ratio), reps_max(&ratio),
		         reps_min(&p50r), R, iters, modes);
	else
		printf("  %-4s %6s x%-3d %-4s %8.2f %9.1f %9.1f %9.2f   %s\n",
		       via_label[x->v], sizes[s].name, nb, cache, reps_med(&eg),
		       p50, p99, reps_med(&bg),
		       fmt_reps(&ratio, 2, buf, sizeof(buf)));
	fflush(stdout);
	/* --check: each row against its target; --quick: the median of a
	 * group's rows (shm 7 MiB, tcp >= 1 MiB), and the best repetition's
	 * p50 (load only adds to a latency), against its floor. */
	const targets *t = tgt();
	if (!cold && x->v == VIA_SHM && s == 2) {
		if (quick)
			reps_add(&group_shm7, reps_med(&ratio));
		else
			check_row(reps_med(&ratio) >= t->shm7_ratio, row,
			          "%.2fx memcpy, below %.2fx", reps_med(&ratio),
			          t->shm7_ratio);
	}
	if (!cold && x->v == VIA_SHM && s == 0 && nb == 1) {
		double v = quick ? reps_min(&p50r) : p50;
		check_row(v < t->shm64_p50, row,
		          "%sp50 %.1f us, not below %.0f us",
		          quick ? "best repetition's " : "", v, t->shm64_p50);
	}
	if (!cold && x->v == VIA_TCP && s >= 1) {
		if (quick)
			reps_add(&group_tcp, reps_med(&ratio));
		else
			check_row(reps_med(&ratio) >= t->tcp_ratio, row,
			          "%.2fx raw TCP, below %.2fx",
			          reps_med(&ratio), t->tcp_ratio);
	}
	samples_free(&lat);
	return true;
}

/* The price of integrity: warm loads of nb items of size s into the
 * receive arena by a consumer that checks each item's xxh64 (hashed) beside
 * the same loads by one that does not (x->c), alternating blocks. */
static bool bench_integrity(bench_ctx *x, ecx_consumer *hashed, int s, int nb)
{
	size_t sz = size_bytes(s), bytes = sz * (size_t)nb;
	int iters = block_iters(bytes), R = nreps();
	ecx_consumer *cs[2] = {x->c, hashed};
	ecx_item it[2][MAXBATCH];
	char ids[MAXBATCH][64];
	reps gb[2], ratio = {0};
	memset(gb, 0, sizeof(gb));
	bool ok = true;
	memset(it, 0, sizeof(it));
	for (int w = 0; w < 2; w++)
		for (int k = 0; k < nb; k++) {
			snprintf(ids[k], sizeof(ids[k]), "%s-%d", sizes[s].name,
			         k);
			it[w][k].id = ids[k];
		}
	for (int w = 0; w < 2 && ok; w++) {
		ok = ecx_consumer_lookup(cs[w], it[w], (size_t)nb) == 0;
		for (int k = 0; k < nb && ok; k++)
			ok = (it[w][k].dst = ecx_consumer_alloc(cs[w], sz)) !=
			     NULL;
		/* untimed: the first load registers nothing new, but
		 * connects */
		ok = ok && ecx_consumer_load(cs[w], it[w], (size_t)nb) == 0;
	}
	for (int r = 0; r < R && ok; r++) {
		double g[2];
		for (int w = 0; w < 2 && ok; w++) {
			samples sm = {0};
			for (int i = 0; i < iters && ok; i++) {
				uint64_t t0 = tool_now_ns();
				ok = ecx_consumer_load(cs[w], it[w],
				                       (size_t)nb) == 0;
				samples_add(&sm, tool_now_ns() - t0);
			}
			g[w] = (double)bytes / (double)samples_pct(&sm, 50);
			reps_add(&gb[w], g[w]);
			samples_free(&sm);
		}
		if (ok)
			reps_add(&ratio, g[1] / g[0]);
	}
	if (!ok)
		tool_fail("bench", EXIT_FAIL, "integrity row: %s",
		          ecx_last_error());
	for (int w = 0; w < 2; w++)
		for (int k = 0; k < nb; k++)
			if (it[w][k].dst != NULL)
				ecx_consumer_free(cs[w], it[w][k].dst);
	if (!ok)
		return false;
	char buf[96];
	if (json)
		row_json("transfer", "integrity",
		         "\"via\": \"%s\", \"size\": \"%s\", \"batch\": %d, "
		         "\"gbps_checking\": %.3f, \"gbps_plain\": %.3f, "
		         "\"ratio\": %.3f, \"ratio_min\": %.3f, "
		         "\"ratio_max\": %.3f, \"reps\": %d",
		         via_json[x->v], sizes[s].name, nb, reps_med(&gb[1]),
		         reps_med(&gb[0]), reps_med(&ratio), reps_min(&ratio),
		         reps_max(&ratio), R);
	else
		printf("  %-4s %6s x%-3d %-4s %8.2f %9s %9s %9.2f   %s "
		       "(integrity: checking xxh64 vs not)\n",
		       via_label[x->v], sizes[s].name, nb, "hash",
		       reps_med(&gb[1]), "", "", reps_med(&gb[0]),
		       fmt_reps(&ratio, 2, buf, sizeof(buf)));
	fflush(stdout);
	return true;
}

/* Waits until every item of the producer's pools is found by a lookup,
 * so no row runs while the producer is still publishing. */
static bool producer_settled(ecx_consumer *c)
{
	enum { MAXPOOL = 1024 + 64 + 32 };
	static ecx_item it[MAXPOOL];
	static char ids[MAXPOOL][32];
	size_t n = 0;
	for (int s = 0; s < NSIZES; s++)
		for (int i = 0; i < sizes[s].pool && n < MAXPOOL; i++, n++)
			snprintf(ids[n], sizeof(ids[n]), "%s-%d", sizes[s].name,
			         i);
	uint64_t end = tool_now_ns() + 60000000000ull;
	while (tool_now_ns() < end) {
		memset(it, 0, sizeof(it));
		for (size_t i = 0; i < n; i++)
			it[i].id = ids[i];
		ecx_consumer_lookup(c, it, n);
		size_t found = 0;
		for (size_t i = 0; i < n; i++)
			found += it[i].status == 0;
		if (found == n)
			return true;
		usleep(100000);
	}
	return false;
}

/* Starts the raw TCP source and connects to it. */
static bool tcp_source_start(proc *pr, int *fd)
{
	char *a[] = {"bench", "--peer-addr", (char *)peer_addr,
	             "--tcp-source-for-bench", NULL};
	char line[64];
	unsigned port;
	if (!proc_start_via(pr, peer_wrap, a) ||
	    !proc_line(pr, line, sizeof(line), 30000) ||
	    sscanf(line, "ready %u", &port) != 1)
		return false;
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_port = htons((uint16_t)port)};
	inet_pton(AF_INET, peer_addr, &sa.sin_addr);
	*fd = socket(AF_INET, SOCK_STREAM, 0);
	if (*fd < 0 || connect(*fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
		return false;
	tcp_tune(*fd);
	/* The blocking receiver's bound, as IO_POLL's: 30 s without a byte. */
	struct timeval tv = {.tv_sec = 30};
	setsockopt(*fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	return true;
}

/* One transport's rows. */
static int bench_transfer_one(via v)
{
	const char *transport = v == VIA_TCP ? "tcp" : "shm";
	proc pr = {0}, src = {0};
	char *a[] = {"bench",           "--peer-addr",
	             (char *)peer_addr, "--producer-for-bench",
	             (char *)transport, NULL};
	char line[256];
	unsigned port = 0;
	if (!proc_start_via(&pr, peer_wrap, a) ||
	    !proc_line(&pr, line, sizeof(line), 60000) ||
	    sscanf(line, "ready %u", &port) != 1) {
		if (pr.pid > 0)
			proc_stop(&pr, SIGTERM, 5000);
		return tool_fail("bench", EXIT_FAIL,
		                 "the benchmark's producer did not start");
	}
	bench_ctx x = {.v = v, .tcp = -1};
	int rc = EXIT_OK;
	if (v == VIA_TCP && !tcp_source_start(&src, &x.tcp)) {
		rc = tool_fail("bench", EXIT_FAIL,
		               "the raw TCP baseline's sender did not start");
		goto out;
	}
	char url[64], why[256];
	snprintf(url, sizeof(url), "http://%s:%u", peer_addr, port);
	ecx_consumer_params cp = {.field_mask =
	                              ECX_CONSUMER_PARAM_REGISTRY |
	                              ECX_CONSUMER_PARAM_RECV_CAPACITY |
	                              ECX_CONSUMER_PARAM_TRANSPORT,
	                          .registry = url,
	                          .recv_capacity = 240u << 20,
	                          .transport = transport};
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
		if (v != VIA_TCP && (x.bsrc = warm_alloc(pool)) == NULL)
			rc = tool_fail("bench", EXIT_FAIL, "out of memory");
		if (rc == EXIT_OK && (x.bdst = warm_alloc(pool)) == NULL)
			rc = tool_fail("bench", EXIT_FAIL, "out of memory");
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
	/* Integrity's price, into the receive arena, 1 MiB and 7 MiB x8. */
	if (rc == EXIT_OK && v != VIA_USER) {
		ecx_consumer *hashed = NULL;
		cp.field_mask |= ECX_CONSUMER_PARAM_INTEGRITY;
		cp.integrity = 1;
		cp.recv_capacity = 64u << 20;
		if (ecx_consumer_create(&cp, &hashed, why, sizeof(why)) != 0)
			rc = tool_fail("bench", EXIT_FAIL, "%s", why);
		for (int s = 1; s < NSIZES && rc == EXIT_OK; s++)
			if (!bench_integrity(&x, hashed, s, 8))
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

/* The kernel's TCP buffer ceilings, for the table header. */
static void tcp_limits(char *buf, size_t len)
{
	unsigned long w[3] = {0}, r[3] = {0};
	FILE *f = fopen("/proc/sys/net/ipv4/tcp_wmem", "r");
	if (f != NULL) {
		if (fscanf(f, "%lu %lu %lu", &w[0], &w[1], &w[2]) != 3)
			w[2] = 0;
		fclose(f);
	}
	f = fopen("/proc/sys/net/ipv4/tcp_rmem", "r");
	if (f != NULL) {
		if (fscanf(f, "%lu %lu %lu", &r[0], &r[1], &r[2]) != 3)
			r[2] = 0;
		fclose(f);
	}
	char a[32], b[32];
	snprintf(buf, len, "up to %s send, %s receive",
	         tool_bytes(w[2], a, sizeof(a)),
	         tool_bytes(r[2], b, sizeof(b)));
}

static int bench_transfer(void)
{
	if (!json) {
		char lim[96];
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
		    "  warm: the same ids into the same destinations; cold: "
		    "ids unused for 32+ MiB of loads, fresh destinations "
		    "(shm*: never-touched memory), baselines alike\n"
		    "  hash: warm loads into the receive arena by a consumer "
		    "checking each item's xxh64 (integrity on); base: the "
		    "same loads by one that does not, alternating\n",
		    peer_wrap != NULL ? "producer reached at --peer-addr "
		                        "through --peer-wrap"
		                      : "loopback",
		    nreps(), lim);
		printf("  %-4s %6s %-4s %-4s %8s %9s %9s %9s   %s\n", "via",
		       "item", "batch", "", "GB/s", "p50 us", "p99 us",
		       "base GB/s", "ratio");
	}
	int rc = EXIT_OK;
	if (via_mask & VIA_BIT_SHM)
		rc = bench_transfer_one(VIA_SHM);
	if (rc == EXIT_OK && (via_mask & VIA_BIT_USER))
		rc = bench_transfer_one(VIA_USER);
	if (rc == EXIT_OK && (via_mask & VIA_BIT_TCP))
		rc = bench_transfer_one(VIA_TCP);
	if (rc == EXIT_OK && quick && group_shm7.n > 0)
		check_row(reps_med(&group_shm7) >= tgt()->shm7_ratio,
		          "transfer shm 7MiB warm (median of its rows)",
		          "%.2fx memcpy, below %.2fx", reps_med(&group_shm7),
		          tgt()->shm7_ratio);
	if (rc == EXIT_OK && quick && group_tcp.n > 0)
		check_row(reps_med(&group_tcp) >= tgt()->tcp_ratio,
		          "transfer tcp 1MiB and 7MiB warm (median of their "
		          "rows)",
		          "%.2fx raw TCP, below %.2fx", reps_med(&group_tcp),
		          tgt()->tcp_ratio);
	if (!json)
		printf("  targets%s: shm 7MiB warm >= %.2fx memcpy; shm 64KiB "
		       "x1 warm p50 < %.0f us; tcp warm 1MiB and 7MiB >= %.2fx "
		       "raw TCP\n",
		       quick ? " (--quick floors)" : "", tgt()->shm7_ratio,
		       tgt()->shm64_p50, tgt()->tcp_ratio);
	return rc;
}

/* ---- file baseline ---- */

static volatile unsigned char copy_sink;

/* Reads the copy back so the compiler cannot drop a memcpy into memory
 * that is freed right after it. */
static void keep_copy(const void *p, size_t n)
{
	const volatile unsigned char *c = p;
	copy_sink ^= c[0] ^ c[n / 2] ^ c[n - 1];
}

static int bench_file(void)
{
	struct stat sb;
	const char *base = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
	char dir[256];
	snprintf(dir, sizeof(dir), "%s/ecx-bench-%ld", base, (long)getpid());
	if (mkdir(dir, 0700) != 0)
		return tool_fail("bench", EXIT_FAIL, "cannot create %s", dir);
	int R = nreps();
	if (!json)
		printf("file: one safetensors file per item in %s (vLLM's "
		       "ECExampleConnector), loaded (open, parse, malloc, "
		       "read); baseline: malloc and memcpy of the same size; "
		       "%d repetitions of (memcpy block, file block)\n"
		       "  %6s %10s %10s %12s %12s   %s\n",
		       base, R, "item", "save GB/s", "load GB/s", "load p50 us",
		       "memcpy GB/s", "ratio");
	int rc = EXIT_OK;
	void *buf = malloc(7u << 20);
	for (int s = 0; s < NSIZES && rc == EXIT_OK; s++) {
		uint64_t dims[2] = {sizes[s].rows, sizes[s].cols};
		ecx_tensor_desc d;
		ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
		gen_fill(sizes[s].name, buf, d.nbytes);
		samples sv = {0}, lat = {0};
		reps lg = {0}, mg = {0}, ratio = {0};
		int iters = quick ? 5 : 20;
		char path[512], why[256];
		for (int i = 0; i < iters; i++) {
			snprintf(path, sizeof(path), "%s/%s-%d.safetensors",
			         dir, sizes[s].name, i);
			uint64_t t0 = tool_now_ns();
			if (st_save(path, &d, buf, why, sizeof(why)) != 0)
				rc = tool_fail("bench", EXIT_FAIL, "%s", why);
			samples_add(&sv, tool_now_ns() - t0);
		}
		for (int r = 0; r < R && rc == EXIT_OK; r++) {
			samples m = {0}, l = {0};
			for (int i = 0; i < iters; i++) {
				/* Into memory got as the loader gets it. */
				uint64_t t0 = tool_now_ns();
				void *dst = malloc(d.nbytes);
				if (dst == NULL)
					break;
				memcpy(dst, buf, d.nbytes);
				samples_add(&m, tool_now_ns() - t0);
				keep_copy(dst, d.nbytes);
				free(dst);
			}
			for (int i = 0; i < iters && rc == EXIT_OK; i++) {
				snprintf(path, sizeof(path),
				         "%s/%s-%d.safetensors", dir,
				         sizes[s].name, i);
				void *back = NULL;
				ecx_tensor_desc bd;
				uint64_t t0 = tool_now_ns();
				int e =
				    st_load(path, &bd, &back, why, sizeof(why));
				uint64_t dt = tool_now_ns() - t0;
				samples_add(&l, dt);
				samples_add(&lat, dt);
				if (e != 0 ||
				    !gen_check(sizes[s].name, back, bd.nbytes))
					rc =
					    tool_fail("bench", EXIT_FAIL,
					              "file baseline: %s", why);
				free(back);
			}
			if (rc == EXIT_OK && m.n > 0) {
				double a = (double)d.nbytes /
				           (double)samples_pct(&m, 50);
				double b = (double)d.nbytes /
				           (double)samples_pct(&l, 50);
				reps_add(&mg, a);
				reps_add(&lg, b);
				reps_add(&ratio, b / a);
			}
			samples_free(&m);
			samples_free(&l);
		}
		for (int i = 0; i < iters; i++) {
			snprintf(path, sizeof(path), "%s/%s-%d.safetensors",
			         dir, sizes[s].name, i);
			unlink(path);
		}
		double sg = (double)d.nbytes / (double)samples_pct(&sv, 50);
		double lp = (double)samples_pct(&lat, 50) / 1e3;
		char rb[96];
		if (rc == EXIT_OK && json)
			row_json(
			    "file", sizes[s].name,
			    "\"save_gbps\": %.3f, \"load_gbps\": %.3f, "
			    "\"load_p50_us\": %.1f, \"memcpy_gbps\": %.3f, "
			    "\"ratio\": %.3f, \"ratio_min\": %.3f, "
			    "\"ratio_max\": %.3f",
			    sg, reps_med(&lg), lp, reps_med(&mg),
			    reps_med(&ratio), reps_min(&ratio),
			    reps_max(&ratio));
		else if (rc == EXIT_OK)
			printf("  %6s %10.2f %10.2f %12.1f %12.2f   %s\n",
			       sizes[s].name, sg, reps_med(&lg), lp,
			       reps_med(&mg),
			       fmt_reps(&ratio, 2, rb, sizeof(rb)));
		samples_free(&sv);
		samples_free(&lat);
	}
	free(buf);
	rmdir(dir);
	return rc;
}

/* --via: "shm,user,tcp" or any part of it. */
static bool parse_via(const char *arg)
{
	char *buf = strdup(arg);
	if (buf == NULL)
		return false;
	via_mask = 0;
	for (char *sv, *t = strtok_r(buf, ",", &sv); t != NULL;
	     t = strtok_r(NULL, ",", &sv)) {
		if (strcmp(t, "shm") == 0)
			via_mask |= VIA_BIT_SHM;
		else if (strcmp(t, "user") == 0)
			via_mask |= VIA_BIT_USER;
		else if (strcmp(t, "tcp") == 0)
			via_mask |= VIA_BIT_TCP;
		else
			via_mask = 1u << 31; /* not a row: refused below */
	}
	free(buf);
	return via_mask != 0 && (via_mask >> 31) == 0;
}

int cmd_bench(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"quick", no_argument, NULL, 'q'},
	    {"check", no_argument, NULL, 'c'},
	    {"json", no_argument, NULL, 'j'},
	    {"producer-for-bench", required_argument, NULL, 'P'},
	    {"tcp-source-for-bench", no_argument, NULL, 'S'},
	    {"redis", required_argument, NULL, 'R'},
	    {"via", required_argument, NULL, 'V'},
	    {"peer-wrap", required_argument, NULL, 'W'},
	    {"peer-addr", required_argument, NULL, 'A'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	int c;
	bool addr_given = false;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'q':
			quick = true;
			break;
		case 'c':
			check = true;
			break;
		case 'j':
			json = true;
			break;
		case 'P':
			return bench_producer(optarg);
		case 'S':
			return bench_tcp_source();
		case 'R':
			redis_url = optarg;
			break;
		case 'V':
			if (!parse_via(optarg))
				return tool_fail(
				    "bench", EXIT_USAGE,
				    "--via '%s': a comma-separated "
				    "list of shm, user, tcp",
				    optarg);
			break;
		case 'W':
			if (access(optarg, X_OK) != 0)
				return tool_fail("bench", EXIT_USAGE,
				                 "--peer-wrap '%s': %m",
				                 optarg);
			peer_wrap = optarg;
			break;
		case 'A': {
			struct in_addr ia;
			if (inet_pton(AF_INET, optarg, &ia) != 1)
				return tool_fail("bench", EXIT_USAGE,
				                 "--peer-addr '%s': an IPv4 "
				                 "address, such as 127.0.0.1",
				                 optarg);
			peer_addr = optarg;
			addr_given = true;
			break;
		}
		case 'h':
			fputs(help, stdout);
			return EXIT_OK;
		default:
			fputs(help, stderr);
			return EXIT_USAGE;
		}
	}
	/* The wrapper runs the producer and the raw TCP sender elsewhere:
	 * only tcp rows can reach them there, and only at an address given. */
	if (peer_wrap != NULL && (via_mask != VIA_BIT_TCP || !addr_given))
		return tool_fail("bench", EXIT_USAGE,
		                 "--peer-wrap needs --via tcp (only) and "
		                 "--peer-addr (the address its peers bind in "
		                 "their namespace); see 'ecx bench --help'");
	const char *what = optind < argc ? argv[optind] : "all";
	if (argc - optind > 1) {
		fputs(help, stderr);
		return EXIT_USAGE;
	}
	bool all = strcmp(what, "all") == 0;
	if (!all && strcmp(what, "registry") != 0 &&
	    strcmp(what, "transfer") != 0 && strcmp(what, "file") != 0)
		return tool_fail("bench", EXIT_USAGE,
		                 "unknown benchmark '%s' (registry, transfer, "
		                 "file, all)",
		                 what);
	signal(SIGPIPE, SIG_IGN);
	curl_global_init(CURL_GLOBAL_DEFAULT);
	int rc = EXIT_OK;
	if (rc == EXIT_OK && (all || strcmp(what, "registry") == 0))
		rc = bench_registry();
	if (rc == EXIT_OK && (all || strcmp(what, "transfer") == 0))
		rc = bench_transfer();
	if (rc == EXIT_OK && (all || strcmp(what, "file") == 0))
		rc = bench_file();
	curl_global_cleanup();
	if (rc == EXIT_OK && check) {
		if (nmissed > 0)
			return tool_fail("bench", EXIT_FAIL,
			                 "%d row(s) missed their %s", nmissed,
			                 quick ? "--quick floors" : "targets");
		if (!json)
			printf("check: every %s met\n",
			       quick ? "--quick floor" : "target");
	}
	return rc;
}
