/* types.c - item ids, dtypes and tensor descriptors (api/common.c makes
 * them public). */
#include "core.h"

#include <string.h>

/* The bytes an id may hold: A-Z a-z 0-9 . _ : @ + = - (a table: every
 * lookup checks every byte of every id). */
static const bool id_bytes[256] = {
    ['0'] = 1, ['1'] = 1, ['2'] = 1, ['3'] = 1, ['4'] = 1, ['5'] = 1, ['6'] = 1,
    ['7'] = 1, ['8'] = 1, ['9'] = 1, ['A'] = 1, ['B'] = 1, ['C'] = 1, ['D'] = 1,
    ['E'] = 1, ['F'] = 1, ['G'] = 1, ['H'] = 1, ['I'] = 1, ['J'] = 1, ['K'] = 1,
    ['L'] = 1, ['M'] = 1, ['N'] = 1, ['O'] = 1, ['P'] = 1, ['Q'] = 1, ['R'] = 1,
    ['S'] = 1, ['T'] = 1, ['U'] = 1, ['V'] = 1, ['W'] = 1, ['X'] = 1, ['Y'] = 1,
    ['Z'] = 1, ['a'] = 1, ['b'] = 1, ['c'] = 1, ['d'] = 1, ['e'] = 1, ['f'] = 1,
    ['g'] = 1, ['h'] = 1, ['i'] = 1, ['j'] = 1, ['k'] = 1, ['l'] = 1, ['m'] = 1,
    ['n'] = 1, ['o'] = 1, ['p'] = 1, ['q'] = 1, ['r'] = 1, ['s'] = 1, ['t'] = 1,
    ['u'] = 1, ['v'] = 1, ['w'] = 1, ['x'] = 1, ['y'] = 1, ['z'] = 1, ['.'] = 1,
    ['_'] = 1, [':'] = 1, ['@'] = 1, ['+'] = 1, ['='] = 1, ['-'] = 1};

static bool id_byte_ok(unsigned char c)
{
	return id_bytes[c];
}

int core_id_check(const char *id, char *why, size_t whylen)
{
	if (id == NULL)
		return ecx_why(why, whylen, ECX_EID, "id is missing");
	size_t n = strnlen(id, ECX_ID_MAX + 1);
	if (n == 0)
		return ecx_why(why, whylen, ECX_EID, "id is empty");
	if (n > ECX_ID_MAX)
		return ecx_why(why, whylen, ECX_EID,
		               "id is longer than %d bytes", ECX_ID_MAX);
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)id[i];
		if (!id_byte_ok(c)) {
			if (c > 0x20 && c < 0x7f)
				return ecx_why(
				    why, whylen, ECX_EID,
				    "id has byte '%c' (0x%02x) at offset "
				    "%zu; allowed: A-Z a-z 0-9 . _ : @ + = -",
				    c, c, i);
			return ecx_why(
			    why, whylen, ECX_EID,
			    "id has byte 0x%02x at offset %zu; allowed: "
			    "A-Z a-z 0-9 . _ : @ + = -",
			    c, i);
		}
	}
	return 0;
}

static const struct {
	const char *name;
	size_t size;
} dtypes[ECX_DTYPE_COUNT] = {[ECX_DTYPE_INVALID] = {NULL, 0},
#define ECX_DTYPE_ROW(name, str, sz) [ECX_DTYPE_##name] = {str, sz},
                             ECX_DTYPE_MAP(ECX_DTYPE_ROW)
#undef ECX_DTYPE_ROW
};

const char *core_dtype_name(ecx_dtype dt)
{
	if ((int)dt <= ECX_DTYPE_INVALID || dt >= ECX_DTYPE_COUNT)
		return NULL;
	return dtypes[dt].name;
}

size_t core_dtype_size(ecx_dtype dt)
{
	if ((int)dt <= ECX_DTYPE_INVALID || dt >= ECX_DTYPE_COUNT)
		return 0;
	return dtypes[dt].size;
}

int core_dtype_parse(const char *name, ecx_dtype *out)
{
	if (name == NULL)
		return ECX_EDTYPE;
	if (strncmp(name, "torch.", 6) == 0)
		name += 6;
	for (int i = 1; i < ECX_DTYPE_COUNT; i++) {
		if (strcmp(name, dtypes[i].name) == 0) {
			*out = (ecx_dtype)i;
			return 0;
		}
	}
	return ECX_EDTYPE;
}

int core_tensor_nbytes(const ecx_tensor_desc *d, uint64_t *out)
{
	size_t esz = core_dtype_size(d->dtype);
	if (esz == 0)
		return ECX_EDTYPE;
	if (d->ndim > ECX_MAX_DIMS)
		return ECX_EINVAL;
	uint64_t n = esz;
	for (uint32_t i = 0; i < d->ndim; i++) {
		uint64_t dim = d->shape[i];
		if (dim != 0 && n > ECX_JSON_INT_MAX / dim)
			return ECX_ETOOBIG;
		n *= dim;
	}
	if (n > ECX_JSON_INT_MAX)
		return ECX_ETOOBIG;
	*out = n;
	return 0;
}

int core_tensor_check(const ecx_tensor_desc *d, char *why, size_t whylen)
{
	uint64_t n;
	int rc = core_tensor_nbytes(d, &n);
	switch (rc) {
	case 0:
		break;
	case ECX_EDTYPE:
		return ecx_why(why, whylen, rc, "unknown dtype %d",
		               (int)d->dtype);
	case ECX_EINVAL:
		return ecx_why(why, whylen, rc,
		               "%u dimensions; at most %d are allowed", d->ndim,
		               ECX_MAX_DIMS);
	default:
		return ecx_why(why, whylen, rc,
		               "shape's size overflows 2^53 bytes");
	}
	if (n != d->nbytes)
		return ecx_why(why, whylen, ECX_ESIZE,
		               "nbytes %llu disagrees with shape and dtype "
		               "(%llu bytes)",
		               (unsigned long long)d->nbytes,
		               (unsigned long long)n);
	return 0;
}

int core_tensor_set(ecx_tensor_desc *d, ecx_dtype dtype, uint32_t ndim,
                    const uint64_t *shape)
{
	ecx_tensor_desc t;
	memset(&t, 0, sizeof(t));
	t.dtype = dtype;
	t.ndim = ndim;
	if (ndim > ECX_MAX_DIMS)
		return ECX_EINVAL;
	for (uint32_t i = 0; i < ndim; i++)
		t.shape[i] = shape[i];
	int rc = core_tensor_nbytes(&t, &t.nbytes);
	if (rc == 0)
		*d = t;
	return rc;
}
