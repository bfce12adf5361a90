/* proc.c - child processes of the ecx command. */
#include "proc.h"

#include "tool.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

bool proc_start(proc *p, char *const args[])
{
	return proc_start_via(p, NULL, args);
}

bool proc_start_via(proc *p, const char *wrap, char *const args[])
{
	/* Through a wrapper: WRAP /path/to/ecx ARGS..., the path read from
	 * /proc/self/exe here, where it names this binary. */
	char exe[4096];
	ssize_t el = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (el <= 0)
		return false;
	exe[el] = '\0';
	char *argv[64];
	int n = 0;
	if (wrap != NULL) {
		argv[n++] = (char *)wrap;
		argv[n++] = exe;
	} else {
		argv[n++] = "ecx";
	}
	for (int i = 0; args[i] != NULL && n < 63; i++)
		argv[n++] = args[i];
	argv[n] = NULL;
	int fds[2];
	if (pipe(fds) != 0)
		return false;
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
	posix_spawn_file_actions_addclose(&fa, fds[0]);
	/* The child must not inherit SIGINT/SIGTERM blocked by the caller. */
	posix_spawnattr_t at;
	posix_spawnattr_init(&at);
	sigset_t none;
	sigemptyset(&none);
	posix_spawnattr_setsigmask(&at, &none);
	posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK);
	/* Without the ECX_LOG main chose for this command: the child picks
	 * its own default. */
	size_t ne = 0;
	while (environ[ne] != NULL)
		ne++;
	char **envp = calloc(ne + 1, sizeof(*envp));
	if (envp == NULL) {
		posix_spawn_file_actions_destroy(&fa);
		posix_spawnattr_destroy(&at);
		close(fds[0]);
		close(fds[1]);
		return false;
	}
	size_t k = 0;
	for (size_t i = 0; i < ne; i++)
		if (!tool_log_defaulted ||
		    strncmp(environ[i], "ECX_LOG=", 8) != 0)
			envp[k++] = environ[i];
	int rc = posix_spawn(&p->pid, wrap != NULL ? wrap : exe, &fa, &at, argv,
	                     envp);
	free(envp);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&at);
	close(fds[1]);
	if (rc != 0) {
		close(fds[0]);
		return false;
	}
	p->out = fdopen(fds[0], "r");
	/* Unbuffered, so poll(2) on the descriptor sees every line. */
	if (p->out != NULL)
		setvbuf(p->out, NULL, _IONBF, 0);
	return p->out != NULL;
}

bool proc_line(proc *p, char *buf, size_t len, int timeout_ms)
{
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		clock_gettime(CLOCK_MONOTONIC, &t1);
		long left = timeout_ms - ((t1.tv_sec - t0.tv_sec) * 1000 +
		                          (t1.tv_nsec - t0.tv_nsec) / 1000000);
		if (left <= 0)
			return false;
		struct pollfd pf = {.fd = fileno(p->out), .events = POLLIN};
		if (poll(&pf, 1, (int)left) <= 0)
			return false;
		if (fgets(buf, (int)len, p->out) == NULL)
			return false;
		if (buf[0] == '[')
			continue;
		buf[strcspn(buf, "\n")] = '\0';
		return true;
	}
}

int proc_stop(proc *p, int sig, int timeout_ms)
{
	int st = 0;
	if (sig != 0)
		kill(p->pid, sig);
	for (int i = 0; i < timeout_ms / 10; i++) {
		if (waitpid(p->pid, &st, WNOHANG) == p->pid)
			goto done;
		usleep(10000);
	}
	kill(p->pid, SIGKILL);
	waitpid(p->pid, &st, 0);
done:
	if (p->out != NULL)
		fclose(p->out);
	p->out = NULL;
	return st;
}
