/* bench_integrity.c - the price of integrity in `ecx bench transfer`:
 * the `hash` rows. */
#include "tool.h"

#include "bench.h"
#include "stats.h"

#include <stdio.h>
#include <string.h>

bool bench_integrity(const bench_opts *o, ecx_consumer *plain,
                     ecx_consumer *hashed, const char *label, const char *json,
                     int s, int nb)
{
	if (nb < 1 || nb > INTEGRITY_MAXBATCH)
		return tool_fail("bench", EXIT_FAIL,
		                 "integrity row: %d items, not 1 to %d", nb,
		                 INTEGRITY_MAXBATCH) == 0;
	size_t sz = size_bytes(s), bytes = sz * (size_t)nb;
	int iters = block_iters(o, bytes), R = nreps(o);
	ecx_consumer *cs[2] = {plain, hashed};
	ecx_item it[2][INTEGRITY_MAXBATCH];
	char ids[INTEGRITY_MAXBATCH][64];
	reps gb[2], ratio = {0};
	memset(gb, 0, sizeof(gb));
	bool ok = true;
	memset(it, 0, sizeof(it));
	for (int w = 0; w < 2; w++)
		for (int k = 0; k < nb; k++) {
			snprintf(ids[k], sizeof(ids[k]), "%s-%d", sizes[s].name,
			         k);
			it[w][k].id = ids[k];
		}
	for (int w = 0; w < 2 && ok; w++) {
		ok = ecx_consumer_lookup(cs[w], it[w], (size_t)nb) == 0;
		for (int k = 0; k < nb && ok; k++)
			ok = (it[w][k].dst = ecx_consumer_alloc(cs[w], sz)) !=
			     NULL;
		/* untimed: the first load registers nothing new, but
		 * connects */
		ok = ok && ecx_consumer_load(cs[w], it[w], (size_t)nb) == 0;
	}
	for (int r = 0; r < R && ok; r++) {
		double g[2];
		for (int j = 0; j < 2 && ok; j++) {
			int w = (j + r) % 2; /* in turn first */
			samples sm = {0};
			for (int i = 0; i < iters && ok; i++) {
				uint64_t t0 = tool_now_ns();
				ok = ecx_consumer_load(cs[w], it[w],
				                       (size_t)nb) == 0;
				samples_add(&sm, tool_now_ns() - t0);
			}
			g[w] = (double)bytes / (double)samples_pct(&sm, 50);
			reps_add(&gb[w], g[w]);
			samples_free(&sm);
		}
		if (ok)
			reps_add(&ratio, g[1] / g[0]);
	}
	if (!ok)
		tool_fail("bench", EXIT_FAIL, "integrity row: %s",
		          ecx_last_error());
	for (int w = 0; w < 2; w++)
		for (int k = 0; k < nb; k++)
			if (it[w][k].dst != NULL)
				ecx_consumer_free(cs[w], it[w][k].dst);
	if (!ok)
		return false;
	char buf[96];
	if (o->json)
		row_json("transfer", "integrity",
		         "\"via\": \"%s\", \"size\": \"%s\", \"batch\": %d, "
		         "\"gbps_checking\": %.3f, \"gbps_plain\": %.3f, "
		         "\"ratio\": %.3f, \"ratio_min\": %.3f, "
		         "\"ratio_max\": %.3f, \"reps\": %d",
		         json, sizes[s].name, nb, reps_med(&gb[1]),
		         reps_med(&gb[0]), reps_med(&ratio), reps_min(&ratio),
		         reps_max(&ratio), R);
	else
		printf("  %-4s %6s x%-3d %-4s %8.2f %9s %9s %9.2f   %s "
		       "(integrity: checking XXH3 vs not)\n",
		       label, sizes[s].name, nb, "hash", reps_med(&gb[1]), "",
		       "", reps_med(&gb[0]),
		       fmt_reps(&ratio, 2, buf, sizeof(buf)));
	fflush(stdout);
	return true;
}
