/* util.c - the command's own small helpers: a clock, string copies and
 * error details (the library's internal ones are not exported). */
#include "tool.h"

#include <stdarg.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

bool tool_log_defaulted;

uint64_t tool_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void tool_prefault(void *p, size_t n)
{
	/* Volatile stores: the compiler may neither drop nor fold them. */
	volatile char *c = p;
	long ps = sysconf(_SC_PAGESIZE);
	size_t page = ps > 0 ? (size_t)ps : 4096u;
	for (size_t i = 0; i < n; i += page)
		c[i] = 1;
	if (n > 0)
		c[n - 1] = 1;
}

size_t tool_strlcpy(char *dst, const char *src, size_t n)
{
	size_t len = strlen(src);
	if (n > 0) {
		size_t c = len < n - 1 ? len : n - 1;
		memcpy(dst, src, c);
		dst[c] = '\0';
	}
	return len;
}

int tool_why(char *why, size_t whylen, int err, const char *fmt, ...)
{
	if (why != NULL && whylen > 0) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(why, whylen, fmt, ap);
		va_end(ap);
	}
	return err;
}
