/* cmd_consume.c - `ecx consume`: load every item a registry lists (or
 * every file of the file baseline), in batches, verifying each byte; the
 * demo's consumer process. */
#include "tool.h"

#include <cjson/cJSON.h>

#include "consume.h"
#include "gen.h"
#include "safetensors.h"
#include "stats.h"

#include <dirent.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx consume [OPTIONS] REGISTRY\n"
    "       ecx consume [OPTIONS] --files DIR\n"
    "\n"
    "Loads every item REGISTRY lists, BATCH ids per load (as a prefill\n"
    "step asks for the images of its requests), and reports throughput\n"
    "and latency. REGISTRY is http://HOST:PORT,\n"
    "redis://[:PASSWORD@]HOST[:PORT][/DB] or\n"
    "redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB],\n"
    "or several separated by commas: each is listed in turn (one that\n"
    "fails is said on stderr and the others are still listed), and every\n"
    "id is looked up in all of them. With --files it reads the\n"
    "file-per-item baseline that 'ecx demo' writes\n"
    "(DIR/ID/encoder_cache.safetensors, as vLLM's ECExampleConnector\n"
    "does) instead.\n"
    "\n"
    "Timed: each load (ecx: ecx_consumer_load, after the lookup; files:\n"
    "open, parse and read). Where the items land, per --memory:\n"
    "  prefaulted  memory faulted in before timing, reused every batch\n"
    "              (ecx: its receive arena, sized for a batch of the\n"
    "              largest items listed; files: one buffer)\n"
    "  fresh       each item into memory never touched before, every\n"
    "              item kept to the end (so page faults are timed)\n"
    "\n"
    "Options:\n"
    "  --batch N            ids per load, 1 to 256 (default 8)\n"
    "  --verify             check every byte against the synthetic item of\n"
    "                       its id (items of 'ecx serve --synthetic' or\n"
    "                       '--workload'); other items fail it\n"
    "  --memory M           prefaulted (default) or fresh\n"
    "  --files DIR          read the file baseline in DIR\n"
    "  --transport T        auto (default), tcp or shm\n"
    "  --token T            bearer token (default $ECX_TOKEN)\n"
    "  --timeout DUR        bound on each step, with its unit: 500ms, 2s\n"
    "                       (default 5s)\n"
    "  --json               print the result as one JSON object\n"
    "  -h, --help           this text\n"
    "\n"
    "Exit codes: 0 every item loaded (and verified), 1 otherwise (the\n"
    "message says why: nothing listed, a load or check failed), 2 usage.\n";

typedef struct result {
	size_t items, verified, failed;
	uint64_t bytes, ns; /* ns: time in loads, excluding lookups */
	samples batch;
} result;

static void report(const result *r, bool json, const char *what,
                   const char *memory)
{
	samples s = r->batch;
	double p50 = (double)samples_pct(&s, 50) / 1e6;
	double p99 = (double)samples_pct(&s, 99) / 1e6;
	double gbps = r->ns ? (double)r->bytes / (double)r->ns : 0;
	if (json) {
		cJSON *o = cJSON_CreateObject();
		cJSON_AddStringToObject(o, "what", what);
		cJSON_AddStringToObject(o, "memory", memory);
		cJSON_AddNumberToObject(o, "items", (double)r->items);
		cJSON_AddNumberToObject(o, "bytes", (double)r->bytes);
		cJSON_AddNumberToObject(o, "seconds", (double)r->ns / 1e9);
		cJSON_AddNumberToObject(o, "gbps", gbps);
		cJSON_AddNumberToObject(o, "batch_p50_ms", p50);
		cJSON_AddNumberToObject(o, "batch_p99_ms", p99);
		cJSON_AddNumberToObject(o, "verified", (double)r->verified);
		cJSON_AddNumberToObject(o, "failed", (double)r->failed);
		char *s = cJSON_PrintUnformatted(o);
		if (s != NULL)
			printf("%s\n", s);
		free(s);
		cJSON_Delete(o);
	} else {
		char b[32];
		printf("%s (%s memory): %zu items, %s in %.3f s: %.2f GB/s; "
		       "per batch p50 %.2f ms, p99 %.2f ms; %zu verified, %zu "
		       "failed\n",
		       what, memory, r->items,
		       tool_bytes(r->bytes, b, sizeof(b)), (double)r->ns / 1e9,
		       gbps, p50, p99, r->verified, r->failed);
	}
}

/* Memory never touched before, for --memory fresh (mmap: malloc could
 * hand back pages an earlier item faulted in). */
static void *fresh_map(size_t n)
{
	void *p = mmap(NULL, n ? n : 1, PROT_READ | PROT_WRITE,
	               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

/* Items kept to the end with --memory fresh. */
typedef struct kept {
	void **p;
	size_t *n;
	size_t len, cap;
} kept;

static bool kept_add(kept *k, void *p, size_t n)
{
	if (k->len == k->cap) {
		size_t cap = k->cap ? k->cap * 2 : 256;
		void **v = realloc(k->p, cap * sizeof(*v));
		if (v != NULL)
			k->p = v;
		size_t *w = realloc(k->n, cap * sizeof(*w));
		if (w != NULL)
			k->n = w;
		if (v == NULL || w == NULL)
			return false;
		k->cap = cap;
	}
	k->p[k->len] = p;
	k->n[k->len++] = n;
	return true;
}

static void kept_free(kept *k)
{
	for (size_t i = 0; i < k->len; i++)
		munmap(k->p[i], k->n[i] ? k->n[i] : 1);
	free(k->p);
	free(k->n);
}

/* Says why an item failed --verify (the first few only). */
static void verify_failed(result *r, const char *id)
{
	r->failed++;
	if (r->failed <= 5)
		fprintf(stderr,
		        "ecx consume: %s: the bytes are not those of the "
		        "synthetic item '%s' (--verify checks items made by "
		        "'ecx serve --synthetic' or '--workload')\n",
		        id, id);
}

/* Says why an item failed before its load (the first few only). */
static void item_failed(result *r, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void item_failed(result *r, const char *id, const char *fmt, ...)
{
	r->items++;
	r->failed++;
	if (r->failed > 5)
		return;
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr, "ecx consume: %s: %s\n", id, msg);
}

static int consume_registry(const char *list, const tool_common *t,
                            const char *transport, size_t batch, bool verify,
                            bool fresh, result *r)
{
	char urls[TOOL_REGISTRIES_MAX][ECX_ADDR_MAX], why[256];
	int nu = tool_registry_split(list, urls, why, sizeof(why));
	if (nu < 0)
		return tool_fail("consume", EXIT_USAGE, "%s", why);
	if (nu == 0)
		return tool_missing("consume", "REGISTRY");
	idlist l = {0};
	int rc = list_ids(urls, (size_t)nu, t, &l);
	if (rc != EXIT_OK)
		return rc;
	if (l.n == 0) {
		idlist_free(&l);
		return tool_fail("consume", EXIT_FAIL,
		                 "%s list%s no items: nothing to load", list,
		                 nu > 1 ? "" : "s");
	}
	uint64_t arena = fresh ? 0 : arena_size(&l, batch);
	if (!fresh && arena == 0) {
		idlist_free(&l);
		return tool_fail("consume", EXIT_FAIL, "out of memory");
	}
	/* The consumer asks every registry of the list, as lookups do. */
	ecx_consumer_params cp = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_TOKEN |
	        ECX_CONSUMER_PARAM_TIMEOUT | ECX_CONSUMER_PARAM_RECV_CAPACITY |
	        ECX_CONSUMER_PARAM_TRANSPORT,
	    .registry = list,
	    .token = t->token,
	    .timeout_ms = t->timeout_ms,
	    .recv_capacity = arena,
	    .transport = transport};
	ecx_consumer *cons;
	int err = ecx_consumer_create(&cp, &cons, why, sizeof(why));
	if (err != 0) {
		idlist_free(&l);
		char b[32];
		if (!fresh && err != ECX_EINVAL)
			return tool_fail(
			    "consume", EXIT_FAIL,
			    "cannot make a receive arena of %s (a batch of "
			    "the largest items listed): %s; a smaller --batch "
			    "or --memory fresh needs less",
			    tool_bytes(arena, b, sizeof(b)), why);
		return tool_fail("consume",
		                 err == ECX_EINVAL ? EXIT_USAGE : EXIT_FAIL,
		                 "%s", why);
	}
	ecx_item *it = calloc(batch, sizeof(*it));
	ecx_item *ld = calloc(batch, sizeof(*ld));
	kept keep = {0};
	bool tty = isatty(STDERR_FILENO);
	for (size_t i = 0; i < l.n && it != NULL && ld != NULL; i += batch) {
		size_t m = l.n - i < batch ? l.n - i : batch, nl = 0;
		memset(it, 0, batch * sizeof(*it));
		for (size_t k = 0; k < m; k++)
			it[k].id = l.v[i + k].id;
		ecx_consumer_lookup(cons, it, m);
		/* Only what was found and has memory is loaded: a load
		 * would report the others as bad arguments. */
		for (size_t k = 0; k < m; k++) {
			char b[32], c[32];
			size_t nb = (size_t)it[k].desc.nbytes;
			if (it[k].status != 0) {
				item_failed(r, it[k].id, "%s",
				            ecx_strerror(it[k].status));
				continue;
			}
			it[k].dst = fresh ? fresh_map(nb)
			                  : ecx_consumer_alloc(cons, nb);
			if (it[k].dst != NULL && fresh &&
			    !kept_add(&keep, it[k].dst, nb)) {
				munmap(it[k].dst, nb ? nb : 1);
				it[k].dst = NULL;
			}
			if (it[k].dst == NULL && !fresh)
				item_failed(
				    r, it[k].id,
				    "its %s %s the receive arena (%s, sized "
				    "for a batch of the items listed at start: "
				    "they have grown since); run again, or use "
				    "--memory fresh",
				    tool_bytes(nb, b, sizeof(b)),
				    nb > arena ? "do not fit in"
				               : "find no room left in",
				    tool_bytes(arena, c, sizeof(c)));
			else if (it[k].dst == NULL)
				item_failed(r, it[k].id,
				            "no memory to load its %s into",
				            tool_bytes(nb, b, sizeof(b)));
			else
				ld[nl++] = it[k];
		}
		uint64_t t0 = tool_now_ns();
		int lrc = nl > 0 ? ecx_consumer_load(cons, ld, nl) : 0;
		uint64_t dt = tool_now_ns() - t0;
		/* "N of M items failed; first: WHY": the why names the first
		 * failed item and its producer (a token refused, say). */
		char first[512] = "";
		const char *why =
		    lrc != 0 ? strstr(ecx_last_error(), "first: ") : NULL;
		if (why != NULL)
			snprintf(first, sizeof(first), "%s", why + 7);
		r->ns += dt;
		samples_add(&r->batch, dt);
		for (size_t k = 0; k < nl; k++) {
			r->items++;
			if (ld[k].status != 0) {
				r->failed++;
				if (r->failed <= 5 && first[0] != '\0')
					fprintf(stderr, "ecx consume: %s\n",
					        first);
				else if (r->failed <= 5)
					fprintf(stderr,
					        "ecx consume: %s from %s: %s\n",
					        ld[k].id, ld[k].producer,
					        ecx_strerror(ld[k].status));
				first[0] = '\0';
				if (!fresh)
					ecx_consumer_free(cons, ld[k].dst);
				continue;
			}
			r->bytes += ld[k].desc.nbytes;
			if (verify) {
				if (gen_check(ld[k].id, ld[k].dst,
				              ld[k].desc.nbytes))
					r->verified++;
				else
					verify_failed(r, ld[k].id);
			}
			if (!fresh)
				ecx_consumer_free(cons, ld[k].dst);
		}
		if (tty)
			fprintf(stderr, "\recx consume: %zu/%zu items",
			        r->items, l.n);
	}
	if (tty)
		fputc('\n', stderr);
	if (it == NULL || ld == NULL)
		tool_fail("consume", EXIT_FAIL, "out of memory");
	free(it);
	free(ld);
	idlist_free(&l);
	ecx_consumer_destroy(cons);
	kept_free(&keep);
	return r->failed == 0 && r->items > 0 ? EXIT_OK : EXIT_FAIL;
}

static int name_cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The item at DIR/ID/encoder_cache.safetensors (vLLM's layout). */
static void item_path(char *path, size_t len, const char *dir, const char *id)
{
	snprintf(path, len, "%s/%s/encoder_cache.safetensors", dir, id);
}

static int consume_files(const char *dir, size_t batch, bool verify, bool fresh,
                         result *r)
{
	DIR *d = opendir(dir);
	if (d == NULL)
		return tool_fail("consume", EXIT_FAIL, "cannot open %s: %m",
		                 dir);
	char **names = NULL;
	size_t n = 0, cap = 0;
	struct dirent *e;
	bool oom = false;
	while ((e = readdir(d)) != NULL && !oom) {
		if (e->d_name[0] == '.')
			continue;
		if (n == cap) {
			size_t c2 = cap ? cap * 2 : 256;
			char **v = realloc(names, c2 * sizeof(*names));
			if (v == NULL) {
				oom = true;
				break;
			}
			names = v;
			cap = c2;
		}
		if ((names[n] = strdup(e->d_name)) == NULL)
			oom = true;
		else
			n++;
	}
	closedir(d);
	int rc = EXIT_OK;
	kept keep = {0};
	void *pre = NULL;
	size_t precap = 0, each = 0;
	if (oom) {
		rc = tool_fail("consume", EXIT_FAIL, "out of memory");
		goto out;
	}
	if (n == 0) {
		rc = tool_fail("consume", EXIT_FAIL,
		               "%s holds no items (the file baseline keeps "
		               "each at %s/ID/encoder_cache.safetensors)",
		               dir, dir);
		goto out;
	}
	qsort(names, n, sizeof(*names), name_cmp);
	/* Pre-faulted: one buffer for a batch of the largest item, faulted
	 * in before any load is timed (as ecx's receive arena is). */
	if (!fresh) {
		for (size_t i = 0; i < n; i++) {
			char path[4096];
			item_path(path, sizeof(path), dir, names[i]);
			FILE *f = fopen(path, "rb");
			if (f == NULL)
				continue;
			if (fseek(f, 0, SEEK_END) == 0 && ftell(f) > 0 &&
			    (size_t)ftell(f) > each)
				each = (size_t)ftell(f);
			fclose(f);
		}
		precap = each * (batch < n ? batch : n);
		if (precap == 0 || (pre = malloc(precap)) == NULL) {
			rc = tool_fail("consume", EXIT_FAIL,
			               "no memory for %zu bytes", precap);
			goto out;
		}
		tool_prefault(pre, precap);
	}
	for (size_t i = 0; i < n; i += batch) {
		size_t m = n - i < batch ? n - i : batch;
		void *bufs[256];
		size_t lens[256];
		ecx_tensor_desc ds[256];
		int rcs[256];
		char whys[256][160];
		for (size_t k = 0; k < m; k++) {
			/* The file's size bounds the tensor's. */
			char path[4096];
			item_path(path, sizeof(path), dir, names[i + k]);
			lens[k] = each;
			if (fresh) {
				FILE *f = fopen(path, "rb");
				lens[k] = 0;
				if (f != NULL) {
					if (fseek(f, 0, SEEK_END) == 0 &&
					    ftell(f) > 0)
						lens[k] = (size_t)ftell(f);
					fclose(f);
				}
				bufs[k] = fresh_map(lens[k]);
				if (bufs[k] != NULL &&
				    !kept_add(&keep, bufs[k], lens[k])) {
					munmap(bufs[k], lens[k] ? lens[k] : 1);
					bufs[k] = NULL;
				}
			} else {
				bufs[k] = (char *)pre + k * each;
			}
		}
		uint64_t t0 = tool_now_ns();
		for (size_t k = 0; k < m; k++) {
			char path[4096];
			item_path(path, sizeof(path), dir, names[i + k]);
			rcs[k] = bufs[k] == NULL
			             ? tool_why(whys[k], sizeof(whys[k]),
			                        ECX_ENOMEM, "out of memory")
			             : st_load_into(path, &ds[k], bufs[k],
			                            lens[k] ? lens[k] : 1,
			                            whys[k], sizeof(whys[k]));
		}
		uint64_t dt = tool_now_ns() - t0;
		r->ns += dt;
		samples_add(&r->batch, dt);
		for (size_t k = 0; k < m; k++) {
			r->items++;
			if (rcs[k] != 0) {
				r->failed++;
				if (r->failed <= 5)
					fprintf(stderr, "ecx consume: %s\n",
					        whys[k]);
				continue;
			}
			r->bytes += ds[k].nbytes;
			if (verify) {
				if (gen_check(names[i + k], bufs[k],
				              ds[k].nbytes))
					r->verified++;
				else
					verify_failed(r, names[i + k]);
			}
		}
	}
	rc = r->failed == 0 && r->items > 0 ? EXIT_OK : EXIT_FAIL;
out:
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	free(pre);
	kept_free(&keep);
	return rc;
}

int cmd_consume(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"batch", required_argument, NULL, 'b'},
	    {"verify", no_argument, NULL, 'v'},
	    {"files", required_argument, NULL, 'f'},
	    {"transport", required_argument, NULL, 'T'},
	    {"memory", required_argument, NULL, 'm'},
	    TOOL_OPT_ENTRIES,
	    {NULL, 0, NULL, 0}};
	tool_common t = {.token = getenv("ECX_TOKEN"), .timeout_ms = 5000};
	const char *files = NULL, *transport = NULL;
	size_t batch = 8;
	bool verify = false, fresh = false;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'b': {
			char *end;
			batch = strtoul(optarg, &end, 10);
			if (*end != '\0' || batch < 1 || batch > 256)
				return tool_fail("consume", EXIT_USAGE,
				                 "--batch takes 1 to 256");
			break;
		}
		case 'v':
			verify = true;
			break;
		case 'f':
			files = optarg;
			break;
		case 'T':
			transport = optarg;
			if (strcmp(optarg, "auto") != 0 &&
			    strcmp(optarg, "tcp") != 0 &&
			    strcmp(optarg, "shm") != 0)
				return tool_fail(
				    "consume", EXIT_USAGE,
				    "--transport takes auto, tcp or "
				    "shm, not '%s'",
				    optarg);
			break;
		case 'm':
			if (strcmp(optarg, "prefaulted") != 0 &&
			    strcmp(optarg, "fresh") != 0)
				return tool_fail("consume", EXIT_USAGE,
				                 "--memory takes prefaulted or "
				                 "fresh, not '%s'",
				                 optarg);
			fresh = strcmp(optarg, "fresh") == 0;
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
	int rc = files != NULL ? consume_files(files, batch, verify, fresh, &r)
	                       : consume_registry(argv[optind], &t, transport,
	                                          batch, verify, fresh, &r);
	if (r.items > 0)
		report(&r, t.json, files != NULL ? "file" : "ecx",
		       fresh ? "fresh" : "prefaulted");
	samples_free(&r.batch);
	return rc;
}
