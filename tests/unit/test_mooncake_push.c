/* ecx_producer_push and ecx_producer_push_batch: held items written into
 * the Mooncake session of tests/common/mcrx.h at addresses the test picks
 * (as a push-mode reservation picks them), bytes checked; refusals before
 * a byte is sent; a receiver that refuses, stalls or is gone, each
 * bounded. ecx_producer_item_xxh3: the hash a push carries. Real sockets
 * on 127.0.0.1, port 0. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/mcrx.h"
#include "common/testutil.h"
#include "producer/producer.h"

#define KiB 1024u
#define MiB (1024u * 1024u)

static ecx_producer *producer(int mooncake, int timeout_ms)
{
	ecx_producer_params pp = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_CAPACITY | ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_TIMEOUT |
	        ECX_PRODUCER_PARAM_MOONCAKE,
	    .capacity_bytes = 48 * MiB,
	    .bind_host = "127.0.0.1",
	    .registry_port = 0,
	    .timeout_ms = timeout_ms * time_scale(),
	    .mooncake = mooncake};
	ecx_producer *p = NULL;
	char why[256] = "";
	if (ecx_producer_create(&pp, &p, why, sizeof(why)) != 0)
		fail_msg("producer: %s", why);
	return p;
}

static int headers(rx *x)
{
	return __atomic_load_n(&x->headers, __ATOMIC_RELAXED);
}

/* One item and a batch land where they were sent, whole; the writes after
 * the first cost no handshake and no connect. */
static void test_push(void **state)
{
	(void)state;
	ecx_producer *p = producer(1, 5000);
	assert_int_equal(tu_put(p, "a-7m", 7 * MiB), 0);
	assert_int_equal(tu_put(p, "a-64k", 64 * KiB), 0);
	rx x;
	assert_true(rx_start(&x, AF_INET, 24 * MiB, 2, RX_OK));
	uint64_t base = (uint64_t)(uintptr_t)x.mem;

	assert_int_equal(
	    ecx_producer_push(p, "a-7m", x.name, base + 256, 7 * MiB, 0), 0);
	assert_true(tu_check("a-7m", x.mem + 256, 7 * MiB));
	assert_int_equal(
	    ecx_producer_push(p, "a-64k", x.name, base + 8 * MiB, 64 * KiB, 0),
	    0);
	assert_true(tu_check("a-64k", x.mem + 8 * MiB, 64 * KiB));

	/* A batch: eight items, in parallel. */
	char ids[8][16];
	ecx_push_item e[8];
	for (int k = 0; k < 8; k++) {
		snprintf(ids[k], sizeof(ids[k]), "b-%d", k);
		assert_int_equal(
		    tu_put(p, ids[k], 1 * MiB + (uint64_t)k * 4096), 0);
		e[k] = (ecx_push_item){.id = ids[k],
		                       .dst_session = x.name,
		                       .dst_ptr = base + 10 * MiB +
		                                  (uint64_t)k * 1536 * KiB,
		                       .nbytes = 1 * MiB + (uint64_t)k * 4096,
		                       .status = -1};
	}
	assert_int_equal(ecx_producer_push_batch(p, e, 8, 0), 0);
	for (int k = 0; k < 8; k++) {
		assert_int_equal(e[k].status, 0);
		assert_true(tu_check(
		    ids[k], x.mem + 10 * MiB + (uint64_t)k * 1536 * KiB,
		    e[k].nbytes));
	}
	assert_int_equal(__atomic_load_n(&x.handshakes, __ATOMIC_RELAXED), 1);
	assert_true(__atomic_load_n(&x.accepts, __ATOMIC_RELAXED) <=
	            ECX_MC_POOL);
	ecx_producer_stats st;
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.pinned, 0);
	ecx_producer_destroy(p);
	rx_stop(&x);
}

/* Refused before a byte is sent: not held, the wrong size, a destination
 * outside the session's buffers, a producer with the wire off. A batch
 * with one bad entry writes the others and names the bad one. */
static void test_push_refused(void **state)
{
	(void)state;
	ecx_producer *p = producer(1, 5000);
	assert_int_equal(tu_put(p, "r-64k", 64 * KiB), 0);
	rx x;
	assert_true(rx_start(&x, AF_INET, 1 * MiB, 2, RX_OK));
	uint64_t base = (uint64_t)(uintptr_t)x.mem;

	assert_int_equal(ecx_producer_push(p, "nope", x.name, base, 16, 0),
	                 ECX_ENOTFOUND);
	assert_non_null(strstr(ecx_last_error(), "nope"));
	assert_int_equal(ecx_producer_push(p, "r-64k", x.name, base, 16, 0),
	                 ECX_ESIZE);
	assert_int_equal(ecx_producer_push(p, "r-64k", x.name,
	                                   base + 1 * MiB - 100, 64 * KiB, 0),
	                 ECX_EINVAL);
	assert_non_null(strstr(ecx_last_error(), "outside"));
	assert_non_null(strstr(ecx_last_error(), "r-64k"));
	assert_int_equal(
	    ecx_producer_push(p, "r-64k", x.name, base - 64 * KiB, 64 * KiB, 0),
	    ECX_EINVAL);
	assert_int_equal(headers(&x), 0);

	ecx_push_item e[3] = {{.id = "r-64k",
	                       .dst_session = x.name,
	                       .dst_ptr = base,
	                       .nbytes = 64 * KiB},
	                      {.id = "gone",
	                       .dst_session = x.name,
	                       .dst_ptr = base,
	                       .nbytes = 64 * KiB},
	                      {.id = "r-64k",
	                       .dst_session = x.name,
	                       .dst_ptr = base + 512 * KiB,
	                       .nbytes = 64 * KiB}};
	assert_int_equal(ecx_producer_push_batch(p, e, 3, 0), ECX_ENOTFOUND);
	assert_int_equal(e[0].status, 0);
	assert_int_equal(e[1].status, ECX_ENOTFOUND);
	assert_int_equal(e[2].status, 0);
	assert_non_null(strstr(ecx_last_error(), "gone"));
	assert_true(tu_check("r-64k", x.mem, 64 * KiB));
	assert_true(tu_check("r-64k", x.mem + 512 * KiB, 64 * KiB));
	ecx_producer_destroy(p);

	p = producer(0, 5000);
	assert_int_equal(tu_put(p, "r-64k", 64 * KiB), 0);
	assert_int_equal(
	    ecx_producer_push(p, "r-64k", x.name, base, 64 * KiB, 0),
	    ECX_EUNSUPPORTED);
	ecx_producer_destroy(p);
	rx_stop(&x);
}

typedef struct bg {
	ecx_producer *p;
	const char *session;
	uint64_t dst;
	uint64_t timeout_ms;
	int rc;
	uint64_t took_ns;
} bg;

static void *bg_push(void *arg)
{
	bg *b = arg;
	uint64_t t0 = ecx_now_ns();
	b->rc = ecx_producer_push(b->p, "s-7m", b->session, b->dst, 7 * MiB,
	                          b->timeout_ms);
	b->took_ns = ecx_now_ns() - t0;
	return NULL;
}

/* A receiver that refuses the write, one that stops reading (the push ends
 * at its deadline with the item pinned until then, and a remove meanwhile
 * frees it only after), and a session that is gone (refused at once). */
static void test_push_receiver_faults(void **state)
{
	(void)state;
	uint64_t scale = (uint64_t)time_scale();
	ecx_producer *p = producer(1, 5000);
	assert_int_equal(tu_put(p, "s-7m", 7 * MiB), 0);

	rx x;
	assert_true(rx_start(&x, AF_INET, 8 * MiB, 2, RX_REJECT));
	uint64_t base = (uint64_t)(uintptr_t)x.mem;
	assert_int_equal(
	    ecx_producer_push(p, "s-7m", x.name, base, 7 * MiB, 2000),
	    ECX_EINVAL);
	assert_true(__atomic_load_n(&x.rejects, __ATOMIC_RELAXED) >= 1);
	rx_stop(&x);

	assert_true(rx_start(&x, AF_INET, 8 * MiB, 2, RX_STALL));
	base = (uint64_t)(uintptr_t)x.mem;
	bg b = {
	    .p = p, .session = x.name, .dst = base, .timeout_ms = 400 * scale};
	pthread_t t;
	assert_int_equal(pthread_create(&t, NULL, bg_push, &b), 0);
	ecx_producer_stats st;
	for (int i = 0; i < 400; i++) {
		ecx_producer_stats_get(p, &st);
		if (st.pinned == 1)
			break;
		usleep(1000);
	}
	assert_int_equal(st.pinned, 1);
	assert_int_equal(ecx_producer_remove(p, "s-7m"), 0);
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.pinned, 1); /* still being written */
	pthread_join(t, NULL);
	assert_int_equal(b.rc, ECX_ETIMEDOUT);
	assert_true(b.took_ns >= 350 * scale * 1000000u);
	assert_true(b.took_ns < 1500 * scale * 1000000u);
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.pinned, 0);
	assert_int_equal(st.items, 0);
	rx_stop(&x);

	/* A session that is gone: nothing listens on its ports. */
	assert_int_equal(tu_put(p, "s-7m", 7 * MiB), 0);
	assert_true(rx_start(&x, AF_INET, 8 * MiB, 2, RX_OK));
	char gone[64];
	snprintf(gone, sizeof(gone), "%s", x.name);
	base = (uint64_t)(uintptr_t)x.mem;
	rx_stop(&x);
	uint64_t t0 = ecx_now_ns();
	int rc =
	    ecx_producer_push(p, "s-7m", gone, base, 7 * MiB, 1000 * scale);
	uint64_t took = ecx_now_ns() - t0;
	assert_true(rc == ECX_ECONNECT || rc == ECX_ETIMEDOUT);
	assert_true(took < 1500 * scale * 1000000u);
	assert_non_null(strstr(ecx_last_error(), gone));
	ecx_producer_destroy(p);
}

/* The hash a push carries: XXH3 of the bytes; with integrity on, the
 * put's, kept after the arena's bytes changed. */
static void test_item_xxh3(void **state)
{
	(void)state;
	for (int integrity = 0; integrity <= 1; integrity++) {
		ecx_producer_params pp = {.field_mask =
		                              ECX_PRODUCER_PARAM_CAPACITY |
		                              ECX_PRODUCER_PARAM_BIND_HOST |
		                              ECX_PRODUCER_PARAM_REGISTRY_PORT |
		                              ECX_PRODUCER_PARAM_INTEGRITY,
		                          .capacity_bytes = 4 * MiB,
		                          .bind_host = "127.0.0.1",
		                          .registry_port = 0,
		                          .integrity = integrity};
		ecx_producer *p = NULL;
		char why[256] = "";
		if (ecx_producer_create(&pp, &p, why, sizeof(why)) != 0)
			fail_msg("producer: %s", why);
		uint64_t n = 300 * KiB + 7;
		assert_int_equal(tu_put(p, "hashed", n), 0);
		unsigned char *want = malloc(n);
		tu_fill("hashed", want, n);
		uint64_t h = 0;
		assert_int_equal(ecx_producer_item_xxh3(p, "hashed", &h), 0);
		assert_true(h == ecx_xxh3(want, n));
		assert_int_equal(ecx_producer_item_xxh3(p, "absent", &h),
		                 ECX_ENOTFOUND);
		assert_int_equal(ecx_producer_item_xxh3(p, NULL, &h),
		                 ECX_EINVAL);
		/* A byte changed in the arena after put. */
		uint64_t cap = 0;
		unsigned char *arena = ecx_producer_arena(p, &cap);
		unsigned char *at = NULL;
		for (uint64_t off = 0; at == NULL && off + n <= cap; off++)
			if (memcmp(arena + off, want, n) == 0)
				at = arena + off;
		assert_non_null(at);
		at[1000] ^= 0x40;
		assert_int_equal(ecx_producer_item_xxh3(p, "hashed", &h), 0);
		if (integrity)
			assert_true(h == ecx_xxh3(want, n)); /* the put's */
		else
			assert_true(h == ecx_xxh3(at, n)); /* the bytes now */
		free(want);
		ecx_producer_destroy(p);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_push),
	    cmocka_unit_test(test_push_refused),
	    cmocka_unit_test(test_push_receiver_faults),
	    cmocka_unit_test(test_item_xxh3),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
