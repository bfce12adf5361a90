/* Fuzzes the registry entry decoder; a decoded entry must re-encode and
 * decode to itself. */
#include "wire/wire.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	ecx_entry e, back;
	char why[160];
	if (ecx_entry_decode((const char *)data, size, &e, why, sizeof(why)))
		return 0;
	char *s = ecx_entry_encode(&e);
	if (s == NULL)
		return 0;
	if (ecx_entry_decode(s, strlen(s), &back, why, sizeof(why)) != 0 ||
	    memcmp(&e.desc, &back.desc, sizeof(e.desc)) != 0 ||
	    strcmp(e.producer_zmq, back.producer_zmq) != 0 ||
	    e.epoch != back.epoch)
		abort();
	free(s);
	return 0;
}
