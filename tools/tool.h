/* tool.h - what the ecx command's subcommands share. */
#ifndef ECX_TOOL_H
#define ECX_TOOL_H

#include <ecx/ecx.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Exit codes, documented in docs/cli.md and every --help. */
enum {
	EXIT_OK = 0,
	EXIT_FAIL = 1,     /* the operation failed */
	EXIT_USAGE = 2,    /* bad arguments */
	EXIT_NOTFOUND = 3, /* the id is not in any registry */
};

/* Options most subcommands take. */
typedef struct tool_common {
	const char *token; /* --token, else $ECX_TOKEN */
	int timeout_ms;    /* --timeout, default 5000 */
	bool json;         /* --json */
} tool_common;

/* getopt_long codes of the options several commands share. */
enum {
	TOOL_OPT_TOKEN = 256, /* --token T */
	TOOL_OPT_TIMEOUT,     /* --timeout DURATION */
	TOOL_OPT_JSON,        /* --json */
};
#define TOOL_OPT_ENTRIES                                            \
	{"token", required_argument, NULL, TOOL_OPT_TOKEN},         \
	    {"timeout", required_argument, NULL, TOOL_OPT_TIMEOUT}, \
	    {"json", no_argument, NULL, TOOL_OPT_JSON},             \
	{                                                           \
		"help", no_argument, NULL, 'h'                      \
	}

/* Handles option c if it is a shared one (--token, --timeout, --json,
 * --help) or unknown: returns -1 to go on, or the exit code (help printed:
 * EXIT_OK; a bad value or an unknown option: what is wrong, where the
 * options are described, and EXIT_USAGE). */
int tool_opt(const char *cmd, const char *help, int c, const char *arg,
             tool_common *t);

/* Each subcommand: argc/argv start at the subcommand's name. */
int cmd_registry(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_ls(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_get(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_consume(int argc, char **argv);

/* Prints "ecx CMD: message" to stderr, any URL's password masked
 * (tool_mask), and returns code. */
int tool_fail(const char *cmd, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Parses a duration with its unit ("500ms", "2s", "1.5s"), at most 24 h,
 * into milliseconds; a bare number ("5") is refused, as is anything else. */
bool tool_parse_ms(const char *s, int *out);
/* What a good duration looks like, for usage errors. */
#define TOOL_DURATION_HINT \
	"a duration with its unit, ms or s, e.g. 500ms, 2s; up to 24 hours"

/* Parses a port number 0..65535. */
bool tool_parse_port(const char *s, uint16_t *out);
/* Parses a whole decimal number min..max: digits only, no sign, no
 * suffix, no spaces ("3abc", "-1" and "" are refused). */
bool tool_parse_uint(const char *s, uint64_t min, uint64_t max, uint64_t *out);

/* Splits a comma-separated list of registry URLs as libecx does (a
 * redis+sentinel:// URL keeps the commas between its sentinels), each
 * trimmed of spaces, empty ones skipped: returns how many (0 for none), or
 * -1 with why for a URL too long or more than TOOL_REGISTRIES_MAX. */
#define TOOL_REGISTRIES_MAX 8
int tool_registry_split(const char *list,
                        char urls[TOOL_REGISTRIES_MAX][ECX_ADDR_MAX], char *why,
                        size_t whylen);

/* For "bad --FLAG 'VALUE' (hint)": prints it and returns EXIT_USAGE. */
int tool_bad_value(const char *cmd, const char *flag, const char *value,
                   const char *hint);
/* For a missing argument: "ecx CMD: missing WHAT" and where the options
 * are described; returns EXIT_USAGE. */
int tool_missing(const char *cmd, const char *what);

/* Checks a host name or IP address as given to --bind or --advertise:
 * letters, digits, '-', '.', or an IPv6 address (brackets allowed).
 * Returns false with the reason in why. */
bool tool_host_check(const char *host, char *why, size_t whylen);
/* Writes HOST for a URL: an IPv6 address inside brackets ("[::1]"). */
const char *tool_url_host(const char *host, char *buf, size_t len);
/* Resolves a --bind host name ("localhost") to a numeric address into
 * buf; numeric addresses are copied. Returns false with why. */
bool tool_bind_resolve(const char *host, char *buf, size_t len, char *why,
                       size_t whylen);

/* Warns on stderr, one line, when bind is not a loopback address and
 * token is NULL or empty: what says what anyone who reaches it can do. */
void tool_warn_open(const char *cmd, const char *bind, const char *token,
                    const char *what);

/* Prints a cJSON value on one line of stdout and deletes it; false when
 * it could not be printed (out of memory). */
struct cJSON;
bool tool_json_print(struct cJSON *o);

/* Blocks SIGINT, SIGTERM and SIGHUP in this thread (and threads it starts
 * later), then waits for one; returns the signal number. */
void tool_block_signals(void);
int tool_wait_signal(void);
/* Takes one of those signals if it is pending, waiting at most ms
 * milliseconds (0: only looks); returns it, or 0 when none came. */
int tool_poll_signal(int ms);

/* Writes text into buf (len bytes) with every URL's password masked, as
 * libecx's ecx_url_mask does, and returns buf. Everything the command
 * prints that may hold a registry URL goes through it. */
const char *tool_mask(const char *text, char *buf, size_t len);

/* Formats a byte count for people ("7.0 MiB"). */
const char *tool_bytes(uint64_t n, char *buf, size_t len);

/* The command uses the library's public API only (ecx.h); these small
 * helpers are its own (util.c). */

/* Monotonic time in nanoseconds. */
uint64_t tool_now_ns(void);

/* Writes every page of [p, p+n), so that none faults later. Not
 * memset(p, 0, n) after malloc: GCC folds that pair into calloc, which
 * leaves fresh pages untouched (reads of them then map the shared zero
 * page: a baseline copying from it reads no memory at all). */
void tool_prefault(void *p, size_t n);

/* Copies at most n-1 bytes of src and terminates; returns strlen(src). */
size_t tool_strlcpy(char *dst, const char *src, size_t n);

/* Formats a one-line reason into why (when why is not NULL and whylen > 0)
 * and returns err. */
int tool_why(char *why, size_t whylen, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* True when main set ECX_LOG for this process (the user had not): child
 * processes of the command then start without it. */
extern bool tool_log_defaulted;

#endif /* ECX_TOOL_H */
