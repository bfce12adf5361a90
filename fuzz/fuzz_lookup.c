/* Fuzzes the batched lookup request and reply decoders. */
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
		free(back.ids);
		free(s);
		free(ids);
		free(l.ids);
	}
	ecx_lookup_item items[3] = {{.id = "a"}, {.id = "b"}, {.id = "a"}};
	ecx_lookup_resp_decode((const char *)data, size, items, 3, why,
	                       sizeof(why));
	ecx_lookup_items_clear(items, 3);
	return 0;
}
