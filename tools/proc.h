/* proc.h - running this same ecx binary as a child process with its
 * stdout on a pipe (the demo and the transfer benchmark). */
#ifndef ECX_TOOL_PROC_H
#define ECX_TOOL_PROC_H

#include <stdbool.h>
#include <stdio.h>
#include <sys/types.h>

typedef struct proc {
	pid_t pid;
	FILE *out;
} proc;

/* Starts `ecx ARGS...` (argv without argv[0], NULL-terminated). */
bool proc_start(proc *p, char *const args[]);
/* The same through a wrapper program (NULL: none), started as
 * `WRAP /path/to/ecx ARGS...`; it must exec the rest of its arguments, so
 * that the child's pid is ecx's (signals reach it). */
bool proc_start_via(proc *p, const char *wrap, char *const args[]);
/* Reads one line of its stdout (skipping UCX's own '[...' log lines) into
 * buf, waiting at most timeout_ms; false on end of file or timeout. */
bool proc_line(proc *p, char *buf, size_t len, int timeout_ms);
/* Sends sig (0: none), waits up to timeout_ms, then kills; returns the
 * exit status (as waitpid). */
int proc_stop(proc *p, int sig, int timeout_ms);

#endif
