/* json.c - strict field readers shared by the codecs. */
#include "wire.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

cJSON *ecx_json_parse(const char *buf, size_t len, size_t max, char *why,
                      size_t whylen)
{
	if (buf == NULL || len == 0) {
		ecx_why(why, whylen, ECX_EPROTO, "empty message");
		return NULL;
	}
	if (len > max) {
		ecx_why(why, whylen, ECX_ETOOBIG,
		        "message of %zu bytes exceeds the limit of %zu", len,
		        max);
		return NULL;
	}
	const char *end = NULL;
	cJSON *o = cJSON_ParseWithLengthOpts(buf, len, &end, false);
	if (o == NULL) {
		ecx_why(why, whylen, ECX_EPROTO, "not valid JSON");
		return NULL;
	}
	/* Only whitespace (or a C string's NUL) may follow the value. */
	for (; end != NULL && end < buf + len; end++) {
		if (*end != ' ' && *end != '\n' && *end != '\r' &&
		    *end != '\t' && *end != '\0') {
			cJSON_Delete(o);
			ecx_why(why, whylen, ECX_EPROTO,
			        "trailing bytes after the JSON value");
			return NULL;
		}
	}
	if (!cJSON_IsObject(o)) {
		cJSON_Delete(o);
		ecx_why(why, whylen, ECX_EPROTO,
		        "message is not a JSON object");
		return NULL;
	}
	return o;
}

cJSON *ecx_json_u64(uint64_t v)
{
	char s[24];
	snprintf(s, sizeof(s), "%" PRIu64, v);
	return cJSON_CreateRaw(s);
}

int ecx_json_double_u64(double d, const char *key, uint64_t *out, char *why,
                        size_t whylen)
{
	if (!isfinite(d) || d < 0)
		return ecx_why(why, whylen, ECX_EPROTO, "\"%s\" is negative",
		               key);
	if (d != floor(d))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is not an integer", key);
	if (d >= (double)ECX_JSON_INT_MAX)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is out of range (at most 2^53-1)", key);
	*out = (uint64_t)d;
	return 0;
}

static int json_num_u64(const cJSON *n, const char *key, uint64_t *out,
                        char *why, size_t whylen)
{
	if (!cJSON_IsNumber(n))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is not a number", key);
	return ecx_json_double_u64(n->valuedouble, key, out, why, whylen);
}

int ecx_json_get_u64(const cJSON *o, const char *key, uint64_t *out, char *why,
                     size_t whylen)
{
	const cJSON *n = cJSON_GetObjectItemCaseSensitive(o, key);
	if (n == NULL)
		return ecx_why(why, whylen, ECX_EPROTO, "missing field \"%s\"",
		               key);
	return json_num_u64(n, key, out, why, whylen);
}

int ecx_json_get_str(const cJSON *o, const char *key, char *out, size_t cap,
                     char *why, size_t whylen)
{
	const cJSON *n = cJSON_GetObjectItemCaseSensitive(o, key);
	if (n == NULL)
		return ecx_why(why, whylen, ECX_EPROTO, "missing field \"%s\"",
		               key);
	if (!cJSON_IsString(n) || n->valuestring == NULL)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is not a string", key);
	size_t len = strlen(n->valuestring);
	if (len >= cap)
		return ecx_why(why, whylen, ECX_EPROTO,
		               "\"%s\" is longer than %zu bytes", key, cap - 1);
	memcpy(out, n->valuestring, len + 1);
	return 0;
}

int ecx_err_from_name(const char *name)
{
#define ECX_ERR_BYNAME(nm, code, msg) \
	if (strcmp(name, #nm) == 0)   \
		return code;
	ECX_ERR_MAP(ECX_ERR_BYNAME)
#undef ECX_ERR_BYNAME
	return ECX_EIO;
}

/* Shared by the codecs that read ids out of arrays. */
int ecx_json_id(const cJSON *n, const char *what, char *out, char *why,
                size_t whylen);
int ecx_json_id(const cJSON *n, const char *what, char *out, char *why,
                size_t whylen)
{
	if (!cJSON_IsString(n) || n->valuestring == NULL)
		return ecx_why(why, whylen, ECX_EPROTO, "%s is not a string",
		               what);
	char r[160];
	if (core_id_check(n->valuestring, r, sizeof(r)) != 0)
		return ecx_why(why, whylen, ECX_EID, "%s: %s", what, r);
	memcpy(out, n->valuestring, strlen(n->valuestring) + 1);
	return 0;
}
