/* entry.c - the registry entry and the batched lookup. */
#include "wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int ecx_json_id(const cJSON *n, const char *what, char *out, char *why,
                size_t whylen);

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
	const char *dt = ecx_dtype_name(e->desc.dtype);
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

static char *json_print_free(cJSON *o)
{
	if (o == NULL)
		return NULL;
	char *s = cJSON_PrintUnformatted(o);
	cJSON_Delete(o);
	return s;
}

char *ecx_entry_encode(const ecx_entry *e)
{
	return json_print_free(ecx_entry_to_json(e));
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
	if (ecx_dtype_parse(dt, &e.desc.dtype) != 0)
		return ecx_why(why, whylen, ECX_EDTYPE, "unknown dtype \"%s\"",
		               dt);
	rc = ecx_tensor_check(&e.desc, why, whylen);
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

int ecx_entry_decode(const char *buf, size_t len, ecx_entry *out, char *why,
                     size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_ENTRY_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_ENTRY_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	int rc = ecx_entry_from_json(o, out, why, whylen);
	cJSON_Delete(o);
	return rc;
}

void ecx_lookup_items_clear(ecx_lookup_item *items, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		free(items[i].alt);
		items[i].alt = NULL;
		items[i].nalt = 0;
	}
}

char *ecx_lookup_req_encode(const char *const *ids, size_t n)
{
	return ecx_lookup_req_encode_lease(ids, n, 0);
}

char *ecx_lookup_req_encode_lease(const char *const *ids, size_t n,
                                  uint64_t lease_ms)
{
	cJSON *o = cJSON_CreateObject();
	cJSON *arr = cJSON_AddArrayToObject(o, "ids");
	if (arr == NULL) {
		cJSON_Delete(o);
		return NULL;
	}
	if (lease_ms != 0 &&
	    !cJSON_AddItemToObject(o, "ecx_lease_ms", ecx_json_u64(lease_ms))) {
		cJSON_Delete(o);
		return NULL;
	}
	for (size_t i = 0; i < n; i++) {
		cJSON *s = cJSON_CreateString(ids[i]);
		if (s == NULL) {
			cJSON_Delete(o);
			return NULL;
		}
		cJSON_AddItemToArray(arr, s);
	}
	return json_print_free(o);
}

int ecx_lookup_req_decode(const char *buf, size_t len, ecx_idlist *out,
                          char *why, size_t whylen)
{
	cJSON *o = ecx_json_parse(buf, len, ECX_WIRE_MAX, why, whylen);
	if (o == NULL)
		return len > ECX_WIRE_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	int rc = 0;
	ecx_idlist l = {0, NULL, 0};
	if (cJSON_GetObjectItemCaseSensitive(o, "ecx_lease_ms") != NULL) {
		rc = ecx_json_get_u64(o, "ecx_lease_ms", &l.lease_ms, why,
		                      whylen);
		if (rc != 0)
			goto out;
	}
	const cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "ids");
	if (arr == NULL) {
		rc = ecx_why(why, whylen, ECX_EPROTO, "missing field \"ids\"");
		goto out;
	}
	if (!cJSON_IsArray(arr)) {
		rc =
		    ecx_why(why, whylen, ECX_EPROTO, "\"ids\" is not an array");
		goto out;
	}
	int n = cJSON_GetArraySize(arr);
	if (n > ECX_LOOKUP_MAX_IDS) {
		rc = ecx_why(why, whylen, ECX_ETOOBIG,
		             "%d ids in one lookup; at most %d", n,
		             ECX_LOOKUP_MAX_IDS);
		goto out;
	}
	l.ids = calloc(n > 0 ? (size_t)n : 1, sizeof(*l.ids));
	if (l.ids == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		goto out;
	}
	const cJSON *s;
	cJSON_ArrayForEach (s, arr) {
		char what[32];
		snprintf(what, sizeof(what), "\"ids\"[%zu]", l.n);
		rc = ecx_json_id(s, what, l.ids[l.n], why, whylen);
		if (rc != 0) {
			free(l.ids);
			goto out;
		}
		l.n++;
	}
	*out = l;
out:
	cJSON_Delete(o);
	return rc;
}

static int item_ptr_cmp(const void *a, const void *b)
{
	const ecx_lookup_item *x = *(const ecx_lookup_item *const *)a;
	const ecx_lookup_item *y = *(const ecx_lookup_item *const *)b;
	int c = strcmp(x->id, y->id);
	return c != 0 ? c : (x < y ? -1 : x > y);
}

char *ecx_lookup_resp_encode(const ecx_lookup_item *items, size_t n)
{
	/* Each distinct id is answered once, however often it was asked. */
	const ecx_lookup_item **order = malloc((n + 1) * sizeof(*order));
	bool *dup = calloc(n + 1, sizeof(*dup));
	if (order == NULL || dup == NULL) {
		free(order);
		free(dup);
		return NULL;
	}
	for (size_t i = 0; i < n; i++)
		order[i] = &items[i];
	qsort(order, n, sizeof(*order), item_ptr_cmp);
	for (size_t i = 1; i < n; i++)
		if (strcmp(order[i]->id, order[i - 1]->id) == 0)
			dup[order[i] - items] = true;
	free(order);
	cJSON *o = cJSON_CreateObject();
	cJSON *found = cJSON_AddObjectToObject(o, "found");
	cJSON *missing = cJSON_AddArrayToObject(o, "missing");
	cJSON *holders = NULL;
	if (found == NULL || missing == NULL)
		goto fail;
	for (size_t i = 0; i < n; i++) {
		if (dup[i])
			continue;
		cJSON *c = items[i].found ? ecx_entry_to_json(&items[i].entry)
		                          : cJSON_CreateString(items[i].id);
		if (c == NULL)
			goto fail;
		if (items[i].found)
			cJSON_AddItemToObject(found, items[i].id, c);
		else
			cJSON_AddItemToArray(missing, c);
		if (!items[i].found || items[i].nalt == 0)
			continue;
		/* Several holders: all of them, for clients that fail over
		 * (the reference's clients read "found" only). */
		if (holders == NULL)
			holders = cJSON_AddObjectToObject(o, "ecx_holders");
		cJSON *arr = cJSON_CreateArray();
		if (holders == NULL || arr == NULL) {
			cJSON_Delete(arr);
			goto fail;
		}
		cJSON_AddItemToObject(holders, items[i].id, arr);
		cJSON_AddItemToArray(arr, ecx_entry_to_json(&items[i].entry));
		for (uint32_t k = 0;
		     k < items[i].nalt && k < ECX_HOLDERS_MAX - 1; k++)
			cJSON_AddItemToArray(
			    arr, ecx_entry_to_json(&items[i].alt[k]));
		if (cJSON_GetArraySize(arr) != (int)items[i].nalt + 1)
			goto fail;
	}
	free(dup);
	return json_print_free(o);
fail:
	free(dup);
	cJSON_Delete(o);
	return NULL;
}

/* The first of ord[0..n) (sorted by id) whose id is not below id. */
static size_t item_lower(ecx_lookup_item **ord, size_t n, const char *id)
{
	size_t lo = 0, hi = n;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (strcmp(ord[mid]->id, id) < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

int ecx_lookup_resp_decode(const char *buf, size_t len, ecx_lookup_item *items,
                           size_t n, char *why, size_t whylen)
{
	/* Output only: what items held before is not freed here. */
	for (size_t i = 0; i < n; i++) {
		items[i].alt = NULL;
		items[i].nalt = 0;
	}
	/* The items by id, so that each id of the reply is found in log n
	 * (comparing every pair, as before, is about 100k strcmp for a batch
	 * of 256). */
	ecx_lookup_item **ord = malloc((n > 0 ? n : 1) * sizeof(*ord));
	if (ord == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++)
		ord[i] = &items[i];
	qsort(ord, n, sizeof(*ord), item_ptr_cmp);
	cJSON *o = ecx_json_parse(buf, len, ECX_WIRE_MAX, why, whylen);
	if (o == NULL) {
		free(ord);
		return len > ECX_WIRE_MAX ? ECX_ETOOBIG : ECX_EPROTO;
	}
	int rc = 0;
	const cJSON *found = cJSON_GetObjectItemCaseSensitive(o, "found");
	const cJSON *missing = cJSON_GetObjectItemCaseSensitive(o, "missing");
	if (!cJSON_IsObject(found) || !cJSON_IsArray(missing)) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "lookup reply needs \"found\" (object) and "
		             "\"missing\" (array)");
		goto out;
	}
	size_t nf = (size_t)cJSON_GetArraySize(found);
	size_t nm = (size_t)cJSON_GetArraySize(missing);
	/* The reply answers each distinct requested id once. */
	size_t distinct = 0;
	for (size_t i = 0; i < n; i++)
		distinct += i == 0 || strcmp(ord[i - 1]->id, ord[i]->id) != 0;
	if (nf + nm != distinct) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "lookup reply answers %zu ids, expected %zu",
		             nf + nm, distinct);
		goto out;
	}
	const cJSON *c;
	cJSON_ArrayForEach (c, found) {
		bool known = false;
		for (size_t k = item_lower(ord, n, c->string);
		     k < n && strcmp(ord[k]->id, c->string) == 0; k++) {
			rc =
			    ecx_entry_from_json(c, &ord[k]->entry, why, whylen);
			if (rc != 0)
				goto out;
			ord[k]->found = true;
			known = true;
		}
		if (!known) {
			rc = ecx_why(why, whylen, ECX_EPROTO,
			             "lookup reply names an id that was not "
			             "asked for");
			goto out;
		}
	}
	/* The other holders of an id found, when the registry has them. */
	const cJSON *holders =
	    cJSON_GetObjectItemCaseSensitive(o, "ecx_holders");
	if (!cJSON_IsObject(holders))
		holders = NULL;
	cJSON_ArrayForEach (c, holders) {
		if (!cJSON_IsArray(c) ||
		    cJSON_GetArraySize(c) > ECX_HOLDERS_MAX) {
			rc =
			    ecx_why(why, whylen, ECX_EPROTO,
			            "lookup reply's \"ecx_holders\" of '%.64s' "
			            "is not an array of at most %d entries",
			            c->string, ECX_HOLDERS_MAX);
			goto out;
		}
		for (size_t k = item_lower(ord, n, c->string);
		     k < n && strcmp(ord[k]->id, c->string) == 0; k++) {
			ecx_lookup_item *it = ord[k];
			if (!it->found)
				continue;
			free(it->alt);
			it->nalt = 0;
			it->alt =
			    malloc((ECX_HOLDERS_MAX - 1) * sizeof(*it->alt));
			if (it->alt == NULL) {
				rc = ecx_why(why, whylen, ECX_ENOMEM,
				             "out of memory");
				goto out;
			}
			const cJSON *h;
			cJSON_ArrayForEach (h, c) {
				ecx_entry e;
				rc = ecx_entry_from_json(h, &e, why, whylen);
				if (rc != 0)
					goto out;
				if (strcmp(e.producer_zmq,
				           it->entry.producer_zmq) == 0 ||
				    it->nalt == ECX_HOLDERS_MAX - 1)
					continue;
				it->alt[it->nalt++] = e;
			}
		}
	}
	cJSON_ArrayForEach (c, missing) {
		size_t k =
		    cJSON_IsString(c) ? item_lower(ord, n, c->valuestring) : n;
		if (k == n || strcmp(ord[k]->id, c->valuestring) != 0 ||
		    ord[k]->found) {
			rc =
			    ecx_why(why, whylen, ECX_EPROTO,
			            "lookup reply's \"missing\" has an id that "
			            "was not asked for");
			goto out;
		}
	}
out:
	if (rc != 0) {
		ecx_lookup_items_clear(items, n);
		for (size_t i = 0; i < n; i++)
			items[i].found = false;
	}
	cJSON_Delete(o);
	free(ord);
	return rc;
}
