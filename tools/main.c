/* main.c - the ecx command: dispatches to subcommands. */
#include "tool.h"

#include <ctype.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

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
	default:
		fputs(help, stderr);
		return EXIT_USAGE;
	}
}

bool tool_parse_ms(const char *s, int *out)
{
	char *end;
	double v = strtod(s, &end);
	if (end == s || v < 0)
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
	double v = strtod(s, &end);
	if (end == s || v < 0)
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
	char *end;
	long v = strtol(s, &end, 10);
	if (end == s || *end != '\0' || v < 0 || v > 65535)
		return false;
	*out = (uint16_t)v;
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
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		if (strcmp(cmd, cmds[i].name) == 0)
			return cmds[i].fn(argc - 1, argv + 1);
	fprintf(stderr, "ecx: unknown command '%s'\n\n%s", cmd, usage);
	return EXIT_USAGE;
}
