/* npy.h - the .npy file format (what numpy.save writes), for ecx serve and
 * ecx get. numpy has no bfloat16 or float8 dtypes, so those are written
 * as a structured dtype with one field named after the torch dtype over the
 * raw bits ([('bfloat16', '<u2')]): numpy opens the file, a['bfloat16']
 * gives the bits, and ecx reads the dtype back exactly. */
#ifndef ECX_TOOL_NPY_H
#define ECX_TOOL_NPY_H

#include <ecx/ecx.h>

#include <stdbool.h>
#include <stdio.h>

/* Writes desc and data as a .npy file at path. Returns 0 or an ECX_E*
 * with the reason in why. */
int npy_write(const char *path, const ecx_tensor_desc *d, const void *data,
              char *why, size_t whylen);

/* True when f starts with the .npy magic bytes (it is read from the
 * start; the position is left anywhere). */
bool npy_sniff(FILE *f);

/* Reads a .npy file: its descriptor and a malloc'd copy of its data; with
 * data NULL, only its descriptor, checking the data is all there. */
int npy_read(const char *path, ecx_tensor_desc *d, void **data, char *why,
             size_t whylen);

#endif
