/* cmd_demo.c - `ecx demo`: the main job, end to end, beside the
 * file-per-item baseline, on one workload, in one run. */
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

static const char help[] =
    "usage: ecx demo [--count N] [--batch N] [--transport T]\n"
    "                [--standalone-registry] [--dir DIR] [--json]\n"
    "\n"
    "The main job in one command. It starts a producer ('ecx serve') with\n"
    "its embedded registry on 127.0.0.1, which puts N Qwen2.5-VL-shaped\n"
    "image embeddings (bfloat16, 64 to 2691 tokens x 3584) into its arena\n"
    "and publishes them; then a consumer process ('ecx consume') looks\n"
    "them up and loads them, BATCH per load, verifying every byte. Beside\n"
    "it, in the same run, the file-per-item approach of vLLM's\n"
    "ECExampleConnector: each tensor saved as a safetensors file into a\n"
    "shared folder in /dev/shm and loaded back by another process. It\n"
    "ends with a table of both.\n"
    "\n"
    "Options:\n"
    "  --count N              items (default 200)\n"
    "  --batch N              items per load (default 8)\n"
    "  --transport T          auto (default: shared memory here), tcp, shm\n"
    "  --standalone-registry  run the registry as a third process\n"
    "                         ('ecx registry') and publish to it\n"
    "  --dir DIR              folder for the file baseline (default\n"
    "                         /dev/shm, else /tmp)\n"
    "  --json                 print the results as JSON\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit codes: 0 every item moved and verified both ways, 1 otherwise.\n";

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

int cmd_demo(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"count", required_argument, NULL, 'n'},
	    {"batch", required_argument, NULL, 'b'},
	    {"transport", required_argument, NULL, 'T'},
	    {"standalone-registry", no_argument, NULL, 'S'},
	    {"dir", required_argument, NULL, 'd'},
	    {"json", no_argument, NULL, 'j'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	size_t count = 200;
	char batch[16] = "8", countstr[16];
	const char *transport = "auto", *base = NULL;
	bool standalone = false, json = false;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'n':
			count = strtoul(optarg, NULL, 10);
			if (count < 1 || count > 100000)
				return tool_fail("demo", EXIT_USAGE,
				                 "--count takes 1 to 100000");
			break;
		case 'b':
			if (atoi(optarg) < 1 || atoi(optarg) > 256)
				return tool_fail("demo", EXIT_USAGE,
				                 "--batch takes 1 to 256");
			snprintf(batch, sizeof(batch), "%d", atoi(optarg));
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
	proc reg = {0}, prod = {0}, cons = {0}, files = {0};
	cJSON *served = NULL, *loaded = NULL, *fileres = NULL;
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
	step("starting the consumer (ecx consume --verify)");
	{
		char *a[] = {
		    "consume",  regurl,   "--batch",     batch,
		    "--verify", "--json", "--transport", (char *)transport,
		    NULL};
		if (!proc_start(&cons, a))
			goto out;
		loaded = json_line(&cons, 300000, "ecx consume");
		int st = proc_stop(&cons, 0, 10000);
		if (loaded == NULL || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			tool_fail("demo", EXIT_FAIL, "the consumer failed");
			goto out;
		}
	}
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
		step("file baseline: loading them in another process");
		char *a[] = {"consume", "--files",  dir,      "--batch",
		             batch,     "--verify", "--json", NULL};
		if (proc_start(&files, a)) {
			fileres =
			    json_line(&files, 300000, "ecx consume --files");
			proc_stop(&files, 0, 10000);
		}
	}
	remove_files(dir, count);
	if (fileres == NULL)
		goto out;

	double put_s = num(served, "put_seconds");
	double bytes = num(served, "bytes");
	size_t ok_ecx = (size_t)num(loaded, "verified");
	size_t ok_file = (size_t)num(fileres, "verified");
	double speedup =
	    num(fileres, "seconds") > 0 && num(loaded, "seconds") > 0
	        ? num(fileres, "seconds") / num(loaded, "seconds")
	        : 0;
	if (json) {
		char *l = cJSON_PrintUnformatted(loaded);
		char *f = cJSON_PrintUnformatted(fileres);
		printf("{\"items\": %zu, \"bytes\": %.0f, \"batch\": %s, "
		       "\"ecx\": {\"save_gbps\": %.3f, \"load\": %s}, "
		       "\"file\": {\"save_gbps\": %.3f, \"load\": %s}, "
		       "\"load_speedup\": %.2f}\n",
		       count, bytes, batch, put_s > 0 ? bytes / put_s / 1e9 : 0,
		       l != NULL ? l : "null",
		       save_s > 0 ? bytes / save_s / 1e9 : 0,
		       f != NULL ? f : "null", speedup);
		free(l);
		free(f);
	} else {
		printf(
		    "\n%zu Qwen2.5-VL-shaped embeddings (bfloat16, 64-2691 x "
		    "3584), %s, %s per load, one run\n\n",
		    count, tool_bytes((uint64_t)bytes, b, sizeof(b)), batch);
		printf("%-22s %10s %10s %12s %12s %10s\n", "", "save GB/s",
		       "load GB/s", "load p50 ms", "load p99 ms", "verified");
		printf("%-22s %10.2f %10.2f %12.2f %12.2f %6zu/%zu\n",
		       "ecx (UCX, arena)", put_s > 0 ? bytes / put_s / 1e9 : 0,
		       num(loaded, "gbps"), num(loaded, "batch_p50_ms"),
		       num(loaded, "batch_p99_ms"), ok_ecx, count);
		printf("%-22s %10.2f %10.2f %12.2f %12.2f %6zu/%zu\n",
		       "file per item (shm)",
		       save_s > 0 ? bytes / save_s / 1e9 : 0,
		       num(fileres, "gbps"), num(fileres, "batch_p50_ms"),
		       num(fileres, "batch_p99_ms"), ok_file, count);
		printf("\necx loads the workload %.1fx as fast as the file "
		       "baseline (total load time %.3f s vs %.3f s).\n",
		       speedup, num(loaded, "seconds"),
		       num(fileres, "seconds"));
	}
	rc = ok_ecx == count && ok_file == count ? EXIT_OK : EXIT_FAIL;
out:
	if (prod.pid > 0) {
		int st = proc_stop(&prod, SIGTERM, 10000);
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			tool_fail("demo", EXIT_FAIL,
			          "the producer did not stop "
			          "cleanly");
			rc = EXIT_FAIL;
		}
	}
	if (reg.pid > 0)
		proc_stop(&reg, SIGTERM, 5000);
	cJSON_Delete(served);
	cJSON_Delete(loaded);
	cJSON_Delete(fileres);
	return rc;
}
