/* consume.h - what `ecx consume` loads from registries: the ids they list
 * (consume_list.c), and the receive arena those ids need. */
#ifndef ECX_TOOL_CONSUME_H
#define ECX_TOOL_CONSUME_H

#include "tool.h"

/* The ids listed, with each item's size as listed (for the arena). */
typedef struct listed {
	char *id;
	uint64_t nbytes;
} listed;

typedef struct idlist {
	listed *v;
	size_t n, cap;
} idlist;

void idlist_free(idlist *l);

/* Every id the registries list (each of urls in turn, as 'ecx ls'
 * does), each once, sorted; a registry that fails is said on stderr and
 * the others are still listed. Returns EXIT_OK with l filled (empty when
 * they list nothing), or the exit code when every registry failed or a
 * URL is bad (said). */
int list_ids(char urls[][ECX_ADDR_MAX], size_t nurls, const tool_common *t,
             idlist *l);

/* The receive arena for --memory prefaulted: room for a batch of the
 * largest items listed, each rounded up to the arena's 4 KiB ranges, and
 * as much again of the largest for ranges a timed-out pull keeps out of
 * use a while (the 512 MiB it had fixed before refused larger items).
 * 0 when out of memory. */
uint64_t arena_size(const idlist *l, size_t batch);

#endif
