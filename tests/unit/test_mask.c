/* Unit tests for ecx_url_mask (src/core/mask.c): a registry URL's
 * password never shows, in a URL, in a list of them, in a line of text,
 * or in the library's log. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/core.h"
#include "ecx/ecx.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void masked(const char *in, const char *want)
{
	char buf[512];
	ecx_url_mask(in, buf, sizeof(buf));
	assert_string_equal(buf, want);
}

static void test_urls(void **state)
{
	(void)state;
	masked("redis://:hunter2@10.0.0.1:6379/0",
	       "redis://:***@10.0.0.1:6379/0");
	masked("redis://user:hunter2@h", "redis://user:***@h");
	masked("redis://hunter2@h", "redis://***@h");
	masked("redis+sentinel://:pw@a:26379,b:26379/m1/2",
	       "redis+sentinel://:***@a:26379,b:26379/m1/2");
	/* A password may hold ':', '/', ',' or '@': all of it goes. */
	masked("redis://:p:a/s,s@w@h:1", "redis://:***@h:1");
	masked("http://u:pw@127.0.0.1:9018", "http://u:***@127.0.0.1:9018");
	/* Nothing to mask. */
	masked("http://127.0.0.1:9018", "http://127.0.0.1:9018");
	masked("redis+sentinel://a:1,b:2/m", "redis+sentinel://a:1,b:2/m");
	masked("", "");
	masked("no url here: a@b", "no url here: a@b");
}

static void test_lists_and_text(void **state)
{
	(void)state;
	/* Each URL of a list on its own: the hosts between stay. */
	masked("redis://:a@h1:1,redis+sentinel://:b@s1,s2/m,http://h3:2",
	       "redis://:***@h1:1,redis+sentinel://:***@s1,s2/m,http://h3:2");
	masked("registry URL 'ftp://u:pw@host' is not http://HOST:PORT",
	       "registry URL 'ftp://u:***@host' is not http://HOST:PORT");
	masked("registry redis://:pw@h answers again (after 3 s)",
	       "registry redis://:***@h answers again (after 3 s)");
	/* A usage text's notation is no URL. */
	masked("redis URL is redis://[:password@]host[:port][/db]",
	       "redis URL is redis://[:password@]host[:port][/db]");
}

static void test_bounds(void **state)
{
	(void)state;
	char buf[16];
	memset(buf, 'x', sizeof(buf));
	ecx_url_mask("redis://:secretsecret@host", buf, 12);
	assert_int_equal(strlen(buf), 11);
	assert_null(strstr(buf, "secret"));
	assert_int_equal(buf[12], 'x');
	ecx_url_mask(NULL, buf, sizeof(buf));
	assert_string_equal(buf, "");
	ecx_url_mask("abc", buf, 1);
	assert_string_equal(buf, "");
	ecx_url_mask("abc", NULL, 0); /* nothing written, no crash */
}

/* The library's log masks every line it writes. */
static void test_log(void **state)
{
	(void)state;
	char path[] = "/tmp/ecx-test-mask-XXXXXX";
	int fd = mkstemp(path);
	assert_true(fd >= 0);
	int saved = dup(STDERR_FILENO);
	dup2(fd, STDERR_FILENO);
	ecx_log_set_level(ECX_LOG_WARN);
	ecx_warn("test", "registry %s answers again",
	         "redis+sentinel://:hunter2@127.0.0.1:26379/m1");
	dup2(saved, STDERR_FILENO);
	close(saved);
	char got[1024] = "";
	ssize_t n = pread(fd, got, sizeof(got) - 1, 0);
	close(fd);
	unlink(path);
	assert_true(n > 0);
	assert_null(strstr(got, "hunter2"));
	assert_non_null(strstr(got, "registry redis+sentinel://:***@127.0.0.1:"
	                            "26379/m1 answers again\n"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_urls),
	    cmocka_unit_test(test_lists_and_text),
	    cmocka_unit_test(test_bounds),
	    cmocka_unit_test(test_log),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
