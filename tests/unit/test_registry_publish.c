/* The producer's entries in a remote HTTP registry under eviction while
 * the registry is stopped (SIGSTOP: it keeps its entries but answers
 * nothing) or killed and started again on the same port: evicted ids
 * leave it when it answers again, held ids come back after a restart, and
 * the producer's other work does not wait on it. Real processes: `ecx
 * registry` and a producer (tests/peer.c), on 127.0.0.1. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/fixture.h"
#include "dir/dir.h"

#include <time.h>

/* Every child started, killed at exit so a failed test leaves none. */
static pid_t children[16];
static size_t nchildren;

static void kill_children(void)
{
	for (size_t i = 0; i < nchildren; i++)
		if (children[i] > 0)
			kill(children[i], SIGKILL);
}

static void child_started(pid_t pid)
{
	if (nchildren < sizeof(children) / sizeof(children[0]))
		children[nchildren++] = pid;
}

typedef struct registry {
	tu_child ch;
	unsigned port;
	char url[64];
} registry;

/* Starts `ecx registry` on port (0: a free one) with extra arguments. */
static void registry_start(registry *r, unsigned port, const char *ttl)
{
	/* The ecx command: $ECX_BIN (ctest sets it), else beside the tests
	 * in the build tree. */
	static char guess[512];
	const char *ecx = getenv("ECX_BIN");
	if (ecx == NULL) {
		snprintf(guess, sizeof(guess), "%s/../tools/ecx", tu_bindir());
		ecx = guess;
	}
	char ps[16];
	snprintf(ps, sizeof(ps), "%u", port);
	char *argv[] = {(char *)ecx, "registry", "--bind",
	                "127.0.0.1", "--port",   ps,
	                NULL,        NULL,       NULL};
	if (ttl != NULL) {
		argv[6] = "--registry-ttl";
		argv[7] = (char *)ttl;
	}
	char line[256];
	/* The port may still be held a moment after a kill: try again. */
	for (int i = 0; i < 50; i++) {
		assert_true(tu_spawn(&r->ch, argv));
		child_started(r->ch.pid);
		if (tu_line(&r->ch, line, sizeof(line)))
			break;
		tu_reap(&r->ch, 1000);
		usleep(100000);
	}
	if (sscanf(line, "listening on http://127.0.0.1:%u", &r->port) != 1)
		fail_msg("registry: %s", line);
	snprintf(r->url, sizeof(r->url), "http://127.0.0.1:%u", r->port);
}

static void registry_kill(registry *r)
{
	kill(r->ch.pid, SIGKILL);
	tu_reap(&r->ch, 2000);
}

/* A producer peer publishing to the registry at url (its capacity and
 * --registry-ttl), killed at exit if the test fails first. */
static void publisher_start(producer *p, const char *url, const char *cap,
                            const char *ttl)
{
	producer_start(p, NULL, "--registry", url, "--capacity", cap,
	               "--timeout", "1000", "--registry-ttl", ttl, NULL);
	child_started(p->ch.pid);
}

/* Whether url holds id (a fresh client each time: no back-off state). */
static bool listed(const char *url, const char *id)
{
	ecx_regclient_opts o = {
	    .urls = url, .connect_timeout_ms = 2000, .timeout_ms = 2000};
	ecx_regclient *c;
	char why[256];
	assert_int_equal(ecx_regclient_create(&o, &c, why, sizeof(why)), 0);
	ecx_lookup_item it = {.id = id};
	int rc = ecx_regclient_lookup(c, &it, 1, why, sizeof(why));
	ecx_regclient_destroy(c);
	if (rc != 0)
		fail_msg("lookup %s: %s", id, why);
	return it.found;
}

/* Waits up to ms for listed(url, id) to become want; returns the time. */
static uint64_t wait_listed(const char *url, const char *id, bool want,
                            uint64_t ms)
{
	uint64_t t0 = now_ms();
	while (listed(url, id) != want) {
		if (now_ms() - t0 > ms)
			fail_msg("%s still %s after %llu ms", id,
			         want ? "missing" : "listed",
			         (unsigned long long)ms);
		usleep(50000);
	}
	return now_ms() - t0;
}

static void put_ok(producer *p, const char *id)
{
	producer_put(p, id, "uint8", "1048576", "ok");
}

/* Eviction while the registry answers nothing: the evicted id leaves it
 * when it answers again; nothing else of the producer waits meanwhile. */
static void test_evict_while_stopped(void **state)
{
	(void)state;
	registry r;
	registry_start(&r, 0, NULL);
	producer p;
	publisher_start(&p, r.url, "2097152", "30"); /* 2 MiB: two items */
	put_ok(&p, "ev-a");
	put_ok(&p, "ev-b");
	assert_true(listed(r.url, "ev-a") && listed(r.url, "ev-b"));

	tu_stop(r.ch.pid);
	char ans[512];
	uint64_t t0 = now_ms();
	/* Evicts ev-a; its removal waits for the registry. The put itself
	 * cannot publish ev-c: it says so, within its bound. */
	assert_true(tu_ask(&p.ch, ans, sizeof(ans), "put ev-c uint8 1048576"));
	uint64_t took = now_ms() - t0;
	print_message("put while the registry is stopped: %llu ms: %s\n",
	              (unsigned long long)took, ans);
	assert_true(took < 2500);
	assert_non_null(strstr(ans, "err"));
	/* The rest of the producer does not wait on the registry. */
	for (int i = 0; i < 5; i++) {
		t0 = now_ms();
		assert_true(tu_ask(&p.ch, ans, sizeof(ans), "stats"));
		assert_true(now_ms() - t0 < 200);
		usleep(200000);
	}
	/* The publisher knows the registry is down now: this removal is not
	 * even sent, only queued. */
	t0 = now_ms();
	assert_true(tu_ask(&p.ch, ans, sizeof(ans), "remove ev-b"));
	assert_string_equal(ans, "ok");
	assert_true(now_ms() - t0 < 200);
	kill(r.ch.pid, SIGCONT);
	uint64_t gone = wait_listed(r.url, "ev-a", false, 3000);
	gone = wait_listed(r.url, "ev-b", false, 3000) + gone;
	print_message("ev-a and ev-b left the registry %llu ms after it "
	              "answered again\n",
	              (unsigned long long)gone);
	assert_false(listed(r.url, "ev-c"));

	/* Puts with the registry back: an evicted id is gone when the put
	 * that evicted it returns. */
	put_ok(&p, "ev-d");
	put_ok(&p, "ev-e");
	put_ok(&p, "ev-f"); /* evicts ev-d */
	assert_false(listed(r.url, "ev-d"));
	assert_true(listed(r.url, "ev-e") && listed(r.url, "ev-f"));
	producer_quit(&p);
	assert_false(listed(r.url, "ev-e") || listed(r.url, "ev-f"));
	registry_kill(&r);
}

/* The registry is killed and started again on its port: ids evicted
 * meanwhile are not there, ids still held are published again. */
static void test_evict_across_restart(void **state)
{
	(void)state;
	registry r;
	registry_start(&r, 0, NULL);
	producer p;
	publisher_start(&p, r.url, "2097152", "30");
	put_ok(&p, "rs-a");
	put_ok(&p, "rs-b");
	unsigned port = r.port;
	registry_kill(&r);
	char ans[512];
	/* Refused at once: rs-a is evicted, its removal queued. */
	uint64_t t0 = now_ms();
	assert_true(tu_ask(&p.ch, ans, sizeof(ans), "put rs-c uint8 1048576"));
	assert_non_null(strstr(ans, "err"));
	assert_true(now_ms() - t0 < 1500);
	assert_true(tu_ask(&p.ch, ans, sizeof(ans), "remove rs-b"));
	assert_string_equal(ans, "ok");
	usleep(300000);
	registry_start(&r, port, NULL);
	/* Puts are refused at once while the producer holds the registry
	 * down; it tries again within its longest back-off (2 s). */
	t0 = now_ms();
	while (tu_ask(&p.ch, ans, sizeof(ans), "put rs-d uint8 1048576") &&
	       strcmp(ans, "ok") != 0 && now_ms() - t0 < 3000)
		usleep(100000);
	assert_string_equal(ans, "ok");
	print_message("a put publishes again %llu ms after the restart\n",
	              (unsigned long long)(now_ms() - t0));
	/* Held items come back; the removed and evicted ones do not. */
	wait_listed(r.url, "rs-d", true, 3000);
	usleep(2500000); /* more than a sync period */
	assert_false(listed(r.url, "rs-a"));
	assert_false(listed(r.url, "rs-b"));
	assert_false(listed(r.url, "rs-c"));
	producer_quit(&p);
	registry_kill(&r);
}

/* Looks id up in url: its holders' producer addresses (first the one a
 * client tries first), and the age the registry gives the first. */
static size_t holders(const char *url, const char *id, char out[][256],
                      uint64_t *age_ms)
{
	ecx_regclient_opts o = {
	    .urls = url, .connect_timeout_ms = 2000, .timeout_ms = 2000};
	ecx_regclient *c;
	char why[256];
	assert_int_equal(ecx_regclient_create(&o, &c, why, sizeof(why)), 0);
	ecx_lookup_item it[1] = {{.id = id}};
	int rc = ecx_regclient_lookup_holders(c, it, 1, why, sizeof(why));
	ecx_regclient_destroy(c);
	if (rc != 0)
		fail_msg("lookup %s: %s", id, why);
	if (!it[0].found)
		return 0;
	ecx_strlcpy(out[0], it[0].entry.producer_zmq, 256);
	for (uint32_t k = 0; k < it[0].nalt; k++)
		ecx_strlcpy(out[k + 1], it[0].alt[k].producer_zmq, 256);
	if (age_ms != NULL)
		*age_ms = it[0].entry.age_ms;
	size_t n = 1 + it[0].nalt;
	ecx_lookup_items_clear(it, 1);
	return n;
}

/* A producer killed with SIGKILL: its entries leave the HTTP registry
 * within its TTL; while it lives they stay (it renews them). */
static void test_killed_producer_expires(void **state)
{
	(void)state;
	registry r;
	registry_start(&r, 0, NULL);
	producer p;
	publisher_start(&p, r.url, "4194304", "2"); /* TTL 2 s */
	put_ok(&p, "ttl-a");
	put_ok(&p, "ttl-b");
	usleep(4500000); /* more than twice the TTL: renewed meanwhile */
	assert_true(listed(r.url, "ttl-a") && listed(r.url, "ttl-b"));
	char h[ECX_HOLDERS_MAX][256];
	uint64_t age = 0;
	assert_int_equal(holders(r.url, "ttl-a", h, &age), 1);
	assert_true(age > 0 && age < 2000);
	kill(p.ch.pid, SIGKILL);
	tu_reap(&p.ch, 2000);
	uint64_t t0 = now_ms();
	uint64_t gone = wait_listed(r.url, "ttl-a", false, 4000);
	assert_false(listed(r.url, "ttl-b"));
	print_message("a SIGKILLed producer's entries left the registry "
	              "%llu ms after the kill (TTL 2 s)\n",
	              (unsigned long long)gone);
	assert_true(now_ms() - t0 <= 2600);
	registry_kill(&r);
}

/* Looks id up in url and loads it with a consumer of this process. */
static void load_ok(const char *url, const char *id, const char *from)
{
	ecx_consumer_params cp = {.field_mask = ECX_CONSUMER_PARAM_REGISTRY |
	                                        ECX_CONSUMER_PARAM_TIMEOUT,
	                          .registry = url,
	                          .timeout_ms = 3000};
	ecx_consumer *c;
	char why[256];
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0)
		fail_msg("consumer: %s", why);
	ecx_item it = {.id = id};
	assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
	assert_int_equal(it.status, 0);
	it.dst = malloc(it.desc.nbytes);
	if (ecx_consumer_load(c, &it, 1) != 0)
		fail_msg("load %s: %s", id, ecx_last_error());
	assert_string_equal(it.producer, from);
	assert_true(tu_check(id, it.dst, it.desc.nbytes));
	free(it.dst);
	ecx_consumer_destroy(c);
}

/* Two producers hold one id: the registry keeps both; stop either and the
 * id still resolves to the other, and loads from it. */
static void test_two_holders(void **state)
{
	(void)state;
	registry r;
	registry_start(&r, 0, NULL);
	producer a, b;
	/* A TTL of 30 s: a renews every 10 s, so no renewal of a lands
	 * between b's put and the lookup to reorder them. */
	publisher_start(&a, r.url, "4194304", "30");
	publisher_start(&b, r.url, "4194304", "30");
	put_ok(&a, "two");
	usleep(5000); /* renewal times are in ms: keep them apart */
	put_ok(&b, "two");
	char h[ECX_HOLDERS_MAX][256];
	assert_int_equal(holders(r.url, "two", h, NULL), 2);
	/* The most recent first. */
	assert_string_equal(h[0], b.zmq);
	assert_string_equal(h[1], a.zmq);
	/* The one that stops unpublishes its own entry only. */
	producer_quit(&b);
	assert_int_equal(holders(r.url, "two", h, NULL), 1);
	assert_string_equal(h[0], a.zmq);
	load_ok(r.url, "two", a.zmq);
	publisher_start(&b, r.url, "4194304", "30");
	put_ok(&b, "two");
	assert_int_equal(holders(r.url, "two", h, NULL), 2);
	producer_quit(&a);
	assert_int_equal(holders(r.url, "two", h, NULL), 1);
	assert_string_equal(h[0], b.zmq);
	load_ok(r.url, "two", b.zmq);
	producer_quit(&b);
	assert_int_equal(holders(r.url, "two", h, NULL), 0);
	registry_kill(&r);
}

/* A pull that fails on one holder (its producer was SIGKILLed; its entry
 * is still listed, within its TTL) loads from the other; with both gone,
 * the error names the producer and how old its entry is. */
static void test_failover(void **state)
{
	(void)state;
	registry r;
	registry_start(&r, 0, NULL);
	producer a, b;
	publisher_start(&a, r.url, "4194304", "20");
	publisher_start(&b, r.url, "4194304", "20");
	put_ok(&a, "fo");
	put_ok(&b, "fo");
	ecx_consumer_params cp = {.field_mask = ECX_CONSUMER_PARAM_REGISTRY |
	                                        ECX_CONSUMER_PARAM_TIMEOUT,
	                          .registry = r.url,
	                          .timeout_ms = 3000};
	ecx_consumer *c;
	char why[256];
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0)
		fail_msg("consumer: %s", why);
	kill(a.ch.pid, SIGKILL);
	tu_reap(&a.ch, 2000);
	ecx_item it = {.id = "fo"};
	assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
	assert_int_equal(it.status, 0);
	/* As if the registry had answered the dead holder first. */
	ecx_strlcpy(it.producer, a.zmq, sizeof(it.producer));
	it.dst = malloc(it.desc.nbytes);
	uint64_t t0 = now_ms();
	int rc = ecx_consumer_load(c, &it, 1);
	uint64_t took = now_ms() - t0;
	if (rc != 0)
		fail_msg("load with failover: %s", ecx_last_error());
	print_message("loaded from the other holder in %llu ms\n",
	              (unsigned long long)took);
	assert_int_equal(it.status, 0);
	assert_string_equal(it.producer, b.zmq);
	assert_true(tu_check("fo", it.dst, it.desc.nbytes));
	assert_true(took < 1500);

	/* Both gone: the error says which producer and since when. */
	kill(b.ch.pid, SIGKILL);
	tu_reap(&b.ch, 2000);
	memset(it.dst, 0, it.desc.nbytes);
	ecx_strlcpy(it.producer, a.zmq, sizeof(it.producer));
	assert_int_not_equal(ecx_consumer_load(c, &it, 1), 0);
	print_message("both holders gone: %s\n", ecx_last_error());
	assert_non_null(strstr(ecx_last_error(), "does not answer"));
	assert_non_null(strstr(ecx_last_error(), "entry renewed"));
	assert_non_null(strstr(ecx_last_error(), a.zmq));
	free(it.dst);
	ecx_consumer_destroy(c);
	registry_kill(&r);
}

int main(void)
{
	atexit(kill_children);
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_evict_while_stopped),
	    cmocka_unit_test(test_evict_across_restart),
	    cmocka_unit_test(test_killed_producer_expires),
	    cmocka_unit_test(test_two_holders),
	    cmocka_unit_test(test_failover),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
