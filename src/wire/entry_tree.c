/* entry_tree.c - the registry entry as a cJSON tree, for the listing
 * (GET /ec/list); entry.c writes and reads the same entry without one. */
#include "wire.h"

#include <string.h>

cJSON *ecx_entry_to_json(const ecx_entry *e)
{
	cJSON *o = cJSON_CreateObject();
	cJSON *shape = cJSON_CreateArray();
	if (o == NULL || shape == NULL)
		goto fail;
	cJSON_AddItemToObject(o, "nbytes", ecx_json_u64(e->desc.nbytes));
	cJSON_AddItemToObject(o, "shape", shape);
	for (uint32_t i = 0; i < e->desc.ndim && i < ECX_MAX_DIMS; i++)
		cJSON_AddItemToArray(shape, ecx_json_u64(e->desc.shape[i]));
	const char *dt = core_dtype_name(e->desc.dtype);
	cJSON_AddStringToObject(o, "dtype", dt != NULL ? dt : "invalid");
	cJSON_AddStringToObject(o, "producer_zmq", e->producer_zmq);
	if (e->epoch != 0)
		cJSON_AddItemToObject(o, "ecx_epoch", ecx_json_u64(e->epoch));
	if (e->ttl_s != 0)
		cJSON_AddItemToObject(o, "ecx_ttl_s", ecx_json_u64(e->ttl_s));
	if (e->age_ms != 0)
		cJSON_AddItemToObject(o, "ecx_age_ms", ecx_json_u64(e->age_ms));
	if (e->lease != 0)
		cJSON_AddItemToObject(o, "ecx_lease", ecx_json_u64(e->lease));
	/* cJSON reports allocation failures only through missing children. */
	if (cJSON_GetArraySize(o) < 4 ||
	    cJSON_GetArraySize(shape) != (int)e->desc.ndim)
		goto fail;
	return o;
fail:
	cJSON_Delete(o);
	if (o == NULL)
		cJSON_Delete(shape);
	return NULL;
}

int ecx_entry_from_json(const cJSON *o, ecx_entry *out, char *why,
                        size_t whylen)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	if (!cJSON_IsObject(o))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "entry is not an object");
	int rc = ecx_json_get_u64(o, "nbytes", &e.desc.nbytes, why, whylen);
	if (rc != 0)
		return rc;
	const cJSON *shape = cJSON_GetObjectItemCaseSensitive(o, "shape");
	if (shape == NULL)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "missing field \"shape\"");
	if (!cJSON_IsArray(shape))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"shape\" is not an array");
	int nd = cJSON_GetArraySize(shape);
	if (nd > ECX_MAX_DIMS)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"shape\" has %d dimensions; at most %d", nd,
		               ECX_MAX_DIMS);
	e.desc.ndim = (uint32_t)nd;
	int i = 0;
	const cJSON *d;
	cJSON_ArrayForEach (d, shape) {
		if (!cJSON_IsNumber(d) || d->valuedouble < 0 ||
		    d->valuedouble != (double)(uint64_t)d->valuedouble ||
		    d->valuedouble >= (double)ECX_JSON_INT_MAX)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "\"shape\"[%d] is not a non-negative "
			               "integer below 2^53",
			               i);
		e.desc.shape[i++] = (uint64_t)d->valuedouble;
	}
	char dt[32];
	rc = ecx_json_get_str(o, "dtype", dt, sizeof(dt), why, whylen);
	if (rc != 0)
		return rc;
	if (core_dtype_parse(dt, &e.desc.dtype) != 0)
		return ecx_why(why, whylen, ECX_EDTYPE, "unknown dtype \"%s\"",
		               dt);
	rc = core_tensor_check(&e.desc, why, whylen);
	if (rc != 0)
		return rc;
	rc = ecx_json_get_str(o, "producer_zmq", e.producer_zmq,
	                      sizeof(e.producer_zmq), why, whylen);
	if (rc != 0)
		return rc;
	if (e.producer_zmq[0] == '\0')
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"producer_zmq\" is empty");
	if (cJSON_GetObjectItemCaseSensitive(o, "ecx_epoch") != NULL) {
		rc = ecx_json_get_u64(o, "ecx_epoch", &e.epoch, why, whylen);
		if (rc != 0)
			return rc;
	}
	if (cJSON_GetObjectItemCaseSensitive(o, "ecx_ttl_s") != NULL) {
		uint64_t t = 0;
		rc = ecx_json_get_u64(o, "ecx_ttl_s", &t, why, whylen);
		if (rc != 0)
			return rc;
		if (t > ECX_TTL_MAX_S)
			return ecx_why(why, whylen, ECX_EPROTO,
			               "\"ecx_ttl_s\" is over %d",
			               ECX_TTL_MAX_S);
		e.ttl_s = (uint32_t)t;
	}
	if (cJSON_GetObjectItemCaseSensitive(o, "ecx_age_ms") != NULL) {
		rc = ecx_json_get_u64(o, "ecx_age_ms", &e.age_ms, why, whylen);
		if (rc != 0)
			return rc;
	}
	if (cJSON_GetObjectItemCaseSensitive(o, "ecx_lease") != NULL) {
		rc = ecx_json_get_u64(o, "ecx_lease", &e.lease, why, whylen);
		if (rc != 0)
			return rc;
	}
	*out = e;
	return 0;
}
