/* bench_registry.c - the registry benchmark (`ecx bench registry`). */
#include "tool.h"

#include "bench.h"
#include "gen.h"
#include "stats.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

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

/* n lookups of 256 ids through cl, the next ids in turn, each timed into
 * *s; the block's seconds. A failure sets *rc (what: its detail) and
 * ends the block. */
static double batch_block(ecx_client *cl, ecx_item *its, int n, int *next,
                          samples *s, const char *what, int *rc)
{
	uint64_t t0 = tool_now_ns();
	for (int i = 0; i < n && *rc == EXIT_OK; i++) {
		for (int k = 0; k < 256; k++)
			its[k].id = reg_ids[(*next)++ % NIDS];
		uint64_t a = tool_now_ns();
		if (ecx_client_lookup(cl, its, 256) != 0)
			*rc = tool_fail("bench", EXIT_FAIL, "%s: %s", what,
			                ecx_last_error());
		samples_add(s, tool_now_ns() - a);
	}
	return (double)(tool_now_ns() - t0) / 1e9;
}

int bench_registry(const bench_opts *o)
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
	ecx_client_params cp = {.field_mask = ECX_CLIENT_PARAM_REGISTRY |
	                                      ECX_CLIENT_PARAM_TIMEOUT,
	                        .registry = url,
	                        .timeout_ms = 5000};
	ecx_client *c, *cs;
	if (ecx_client_create(&cp, &c, why, sizeof(why)) != 0) {
		ecx_registry_destroy(reg);
		return tool_fail("bench", EXIT_FAIL, "%s", why);
	}
	/* The same client sleeping at once on each answer (no poll first):
	 * what the default 200 us poll buys, and what it costs in CPU. */
	cp.field_mask |= ECX_CLIENT_PARAM_SPIN;
	cp.spin_us = 0;
	if (ecx_client_create(&cp, &cs, why, sizeof(why)) != 0) {
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
	int R = o->quick ? 5 : 10, iters = o->quick ? 60 : 500,
	    biters = o->quick ? 6 : 30;
	reps ref50 = {0}, keep50 = {0}, keep99 = {0}, ref99 = {0},
	     batch50 = {0}, krate = {0}, frate = {0}, brate = {0}, xref = {0},
	     xbatch = {0}, xbatch50 = {0}, kmin = {0}, bmin = {0}, rbrate = {0},
	     rtt50 = {0}, xrtt = {0}, sleep50 = {0}, sleep99 = {0}, srate = {0},
	     kcpu = {0}, scpu = {0};
	ecx_item *its = calloc(256, sizeof(*its));
	ecx_client *rcl = NULL;
	int rc = EXIT_OK;
	if (its == NULL) {
		rc = tool_fail("bench", EXIT_FAIL, "out of memory");
		goto out;
	}
	if (o->redis_url != NULL) {
		ecx_client_params ro = {.field_mask =
		                            ECX_CLIENT_PARAM_REGISTRY |
		                            ECX_CLIENT_PARAM_TIMEOUT,
		                        .registry = o->redis_url,
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
		for (int k = 0; k < 2; k++) {
			/* Sleeping at once and the default poll, adjacent;
			 * which goes first alternates by repetition. */
			int pass = (k + r) % 2; /* 0: sleeping, 1: polling */
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
		double bsec =
		    batch_block(c, its, biters, &next, &bs, "lookup", &rc);
		double rbsec = rcl != NULL
		                   ? batch_block(rcl, its, biters, &next, &rs,
		                                 "redis", &rc)
		                   : 0;
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
			reps_add(&kmin, (double)samples_pct(&ks, 0) / 1e3);
			reps_add(&bmin, (double)samples_pct(&bs, 0) / 1e3);
			reps_add(&xbatch50,
			         256.0 * k /
			             ((double)samples_pct(&bs, 50) / 1e3));
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
	if (o->json) {
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
		row_json(
		    "registry", "single_persistent",
		    "\"p50_us\": %.1f, \"p50_us_min\": %.1f, "
		    "\"p50_us_max\": %.1f, \"p99_us\": %.1f, "
		    "\"ids_per_s\": %.0f, \"cpu_us_per_id\": %.1f, "
		    "\"x_new_connection_p50\": %.2f, "
		    "\"x_tcp_round_trip_p50\": %.2f, "
		    "\"x_tcp_round_trip_p50_min\": %.2f, "
		    "\"x_tcp_round_trip_p50_max\": %.2f, \"connections\": %ld",
		    reps_med(&keep50), reps_min(&keep50), reps_max(&keep50),
		    reps_med(&keep99), reps_med(&krate), reps_med(&kcpu),
		    reps_med(&xref), reps_med(&xrtt), reps_min(&xrtt),
		    reps_max(&xrtt), conns);
		row_json("registry", "single_persistent_sleeping",
		         "\"p50_us\": %.1f, \"p50_us_min\": %.1f, "
		         "\"p50_us_max\": %.1f, \"p99_us\": %.1f, "
		         "\"ids_per_s\": %.0f, \"cpu_us_per_id\": %.1f",
		         reps_med(&sleep50), reps_min(&sleep50),
		         reps_max(&sleep50), reps_med(&sleep99),
		         reps_med(&srate), reps_med(&scpu));
		row_json(
		    "registry", "batch_256",
		    "\"p50_us\": %.1f, \"p50_us_min\": %.1f, "
		    "\"ids_per_s\": %.0f, \"x_single\": "
		    "%.1f, \"x_single_min\": %.1f, \"x_single_max\": %.1f, "
		    "\"x_single_p50\": %.1f, \"x_single_p50_min\": %.1f, "
		    "\"x_single_p50_max\": %.1f, \"x_single_fastest\": %.1f",
		    reps_med(&batch50), reps_min(&batch50), reps_med(&brate),
		    reps_med(&xbatch), reps_min(&xbatch), reps_max(&xbatch),
		    reps_med(&xbatch50), reps_min(&xbatch50),
		    reps_max(&xbatch50),
		    256.0 * reps_min(&kmin) / reps_min(&bmin));
		if (rcl != NULL)
			row_json("registry", "batch_256_redis",
			         "\"ids_per_s\": %.0f, \"x_http_batch\": %.2f",
			         reps_med(&rbrate),
			         reps_med(&rbrate) / reps_med(&brate));
	} else {
		printf("registry: loopback, %d entries; %d repetitions of: %d "
		       "lookups each with a new HTTP client and connection "
		       "(the reference), %d over one persistent connection "
		       "polling for each answer and %d sleeping at once "
		       "(in turn first), %d batches of 256 ids; medians of "
		       "the repetitions [min-max]; cpu: the calling thread's\n",
		       NIDS, R, iters, iters, iters, biters);
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
		char d[96], e[96];
		printf("  persistent p50 / new-connection p50: %s; persistent "
		       "p50 / TCP round trip p50: %s; batched ids/s / single: "
		       "%s; 256 x single p50 / batch p50: %s; %ld "
		       "connection(s) for the persistent lookups\n",
		       fmt_reps(&xref, 2, a, sizeof(a)),
		       fmt_reps(&xrtt, 2, d, sizeof(d)),
		       fmt_reps(&xbatch, 1, b, sizeof(b)),
		       fmt_reps(&xbatch50, 1, e, sizeof(e)), conns);
		if (o->quick)
			printf(
			    "  targets (--quick, reported, not checked): 256 "
			    "x single p50 / batch p50 >= %.0fx; persistent "
			    "best p50 < %.0f us\n",
			    tgt(o)->reg_batch_x, tgt(o)->reg_p50);
		else
			printf("  targets: persistent p50 < %.0f us, batched "
			       ">= %.0fx single ids/s\n",
			       tgt(o)->reg_p50, tgt(o)->reg_batch_x);
	}
	double k50 = o->quick ? reps_min(&keep50) : reps_med(&keep50);
	(o->quick ? report_row : check_row)(
	    o, k50 < tgt(o)->reg_p50, "registry single, persistent connection",
	    "%sp50 %.1f us, not below %.0f us",
	    o->quick ? "best repetition's " : "", k50, tgt(o)->reg_p50);
	/* --quick: reported, not checked (bench_report.c says why), on the
	 * medians of the calls, which load moves least. */
	if (o->quick)
		report_row(o, reps_med(&xbatch50) >= tgt(o)->reg_batch_x,
		           "registry batch of 256 ids",
		           "256 x single p50 / batch p50 %.1fx, below %.0fx",
		           reps_med(&xbatch50), tgt(o)->reg_batch_x);
	else
		check_row(o, reps_med(&xbatch) >= tgt(o)->reg_batch_x,
		          "registry batch of 256 ids",
		          "%.1fx single ids/s, below %.0fx", reps_med(&xbatch),
		          tgt(o)->reg_batch_x);
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
