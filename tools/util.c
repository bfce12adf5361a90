/* util.c - the command's own small helpers: a clock, string copies, error
 * details (the library's internal ones are not exported), JSON output,
 * signals, sizes for people, and URLs with their passwords masked (by
 * libecx's ecx_url_mask). */
#include "tool.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <signal.h>
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

bool tool_json_print(cJSON *o)
{
	char *s = o != NULL ? cJSON_PrintUnformatted(o) : NULL;
	cJSON_Delete(o);
	if (s == NULL)
		return false;
	printf("%s\n", s);
	cJSON_free(s);
	return true;
}

void tool_block_signals(void)
{
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGHUP); /* the terminal went away: stop cleanly too */
	pthread_sigmask(SIG_BLOCK, &set, NULL);
}

int tool_wait_signal(void)
{
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGHUP);
	int sig = 0;
	sigwait(&set, &sig);
	return sig;
}

int tool_poll_signal(int ms)
{
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGHUP);
	struct timespec ts = {.tv_sec = ms / 1000,
	                      .tv_nsec = (long)(ms % 1000) * 1000000};
	int sig;
	do
		sig = sigtimedwait(&set, NULL, &ts);
	while (sig < 0 && errno == EINTR);
	return sig > 0 ? sig : 0;
}

const char *tool_bytes(uint64_t n, char *buf, size_t len)
{
	static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
	double v = (double)n;
	int i = 0;
	while (v >= 1024 && i < 4) {
		v /= 1024;
		i++;
	}
	if (i == 0)
		snprintf(buf, len, "%llu B", (unsigned long long)n);
	else
		snprintf(buf, len, "%.1f %s", v, u[i]);
	return buf;
}

const char *tool_mask(const char *text, char *buf, size_t len)
{
	ecx_url_mask(text, buf, len);
	return buf;
}
