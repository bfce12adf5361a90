/* Fuzzes the registry entry decoder; a decoded entry must re-encode and
 * decode to itself and read the same through cJSON's tree (the reader
 * without a tree accepts nothing that cJSON reads otherwise), and its
 * encoding must be the bytes the tree codec prints. */
#include "wire/wire.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	ecx_entry e, back;
	char why[160];
	if (ecx_entry_decode((const char *)data, size, &e, why, sizeof(why)))
		return 0;
	/* cJSON refuses some valid JSON (numbers of 64 characters or more);
	 * what it reads, it must read alike. */
	cJSON *t = cJSON_ParseWithLength((const char *)data, size);
	memset(&back, 0, sizeof(back));
	if (t != NULL &&
	    (ecx_entry_from_json(t, &back, why, sizeof(why)) != 0 ||
	     memcmp(&e.desc, &back.desc, sizeof(e.desc)) != 0 ||
	     strcmp(e.producer_zmq, back.producer_zmq) != 0 ||
	     e.epoch != back.epoch || e.ttl_s != back.ttl_s ||
	     e.age_ms != back.age_ms))
		abort();
	cJSON_Delete(t);
	char *s = ecx_entry_encode(&e);
	if (s == NULL)
		return 0;
	t = ecx_entry_to_json(&e);
	char *ref = t != NULL ? cJSON_PrintUnformatted(t) : NULL;
	if (ref == NULL || strcmp(s, ref) != 0)
		abort();
	free(ref);
	cJSON_Delete(t);
	if (ecx_entry_decode(s, strlen(s), &back, why, sizeof(why)) != 0 ||
	    memcmp(&e.desc, &back.desc, sizeof(e.desc)) != 0 ||
	    strcmp(e.producer_zmq, back.producer_zmq) != 0 ||
	    e.epoch != back.epoch)
		abort();
	free(s);
	return 0;
}
