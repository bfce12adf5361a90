/* cmd_bench.c - `ecx bench`: every benchmark, each beside its baseline
 * measured in the same run. */
#include "tool.h"

#include "gen.h"
#include "proc.h"
#include "safetensors.h"
#include "stats.h"

#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx bench [--quick] [--json] [registry|transfer|file|all]\n"
    "\n"
    "Benchmarks, each printed beside the baseline it is compared with,\n"
    "measured in the same run (these machines are shared and noisy: read\n"
    "the ratios). Medians unless a column says otherwise.\n"
    "\n"
    "  registry  single lookups over one persistent connection (p50, p99,\n"
    "            lookups/s) against a new connection per lookup (what the\n"
    "            reference's consumer does), and batched lookups of 256 ids\n"
    "  transfer  loads of 64 KiB, 1 MiB and 7 MiB items (7 MiB: 1024 x\n"
    "            3584 bf16, one Qwen2.5-VL-7B image) in batches of 1, 8\n"
    "            and 32, over shared memory and over TCP, from a producer\n"
    "            process, against single-thread memcpy and a raw\n"
    "            single-stream TCP copy over loopback\n"
    "  file      the file-per-item baseline (vLLM's ECExampleConnector:\n"
    "            a safetensors file per item in /dev/shm), saved and\n"
    "            loaded, against memcpy\n"
    "  all       all of them (the default)\n"
    "\n"
    "Options:\n"
    "  --quick   few iterations (CI runs this so the benchmarks never rot)\n"
    "  --json    one JSON object per result line\n"
    "  --redis URL  registry: also batched lookups against this Redis\n"
    "            (redis://HOST:PORT; bench/redis_vs_http.sh starts one)\n"
    "  -h, --help\n";

static bool quick, json;
static const char *redis_url; /* --redis: a Redis to compare lookups with */

/* ---- output ---- */

static void row_json(const char *bench, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void row_json(const char *bench, const char *name, const char *fmt, ...)
{
	va_list ap;
	printf("{\"bench\": \"%s\", \"case\": \"%s\", ", bench, name);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("}\n");
	fflush(stdout);
}

/* ---- registry ---- */

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
	ecx_client *c;
	if (ecx_client_create(&o, &c, why, sizeof(why)) != 0)
		return tool_fail("bench", EXIT_FAIL, "%s", why);
	enum { NIDS = 4096 };
	static char ids[NIDS][80];
	static ecx_item entries[NIDS];
	for (int i = 0; i < NIDS; i++) {
		snprintf(ids[i], sizeof(ids[i]), "%016x%016x%016x%016x", i,
		         i * 7, i * 13, i * 31);
		ecx_item *e = &entries[i];
		memset(e, 0, sizeof(*e));
		e->id = ids[i];
		uint64_t dims[2] = {gen_qwen_tokens((size_t)i), 3584};
		ecx_tensor_set(&e->desc, ECX_DTYPE_BFLOAT16, 2, dims);
		snprintf(e->producer, sizeof(e->producer),
		         "tcp://10.0.0.%d:5555", i % 8);
		if (ecx_client_publish(c, e) != 0)
			return tool_fail("bench", EXIT_FAIL, "publish: %s",
			                 ecx_last_error());
	}
	int iters = quick ? 300 : 5000;
	samples keep = {0}, fresh = {0}, batch = {0};
	/* Warm up the connection and the caches. */
	for (int i = 0; i < 50; i++) {
		ecx_item it = {.id = ids[i]};
		ecx_client_lookup(c, &it, 1);
	}
	uint64_t t0 = tool_now_ns();
	for (int i = 0; i < iters; i++) {
		ecx_item it = {.id = ids[i % NIDS]};
		uint64_t a = tool_now_ns();
		if (ecx_client_lookup(c, &it, 1) != 0 || it.status != 0)
			return tool_fail("bench", EXIT_FAIL, "lookup: %s",
			                 ecx_last_error());
		samples_add(&keep, tool_now_ns() - a);
	}
	double keep_s = (double)(tool_now_ns() - t0) / 1e9;
	long conns = ecx_client_connections(c);
	t0 = tool_now_ns();
	for (int i = 0; i < iters; i++) {
		ecx_client *one;
		ecx_item it = {.id = ids[i % NIDS]};
		uint64_t a = tool_now_ns();
		int rc = ecx_client_create(&o, &one, why, sizeof(why));
		if (rc == 0)
			rc = ecx_client_lookup(one, &it, 1);
		ecx_client_destroy(one);
		if (rc != 0)
			return tool_fail("bench", EXIT_FAIL, "lookup: %s",
			                 ecx_last_error());
		samples_add(&fresh, tool_now_ns() - a);
	}
	double fresh_s = (double)(tool_now_ns() - t0) / 1e9;
	int biters = quick ? 30 : 300;
	ecx_item *its = calloc(256, sizeof(*its));
	if (its == NULL)
		return tool_fail("bench", EXIT_FAIL, "out of memory");
	t0 = tool_now_ns();
	for (int i = 0; i < biters; i++) {
		for (int k = 0; k < 256; k++)
			its[k].id = ids[(i * 256 + k) % NIDS];
		uint64_t a = tool_now_ns();
		if (ecx_client_lookup(c, its, 256) != 0)
			return tool_fail("bench", EXIT_FAIL, "lookup: %s",
			                 ecx_last_error());
		samples_add(&batch, tool_now_ns() - a);
	}
	double batch_s = (double)(tool_now_ns() - t0) / 1e9;
	/* The same batches against Redis (MGET), when one is given. */
	samples rbatch = {0};
	double rbatch_s = 0;
	if (redis_url != NULL) {
		ecx_client_params ro = {.field_mask =
		                            ECX_CLIENT_PARAM_REGISTRY |
		                            ECX_CLIENT_PARAM_TIMEOUT,
		                        .registry = redis_url,
		                        .timeout_ms = 5000};
		ecx_client *rc;
		if (ecx_client_create(&ro, &rc, why, sizeof(why)) != 0)
			return tool_fail("bench", EXIT_USAGE, "%s", why);
		for (int i = 0; i < NIDS; i++)
			if (ecx_client_publish(rc, &entries[i]) != 0)
				return tool_fail("bench", EXIT_FAIL, "%s",
				                 ecx_last_error());
		t0 = tool_now_ns();
		for (int i = 0; i < biters; i++) {
			for (int k = 0; k < 256; k++)
				its[k].id = ids[(i * 256 + k) % NIDS];
			uint64_t a = tool_now_ns();
			if (ecx_client_lookup(rc, its, 256) != 0)
				return tool_fail("bench", EXIT_FAIL,
				                 "redis: %s", ecx_last_error());
			samples_add(&rbatch, tool_now_ns() - a);
		}
		rbatch_s = (double)(tool_now_ns() - t0) / 1e9;
		for (int i = 0; i < NIDS; i++)
			ecx_client_remove(rc, ids[i], NULL);
		ecx_client_destroy(rc);
	}
	free(its);
	ecx_client_destroy(c);
	ecx_registry_destroy(reg);

	double k50 = (double)samples_pct(&keep, 50) / 1e3,
	       k99 = (double)samples_pct(&keep, 99) / 1e3;
	double f50 = (double)samples_pct(&fresh, 50) / 1e3,
	       f99 = (double)samples_pct(&fresh, 99) / 1e3;
	double b50 = (double)samples_pct(&batch, 50) / 1e3,
	       b99 = (double)samples_pct(&batch, 99) / 1e3;
	double krate = iters / keep_s, frate = iters / fresh_s;
	double brate = 256.0 * biters / batch_s;
	if (json) {
		row_json("registry", "single_persistent",
		         "\"p50_us\": %.1f, \"p99_us\": %.1f, \"ids_per_s\": "
		         "%.0f, \"connections\": %ld",
		         k50, k99, krate, conns);
		row_json(
		    "registry", "single_new_connection",
		    "\"p50_us\": %.1f, \"p99_us\": %.1f, \"ids_per_s\": %.0f",
		    f50, f99, frate);
		row_json("registry", "batch_256",
		         "\"p50_us\": %.1f, \"p99_us\": %.1f, \"ids_per_s\": "
		         "%.0f, \"x_single\": %.1f",
		         b50, b99, brate, brate / krate);
		if (redis_url != NULL)
			row_json("registry", "batch_256_redis",
			         "\"p50_us\": %.1f, \"p99_us\": %.1f, "
			         "\"ids_per_s\": %.0f, \"x_http_batch\": %.2f",
			         (double)samples_pct(&rbatch, 50) / 1e3,
			         (double)samples_pct(&rbatch, 99) / 1e3,
			         256.0 * biters / rbatch_s,
			         256.0 * biters / rbatch_s / brate);
	} else {
		printf("registry: %d lookups each way, %d batches of 256, one "
		       "run, loopback, %d entries\n",
		       iters, biters, NIDS);
		printf("  %-34s %9s %9s %12s\n", "", "p50 us", "p99 us",
		       "ids/s");
		printf("  %-34s %9.1f %9.1f %12.0f\n",
		       "single, persistent connection", k50, k99, krate);
		printf("  %-34s %9.1f %9.1f %12.0f\n",
		       "single, new connection (reference)", f50, f99, frate);
		printf("  %-34s %9.1f %9.1f %12.0f\n", "batch of 256 ids", b50,
		       b99, brate);
		if (redis_url != NULL)
			printf("  %-34s %9.1f %9.1f %12.0f   (%.2fx the HTTP "
			       "batch)\n",
			       "batch of 256 ids, Redis MGET",
			       (double)samples_pct(&rbatch, 50) / 1e3,
			       (double)samples_pct(&rbatch, 99) / 1e3,
			       256.0 * biters / rbatch_s,
			       256.0 * biters / rbatch_s / brate);
		printf("  persistent p50 is %.2fx the new-connection p50 "
		       "(target: p50 < 150 us); batched ids/s are %.1fx single "
		       "(target >= 10x); %ld connection(s) for %d lookups\n",
		       k50 / f50, brate / krate, conns, iters + 50);
	}
	samples_free(&keep);
	samples_free(&fresh);
	samples_free(&batch);
	samples_free(&rbatch);
	return EXIT_OK;
}

/* ---- baselines: memcpy and raw TCP ---- */

static double memcpy_gbps(size_t bytes)
{
	char *a = malloc(bytes), *b = malloc(bytes);
	memset(a, 1, bytes);
	memset(b, 2, bytes);
	samples s = {0};
	int iters = quick ? 10 : 50;
	for (int i = 0; i < iters; i++) {
		uint64_t t0 = tool_now_ns();
		memcpy(b, a, bytes);
		samples_add(&s, tool_now_ns() - t0);
		a[i % bytes] = (char)i; /* keep the copy from being elided */
	}
	double g = (double)bytes / (double)samples_pct(&s, 50);
	samples_free(&s);
	free(a);
	free(b);
	return g;
}

typedef struct tcp_sink {
	int fd;
	size_t bytes;
	int rounds;
} tcp_sink;

/* Receives `rounds` messages of `bytes` and acknowledges each. */
static void *tcp_sink_run(void *p)
{
	tcp_sink *k = p;
	char *buf = malloc(k->bytes);
	memset(buf, 0, k->bytes);
	for (int r = 0; r < k->rounds; r++) {
		size_t got = 0;
		while (got < k->bytes) {
			ssize_t n = recv(k->fd, buf + got, k->bytes - got, 0);
			if (n <= 0)
				goto out;
			got += (size_t)n;
		}
		char ack = 1;
		if (send(k->fd, &ack, 1, 0) != 1)
			break;
	}
out:
	free(buf);
	return NULL;
}

/* One stream over loopback TCP: a message of `bytes` and its 1-byte
 * acknowledgement, as a pull is data then a reply. */
static double tcp_gbps(size_t bytes)
{
	int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	bind(l, (struct sockaddr *)&sa, sizeof(sa));
	socklen_t sl = sizeof(sa);
	getsockname(l, (struct sockaddr *)&sa, &sl);
	listen(l, 1);
	int c = socket(AF_INET, SOCK_STREAM, 0);
	connect(c, (struct sockaddr *)&sa, sizeof(sa));
	int a = accept(l, NULL, NULL);
	setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	int iters = quick ? 5 : 30;
	tcp_sink k = {.fd = a, .bytes = bytes, .rounds = iters + 2};
	pthread_t t;
	pthread_create(&t, NULL, tcp_sink_run, &k);
	char *buf = malloc(bytes);
	memset(buf, 3, bytes);
	samples s = {0};
	for (int i = 0; i < iters + 2; i++) {
		uint64_t t0 = tool_now_ns();
		size_t sent = 0;
		while (sent < bytes) {
			ssize_t n = send(c, buf + sent, bytes - sent, 0);
			if (n <= 0)
				break;
			sent += (size_t)n;
		}
		char ack;
		if (recv(c, &ack, 1, MSG_WAITALL) != 1)
			break;
		if (i >= 2)
			samples_add(&s, tool_now_ns() - t0);
	}
	pthread_join(t, NULL);
	double g = (double)bytes / (double)samples_pct(&s, 50);
	samples_free(&s);
	free(buf);
	close(c);
	close(a);
	close(l);
	return g;
}

/* ---- transfer ---- */

static const struct {
	const char *name;
	uint64_t rows, cols; /* bfloat16 */
} sizes[] = {
    {"64KiB", 32, 1024},
    {"1MiB", 512, 1024},
    {"7MiB", 1024, 3584},
};
static const int batches[] = {1, 8, 32};
#define NSIZES 3
#define NBATCH 3
#define MAXBATCH 32

/* The producer side of the transfer benchmark, in a child process:
 * MAXBATCH items of each size, then serves until SIGTERM. */
static int bench_producer(const char *transport)
{
	tool_block_signals();
	ecx_producer_params p = {.field_mask =
	                             ECX_PRODUCER_PARAM_BIND_HOST |
	                             ECX_PRODUCER_PARAM_REGISTRY_PORT |
	                             ECX_PRODUCER_PARAM_CAPACITY |
	                             ECX_PRODUCER_PARAM_TRANSPORT,
	                         .bind_host = "127.0.0.1",
	                         .registry_port = 0,
	                         .capacity_bytes = 300u << 20,
	                         .transport = transport};
	ecx_producer *prod;
	char why[256];
	if (ecx_producer_create(&p, &prod, why, sizeof(why)) != 0)
		return tool_fail("bench", EXIT_FAIL, "producer: %s", why);
	void *buf = malloc(7u << 20);
	for (int s = 0; s < NSIZES; s++) {
		for (int i = 0; i < MAXBATCH; i++) {
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

/* One transport's rows. user: load into the caller's own (malloc'd)
 * memory, registered through the consumer's cache, instead of the receive
 * arena. */
static int bench_transfer_one(const char *transport, bool user,
                              double memcpy_g[][NBATCH], double tcp_g[][NBATCH])
{
	const char *label = user ? "shm*" : transport;
	proc pr;
	char *a[] = {"bench", "--producer-for-bench", (char *)transport, NULL};
	char line[256];
	unsigned port = 0;
	if (!proc_start(&pr, a) || !proc_line(&pr, line, sizeof(line), 60000) ||
	    sscanf(line, "ready %u", &port) != 1) {
		if (pr.pid > 0)
			proc_stop(&pr, SIGTERM, 5000);
		return tool_fail("bench", EXIT_FAIL,
		                 "the benchmark's producer did not start");
	}
	char url[64], why[256];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", port);
	ecx_consumer_params cp = {.field_mask =
	                              ECX_CONSUMER_PARAM_REGISTRY |
	                              ECX_CONSUMER_PARAM_RECV_CAPACITY |
	                              ECX_CONSUMER_PARAM_TRANSPORT,
	                          .registry = url,
	                          .recv_capacity = 240u << 20,
	                          .transport = transport};
	ecx_consumer *c;
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0) {
		proc_stop(&pr, SIGTERM, 5000);
		return tool_fail("bench", EXIT_FAIL, "%s", why);
	}
	int rc = EXIT_OK;
	for (int s = 0; s < NSIZES && rc == EXIT_OK; s++) {
		ecx_item it[MAXBATCH];
		char ids[MAXBATCH][64];
		memset(it, 0, sizeof(it));
		for (int i = 0; i < MAXBATCH; i++) {
			snprintf(ids[i], sizeof(ids[i]), "%s-%d", sizes[s].name,
			         i);
			it[i].id = ids[i];
		}
		ecx_consumer_lookup(c, it, MAXBATCH);
		for (int i = 0; i < MAXBATCH; i++)
			if (user) {
				it[i].dst = malloc(it[i].desc.nbytes);
				memset(it[i].dst, 0, it[i].desc.nbytes);
			} else {
				it[i].dst =
				    ecx_consumer_alloc(c, it[i].desc.nbytes);
			}
		for (int bi = 0; bi < NBATCH; bi++) {
			int nb = batches[bi];
			int iters = quick ? 5 : (s == 2 ? 20 : 50);
			samples lat = {0};
			for (int k = 0; k < iters + 2; k++) {
				uint64_t t0 = tool_now_ns();
				int e = ecx_consumer_load(c, it, (size_t)nb);
				uint64_t dt = tool_now_ns() - t0;
				if (e != 0) {
					rc = tool_fail("bench", EXIT_FAIL,
					               "load: %s",
					               ecx_last_error());
					break;
				}
				if (k >= 2)
					samples_add(&lat, dt);
			}
			if (rc != EXIT_OK)
				break;
			for (int i = 0; i < nb; i++)
				if (!gen_check(it[i].id, it[i].dst,
				               it[i].desc.nbytes))
					rc = tool_fail("bench", EXIT_FAIL,
					               "%s: bytes differ",
					               it[i].id);
			uint64_t bytes = (uint64_t)nb * it[0].desc.nbytes;
			double p50 = (double)samples_pct(&lat, 50);
			double p99 = (double)samples_pct(&lat, 99);
			double g = (double)bytes / p50;
			double base = strcmp(transport, "tcp") == 0
			                  ? tcp_g[s][bi]
			                  : memcpy_g[s][bi];
			if (json)
				row_json(
				    "transfer",
				    user ? "shm_user_memory" : transport,
				    "\"size\": \"%s\", \"batch\": %d, "
				    "\"gbps\": %.3f, \"p50_us\": %.1f, "
				    "\"p99_us\": %.1f, \"baseline\": \"%s\", "
				    "\"baseline_gbps\": %.3f, \"ratio\": %.2f",
				    sizes[s].name, nb, g, p50 / 1e3, p99 / 1e3,
				    strcmp(transport, "tcp") == 0 ? "raw_tcp"
				                                  : "memcpy",
				    base, g / base);
			else
				printf("  %-4s %6s x%-3d %8.2f %10.1f %10.1f "
				       "%10.2f %6.2f\n",
				       label, sizes[s].name, nb, g, p50 / 1e3,
				       p99 / 1e3, base, g / base);
			samples_free(&lat);
		}
		for (int i = 0; i < MAXBATCH; i++)
			if (user)
				free(it[i].dst);
			else
				ecx_consumer_free(c, it[i].dst);
	}
	ecx_consumer_destroy(c);
	int st = proc_stop(&pr, SIGTERM, 10000);
	if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
		rc = tool_fail("bench", EXIT_FAIL,
		               "the benchmark's producer failed");
	return rc;
}

static int bench_transfer(void)
{
	/* Each row's baseline moves the same bytes: batch x item size. */
	double mg[NSIZES][NBATCH], tg[NSIZES][NBATCH];
	for (int s = 0; s < NSIZES; s++) {
		size_t one = sizes[s].rows * sizes[s].cols * 2;
		for (int bi = 0; bi < NBATCH; bi++) {
			mg[s][bi] = memcpy_gbps(one * (size_t)batches[bi]);
			tg[s][bi] = tcp_gbps(one * (size_t)batches[bi]);
		}
	}
	if (!json) {
		printf("transfer: producer process -> consumer process, "
		       "loopback, into the consumer's receive arena; baseline "
		       "beside each: single-thread memcpy (shm) or one raw TCP "
		       "stream (tcp) of the same bytes (batch x item), same "
		       "run; p50/p99: of a whole load (every item of a batch "
		       "lands by its end)\n");
		printf("  %-4s %6s %-4s %8s %10s %10s %10s %6s\n", "via",
		       "item", "batch", "GB/s", "p50 us", "p99 us", "base GB/s",
		       "ratio");
	}
	int rc = bench_transfer_one("shm", false, mg, tg);
	if (rc == EXIT_OK)
		rc = bench_transfer_one("shm", true, mg, tg);
	if (rc == EXIT_OK)
		rc = bench_transfer_one("tcp", false, mg, tg);
	if (!json)
		printf(
		    "  targets: shm 7MiB batches >= 0.5 x memcpy; tcp >= 0.7 "
		    "x raw TCP; 64KiB over shm p50 < 100 us\n");
	return rc;
}

/* ---- file baseline ---- */

static int bench_file(void)
{
	struct stat sb;
	const char *base = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
	char dir[256];
	snprintf(dir, sizeof(dir), "%s/ecx-bench-%ld", base, (long)getpid());
	if (mkdir(dir, 0700) != 0)
		return tool_fail("bench", EXIT_FAIL, "cannot create %s", dir);
	if (!json)
		printf("file: one safetensors file per item in %s (vLLM's "
		       "ECExampleConnector), saved then loaded into fresh "
		       "memory; baseline: memcpy of the same size, same run\n"
		       "  %6s %10s %10s %12s %12s %6s\n",
		       base, "item", "save GB/s", "load GB/s", "load p50 us",
		       "memcpy GB/s", "ratio");
	void *buf = malloc(7u << 20);
	for (int s = 0; s < NSIZES; s++) {
		uint64_t dims[2] = {sizes[s].rows, sizes[s].cols};
		ecx_tensor_desc d;
		ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
		gen_fill(sizes[s].name, buf, d.nbytes);
		samples sv = {0}, ld = {0};
		int iters = quick ? 5 : 30;
		char path[512], why[256];
		for (int i = 0; i < iters; i++) {
			snprintf(path, sizeof(path), "%s/%s-%d.safetensors",
			         dir, sizes[s].name, i);
			uint64_t t0 = tool_now_ns();
			st_save(path, &d, buf, why, sizeof(why));
			samples_add(&sv, tool_now_ns() - t0);
		}
		for (int i = 0; i < iters; i++) {
			snprintf(path, sizeof(path), "%s/%s-%d.safetensors",
			         dir, sizes[s].name, i);
			void *back = NULL;
			ecx_tensor_desc bd;
			uint64_t t0 = tool_now_ns();
			int rc = st_load(path, &bd, &back, why, sizeof(why));
			samples_add(&ld, tool_now_ns() - t0);
			if (rc != 0 ||
			    !gen_check(sizes[s].name, back, bd.nbytes))
				return tool_fail("bench", EXIT_FAIL,
				                 "file baseline: %s", why);
			free(back);
			unlink(path);
		}
		double sg = (double)d.nbytes / (double)samples_pct(&sv, 50);
		double lp = (double)samples_pct(&ld, 50);
		double lg = (double)d.nbytes / lp;
		double mg = memcpy_gbps(d.nbytes);
		if (json)
			row_json(
			    "file", sizes[s].name,
			    "\"save_gbps\": %.3f, \"load_gbps\": %.3f, "
			    "\"load_p50_us\": %.1f, \"memcpy_gbps\": %.3f, "
			    "\"ratio\": %.2f",
			    sg, lg, lp / 1e3, mg, lg / mg);
		else
			printf("  %6s %10.2f %10.2f %12.1f %12.2f %6.2f\n",
			       sizes[s].name, sg, lg, lp / 1e3, mg, lg / mg);
		samples_free(&sv);
		samples_free(&ld);
	}
	free(buf);
	rmdir(dir);
	return EXIT_OK;
}

int cmd_bench(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"quick", no_argument, NULL, 'q'},
	    {"json", no_argument, NULL, 'j'},
	    {"producer-for-bench", required_argument, NULL, 'P'},
	    {"redis", required_argument, NULL, 'R'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'q':
			quick = true;
			break;
		case 'j':
			json = true;
			break;
		case 'P':
			return bench_producer(optarg);
		case 'R':
			redis_url = optarg;
			break;
		case 'h':
			fputs(help, stdout);
			return EXIT_OK;
		default:
			fputs(help, stderr);
			return EXIT_USAGE;
		}
	}
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
	int rc = EXIT_OK;
	if (rc == EXIT_OK && (all || strcmp(what, "registry") == 0))
		rc = bench_registry();
	if (rc == EXIT_OK && (all || strcmp(what, "transfer") == 0))
		rc = bench_transfer();
	if (rc == EXIT_OK && (all || strcmp(what, "file") == 0))
		rc = bench_file();
	return rc;
}
