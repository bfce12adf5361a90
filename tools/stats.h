/* stats.h - samples and percentiles for the benchmarks and the demo. */
#ifndef ECX_TOOL_STATS_H
#define ECX_TOOL_STATS_H

#include <stddef.h>
#include <stdint.h>

typedef struct samples {
	uint64_t *v; /* nanoseconds */
	size_t n, cap;
} samples;

void samples_add(samples *s, uint64_t ns);
/* The p-th percentile (0..100), nearest rank; 0 when empty. Sorts. */
uint64_t samples_pct(samples *s, double p);
void samples_free(samples *s);

#endif
