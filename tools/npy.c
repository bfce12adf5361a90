/* npy.c - reading and writing .npy files (format version 1.0 and 2.0). */
#include "npy.h"

#include "tool.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const struct {
	ecx_dtype dt;
	const char *descr; /* numpy's, little-endian */
} npy_types[] = {
    {ECX_DTYPE_FLOAT16, "'<f2'"},
    {ECX_DTYPE_FLOAT32, "'<f4'"},
    {ECX_DTYPE_FLOAT64, "'<f8'"},
    {ECX_DTYPE_INT8, "'|i1'"},
    {ECX_DTYPE_UINT8, "'|u1'"},
    {ECX_DTYPE_INT16, "'<i2'"},
    {ECX_DTYPE_INT32, "'<i4'"},
    {ECX_DTYPE_INT64, "'<i8'"},
    {ECX_DTYPE_BOOL, "'|b1'"},
    {ECX_DTYPE_BFLOAT16, "[('bfloat16', '<u2')]"},
    {ECX_DTYPE_FLOAT8_E4M3FN, "[('float8_e4m3fn', '|u1')]"},
    {ECX_DTYPE_FLOAT8_E5M2, "[('float8_e5m2', '|u1')]"},
};

/* The temporary file being written, for the signal handler to remove. */
static char tmp_path[4096];
static const int stop_sigs[] = {SIGINT, SIGTERM, SIGHUP};
#define NSTOP (sizeof(stop_sigs) / sizeof(stop_sigs[0]))

/* A stop signal while the temporary file exists: the file goes, then the
 * signal does what it would have done (the process ends by it). */
static void on_stop(int sig)
{
	unlink(tmp_path);
	signal(sig, SIG_DFL);
	raise(sig);
}

/* Writes the whole of [p, p+n) to fd. */
static bool write_all(int fd, const void *p, size_t n)
{
	const char *c = p;
	while (n > 0) {
		ssize_t k = write(fd, c, n > (1u << 30) ? (1u << 30) : n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return false;
		c += k;
		n -= (size_t)k;
	}
	return true;
}

/* Writes the file's three parts to fd; errno is kept from the failure. */
static bool write_parts(int fd, const unsigned char *pre, const char *hdr,
                        size_t hlen, uint64_t nbytes, const void *data)
{
	return write_all(fd, pre, 10) && write_all(fd, hdr, hlen) &&
	       write_all(fd, data, (size_t)nbytes);
}

/* Writes the file at path whole or not at all: into a temporary file
 * beside it (".NAME.PID.part"), renamed over path once complete. A
 * failure, or SIGINT, SIGTERM or SIGHUP meanwhile, removes the temporary
 * file and leaves whatever was at path as it was. A path that exists and
 * is not a regular file (/dev/null, a pipe), or a directory where no file
 * can be made (with a warning), is written in place; a symbolic link is
 * written through to the file it names. */
static int npy_put_file(const char *path, const unsigned char *pre,
                        const char *hdr, size_t hlen, uint64_t nbytes,
                        const void *data, char *why, size_t whylen)
{
	/* A symbolic link is written through: the file it names is the one
	 * replaced, and the link stays a link. */
	char target[PATH_MAX];
	struct stat link;
	if (lstat(path, &link) == 0 && S_ISLNK(link.st_mode) &&
	    realpath(path, target) != NULL)
		path = target;
	struct stat old;
	bool exists = stat(path, &old) == 0;
	int fd = -1;
	if (!exists || S_ISREG(old.st_mode)) {
		const char *slash = strrchr(path, '/');
		int dl = slash != NULL ? (int)(slash - path + 1) : 0;
		int n = snprintf(tmp_path, sizeof(tmp_path), "%.*s.%s.%ld.part",
		                 dl, path, slash != NULL ? slash + 1 : path,
		                 (long)getpid());
		if (n < 0 || (size_t)n >= sizeof(tmp_path))
			return tool_why(why, whylen, ECX_EINVAL,
			                "cannot write %s: name too long", path);
	} else {
		tmp_path[0] = '\0';
	}
	/* The handlers are in place before the file exists; a signal that
	 * was ignored stays ignored. A file too large for RLIMIT_FSIZE fails
	 * its write (EFBIG) rather than ending the process. */
	struct sigaction was[NSTOP], xfsz_was;
	struct sigaction sa = {.sa_handler = on_stop};
	sigemptyset(&sa.sa_mask);
	struct sigaction ign = {.sa_handler = SIG_IGN};
	sigemptyset(&ign.sa_mask);
	sigaction(SIGXFSZ, &ign, &xfsz_was);
	bool handled = tmp_path[0] != '\0';
	for (size_t i = 0; i < NSTOP && handled; i++) {
		sigaction(stop_sigs[i], NULL, &was[i]);
		if (was[i].sa_handler != SIG_IGN)
			sigaction(stop_sigs[i], &sa, NULL);
	}
	if (tmp_path[0]) {
		fd = open(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
		          0666);
		if (fd < 0 && errno == EEXIST) { /* left by a killed run */
			unlink(tmp_path);
			fd =
			    open(tmp_path,
			         O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
		}
		if (fd < 0 && (errno == EACCES || errno == EPERM) && exists) {
			/* No file can be made beside it: written in place,
			 * which a failure midway leaves cut short; say so. */
			fprintf(stderr,
			        "ecx: warning: cannot make a temporary file "
			        "beside %s (%s): writing it in place\n",
			        path, strerror(errno));
			tmp_path[0] = '\0';
		}
	}
	if (fd < 0 && !tmp_path[0])
		fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
	int rc = 0;
	if (fd < 0) {
		rc = tool_why(why, whylen, ECX_EIO, "cannot write %s: %s", path,
		              strerror(errno));
	} else {
		/* A file replaced keeps its permissions. */
		if (tmp_path[0] && exists)
			(void)fchmod(fd, old.st_mode & 07777);
		bool ok = write_parts(fd, pre, hdr, hlen, nbytes, data);
		int e = errno;
		if (close(fd) != 0 && ok) {
			ok = false;
			e = errno;
		}
		if (ok && tmp_path[0] && rename(tmp_path, path) != 0) {
			ok = false;
			e = errno;
		}
		if (!ok)
			rc =
			    tool_why(why, whylen, ECX_EIO,
			             "cannot write %s: %s%s", path, strerror(e),
			             tmp_path[0] ? " (left as it was)" : "");
	}
	if (rc != 0 && tmp_path[0])
		unlink(tmp_path);
	for (size_t i = 0; i < NSTOP && handled; i++)
		sigaction(stop_sigs[i], &was[i], NULL);
	sigaction(SIGXFSZ, &xfsz_was, NULL);
	tmp_path[0] = '\0';
	return rc;
}

int npy_write(const char *path, const ecx_tensor_desc *d, const void *data,
              char *why, size_t whylen)
{
	const char *descr = NULL;
	for (size_t i = 0; i < sizeof(npy_types) / sizeof(npy_types[0]); i++)
		if (npy_types[i].dt == d->dtype)
			descr = npy_types[i].descr;
	if (descr == NULL)
		return tool_why(why, whylen, ECX_EDTYPE,
		                "no .npy form for dtype");
	char shape[256] = "";
	size_t off = 0;
	for (uint32_t i = 0; i < d->ndim; i++)
		off += (size_t)snprintf(
		    shape + off, sizeof(shape) - off, "%llu,%s",
		    (unsigned long long)d->shape[i],
		    (d->ndim > 1 && i + 1 < d->ndim) ? " " : "");
	if (d->ndim > 1)
		shape[off - 1] = '\0'; /* (2, 3) rather than (2, 3,) */
	char hdr[512];
	int n =
	    snprintf(hdr, sizeof(hdr),
	             "{'descr': %s, 'fortran_order': False, 'shape': (%s), }",
	             descr, shape);
	/* Pad with spaces to a multiple of 64 bytes, ending in a newline. */
	size_t total = 10 + (size_t)n + 1;
	size_t pad = (64 - total % 64) % 64;
	memset(hdr + n, ' ', pad);
	hdr[n + pad] = '\n';
	size_t hlen = (size_t)n + pad + 1;
	unsigned char pre[10] = {0x93,
	                         'N',
	                         'U',
	                         'M',
	                         'P',
	                         'Y',
	                         1,
	                         0,
	                         (unsigned char)(hlen & 0xff),
	                         (unsigned char)(hlen >> 8)};
	return npy_put_file(path, pre, hdr, hlen, d->nbytes, data, why, whylen);
}

bool npy_sniff(FILE *f)
{
	unsigned char m[6];
	rewind(f);
	return fread(m, 1, 6, f) == 6 && memcmp(m, "\x93NUMPY", 6) == 0;
}

/* Says why numpy's dtype descr (as the header writes it, e.g. '>f4') is
 * not one ecx carries. */
static void npy_unsupported(const char *path, const char *descr, char *why,
                            size_t whylen)
{
	char d[48] = "";
	const char *hint = "";
	if (descr[0] == '\'') {
		size_t n = strcspn(descr + 1, "'");
		snprintf(d, sizeof(d), "%.*s", (int)(n < 40 ? n : 40),
		         descr + 1);
		char kind = d[0] != '\0' ? d[1] : '\0';
		if (d[0] == '>')
			hint = "big-endian: save "
			       "a.astype(a.dtype.newbyteorder('<'))";
		else if (kind == 'O')
			hint = "Python objects have no fixed size";
		else if (kind == 'c')
			hint = "complex: save a.real and a.imag apart, or "
			       "a.view(a.real.dtype)";
		else if (kind == 'u')
			hint = "of unsigned types only uint8: save "
			       "a.astype(an int type that holds it)";
		else if (kind == 'U' || kind == 'S')
			hint = "strings are not tensors";
		else if (kind == 'M' || kind == 'm')
			hint = "save dates and durations as int64";
	} else {
		snprintf(d, sizeof(d), "a structured dtype");
		hint = "only ecx's own one-field bfloat16 and float8 forms";
	}
	tool_why(why, whylen, ECX_EDTYPE,
	         "%s: numpy dtype %s is not one ecx carries%s%s (ecx takes "
	         "little-endian float16/32/64, int8/16/32/64, uint8, bool, "
	         "and the bfloat16/float8 files ecx get writes)",
	         path, d, hint[0] ? ": " : "", hint);
}

/* Finds 'key': in the header dict and returns a pointer after the colon. */
static const char *hdr_value(const char *h, const char *key)
{
	char k[32];
	snprintf(k, sizeof(k), "'%s':", key);
	const char *p = strstr(h, k);
	if (p == NULL)
		return NULL;
	p += strlen(k);
	while (*p == ' ')
		p++;
	return p;
}

int npy_read(const char *path, ecx_tensor_desc *d, void **data, char *why,
             size_t whylen)
{
	FILE *f = fopen(path, "rb");
	if (f == NULL)
		return tool_why(why, whylen, ECX_EIO, "cannot open %s: %m",
		                path);
	unsigned char pre[12];
	int rc = 0;
	char *hdr = NULL;
	void *buf = NULL;
	if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
		rc = tool_why(why, whylen, ECX_EPROTO, "%s is not a .npy file",
		              path);
		goto out;
	}
	size_t hlen = pre[8] | (size_t)pre[9] << 8;
	if (pre[6] >= 2) {
		if (fread(pre + 10, 1, 2, f) != 2) {
			rc = tool_why(why, whylen, ECX_EPROTO,
			              "%s: short header", path);
			goto out;
		}
		hlen |= (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
	}
	if (hlen > 65536) {
		rc = tool_why(why, whylen, ECX_EPROTO, "%s: header too long",
		              path);
		goto out;
	}
	hdr = calloc(1, hlen + 1);
	if (hdr == NULL || fread(hdr, 1, hlen, f) != hlen) {
		rc =
		    tool_why(why, whylen, ECX_EPROTO, "%s: short header", path);
		goto out;
	}
	const char *descr = hdr_value(hdr, "descr");
	const char *fo = hdr_value(hdr, "fortran_order");
	const char *shape = hdr_value(hdr, "shape");
	if (descr == NULL || fo == NULL || shape == NULL || *shape != '(') {
		rc = tool_why(why, whylen, ECX_EPROTO,
		              "%s: header lacks descr, "
		              "fortran_order or shape",
		              path);
		goto out;
	}
	if (strncmp(fo, "False", 5) != 0) {
		rc = tool_why(why, whylen, ECX_EUNSUPPORTED,
		              "%s: Fortran order is not supported (save a "
		              "C-contiguous array)",
		              path);
		goto out;
	}
	ecx_dtype dt = ECX_DTYPE_INVALID;
	for (size_t i = 0; i < sizeof(npy_types) / sizeof(npy_types[0]); i++)
		if (strncmp(descr, npy_types[i].descr,
		            strlen(npy_types[i].descr)) == 0)
			dt = npy_types[i].dt;
	if (dt == ECX_DTYPE_INVALID) {
		npy_unsupported(path, descr, why, whylen);
		rc = ECX_EDTYPE;
		goto out;
	}
	uint64_t dims[ECX_MAX_DIMS];
	uint32_t nd = 0;
	const char *p = shape + 1;
	while (*p != ')') {
		while (*p == ' ' || *p == ',')
			p++;
		if (*p == ')')
			break;
		char *end;
		unsigned long long v = strtoull(p, &end, 10);
		if (end == p || nd == ECX_MAX_DIMS) {
			rc = tool_why(why, whylen, ECX_EPROTO, "%s: bad shape",
			              path);
			goto out;
		}
		dims[nd++] = v;
		p = end;
	}
	rc = ecx_tensor_set(d, dt, nd, dims);
	if (rc != 0) {
		tool_why(why, whylen, rc, "%s: shape too large", path);
		goto out;
	}
	if (data == NULL) { /* only checking: is the data all there? */
		long at = ftell(f);
		struct stat sb;
		if (at < 0 || fstat(fileno(f), &sb) != 0 ||
		    (uint64_t)sb.st_size < (uint64_t)at + d->nbytes)
			rc = tool_why(why, whylen, ECX_EPROTO,
			              "%s: data shorter than its shape says",
			              path);
		goto out;
	}
	buf = malloc(d->nbytes ? d->nbytes : 1);
	if (buf == NULL || fread(buf, 1, d->nbytes, f) != d->nbytes) {
		rc = tool_why(why, whylen, ECX_EPROTO,
		              "%s: data shorter than its shape says", path);
		goto out;
	}
	*data = buf;
	buf = NULL;
out:
	free(buf);
	free(hdr);
	fclose(f);
	return rc;
}
