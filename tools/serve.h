/* serve.h - what `ecx serve`'s parts share: its options and the state of
 * its put phase (cmd_serve.c: options, start and run; serve_items.c: the
 * items it is given or generates, put into the producer). */
#ifndef ECX_TOOLS_SERVE_H
#define ECX_TOOLS_SERVE_H

#include "ecx/ecx.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct serve_opts {
	ecx_producer_params p;
	uint64_t synthetic, count;
	const char *workload, *prefix, *shape, *dtype;
	bool json;
} serve_opts;

/* What the put phase did, for the ready line; and the signal that stopped
 * it, if one did. */
typedef struct serve_run {
	ecx_producer *prod;
	const char *registry; /* --registry as printed (its password masked:
	                         tool_mask), NULL for the embedded one */
	uint64_t put, put_bytes;
	uint64_t put_ns;
	/* The sizes of the latest puts, a ring as long as the arena holds
	 * items: eviction takes the least recently used, so the items kept
	 * are the latest put (pulls before the ready line aside). */
	uint64_t *sizes;
	size_t nsizes;
	bool waited; /* for the registry */
	int sig;
} serve_run;

/* Parses AxBxC strictly (digits only); false for anything else. */
bool parse_shape(const char *s, uint64_t *dims, uint32_t *nd);
/* serve_items.c: an item read from path (.npy, or raw bytes with --shape
 * and --dtype), the files given, and the --synthetic or --workload items,
 * each put (r counts them; 0 or an exit code). */
int read_item(const char *path, const serve_opts *o, bool generated,
              ecx_tensor_desc *d, void **data);
int serve_files(serve_run *r, int n, char **files, const serve_opts *o);
int serve_generated(serve_run *r, const serve_opts *o);

#endif
