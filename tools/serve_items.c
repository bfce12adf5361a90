/* serve_items.c - the items `ecx serve` puts at start: files (.npy, or
 * raw with --shape/--dtype) and generated ones (--synthetic, --workload),
 * with a progress line on long puts. */
#include "tool.h"

#include "gen.h"
#include "npy.h"
#include "serve.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Parses AxBxC strictly (digits only); false for anything else. */
bool parse_shape(const char *s, uint64_t *dims, uint32_t *nd)
{
	*nd = 0;
	for (;;) {
		size_t n = strspn(s, "0123456789");
		if (n == 0 || n > 15 || *nd == ECX_MAX_DIMS)
			return false;
		dims[(*nd)++] = strtoull(s, NULL, 10);
		s += n;
		if (*s == '\0')
			return true;
		if (*s != 'x')
			return false;
		s++;
	}
}

static void print_shape(char *buf, size_t len, const ecx_tensor_desc *d)
{
	size_t off = 0;
	buf[0] = '\0';
	for (uint32_t i = 0; i < d->ndim && off < len; i++)
		off += (size_t)snprintf(buf + off, len - off, "%s%llu",
		                        i ? "x" : "",
		                        (unsigned long long)d->shape[i]);
	if (d->ndim == 0)
		snprintf(buf, len, "scalar");
}

/* A progress line on stderr while items go in, when it is a terminal. */
static void progress(size_t done, size_t total, uint64_t bytes)
{
	static int tty = -1;
	if (tty < 0)
		tty = isatty(STDERR_FILENO);
	if (!tty || total < 2)
		return;
	char b[32];
	fprintf(stderr, "\recx serve: %zu/%zu items (%s)\033[K%s", done, total,
	        tool_bytes(bytes, b, sizeof(b)), done == total ? "\n" : "");
}

/* Puts one item, reporting failures. A registry that does not answer is
 * waited for (a producer of a fleet starts before its registry, or
 * outlives a restart of it): the put is tried again each second until it
 * answers or a signal comes. Returns EXIT_OK, EXIT_FAIL, or -1 when a
 * signal stopped it (r->sig). */
static int serve_put(serve_run *r, const char *id, const ecx_tensor_desc *d,
                     const void *data)
{
	for (;;) {
		if ((r->sig = tool_poll_signal(0)) != 0)
			return -1;
		uint64_t t0 = tool_now_ns();
		int rc = ecx_producer_put(r->prod, id, d, data);
		r->put_ns += tool_now_ns() - t0;
		if (rc == 0)
			break;
		if (r->registry == NULL ||
		    (rc != ECX_ECONNECT && rc != ECX_ETIMEDOUT &&
		     rc != ECX_EIO))
			return tool_fail("serve", EXIT_FAIL, "%s",
			                 ecx_last_error());
		/* The error names the registry and says why. */
		if (!r->waited)
			fprintf(
			    stderr,
			    "ecx serve: %s; waiting for the registry: items "
			    "are put and published once it answers, then "
			    "serving starts\n",
			    ecx_last_error());
		r->waited = true;
		if ((r->sig = tool_poll_signal(1000)) != 0)
			return -1;
	}
	if (r->waited) {
		fprintf(stderr, "ecx serve: registry %s answers\n",
		        r->registry);
		r->waited = false;
	}
	if (r->nsizes > 0)
		r->sizes[r->put % r->nsizes] = d->nbytes;
	r->put++;
	r->put_bytes += d->nbytes;
	return EXIT_OK;
}

/* Reads a raw file of exactly d->nbytes. */
static int read_raw(const char *path, const ecx_tensor_desc *d, void **data,
                    char *why, size_t whylen)
{
	FILE *f = fopen(path, "rb");
	if (f == NULL)
		return tool_why(why, whylen, ECX_EIO, "cannot read %s: %s",
		                path, strerror(errno));
	struct stat sb;
	int rc = 0;
	char shape[128];
	print_shape(shape, sizeof(shape), d);
	if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
		rc = tool_why(why, whylen, ECX_EIO, "%s is not a regular file",
		              path);
	} else if ((uint64_t)sb.st_size != d->nbytes) {
		rc = tool_why(why, whylen, ECX_ESIZE,
		              "%s holds %llu bytes, but --shape %s of %s "
		              "makes %llu",
		              path, (unsigned long long)sb.st_size, shape,
		              ecx_dtype_name(d->dtype),
		              (unsigned long long)d->nbytes);
	} else if (data != NULL) {
		*data = malloc(d->nbytes ? d->nbytes : 1);
		if (*data == NULL)
			rc = tool_why(why, whylen, ECX_ENOMEM,
			              "out of memory for %s", path);
		else if (fread(*data, 1, d->nbytes, f) != d->nbytes)
			rc = tool_why(
			    why, whylen, ECX_EIO, "cannot read %s: %s", path,
			    ferror(f) ? strerror(errno) : "it got shorter");
	}
	fclose(f);
	return rc;
}

/* Reads one file given to serve: a .npy file (known by its magic bytes,
 * whatever its name) or raw bytes of --dtype and --shape. Returns an exit
 * code; on success *data is malloc'd. With data NULL it only checks the
 * file (before anything starts, so a bad file is said at once). */
int read_item(const char *path, const serve_opts *o, bool generated,
              ecx_tensor_desc *d, void **data)
{
	char why[512];
	FILE *f = fopen(path, "rb");
	if (f == NULL)
		return tool_fail("serve", EXIT_FAIL, "cannot read %s: %s", path,
		                 strerror(errno));
	bool npy = npy_sniff(f);
	fclose(f);
	ecx_dtype dt = ECX_DTYPE_INVALID;
	uint64_t dims[ECX_MAX_DIMS];
	uint32_t nd = 0;
	if (o->dtype != NULL)
		ecx_dtype_parse(o->dtype, &dt); /* checked with the options */
	if (o->shape != NULL)
		parse_shape(o->shape, dims, &nd);
	if (npy) {
		if (npy_read(path, d, data, why, sizeof(why)) != 0)
			return tool_fail("serve", EXIT_FAIL, "%s", why);
		/* --dtype and --shape describe files, unless they are for
		 * the generated items: a .npy file that says otherwise is
		 * refused rather than served as something else. */
		ecx_tensor_desc want;
		char got[128], asked[128];
		print_shape(got, sizeof(got), d);
		if (!generated && o->shape != NULL &&
		    (ecx_tensor_set(&want, d->dtype, nd, dims) != 0 ||
		     want.ndim != d->ndim ||
		     memcmp(want.shape, d->shape,
		            d->ndim * sizeof(d->shape[0])) != 0)) {
			if (data != NULL)
				free(*data);
			return tool_fail("serve", EXIT_USAGE,
			                 "%s is %s, not --shape %s", path, got,
			                 o->shape);
		}
		if (!generated && o->dtype != NULL && dt != d->dtype) {
			if (data != NULL)
				free(*data);
			snprintf(asked, sizeof(asked), "%s",
			         ecx_dtype_name(d->dtype));
			return tool_fail("serve", EXIT_USAGE,
			                 "%s holds %s, not --dtype %s", path,
			                 asked, o->dtype);
		}
		return EXIT_OK;
	}
	if (o->dtype == NULL || o->shape == NULL)
		return tool_fail("serve", EXIT_USAGE,
		                 "%s is not a .npy file: raw bytes need "
		                 "--dtype and --shape",
		                 path);
	if (ecx_tensor_set(d, dt, nd, dims) != 0)
		return tool_fail("serve", EXIT_USAGE,
		                 "--shape %s of %s is too large", o->shape,
		                 o->dtype);
	int rc = read_raw(path, d, data, why, sizeof(why));
	if (rc != 0) /* a size that differs: the options do not fit it */
		return tool_fail("serve",
		                 rc == ECX_ESIZE ? EXIT_USAGE : EXIT_FAIL, "%s",
		                 why);
	return EXIT_OK;
}

int serve_files(serve_run *r, int n, char **files, const serve_opts *o)
{
	bool generated = o->synthetic > 0 || o->workload != NULL;
	for (int i = 0; i < n; i++) {
		char id[ECX_ID_MAX + 1], why[256];
		const char *path = files[i];
		const char *eq = strchr(path, '=');
		if (eq != NULL && (size_t)(eq - path) <= ECX_ID_MAX) {
			memcpy(id, path, (size_t)(eq - path));
			id[eq - path] = '\0';
			path = eq + 1;
		} else {
			const char *base = strrchr(path, '/');
			tool_strlcpy(id, base ? base + 1 : path, sizeof(id));
			char *dot = strrchr(id, '.');
			if (dot != NULL && dot != id)
				*dot = '\0';
		}
		if (ecx_id_check(id, why, sizeof(why)) != 0)
			return tool_fail("serve", EXIT_USAGE,
			                 "%s: %s (name it with ID=%s)", path,
			                 why, path);
		ecx_tensor_desc d;
		void *data = NULL;
		int rc = read_item(path, o, generated, &d, &data);
		if (rc != EXIT_OK)
			return rc;
		rc = serve_put(r, id, &d, data);
		free(data);
		if (rc != EXIT_OK)
			return rc;
		progress((size_t)i + 1, (size_t)n, r->put_bytes);
	}
	return EXIT_OK;
}

int serve_generated(serve_run *r, const serve_opts *o)
{
	uint64_t n = o->workload != NULL ? o->count : o->synthetic;
	ecx_tensor_desc fixed;
	if (o->workload == NULL) {
		ecx_dtype dt;
		uint64_t dims[ECX_MAX_DIMS];
		uint32_t nd;
		if (o->dtype == NULL)
			return tool_missing("serve",
			                    "--dtype for --synthetic (a torch "
			                    "dtype name such as bfloat16)");
		if (o->shape == NULL)
			return tool_missing("serve",
			                    "--shape for --synthetic (e.g. "
			                    "1024x3584)");
		ecx_dtype_parse(o->dtype, &dt);
		parse_shape(o->shape, dims, &nd);
		if (ecx_tensor_set(&fixed, dt, nd, dims) != 0)
			return tool_fail("serve", EXIT_USAGE,
			                 "--shape %s of %s is too large",
			                 o->shape, o->dtype);
	}
	const char *prefix = o->prefix != NULL     ? o->prefix
	                     : o->workload != NULL ? o->workload
	                                           : "synthetic";
	void *buf = NULL;
	uint64_t cap = 0;
	uint64_t base = r->put_bytes;
	int rc = EXIT_OK;
	for (uint64_t i = 0; i < n && rc == EXIT_OK; i++) {
		ecx_tensor_desc d = fixed;
		if (o->workload != NULL) {
			uint64_t dims[2] = {gen_qwen_tokens((size_t)i), 3584};
			ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
		}
		if (d.nbytes > cap || buf == NULL) {
			free(buf);
			cap = d.nbytes;
			buf = malloc(cap ? cap : 1);
			if (buf == NULL)
				return tool_fail("serve", EXIT_FAIL,
				                 "out of memory");
		}
		char id[ECX_ID_MAX + 1];
		snprintf(id, sizeof(id), "%s-%llu", prefix,
		         (unsigned long long)i);
		gen_fill(id, buf, d.nbytes);
		rc = serve_put(r, id, &d, buf);
		progress((size_t)i + 1, (size_t)n, r->put_bytes - base);
	}
	free(buf);
	return rc;
}
