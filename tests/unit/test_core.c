/* Unit tests for src/core: errors, version, ids, dtypes, descriptors,
 * base64, constant-time compare, log level names, page size, the copy
 * probe. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/core.h"
#include "ecx/ecx.h"

#include <string.h>
#include <unistd.h>

static void test_version(void **state)
{
	(void)state;
	assert_string_equal(ecx_version(), ECX_VERSION_STRING);
	assert_int_equal(ecx_version_number(), ECX_VERSION_NUMBER);
}

static void test_errors(void **state)
{
	(void)state;
	assert_string_equal(ecx_strerror(0), "success");
	assert_string_equal(ecx_strerror(ECX_ENOTFOUND), "unknown mm_hash");
	assert_string_equal(ecx_strerror(ECX_ESIZE), "size mismatch");
	assert_string_equal(ecx_err_name(ECX_ETIMEDOUT), "ETIMEDOUT");
	assert_string_equal(ecx_strerror(-9999), "unknown error");
	assert_string_equal(ecx_err_name(12345), "UNKNOWN");
	/* Every code is negative except OK, and names and strings exist. */
#define CHECK(name, code, msg)                          \
	assert_true(code <= 0);                         \
	assert_string_equal(ecx_err_name(code), #name); \
	assert_string_equal(ecx_strerror(code), msg);
	ECX_ERR_MAP(CHECK)
#undef CHECK
}

static void test_id_ok(void **state)
{
	(void)state;
	const char *good[] = {
	    "a",
	    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
	    "lora:0123abcd", "A.b_c:d@e+f=g-h"};
	for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++)
		assert_int_equal(ecx_id_check(good[i], NULL, 0), 0);
	char max[ECX_ID_MAX + 1];
	memset(max, 'x', ECX_ID_MAX);
	max[ECX_ID_MAX] = '\0';
	assert_int_equal(ecx_id_check(max, NULL, 0), 0);
}

static void test_id_bad(void **state)
{
	(void)state;
	char why[160];
	assert_int_equal(ecx_id_check("", why, sizeof(why)), ECX_EID);
	assert_non_null(strstr(why, "empty"));
	assert_int_equal(ecx_id_check(NULL, why, sizeof(why)), ECX_EID);
	assert_int_equal(ecx_id_check("abc/def", why, sizeof(why)), ECX_EID);
	assert_non_null(strstr(why, "'/'"));
	assert_non_null(strstr(why, "offset 3"));
	assert_int_equal(ecx_id_check("a b", why, sizeof(why)), ECX_EID);
	assert_non_null(strstr(why, "0x20"));
	assert_int_equal(ecx_id_check("\xff", why, sizeof(why)), ECX_EID);
	assert_non_null(strstr(why, "0xff"));
	assert_int_equal(ecx_id_check("a\n", why, sizeof(why)), ECX_EID);
	assert_int_equal(ecx_id_check("%2e", why, sizeof(why)), ECX_EID);
	char big[ECX_ID_MAX + 2];
	memset(big, 'x', ECX_ID_MAX + 1);
	big[ECX_ID_MAX + 1] = '\0';
	assert_int_equal(ecx_id_check(big, why, sizeof(why)), ECX_EID);
	assert_non_null(strstr(why, "longer than 255"));
	/* why may be NULL or tiny without harm. */
	assert_int_equal(ecx_id_check("a/b", NULL, 0), ECX_EID);
	assert_int_equal(ecx_id_check("a/b", why, 1), ECX_EID);
	assert_string_equal(why, "");
}

static void test_dtypes(void **state)
{
	(void)state;
	static const struct {
		const char *name;
		size_t size;
	} want[] = {{"float16", 2}, {"bfloat16", 2},      {"float32", 4},
	            {"float64", 8}, {"int8", 1},          {"uint8", 1},
	            {"int16", 2},   {"int32", 4},         {"int64", 8},
	            {"bool", 1},    {"float8_e4m3fn", 1}, {"float8_e5m2", 1}};
	assert_int_equal(ECX_DTYPE_COUNT - 1, sizeof(want) / sizeof(want[0]));
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		ecx_dtype dt;
		assert_int_equal(ecx_dtype_parse(want[i].name, &dt), 0);
		assert_string_equal(ecx_dtype_name(dt), want[i].name);
		assert_int_equal(ecx_dtype_size(dt), want[i].size);
	}
	ecx_dtype dt = ECX_DTYPE_INVALID;
	assert_int_equal(ecx_dtype_parse("torch.bfloat16", &dt), 0);
	assert_int_equal(dt, ECX_DTYPE_BFLOAT16);
	assert_int_equal(ecx_dtype_parse("float", &dt), ECX_EDTYPE);
	assert_int_equal(ecx_dtype_parse("", &dt), ECX_EDTYPE);
	assert_int_equal(ecx_dtype_parse(NULL, &dt), ECX_EDTYPE);
	assert_null(ecx_dtype_name(ECX_DTYPE_INVALID));
	assert_null(ecx_dtype_name(ECX_DTYPE_COUNT));
	assert_int_equal(ecx_dtype_size((ecx_dtype)-3), 0);
}

static void test_tensor(void **state)
{
	(void)state;
	ecx_tensor_desc d;
	uint64_t shape[] = {1024, 3584};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, shape), 0);
	assert_int_equal(d.nbytes, 1024u * 3584u * 2u);
	char why[160];
	assert_int_equal(ecx_tensor_check(&d, why, sizeof(why)), 0);
	d.nbytes++;
	assert_int_equal(ecx_tensor_check(&d, why, sizeof(why)), ECX_ESIZE);
	assert_non_null(strstr(why, "disagrees"));
	/* A scalar and an empty tensor. */
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_INT64, 0, NULL), 0);
	assert_int_equal(d.nbytes, 8);
	uint64_t zero[] = {0, 5};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_INT64, 2, zero), 0);
	assert_int_equal(d.nbytes, 0);
	/* Overflow in any order of dimensions. */
	uint64_t huge[] = {UINT64_MAX / 2, 4};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_FLOAT32, 2, huge),
	                 ECX_ETOOBIG);
	uint64_t big2[] = {1u << 30, 1u << 30, 1u << 30};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_UINT8, 3, big2),
	                 ECX_ETOOBIG);
	uint64_t edge[] = {(uint64_t)1 << 52};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_INT16, 1, edge), 0);
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_INT32, 1, edge),
	                 ECX_ETOOBIG);
	uint64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_UINT8, 9, nine),
	                 ECX_EINVAL);
	memset(&d, 0, sizeof(d));
	d.dtype = (ecx_dtype)99;
	assert_int_equal(ecx_tensor_check(&d, why, sizeof(why)), ECX_EDTYPE);
	d.dtype = ECX_DTYPE_UINT8;
	d.ndim = 9;
	assert_int_equal(ecx_tensor_check(&d, why, sizeof(why)), ECX_EINVAL);
}

static void test_base64(void **state)
{
	(void)state;
	const char *vec[][2] = {{"", ""},
	                        {"f", "Zg=="},
	                        {"fo", "Zm8="},
	                        {"foo", "Zm9v"},
	                        {"foob", "Zm9vYg=="},
	                        {"fooba", "Zm9vYmE="},
	                        {"foobar", "Zm9vYmFy"}};
	for (size_t i = 0; i < sizeof(vec) / sizeof(vec[0]); i++) {
		char enc[16];
		unsigned char dec[16];
		ecx_b64_encode(vec[i][0], strlen(vec[i][0]), enc);
		assert_string_equal(enc, vec[i][1]);
		long n = ecx_b64_decode(enc, strlen(enc), dec, sizeof(dec));
		assert_int_equal(n, strlen(vec[i][0]));
		assert_memory_equal(dec, vec[i][0], (size_t)n);
	}
	unsigned char out[8];
	assert_int_equal(ecx_b64_decode("Zm9", 3, out, 8), -1);
	assert_int_equal(ecx_b64_decode("Zm9!", 4, out, 8), -1);
	assert_int_equal(ecx_b64_decode("Z===", 4, out, 8), -1);
	assert_int_equal(ecx_b64_decode("Zg==Zg==", 8, out, 8), -1);
	assert_int_equal(ecx_b64_decode("Zm9vYmFy", 8, out, 5), -1);
}

static void test_ct_equal(void **state)
{
	(void)state;
	assert_true(ecx_ct_equal("secret", 6, "secret", 6));
	assert_false(ecx_ct_equal("secret", 6, "secreT", 6));
	assert_false(ecx_ct_equal("secret", 6, "secret2", 7));
	assert_false(ecx_ct_equal("", 0, "x", 1));
	assert_true(ecx_ct_equal("", 0, "", 0));
}

static void test_log_names(void **state)
{
	(void)state;
	assert_int_equal(ecx_log_parse("error"), ECX_LOG_ERROR);
	assert_int_equal(ecx_log_parse("WARN"), ECX_LOG_WARN);
	assert_int_equal(ecx_log_parse("info"), ECX_LOG_INFO);
	assert_int_equal(ecx_log_parse("debug"), ECX_LOG_DEBUG);
	assert_int_equal(ecx_log_parse("off"), ECX_LOG_OFF);
	assert_int_equal(ecx_log_parse("loud"), -1);
	ecx_log_set_level(ECX_LOG_INFO);
	assert_true(ecx_log_enabled(ECX_LOG_INFO));
	assert_false(ecx_log_enabled(ECX_LOG_DEBUG));
	ecx_log_set_level(ECX_LOG_WARN);
}

static void test_page_size(void **state)
{
	(void)state;
	/* The kernel's, not 4 KiB: 64 KiB on some arm64 kernels. */
	assert_int_equal(ecx_page_size(), (uint64_t)sysconf(_SC_PAGESIZE));
	assert_int_equal(ecx_page_size() & (ecx_page_size() - 1), 0);
}

/* The copy probe measures (a ratio, not the 0 of "not measured" that
 * would have every producer pad again), once: the same answer each call,
 * and the verdict the ratio gives. */
static void test_copy_probe(void **state)
{
	(void)state;
	double r1 = 0, r2 = 0;
	bool slow = ecx_copy_offset_slow(21, &r1);
	assert_true(r1 > 0.1 && r1 < 1000);
	assert_true(ecx_copy_offset_slow(21, &r2) == slow);
	assert_true(r1 == r2);
	assert_true(slow == (r1 >= 4.0));
	assert_true(ecx_copy_offset_slow(21, NULL) == slow);
	/* A distance outside 1-63 is not measured: counted slow. */
	assert_true(ecx_copy_offset_slow(0, &r2));
	assert_true(r2 == 0);
}

/* A NULL handle is a bad argument, not a crash: the fork check each
 * public call makes first must not read it. */
static void test_null_handles(void **state)
{
	(void)state;
	ecx_tensor_desc d = {.dtype = ECX_DTYPE_UINT8, .ndim = 1, .shape = {4}};
	d.nbytes = 4;
	char b[4] = {0};
	assert_int_equal(ecx_producer_put(NULL, "a", &d, b), ECX_EINVAL);
	assert_int_equal(ecx_producer_remove(NULL, "a"), ECX_EINVAL);
	assert_int_equal(ecx_consumer_release(NULL, NULL, 0), ECX_EINVAL);
	ecx_producer_destroy(NULL);
	ecx_consumer_destroy(NULL);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_version),
	    cmocka_unit_test(test_errors),
	    cmocka_unit_test(test_id_ok),
	    cmocka_unit_test(test_id_bad),
	    cmocka_unit_test(test_dtypes),
	    cmocka_unit_test(test_tensor),
	    cmocka_unit_test(test_base64),
	    cmocka_unit_test(test_ct_equal),
	    cmocka_unit_test(test_log_names),
	    cmocka_unit_test(test_page_size),
	    cmocka_unit_test(test_copy_probe),
	    cmocka_unit_test(test_null_handles),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
