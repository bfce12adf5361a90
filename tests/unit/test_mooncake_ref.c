/* An ecx consumer loading from a producer that speaks only the reference's
 * protocol: its entries in the reference's shape (nbytes, shape, dtype,
 * producer_zmq; published here through an ecx registry with no epoch), a
 * ZeroMQ REP socket answering the reference's pull op, and a Mooncake-wire
 * writer built from the frame codec (handshake for the segment, then a
 * version-2 WRITE into dst_session at dst_ptr). The producer is a thread
 * of this test, with ways to misbehave: forget an item, write beside the
 * destination and say ok, answer late and write after the load's end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "mooncake/frame.h"
#include <ecx/ecx.h>

#include "common/testutil.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <zmq.h>

#define NITEMS 8

/* How the producer behaves. */
enum { GOOD, SHIFTED, LATE };

typedef struct refprod {
	void *zctx, *rep;
	char address[64];
	pthread_t thread;
	/* Set by the test while the thread runs: atomics. */
	_Atomic int mode;
	_Atomic int
	    late_ms; /* LATE: sleep this long, then write, then answer */
	/* the items it holds */
	const char *ids[NITEMS];
	uint8_t *bytes[NITEMS];
	size_t sizes[NITEMS];
	_Atomic size_t n;
	_Atomic int served, failed;
} refprod;

static void msleep(int ms)
{
	struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&t, NULL);
}

static int dial(const char *host, uint16_t port)
{
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai;
	char ps[8];
	snprintf(ps, sizeof(ps), "%u", port);
	if (getaddrinfo(host, ps, &hints, &ai) != 0)
		return -1;
	int fd = socket(ai->ai_family, SOCK_STREAM, 0);
	if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
		close(fd);
		fd = -1;
	}
	freeaddrinfo(ai);
	struct timeval tv = {5, 0};
	if (fd >= 0)
		setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	return fd;
}

static bool send_all(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;
	while (n > 0) {
		ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
		if (k <= 0)
			return false;
		b += k;
		n -= (size_t)k;
	}
	return true;
}

/* The Mooncake writer: the segment of session, then one acknowledged
 * WRITE of n bytes at addr. Returns 0, or -1 as Mooncake's engine does. */
static int mc_write(const char *session, uint64_t addr, const void *src,
                    size_t n)
{
	char host[256];
	uint16_t port;
	char why[200];
	if (ecx_mc_host_port(session, host, sizeof(host), &port, why,
	                     sizeof(why)) != 0)
		return -1;
	int fd = dial(host, port);
	if (fd < 0)
		return -1;
	const char *mine = "{\"name\":\"refprod:1\",\"protocol\":\"tcp\","
	                   "\"tcp_data_port\":1,\"buffers\":[]}\n";
	size_t fl;
	uint8_t *f =
	    ecx_mc_hs_frame_encode(ECX_MC_HS_METADATA, mine, strlen(mine), &fl);
	send_all(fd, f, fl);
	free(f);
	/* Static: a free of a large block would munmap, and the consumer's
	 * unmap hook then runs on this thread (TSan deadlocks reporting its
	 * suppressed race there). One producer thread uses it. */
	static uint8_t ans[1 << 20];
	size_t got = 0;
	for (;;) {
		ssize_t k = recv(fd, ans + got, (1 << 20) - got, 0);
		if (k <= 0)
			break;
		got += (size_t)k;
	}
	close(fd);
	ecx_mc_segment s;
	if (got < 9 || ecx_mc_segment_decode((char *)ans + 9, got - 9, &s, why,
	                                     sizeof(why)) != 0)
		return -1;
	/* The data port at the host the segment's name gives. */
	ecx_mc_host_port(s.name, host, sizeof(host), &port, why, sizeof(why));
	fd = dial(host, s.tcp_data_port);
	ecx_mc_segment_free(&s);
	if (fd < 0)
		return -1;
	uint8_t h[ECX_MC_HDR_LEN], st[ECX_MC_STATUS_LEN];
	ecx_mc_hdr_encode(
	    &(ecx_mc_hdr){.size = n,
	                  .addr = addr,
	                  .opcode = ECX_MC_OP_WRITE | ECX_MC_OP_V2},
	    h);
	int rc = -1;
	if (send_all(fd, h, sizeof(h)) && send_all(fd, src, n)) {
		size_t k = 0;
		while (k < sizeof(st)) {
			ssize_t r = recv(fd, st + k, sizeof(st) - k, 0);
			if (r <= 0)
				break;
			k += (size_t)r;
		}
		if (k == sizeof(st) &&
		    ecx_mc_status_decode(st) == ECX_MC_STATUS_OK)
			rc = 0;
	}
	close(fd);
	return rc;
}

static void *prod_run(void *arg)
{
	refprod *p = arg;
	char buf[4096];
	for (;;) {
		int n = zmq_recv(p->rep, buf, sizeof(buf) - 1, 0);
		if (n < 0)
			return NULL; /* the context ended */
		buf[n] = '\0';
		cJSON *o = cJSON_Parse(buf);
		const char *op = cJSON_GetStringValue(
		    cJSON_GetObjectItemCaseSensitive(o, "op"));
		char out[256];
		if (op == NULL || strcmp(op, "pull") != 0) {
			snprintf(out, sizeof(out),
			         "{\"ok\": false, \"err\": \"unknown op\"}");
		} else {
			const char *id = cJSON_GetStringValue(
			    cJSON_GetObjectItemCaseSensitive(o, "mm_hash"));
			const char *sess = cJSON_GetStringValue(
			    cJSON_GetObjectItemCaseSensitive(o, "dst_session"));
			uint64_t ptr = (uint64_t)cJSON_GetNumberValue(
			    cJSON_GetObjectItemCaseSensitive(o, "dst_ptr"));
			size_t nb = (size_t)cJSON_GetNumberValue(
			    cJSON_GetObjectItemCaseSensitive(o, "nbytes"));
			size_t k = 0;
			while (k < p->n && strcmp(p->ids[k], id) != 0)
				k++;
			if (k == p->n) {
				snprintf(out, sizeof(out),
				         "{\"ok\": false, \"err\": \"unknown "
				         "mm_hash\"}");
			} else if (nb != p->sizes[k]) {
				snprintf(out, sizeof(out),
				         "{\"ok\": false, \"err\": \"size "
				         "mismatch\"}");
			} else {
				if (p->mode == LATE)
					msleep(p->late_ms);
				int ret = mc_write(
				    sess, ptr + (p->mode == SHIFTED ? 8 : 0),
				    p->bytes[k], nb);
				if (ret != 0)
					p->failed++;
				p->served++;
				/* The shifted one says ok whatever came of
				 * it. */
				if (p->mode == SHIFTED)
					ret = 0;
				snprintf(out, sizeof(out),
				         "{\"ok\": %s, \"mooncake_ret\": %d}",
				         ret == 0 ? "true" : "false", ret);
			}
		}
		cJSON_Delete(o);
		zmq_send(p->rep, out, strlen(out), 0);
	}
}

typedef struct fix {
	ecx_registry *reg;
	char url[64];
	refprod prod;
	ecx_client *cl;
} fix;

static char ids[NITEMS][32];

static int setup(void **state)
{
	fix *f = calloc(1, sizeof(*f));
	ecx_registry_params rp = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                        ECX_REGISTRY_PARAM_PORT,
	                          .bind_host = "127.0.0.1"};
	char why[256];
	assert_int_equal(ecx_registry_create(&rp, &f->reg, why, sizeof(why)),
	                 0);
	snprintf(f->url, sizeof(f->url), "http://127.0.0.1:%u",
	         ecx_registry_port(f->reg));
	ecx_client_params cp = {.field_mask = ECX_CLIENT_PARAM_REGISTRY,
	                        .registry = f->url};
	assert_int_equal(ecx_client_create(&cp, &f->cl, why, sizeof(why)), 0);
	refprod *p = &f->prod;
	p->zctx = zmq_ctx_new();
	p->rep = zmq_socket(p->zctx, ZMQ_REP);
	assert_int_equal(zmq_bind(p->rep, "tcp://127.0.0.1:*"), 0);
	size_t al = sizeof(p->address);
	zmq_getsockopt(p->rep, ZMQ_LAST_ENDPOINT, p->address, &al);
	/* 64 KiB, 1 MiB, 7 MiB, then small ones. */
	static const size_t rows[NITEMS] = {64 * 4, 4096, 7 * 4096, 1,
	                                    2,      3,    4,        5};
	for (size_t i = 0; i < NITEMS; i++) {
		snprintf(ids[i], sizeof(ids[i]), "ref-%zu", i);
		ecx_item it;
		memset(&it, 0, sizeof(it));
		it.id = ids[i];
		uint64_t shape[2] = {rows[i], 128};
		ecx_tensor_set(&it.desc, ECX_DTYPE_BFLOAT16, 2, shape);
		snprintf(it.producer, sizeof(it.producer), "%s", p->address);
		it.epoch = ECX_EPOCH_REFERENCE; /* published with no epoch */
		assert_int_equal(ecx_client_publish(f->cl, &it), 0);
		p->ids[i] = ids[i];
		p->sizes[i] = it.desc.nbytes;
		p->bytes[i] = malloc(it.desc.nbytes);
		tu_fill(ids[i], p->bytes[i], it.desc.nbytes);
	}
	p->n = NITEMS;
	assert_int_equal(pthread_create(&p->thread, NULL, prod_run, p), 0);
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	fix *f = *state;
	refprod *p = &f->prod;
	zmq_ctx_shutdown(p->zctx);
	pthread_join(p->thread, NULL);
	zmq_close(p->rep);
	zmq_ctx_term(p->zctx);
	for (size_t i = 0; i < p->n; i++)
		free(p->bytes[i]);
	ecx_client_destroy(f->cl);
	ecx_registry_destroy(f->reg);
	free(f);
	return 0;
}

static ecx_consumer *consumer(fix *f, const char *mode, int timeout_ms)
{
	ecx_consumer_params cp = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_RECV_CAPACITY |
	        ECX_CONSUMER_PARAM_TIMEOUT | ECX_CONSUMER_PARAM_MOONCAKE_HOST |
	        (mode ? ECX_CONSUMER_PARAM_MOONCAKE : 0),
	    .registry = f->url,
	    .recv_capacity = 64u << 20,
	    .timeout_ms = timeout_ms,
	    .mooncake = mode,
	    .mooncake_host = "127.0.0.1"};
	ecx_consumer *c = NULL;
	char why[256];
	int rc = ecx_consumer_create(&cp, &c, why, sizeof(why));
	if (rc != 0)
		fail_msg("consumer: %s", why);
	return c;
}

static void lookup(ecx_consumer *c, ecx_item *it, size_t n, bool lease)
{
	memset(it, 0, n * sizeof(*it));
	for (size_t i = 0; i < n; i++)
		it[i].id = ids[i];
	assert_int_equal(lease ? ecx_consumer_lookup_lease(c, it, n, 0)
	                       : ecx_consumer_lookup(c, it, n),
	                 0);
	for (size_t i = 0; i < n; i++) {
		assert_int_equal(it[i].status, 0);
		assert_true(it[i].epoch == ECX_EPOCH_REFERENCE);
		assert_int_equal(it[i].lease, 0);
	}
}

/* The whole batch, into the arena and into the caller's memory, checked
 * byte for byte; a leased lookup finds them all too. */
static void test_ref_load(void **state)
{
	fix *f = *state;
	ecx_consumer *c = consumer(f, NULL, 5000);
	ecx_item it[NITEMS];
	lookup(c, it, NITEMS, true);
	for (size_t i = 0; i < NITEMS; i++) {
		it[i].dst = ecx_consumer_alloc(c, it[i].desc.nbytes);
		assert_non_null(it[i].dst);
	}
	int rc = ecx_consumer_load(c, it, NITEMS);
	if (rc != 0)
		fail_msg("load: %s", ecx_consumer_last_error());
	for (size_t i = 0; i < NITEMS; i++) {
		assert_int_equal(it[i].status, 0);
		assert_true(tu_check(ids[i], it[i].dst, it[i].desc.nbytes));
		ecx_consumer_free(c, it[i].dst);
	}
	/* Caller memory, not registered before. */
	lookup(c, it, 3, false);
	uint8_t *mine[3];
	for (size_t i = 0; i < 3; i++) {
		mine[i] = malloc(it[i].desc.nbytes);
		memset(mine[i], 0, it[i].desc.nbytes);
		it[i].dst = mine[i];
	}
	assert_int_equal(ecx_consumer_load(c, it, 3), 0);
	for (size_t i = 0; i < 3; i++) {
		assert_true(tu_check(ids[i], mine[i], it[i].desc.nbytes));
		free(mine[i]);
	}
	ecx_consumer_stats st;
	ecx_consumer_stats_get(c, &st);
	assert_int_equal(st.mc_pulls, NITEMS + 3);
	assert_int_equal(st.loaded, NITEMS + 3);
	assert_int_equal(st.mc_rej_range + st.mc_rej_expired, 0);
	assert_int_equal(st.connections, 0); /* no hello */
	ecx_consumer_destroy(c);
}

static void test_ref_errors(void **state)
{
	fix *f = *state;
	ecx_consumer *c = consumer(f, NULL, 2000);
	ecx_item it[1];
	lookup(c, it, 1, false);
	it[0].dst = ecx_consumer_alloc(c, it[0].desc.nbytes);
	/* Forgotten by its producer. */
	f->prod.n = 0;
	assert_int_equal(ecx_consumer_load(c, it, 1), ECX_ENOTFOUND);
	assert_non_null(
	    strstr(ecx_consumer_last_error(), "no longer holds it"));
	f->prod.n = NITEMS;
	/* Off: said so. */
	ecx_consumer *off = consumer(f, "off", 2000);
	ecx_item o[1];
	lookup(off, o, 1, false);
	o[0].dst = ecx_consumer_alloc(off, o[0].desc.nbytes);
	assert_int_equal(ecx_consumer_load(off, o, 1), ECX_EUNSUPPORTED);
	assert_non_null(strstr(ecx_consumer_last_error(), "reference"));
	ecx_consumer_destroy(off);
	/* A write beside the destination, and "ok": refused by the receiver,
	 * nothing landed, and the load says so. */
	f->prod.mode = SHIFTED;
	memset(it[0].dst, 0, it[0].desc.nbytes);
	assert_int_equal(ecx_consumer_load(c, it, 1), ECX_EIO);
	assert_non_null(strstr(ecx_consumer_last_error(), "answered ok"));
	assert_true(((uint8_t *)it[0].dst)[it[0].desc.nbytes - 1] == 0);
	ecx_consumer_stats st;
	ecx_consumer_stats_get(c, &st);
	assert_int_equal(st.mc_rej_range, 1);
	f->prod.mode = GOOD;
	/* Given an ecx epoch (by hand), the item goes to ecx's hello, which
	 * the producer does not speak: said so, not a transport error. */
	lookup(c, it, 1, false);
	it[0].epoch = 5;
	it[0].dst = ecx_consumer_alloc(c, it[0].desc.nbytes);
	assert_int_equal(ecx_consumer_load(c, it, 1), ECX_EUNSUPPORTED);
	assert_non_null(strstr(ecx_consumer_last_error(),
	                       "speaks only the reference's protocol"));
	ecx_consumer_destroy(c);
}

/* A producer that answers after the deadline and writes then: the load
 * fails within its bound, and nothing lands once it has returned. */
static void test_ref_late(void **state)
{
	fix *f = *state;
	ecx_consumer *c = consumer(f, NULL, 300);
	ecx_item it[1];
	lookup(c, it, 1, false);
	it[0].dst = ecx_consumer_alloc(c, it[0].desc.nbytes);
	memset(it[0].dst, 0, it[0].desc.nbytes);
	f->prod.mode = LATE;
	f->prod.late_ms = 800;
	uint64_t t0 = (uint64_t)time(NULL);
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	assert_int_equal(ecx_consumer_load(c, it, 1), ECX_ETIMEDOUT);
	clock_gettime(CLOCK_MONOTONIC, &b);
	(void)t0;
	double took = (double)(b.tv_sec - a.tv_sec) +
	              (double)(b.tv_nsec - a.tv_nsec) / 1e9;
	assert_true(took < 0.3 + 0.1 + 0.3);
	assert_non_null(strstr(ecx_consumer_last_error(), "did not answer"));
	/* The late write comes, and is refused. */
	for (int i = 0; i < 200 && f->prod.served == 0; i++)
		msleep(10);
	msleep(50);
	assert_int_equal(f->prod.failed, 1);
	const uint8_t *d = it[0].dst;
	for (size_t i = 0; i < it[0].desc.nbytes; i++)
		if (d[i] != 0)
			fail_msg("byte %zu landed after the load", i);
	/* Freed while the producer might still write: not handed out again
	 * until it answered. */
	void *old = it[0].dst;
	ecx_consumer_free(c, old);
	void *again = ecx_consumer_alloc(c, it[0].desc.nbytes);
	assert_ptr_not_equal(again, old);
	it[0].dst = again;
	f->prod.mode = GOOD;
	/* The next load works (a new socket: the old one waits for its
	 * answer). */
	assert_int_equal(ecx_consumer_load(c, it, 1), ECX_OK);
	assert_true(tu_check(ids[0], it[0].dst, it[0].desc.nbytes));
	ecx_consumer_destroy(c);
}

static int u64cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* An ecx producer, and an ecx consumer forced onto Mooncake's wire: the
 * reference's pull op to the producer, its writer into the consumer's
 * receiver. A batch, byte for byte, with no hello; then the median of
 * 64 KiB loads, printed beside the same loads over ecx's own pulls. */
static void test_force_ecx(void **state)
{
	(void)state;
	ecx_producer_params pp = {.field_mask =
	                              ECX_PRODUCER_PARAM_CAPACITY |
	                              ECX_PRODUCER_PARAM_BIND_HOST |
	                              ECX_PRODUCER_PARAM_REGISTRY_PORT,
	                          .capacity_bytes = 64u << 20,
	                          .bind_host = "127.0.0.1",
	                          .registry_port = 0};
	ecx_producer *p = NULL;
	char why[256] = "";
	if (ecx_producer_create(&pp, &p, why, sizeof(why)) != 0)
		fail_msg("producer: %s", why);
	static const uint64_t sizes[4] = {65536, 1u << 20, 7u << 20, 100};
	static const char *fids[4] = {"f-64k", "f-1m", "f-7m", "f-100"};
	for (int i = 0; i < 4; i++) {
		ecx_tensor_desc d;
		uint64_t shape[1] = {sizes[i]};
		ecx_tensor_set(&d, ECX_DTYPE_UINT8, 1, shape);
		void *b = malloc(sizes[i]);
		tu_fill(fids[i], b, sizes[i]);
		assert_int_equal(ecx_producer_put(p, fids[i], &d, b), 0);
		free(b);
	}
	fix f;
	snprintf(f.url, sizeof(f.url), "http://127.0.0.1:%u",
	         ecx_producer_registry_port(p));
	ecx_consumer *c[2] = {consumer(&f, "force", 5000),
	                      consumer(&f, NULL, 5000)};
	ecx_item it[4];
	memset(it, 0, sizeof(it));
	for (int i = 0; i < 4; i++)
		it[i].id = fids[i];
	assert_int_equal(ecx_consumer_lookup(c[0], it, 4), 0);
	for (int i = 0; i < 4; i++) {
		assert_int_equal(it[i].status, 0);
		assert_true(it[i].epoch != ECX_EPOCH_REFERENCE);
		it[i].dst = ecx_consumer_alloc(c[0], it[i].desc.nbytes);
	}
	int rc = ecx_consumer_load(c[0], it, 4);
	if (rc != 0)
		fail_msg("forced load: %s", ecx_consumer_last_error());
	for (int i = 0; i < 4; i++)
		assert_true(tu_check(fids[i], it[i].dst, it[i].desc.nbytes));
	ecx_consumer_stats st;
	ecx_consumer_stats_get(c[0], &st);
	assert_int_equal(st.mc_pulls, 4);
	assert_int_equal(st.connections, 0);
	for (int i = 0; i < 4; i++)
		ecx_consumer_free(c[0], it[i].dst);
	enum { N = 300 };
	uint64_t t[2][N];
	for (int k = 0; k < 2; k++) {
		ecx_item one;
		memset(&one, 0, sizeof(one));
		one.id = fids[0];
		assert_int_equal(ecx_consumer_lookup(c[k], &one, 1), 0);
		one.dst = ecx_consumer_alloc(c[k], one.desc.nbytes);
		for (int i = 0; i < N + 20; i++) {
			struct timespec a, b;
			clock_gettime(CLOCK_MONOTONIC, &a);
			assert_int_equal(ecx_consumer_load(c[k], &one, 1), 0);
			clock_gettime(CLOCK_MONOTONIC, &b);
			if (i >= 20) /* after the first connection */
				t[k][i - 20] =
				    (uint64_t)(b.tv_sec - a.tv_sec) *
				        1000000000u +
				    (uint64_t)(b.tv_nsec - a.tv_nsec);
		}
		assert_true(tu_check(fids[0], one.dst, one.desc.nbytes));
		qsort(t[k], N, sizeof(t[k][0]), u64cmp);
	}
	printf("# 64 KiB load, loopback, same run: reference pull over "
	       "Mooncake's wire p50 %.1f us p90 %.1f us; ecx's pull p50 "
	       "%.1f us p90 %.1f us\n",
	       (double)t[0][N / 2] / 1e3, (double)t[0][N * 9 / 10] / 1e3,
	       (double)t[1][N / 2] / 1e3, (double)t[1][N * 9 / 10] / 1e3);
	ecx_consumer_destroy(c[0]);
	ecx_consumer_destroy(c[1]);
	ecx_producer_destroy(p);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test_setup_teardown(test_ref_load, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_ref_errors, setup, teardown),
	    cmocka_unit_test_setup_teardown(test_ref_late, setup, teardown),
	    cmocka_unit_test(test_force_ecx),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
