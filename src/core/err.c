/* err.c - the error table's strings, and the version. */
#include "core.h"

#include <stdio.h>
#include <unistd.h>

const char *ecx_version(void)
{
	return ECX_VERSION_STRING;
}

int ecx_version_number(void)
{
	return ECX_VERSION_NUMBER;
}

const char *ecx_strerror(int err)
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

const char *ecx_err_name(int err)
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

const char *ecx_last_error(void)
{
	return last_error;
}
const char *ecx_producer_last_error(void)
{
	return last_error;
}
const char *ecx_consumer_last_error(void)
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

bool ecx_forked(int owner, const char *what)
{
	int me = (int)getpid();
	if (me == owner)
		return false;
	ecx_set_error(ECX_EFORK,
	              "%s handle created in process %d, used after fork in %d: "
	              "create a new one in the child",
	              what, owner, me);
	return true;
}
