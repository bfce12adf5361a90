/*
 * lease_cost.c - what a lease adds to a lookup. A producer process (its
 * embedded registry on loopback) holds 64 items; this process looks them
 * up with ecx_consumer_lookup and with ecx_consumer_lookup_lease, batches
 * of 1 and of 64, the four kinds taking turns so that each sees the same
 * load of the machine. Leases are released after each timed lookup (not
 * timed; its own p50 is printed too) so they never pile up.
 *
 *   ecx-bench-lease [--iters N]        (default 2000 per kind)
 *
 * Prints p50 and p99 in microseconds, and each lease p50 over the plain
 * lookup's p50 of the same batch, measured in the same run.
 */
#include <ecx/ecx.h>

#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NITEMS 64

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_d);
	int k = (int)(p * (n - 1) + 0.5);
	return v[k];
}

/* The producer: puts the items, writes its registry port to fd, and
 * serves until its stdin (the pipe rd) closes. */
static int producer(int fd, int rd)
{
	ecx_producer_params pp = {.field_mask =
	                              ECX_PRODUCER_PARAM_CAPACITY |
	                              ECX_PRODUCER_PARAM_BIND_HOST |
	                              ECX_PRODUCER_PARAM_REGISTRY_PORT,
	                          .capacity_bytes = 64u << 20,
	                          .bind_host = "127.0.0.1",
	                          .registry_port = 0};
	ecx_producer *p;
	char why[256];
	if (ecx_producer_create(&pp, &p, why, sizeof(why)) != 0) {
		fprintf(stderr, "producer: %s\n", why);
		return 1;
	}
	static char buf[4096];
	uint64_t dims[] = {sizeof(buf)};
	ecx_tensor_desc d;
	ecx_tensor_set(&d, ECX_DTYPE_UINT8, 1, dims);
	for (int i = 0; i < NITEMS; i++) {
		char id[32];
		snprintf(id, sizeof(id), "lease-bench-%d", i);
		if (ecx_producer_put(p, id, &d, buf) != 0)
			return 1;
	}
	unsigned port = ecx_producer_registry_port(p);
	if (write(fd, &port, sizeof(port)) != sizeof(port))
		return 1;
	char c;
	while (read(rd, &c, 1) > 0)
		;
	ecx_producer_stats st;
	ecx_producer_stats_get(p, &st);
	fprintf(stderr,
	        "producer: %llu leases granted, %llu released, %llu refused\n",
	        (unsigned long long)st.leases_granted,
	        (unsigned long long)st.leases_released,
	        (unsigned long long)st.leases_refused);
	ecx_producer_destroy(p);
	return 0;
}

int main(int argc, char **argv)
{
	int iters = 2000;
	static const struct option opts[] = {
	    {"iters", required_argument, NULL, 'i'}, {NULL, 0, NULL, 0}};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (o != 'i')
			return 2;
		iters = atoi(optarg);
	}
	if (iters < 10)
		return 2;
	int up[2], down[2];
	if (pipe(up) != 0 || pipe(down) != 0)
		return 1;
	pid_t pid = fork();
	if (pid == 0) {
		close(up[0]);
		close(down[1]);
		_exit(producer(up[1], down[0]));
	}
	close(up[1]);
	close(down[0]);
	unsigned port = 0;
	if (read(up[0], &port, sizeof(port)) != sizeof(port)) {
		fprintf(stderr, "the producer did not start\n");
		return 1;
	}
	char url[64], why[256];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", port);
	ecx_consumer_params cp = {.field_mask =
	                              ECX_CONSUMER_PARAM_REGISTRY |
	                              ECX_CONSUMER_PARAM_RECV_CAPACITY,
	                          .registry = url,
	                          .recv_capacity = 0};
	ecx_consumer *c;
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0) {
		fprintf(stderr, "consumer: %s\n", why);
		return 1;
	}
	char ids[NITEMS][32];
	ecx_item it[NITEMS];
	for (int i = 0; i < NITEMS; i++)
		snprintf(ids[i], sizeof(ids[i]), "lease-bench-%d", i);
	/* kinds: 0 plain x1, 1 lease x1, 2 plain x64, 3 lease x64 */
	static const int batch[4] = {1, 1, NITEMS, NITEMS};
	double *t[4], *rel = malloc(sizeof(double) * (size_t)iters * 2);
	for (int k = 0; k < 4; k++)
		t[k] = malloc(sizeof(double) * (size_t)iters);
	int nrel = 0, bad = 0;
	for (int w = -100; w < iters; w++) { /* 100 rounds of warm-up */
		for (int k = 0; k < 4; k++) {
			int n = batch[k];
			memset(it, 0, sizeof(it));
			int first = (w < 0 ? 0 : w) * 7 % NITEMS;
			for (int i = 0; i < n; i++)
				it[i].id = ids[(first + i) % NITEMS];
			double t0 = now_us();
			int rc = k % 2 ? ecx_consumer_lookup_lease(c, it,
			                                           (size_t)n, 0)
			               : ecx_consumer_lookup(c, it, (size_t)n);
			double t1 = now_us();
			for (int i = 0; i < n; i++)
				bad += rc != 0 || it[i].status != 0 ||
				       (k % 2 && it[i].lease == 0);
			if (w >= 0)
				t[k][w] = t1 - t0;
			if (k % 2) {
				double r0 = now_us();
				ecx_consumer_release(c, it, (size_t)n);
				if (w >= 0)
					rel[nrel++] = now_us() - r0;
			}
		}
	}
	double p50[4], p99[4];
	for (int k = 0; k < 4; k++) {
		p99[k] = pct(t[k], iters, 0.99);
		p50[k] = pct(t[k], iters, 0.50);
	}
	printf("lease cost in a lookup: %d lookups of each kind, taking "
	       "turns, one run, loopback, producer in another process\n",
	       iters);
	printf("  %-30s %10s %10s\n", "", "p50 us", "p99 us");
	static const char *names[4] = {"lookup, 1 id", "lookup + lease, 1 id",
	                               "lookup, 64 ids",
	                               "lookup + lease, 64 ids"};
	for (int k = 0; k < 4; k++)
		printf("  %-30s %10.1f %10.1f\n", names[k], p50[k], p99[k]);
	printf("  %-30s %10.1f\n", "release (not in the above)",
	       pct(rel, nrel, 0.5));
	printf("  a lease makes a lookup %.2fx (1 id: +%.1f us) and %.2fx "
	       "(64 ids: +%.1f us) of the lease-less p50\n",
	       p50[1] / p50[0], p50[1] - p50[0], p50[3] / p50[2],
	       p50[3] - p50[2]);
	if (bad)
		printf("  %d items were not found or not leased\n", bad);
	ecx_consumer_destroy(c);
	close(down[1]);
	int st;
	waitpid(pid, &st, 0);
	for (int k = 0; k < 4; k++)
		free(t[k]);
	free(rel);
	return bad == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
