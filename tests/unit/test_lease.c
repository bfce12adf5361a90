/*
 * Leases, end to end: a producer in a process of its own (ecx-test-peer),
 * the consumer (or a registry client) here, on loopback. A leased item is
 * not evicted until its pull, its release or its expiry; leases take at
 * most their share of the arena and are refused beyond it; expired leases
 * give their room back.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/fixture.h"
#include "wire/wire.h"

#include <time.h>

#define MiB (1u << 20)

/* A field of the peer's "leases" line: held, bytes, granted, refused,
 * expired, released, used, items, evictions. */
static long long lease_stat(producer *p, const char *name)
{
	return producer_field(p, "leases", name);
}

static ecx_consumer *consumer(const char *url, const char *token)
{
	ecx_consumer_params cp = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_TIMEOUT |
	        ECX_CONSUMER_PARAM_TRANSPORT |
	        ECX_CONSUMER_PARAM_RECV_CAPACITY | ECX_CONSUMER_PARAM_TOKEN,
	    .registry = url,
	    .timeout_ms = 3000,
	    .transport = "tcp",
	    .recv_capacity = 0,
	    .token = token};
	ecx_consumer *c = NULL;
	char why[256];
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0)
		fail_msg("consumer: %s", why);
	return c;
}

/* Loads the items into fresh memory and checks every byte. */
static void load_check(ecx_consumer *c, ecx_item *it, size_t n)
{
	for (size_t i = 0; i < n; i++)
		it[i].dst = malloc(it[i].desc.nbytes ? it[i].desc.nbytes : 1);
	int rc = ecx_consumer_load(c, it, n);
	for (size_t i = 0; i < n; i++) {
		if (it[i].status != 0)
			fail_msg("%s: %s", it[i].id,
			         ecx_err_name(it[i].status));
		assert_true(tu_check(it[i].id, it[i].dst, it[i].desc.nbytes));
		free(it[i].dst);
		it[i].dst = NULL;
	}
	assert_int_equal(rc, 0);
}

/* Leased items survive the eviction that takes the unleased ones, the
 * share is enforced (a lease beyond it is a miss), and the pull ends the
 * leases. */
static void test_lease_pins_until_pull(void **state)
{
	(void)state;
	producer p;
	producer_start(&p, "tcp", "--capacity", "4194304", NULL);
	const char *ids[] = {"l1", "l2", "l3", "l4"};
	for (int i = 0; i < 4; i++)
		producer_put(&p, ids[i], "uint8", "1048576", "ok");
	ecx_consumer *c = consumer(p.url, NULL);
	/* l1 and l2 are the least recently used: eviction's first choice. */
	ecx_item it[3] = {{.id = "l1"}, {.id = "l2"}, {.id = "l3"}};
	assert_int_equal(ecx_consumer_lookup_lease(c, it, 3, 10000), 0);
	/* The share (50 % of 4 MiB) holds two of them. */
	assert_int_equal(it[0].status, 0);
	assert_int_equal(it[1].status, 0);
	assert_true(it[0].lease != 0 && it[1].lease != 0);
	assert_true(it[0].lease != it[1].lease);
	assert_int_equal(it[2].status, ECX_ENOTFOUND);
	assert_int_equal(it[2].lease, 0);
	assert_int_equal(lease_stat(&p, "held"), 2);
	assert_int_equal(lease_stat(&p, "bytes"), 2 * MiB);
	assert_int_equal(lease_stat(&p, "granted"), 2);
	assert_int_equal(lease_stat(&p, "refused"), 1);
	/* Three puts need three items' room: l3, l4 and then l5 go, never
	 * l1 and l2. */
	producer_put(&p, "l5", "uint8", "1048576", "ok");
	producer_put(&p, "l6", "uint8", "1048576", "ok");
	producer_put(&p, "l7", "uint8", "1048576", "ok");
	assert_int_equal(lease_stat(&p, "evictions"), 3);
	ecx_item look[3] = {{.id = "l3"}, {.id = "l4"}, {.id = "l5"}};
	assert_int_equal(ecx_consumer_lookup(c, look, 3), 0);
	for (int i = 0; i < 3; i++)
		assert_int_equal(look[i].status, ECX_ENOTFOUND);
	/* The hits load; their pull ends the leases. */
	load_check(c, it, 2);
	assert_int_equal(it[0].lease, 0);
	assert_int_equal(lease_stat(&p, "used"), 2);
	assert_int_equal(lease_stat(&p, "held"), 0);
	assert_int_equal(lease_stat(&p, "bytes"), 0);
	/* And they can be evicted again: four puts take the whole arena. */
	const char *more[] = {"l8", "l9", "l10", "l11"};
	for (int i = 0; i < 4; i++)
		producer_put(&p, more[i], "uint8", "1048576", "ok");
	ecx_consumer_destroy(c);
	producer_stop(&p);
}

/* A release ends a lease at once; an expiry ends it by itself and its
 * room comes back to puts. The time granted is cut to the producer's
 * lease_max_ms. */
static void test_lease_release_and_expiry(void **state)
{
	(void)state;
	producer p;
	producer_start(&p, "tcp", "--capacity", "4194304", "--lease-max-ms",
	               "300", NULL);
	const char *ids[] = {"r1", "r2", "r3", "r4"};
	for (int i = 0; i < 4; i++)
		producer_put(&p, ids[i], "uint8", "1048576", "ok");
	ecx_consumer *c = consumer(p.url, NULL);
	ecx_item it[2] = {{.id = "r1"}, {.id = "r2"}};
	assert_int_equal(ecx_consumer_lookup_lease(c, it, 2, 60000), 0);
	assert_true(it[0].lease != 0 && it[1].lease != 0);
	uint64_t t0 = now_ms();
	/* Release r2 now; r1 expires after 300 ms, not 60 s. */
	assert_int_equal(ecx_consumer_release(c, &it[1], 1), 0);
	assert_int_equal(it[1].lease, 0);
	assert_int_equal(lease_stat(&p, "released"), 1);
	assert_int_equal(lease_stat(&p, "held"), 1);
	/* Releasing again is no error, and ends nothing. */
	ecx_item again = it[1];
	again.lease = 12345;
	assert_int_equal(ecx_consumer_release(c, &again, 1), 0);
	assert_int_equal(lease_stat(&p, "released"), 1);
	while (now_ms() - t0 < 450)
		usleep(20000);
	assert_int_equal(lease_stat(&p, "held"), 0);
	assert_int_equal(lease_stat(&p, "expired"), 1);
	assert_int_equal(lease_stat(&p, "bytes"), 0);
	/* Its room is back: four puts take the whole arena, r1 included. */
	const char *more[] = {"r5", "r6", "r7", "r8"};
	for (int i = 0; i < 4; i++)
		producer_put(&p, more[i], "uint8", "1048576", "ok");
	ecx_item look[2] = {{.id = "r1"}, {.id = "r2"}};
	assert_int_equal(ecx_consumer_lookup(c, look, 2), 0);
	assert_int_equal(look[0].status, ECX_ENOTFOUND);
	assert_int_equal(look[1].status, ECX_ENOTFOUND);
	/* A load naming a lease that is gone (or another item's) loads as
	 * any load and ends nothing. */
	ecx_item r5 = {.id = "r5"};
	assert_int_equal(ecx_consumer_lookup(c, &r5, 1), 0);
	r5.lease = it[0].lease;
	load_check(c, &r5, 1);
	assert_int_equal(lease_stat(&p, "used"), 0);
	ecx_consumer_destroy(c);
	producer_stop(&p);
}

/* One call leases a batch across two producers (one request each); a
 * registry client leases, another process's consumer loads with the lease
 * numbers (the vLLM split: the scheduler looks up, a worker pulls); the
 * pull ends the leases. */
static void test_lease_batch_two_producers(void **state)
{
	(void)state;
	producer a, b;
	producer_start(&a, "tcp", NULL);
	producer_start(&b, "tcp", NULL);
	char ids[64][16];
	for (int i = 0; i < 64; i++) {
		snprintf(ids[i], sizeof(ids[i]), "b%02d", i);
		producer_put(i % 2 ? &b : &a, ids[i], "uint8", "4096", "ok");
	}
	char urls[160];
	snprintf(urls, sizeof(urls), "%s,%s", a.url, b.url);
	ecx_client_params cp = {.field_mask = ECX_CLIENT_PARAM_REGISTRY |
	                                      ECX_CLIENT_PARAM_TIMEOUT,
	                        .registry = urls,
	                        .timeout_ms = 3000};
	ecx_client *cl;
	char why[256];
	if (ecx_client_create(&cp, &cl, why, sizeof(why)) != 0)
		fail_msg("client: %s", why);
	ecx_item it[64];
	memset(it, 0, sizeof(it));
	for (int i = 0; i < 64; i++)
		it[i].id = ids[i];
	assert_int_equal(ecx_client_lookup_lease(cl, it, 64, 0), 0);
	for (int i = 0; i < 64; i++) {
		if (it[i].status != 0 || it[i].lease == 0)
			fail_msg("%s: %s, lease %llu", ids[i],
			         ecx_err_name(it[i].status),
			         (unsigned long long)it[i].lease);
	}
	assert_int_equal(lease_stat(&a, "granted"), 32);
	assert_int_equal(lease_stat(&b, "granted"), 32);
	/* A consumer that never looked up loads them, naming the leases. */
	ecx_consumer *c = consumer(urls, NULL);
	load_check(c, it, 64);
	assert_int_equal(lease_stat(&a, "used"), 32);
	assert_int_equal(lease_stat(&b, "held"), 0);
	/* The client's release of leases the pulls ended is no error. */
	it[0].lease = 77;
	assert_int_equal(ecx_client_release(cl, it, 1), 0);
	ecx_consumer_destroy(c);
	ecx_client_destroy(cl);
	producer_stop(&a);
	producer_stop(&b);
}

/* Without the producer's token no lease is granted (a miss); removing a
 * leased item ends its leases; a share of 0 turns leases off. */
static void test_lease_token_remove_share(void **state)
{
	(void)state;
	producer p;
	producer_start(&p, "tcp", "--token", "sekrit", NULL);
	producer_put(&p, "t1", "uint8", "4096", "ok");
	ecx_consumer *bad = consumer(p.url, NULL);
	ecx_item it = {.id = "t1"};
	/* Reads of the registry need no token; the lease does. */
	assert_int_equal(ecx_consumer_lookup_lease(bad, &it, 1, 1000), 0);
	assert_int_equal(it.status, ECX_ENOTFOUND);
	assert_int_equal(lease_stat(&p, "granted"), 0);
	ecx_consumer *good = consumer(p.url, "sekrit");
	assert_int_equal(ecx_consumer_lookup_lease(good, &it, 1, 1000), 0);
	assert_int_equal(it.status, 0);
	assert_int_equal(lease_stat(&p, "held"), 1);
	char ans[64];
	assert_true(tu_ask(&p.ch, ans, sizeof(ans), "remove t1"));
	assert_string_equal(ans, "ok");
	assert_int_equal(lease_stat(&p, "held"), 0);
	assert_int_equal(lease_stat(&p, "bytes"), 0);
	ecx_consumer_destroy(bad);
	ecx_consumer_destroy(good);
	producer_stop(&p);

	producer_start(&p, "tcp", "--lease-share", "0", NULL);
	producer_put(&p, "s1", "uint8", "4096", "ok");
	ecx_consumer *c = consumer(p.url, NULL);
	ecx_item s1 = {.id = "s1"};
	assert_int_equal(ecx_consumer_lookup_lease(c, &s1, 1, 1000), 0);
	assert_int_equal(s1.status, ECX_ENOTFOUND);
	assert_int_equal(lease_stat(&p, "refused"), 1);
	ecx_consumer_destroy(c);
	producer_stop(&p);
}

/* A producer that does not answer (stopped) costs the lookup at most its
 * timeout, and its items are misses; then it is skipped for a back-off
 * instead of costing every lookup its timeout. One that is gone (killed)
 * costs at most the connect bound. */
static void test_lease_stopped_producer(void **state)
{
	(void)state;
	producer reg, p;
	producer_start(&reg, "tcp", NULL); /* its registry serves the lookup */
	producer_start(&p, "tcp", "--registry", reg.url, NULL);
	producer_put(&p, "d1", "uint8", "4096", "ok");
	ecx_consumer *c = consumer(reg.url, NULL);
	ecx_item it = {.id = "d1"};
	assert_int_equal(ecx_consumer_lookup_lease(c, &it, 1, 1000), 0);
	assert_int_equal(it.status, 0);
	assert_int_equal(ecx_consumer_release(c, &it, 1), 0);
	tu_stop(p.ch.pid);
	uint64_t t0 = now_ms();
	assert_int_equal(ecx_consumer_lookup_lease(c, &it, 1, 1000), 0);
	uint64_t took = now_ms() - t0;
	assert_int_equal(it.status, ECX_ENOTFOUND);
	assert_true(took < 3000 + 500);
	/* Backing off: the next lookup does not wait on it again. */
	t0 = now_ms();
	assert_int_equal(ecx_consumer_lookup_lease(c, &it, 1, 1000), 0);
	assert_int_equal(it.status, ECX_ENOTFOUND);
	assert_true(now_ms() - t0 < 400);
	kill(p.ch.pid, SIGCONT);
	/* After the back-off (500 ms), a new socket: leases work again. */
	usleep(600000);
	assert_int_equal(ecx_consumer_lookup_lease(c, &it, 1, 1000), 0);
	assert_int_equal(it.status, 0);
	ecx_consumer_destroy(c);
	/* Killed (its entry outlives it in the registry): a new consumer's
	 * lease fails within the 500 ms connect bound, not the timeout. */
	kill(p.ch.pid, SIGKILL);
	tu_reap(&p.ch, 5000);
	c = consumer(reg.url, NULL);
	t0 = now_ms();
	it = (ecx_item){.id = "d1"};
	assert_int_equal(ecx_consumer_lookup_lease(c, &it, 1, 1000), 0);
	took = now_ms() - t0;
	assert_int_equal(it.status, ECX_ENOTFOUND);
	if (took > 1500)
		fail_msg("a lease from a dead producer took %llu ms",
		         (unsigned long long)took);
	ecx_consumer_destroy(c);
	producer_stop(&reg);
}

/* The codecs of the lease and release messages and of a pull item's
 * lease: round trips, and what the decoders refuse. */
static void test_lease_wire(void **state)
{
	(void)state;
	char why[160];
	const char *ids[] = {"a1", "lora:b2"};
	char *m = ecx_zreq_encode_lease(ids, 2, 1500, "tok");
	ecx_zreq r;
	assert_int_equal(ecx_zreq_decode(m, strlen(m), &r, why, sizeof(why)),
	                 0);
	assert_int_equal(r.op, ECX_ZOP_LEASE);
	assert_int_equal(r.lease_ms, 1500);
	assert_int_equal(r.ids.n, 2);
	assert_string_equal(r.ids.ids[1], "lora:b2");
	assert_string_equal(r.token, "tok");
	ecx_zreq_free(&r);
	free(m);
	uint64_t ls[] = {12, (1ull << 53) - 1};
	m = ecx_zreq_encode_release(ls, 2, NULL);
	assert_int_equal(ecx_zreq_decode(m, strlen(m), &r, why, sizeof(why)),
	                 0);
	assert_int_equal(r.op, ECX_ZOP_RELEASE);
	assert_int_equal(r.nleases, 2);
	assert_true(r.leases[1] == ls[1]);
	ecx_zreq_free(&r);
	free(m);
	static const char *bad[] = {
	    "{\"op\":\"lease\",\"ids\":[\"a/b\"],\"ms\":1}",
	    "{\"op\":\"lease\",\"ids\":\"a\",\"ms\":1}",
	    "{\"op\":\"lease\",\"ids\":[\"a\"]}",
	    "{\"op\":\"lease\",\"ids\":[\"a\"],\"ms\":-1}",
	    "{\"op\":\"release\",\"leases\":[0]}",
	    "{\"op\":\"release\",\"leases\":[1.5]}",
	    "{\"op\":\"release\",\"leases\":[\"1\"]}",
	    "{\"op\":\"release\",\"leases\":[9007199254740992]}",
	    "{\"op\":\"release\"}"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		if (ecx_zreq_decode(bad[i], strlen(bad[i]), &r, why,
		                    sizeof(why)) == 0)
			fail_msg("decoded: %s", bad[i]);
	/* Too many ids for one message. */
	const char *many[ECX_LEASE_MAX_IDS + 1];
	for (int i = 0; i <= ECX_LEASE_MAX_IDS; i++)
		many[i] = "x";
	m = ecx_zreq_encode_lease(many, ECX_LEASE_MAX_IDS + 1, 1, NULL);
	assert_int_equal(ecx_zreq_decode(m, strlen(m), &r, why, sizeof(why)),
	                 ECX_ETOOBIG);
	free(m);
	/* The answers. */
	uint64_t nums[] = {12, 0, 0};
	int errs[] = {0, ECX_ENOSPC, ECX_ENOTFOUND};
	m = ecx_zresp_encode_lease(9, 300, nums, errs, 3);
	ecx_zresp z;
	assert_int_equal(ecx_zresp_decode(m, strlen(m), &z, why, sizeof(why)),
	                 0);
	assert_true(z.ok);
	assert_int_equal(z.epoch, 9);
	assert_int_equal(z.lease_ms, 300);
	assert_int_equal(z.nleases, 3);
	assert_true(z.leases[0] == 12 && z.leases[1] == 0);
	assert_int_equal(z.lease_err[1], ECX_ENOSPC);
	assert_int_equal(z.lease_err[2], ECX_ENOTFOUND);
	ecx_zresp_free(&z);
	free(m);
	m = ecx_zresp_encode_release(2);
	assert_int_equal(ecx_zresp_decode(m, strlen(m), &z, why, sizeof(why)),
	                 0);
	assert_int_equal(z.released, 2);
	ecx_zresp_free(&z);
	free(m);
	/* A pull item's lease travels, and is optional. */
	unsigned char key[4] = {1, 2, 3, 4};
	ecx_region g = {.base = 4096, .len = 8192, .rkey_len = 4, .rkey = key};
	ecx_pull_item pi[2] = {
	    {.id = "a", .nbytes = 10, .addr = 4096, .lease = 77},
	    {.id = "b", .nbytes = 10, .addr = 8192}};
	ecx_pull_req pr = {
	    .req = 1, .nregions = 1, .regions = &g, .nitems = 2, .items = pi};
	m = ecx_pull_req_encode(&pr);
	ecx_pull_req out;
	assert_int_equal(
	    ecx_pull_req_decode(m, strlen(m), &out, why, sizeof(why)), 0);
	assert_true(out.items[0].lease == 77 && out.items[1].lease == 0);
	ecx_pull_req_free(&out);
	free(m);
}

static bool own_held(ecx_producer *p, const char *id)
{
	uint64_t h = 0;
	return ecx_producer_item_xxh3(p, id, &h) == 0;
}

/* A lease the producer's own process takes (ecx_producer_lease, what an
 * ecx encoder holds a fetched item with): the item outlives the puts that
 * evict the others; lease_end gives it back to eviction; a lease past its
 * expiry (the producer's lease_max_ms cuts a longer one) ends by itself;
 * the share and ENOTFOUND refuse, never wait. */
static void test_lease_own(void **state)
{
	(void)state;
	ecx_producer_params pp = {.field_mask =
	                              ECX_PRODUCER_PARAM_CAPACITY |
	                              ECX_PRODUCER_PARAM_BIND_HOST |
	                              ECX_PRODUCER_PARAM_REGISTRY_PORT |
	                              ECX_PRODUCER_PARAM_LEASE_MAX_MS,
	                          .capacity_bytes = 4 * MiB,
	                          .bind_host = "127.0.0.1",
	                          .registry_port = 0,
	                          /* Every lease below is cut to it, so
	                           * it outlasts the steps before the wait
	                           * for its expiry, however loaded the
	                           * machine (ECX_TEST_TIME_SCALE). */
	                          .lease_max_ms = tu_ms(300)};
	ecx_producer *p = NULL;
	char why[256] = "";
	if (ecx_producer_create(&pp, &p, why, sizeof(why)) != 0)
		fail_msg("producer: %s", why);
	assert_int_equal(tu_put(p, "o1", MiB), 0);
	assert_int_equal(tu_put(p, "o2", MiB), 0);
	uint64_t l1 = 0, l2 = 0, lx = 7;
	assert_int_equal(ecx_producer_lease(p, "o1", 60000, &l1), 0);
	assert_true(l1 != 0 && l1 < (1ull << 53));
	assert_int_equal(ecx_producer_lease(p, "none", 0, &lx), ECX_ENOTFOUND);
	assert_int_equal(lx, 0);
	/* The share (50 % of 4 MiB) holds two 1 MiB items, counted once. */
	assert_int_equal(ecx_producer_lease(p, "o1", 0, &lx), 0);
	assert_int_equal(ecx_producer_lease(p, "o2", 0, &l2), 0);
	assert_int_equal(tu_put(p, "o3", MiB), 0);
	uint64_t l3 = 0;
	assert_int_equal(ecx_producer_lease(p, "o3", 0, &l3), ECX_ENOSPC);
	ecx_producer_stats st;
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.leases, 3);
	assert_int_equal(st.leased_bytes, 2 * MiB);
	assert_int_equal(st.leases_refused, 1);
	/* o1 and o2 are the least recently put: eviction passes them by. */
	assert_int_equal(tu_put(p, "o4", MiB), 0);
	assert_int_equal(tu_put(p, "o5", MiB), 0);
	assert_int_equal(tu_put(p, "o6", MiB), 0);
	assert_true(own_held(p, "o1") && own_held(p, "o2"));
	assert_false(own_held(p, "o3"));
	/* lease_end: 1 while held, 0 after; o1 stays leased by lx. */
	assert_int_equal(ecx_producer_lease_end(p, l1), 1);
	assert_int_equal(ecx_producer_lease_end(p, l1), 0);
	assert_int_equal(ecx_producer_lease_end(p, 0), 0);
	assert_int_equal(ecx_producer_lease_end(p, lx), 1);
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.leases_released, 2);
	/* o2's lease (cut to lease_max_ms) expires; then both are
	 * evictable. */
	uint64_t t0 = now_ms();
	while (now_ms() - t0 < (uint64_t)tu_ms(450))
		usleep(20000);
	ecx_producer_stats_get(p, &st);
	assert_int_equal(st.leases, 0);
	assert_int_equal(st.leases_expired, 1);
	assert_int_equal(tu_put(p, "o7", MiB), 0);
	assert_int_equal(tu_put(p, "o8", MiB), 0);
	assert_int_equal(tu_put(p, "o9", MiB), 0);
	assert_int_equal(tu_put(p, "o10", MiB), 0);
	assert_false(own_held(p, "o1"));
	assert_false(own_held(p, "o2"));
	assert_int_equal(ecx_producer_lease(NULL, "o7", 0, &lx), ECX_EINVAL);
	assert_int_equal(ecx_producer_lease(p, "o7", -1, &lx), ECX_EINVAL);
	ecx_producer_destroy(p);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_lease_wire),
	    cmocka_unit_test(test_lease_pins_until_pull),
	    cmocka_unit_test(test_lease_release_and_expiry),
	    cmocka_unit_test(test_lease_batch_two_producers),
	    cmocka_unit_test(test_lease_token_remove_share),
	    cmocka_unit_test(test_lease_stopped_producer),
	    cmocka_unit_test(test_lease_own),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
