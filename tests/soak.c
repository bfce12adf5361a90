/*
 * soak.c - a bounded soak: one producer whose arena is small enough to
 * evict all the time, putting items of random sizes, and several consumer
 * processes pulling random recent ids, verifying every byte. At the end:
 * nothing corrupted, the counters add up on both sides, and the producer's
 * resident memory stayed within its arena plus a stated overhead.
 *
 * Every other lookup of a consumer takes leases (docs/protocol.md "a hit
 * will load"): under the same eviction pressure, no leased item is evicted
 * before its pull (unleased ones are, and are counted apart), the leased
 * bytes never pass their share of the arena, and leases that are never
 * used (a consumer's first leased batch with a hit, then one in 64, is
 * dropped without a load) expire and give their room back.
 *
 * Consumers restart during the run (each process ends after --restart
 * seconds and a new one takes its place, counting on), and the producer is
 * stalled three times (SIGSTOP, 300 ms, SIGCONT), well within the loads'
 * timeout and the leases' time: nothing may fail because of either.
 *
 *   ecx-soak [--seconds N] [--consumers N] [--restart S]
 *                                               (defaults: 60, 3, 15)
 *
 * Prints a summary and "N passed, N failed"; exits non-zero on a failure.
 */
#include "common/testutil.h"

#include <getopt.h>
#include <malloc.h>
#include <sys/mman.h>
#include <time.h>

#define ARENA (32u << 20)
#define OVERHEAD (64u << 20) /* stated: resident beyond the arena */
#define MAX_CONSUMERS 8
#define WINDOW 48 /* consumers pick among the newest WINDOW ids */
#define BATCH 8
#define LEASE_MS 1000  /* the producer's lease_max_ms here */
#define LEASE_SHARE 50 /* percent */

typedef struct shared {
	volatile unsigned port;
	volatile long latest; /* newest id put, -1 before the first */
	volatile int stop;
	int restarts, stalls;
	/* producer, at the end */
	uint64_t puts, put_fail, evictions, pulls, served, failed, pinned;
	uint64_t rss_start, rss_mid, rss_end;
	uint64_t heap_mid, heap_end; /* bytes malloc'd and not freed */
	uint64_t shmem_end;          /* shared pages mapped, arenas included */
	uint64_t lease_max_bytes;    /* most leased bytes seen */
	ecx_producer_stats lst;      /* at the end, after every lease expired */
	/* per consumer */
	struct {
		uint64_t loads, items, ok, notfound, refused, other, corrupt;
		uint64_t bytes;
		/* of the above, items of leased lookups; dropped: leased and
		 * never loaded (left to expire) */
		uint64_t l_items, l_ok, l_notfound, l_refused, l_other;
		uint64_t l_dropped;
	} c[MAX_CONSUMERS];
} shared;

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A field of /proc/self/status, in bytes. */
static uint64_t status_bytes(const char *field)
{
	FILE *f = fopen("/proc/self/status", "r");
	char line[256], fmt[64];
	unsigned long long kb = 0;
	snprintf(fmt, sizeof(fmt), "%s: %%llu kB", field);
	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		if (sscanf(line, fmt, &kb) == 1)
			break;
	if (f != NULL)
		fclose(f);
	return (uint64_t)kb * 1024;
}

/* Resident memory that is the producer's own: its private pages plus its
 * arena. Shared pages beyond the arena are the consumers' receive arenas,
 * mapped here for direct writes (bounded by their sizes), not growth of
 * the producer's. */
static uint64_t rss_bytes(void)
{
	return status_bytes("RssAnon") + ARENA;
}

/* The size of item k: 4 KiB to 2 MiB, fixed by k. */
static uint64_t item_size(long k)
{
	uint64_t x = (uint64_t)k * 0x9E3779B97F4A7C15ull;
	x ^= x >> 29;
	return 4096 + x % (2u << 20);
}

static int run_producer(shared *sh, uint64_t until)
{
	ecx_producer_params p = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_CAPACITY | ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_TIMEOUT |
	        ECX_PRODUCER_PARAM_LEASE_MAX_MS |
	        ECX_PRODUCER_PARAM_LEASE_SHARE,
	    .capacity_bytes = ARENA,
	    .bind_host = "127.0.0.1",
	    .registry_port = 0,
	    .timeout_ms = 10000,
	    .lease_max_ms = LEASE_MS,
	    .lease_share_pct = LEASE_SHARE};
	ecx_producer *prod;
	char why[256];
	if (ecx_producer_create(&p, &prod, why, sizeof(why)) != 0) {
		fprintf(stderr, "soak: producer: %s\n", why);
		return 1;
	}
	sh->rss_start = rss_bytes();
	sh->port = ecx_producer_registry_port(prod);
	char *buf = malloc(2u << 21);
	uint64_t mid = now_ms() + (until - now_ms()) / 3;
	for (long k = 0; now_ms() < until; k++) {
		if (sh->rss_mid == 0 && now_ms() >= mid) {
			sh->rss_mid = rss_bytes();
			sh->heap_mid = mallinfo2().uordblks;
		}
		char id[32];
		snprintf(id, sizeof(id), "soak-%ld", k);
		uint64_t dims[] = {item_size(k)};
		ecx_tensor_desc d;
		ecx_tensor_set(&d, ECX_DTYPE_UINT8, 1, dims);
		tu_fill(id, buf, d.nbytes);
		if (ecx_producer_put(prod, id, &d, buf) == 0)
			sh->puts++;
		else
			sh->put_fail++; /* ENOSPC while pulls pin: allowed */
		ecx_producer_stats ls;
		ecx_producer_stats_get(prod, &ls);
		if (ls.leased_bytes > sh->lease_max_bytes)
			sh->lease_max_bytes = ls.leased_bytes;
		__atomic_store_n(&sh->latest, k, __ATOMIC_RELEASE);
		usleep(2000);
	}
	/* Let the last pulls finish before counting. */
	while (!__atomic_load_n(&sh->stop, __ATOMIC_ACQUIRE))
		usleep(10000);
	ecx_producer_stats st;
	ecx_producer_stats_get(prod, &st);
	sh->evictions = st.evictions;
	sh->pulls = st.pulls;
	sh->served = st.items_served;
	sh->failed = st.items_failed;
	sh->pinned = st.pinned;
	/* Leases nobody used end by their expiry. */
	usleep((LEASE_MS + 200) * 1000);
	ecx_producer_stats_get(prod, &sh->lst);
	sh->rss_end = rss_bytes();
	sh->heap_end = mallinfo2().uordblks;
	sh->shmem_end = status_bytes("RssShmem");
	free(buf);
	ecx_producer_destroy(prod);
	return 0;
}

static int run_consumer(shared *sh, int me, uint64_t until)
{
	char url[64], why[256];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", sh->port);
	ecx_consumer_params cp = {.field_mask =
	                              ECX_CONSUMER_PARAM_REGISTRY |
	                              ECX_CONSUMER_PARAM_TIMEOUT |
	                              ECX_CONSUMER_PARAM_RECV_CAPACITY,
	                          .registry = url,
	                          .timeout_ms = 10000,
	                          .recv_capacity = 24u << 20};
	ecx_consumer *c;
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0) {
		fprintf(stderr, "soak: consumer: %s\n", why);
		return 1;
	}
	unsigned seed = (unsigned)(me * 7919 + 1);
	char ids[BATCH][32];
	for (uint64_t round = 0; now_ms() < until; round++) {
		long latest = __atomic_load_n(&sh->latest, __ATOMIC_ACQUIRE);
		if (latest < 0) {
			usleep(1000);
			continue;
		}
		ecx_item it[BATCH];
		memset(it, 0, sizeof(it));
		for (int i = 0; i < BATCH; i++) {
			long k = latest - (long)(rand_r(&seed) % WINDOW);
			snprintf(ids[i], sizeof(ids[i]), "soak-%ld",
			         k < 0 ? 0 : k);
			it[i].id = ids[i];
		}
		/* Every other batch with leases. */
		bool leased = round % 2 == 1;
		int rc = leased
		             ? ecx_consumer_lookup_lease(c, it, BATCH, LEASE_MS)
		             : ecx_consumer_lookup(c, it, BATCH);
		if (rc != 0)
			usleep(10000); /* the registry said no: do not spin */
		/* Until one is, and then one in 64. */
		if (leased &&
		    (sh->c[me].l_dropped == 0 || rand_r(&seed) % 64 == 0)) {
			/* Looked up, leased, never loaded: left to expire. */
			for (int i = 0; i < BATCH; i++) {
				sh->c[me].items++;
				sh->c[me].l_items++;
				if (it[i].status != 0) {
					sh->c[me].notfound++;
					sh->c[me].l_notfound++;
				} else {
					sh->c[me].l_dropped++;
				}
			}
			continue;
		}
		ecx_item sent[BATCH];
		bool arena[BATCH];
		int n = 0;
		for (int i = 0; i < BATCH; i++) {
			sh->c[me].items++;
			sh->c[me].l_items += leased;
			if (it[i].status != 0) {
				sh->c[me].notfound++;
				sh->c[me].l_notfound += leased;
				continue;
			}
			/* Half into the receive arena, half into malloc'd
			 * memory (the registration cache's path). */
			sent[n] = it[i];
			sent[n].dst =
			    rand_r(&seed) % 2
			        ? ecx_consumer_alloc(c, it[i].desc.nbytes)
			        : NULL;
			arena[n] = sent[n].dst != NULL;
			if (!arena[n])
				sent[n].dst = malloc(it[i].desc.nbytes);
			n++;
		}
		if (n == 0)
			continue;
		ecx_consumer_load(c, sent, (size_t)n);
		sh->c[me].loads++;
		for (int i = 0; i < n; i++) {
			int s = sent[i].status;
			if (s == 0) {
				if (tu_check(sent[i].id, sent[i].dst,
				             sent[i].desc.nbytes)) {
					sh->c[me].ok++;
					sh->c[me].l_ok += leased;
					sh->c[me].bytes += sent[i].desc.nbytes;
				} else {
					sh->c[me].corrupt++;
				}
			} else if (s == ECX_ENOTFOUND) {
				/* evicted since the lookup */
				sh->c[me].refused++;
				sh->c[me].l_refused += leased;
			} else {
				sh->c[me].other++;
				sh->c[me].l_other += leased;
				fprintf(stderr, "soak: %s: %s\n", sent[i].id,
				        ecx_strerror(s));
			}
			if (arena[i])
				ecx_consumer_free(c, sent[i].dst);
			else
				free(sent[i].dst);
		}
	}
	ecx_consumer_destroy(c);
	return 0;
}

static pid_t consumer_start(shared *sh, int me, uint64_t until, int restart_s)
{
	uint64_t end = now_ms() + (uint64_t)restart_s * 1000;
	pid_t pid = fork();
	if (pid == 0)
		_exit(run_consumer(sh, me, end < until ? end : until));
	return pid;
}

int main(int argc, char **argv)
{
	int seconds = 60, consumers = 3, restart_s = 15;
	static const struct option opts[] = {
	    {"seconds", required_argument, NULL, 's'},
	    {"consumers", required_argument, NULL, 'c'},
	    {"restart", required_argument, NULL, 'r'},
	    {NULL, 0, NULL, 0}};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (o == 's')
			seconds = atoi(optarg);
		else if (o == 'c')
			consumers = atoi(optarg);
		else if (o == 'r')
			restart_s = atoi(optarg);
		else
			return 2;
	}
	if (seconds < 1 || consumers < 1 || consumers > MAX_CONSUMERS ||
	    restart_s < 1)
		return 2;
	shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
	                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	memset(sh, 0, sizeof(*sh));
	sh->latest = -1;
	uint64_t until = now_ms() + (uint64_t)seconds * 1000;
	pid_t prod = fork();
	if (prod == 0)
		_exit(run_producer(sh, until));
	while (sh->port == 0)
		usleep(10000);
	uint64_t start = now_ms();
	pid_t cons[MAX_CONSUMERS];
	for (int i = 0; i < consumers; i++)
		cons[i] = consumer_start(sh, i, until, restart_s);
	int bad_exit = 0, live = consumers;
	while (live > 0) {
		/* The stalls: at a quarter, half and three quarters. */
		uint64_t now = now_ms();
		if (sh->stalls < 3 &&
		    now >= start + (until - start) *
		                       (uint64_t)(sh->stalls + 1) / 4) {
			kill(prod, SIGSTOP);
			usleep(300000);
			kill(prod, SIGCONT);
			sh->stalls++;
		}
		for (int i = 0; i < consumers; i++) {
			int st;
			if (cons[i] <= 0 || waitpid(cons[i], &st, WNOHANG) <= 0)
				continue;
			bad_exit += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
			/* A new process in its place, counting on. */
			if (now_ms() + 1000 < until) {
				cons[i] =
				    consumer_start(sh, i, until, restart_s);
				sh->restarts++;
			} else {
				cons[i] = 0;
				live--;
			}
		}
		usleep(20000);
	}
	sh->stop = 1;
	int st;
	waitpid(prod, &st, 0);
	bad_exit += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);

	uint64_t ok = 0, nf = 0, refused = 0, other = 0, corrupt = 0, items = 0;
	uint64_t loads = 0, bytes = 0;
	uint64_t l_items = 0, l_ok = 0, l_nf = 0, l_refused = 0, l_other = 0;
	uint64_t l_dropped = 0;
	int pass = 0, fail = 0;
	for (int i = 0; i < consumers; i++) {
		ok += sh->c[i].ok;
		nf += sh->c[i].notfound;
		refused += sh->c[i].refused;
		other += sh->c[i].other;
		corrupt += sh->c[i].corrupt;
		items += sh->c[i].items;
		loads += sh->c[i].loads;
		bytes += sh->c[i].bytes;
		l_items += sh->c[i].l_items;
		l_ok += sh->c[i].l_ok;
		l_nf += sh->c[i].l_notfound;
		l_refused += sh->c[i].l_refused;
		l_other += sh->c[i].l_other;
		l_dropped += sh->c[i].l_dropped;
	}
	uint64_t share = (uint64_t)ARENA * LEASE_SHARE / 100;
	printf("soak: %d s, %d consumers; producer: %llu puts (%llu refused "
	       "while pinned), %llu evictions, %llu pulls, %llu items served, "
	       "%llu failed\n",
	       seconds, consumers, (unsigned long long)sh->puts,
	       (unsigned long long)sh->put_fail,
	       (unsigned long long)sh->evictions, (unsigned long long)sh->pulls,
	       (unsigned long long)sh->served, (unsigned long long)sh->failed);
	printf("soak: consumers: %llu ids asked in %llu loads: %llu loaded "
	       "and verified (%.2f GiB), %llu not in the registry, %llu "
	       "evicted before their pull, %llu other errors, %llu corrupted\n",
	       (unsigned long long)items, (unsigned long long)loads,
	       (unsigned long long)ok, (double)bytes / (1 << 30),
	       (unsigned long long)nf, (unsigned long long)refused,
	       (unsigned long long)other, (unsigned long long)corrupt);
	printf("soak: unleased lookups: %llu ids: %llu loaded, %llu not in "
	       "the registry, %llu evicted before their pull\n",
	       (unsigned long long)(items - l_items),
	       (unsigned long long)(ok - l_ok), (unsigned long long)(nf - l_nf),
	       (unsigned long long)(refused - l_refused));
	printf("soak: leased lookups: %llu ids: %llu loaded, %llu not found "
	       "or lease refused, %llu evicted before their pull, %llu other "
	       "errors, %llu leased and dropped (left to expire)\n",
	       (unsigned long long)l_items, (unsigned long long)l_ok,
	       (unsigned long long)l_nf, (unsigned long long)l_refused,
	       (unsigned long long)l_other, (unsigned long long)l_dropped);
	printf("soak: producer leases: %llu granted, %llu refused (share "
	       "taken), %llu ended by their pull, %llu released, %llu "
	       "expired; most leased %.1f MiB of a %.1f MiB share; at the end "
	       "%llu held, %llu bytes\n",
	       (unsigned long long)sh->lst.leases_granted,
	       (unsigned long long)sh->lst.leases_refused,
	       (unsigned long long)sh->lst.leases_used,
	       (unsigned long long)sh->lst.leases_released,
	       (unsigned long long)sh->lst.leases_expired,
	       (double)sh->lease_max_bytes / (1 << 20),
	       (double)share / (1 << 20), (unsigned long long)sh->lst.leases,
	       (unsigned long long)sh->lst.leased_bytes);
	printf("soak: producer resident memory (private + its arena) %.1f MiB "
	       "at start, %.1f MiB at a third, %.1f MiB at the end (arena %u "
	       "MiB + stated overhead %u MiB)\n",
	       (double)sh->rss_start / (1 << 20),
	       (double)sh->rss_mid / (1 << 20), (double)sh->rss_end / (1 << 20),
	       ARENA >> 20, OVERHEAD >> 20);
	printf(
	    "soak: producer heap in use %.2f MiB at a third, %.2f MiB at the "
	    "end; shared pages mapped %.1f MiB (its arena and the "
	    "consumers' receive arenas, %d x 24 MiB at most)\n",
	    (double)sh->heap_mid / (1 << 20), (double)sh->heap_end / (1 << 20),
	    (double)sh->shmem_end / (1 << 20), consumers);
#define CHECK(cond, what)                            \
	do {                                         \
		if (cond) {                          \
			printf("ok - %s\n", what);   \
			pass++;                      \
		} else {                             \
			printf("FAIL - %s\n", what); \
			fail++;                      \
		}                                    \
	} while (0)
	printf("soak: %d consumer restarts, %d producer stalls of 300 ms\n",
	       sh->restarts, sh->stalls);
	CHECK(bad_exit == 0, "every process exited cleanly");
	CHECK(sh->restarts >= (seconds / restart_s - 1) * consumers &&
	          sh->stalls == 3,
	      "consumers restarted and the producer stalled during the run");
	CHECK(corrupt == 0, "no item was corrupted");
	CHECK(other == 0, "no error but 'evicted' or 'not found'");
	CHECK(ok > 100 && sh->evictions > 100, "it loaded and evicted a lot");
	CHECK(items == ok + nf + refused + other + corrupt + l_dropped,
	      "consumers: asked = loaded + not found + evicted + errors");
	CHECK(sh->served == ok + corrupt && sh->failed == refused + other,
	      "producer: served and failed items match the consumers' counts");
	CHECK(sh->pinned == 0, "no pins left");
	CHECK(l_ok > 100 && l_refused == 0,
	      "leased: loaded a lot, none evicted before its pull");
	CHECK(sh->lease_max_bytes <= share && sh->lease_max_bytes > 0,
	      "leased bytes never above their share of the arena");
	CHECK(l_dropped > 0 && sh->lst.leases_expired >= l_dropped &&
	          sh->lst.leases == 0 && sh->lst.leased_bytes == 0,
	      "unused leases expired and gave their room back");
	CHECK(sh->lst.leases_granted ==
	          sh->lst.leases_used + sh->lst.leases_released +
	              sh->lst.leases_expired + sh->lst.leases,
	      "every lease granted ended by a pull, a release or expiry");
#if defined(__SANITIZE_ADDRESS__)
	/* AddressSanitizer's shadow and quarantine are resident too: the
	 * memory checks belong to the plain build. */
	printf("skipped - memory bounds under AddressSanitizer\n");
#else
	CHECK(sh->rss_end <= (uint64_t)ARENA + OVERHEAD,
	      "resident memory within the arena plus the stated overhead");
	CHECK(sh->rss_end <= sh->rss_mid + (8u << 20) &&
	          sh->heap_end <= sh->heap_mid + (4u << 20),
	      "resident memory and heap flat over the last two thirds");
#endif
	printf("%d passed, %d failed\n", pass, fail);
	return fail == 0 ? 0 : 1;
}
