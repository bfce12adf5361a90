/* main.c - the ecx command: dispatches to subcommands. */
#include "tool.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char usage[] =
    "usage: ecx COMMAND [OPTIONS]\n"
    "\n"
    "Moves multimodal encoder outputs between processes and hosts.\n"
    "\n"
    "Commands:\n"
    "  registry   run a standalone HTTP registry\n"
    "  serve      run a producer that publishes items (files or synthetic)\n"
    "  info       print one registry entry\n"
    "  ls         list a registry's entries\n"
    "  get        pull one item into a .npy file\n"
    "  bench      benchmarks: registry, transfer, file, all\n"
    "  demo       the main job: a producer and a consumer moving\n"
    "             encoder-shaped tensors, verified, beside a file baseline\n"
    "  version    print the version\n"
    "\n"
    "Run 'ecx COMMAND --help' for a command's options.\n"
    "Environment: ECX_TOKEN (default for --token), ECX_LOG (error, warn,\n"
    "info, debug; default warn), UCX_* (override ecx's UCX defaults).\n"
    "Exit codes: 0 success, 1 failure, 2 usage error, 3 id not found.\n";

int tool_fail(const char *cmd, int code, const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "ecx %s: ", cmd);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
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
			return tool_fail(cmd, EXIT_USAGE,
			                 "bad --timeout '%s' (e.g. 500ms, 2s)",
			                 arg);
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

/* The number at the start of a size or duration: digits with at most one
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
	if (strcmp(end, "ms") == 0 || *end == '\0')
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

bool tool_parse_size(const char *s, uint64_t *out)
{
	char *end;
	double v;
	if (!tool_strtod(s, &v, &end))
		return false;
	static const struct {
		const char *suffix;
		double mult;
	} units[] = {{"", 1},           {"B", 1},           {"K", 1024},
	             {"KiB", 1024},     {"M", 1048576},     {"MiB", 1048576},
	             {"G", 1073741824}, {"GiB", 1073741824}};
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		if (strcmp(end, units[i].suffix) == 0) {
			v *= units[i].mult;
			if (v >= (double)TOOL_JSON_INT_MAX)
				return false;
			*out = (uint64_t)v;
			return true;
		}
	}
	return false;
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

bool tool_host_check(const char *host, char *why, size_t whylen)
{
	size_t n = strlen(host);
	char v6[INET6_ADDRSTRLEN + 2];
	struct in6_addr a6;
	if (n > 0 && host[0] == '[' && host[n - 1] == ']' &&
	    n - 2 < sizeof(v6)) {
		memcpy(v6, host + 1, n - 2);
		v6[n - 2] = '\0';
		if (inet_pton(AF_INET6, v6, &a6) == 1)
			return true;
	}
	if (strchr(host, ':') != NULL) {
		if (inet_pton(AF_INET6, host, &a6) == 1)
			return true;
		tool_why(why, whylen, 0, "not an IPv6 address");
		return false;
	}
	if (n == 0 || n > 253) {
		tool_why(why, whylen, 0, "a host name is 1 to 253 characters");
		return false;
	}
	for (const char *p = host; *p != '\0'; p++) {
		if (!isalnum((unsigned char)*p) && *p != '-' && *p != '.' &&
		    *p != '_') {
			tool_why(why, whylen, 0,
			         "a host name or IP address: letters, "
			         "digits, '-' and '.'");
			return false;
		}
	}
	return true;
}

const char *tool_url_host(const char *host, char *buf, size_t len)
{
	if (strchr(host, ':') != NULL && host[0] != '[')
		snprintf(buf, len, "[%s]", host);
	else
		snprintf(buf, len, "%s", host);
	return buf;
}

bool tool_bind_resolve(const char *host, char *buf, size_t len, char *why,
                       size_t whylen)
{
	if (!tool_host_check(host, why, whylen))
		return false;
	size_t n = strlen(host);
	if (host[0] == '[') { /* [::1] -> ::1 */
		snprintf(buf, len, "%.*s", (int)(n - 2), host + 1);
		return true;
	}
	struct in6_addr a;
	if (inet_pton(AF_INET, host, &a) == 1 ||
	    inet_pton(AF_INET6, host, &a) == 1) {
		snprintf(buf, len, "%s", host);
		return true;
	}
	/* A name: its IPv4 address where it has one (as 'localhost' on most
	 * hosts), else its IPv6 one. */
	static const int families[] = {AF_INET, AF_INET6};
	int err = 0;
	for (size_t i = 0; i < 2; i++) {
		struct addrinfo hints = {.ai_family = families[i],
		                         .ai_socktype = SOCK_STREAM},
		                *res = NULL;
		err = getaddrinfo(host, NULL, &hints, &res);
		if (err != 0)
			continue;
		err = getnameinfo(res->ai_addr, res->ai_addrlen, buf,
		                  (socklen_t)len, NULL, 0, NI_NUMERICHOST);
		freeaddrinfo(res);
		if (err == 0)
			return true;
	}
	tool_why(why, whylen, 0, "cannot resolve it: %s", gai_strerror(err));
	return false;
}

/* Whether a numeric address is a loopback one (127.0.0.0/8, ::1, or
 * ::ffff:127.x.y.z). */
static bool numeric_loopback(const char *host)
{
	unsigned char a[16];
	if (inet_pton(AF_INET, host, a) == 1)
		return a[0] == 127;
	if (inet_pton(AF_INET6, host, a) != 1)
		return false;
	static const unsigned char one[16] = {[15] = 1};
	static const unsigned char v4[12] = {[10] = 0xff, [11] = 0xff};
	return memcmp(a, one, 16) == 0 ||
	       (memcmp(a, v4, 12) == 0 && a[12] == 127);
}

void tool_warn_open(const char *cmd, const char *bind, const char *token,
                    const char *what)
{
	if (token != NULL && token[0] != '\0')
		return;
	char num[INET6_ADDRSTRLEN + 1], why[128];
	const char *h = bind;
	if (tool_bind_resolve(bind, num, sizeof(num), why, sizeof(why)))
		h = num;
	if (numeric_loopback(h))
		return;
	fprintf(stderr,
	        "ecx %s: warning: listening on %s with no token: anyone who "
	        "reaches it can %s (give --token T or $ECX_TOKEN, or --bind "
	        "127.0.0.1)\n",
	        cmd, bind, what);
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

int main(int argc, char **argv)
{
	if (argc < 2) {
		fputs(usage, stderr);
		return EXIT_USAGE;
	}
	const char *cmd = argv[1];
	if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 ||
	    strcmp(cmd, "help") == 0) {
		fputs(usage, stdout);
		return EXIT_OK;
	}
	if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
		printf("ecx %s\n", ecx_version());
		return EXIT_OK;
	}
	static const struct {
		const char *name;
		int (*fn)(int, char **);
	} cmds[] = {{"registry", cmd_registry}, {"serve", cmd_serve},
	            {"info", cmd_info},         {"ls", cmd_ls},
	            {"get", cmd_get},           {"bench", cmd_bench},
	            {"demo", cmd_demo},         {"consume", cmd_consume}};
	/* Commands that report their own failures in one line keep the
	 * library's warnings (a registry it will retry, ...) to themselves;
	 * the daemons log them. ECX_LOG overrides both. */
	bool daemon = strcmp(cmd, "registry") == 0 || strcmp(cmd, "serve") == 0;
	/* The library reads ECX_LOG once, at its first message. */
	if (getenv("ECX_LOG") == NULL) {
		setenv("ECX_LOG", daemon ? "warn" : "error", 1);
		tool_log_defaulted = true;
	}
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		if (strcmp(cmd, cmds[i].name) == 0) {
			/* getopt names the program in its messages: "ecx get:
			 * unrecognized option", like every other message. */
			static char name[32];
			snprintf(name, sizeof(name), "ecx %s", cmds[i].name);
			argv[1] = name;
			return cmds[i].fn(argc - 1, argv + 1);
		}
	}
	fprintf(stderr, "ecx: unknown command '%s'\n\n%s", cmd, usage);
	return EXIT_USAGE;
}
