/* err.c - the error table's strings, and the calling thread's last error
 * detail. */
#include "core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

const char *core_strerror(int err)
{
	switch (err) {
#define ECX_ERR_STR(name, code, msg) \
	case code:                   \
		return msg;
		ECX_ERR_MAP(ECX_ERR_STR)
#undef ECX_ERR_STR
	}
	return "unknown error";
}

const char *core_err_name(int err)
{
	switch (err) {
#define ECX_ERR_NAME(name, code, msg) \
	case code:                    \
		return #name;
		ECX_ERR_MAP(ECX_ERR_NAME)
#undef ECX_ERR_NAME
	}
	return "UNKNOWN";
}

int ecx_why(char *why, size_t whylen, int err, const char *fmt, ...)
{
	if (why != NULL && whylen > 0) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(why, whylen, fmt, ap);
		va_end(ap);
	}
	return err;
}

static __thread char last_error[512];

const char *core_last_error(void)
{
	return last_error;
}

int ecx_set_error(int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return err;
}

/* This process's id, kept so that the check on every public call is a
 * load, not a system call: set once, and again in every child that fork
 * makes (pthread_atfork). */
static atomic_int self_pid;
static pthread_once_t self_once = PTHREAD_ONCE_INIT;

static void self_after_fork(void)
{
	atomic_store(&self_pid, (int)getpid());
}

static void self_init(void)
{
	atomic_store(&self_pid, (int)getpid());
	pthread_atfork(NULL, NULL, self_after_fork);
}

bool ecx_forked(int owner, const char *what)
{
	pthread_once(&self_once, self_init);
	int me = atomic_load_explicit(&self_pid, memory_order_relaxed);
	if (me == owner)
		return false;
	ecx_set_error(ECX_EFORK,
	              "%s handle created in process %d, used after fork in %d: "
	              "create a new one in the child",
	              what, owner, me);
	return true;
}
