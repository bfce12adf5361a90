/* Fuzzes ecx's pull request and reply decoders. A decoded request must
 * keep every item inside its region, and re-encode to itself (its hash
 * kind and landed ask included); a decoded reply must re-encode to one
 * with the same statuses and the same hashes, of the same kind. */
#include "wire/wire.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char why[160];
	ecx_pull_req r;
	if (ecx_pull_req_decode((const char *)data, size, &r, why, 160) == 0) {
		for (size_t i = 0; i < r.nitems; i++) {
			const ecx_pull_item *it = &r.items[i];
			const ecx_region *g = &r.regions[it->region];
			if (it->region >= r.nregions || it->addr < g->base ||
			    it->addr + it->nbytes > g->base + g->len)
				abort();
		}
		char *s = ecx_pull_req_encode(&r);
		ecx_pull_req back;
		if (s == NULL ||
		    ecx_pull_req_decode(s, strlen(s), &back, why, 160) != 0 ||
		    back.nitems != r.nitems || back.nregions != r.nregions ||
		    back.hash != r.hash || back.landed != r.landed)
			abort();
		ecx_pull_req_free(&back);
		free(s);
		ecx_pull_req_free(&r);
	}
	ecx_pull_resp p;
	if (ecx_pull_resp_decode((const char *)data, size, &p, why, 160) == 0) {
		for (size_t i = 0; i < p.nitems; i++)
			if (p.status[i] > 0)
				abort();
		/* Only ok items carry a hash on the way out. */
		for (size_t i = 0; p.has_hash != NULL && i < p.nitems; i++)
			if (p.status[i] != 0)
				p.has_hash[i] = 0;
		if (p.err == 0) {
			char *s = ecx_pull_resp_encode(&p);
			ecx_pull_resp back;
			if (s == NULL ||
			    ecx_pull_resp_decode(s, strlen(s), &back, why,
			                         160) != 0 ||
			    back.nitems != p.nitems)
				abort();
			for (size_t i = 0; i < p.nitems; i++) {
				bool had = p.has_hash != NULL && p.has_hash[i];
				bool has =
				    back.has_hash != NULL && back.has_hash[i];
				if (back.status[i] != p.status[i] ||
				    had != has ||
				    (had && (back.hash[i] != p.hash[i] ||
				             back.hash_kind != p.hash_kind)))
					abort();
			}
			ecx_pull_resp_free(&back);
			free(s);
		}
		ecx_pull_resp_free(&p);
	}
	return 0;
}
