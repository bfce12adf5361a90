/* safetensors.c - just enough of the safetensors format for the baseline:
 * an 8-byte little-endian header length, a JSON header, the raw bytes. */
#include "safetensors.h"

#include "tool.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
	ecx_dtype dt;
	const char *name;
} st_types[] = {
    {ECX_DTYPE_FLOAT16, "F16"},
    {ECX_DTYPE_BFLOAT16, "BF16"},
    {ECX_DTYPE_FLOAT32, "F32"},
    {ECX_DTYPE_FLOAT64, "F64"},
    {ECX_DTYPE_INT8, "I8"},
    {ECX_DTYPE_UINT8, "U8"},
    {ECX_DTYPE_INT16, "I16"},
    {ECX_DTYPE_INT32, "I32"},
    {ECX_DTYPE_INT64, "I64"},
    {ECX_DTYPE_BOOL, "BOOL"},
    {ECX_DTYPE_FLOAT8_E4M3FN, "F8_E4M3"},
    {ECX_DTYPE_FLOAT8_E5M2, "F8_E5M2"},
};

static int st_read(const char *path, ecx_tensor_desc *d, void **data,
                   size_t cap, char *why, size_t whylen);

int st_save(const char *path, const ecx_tensor_desc *d, const void *data,
            char *why, size_t whylen)
{
	const char *name = "U8";
	for (size_t i = 0; i < sizeof(st_types) / sizeof(st_types[0]); i++)
		if (st_types[i].dt == d->dtype)
			name = st_types[i].name;
	char hdr[512], shape[200] = "";
	size_t off = 0;
	for (uint32_t i = 0; i < d->ndim; i++)
		off += (size_t)snprintf(shape + off, sizeof(shape) - off,
		                        "%s%llu", i ? "," : "",
		                        (unsigned long long)d->shape[i]);
	int n = snprintf(hdr, sizeof(hdr),
	                 "{\"ec_cache\":{\"dtype\":\"%s\",\"shape\":[%s],"
	                 "\"data_offsets\":[0,%llu]}}",
	                 name, shape, (unsigned long long)d->nbytes);
	/* The header is padded to 8 bytes with spaces. */
	while (n % 8 != 0)
		hdr[n++] = ' ';
	uint64_t hl = (uint64_t)n;
	unsigned char le[8];
	for (int i = 0; i < 8; i++)
		le[i] = (unsigned char)(hl >> (8 * i));
	FILE *f = fopen(path, "wb");
	if (f == NULL)
		return tool_why(why, whylen, ECX_EIO, "cannot write %s: %m",
		                path);
	bool ok = fwrite(le, 1, 8, f) == 8 &&
	          fwrite(hdr, 1, (size_t)n, f) == (size_t)n &&
	          fwrite(data, 1, d->nbytes, f) == d->nbytes;
	ok = fclose(f) == 0 && ok;
	return ok ? 0 : tool_why(why, whylen, ECX_EIO, "cannot write %s", path);
}

int st_load(const char *path, ecx_tensor_desc *d, void **data, char *why,
            size_t whylen)
{
	return st_read(path, d, data, 0, why, whylen);
}

int st_load_into(const char *path, ecx_tensor_desc *d, void *dst, size_t cap,
                 char *why, size_t whylen)
{
	return st_read(path, d, &dst, cap, why, whylen);
}

/* cap 0: into a malloc'd buffer returned in *data; else into *data, which
 * holds cap bytes. */
static int st_read(const char *path, ecx_tensor_desc *d, void **data,
                   size_t cap, char *why, size_t whylen)
{
	FILE *f = fopen(path, "rb");
	if (f == NULL)
		return tool_why(why, whylen, ECX_EIO, "cannot open %s: %m",
		                path);
	unsigned char le[8];
	int rc = ECX_EPROTO;
	char *hdr = NULL;
	void *buf = NULL;
	cJSON *o = NULL;
	if (fread(le, 1, 8, f) != 8)
		goto out;
	uint64_t hl = 0;
	for (int i = 0; i < 8; i++)
		hl |= (uint64_t)le[i] << (8 * i);
	if (hl > 1 << 20 || (hdr = malloc(hl + 1)) == NULL ||
	    fread(hdr, 1, hl, f) != hl)
		goto out;
	o = cJSON_ParseWithLength(hdr, hl);
	const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "ec_cache");
	const cJSON *dt = cJSON_GetObjectItemCaseSensitive(t, "dtype");
	const cJSON *sh = cJSON_GetObjectItemCaseSensitive(t, "shape");
	if (!cJSON_IsString(dt) || !cJSON_IsArray(sh))
		goto out;
	ecx_dtype dtype = ECX_DTYPE_INVALID;
	for (size_t i = 0; i < sizeof(st_types) / sizeof(st_types[0]); i++)
		if (strcmp(st_types[i].name, dt->valuestring) == 0)
			dtype = st_types[i].dt;
	uint64_t dims[ECX_MAX_DIMS];
	uint32_t nd = 0;
	const cJSON *x;
	cJSON_ArrayForEach (x, sh) {
		if (nd == ECX_MAX_DIMS || !cJSON_IsNumber(x))
			goto out;
		dims[nd++] = (uint64_t)x->valuedouble;
	}
	if (ecx_tensor_set(d, dtype, nd, dims) != 0)
		goto out;
	if (cap > 0) {
		if (d->nbytes > cap) {
			rc = ECX_ESIZE;
			goto out;
		}
		if (fread(*data, 1, d->nbytes, f) != d->nbytes)
			goto out;
		rc = 0;
		goto out;
	}
	buf = malloc(d->nbytes ? d->nbytes : 1);
	if (buf == NULL || fread(buf, 1, d->nbytes, f) != d->nbytes)
		goto out;
	*data = buf;
	buf = NULL;
	rc = 0;
out:
	if (rc == ECX_ESIZE)
		tool_why(why, whylen, rc,
		         "%s holds %llu bytes, more than the %zu given", path,
		         (unsigned long long)d->nbytes, cap);
	else if (rc != 0)
		tool_why(why, whylen, rc,
		         "%s is not a readable safetensors file", path);
	cJSON_Delete(o);
	free(buf);
	free(hdr);
	fclose(f);
	return rc;
}
