/*
 * The two-step put (ecx_producer_reserve / commit / cancel) with a real
 * producer (embedded registry on a free port of 127.0.0.1) and a real
 * consumer in this process: a reservation is invisible until committed,
 * holds its room against eviction, and loads byte for byte once committed;
 * ecx_producer_put_stored copies large items exactly and says what it did.
 * Only the public header is used.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <ecx/ecx.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KiB 1024u

static ecx_producer *producer(uint64_t capacity, int integrity)
{
	ecx_producer_params p = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_CAPACITY | ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_INTEGRITY,
	    .capacity_bytes = capacity,
	    .bind_host = "127.0.0.1",
	    .registry_port = 0,
	    .integrity = integrity};
	ecx_producer *prod = NULL;
	char why[256] = "";
	if (ecx_producer_create(&p, &prod, why, sizeof(why)) != 0)
		fail_msg("producer: %s", why);
	return prod;
}

static ecx_consumer *consumer(ecx_producer *prod, int integrity)
{
	char url[64];
	snprintf(url, sizeof(url), "http://127.0.0.1:%u",
	         ecx_producer_registry_port(prod));
	ecx_consumer_params p = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_TIMEOUT |
	        ECX_CONSUMER_PARAM_RECV_CAPACITY | ECX_CONSUMER_PARAM_INTEGRITY,
	    .registry = url,
	    .timeout_ms = 5000,
	    .recv_capacity = 0,
	    .integrity = integrity};
	ecx_consumer *c = NULL;
	char why[256] = "";
	if (ecx_consumer_create(&p, &c, why, sizeof(why)) != 0)
		fail_msg("consumer: %s", why);
	return c;
}

static ecx_tensor_desc bytes_desc(uint64_t n)
{
	ecx_tensor_desc d;
	uint64_t shape[1] = {n};
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_UINT8, 1, shape), 0);
	return d;
}

static int lookup_status(ecx_consumer *c, const char *id)
{
	ecx_item it = {.id = id};
	assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
	return it.status;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 31u + seed);
}

/* Reserve, write, commit, then load: the bytes written in place arrive. */
static void test_reserve_commit_load(void **state)
{
	(void)state;
	ecx_producer *prod = producer(1u << 20, 1);
	ecx_consumer *c = consumer(prod, 1);
	ecx_tensor_desc d = bytes_desc(100 * KiB);
	void *dst = NULL;
	assert_int_equal(ecx_producer_reserve(prod, "r1", &d, &dst), 0);
	assert_non_null(dst);
	uint64_t cap = 0;
	char *base = ecx_producer_arena(prod, &cap);
	assert_true(cap >= 1u << 20);
	assert_true((char *)dst >= base &&
	            (char *)dst + d.nbytes <= base + cap);
	fill(dst, d.nbytes, 7);
	/* Not visible before commit; a put of the id meanwhile is refused. */
	assert_int_equal(lookup_status(c, "r1"), ECX_ENOTFOUND);
	unsigned char other[16] = {0};
	ecx_tensor_desc d16 = bytes_desc(16);
	assert_int_equal(ecx_producer_put(prod, "r1", &d, other), ECX_EBUSY);
	assert_int_equal(ecx_producer_put(prod, "r1", &d16, other), ECX_EINVAL);
	assert_int_equal(ecx_producer_commit(prod, "r1"), 0);
	/* Committed once: a second commit has nothing to commit. */
	assert_int_equal(ecx_producer_commit(prod, "r1"), ECX_ENOTFOUND);
	ecx_item it = {.id = "r1"};
	assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
	assert_int_equal(it.status, 0);
	unsigned char *got = malloc(d.nbytes);
	unsigned char *want = malloc(d.nbytes);
	fill(want, d.nbytes, 7);
	it.dst = got;
	assert_int_equal(ecx_consumer_load(c, &it, 1), 0);
	assert_memory_equal(got, want, d.nbytes);
	/* The id held already: nothing to write, the first bytes stay. */
	dst = base;
	assert_int_equal(ecx_producer_reserve(prod, "r1", &d, &dst), 0);
	assert_null(dst);
	free(got);
	free(want);
	ecx_consumer_destroy(c);
	ecx_producer_destroy(prod);
}

/* A reservation holds its room: it is never evicted, cancel gives it
 * back, and the committed items around it are evicted as usual. */
static void test_reservations_hold_room(void **state)
{
	(void)state;
	ecx_producer *prod = producer(256 * KiB, 0);
	ecx_consumer *c = consumer(prod, 0);
	ecx_tensor_desc d = bytes_desc(100 * KiB);
	void *a = NULL, *b = NULL, *x = NULL;
	assert_int_equal(ecx_producer_reserve(prod, "ra", &d, &a), 0);
	assert_int_equal(ecx_producer_reserve(prod, "rb", &d, &b), 0);
	assert_ptr_not_equal(a, b);
	/* No room for a third, and nothing may be evicted for it. */
	assert_int_equal(ecx_producer_reserve(prod, "rc", &d, &x), ECX_ENOSPC);
	assert_null(x);
	ecx_producer_stats s;
	ecx_producer_stats_get(prod, &s);
	uint64_t used = s.bytes_used;
	assert_int_equal(ecx_producer_cancel(prod, "ra"), 0);
	assert_int_equal(ecx_producer_cancel(prod, "ra"), ECX_ENOTFOUND);
	ecx_producer_stats_get(prod, &s);
	assert_true(s.bytes_used < used);
	assert_int_equal(lookup_status(c, "ra"), ECX_ENOTFOUND);
	/* Committed items are evicted for new ones; rb, reserved, stays. */
	unsigned char *src = calloc(1, d.nbytes);
	assert_int_equal(ecx_producer_put(prod, "p1", &d, src), 0);
	assert_int_equal(ecx_producer_put(prod, "p2", &d, src), 0);
	ecx_producer_stats_get(prod, &s);
	assert_int_equal(s.evictions, 1);
	assert_int_equal(lookup_status(c, "p1"), ECX_ENOTFOUND);
	assert_int_equal(lookup_status(c, "p2"), 0);
	fill(b, d.nbytes, 3);
	assert_int_equal(ecx_producer_commit(prod, "rb"), 0);
	assert_int_equal(lookup_status(c, "rb"), 0);
	/* Zero bytes: a place to write nothing, committed like the rest. */
	ecx_tensor_desc z = bytes_desc(0);
	void *zd = NULL;
	assert_int_equal(ecx_producer_reserve(prod, "rz", &z, &zd), 0);
	assert_non_null(zd);
	assert_int_equal(ecx_producer_commit(prod, "rz"), 0);
	assert_int_equal(lookup_status(c, "rz"), 0);
	/* Bad arguments. */
	assert_int_equal(ecx_producer_reserve(prod, "bad/id", &d, &x), ECX_EID);
	assert_int_equal(ecx_producer_reserve(prod, "ok", NULL, &x),
	                 ECX_EINVAL);
	assert_int_equal(ecx_producer_commit(prod, "never"), ECX_ENOTFOUND);
	free(src);
	ecx_consumer_destroy(c);
	ecx_producer_destroy(prod);
}

/* ecx_producer_put_stored: items from unaligned sources, of sizes that are
 * no multiple of a cache line, each side of the sizes from which the copy
 * into the arena uses non-temporal stores (64 KiB; 256 KiB with integrity
 * on: items.c), load byte for byte, by a consumer that checks hashes and
 * by one that does not; *stored says whether the bytes were copied. */
static void put_stored(int integrity)
{
	ecx_producer *prod = producer(8u << 20, integrity);
	ecx_consumer *c = consumer(prod, integrity);
	size_t sizes[] = {1000 * KiB + 37, 256 * KiB, 256 * KiB - 1,
	                  100 * KiB + 5,   64 * KiB,  64 * KiB - 1};
	enum { N = sizeof(sizes) / sizeof(sizes[0]) };
	unsigned char *src = malloc(1100 * KiB);
	unsigned char *got = malloc(1100 * KiB);
	for (size_t k = 0; k < N; k++) {
		char id[16];
		snprintf(id, sizeof(id), "ps%zu", k);
		ecx_tensor_desc d = bytes_desc(sizes[k]);
		fill(src + k + 1, sizes[k], (unsigned)k);
		int stored = -1;
		assert_int_equal(
		    ecx_producer_put_stored(prod, id, &d, src + k + 1, &stored),
		    0);
		assert_int_equal(stored, 1);
		ecx_item it = {.id = id};
		assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
		assert_int_equal(it.status, 0);
		memset(got, 0xee, sizes[k]);
		it.dst = got;
		assert_int_equal(ecx_consumer_load(c, &it, 1), 0);
		assert_int_equal(it.status, 0);
		assert_memory_equal(got, src + k + 1, sizes[k]);
		/* Held already: nothing copied, the first bytes stay. */
		memset(src, 0, sizes[k] + N + 1);
		assert_int_equal(
		    ecx_producer_put_stored(prod, id, &d, src, &stored), 0);
		assert_int_equal(stored, 0);
	}
	ecx_tensor_desc d = bytes_desc(16);
	assert_int_equal(ecx_producer_put_stored(prod, "ps9", &d, src, NULL),
	                 ECX_EINVAL);
	free(src);
	free(got);
	ecx_consumer_destroy(c);
	ecx_producer_destroy(prod);
}

static void test_put_stored(void **state)
{
	(void)state;
	put_stored(1);
	put_stored(0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_reserve_commit_load),
	    cmocka_unit_test(test_reservations_hold_room),
	    cmocka_unit_test(test_put_stored),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
