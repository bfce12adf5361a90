/* testutil.h - helpers the C tests share: deterministic item bytes (and a
 * put of them into a producer of the test's process), and a child process
 * (tests/peer.c) driven line by line over pipes. */
#ifndef ECX_TESTUTIL_H
#define ECX_TESTUTIL_H

#include <ecx/ecx.h>

#include "gen.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Item bytes depend only on the id (tools/gen.c, shared with ecx serve
 * and the demo): random-looking, so a test tells any two items (and zeros)
 * apart. */
static inline void tu_fill(const char *id, void *buf, size_t n)
{
	gen_fill(id, buf, n);
}

/* Returns true when buf holds exactly what tu_fill(id) writes. */
static inline bool tu_check(const char *id, const void *buf, size_t n)
{
	return gen_check(id, buf, n);
}

/* Puts into p, a producer of this process, an item of n uint8 bytes for
 * id (tu_fill's). Returns ecx_producer_put's code (ECX_ENOMEM where no
 * buffer could be had). */
static inline int tu_put(ecx_producer *p, const char *id, uint64_t n)
{
	ecx_tensor_desc d;
	uint64_t shape[1] = {n};
	int rc = ecx_tensor_set(&d, ECX_DTYPE_UINT8, 1, shape);
	if (rc != 0)
		return rc;
	void *buf = malloc(n);
	if (buf == NULL)
		return ECX_ENOMEM;
	tu_fill(id, buf, n);
	rc = ecx_producer_put(p, id, &d, buf);
	free(buf);
	return rc;
}

typedef struct tu_child {
	pid_t pid;
	FILE *in;  /* its stdin */
	FILE *out; /* its stdout */
} tu_child;

/* The children started and not reaped yet: a test that fails leaves its
 * children behind (cmocka goes on with the next test), and a child left
 * running or stopped keeps the test's stdout open, so that ctest would wait
 * for it until its timeout. At exit they are killed. */
static pid_t tu_live[64];

static inline void tu_kill_live(void)
{
	for (size_t i = 0; i < sizeof(tu_live) / sizeof(tu_live[0]); i++)
		if (tu_live[i] > 0) {
			kill(tu_live[i], SIGKILL);
			waitpid(tu_live[i], NULL, 0);
			tu_live[i] = 0;
		}
}

static inline void tu_live_set(pid_t old, pid_t pid)
{
	static bool registered;
	if (!registered) {
		atexit(tu_kill_live);
		registered = true;
	}
	for (size_t i = 0; i < sizeof(tu_live) / sizeof(tu_live[0]); i++)
		if (tu_live[i] == old) {
			tu_live[i] = pid;
			return;
		}
}

/* Starts argv[0] (a path) with pipes on stdin and stdout. */
static inline bool tu_spawn(tu_child *c, char *const argv[])
{
	int in[2], out[2];
	if (pipe(in) != 0 || pipe(out) != 0)
		return false;
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, in[0], 0);
	posix_spawn_file_actions_adddup2(&fa, out[1], 1);
	posix_spawn_file_actions_addclose(&fa, in[1]);
	posix_spawn_file_actions_addclose(&fa, out[0]);
	extern char **environ;
	int rc = posix_spawn(&c->pid, argv[0], &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(in[0]);
	close(out[1]);
	if (rc != 0)
		return false;
	tu_live_set(0, c->pid);
	c->in = fdopen(in[1], "w");
	c->out = fdopen(out[0], "r");
	setvbuf(c->in, NULL, _IOLBF, 0);
	return true;
}

/* Reads the child's next answer line, skipping UCX's own log lines (UCX
 * logs to stdout unless UCX_LOG_FILE says otherwise). */
static inline bool tu_line(tu_child *c, char *ans, size_t n)
{
	do {
		if (fgets(ans, (int)n, c->out) == NULL)
			return false;
	} while (ans[0] == '[');
	ans[strcspn(ans, "\n")] = '\0';
	return true;
}

/* Sends one command line and reads one answer line (without newline). */
static inline bool tu_ask(tu_child *c, char *ans, size_t n, const char *fmt,
                          ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfprintf(c->in, fmt, ap);
	va_end(ap);
	fputc('\n', c->in);
	fflush(c->in);
	return tu_line(c, ans, n);
}

/* Reads a "name value" field out of a stats line. */
static inline long long tu_field(const char *line, const char *name)
{
	char key[64];
	snprintf(key, sizeof(key), " %s ", name);
	char padded[1100];
	snprintf(padded, sizeof(padded), " %s ", line);
	const char *p = strstr(padded, key);
	return p != NULL ? atoll(p + strlen(key)) : -1;
}

/* Waits for the child up to ms; kills it if it is still there. Returns
 * its wait status. */
static inline int tu_reap(tu_child *c, int ms)
{
	int st = 0;
	for (int i = 0; i < ms / 10; i++) {
		if (waitpid(c->pid, &st, WNOHANG) == c->pid)
			goto done;
		usleep(10000);
	}
	kill(c->pid, SIGKILL);
	waitpid(c->pid, &st, 0);
done:
	tu_live_set(c->pid, 0);
	if (c->in)
		fclose(c->in);
	if (c->out)
		fclose(c->out);
	c->in = c->out = NULL;
	return st;
}

/* Whether every thread of process pid is stopped ('T' in its stat). */
static inline bool tu_all_stopped(pid_t pid)
{
	char path[320], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
	DIR *d = opendir(path);
	if (d == NULL)
		return false;
	bool all = true;
	struct dirent *e;
	while (all && (e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/%d/task/%s/stat", (int)pid,
		         e->d_name);
		FILE *f = fopen(path, "r");
		size_t n = f != NULL ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
		if (f != NULL)
			fclose(f);
		buf[n] = '\0';
		const char *p = strrchr(buf, ')');
		all = p != NULL && p[1] == ' ' && p[2] == 'T';
	}
	closedir(d);
	return all;
}

/* Stops process pid with SIGSTOP and returns once every thread of it is
 * stopped (at most 1 s). kill() returns before the signal has taken
 * effect: one thread takes it and then stops the others, and until it
 * runs the others may still answer what comes in. */
static inline void tu_stop(pid_t pid)
{
	kill(pid, SIGSTOP);
	for (int i = 0; i < 1000 && !tu_all_stopped(pid); i++)
		usleep(1000);
}

/* The test binaries' folder (for the peer helper). */
static inline const char *tu_bindir(void)
{
	const char *d = getenv("ECX_TEST_BIN");
	return d != NULL ? d : ".";
}

/* A generous timeout, stretched by ECX_TEST_TIME_SCALE where everything runs
 * slower on purpose (valgrind: make valgrind sets 10). Bounds that a test
 * asserts are never scaled: only waits that must not end a correct run. */
static inline int tu_ms(int ms)
{
	const char *s = getenv("ECX_TEST_TIME_SCALE");
	int k = s != NULL ? atoi(s) : 1;
	return k > 1 ? ms * k : ms;
}

#endif
