/*
 * cluster_load.c - the consumer of the simulated cluster (test_cluster.sh):
 * looks ids up and loads them, one after another without pause, until
 * SIGTERM, checking every byte, and writes one line per call to a log.
 *
 *   ecx-cluster-load --registry URLS --ids P1:N,P2:N... --bytes B
 *                    --timeout MS --log FILE
 *
 * Ids are PREFIX-0 .. PREFIX-(N-1) of each prefix, in turn. When a lookup
 * fails (the directory is down: an error, not a miss), the item an earlier
 * lookup of that id found is loaded: what a consumer that holds a lookup
 * does. Log lines (times CLOCK_REALTIME, ms):
 *   L END_MS DUR_MS STATUS ID       a lookup: ok, miss or the error's name
 *   D END_MS DUR_MS STATUS HELD ID  a load: ok, wrong (a byte differs) or
 *                                   the error's name; HELD 1 when it used
 *                                   an earlier lookup
 */
#include "common/testutil.h"

#include <getopt.h>
#include <time.h>

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

static uint64_t wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t mono_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

typedef struct held {
	char id[64];
	bool have;
	ecx_item it; /* the last lookup that found it */
} held;

int main(int argc, char **argv)
{
	const char *registry = NULL, *ids = NULL, *logp = NULL;
	size_t bytes = 1 << 18;
	int timeout = 2000;
	static const struct option opts[] = {
	    {"registry", required_argument, NULL, 'r'},
	    {"ids", required_argument, NULL, 'i'},
	    {"bytes", required_argument, NULL, 'b'},
	    {"timeout", required_argument, NULL, 't'},
	    {"log", required_argument, NULL, 'l'},
	    {NULL, 0, NULL, 0}};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (o) {
		case 'r':
			registry = optarg;
			break;
		case 'i':
			ids = optarg;
			break;
		case 'b':
			bytes = strtoull(optarg, NULL, 10);
			break;
		case 't':
			timeout = atoi(optarg);
			break;
		case 'l':
			logp = optarg;
			break;
		default:
			return 2;
		}
	}
	if (registry == NULL || ids == NULL || logp == NULL) {
		fprintf(stderr, "usage: ecx-cluster-load --registry URLS --ids "
		                "P:N,... --bytes B --timeout MS --log FILE\n");
		return 2;
	}
	held *h = NULL;
	size_t n = 0;
	for (const char *p = ids; *p != '\0';) {
		char pre[32];
		int cnt = 0, len = 0;
		if (sscanf(p, "%31[^:]:%d%n", pre, &cnt, &len) != 2)
			return 2;
		h = realloc(h, (n + (size_t)cnt) * sizeof(*h));
		for (int i = 0; i < cnt; i++, n++) {
			memset(&h[n], 0, sizeof(h[n]));
			snprintf(h[n].id, sizeof(h[n].id), "%s-%d", pre, i);
		}
		p += len;
		if (*p == ',')
			p++;
	}
	FILE *log = fopen(logp, "w");
	if (log == NULL || n == 0)
		return 2;
	setvbuf(log, NULL, _IOLBF, 0);
	signal(SIGTERM, on_term);
	signal(SIGINT, on_term);
	ecx_consumer_params cp = {.field_mask = ECX_CONSUMER_PARAM_REGISTRY |
	                                        ECX_CONSUMER_PARAM_TIMEOUT |
	                                        ECX_CONSUMER_PARAM_TRANSPORT,
	                          .registry = registry,
	                          .timeout_ms = timeout,
	                          .transport = "tcp"};
	ecx_consumer *c;
	char why[256];
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0) {
		fprintf(stderr, "ecx-cluster-load: %s\n", why);
		return 1;
	}
	unsigned char *dst = malloc(bytes);
	printf("ready\n");
	fflush(stdout);
	for (size_t k = 0; !stop; k = (k + 1) % n) {
		held *x = &h[k];
		ecx_item it = {.id = x->id};
		uint64_t t0 = mono_us();
		int rc = ecx_consumer_lookup(c, &it, 1);
		uint64_t dur = mono_us() - t0;
		const char *st = rc != 0          ? ecx_err_name(rc)
		                 : it.status == 0 ? "ok"
		                 : it.status == ECX_ENOTFOUND
		                     ? "miss"
		                     : ecx_err_name(it.status);
		fprintf(log, "L %llu %.1f %s %s\n",
		        (unsigned long long)wall_ms(), dur / 1000.0, st, x->id);
		bool use_held = false;
		if (rc == 0 && it.status == 0) {
			x->it = it;
			x->it.id = x->id;
			x->have = true;
		} else if (rc != 0 && x->have) {
			it = x->it; /* the directory is down: what we hold */
			use_held = true;
		} else {
			if (rc != 0)
				usleep(20000); /* nothing to load: not a spin */
			continue;
		}
		if (it.desc.nbytes > bytes) {
			fprintf(log, "D %llu 0 ESIZE %d %s\n",
			        (unsigned long long)wall_ms(), use_held, x->id);
			continue;
		}
		memset(dst, 0, it.desc.nbytes);
		it.dst = dst;
		t0 = mono_us();
		rc = ecx_consumer_load(c, &it, 1);
		dur = mono_us() - t0;
		st = rc != 0                                ? ecx_err_name(rc)
		     : tu_check(x->id, dst, it.desc.nbytes) ? "ok"
		                                            : "wrong";
		fprintf(log, "D %llu %.1f %s %d %s\n",
		        (unsigned long long)wall_ms(), dur / 1000.0, st,
		        use_held, x->id);
	}
	ecx_consumer_destroy(c);
	free(dst);
	free(h);
	fclose(log);
	return 0;
}
