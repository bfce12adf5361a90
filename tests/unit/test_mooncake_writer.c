/* Unit tests for src/mooncake/writer.c against the receiver of
 * tests/common/mcrx.h (real sockets on 127.0.0.1 and ::1, port 0). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "mooncake/writer.h"

#include "common/mcrx.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static uint64_t deadline_in_ms(int ms)
{
	return ecx_now_ns() + (uint64_t)ms * time_scale() * 1000000u;
}

static ecx_mc_writer *writer(void)
{
	ecx_mc_writer *w = NULL;
	char why[160];
	assert_int_equal(
	    ecx_mc_writer_create("127.0.0.1:1", &w, why, sizeof(why)), 0);
	return w;
}

static uint8_t *pattern(size_t n, unsigned seed)
{
	uint8_t *p = malloc(n);
	assert_non_null(p);
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(i * 131 + seed + (i >> 12));
	return p;
}

/* Bytes land where asked; fifty writes cost one handshake and one data
 * connection. */
static void test_write_pooled(void **state)
{
	(void)state;
	rx x;
	assert_true(rx_start(&x, AF_INET, 8u << 20, 2, RX_OK));
	ecx_mc_writer *w = writer();
	char why[240];
	size_t big = 7u << 20;
	uint8_t *src = pattern(big, 7);
	assert_int_equal(
	    ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem + 4096, src, big,
	                 deadline_in_ms(5000), why, sizeof(why)),
	    0);
	assert_memory_equal(x.mem + 4096, src, big);
	for (int i = 0; i < 50; i++) {
		uint8_t *s = pattern(65536, (unsigned)i);
		uint64_t off = (uint64_t)i * 65536;
		int rc =
		    ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem + off, s,
		                 65536, deadline_in_ms(5000), why, sizeof(why));
		if (rc != 0)
			fail_msg("write %d: %s", i, why);
		assert_memory_equal(x.mem + off, s, 65536);
		free(s);
	}
	ecx_mc_writer_stats st;
	ecx_mc_writer_stats_get(w, &st);
	assert_int_equal(st.handshakes, 1);
	assert_int_equal(st.connects, 1);
	assert_int_equal(st.writes, 51);
	assert_int_equal(st.bytes, big + 50 * 65536);
	assert_int_equal(x.handshakes, 1);
	assert_int_equal(x.accepts, 1);
	assert_int_equal(x.writes, 51);
	ecx_mc_writer_destroy(w);
	free(src);
	rx_stop(&x);
}

/* Outside the advertised buffer, or to a v1 segment: refused before a
 * byte is sent (the receiver reads no header). */
static void test_write_checked_first(void **state)
{
	(void)state;
	rx x;
	assert_true(rx_start(&x, AF_INET, 65536, 2, RX_OK));
	ecx_mc_writer *w = writer();
	char why[240];
	uint8_t src[128] = {1};
	uint64_t base = (uint64_t)(uintptr_t)x.mem;
	assert_int_equal(ecx_mc_write(w, x.name, base + 65536 - 64, src, 128,
	                              deadline_in_ms(2000), why, sizeof(why)),
	                 ECX_EINVAL);
	assert_non_null(strstr(why, "outside"));
	assert_int_equal(ecx_mc_write(w, x.name, base - 1, src, 1,
	                              deadline_in_ms(2000), why, sizeof(why)),
	                 ECX_EINVAL);
	assert_int_equal(ecx_mc_write(w, x.name, base, src, 0,
	                              deadline_in_ms(2000), why, sizeof(why)),
	                 ECX_EINVAL);
	assert_int_equal(ecx_mc_write(w, "127.0.0.1", base, src, 1,
	                              deadline_in_ms(2000), why, sizeof(why)),
	                 ECX_EINVAL);
	usleep(20000);
	assert_int_equal(x.headers, 0);
	assert_int_equal(x.accepts, 0);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);

	assert_true(rx_start(&x, AF_INET, 65536, 1, RX_OK));
	w = writer();
	assert_int_equal(ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem,
	                              src, 128, deadline_in_ms(2000), why,
	                              sizeof(why)),
	                 ECX_EUNSUPPORTED);
	assert_non_null(strstr(why, "tcp_proto_version 1"));
	usleep(20000);
	assert_int_equal(x.accepts, 0);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);
}

/* A reject status is reported as such; a status without the magic, and a
 * metadata answer that is not JSON, as malformed. */
static void test_write_refused(void **state)
{
	(void)state;
	rx x;
	char why[240];
	uint8_t src[4096];
	memset(src, 5, sizeof(src));
	assert_true(rx_start(&x, AF_INET, 65536, 2, RX_REJECT));
	ecx_mc_writer *w = writer();
	assert_int_equal(ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem,
	                              src, sizeof(src), deadline_in_ms(2000),
	                              why, sizeof(why)),
	                 ECX_EINVAL);
	assert_non_null(strstr(why, "refused"));
	ecx_mc_writer_stats st;
	ecx_mc_writer_stats_get(w, &st);
	assert_int_equal(st.rejected, 1);
	assert_int_equal(x.mem[0], 0);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);

	assert_true(rx_start(&x, AF_INET, 65536, 2, RX_BAD_STATUS));
	w = writer();
	assert_int_equal(ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem,
	                              src, sizeof(src), deadline_in_ms(2000),
	                              why, sizeof(why)),
	                 ECX_EPROTO);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);

	assert_true(rx_start(&x, AF_INET, 65536, 2, RX_GARBAGE_META));
	w = writer();
	assert_int_equal(ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem,
	                              src, sizeof(src), deadline_in_ms(2000),
	                              why, sizeof(why)),
	                 ECX_EPROTO);
	assert_non_null(strstr(why, "handshake"));
	ecx_mc_writer_destroy(w);
	rx_stop(&x);
}

static void *shut_later(void *arg)
{
	usleep(100000);
	ecx_mc_writer_shutdown(arg);
	return NULL;
}

/* A receiver that takes the connection but never reads: the write ends at
 * its deadline (a 7 MiB one fills the socket buffers; a small one waits
 * for the status); shutdown ends a wait at once. */
static void test_write_stalled(void **state)
{
	(void)state;
	rx x;
	char why[240];
	assert_true(rx_start(&x, AF_INET, 8u << 20, 2, RX_STALL));
	ecx_mc_writer *w = writer();
	size_t sizes[] = {7u << 20, 4096};
	for (int i = 0; i < 2; i++) {
		uint8_t *src = pattern(sizes[i], 1);
		uint64_t t0 = ecx_now_ns();
		int ms = 300;
		int rc = ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem,
		                      src, sizes[i], deadline_in_ms(ms), why,
		                      sizeof(why));
		uint64_t el = (ecx_now_ns() - t0) / 1000000u;
		assert_int_equal(rc, ECX_ETIMEDOUT);
		assert_true(el >= (uint64_t)ms - 5);
		assert_true(el < (uint64_t)(ms + 200) * time_scale());
		free(src);
	}
	ecx_mc_writer_destroy(w);

	/* shutdown from another thread ends a 10 s wait at once */
	w = writer();
	pthread_t t;
	assert_int_equal(pthread_create(&t, NULL, shut_later, w), 0);
	uint8_t small[64] = {0};
	uint64_t t0 = ecx_now_ns();
	assert_int_equal(ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem,
	                              small, sizeof(small),
	                              deadline_in_ms(10000), why, sizeof(why)),
	                 ECX_ECLOSED);
	assert_true(ecx_now_ns() - t0 < 2000000000ull * time_scale());
	pthread_join(t, NULL);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);
}

/* A session whose data port moved (its engine restarted on the same
 * handshake port): the pooled connection fails, the writer asks for the
 * descriptor again and writes. */
static void test_write_reresolve(void **state)
{
	(void)state;
	rx x;
	char why[240];
	assert_true(rx_start(&x, AF_INET, 65536, 2, RX_OK));
	ecx_mc_writer *w = writer();
	uint8_t src[1024];
	memset(src, 9, sizeof(src));
	uint64_t base = (uint64_t)(uintptr_t)x.mem;
	assert_int_equal(ecx_mc_write(w, x.name, base, src, sizeof(src),
	                              deadline_in_ms(2000), why, sizeof(why)),
	                 0);
	rx_data_stop(&x);
	rx_data_start(&x);
	memset(src, 10, sizeof(src));
	int rc = ecx_mc_write(w, x.name, base, src, sizeof(src),
	                      deadline_in_ms(2000), why, sizeof(why));
	if (rc != 0)
		fail_msg("%s", why);
	assert_memory_equal(x.mem, src, sizeof(src));
	assert_int_equal(x.handshakes, 2);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);

	/* Nothing listening: refused at once. */
	uint16_t port = 0;
	int fd = listen_on(AF_INET, &port);
	close(fd);
	char name[64];
	snprintf(name, sizeof(name), "127.0.0.1:%u", (unsigned)port);
	w = writer();
	uint64_t t0 = ecx_now_ns();
	assert_int_equal(ecx_mc_write(w, name, 4096, src, 16,
	                              deadline_in_ms(3000), why, sizeof(why)),
	                 ECX_ECONNECT);
	assert_true(ecx_now_ns() - t0 < 1000000000ull);
	ecx_mc_writer_destroy(w);
}

static void test_write_ipv6(void **state)
{
	(void)state;
	rx x;
	if (!rx_start(&x, AF_INET6, 65536, 2, RX_OK)) {
		skip();
		return;
	}
	ecx_mc_writer *w = writer();
	char why[240];
	uint8_t *src = pattern(65536, 3);
	int rc = ecx_mc_write(w, x.name, (uint64_t)(uintptr_t)x.mem, src, 65536,
	                      deadline_in_ms(2000), why, sizeof(why));
	if (rc != 0)
		fail_msg("%s: %s", x.name, why);
	assert_memory_equal(x.mem, src, 65536);
	free(src);
	ecx_mc_writer_destroy(w);
	rx_stop(&x);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_write_pooled),
	    cmocka_unit_test(test_write_checked_first),
	    cmocka_unit_test(test_write_refused),
	    cmocka_unit_test(test_write_stalled),
	    cmocka_unit_test(test_write_reresolve),
	    cmocka_unit_test(test_write_ipv6),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
