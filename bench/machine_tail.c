/*
 * machine_tail.c - the tail this machine gives a small load with no ecx in
 * it: what `ecx bench transfer`'s p99 check (p99 <= 3x p50 for single
 * loads) is up against before any of ecx's own work.
 *
 *   spin   a thread per CPU reading CLOCK_MONOTONIC in a loop for a
 *          second: how often a running thread is held up (the gaps
 *          between two reads), per CPU and second, and the longest;
 *   pong   two processes, each on a CPU of its own choosing (none is
 *          pinned), polling a flag in shared memory, as ecx's consumer
 *          and producer poll UCX's queues: a request, a 64 KiB copy by
 *          the other process (the shm load's bytes) and the answer, N
 *          times back to back; then the same with the answering process
 *          busy --work-us in all (polling the clock), so that the round
 *          trip lasts as long as ecx's 64 KiB load and is as exposed to
 *          hold-ups; p50 and p99, and p99 over p50, of all N and of
 *          blocks of 200 (a bench row's single loads);
 *   wake   a one-byte round trip over pipes between two processes that
 *          sleep in read(), after the caller idled (spinning) 0, 1000 and
 *          5000 us: the cost of waking a thread that slept, as a
 *          producer's progress thread does after 200 us without work.
 *
 *   ecx-bench-machine-tail [--n N] [--work-us US]   (defaults 2000, 9)
 *
 * Every wait is bounded: a peer that dies or stops ends the run with an
 * error within 2 s (pong) or 30 s (wake), never a hang.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define COPY (64u << 10)
#define BLOCK 200
#define N_MAX 1000000
/* The most a peer may take to answer before the run gives up. */
#define WAIT_NS 2000000000ull

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* The q-th percentile of v[0..n), sorted in place, as `ecx bench` takes
 * it (tools/stats.c, samples_pct: the rank rounded up, so p99 of 200 is
 * the third slowest). */
static double pct_us(uint64_t *v, size_t n, int q)
{
	qsort(v, n, sizeof(*v), cmp_u64);
	size_t rank = (n * (size_t)q + 99) / 100;
	rank = rank < 1 ? 1 : rank > n ? n : rank;
	return (double)v[rank - 1] / 1e3;
}

static void die(const char *what)
{
	fprintf(stderr, "ecx-bench-machine-tail: %s\n", what);
	exit(1);
}

/* --- spin -------------------------------------------------------------- */

typedef struct {
	uint64_t over10, over20, over40, longest;
} gaps;

static void *spin_main(void *p)
{
	gaps *g = p;
	uint64_t end = now_ns() + 1000000000u, prev = now_ns();
	for (uint64_t t; (t = now_ns()) < end; prev = t) {
		uint64_t d = t - prev;
		g->over10 += d >= 10000;
		g->over20 += d >= 20000;
		g->over40 += d >= 40000;
		g->longest = d > g->longest ? d : g->longest;
	}
	return NULL;
}

static void run_spin(void)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	ncpu = ncpu < 1 ? 1 : ncpu > 256 ? 256 : ncpu;
	pthread_t th[256];
	gaps g[256];
	memset(g, 0, sizeof(g));
	for (long i = 0; i < ncpu; i++)
		if (pthread_create(&th[i], NULL, spin_main, &g[i]) != 0)
			die("cannot start a thread");
	for (long i = 0; i < ncpu; i++)
		pthread_join(th[i], NULL);
	for (long i = 0; i < ncpu; i++)
		printf("spin  thread %ld of %ld, 1 s: held up >= 10 us %llu "
		       "times, >= 20 us %llu, >= 40 us %llu; longest %.0f us\n",
		       i + 1, ncpu, (unsigned long long)g[i].over10,
		       (unsigned long long)g[i].over20,
		       (unsigned long long)g[i].over40,
		       (double)g[i].longest / 1e3);
}

/* --- pong -------------------------------------------------------------- */

typedef struct {
	_Atomic uint64_t ask, done; /* sequence numbers */
	_Atomic int quit;
	uint64_t work_ns; /* the answerer's time per ask, at least */
	char src[COPY], dst[COPY];
} shared;

/* Polls until *w reaches want; false past WAIT_NS. */
static bool poll_for(_Atomic uint64_t *w, uint64_t want)
{
	uint64_t until = now_ns() + WAIT_NS;
	unsigned k = 0;
	while (atomic_load_explicit(w, memory_order_acquire) < want)
		if ((++k & 1023) == 0 && now_ns() > until)
			return false;
	return true;
}

static void report(const char *what, uint64_t *v, size_t n)
{
	/* Blocks of BLOCK first (each sorted in place, which leaves the
	 * whole unordered but intact), then all n. */
	size_t nb = n / BLOCK, over = 0;
	double worst = 0;
	for (size_t b = 0; b < nb; b++) {
		double p50 = pct_us(v + b * BLOCK, BLOCK, 50);
		double r = pct_us(v + b * BLOCK, BLOCK, 99) / p50;
		over += r > 3.0;
		worst = r > worst ? r : worst;
	}
	double p50 = pct_us(v, n, 50), p99 = pct_us(v, n, 99);
	printf("%s: p50 %.1f us, p99 %.1f us (%.1fx) of %zu; blocks of %d: "
	       "p99 over 3x p50 in %zu of %zu, worst %.1fx\n",
	       what, p50, p99, p99 / p50, n, BLOCK, over, nb, worst);
}

static void run_pong(int n, unsigned work_us)
{
	shared *s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE,
	                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (s == MAP_FAILED)
		die("no shared memory");
	memset(s, 0, sizeof(*s));
	memset(s->src, 0x5a, COPY);
	s->work_ns = (uint64_t)work_us * 1000u;
	pid_t pid = fork();
	if (pid < 0)
		die("cannot fork");
	if (pid == 0) { /* the producer: answers each ask with a copy */
		for (uint64_t i = 1;; i++) {
			uint64_t until = now_ns() + WAIT_NS;
			while (atomic_load_explicit(&s->ask,
			                            memory_order_acquire) < i) {
				if (atomic_load(&s->quit) || now_ns() > until)
					_exit(0);
			}
			uint64_t t0 = now_ns();
			memcpy(s->dst, s->src, COPY);
			while (now_ns() - t0 < s->work_ns)
				;
			atomic_store_explicit(&s->done, i,
			                      memory_order_release);
		}
	}
	uint64_t *v = calloc((size_t)n, sizeof(*v));
	bool ok = v != NULL;
	for (int i = 0; i < BLOCK && ok; i++) { /* warm-up, untimed */
		atomic_store_explicit(&s->ask, (uint64_t)i + 1,
		                      memory_order_release);
		ok = poll_for(&s->done, (uint64_t)i + 1);
	}
	for (int i = 0; i < n && ok; i++) {
		uint64_t seq = (uint64_t)(BLOCK + i + 1), t0 = now_ns();
		atomic_store_explicit(&s->ask, seq, memory_order_release);
		ok = poll_for(&s->done, seq);
		v[i] = now_ns() - t0;
	}
	atomic_store(&s->quit, 1);
	if (!ok) /* stopped, perhaps: it would not see quit */
		kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	if (!ok)
		die("pong: the other process did not answer within 2 s");
	char what[128];
	snprintf(what, sizeof(what),
	         "pong  a 64 KiB copy asked of another process, polling "
	         "shared memory, the answer after >= %u us",
	         work_us);
	report(what, v, (size_t)n);
	free(v);
	munmap(s, sizeof(*s));
}

/* --- wake -------------------------------------------------------------- */

/* The wake test's round trips block in read(), so its bound is an alarm:
 * the other process killed, an error said, exit 1. */
#define WAKE_LIMIT_S 30
static volatile sig_atomic_t wake_peer;

static void wake_expired(int sig)
{
	(void)sig;
	static const char m[] = "ecx-bench-machine-tail: wake: no answer "
	                        "within the test's 30 s\n";
	if (wake_peer > 0)
		kill((pid_t)wake_peer, SIGKILL);
	if (write(2, m, sizeof(m) - 1) < 0)
		_exit(1);
	_exit(1);
}

static void run_wake(int n)
{
	int a[2], b[2];
	if (pipe(a) != 0 || pipe(b) != 0)
		die("no pipes");
	pid_t pid = fork();
	if (pid < 0)
		die("cannot fork");
	if (pid == 0) {
		close(a[1]);
		close(b[0]);
		char c;
		while (read(a[0], &c, 1) == 1)
			if (write(b[1], &c, 1) != 1)
				break;
		_exit(0);
	}
	close(a[0]);
	close(b[1]);
	wake_peer = pid;
	signal(SIGALRM, wake_expired);
	alarm(WAKE_LIMIT_S);
	int m = n < 400 ? n : 400; /* 5 ms apart: 2 s at most */
	uint64_t *v = calloc((size_t)m, sizeof(*v));
	if (v == NULL)
		die("out of memory");
	static const int idle_us[] = {0, 1000, 5000};
	for (size_t k = 0; k < sizeof(idle_us) / sizeof(idle_us[0]); k++) {
		for (int i = 0; i < m; i++) {
			uint64_t s = now_ns();
			while (now_ns() - s < (uint64_t)idle_us[k] * 1000u)
				;
			char c = 1;
			uint64_t t0 = now_ns();
			if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1)
				die("wake: the other process is gone");
			v[i] = now_ns() - t0;
		}
		double p50 = pct_us(v, (size_t)m, 50);
		double p99 = pct_us(v, (size_t)m, 99);
		printf("wake  a pipe round trip to a process asleep in read(), "
		       "after %d us idle: p50 %.1f us, p99 %.1f us of %d\n",
		       idle_us[k], p50, p99, m);
	}
	close(a[1]);
	close(b[0]);
	waitpid(pid, NULL, 0);
	alarm(0);
	free(v);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"n", required_argument, 0, 'n'},
	    {"work-us", required_argument, 0, 'w'},
	    {"help", no_argument, 0, 'h'},
	    {0, 0, 0, 0}};
	int n = 2000;
	unsigned work_us = 9;
	for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
		char *end;
		switch (c) {
		case 'n':
			errno = 0;
			long x = strtol(optarg, &end, 10);
			if (errno != 0 || *end != '\0' || x < BLOCK ||
			    x > N_MAX) {
				fprintf(stderr,
				        "ecx-bench-machine-tail: --n is %d to "
				        "%d, not '%s'\n",
				        BLOCK, N_MAX, optarg);
				return 2;
			}
			n = (int)x;
			break;
		case 'w':
			errno = 0;
			long w = strtol(optarg, &end, 10);
			if (errno != 0 || *end != '\0' || w < 1 || w > 10000) {
				fprintf(
				    stderr,
				    "ecx-bench-machine-tail: --work-us is 1 "
				    "to 10000, not '%s'\n",
				    optarg);
				return 2;
			}
			work_us = (unsigned)w;
			break;
		case 'h':
			printf("usage: ecx-bench-machine-tail [--n N] "
			       "[--work-us US]\n"
			       "  the tail this machine gives a small load "
			       "with no ecx in it (bench/machine_tail.c)\n");
			return 0;
		default:
			return 2;
		}
	}
	if (optind != argc) {
		fprintf(stderr, "ecx-bench-machine-tail: unexpected '%s'\n",
		        argv[optind]);
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	run_spin();
	run_pong(n, 0);
	run_pong(n, work_us);
	run_wake(n);
	return 0;
}
