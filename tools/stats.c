/* stats.c - percentiles by sorting (sample counts are small). */
#include "stats.h"

#include <stdlib.h>

void samples_add(samples *s, uint64_t ns)
{
	if (s->n == s->cap) {
		size_t cap = s->cap ? s->cap * 2 : 256;
		uint64_t *v = realloc(s->v, cap * sizeof(*v));
		if (v == NULL)
			return;
		s->v = v;
		s->cap = cap;
	}
	s->v[s->n++] = ns;
}

static int u64_cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

uint64_t samples_pct(samples *s, double p)
{
	if (s->n == 0)
		return 0;
	qsort(s->v, s->n, sizeof(*s->v), u64_cmp);
	size_t rank = (size_t)(p / 100.0 * (double)s->n + 0.999999);
	if (rank < 1)
		rank = 1;
	if (rank > s->n)
		rank = s->n;
	return s->v[rank - 1];
}

void samples_free(samples *s)
{
	free(s->v);
	s->v = NULL;
	s->n = s->cap = 0;
}
