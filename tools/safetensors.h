/* safetensors.h - the file-per-item baseline of vLLM's ECExampleConnector:
 * each tensor saved as a safetensors file in a shared folder, loaded back
 * into fresh memory. */
#ifndef ECX_TOOL_SAFETENSORS_H
#define ECX_TOOL_SAFETENSORS_H

#include <ecx/ecx.h>

/* Writes the tensor to path as a safetensors file with one tensor named
 * "ec_cache" (as the example connector names it). */
int st_save(const char *path, const ecx_tensor_desc *d, const void *data,
            char *why, size_t whylen);
/* Reads it back into a malloc'd buffer. */
int st_load(const char *path, ecx_tensor_desc *d, void **data, char *why,
            size_t whylen);
/* Reads it back into dst, which holds cap bytes (ECX_ESIZE if the tensor
 * is larger). */
int st_load_into(const char *path, ecx_tensor_desc *d, void *dst, size_t cap,
                 char *why, size_t whylen);

#endif
