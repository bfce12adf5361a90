/* The producer answers the reference's pull op ({"op":"pull","mm_hash",
 * "dst_session","dst_ptr","nbytes"} on its ZeroMQ port, as
 * ec_mooncake_connector.py sends it) by writing into the Mooncake session
 * of tests/common/mcrx.h, and replies in the reference's words. Real
 * sockets on 127.0.0.1, port 0. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/mcrx.h"
#include "common/testutil.h"
#include "producer/producer.h"

#include <cjson/cJSON.h>
#include <zmq.h>

#define KiB 1024u
#define MiB (1024u * 1024u)

static ecx_producer *producer(const char *token, int mooncake, int timeout_ms)
{
	ecx_producer_params pp = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_CAPACITY | ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_TIMEOUT |
	        ECX_PRODUCER_PARAM_MOONCAKE |
	        (token ? ECX_PRODUCER_PARAM_TOKEN : 0),
	    .capacity_bytes = 32 * MiB,
	    .bind_host = "127.0.0.1",
	    .registry_port = 0,
	    .timeout_ms = timeout_ms * time_scale(),
	    .token = token,
	    .mooncake = mooncake};
	ecx_producer *p = NULL;
	char why[256] = "";
	if (ecx_producer_create(&pp, &p, why, sizeof(why)) != 0)
		fail_msg("producer: %s", why);
	return p;
}

/* A REQ socket, as the reference's consumer opens one per pull. */
typedef struct req {
	void *ctx, *s;
} req;

static req req_open(ecx_producer *p)
{
	req r;
	r.ctx = zmq_ctx_new();
	r.s = zmq_socket(r.ctx, ZMQ_REQ);
	int t = 20000 * time_scale(), linger = 0;
	zmq_setsockopt(r.s, ZMQ_RCVTIMEO, &t, sizeof(t));
	zmq_setsockopt(r.s, ZMQ_LINGER, &linger, sizeof(linger));
	assert_int_equal(zmq_connect(r.s, ecx_producer_address(p)), 0);
	return r;
}

static void req_close(req *r)
{
	zmq_close(r->s);
	zmq_ctx_term(r->ctx);
}

static void req_send(req *r, const char *msg)
{
	assert_int_equal(zmq_send(r->s, msg, strlen(msg), 0), (int)strlen(msg));
}

/* The reply, NUL-terminated (a buffer of the calling thread's). */
static const char *req_recv(req *r)
{
	static __thread char buf[4096];
	int n = zmq_recv(r->s, buf, sizeof(buf) - 1, 0);
	assert_true(n >= 0);
	buf[n] = '\0';
	return buf;
}

static const char *pull(req *r, const char *id, const char *session,
                        uint64_t dst, uint64_t n)
{
	char msg[512];
	snprintf(msg, sizeof(msg),
	         "{\"op\": \"pull\", \"mm_hash\": \"%s\", \"dst_session\": "
	         "\"%s\", \"dst_ptr\": %llu, \"nbytes\": %llu}",
	         id, session, (unsigned long long)dst, (unsigned long long)n);
	req_send(r, msg);
	return req_recv(r);
}

static const char *jstr(const char *reply, const char *key)
{
	static char out[400];
	cJSON *o = cJSON_Parse(reply);
	assert_non_null(o);
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
	if (cJSON_IsString(v))
		snprintf(out, sizeof(out), "%s", v->valuestring);
	else if (cJSON_IsBool(v))
		snprintf(out, sizeof(out), "%s",
		         cJSON_IsTrue(v) ? "true" : "false");
	else if (cJSON_IsNumber(v))
		snprintf(out, sizeof(out), "%g", v->valuedouble);
	else
		snprintf(out, sizeof(out), "(absent)");
	cJSON_Delete(o);
	return out;
}

static uint64_t metric(ecx_producer *p, const char *line)
{
	char buf[8192];
	size_t n = prod_metrics(p, buf, sizeof(buf));
	assert_true(n < sizeof(buf));
	char want[300];
	snprintf(want, sizeof(want), "\n%s", line);
	const char *at = strstr(buf, want);
	if (at == NULL)
		fail_msg("no metric %s in\n%s", line, buf);
	return strtoull(at + strlen(want), NULL, 10);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* The reference's pull is written, bytes checked, replies as the
 * reference's; then its refusals in its words. */
static void test_ref_pull(void **state)
{
	(void)state;
	ecx_producer *p = producer(NULL, 1, 5000);
	assert_int_equal(tu_put(p, "item-64k", 64 * KiB), 0);
	assert_int_equal(tu_put(p, "item-7m", 7 * MiB), 0);
	rx x;
	assert_true(rx_start(&x, AF_INET, 16 * MiB, 2, RX_OK));
	uint64_t base = (uint64_t)(uintptr_t)x.mem;
	req r = req_open(p);

	assert_string_equal(pull(&r, "item-7m", x.name, base + 4096, 7 * MiB),
	                    "{\"ok\":true,\"mooncake_ret\":0}");
	assert_true(tu_check("item-7m", x.mem + 4096, 7 * MiB));

	/* 64 KiB, many times: the answer's time (the target is a p50 of
	 * 150 us on loopback), one handshake and one data connection. */
	enum { N = 300 };
	uint64_t lat[N];
	for (int i = 0; i < N; i++) {
		memset(x.mem + 8 * MiB, 0, 64 * KiB);
		uint64_t t0 = ecx_now_ns();
		const char *a =
		    pull(&r, "item-64k", x.name, base + 8 * MiB, 64 * KiB);
		lat[i] = ecx_now_ns() - t0;
		if (strcmp(a, "{\"ok\":true,\"mooncake_ret\":0}") != 0)
			fail_msg("pull %d: %s", i, a);
		assert_true(tu_check("item-64k", x.mem + 8 * MiB, 64 * KiB));
	}
	qsort(lat, N, sizeof(lat[0]), cmp_u64);
	printf("reference pull of 64 KiB over loopback: p50 %.1f us, p90 "
	       "%.1f us (%d pulls)\n",
	       lat[N / 2] / 1e3, lat[N * 9 / 10] / 1e3, N);
	assert_int_equal(__atomic_load_n(&x.handshakes, __ATOMIC_RELAXED), 1);
	assert_int_equal(__atomic_load_n(&x.accepts, __ATOMIC_RELAXED), 1);

	/* The reference's refusals, in its words. */
	const char *a = pull(&r, "nope", x.name, base, 16);
	assert_string_equal(jstr(a, "ok"), "false");
	assert_string_equal(jstr(a, "err"), "unknown mm_hash");
	a = pull(&r, "item-64k", x.name, base, 16);
	assert_string_equal(jstr(a, "err"), "size mismatch");
	req_send(&r, "{\"op\": \"push\"}");
	assert_string_equal(jstr(req_recv(&r), "err"), "unknown op");
	/* Outside what the session advertises: a failed transfer, no byte
	 * sent. */
	int headers = __atomic_load_n(&x.headers, __ATOMIC_RELAXED);
	a = pull(&r, "item-64k", x.name, base + 16 * MiB - 100, 64 * KiB);
	assert_string_equal(jstr(a, "ok"), "false");
	assert_string_equal(jstr(a, "mooncake_ret"), "-1");
	assert_non_null(strstr(jstr(a, "err"), "outside"));
	assert_int_equal(__atomic_load_n(&x.headers, __ATOMIC_RELAXED),
	                 headers);

	assert_int_equal(metric(p, "ecx_producer_reference_pulls_total "),
	                 N + 1);
	assert_int_equal(metric(p, "ecx_producer_reference_pull_bytes_total "),
	                 7 * MiB + (uint64_t)N * 64 * KiB);
	assert_int_equal(
	    metric(p, "ecx_producer_reference_pulls_refused_total{reason="
	              "\"unknown_mm_hash\"} "),
	    1);
	assert_int_equal(
	    metric(p, "ecx_producer_reference_pulls_refused_total{reason="
	              "\"size_mismatch\"} "),
	    1);
	assert_int_equal(
	    metric(p, "ecx_producer_reference_pulls_refused_total{reason="
	              "\"destination\"} "),
	    1);
	ecx_producer_stats st;
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.pinned, 0);
	req_close(&r);
	ecx_producer_destroy(p);
	rx_stop(&x);
}

typedef struct stalled_arg {
	ecx_producer *p;
	const char *session;
	uint64_t dst;
	char reply[512];
	uint64_t took_ns;
} stalled_arg;

static void *stalled_pull(void *arg)
{
	stalled_arg *s = arg;
	req r = req_open(s->p);
	uint64_t t0 = ecx_now_ns();
	snprintf(s->reply, sizeof(s->reply), "%s",
	         pull(&r, "item-7m", s->session, s->dst, 7 * MiB));
	s->took_ns = ecx_now_ns() - t0;
	req_close(&r);
	return NULL;
}

/* A receiver that stops reading holds up its own pull until the deadline,
 * not the others': another consumer's pull is answered meanwhile. */
static void test_ref_pull_stalled(void **state)
{
	(void)state;
	int timeout_ms = 1500;
	ecx_producer *p = producer(NULL, 1, timeout_ms);
	assert_int_equal(tu_put(p, "item-64k", 64 * KiB), 0);
	assert_int_equal(tu_put(p, "item-7m", 7 * MiB), 0);
	rx good, stuck;
	assert_true(rx_start(&good, AF_INET, 8 * MiB, 2, RX_OK));
	assert_true(rx_start(&stuck, AF_INET, 8 * MiB, 2, RX_STALL));
	stalled_arg sa = {.p = p,
	                  .session = stuck.name,
	                  .dst = (uint64_t)(uintptr_t)stuck.mem};
	pthread_t t;
	assert_int_equal(pthread_create(&t, NULL, stalled_pull, &sa), 0);
	while (__atomic_load_n(&stuck.accepts, __ATOMIC_RELAXED) == 0)
		usleep(1000);
	req r = req_open(p);
	uint64_t t0 = ecx_now_ns();
	const char *a = pull(&r, "item-64k", good.name,
	                     (uint64_t)(uintptr_t)good.mem, 64 * KiB);
	uint64_t took = ecx_now_ns() - t0;
	assert_string_equal(a, "{\"ok\":true,\"mooncake_ret\":0}");
	assert_true(took < 500000000ull * time_scale());
	pthread_join(t, NULL);
	assert_string_equal(jstr(sa.reply, "ok"), "false");
	assert_string_equal(jstr(sa.reply, "code"), "ETIMEDOUT");
	assert_true(sa.took_ns <
	            (uint64_t)(timeout_ms + 500) * time_scale() * 1000000u);
	assert_int_equal(
	    metric(p, "ecx_producer_reference_pulls_refused_total{reason="
	              "\"timeout\"} "),
	    1);
	req_close(&r);

	/* destroy does not wait for a stalled receiver: the pull in flight
	 * is answered at once. */
	ecx_producer *p2 = producer(NULL, 1, 20000);
	assert_int_equal(tu_put(p2, "item-7m", 7 * MiB), 0);
	stalled_arg sb = {.p = p2,
	                  .session = stuck.name,
	                  .dst = (uint64_t)(uintptr_t)stuck.mem};
	int acc = __atomic_load_n(&stuck.accepts, __ATOMIC_RELAXED);
	assert_int_equal(pthread_create(&t, NULL, stalled_pull, &sb), 0);
	while (__atomic_load_n(&stuck.accepts, __ATOMIC_RELAXED) == acc)
		usleep(1000);
	usleep(50000);
	t0 = ecx_now_ns();
	ecx_producer_destroy(p2);
	assert_true(ecx_now_ns() - t0 < 3000000000ull * time_scale());
	pthread_join(t, NULL);
	assert_string_equal(jstr(sb.reply, "ok"), "false");
	ecx_producer_destroy(p);
	rx_stop(&good);
	rx_stop(&stuck);
}

/* A producer with a token refuses the reference's pull (which carries
 * none) saying so; one started with the wire off refuses it too. */
static void test_ref_pull_refused(void **state)
{
	(void)state;
	rx x;
	assert_true(rx_start(&x, AF_INET, MiB, 2, RX_OK));
	ecx_producer *p = producer("s3cret", 1, 2000);
	assert_int_equal(tu_put(p, "item-64k", 64 * KiB), 0);
	req r = req_open(p);
	const char *a =
	    pull(&r, "item-64k", x.name, (uint64_t)(uintptr_t)x.mem, 64 * KiB);
	assert_string_equal(jstr(a, "code"), "EAUTH");
	assert_non_null(strstr(jstr(a, "err"), "carries none"));
	assert_int_equal(
	    metric(p, "ecx_producer_reference_pulls_refused_total{reason="
	              "\"token\"} "),
	    1);
	/* with the token, it is served */
	char msg[512];
	snprintf(msg, sizeof(msg),
	         "{\"op\":\"pull\",\"mm_hash\":\"item-64k\",\"dst_session\":"
	         "\"%s\",\"dst_ptr\":%llu,\"nbytes\":%u,\"token\":\"s3cret\"}",
	         x.name, (unsigned long long)(uintptr_t)x.mem, 64 * KiB);
	req_send(&r, msg);
	assert_string_equal(req_recv(&r), "{\"ok\":true,\"mooncake_ret\":0}");
	req_close(&r);
	ecx_producer_destroy(p);

	p = producer(NULL, 0, 2000);
	assert_int_equal(tu_put(p, "item-64k", 64 * KiB), 0);
	r = req_open(p);
	a = pull(&r, "item-64k", x.name, (uint64_t)(uintptr_t)x.mem, 64 * KiB);
	assert_string_equal(jstr(a, "code"), "EUNSUPPORTED");
	assert_non_null(strstr(jstr(a, "err"), "Mooncake wire off"));
	req_close(&r);
	ecx_producer_destroy(p);
	rx_stop(&x);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_ref_pull),
	    cmocka_unit_test(test_ref_pull_stalled),
	    cmocka_unit_test(test_ref_pull_refused),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
