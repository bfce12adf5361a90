/* bench_file.c - the file benchmark (`ecx bench file`): a file per item. */
#include "tool.h"

#include "bench.h"
#include "gen.h"
#include "safetensors.h"
#include "stats.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- file baseline ---- */

static volatile unsigned char copy_sink;

/* Reads the copy back so the compiler cannot drop a memcpy into memory
 * that is freed right after it. */
static void keep_copy(const void *p, size_t n)
{
	const volatile unsigned char *c = p;
	copy_sink ^= c[0] ^ c[n / 2] ^ c[n - 1];
}

int bench_file(const bench_opts *o)
{
	struct stat sb;
	const char *base = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
	char dir[256];
	snprintf(dir, sizeof(dir), "%s/ecx-bench-%ld", base, (long)getpid());
	if (mkdir(dir, 0700) != 0)
		return tool_fail("bench", EXIT_FAIL, "cannot create %s", dir);
	int R = nreps(o);
	if (!o->json)
		printf("file: one safetensors file per item in %s (vLLM's "
		       "ECExampleConnector), loaded (open, parse, malloc, "
		       "read); baseline: malloc and memcpy of the same size; "
		       "%d repetitions of (memcpy block, file block)\n"
		       "  %6s %10s %10s %12s %12s   %s\n",
		       base, R, "item", "save GB/s", "load GB/s", "load p50 us",
		       "memcpy GB/s", "ratio");
	int rc = EXIT_OK;
	void *buf = malloc(7u << 20);
	for (int s = 0; s < NSIZES && rc == EXIT_OK; s++) {
		uint64_t dims[2] = {sizes[s].rows, sizes[s].cols};
		ecx_tensor_desc d;
		ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
		gen_fill(sizes[s].name, buf, d.nbytes);
		samples sv = {0}, lat = {0};
		reps lg = {0}, mg = {0}, ratio = {0};
		int iters = o->quick ? 5 : 20;
		char path[512], why[256];
		for (int i = 0; i < iters; i++) {
			snprintf(path, sizeof(path), "%s/%s-%d.safetensors",
			         dir, sizes[s].name, i);
			uint64_t t0 = tool_now_ns();
			if (st_save(path, &d, buf, why, sizeof(why)) != 0)
				rc = tool_fail("bench", EXIT_FAIL, "%s", why);
			samples_add(&sv, tool_now_ns() - t0);
		}
		/* The memcpy baseline copies from as many buffers as there
		 * are files, as the loader reads them: one buffer would stay
		 * in the CPU's cache, the files (20 x 7 MiB) do not. */
		char *srcs = malloc((size_t)iters * d.nbytes);
		if (srcs == NULL)
			rc = tool_fail("bench", EXIT_FAIL, "out of memory");
		for (int i = 0; i < iters && srcs != NULL; i++)
			memcpy(srcs + (size_t)i * d.nbytes, buf, d.nbytes);
		for (int r = 0; r < R && rc == EXIT_OK; r++) {
			samples m = {0}, l = {0};
			for (int i = 0; i < iters; i++) {
				/* Into memory got as the loader gets it. */
				uint64_t t0 = tool_now_ns();
				void *dst = malloc(d.nbytes);
				if (dst == NULL)
					break;
				memcpy(dst, srcs + (size_t)i * d.nbytes,
				       d.nbytes);
				samples_add(&m, tool_now_ns() - t0);
				keep_copy(dst, d.nbytes);
				free(dst);
			}
			for (int i = 0; i < iters && rc == EXIT_OK; i++) {
				snprintf(path, sizeof(path),
				         "%s/%s-%d.safetensors", dir,
				         sizes[s].name, i);
				void *back = NULL;
				ecx_tensor_desc bd;
				uint64_t t0 = tool_now_ns();
				int e =
				    st_load(path, &bd, &back, why, sizeof(why));
				uint64_t dt = tool_now_ns() - t0;
				samples_add(&l, dt);
				samples_add(&lat, dt);
				if (e != 0 ||
				    !gen_check(sizes[s].name, back, bd.nbytes))
					rc =
					    tool_fail("bench", EXIT_FAIL,
					              "file baseline: %s", why);
				free(back);
			}
			if (rc == EXIT_OK && m.n > 0) {
				double a = (double)d.nbytes /
				           (double)samples_pct(&m, 50);
				double b = (double)d.nbytes /
				           (double)samples_pct(&l, 50);
				reps_add(&mg, a);
				reps_add(&lg, b);
				reps_add(&ratio, b / a);
			}
			samples_free(&m);
			samples_free(&l);
		}
		free(srcs);
		for (int i = 0; i < iters; i++) {
			snprintf(path, sizeof(path), "%s/%s-%d.safetensors",
			         dir, sizes[s].name, i);
			unlink(path);
		}
		double sg = (double)d.nbytes / (double)samples_pct(&sv, 50);
		double lp = (double)samples_pct(&lat, 50) / 1e3;
		char rb[96];
		if (rc == EXIT_OK && o->json)
			row_json(
			    "file", sizes[s].name,
			    "\"save_gbps\": %.3f, \"load_gbps\": %.3f, "
			    "\"load_p50_us\": %.1f, \"memcpy_gbps\": %.3f, "
			    "\"ratio\": %.3f, \"ratio_min\": %.3f, "
			    "\"ratio_max\": %.3f",
			    sg, reps_med(&lg), lp, reps_med(&mg),
			    reps_med(&ratio), reps_min(&ratio),
			    reps_max(&ratio));
		else if (rc == EXIT_OK)
			printf("  %6s %10.2f %10.2f %12.1f %12.2f   %s\n",
			       sizes[s].name, sg, reps_med(&lg), lp,
			       reps_med(&mg),
			       fmt_reps(&ratio, 2, rb, sizeof(rb)));
		samples_free(&sv);
		samples_free(&lat);
	}
	free(buf);
	rmdir(dir);
	return rc;
}
