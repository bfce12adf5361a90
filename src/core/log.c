/* log.c - leveled one-line logging to stderr, set by ECX_LOG. */
#include "core.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static int log_level = -1;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

int ecx_log_parse(const char *name)
{
	static const char *names[] = {"off", "error", "warn", "info", "debug"};
	for (int i = 0; i < 5; i++)
		if (strcasecmp(name, names[i]) == 0)
			return i;
	return -1;
}

static void log_init(void)
{
	const char *env = getenv("ECX_LOG");
	int lvl = env != NULL ? ecx_log_parse(env) : -1;
	if (__atomic_load_n(&log_level, __ATOMIC_RELAXED) < 0)
		__atomic_store_n(&log_level, lvl >= 0 ? lvl : ECX_LOG_WARN,
		                 __ATOMIC_RELAXED);
}

bool ecx_log_enabled(ecx_log_level lvl)
{
	pthread_once(&log_once, log_init);
	return (int)lvl <= __atomic_load_n(&log_level, __ATOMIC_RELAXED);
}

void ecx_log_set_level(ecx_log_level lvl)
{
	pthread_once(&log_once, log_init);
	__atomic_store_n(&log_level, (int)lvl, __ATOMIC_RELAXED);
}

void ecx_logf(ecx_log_level lvl, const char *mod, const char *fmt, ...)
{
	static const char *tags[] = {"", "error", "warn", "info", "debug"};
	char line[1024];
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	int n =
	    snprintf(line, sizeof(line),
	             "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ ecx[%ld] %s %s: ",
	             tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
	             tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, (long)getpid(),
	             tags[lvl <= ECX_LOG_DEBUG ? lvl : 0], mod);
	va_list ap;
	va_start(ap, fmt);
	if (n > 0 && (size_t)n < sizeof(line))
		n += vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if ((size_t)n >= sizeof(line) - 1)
		n = (int)sizeof(line) - 2;
	line[n] = '\0';
	/* A message may quote a registry URL (the one a producer publishes
	 * to, one that answers again): its password is masked. */
	char out[sizeof(line)];
	core_url_mask(line, out, sizeof(out) - 1);
	n = (int)strlen(out);
	out[n++] = '\n';
	/* A short write of a log line is not worth handling. */
	ssize_t w = write(STDERR_FILENO, out, (size_t)n);
	(void)w;
}
