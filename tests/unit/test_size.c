/* Unit tests for ecx_size_parse (src/core/size.c), the one parser of sizes
 * behind `ecx serve --capacity` and the connector's sizes: every unit the
 * docs promise, exact results, and refusals that name the units. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "ecx/ecx.h"

#include <string.h>

static uint64_t size_ok(const char *s)
{
	uint64_t v = 12345;
	char why[256] = "";
	int rc = ecx_size_parse(s, &v, why, sizeof(why));
	if (rc != 0)
		fail_msg("'%s' refused: %s", s, why);
	return v;
}

/* Refused with ECX_EINVAL, *out untouched, and a reason containing want. */
static void size_bad(const char *s, const char *want)
{
	uint64_t v = 12345;
	char why[256] = "";
	assert_int_equal(ecx_size_parse(s, &v, why, sizeof(why)), ECX_EINVAL);
	assert_int_equal(v, 12345);
	if (strstr(why, want) == NULL)
		fail_msg("'%s': reason '%s' lacks '%s'", s, why, want);
}

static void test_units(void **state)
{
	(void)state;
	assert_int_equal(size_ok("4096"), 4096);
	assert_int_equal(size_ok("7B"), 7);
	/* Decimal: what the docs promise as KB, MB, GB, TB. */
	assert_int_equal(size_ok("100MB"), 100000000);
	assert_int_equal(size_ok("1KB"), 1000);
	assert_int_equal(size_ok("2GB"), 2000000000);
	assert_int_equal(size_ok("3TB"), 3000000000000ull);
	/* Binary: KiB ... TiB, and the bare letters as before. */
	assert_int_equal(size_ok("512MiB"), 512ull << 20);
	assert_int_equal(size_ok("1KiB"), 1024);
	assert_int_equal(size_ok("1GiB"), 1ull << 30);
	assert_int_equal(size_ok("2TiB"), 2ull << 40);
	assert_int_equal(size_ok("64K"), 64 << 10);
	assert_int_equal(size_ok("3M"), 3 << 20);
	assert_int_equal(size_ok("1G"), 1ull << 30);
	assert_int_equal(size_ok("1T"), 1ull << 40);
	/* Case is ignored, spaces around the parts are allowed. */
	assert_int_equal(size_ok("8gib"), 8ull << 30);
	assert_int_equal(size_ok("100mb"), 100000000);
	assert_int_equal(size_ok(" 1.5 GB "), 1500000000);
}

static void test_exact(void **state)
{
	(void)state;
	/* Fractions are exact where a double is not (4.35 * 1000 is
	 * 4349.999... as doubles). */
	assert_int_equal(size_ok("4.35KB"), 4350);
	assert_int_equal(size_ok("1.5MiB"), 3 << 19);
	assert_int_equal(size_ok("0.5KiB"), 512);
	assert_int_equal(size_ok(".25KiB"), 256);
	assert_int_equal(size_ok("0.05KB"), 50);
	assert_int_equal(size_ok("5."), 5);
	assert_int_equal(size_ok("007"), 7);
	/* A fraction of a byte is dropped. */
	assert_int_equal(size_ok("1.5B"), 1);
	assert_int_equal(size_ok("0.001KiB"), 1);
	/* Exponents move the point. */
	assert_int_equal(size_ok("2e9"), 2000000000);
	assert_int_equal(size_ok("1.5e3KB"), 1500000);
	assert_int_equal(size_ok("0e999"), 0);
	/* The largest: below 2^53. */
	assert_int_equal(size_ok("9007199254740991"), (1ull << 53) - 1);
	assert_int_equal(size_ok("8191.99TiB"), 9007188259624714ull);
}

static void test_refused(void **state)
{
	(void)state;
	static const char *units = "KiB, MiB, GiB, TiB";
	static const char *dec = "KB, MB, GB, TB, powers of 1000";
	size_bad("", units);
	size_bad("GiB", units);
	size_bad("1x", dec);
	size_bad("8 parsecs", units);
	size_bad("-1", units);
	size_bad("+1", units);
	size_bad("1.5.5", units);
	size_bad(".", units);
	size_bad("1 Ki B", units);
	size_bad("1PiB", units);
	size_bad("0x10", units);
	size_bad("1e", units);
	size_bad("nan", units);
	size_bad("inf", units);
	size_bad("1,5GB", units);
	size_bad("9007199254740992", "too large");
	size_bad("8PB", units);
	size_bad("8192TiB", "too large");
	size_bad("1e16", "too large");
	size_bad("1e999GB", "too large");
	size_bad("123456789012345678901234567890123456789012", "digits");
	/* Without a string or a place for the result. */
	uint64_t v;
	assert_int_equal(ecx_size_parse(NULL, &v, NULL, 0), ECX_EINVAL);
	assert_int_equal(ecx_size_parse("1", NULL, NULL, 0), ECX_EINVAL);
	/* A short why is cut, not overrun. */
	char why[8];
	memset(why, 'x', sizeof(why));
	assert_int_equal(ecx_size_parse("bad", &v, why, 5), ECX_EINVAL);
	assert_int_equal(strlen(why), 4);
	assert_int_equal(why[5], 'x');
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_units),
	    cmocka_unit_test(test_exact),
	    cmocka_unit_test(test_refused),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
