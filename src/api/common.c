/*
 * common.c - the public entry points that belong to no handle: the
 * version, the error table (ecx_strerror, ecx_err_name), the calling
 * thread's last error, ids, dtypes and tensor descriptors, sizes, masked URLs,
 * ecx_xxh3 and ecx_free. Each is one call into core/ (err.c, types.c,
 * size.c, mask.c) or wire/ (pull.c's hashes), whose functions every layer uses
 * under their internal names.
 */
#include "core/core.h"
#include "wire/wire.h"

#include <stdlib.h>

const char *ecx_version(void)
{
	return ECX_VERSION_STRING;
}

int ecx_version_number(void)
{
	return ECX_VERSION_NUMBER;
}

const char *ecx_strerror(int err)
{
	return core_strerror(err);
}

const char *ecx_err_name(int err)
{
	return core_err_name(err);
}

const char *ecx_last_error(void)
{
	return core_last_error();
}

int ecx_id_check(const char *id, char *why, size_t whylen)
{
	return core_id_check(id, why, whylen);
}

const char *ecx_dtype_name(ecx_dtype dt)
{
	return core_dtype_name(dt);
}

size_t ecx_dtype_size(ecx_dtype dt)
{
	return core_dtype_size(dt);
}

int ecx_dtype_parse(const char *name, ecx_dtype *out)
{
	return core_dtype_parse(name, out);
}

int ecx_tensor_nbytes(const ecx_tensor_desc *d, uint64_t *out)
{
	return core_tensor_nbytes(d, out);
}

int ecx_tensor_check(const ecx_tensor_desc *d, char *why, size_t whylen)
{
	return core_tensor_check(d, why, whylen);
}

int ecx_tensor_set(ecx_tensor_desc *d, ecx_dtype dtype, uint32_t ndim,
                   const uint64_t *shape)
{
	return core_tensor_set(d, dtype, ndim, shape);
}

int ecx_size_parse(const char *s, uint64_t *out, char *why, size_t whylen)
{
	return core_size_parse(s, out, why, whylen);
}

void ecx_url_mask(const char *text, char *buf, size_t len)
{
	core_url_mask(text, buf, len);
}

uint64_t ecx_xxh3(const void *p, size_t n)
{
	return ecx_hash_bytes(ECX_HASH_XXH3, p, n);
}

void ecx_free(void *p)
{
	free(p);
}
