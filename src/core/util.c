/* util.c - strings, constant-time compare, clocks, base64. */
#include "core.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

int ecx_hex_digit(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

size_t ecx_strlcpy(char *dst, const char *src, size_t n)
{
	size_t len = strlen(src);
	if (n > 0) {
		size_t c = len < n - 1 ? len : n - 1;
		memcpy(dst, src, c);
		dst[c] = '\0';
	}
	return len;
}

uint64_t ecx_hash_str(const char *s)
{
	uint64_t h = 1469598103934665603ull;
	for (; *s != '\0'; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ull;
	return h;
}

bool ecx_ct_equal(const char *a, size_t alen, const char *b, size_t blen)
{
	/* Walk the longer length so the time does not reveal a prefix match. */
	size_t n = alen > blen ? alen : blen;
	unsigned diff = (unsigned)(alen ^ blen);
	for (size_t i = 0; i < n; i++) {
		unsigned char x = i < alen ? (unsigned char)a[i] : 0;
		unsigned char y = i < blen ? (unsigned char)b[i] : 0;
		diff |= (unsigned)(x ^ y);
	}
	return diff == 0;
}

uint64_t ecx_wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t ecx_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t ecx_page_size(void)
{
	static uint64_t page;
	uint64_t p = __atomic_load_n(&page, __ATOMIC_RELAXED);
	if (p == 0) {
		long n = sysconf(_SC_PAGESIZE);
		p = n > 0 ? (uint64_t)n : 4096u;
		__atomic_store_n(&page, p, __ATOMIC_RELAXED);
	}
	return p;
}

static const char b64_chars[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void ecx_b64_encode(const void *in, size_t n, char *out)
{
	const unsigned char *p = in;
	size_t o = 0;
	for (size_t i = 0; i < n; i += 3) {
		uint32_t v = (uint32_t)p[i] << 16;
		if (i + 1 < n)
			v |= (uint32_t)p[i + 1] << 8;
		if (i + 2 < n)
			v |= p[i + 2];
		out[o++] = b64_chars[(v >> 18) & 63];
		out[o++] = b64_chars[(v >> 12) & 63];
		out[o++] = i + 1 < n ? b64_chars[(v >> 6) & 63] : '=';
		out[o++] = i + 2 < n ? b64_chars[v & 63] : '=';
	}
	out[o] = '\0';
}

static int b64_val(char c)
{
	if (c >= 'A' && c <= 'Z')
		return c - 'A';
	if (c >= 'a' && c <= 'z')
		return c - 'a' + 26;
	if (c >= '0' && c <= '9')
		return c - '0' + 52;
	if (c == '+')
		return 62;
	if (c == '/')
		return 63;
	return -1;
}

long ecx_b64_decode(const char *in, size_t len, void *out, size_t outcap)
{
	unsigned char *o = out;
	size_t n = 0;
	if (len % 4 != 0)
		return -1;
	for (size_t i = 0; i < len; i += 4) {
		int v[4];
		int pad = 0;
		for (int k = 0; k < 4; k++) {
			char c = in[i + k];
			if (c == '=' && i + 4 == len && k >= 2) {
				v[k] = 0;
				pad++;
			} else if (pad > 0 || (v[k] = b64_val(c)) < 0) {
				return -1;
			}
		}
		uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 |
		             (uint32_t)v[2] << 6 | (uint32_t)v[3];
		size_t take = 3 - (size_t)pad;
		if (n + take > outcap)
			return -1;
		o[n++] = (unsigned char)(w >> 16);
		if (take > 1)
			o[n++] = (unsigned char)(w >> 8);
		if (take > 2)
			o[n++] = (unsigned char)w;
	}
	return (long)n;
}
