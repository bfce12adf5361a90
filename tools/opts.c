/* opts.c - the command's option parsing and its usage errors: one line on
 * stderr naming the command, the flag and what a good value looks like. */
#include "tool.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int tool_fail(const char *cmd, int code, const char *fmt, ...)
{
	/* A message may quote a registry URL, the user's or the library's:
	 * its password is masked. */
	char msg[2048], out[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr, "ecx %s: %s\n", cmd, tool_mask(msg, out, sizeof(out)));
	return code;
}

int tool_opt(const char *cmd, const char *help, int c, const char *arg,
             tool_common *t)
{
	switch (c) {
	case TOOL_OPT_TOKEN:
		t->token = arg;
		return -1;
	case TOOL_OPT_TIMEOUT:
		if (!tool_parse_ms(arg, &t->timeout_ms) || t->timeout_ms == 0)
			return tool_bad_value(cmd, "--timeout", arg,
			                      TOOL_DURATION_HINT);
		return -1;
	case TOOL_OPT_JSON:
		t->json = true;
		return -1;
	case 'h':
		fputs(help, stdout);
		return EXIT_OK;
	default: /* getopt has said which option, and what is wrong */
		fprintf(stderr, "Run 'ecx %s --help' for its options.\n", cmd);
		return EXIT_USAGE;
	}
}

/* The number at the start of a duration: digits with at most one
 * '.', nothing else (no sign, spaces, hex, exponent, inf or nan); *end is
 * set after it, at the unit. */
static bool tool_strtod(const char *s, double *v, char **end)
{
	size_t n = strspn(s, "0123456789.");
	const char *dot = memchr(s, '.', n);
	if (n == 0 || n > 30 ||
	    (dot != NULL &&
	     memchr(dot + 1, '.', n - (size_t)(dot - s) - 1) != NULL))
		return false;
	char num[32];
	memcpy(num, s, n);
	num[n] = '\0';
	char *e;
	*v = strtod(num, &e);
	*end = (char *)s + n;
	return e == num + n && isfinite(*v);
}

bool tool_parse_ms(const char *s, int *out)
{
	char *end;
	double v;
	if (!tool_strtod(s, &v, &end))
		return false;
	/* A bare number is refused: "5" read as 5 ms surprised users who
	 * meant seconds, and nothing says which a reader means. */
	if (strcmp(end, "ms") == 0)
		;
	else if (strcmp(end, "s") == 0)
		v *= 1000;
	else
		return false;
	if (v > 86400000.0)
		return false;
	*out = (int)v;
	return true;
}

bool tool_parse_port(const char *s, uint16_t *out)
{
	uint64_t v;
	if (!tool_parse_uint(s, 0, 65535, &v))
		return false;
	*out = (uint16_t)v;
	return true;
}

bool tool_parse_uint(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
	if (*s == '\0' || strlen(s) > 19)
		return false;
	uint64_t v = 0;
	for (const char *p = s; *p != '\0'; p++) {
		if (!isdigit((unsigned char)*p))
			return false;
		v = v * 10 + (uint64_t)(*p - '0');
	}
	if (v < min || v > max)
		return false;
	*out = v;
	return true;
}

int tool_bad_value(const char *cmd, const char *flag, const char *value,
                   const char *hint)
{
	return tool_fail(cmd, EXIT_USAGE, "bad %s '%s'%s%s%s", flag, value,
	                 hint != NULL ? " (" : "", hint != NULL ? hint : "",
	                 hint != NULL ? ")" : "");
}

int tool_missing(const char *cmd, const char *what)
{
	fprintf(stderr,
	        "ecx %s: missing %s\nRun 'ecx %s --help' for its usage.\n", cmd,
	        what, cmd);
	return EXIT_USAGE;
}

/* The length of the first URL of a comma-separated list: a
 * redis+sentinel:// URL runs up to the comma that starts another URL
 * (SCHEME://), so that the commas between its sentinels stay in it; any
 * other URL, up to its first comma. libecx splits a list so. */
static size_t registry_url_len(const char *p)
{
	size_t sp = strspn(p, " ");
	if (strncasecmp(p + sp, "redis+sentinel://", 17) != 0)
		return strcspn(p, ",");
	for (size_t i = strcspn(p, ","); p[i] != '\0';
	     i += 1 + strcspn(p + i + 1, ",")) {
		const char *q = p + i + 1;
		while (*q == ' ')
			q++;
		size_t s = strspn(q, "abcdefghijklmnopqrstuvwxyz"
		                     "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.");
		if (*q == '\0' || *q == ',' ||
		    (s > 0 && strncmp(q + s, "://", 3) == 0))
			return i;
	}
	return strlen(p);
}

int tool_registry_split(const char *list,
                        char urls[TOOL_REGISTRIES_MAX][ECX_ADDR_MAX], char *why,
                        size_t whylen)
{
	int n = 0;
	for (const char *p = list; *p != '\0';) {
		size_t len = registry_url_len(p);
		const char *q = p;
		p += len + (p[len] == ',');
		while (len > 0 && *q == ' ')
			q++, len--;
		while (len > 0 && q[len - 1] == ' ')
			len--;
		if (len == 0)
			continue;
		if (len >= ECX_ADDR_MAX)
			return tool_why(why, whylen, -1,
			                "registry URL too long (at most %d "
			                "bytes)",
			                ECX_ADDR_MAX - 1);
		if (n == TOOL_REGISTRIES_MAX)
			return tool_why(why, whylen, -1,
			                "at most %d registries",
			                TOOL_REGISTRIES_MAX);
		memcpy(urls[n], q, len);
		urls[n++][len] = '\0';
	}
	return n;
}
