/* Fuzzes the batched lookup request and reply decoders; what they accept
 * must encode and decode back to the same answer. */
#include "wire/wire.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char why[160];
	ecx_idlist l;
	if (ecx_lookup_req_decode((const char *)data, size, &l, why,
	                          sizeof(why)) == 0) {
		const char **ids = malloc((l.n + 1) * sizeof(*ids));
		for (size_t i = 0; i < l.n; i++)
			ids[i] = l.ids[i];
		char *s = ecx_lookup_req_encode_lease(ids, l.n, l.lease_ms);
		ecx_idlist back;
		if (s == NULL ||
		    ecx_lookup_req_decode(s, strlen(s), &back, why, 160) != 0 ||
		    back.n != l.n || back.lease_ms != l.lease_ms)
			abort();
		for (size_t i = 0; i < l.n; i++)
			if (strcmp(back.ids[i], l.ids[i]) != 0)
				abort();
		free(back.ids);
		free(s);
		free(ids);
		free(l.ids);
	}
	ecx_lookup_item items[3] = {{.id = "a"}, {.id = "b"}, {.id = "a"}};
	if (ecx_lookup_resp_decode((const char *)data, size, items, 3, why,
	                           sizeof(why)) == 0) {
		char *s = ecx_lookup_resp_encode(items, 3);
		ecx_lookup_item back[3] = {
		    {.id = "a"}, {.id = "b"}, {.id = "a"}};
		if (s == NULL || ecx_lookup_resp_decode(s, strlen(s), back, 3,
		                                        why, 160) != 0)
			abort();
		for (int i = 0; i < 3; i++)
			if (back[i].found != items[i].found ||
			    back[i].nalt != items[i].nalt ||
			    (items[i].found &&
			     memcmp(&back[i].entry.desc, &items[i].entry.desc,
			            sizeof(items[i].entry.desc)) != 0))
				abort();
		ecx_lookup_items_clear(back, 3);
		free(s);
	}
	ecx_lookup_items_clear(items, 3);
	return 0;
}
