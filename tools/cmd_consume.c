/* cmd_consume.c - `ecx consume`: load every item a registry lists (or
 * every file of the file baseline), in batches, verifying each byte; the
 * demo's consumer process. */
#include "tool.h"

#include "gen.h"
#include "safetensors.h"
#include "stats.h"

#include <dirent.h>
#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx consume [OPTIONS] REGISTRY\n"
    "       ecx consume [OPTIONS] --files DIR\n"
    "\n"
    "Loads every item REGISTRY lists, BATCH ids per load (as a prefill\n"
    "step asks for the images of its requests), and reports throughput\n"
    "and latency. With --files it reads the file-per-item baseline that\n"
    "'ecx demo' writes (one safetensors file per item, as vLLM's\n"
    "ECExampleConnector does) instead.\n"
    "\n"
    "Options:\n"
    "  --batch N            ids per load (default 8)\n"
    "  --verify             check every byte against the synthetic items\n"
    "  --files DIR          read the file baseline in DIR\n"
    "  --transport T        auto (default), tcp or shm\n"
    "  --token T            bearer token (default $ECX_TOKEN)\n"
    "  --timeout MS         bound on each step (default 5s)\n"
    "  --json               print the result as one JSON object\n"
    "  -h, --help           this text\n"
    "\n"
    "Exit codes: 0 every item loaded (and verified), 1 otherwise, 2 usage.\n";

typedef struct result {
	size_t items, verified, failed;
	uint64_t bytes, ns; /* ns: time in loads, excluding lookups */
	samples batch;
} result;

static void report(const result *r, bool json, const char *what)
{
	samples s = r->batch;
	double p50 = (double)samples_pct(&s, 50) / 1e6;
	double p99 = (double)samples_pct(&s, 99) / 1e6;
	double gbps = r->ns ? (double)r->bytes / (double)r->ns : 0;
	if (json) {
		printf("{\"what\": \"%s\", \"items\": %zu, \"bytes\": %llu, "
		       "\"seconds\": %.6f, \"gbps\": %.3f, \"batch_p50_ms\": "
		       "%.3f, \"batch_p99_ms\": %.3f, \"verified\": %zu, "
		       "\"failed\": %zu}\n",
		       what, r->items, (unsigned long long)r->bytes,
		       (double)r->ns / 1e9, gbps, p50, p99, r->verified,
		       r->failed);
	} else {
		char b[32];
		printf("%s: %zu items, %s in %.3f s: %.2f GB/s; per batch p50 "
		       "%.2f ms, p99 %.2f ms; %zu verified, %zu failed\n",
		       what, r->items, tool_bytes(r->bytes, b, sizeof(b)),
		       (double)r->ns / 1e9, gbps, p50, p99, r->verified,
		       r->failed);
	}
}

typedef struct idlist {
	char **ids;
	size_t n, cap;
} idlist;

static int keep_id(void *arg, const ecx_item *it)
{
	idlist *l = arg;
	if (l->n == l->cap) {
		size_t cap = l->cap ? l->cap * 2 : 256;
		char **v = realloc(l->ids, cap * sizeof(*v));
		if (v == NULL)
			return ECX_ENOMEM;
		l->ids = v;
		l->cap = cap;
	}
	l->ids[l->n] = strdup(it->id);
	if (l->ids[l->n] == NULL)
		return ECX_ENOMEM;
	l->n++;
	return 0;
}

/* Every id the registry lists, page by page; NULL (reported) on failure. */
static char **list_ids(ecx_client *c, size_t *n)
{
	char after[ECX_ID_MAX + 1] = "", next[ECX_ID_MAX + 1];
	idlist l = {0};
	for (;;) {
		int rc = ecx_client_list(c, after, 1000, keep_id, &l, next,
		                         sizeof(next), NULL);
		if (rc != 0) {
			tool_fail("consume", EXIT_FAIL, "%s",
			          rc == ECX_ENOMEM ? "out of memory"
			                           : ecx_last_error());
			for (size_t i = 0; i < l.n; i++)
				free(l.ids[i]);
			free(l.ids);
			*n = 0;
			return NULL;
		}
		if (next[0] == '\0')
			break;
		tool_strlcpy(after, next, sizeof(after));
	}
	*n = l.n;
	return l.ids;
}

static int consume_registry(const char *url, const tool_common *t,
                            const char *transport, size_t batch, bool verify,
                            result *r)
{
	ecx_client_params p = {.field_mask = ECX_CLIENT_PARAM_REGISTRY |
	                                     ECX_CLIENT_PARAM_TOKEN |
	                                     ECX_CLIENT_PARAM_TIMEOUT |
	                                     ECX_CLIENT_PARAM_CONNECT_TIMEOUT,
	                       .registry = url,
	                       .token = t->token,
	                       .timeout_ms = t->timeout_ms,
	                       .connect_timeout_ms = t->timeout_ms};
	ecx_client *rc;
	char why[256];
	if (ecx_client_create(&p, &rc, why, sizeof(why)) != 0)
		return tool_fail("consume", EXIT_USAGE, "%s", why);
	size_t n;
	char **ids = list_ids(rc, &n);
	ecx_client_destroy(rc);
	if (ids == NULL && n == 0)
		return EXIT_FAIL;
	ecx_consumer_params cp = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_TOKEN |
	        ECX_CONSUMER_PARAM_TIMEOUT | ECX_CONSUMER_PARAM_RECV_CAPACITY |
	        ECX_CONSUMER_PARAM_TRANSPORT,
	    .registry = url,
	    .token = t->token,
	    .timeout_ms = t->timeout_ms,
	    .recv_capacity = 512u << 20,
	    .transport = transport};
	ecx_consumer *cons;
	if (ecx_consumer_create(&cp, &cons, why, sizeof(why)) != 0)
		return tool_fail("consume", EXIT_FAIL, "%s", why);
	ecx_item *it = calloc(batch, sizeof(*it));
	bool tty = isatty(STDERR_FILENO);
	for (size_t i = 0; i < n; i += batch) {
		size_t m = n - i < batch ? n - i : batch;
		memset(it, 0, batch * sizeof(*it));
		for (size_t k = 0; k < m; k++)
			it[k].id = ids[i + k];
		ecx_consumer_lookup(cons, it, m);
		for (size_t k = 0; k < m; k++)
			it[k].dst =
			    it[k].status == 0
			        ? ecx_consumer_alloc(cons, it[k].desc.nbytes)
			        : NULL;
		uint64_t t0 = tool_now_ns();
		ecx_consumer_load(cons, it, m);
		uint64_t dt = tool_now_ns() - t0;
		r->ns += dt;
		samples_add(&r->batch, dt);
		for (size_t k = 0; k < m; k++) {
			r->items++;
			if (it[k].status != 0) {
				r->failed++;
				if (r->failed <= 5)
					fprintf(stderr, "ecx consume: %s: %s\n",
					        it[k].id,
					        ecx_strerror(it[k].status));
				continue;
			}
			r->bytes += it[k].desc.nbytes;
			if (verify) {
				if (gen_check(it[k].id, it[k].dst,
				              it[k].desc.nbytes))
					r->verified++;
				else
					r->failed++;
			}
			ecx_consumer_free(cons, it[k].dst);
		}
		if (tty)
			fprintf(stderr, "\recx consume: %zu/%zu items",
			        r->items, n);
	}
	if (tty)
		fputc('\n', stderr);
	free(it);
	for (size_t i = 0; i < n; i++)
		free(ids[i]);
	free(ids);
	ecx_consumer_destroy(cons);
	return r->failed == 0 && r->items > 0 ? EXIT_OK : EXIT_FAIL;
}

static int name_cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static int consume_files(const char *dir, size_t batch, bool verify, result *r)
{
	DIR *d = opendir(dir);
	if (d == NULL)
		return tool_fail("consume", EXIT_FAIL, "cannot open %s: %m",
		                 dir);
	char **names = NULL;
	size_t n = 0, cap = 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		if (n == cap) {
			cap = cap ? cap * 2 : 256;
			names = realloc(names, cap * sizeof(*names));
		}
		names[n++] = strdup(e->d_name);
	}
	closedir(d);
	qsort(names, n, sizeof(*names), name_cmp);
	for (size_t i = 0; i < n; i += batch) {
		size_t m = n - i < batch ? n - i : batch;
		void *bufs[256];
		ecx_tensor_desc ds[256];
		int rcs[256];
		uint64_t t0 = tool_now_ns();
		for (size_t k = 0; k < m && k < 256; k++) {
			char path[4096], why[256];
			/* vLLM's layout:
			 * FOLDER/<mm_hash>/encoder_cache.safetensors */
			snprintf(path, sizeof(path),
			         "%s/%s/encoder_cache.safetensors", dir,
			         names[i + k]);
			bufs[k] = NULL;
			rcs[k] =
			    st_load(path, &ds[k], &bufs[k], why, sizeof(why));
		}
		uint64_t dt = tool_now_ns() - t0;
		r->ns += dt;
		samples_add(&r->batch, dt);
		for (size_t k = 0; k < m && k < 256; k++) {
			r->items++;
			if (rcs[k] != 0) {
				r->failed++;
				continue;
			}
			r->bytes += ds[k].nbytes;
			if (verify) {
				if (gen_check(names[i + k], bufs[k],
				              ds[k].nbytes))
					r->verified++;
				else
					r->failed++;
			}
			free(bufs[k]);
		}
	}
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	return r->failed == 0 && r->items > 0 ? EXIT_OK : EXIT_FAIL;
}

int cmd_consume(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"batch", required_argument, NULL, 'b'},
	    {"verify", no_argument, NULL, 'v'},
	    {"files", required_argument, NULL, 'f'},
	    {"transport", required_argument, NULL, 'T'},
	    TOOL_OPT_ENTRIES,
	    {NULL, 0, NULL, 0}};
	tool_common t = {.token = getenv("ECX_TOKEN"), .timeout_ms = 5000};
	const char *files = NULL, *transport = NULL;
	size_t batch = 8;
	bool verify = false;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
			batch = strtoul(optarg, NULL, 10);
			if (batch < 1 || batch > 256)
				return tool_fail("consume", EXIT_USAGE,
				                 "--batch takes 1 to 256");
			break;
		case 'v':
			verify = true;
			break;
		case 'f':
			files = optarg;
			break;
		case 'T':
			transport = optarg;
			break;
		default: {
			int rc = tool_opt("consume", help, c, optarg, &t);
			if (rc >= 0)
				return rc;
		}
		}
	}
	if ((files == NULL) != (argc - optind == 1) ||
	    (files != NULL && argc != optind)) {
		fputs(help, stderr);
		return EXIT_USAGE;
	}
	result r = {0};
	int rc = files != NULL ? consume_files(files, batch, verify, &r)
	                       : consume_registry(argv[optind], &t, transport,
	                                          batch, verify, &r);
	if (r.items > 0)
		report(&r, t.json, files != NULL ? "file" : "ecx");
	samples_free(&r.batch);
	return rc;
}
