/* consume_list.c - `ecx consume`'s ids: every registry of the list
 * listed page by page, each id once with its largest listed size, and the
 * receive arena a batch of them needs (consume.h). */
#include "consume.h"

#include <stdlib.h>
#include <string.h>

static int keep_id(void *arg, const ecx_item *it)
{
	idlist *l = arg;
	if (l->n == l->cap) {
		size_t cap = l->cap ? l->cap * 2 : 256;
		listed *v = realloc(l->v, cap * sizeof(*v));
		if (v == NULL)
			return ECX_ENOMEM;
		l->v = v;
		l->cap = cap;
	}
	l->v[l->n].id = strdup(it->id);
	if (l->v[l->n].id == NULL)
		return ECX_ENOMEM;
	l->v[l->n++].nbytes = it->desc.nbytes;
	return 0;
}

void idlist_free(idlist *l)
{
	for (size_t i = 0; i < l->n; i++)
		free(l->v[i].id);
	free(l->v);
	*l = (idlist){0};
}

/* Lists one registry, page by page, into l: 0, or the error (l keeps
 * what came before it). */
static int list_one(ecx_client *c, idlist *l)
{
	char after[ECX_ID_MAX + 1] = "", next[ECX_ID_MAX + 1];
	for (;;) {
		int rc = ecx_client_list(c, after, 1000, keep_id, l, next,
		                         sizeof(next), NULL);
		if (rc != 0)
			return rc;
		if (next[0] == '\0')
			return 0;
		tool_strlcpy(after, next, sizeof(after));
	}
}

/* Orders ids, and of an id that several registries list the largest
 * size first. */
static int listed_order(const void *a, const void *b)
{
	const listed *x = a, *y = b;
	int c = strcmp(x->id, y->id);
	if (c != 0)
		return c;
	return x->nbytes > y->nbytes ? -1 : x->nbytes < y->nbytes;
}

int list_ids(char urls[][ECX_ADDR_MAX], size_t nurls, const tool_common *t,
             idlist *l)
{
	size_t failed = 0;
	for (size_t u = 0; u < nurls; u++) {
		ecx_client_params p = {.field_mask =
		                           ECX_CLIENT_PARAM_REGISTRY |
		                           ECX_CLIENT_PARAM_TOKEN |
		                           ECX_CLIENT_PARAM_TIMEOUT |
		                           ECX_CLIENT_PARAM_CONNECT_TIMEOUT,
		                       .registry = urls[u],
		                       .token = t->token,
		                       .timeout_ms = t->timeout_ms,
		                       .connect_timeout_ms = t->timeout_ms};
		ecx_client *c;
		char why[256];
		if (ecx_client_create(&p, &c, why, sizeof(why)) != 0) {
			idlist_free(l);
			return tool_fail("consume", EXIT_USAGE, "%s", why);
		}
		int rc = list_one(c, l);
		if (rc != 0)
			tool_strlcpy(why, ecx_last_error(), sizeof(why));
		ecx_client_destroy(c);
		if (rc == ECX_ENOMEM) {
			idlist_free(l);
			return tool_fail("consume", EXIT_FAIL, "out of memory");
		}
		if (rc != 0) {
			failed++;
			tool_fail("consume", EXIT_FAIL, "%s%s", why,
			          u + 1 < nurls
			              ? " (the next registries of the "
			                "list are still listed)"
			              : "");
		}
	}
	if (failed == nurls) {
		idlist_free(l);
		if (nurls == 1)
			return EXIT_FAIL;
		return tool_fail("consume", EXIT_FAIL,
		                 "none of the %zu registries could be listed",
		                 nurls);
	}
	/* Sorted, each id once with its largest listed size (an empty list
	 * has no array: qsort's must not be NULL). */
	if (l->n > 1)
		qsort(l->v, l->n, sizeof(*l->v), listed_order);
	size_t m = 0;
	for (size_t i = 0; i < l->n; i++) {
		if (m > 0 && strcmp(l->v[m - 1].id, l->v[i].id) == 0) {
			free(l->v[i].id);
			continue;
		}
		l->v[m++] = l->v[i];
	}
	l->n = m;
	return EXIT_OK;
}

uint64_t arena_size(const idlist *l, size_t batch)
{
	uint64_t *s = malloc((l->n ? l->n : 1) * sizeof(*s));
	uint64_t total = 0, largest = 0;
	if (s == NULL)
		return 0;
	for (size_t i = 0; i < l->n; i++)
		s[i] = (l->v[i].nbytes + 4095) / 4096 * 4096;
	/* The batch largest: a partial selection, batch is at most 256. */
	for (size_t k = 0; k < batch && k < l->n; k++) {
		size_t top = k;
		for (size_t i = k + 1; i < l->n; i++)
			if (s[i] > s[top])
				top = i;
		uint64_t v = s[top];
		s[top] = s[k];
		s[k] = v;
		total += v;
		if (v > largest)
			largest = v;
	}
	free(s);
	total += largest;
	return total < ((uint64_t)1 << 20) ? (uint64_t)1 << 20 : total;
}
