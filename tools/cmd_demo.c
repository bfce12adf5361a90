/* cmd_demo.c - `ecx demo`: the main job, end to end, beside the
 * file-per-item baseline, on one workload, in one run of the producer,
 * the loads repeated (--runs) so that a ratio comes with its spread. */
#include "tool.h"

#include "gen.h"
#include "proc.h"
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <getopt.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define DEMO_RUNS_MAX 20

static const char help[] =
    "usage: ecx demo [--count N] [--batch N] [--runs N] [--transport T]\n"
    "                [--standalone-registry] [--dir DIR] [--json]\n"
    "\n"
    "The main job in one command. It starts a producer ('ecx serve') with\n"
    "its embedded registry on 127.0.0.1, which puts N Qwen2.5-VL-shaped\n"
    "image embeddings (bfloat16, 64 to 2691 tokens x 3584) into its arena\n"
    "and publishes them. Beside it, on the same workload in the same run,\n"
    "the file-per-item approach of vLLM's ECExampleConnector: each tensor\n"
    "saved as a safetensors file into a folder in /dev/shm. Then consumer\n"
    "processes ('ecx consume --verify') load every item, BATCH per load,\n"
    "checking every byte, both ways, twice: into pre-faulted memory (ecx:\n"
    "its receive arena; files: a buffer faulted in before timing), and\n"
    "into fresh memory (each item into memory never touched before, every\n"
    "item kept), so each table compares like with like. Timed: ecx's\n"
    "loads (after their lookups) and the files' open, parse and read.\n"
    "The loads run RUNS times, ecx and files in turn; each pair gives a\n"
    "ratio, printed as the median with the range of all runs, and the\n"
    "tables show the run of the median. A range on both sides of 1x is\n"
    "said to be no clear lead.\n"
    "\n"
    "Options:\n"
    "  --count N              items, 1 to 100000 (default 200)\n"
    "  --batch N              items per load, 1 to 256 (default 8)\n"
    "  --runs N               times the loads run, 1 to 20 (default 3)\n"
    "  --transport T          auto (default: shared memory here), tcp, shm\n"
    "  --standalone-registry  run the registry as a third process\n"
    "                         ('ecx registry') and publish to it\n"
    "  --dir DIR              folder for the file baseline (default\n"
    "                         /dev/shm, else /tmp)\n"
    "  --json                 print the results as JSON\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit codes: 0 every item moved and verified both ways, 1 otherwise,\n"
    "2 usage.\n";

static void step(const char *what)
{
	fprintf(stderr, "ecx demo: %s\n", what);
}

static cJSON *json_line(proc *p, int timeout_ms, const char *who)
{
	char line[4096];
	if (!proc_line(p, line, sizeof(line), timeout_ms)) {
		tool_fail("demo", EXIT_FAIL, "%s said nothing within %d s", who,
		          timeout_ms / 1000);
		return NULL;
	}
	cJSON *o = cJSON_Parse(line);
	if (o == NULL)
		tool_fail("demo", EXIT_FAIL, "%s said: %s", who, line);
	return o;
}

static double num(const cJSON *o, const char *k)
{
	const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
	return cJSON_IsNumber(x) ? x->valuedouble : 0;
}

/* Writes the file baseline: one safetensors file per item, as vLLM's
 * ECExampleConnector lays them out. Returns seconds, or -1. */
static double save_files(const char *dir, size_t count)
{
	void *buf = NULL;
	size_t cap = 0;
	uint64_t t = 0;
	for (size_t i = 0; i < count; i++) {
		char id[64], path[4096], why[256];
		uint64_t dims[2] = {gen_qwen_tokens(i), 3584};
		ecx_tensor_desc d;
		ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
		if (d.nbytes > cap) {
			free(buf);
			buf = malloc(d.nbytes);
			cap = d.nbytes;
		}
		snprintf(id, sizeof(id), "qwen-%zu", i);
		gen_fill(id, buf, d.nbytes);
		uint64_t t0 = tool_now_ns();
		snprintf(path, sizeof(path), "%s/%s", dir, id);
		mkdir(path, 0700);
		snprintf(path, sizeof(path), "%s/%s/encoder_cache.safetensors",
		         dir, id);
		if (st_save(path, &d, buf, why, sizeof(why)) != 0) {
			free(buf);
			tool_fail("demo", EXIT_FAIL, "%s", why);
			return -1;
		}
		t += tool_now_ns() - t0;
	}
	free(buf);
	return (double)t / 1e9;
}

static void remove_files(const char *dir, size_t count)
{
	for (size_t i = 0; i < count; i++) {
		char path[4096];
		snprintf(path, sizeof(path),
		         "%s/qwen-%zu/encoder_cache.safetensors", dir, i);
		unlink(path);
		snprintf(path, sizeof(path), "%s/qwen-%zu", dir, i);
		rmdir(path);
	}
	rmdir(dir);
}

/* Runs 'ecx consume --verify --json' on the registry (or, with files,
 * the file baseline in that folder) and returns its JSON line, or NULL
 * (reported). */
static cJSON *consume_run(const char *regurl, const char *files,
                          const char *batch, const char *transport,
                          const char *memory)
{
	proc p = {0};
	char *a[16] = {"consume", "--batch",  (char *)batch, "--verify",
	               "--json",  "--memory", (char *)memory};
	int n = 7;
	if (files != NULL) {
		a[n++] = "--files";
		a[n++] = (char *)files;
	} else {
		a[n++] = "--transport";
		a[n++] = (char *)transport;
		a[n++] = (char *)regurl;
	}
	a[n] = NULL;
	const char *who = files != NULL ? "ecx consume --files" : "ecx consume";
	if (!proc_start(&p, a)) {
		tool_fail("demo", EXIT_FAIL, "cannot start %s", who);
		return NULL;
	}
	cJSON *o = json_line(&p, 300000, who);
	int st = proc_stop(&p, 0, 10000);
	if (o != NULL && (!WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
		tool_fail("demo", EXIT_FAIL, "%s --memory %s failed", who,
		          memory);
		cJSON_Delete(o);
		o = NULL;
	}
	return o;
}

/* Prints one memory's verdict: the median ratio of file time to ecx time
 * with its range over the runs, and what it means (a lead only where
 * every run shows it). */
static void demo_verdict(const char *into, double ratio, double lo, double hi,
                         int runs, double ecx_s, double file_s)
{
	const char *says = lo > 1.0       ? "ecx is faster in every run"
	                   : hi < 1.0     ? "the files are faster in every run"
	                   : runs > 1     ? "no clear lead: the runs differ on "
	                                    "which is faster"
	                   : ratio >= 1.0 ? "ecx is faster in this one run"
	                                  : "the files are faster in this "
	                                    "one run";
	if (runs > 1)
		printf("%s: ecx loads the workload %.2fx as fast as the file "
		       "baseline (median of %d runs, range %.2fx-%.2fx; "
		       "median run %.3f s vs %.3f s): %s.\n",
		       into, ratio, runs, lo, hi, ecx_s, file_s, says);
	else
		printf("%s: ecx loads the workload %.2fx as fast as the file "
		       "baseline (%.3f s vs %.3f s): %s.\n",
		       into, ratio, ecx_s, file_s, says);
}

int cmd_demo(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"count", required_argument, NULL, 'n'},
	    {"batch", required_argument, NULL, 'b'},
	    {"runs", required_argument, NULL, 'r'},
	    {"transport", required_argument, NULL, 'T'},
	    {"standalone-registry", no_argument, NULL, 'S'},
	    {"dir", required_argument, NULL, 'd'},
	    {"json", no_argument, NULL, 'j'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	size_t count = 200;
	int runs = 3;
	char batch[16] = "8", countstr[16];
	const char *transport = "auto", *base = NULL;
	bool standalone = false, json = false;
	char *end;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'n':
			count = strtoul(optarg, &end, 10);
			if (*end != '\0' || count < 1 || count > 100000)
				return tool_fail("demo", EXIT_USAGE,
				                 "--count takes 1 to 100000");
			break;
		case 'b':
			if (strtol(optarg, &end, 10) < 1 || *end != '\0' ||
			    atoi(optarg) > 256)
				return tool_fail("demo", EXIT_USAGE,
				                 "--batch takes 1 to 256");
			snprintf(batch, sizeof(batch), "%d", atoi(optarg));
			break;
		case 'r':
			runs = (int)strtol(optarg, &end, 10);
			if (*end != '\0' || runs < 1 || runs > DEMO_RUNS_MAX)
				return tool_fail("demo", EXIT_USAGE,
				                 "--runs takes 1 to %d",
				                 DEMO_RUNS_MAX);
			break;
		case 'T':
			transport = optarg;
			break;
		case 'S':
			standalone = true;
			break;
		case 'd':
			base = optarg;
			break;
		case 'j':
			json = true;
			break;
		case 'h':
			fputs(help, stdout);
			return EXIT_OK;
		default:
			fputs(help, stderr);
			return EXIT_USAGE;
		}
	}
	if (optind != argc) {
		fputs(help, stderr);
		return EXIT_USAGE;
	}
	snprintf(countstr, sizeof(countstr), "%zu", count);
	/* The arena holds the whole workload with room to spare. */
	uint64_t total = 0;
	for (size_t i = 0; i < count; i++)
		total += gen_qwen_tokens(i) * 3584 * 2;
	char capacity[32];
	snprintf(capacity, sizeof(capacity), "%llu",
	         (unsigned long long)(total + total / 8 + (64u << 20)));
	signal(SIGPIPE, SIG_IGN);
	int rc = EXIT_FAIL;
	proc reg = {0}, prod = {0};
	cJSON *served = NULL, *loaded[2] = {NULL, NULL},
	      *fileres[2] = {NULL, NULL};
	/* Each run's results, [memory][run]; loaded and fileres point at the
	 * median run's. */
	cJSON *lr[2][DEMO_RUNS_MAX] = {{NULL}},
	      *fr[2][DEMO_RUNS_MAX] = {{NULL}};
	double ratios[2][DEMO_RUNS_MAX] = {{0}};
	double ratio[2] = {0, 0}, rmin[2] = {0, 0}, rmax[2] = {0, 0};
	bool done = false;
	size_t ok_ecx = 0, ok_file = 0;
	char regurl[512] = "";
	char b[32];
	if (standalone) {
		step("starting the registry (ecx registry)");
		char *a[] = {"registry", "--bind", "127.0.0.1",
		             "--port",   "0",      NULL};
		char line[512];
		if (!proc_start(&reg, a) ||
		    !proc_line(&reg, line, sizeof(line), 10000) ||
		    sscanf(line, "listening on %511s", regurl) != 1) {
			tool_fail("demo", EXIT_FAIL,
			          "the registry did not start");
			goto out;
		}
	}
	fprintf(stderr,
	        "ecx demo: starting the producer (ecx serve): %zu items, %s\n",
	        count, tool_bytes(total, b, sizeof(b)));
	{
		char *a[24] = {
		    "serve",  "--bind",      "127.0.0.1",       "--workload",
		    "qwen",   "--count",     countstr,          "--capacity",
		    capacity, "--transport", (char *)transport, "--json"};
		int n = 12;
		if (standalone) {
			a[n++] = "--registry";
			a[n++] = regurl;
		} else {
			a[n++] = "--port";
			a[n++] = "0";
		}
		a[n] = NULL;
		if (!proc_start(&prod, a)) {
			tool_fail("demo", EXIT_FAIL, "cannot start ecx serve");
			goto out;
		}
		served = json_line(&prod, 120000, "ecx serve");
		if (served == NULL)
			goto out;
	}
	const cJSON *r = cJSON_GetObjectItemCaseSensitive(served, "registry");
	if (!cJSON_IsString(r))
		goto out;
	tool_strlcpy(regurl, r->valuestring, sizeof(regurl));
	fprintf(
	    stderr, "ecx demo: producer ready at %s, registry %s\n",
	    cJSON_GetObjectItemCaseSensitive(served, "producer")->valuestring,
	    regurl);
	/* The file baseline, on the same workload. */
	char dir[2048];
	struct stat sb;
	if (base == NULL)
		base = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
	snprintf(dir, sizeof(dir), "%s/ecx-demo-%ld", base, (long)getpid());
	if (mkdir(dir, 0700) != 0) {
		tool_fail("demo", EXIT_FAIL, "cannot create %s: %m", dir);
		goto out;
	}
	fprintf(stderr, "ecx demo: file baseline: saving %zu files in %s\n",
	        count, dir);
	double save_s = save_files(dir, count);
	if (save_s >= 0) {
		/* ecx, files, ecx, files: each pair in adjacent runs. */
		static const char *mem[2] = {"prefaulted", "fresh"};
		done = true;
		for (int k = 0; k < runs && done; k++) {
			for (int m = 0; m < 2 && done; m++) {
				fprintf(stderr,
				        "ecx demo: run %d/%d: loading with ecx "
				        "(ecx consume --verify --memory %s), "
				        "then the files in another process "
				        "(ecx consume --files)\n",
				        k + 1, runs, mem[m]);
				lr[m][k] = consume_run(regurl, NULL, batch,
				                       transport, mem[m]);
				fr[m][k] = lr[m][k] != NULL
				               ? consume_run(NULL, dir, batch,
				                             transport, mem[m])
				               : NULL;
				done = fr[m][k] != NULL;
			}
		}
	}
	remove_files(dir, count);
	if (!done)
		goto out;

	double put_s = num(served, "put_seconds");
	double bytes = num(served, "bytes");
	for (int m = 0; m < 2; m++) {
		int order[DEMO_RUNS_MAX];
		for (int k = 0; k < runs; k++) {
			double fs = num(fr[m][k], "seconds");
			double es = num(lr[m][k], "seconds");
			ratios[m][k] = fs > 0 && es > 0 ? fs / es : 0;
			ok_ecx += (size_t)num(lr[m][k], "verified");
			ok_file += (size_t)num(fr[m][k], "verified");
			order[k] = k;
		}
		/* Sorted by ratio (insertion: at most DEMO_RUNS_MAX). */
		for (int i = 1; i < runs; i++)
			for (int j = i; j > 0 && ratios[m][order[j - 1]] >
			                             ratios[m][order[j]];
			     j--) {
				int t = order[j];
				order[j] = order[j - 1];
				order[j - 1] = t;
			}
		int med = order[runs / 2];
		if (runs % 2 == 0) /* the lower of the middle two */
			med = order[runs / 2 - 1];
		ratio[m] = ratios[m][med];
		rmin[m] = ratios[m][order[0]];
		rmax[m] = ratios[m][order[runs - 1]];
		loaded[m] = lr[m][med];
		fileres[m] = fr[m][med];
	}
	if (json) {
		cJSON *o = cJSON_CreateObject(), *e = cJSON_CreateObject(),
		      *f = cJSON_CreateObject();
		cJSON_AddNumberToObject(o, "items", (double)count);
		cJSON_AddNumberToObject(o, "bytes", bytes);
		cJSON_AddNumberToObject(o, "batch", atof(batch));
		cJSON_AddNumberToObject(e, "save_gbps",
		                        put_s > 0 ? bytes / put_s / 1e9 : 0);
		cJSON_AddItemToObject(e, "load_prefaulted",
		                      loaded[0] != NULL
		                          ? cJSON_Duplicate(loaded[0], true)
		                          : cJSON_CreateNull());
		cJSON_AddItemToObject(e, "load_fresh",
		                      loaded[1] != NULL
		                          ? cJSON_Duplicate(loaded[1], true)
		                          : cJSON_CreateNull());
		cJSON_AddNumberToObject(f, "save_gbps",
		                        save_s > 0 ? bytes / save_s / 1e9 : 0);
		cJSON_AddItemToObject(f, "load_prefaulted",
		                      fileres[0] != NULL
		                          ? cJSON_Duplicate(fileres[0], true)
		                          : cJSON_CreateNull());
		cJSON_AddItemToObject(f, "load_fresh",
		                      fileres[1] != NULL
		                          ? cJSON_Duplicate(fileres[1], true)
		                          : cJSON_CreateNull());
		cJSON_AddItemToObject(o, "ecx", e);
		cJSON_AddItemToObject(o, "file", f);
		cJSON_AddNumberToObject(o, "runs", runs);
		cJSON_AddNumberToObject(o, "load_speedup_prefaulted", ratio[0]);
		cJSON_AddNumberToObject(o, "load_speedup_fresh", ratio[1]);
		static const char *rk[2] = {"load_speedups_prefaulted",
		                            "load_speedups_fresh"};
		for (int m = 0; m < 2; m++) {
			cJSON *a = cJSON_AddArrayToObject(o, rk[m]);
			for (int k = 0; a != NULL && k < runs; k++)
				cJSON_AddItemToArray(
				    a, cJSON_CreateNumber(ratios[m][k]));
		}
		char *s = cJSON_PrintUnformatted(o);
		if (s != NULL)
			printf("%s\n", s);
		free(s);
		cJSON_Delete(o);
	} else {
		static const char *title[2] = {
		    "Into pre-faulted memory, reused every batch (ecx: its "
		    "receive arena; file: a buffer faulted in before timing)",
		    "Into fresh memory: each item into memory never touched "
		    "before, every item kept (page faults timed on both "
		    "sides)"};
		static const char *who[2] = {"ecx (UCX, arena)",
		                             "ecx (UCX, caller memory)"};
		printf(
		    "\n%zu Qwen2.5-VL-shaped embeddings (bfloat16, 64-2691 x "
		    "3584), %s, %s per load, %d run%s (the tables: the median "
		    "run); save: ecx puts into its arena at %.2f GB/s, the "
		    "file baseline writes at %.2f GB/s\n",
		    count, tool_bytes((uint64_t)bytes, b, sizeof(b)), batch,
		    runs, runs > 1 ? "s" : "",
		    put_s > 0 ? bytes / put_s / 1e9 : 0,
		    save_s > 0 ? bytes / save_s / 1e9 : 0);
		for (int m = 0; m < 2; m++) {
			printf("\n%s\n", title[m]);
			printf("%-26s %10s %12s %12s %10s\n", "", "load GB/s",
			       "load p50 ms", "load p99 ms", "verified");
			printf("%-26s %10.2f %12.2f %12.2f %6zu/%zu\n", who[m],
			       num(loaded[m], "gbps"),
			       num(loaded[m], "batch_p50_ms"),
			       num(loaded[m], "batch_p99_ms"),
			       (size_t)num(loaded[m], "verified"), count);
			printf("%-26s %10.2f %12.2f %12.2f %6zu/%zu\n",
			       "file per item (shm)", num(fileres[m], "gbps"),
			       num(fileres[m], "batch_p50_ms"),
			       num(fileres[m], "batch_p99_ms"),
			       (size_t)num(fileres[m], "verified"), count);
		}
		printf("\n");
		static const char *into[2] = {"Into pre-faulted memory",
		                              "Into fresh memory"};
		for (int m = 0; m < 2; m++)
			demo_verdict(into[m], ratio[m], rmin[m], rmax[m], runs,
			             num(loaded[m], "seconds"),
			             num(fileres[m], "seconds"));
	}
	rc = ok_ecx == 2 * count * (size_t)runs &&
	             ok_file == 2 * count * (size_t)runs
	         ? EXIT_OK
	         : EXIT_FAIL;
out:
	if (prod.pid > 0) {
		int st = proc_stop(&prod, SIGTERM, 10000);
		/* ecx serve ends with 128 + the signal, once it unpublished */
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 128 + SIGTERM) {
			tool_fail("demo", EXIT_FAIL,
			          "the producer did not stop "
			          "cleanly");
			rc = EXIT_FAIL;
		}
	}
	if (reg.pid > 0)
		proc_stop(&reg, SIGTERM, 5000);
	cJSON_Delete(served);
	for (int m = 0; m < 2; m++)
		for (int k = 0; k < runs; k++) {
			cJSON_Delete(lr[m][k]);
			cJSON_Delete(fr[m][k]);
		}
	return rc;
}
