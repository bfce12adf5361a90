/*
 * The Redis registry and scale-out: a real redis-server on a free port
 * (started and stopped here), the Redis store, the HTTP registry in front
 * of it, producers publishing to it with a TTL, three producers and two
 * consumers, and a Redis that is down.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/port.h"

#include "common/fixture.h"
#include "registry/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>

static pid_t redis_pid;
static int redis_port;
static char redis_url[64];
static char redis_dir[] = "/tmp/ecx-redis-XXXXXX";

static int redis_start(void **state)
{
	(void)state;
	if (mkdtemp(redis_dir) == NULL)
		return -1;
	redis_port = tu_free_port();
	char port[16];
	snprintf(port, sizeof(port), "%d", redis_port);
	char *argv[] = {"/usr/bin/redis-server",
	                "--port",
	                port,
	                "--bind",
	                "127.0.0.1",
	                "--save",
	                "",
	                "--appendonly",
	                "no",
	                "--dir",
	                redis_dir,
	                "--logfile",
	                "",
	                NULL};
	extern char **environ;
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	if (posix_spawn(&redis_pid, argv[0], &fa, NULL, argv, environ) != 0)
		return -1;
	posix_spawn_file_actions_destroy(&fa);
	snprintf(redis_url, sizeof(redis_url), "redis://127.0.0.1:%d",
	         redis_port);
	/* Ready when it answers. */
	char why[200];
	for (int i = 0; i < 100; i++) {
		ecx_store *s =
		    ecx_store_redis_create(redis_url, 500, 0, why, sizeof(why));
		ecx_lookup_item it = {.id = "ping"};
		int rc = s->ops->mget(s, &it, 1, why, sizeof(why));
		ecx_store_destroy(s);
		if (rc == 0)
			return 0;
		usleep(50000);
	}
	return -1;
}

static int redis_stop(void **state)
{
	(void)state;
	kill(redis_pid, SIGTERM);
	waitpid(redis_pid, NULL, 0);
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", redis_dir);
	return system(cmd) == 0 ? 0 : -1;
}

static ecx_entry entry(uint64_t n, const char *zmq)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	uint64_t dims[] = {n};
	ecx_tensor_set(&e.desc, ECX_DTYPE_UINT8, 1, dims);
	ecx_strlcpy(e.producer_zmq, zmq, sizeof(e.producer_zmq));
	e.epoch = 9;
	return e;
}

static void test_store(void **state)
{
	(void)state;
	char why[200];
	ecx_store *s = ecx_store_redis_create(redis_url, 1000, 0, why, 200);
	assert_non_null(s);
	ecx_entry a = entry(10, "tcp://p1:1"), b = entry(20, "tcp://p2:1");
	assert_int_equal(s->ops->put(s, "st-a", &a, why, 200), 0);
	assert_int_equal(s->ops->put(s, "st-b", &b, why, 200), 0);
	ecx_entry got;
	assert_int_equal(s->ops->get(s, "st-a", &got, why, 200), 0);
	assert_memory_equal(&got, &a, sizeof(a));
	assert_int_equal(s->ops->get(s, "st-zz", &got, why, 200),
	                 ECX_ENOTFOUND);
	ecx_lookup_item it[3] = {
	    {.id = "st-a"}, {.id = "st-zz"}, {.id = "st-b"}};
	assert_int_equal(s->ops->mget(s, it, 3, why, 200), 0);
	assert_true(it[0].found && !it[1].found && it[2].found);
	assert_int_equal(it[2].entry.desc.nbytes, 20);
	/* Removal is conditional on the producer. */
	assert_int_equal(s->ops->del(s, "st-a", "tcp://p2:1", why, 200),
	                 ECX_ENOTFOUND);
	assert_int_equal(s->ops->del(s, "st-a", "tcp://p1:1", why, 200), 0);
	assert_int_equal(s->ops->del(s, "st-a", NULL, why, 200), ECX_ENOTFOUND);
	ecx_store_row rows[10];
	size_t n, total;
	assert_int_equal(s->ops->list(s, "", 10, rows, &n, &total, why, 200),
	                 0);
	assert_int_equal(n, 1);
	assert_string_equal(rows[0].id, "st-b");
	assert_int_equal(s->ops->del(s, "st-b", NULL, why, 200), 0);
	assert_int_equal(s->ops->count(s), 0);
	ecx_store_destroy(s);
	/* Bad URLs. */
	assert_null(ecx_store_redis_create("redis://", 100, 0, why, 200));
	assert_null(
	    ecx_store_redis_create("redis://h:99999", 100, 0, why, 200));
	assert_null(ecx_store_redis_create("redis://h:1/x", 100, 0, why, 200));
	assert_null(ecx_store_redis_create("http://h:1", 100, 0, why, 200));
}

static void test_ttl(void **state)
{
	(void)state;
	char why[200];
	ecx_store *s = ecx_store_redis_create(redis_url, 1000, 1, why, 200);
	ecx_entry a = entry(10, "tcp://p1:1");
	assert_int_equal(s->ops->put(s, "ttl-a", &a, why, 200), 0);
	assert_int_equal(s->ops->put(s, "ttl-b", &a, why, 200), 0);
	/* Renewing keeps ttl-b; ttl-a expires. */
	for (int i = 0; i < 4; i++) {
		usleep(400000);
		const char *ids[] = {"ttl-b"};
		assert_int_equal(
		    ecx_store_redis_refresh(s, ids, &a, 1, why, 200), 0);
	}
	ecx_lookup_item it[2] = {{.id = "ttl-a"}, {.id = "ttl-b"}};
	assert_int_equal(s->ops->mget(s, it, 2, why, 200), 0);
	assert_false(it[0].found);
	assert_true(it[1].found);
	ecx_store_destroy(s);
}

/* A Redis that is down: a bounded error, and a registry after it in the
 * list still answers. */
static void test_down(void **state)
{
	(void)state;
	char why[200], url[64];
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", tu_free_port());
	ecx_store *s = ecx_store_redis_create(url, 300, 0, why, 200);
	ecx_lookup_item it = {.id = "x"};
	uint64_t t0 = now_ms();
	assert_int_equal(s->ops->mget(s, &it, 1, why, 200), ECX_ECONNECT);
	assert_true(now_ms() - t0 < 1000);
	ecx_store_destroy(s);
	/* Accepts but never answers: times out within the bound. */
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	socklen_t sl = sizeof(sa);
	getsockname(fd, (struct sockaddr *)&sa, &sl);
	listen(fd, 4);
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", ntohs(sa.sin_port));
	s = ecx_store_redis_create(url, 300, 0, why, 200);
	t0 = now_ms();
	assert_int_not_equal(s->ops->mget(s, &it, 1, why, 200), 0);
	assert_true(now_ms() - t0 < 1500);
	ecx_store_destroy(s);
	/* The HTTP registry after it in the list still works. */
	ecx_registry_params rp = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                        ECX_REGISTRY_PARAM_PORT,
	                          .bind_host = "127.0.0.1",
	                          .port = 0};
	ecx_registry *r;
	assert_int_equal(ecx_registry_create(&rp, &r, why, 200), 0);
	ecx_entry e = entry(5, "tcp://p:1");
	ecx_store *mem = ecx_registry_store(r);
	mem->ops->put(mem, "x", &e, why, 200);
	char both[200];
	snprintf(both, sizeof(both), "%s,http://127.0.0.1:%u", url,
	         ecx_registry_port(r));
	ecx_regclient_opts o = {.urls = both, .timeout_ms = 300};
	ecx_regclient *c;
	assert_int_equal(ecx_regclient_create(&o, &c, why, 200), 0);
	t0 = now_ms();
	assert_int_equal(ecx_regclient_lookup(c, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_true(now_ms() - t0 < 1500);
	ecx_regclient_destroy(c);
	ecx_registry_destroy(r);
	close(fd);
}

/* The HTTP registry daemon with Redis as its store: HTTP clients and Redis
 * clients see the same entries. */
static void test_http_over_redis(void **state)
{
	(void)state;
	char why[200], url[64];
	ecx_registry_params rp = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                        ECX_REGISTRY_PARAM_PORT |
	                                        ECX_REGISTRY_PARAM_STORE,
	                          .bind_host = "127.0.0.1",
	                          .port = 0,
	                          .store = redis_url};
	ecx_registry *r;
	assert_int_equal(ecx_registry_create(&rp, &r, why, 200), 0);
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", ecx_registry_port(r));
	ecx_regclient_opts o = {.urls = url};
	ecx_regclient *http;
	assert_int_equal(ecx_regclient_create(&o, &http, why, 200), 0);
	ecx_entry e = entry(77, "tcp://p9:9");
	assert_int_equal(ecx_regclient_put(http, "via-http", &e, why, 200), 0);
	o.urls = redis_url;
	ecx_regclient *direct;
	assert_int_equal(ecx_regclient_create(&o, &direct, why, 200), 0);
	ecx_lookup_item it = {.id = "via-http"};
	assert_int_equal(ecx_regclient_lookup(direct, &it, 1, why, 200), 0);
	assert_true(it.found);
	assert_int_equal(it.entry.desc.nbytes, 77);
	long status;
	char *body;
	size_t len;
	assert_int_equal(ecx_regclient_get_raw(http, "/ec/list", &status, &body,
	                                       &len, why, 200),
	                 0);
	assert_int_equal(status, 200);
	assert_non_null(strstr(body, "\"id\":\"via-http\""));
	free(body);
	assert_int_equal(
	    ecx_regclient_delete(direct, "via-http", NULL, why, 200), 0);
	it.found = false;
	assert_int_equal(ecx_regclient_lookup(http, &it, 1, why, 200), 0);
	assert_false(it.found);
	ecx_regclient_destroy(http);
	ecx_regclient_destroy(direct);
	ecx_registry_destroy(r);
}

/* A producer peer publishing to the Redis under test, with this
 * capacity. */
static void redis_producer_start(producer *p, const char *capacity)
{
	producer_start(p, NULL, "--registry", redis_url, "--registry-ttl", "2",
	               "--capacity", capacity, "--timeout", "2000", NULL);
}

static void put(producer *p, const char *id, const char *shape)
{
	producer_put(p, id, "uint8", shape, "ok");
}

static bool in_redis(const char *id)
{
	char why[200];
	ecx_store *s = ecx_store_redis_create(redis_url, 1000, 0, why, 200);
	ecx_lookup_item it = {.id = id};
	s->ops->mget(s, &it, 1, why, 200);
	ecx_store_destroy(s);
	return it.found;
}

/* Producers publish with SET and a TTL, remove on eviction at once, and
 * leave nothing behind when SIGKILLed (the TTL runs out). */
static void test_producer_lifecycle(void **state)
{
	(void)state;
	producer p;
	redis_producer_start(&p, "2097152"); /* 2 MiB */
	put(&p, "life-1", "1048576");
	put(&p, "life-2", "1048576");
	assert_true(in_redis("life-1") && in_redis("life-2"));
	put(&p, "life-3", "1048576"); /* evicts life-1 */
	assert_false(in_redis("life-1"));
	assert_true(in_redis("life-3"));
	/* Renewed while it lives: still there after twice the TTL. */
	usleep(4500000);
	assert_true(in_redis("life-2") && in_redis("life-3"));
	/* Lost from Redis (a restart, a flush): put back within a period. */
	char why[200];
	ecx_store *s = ecx_store_redis_create(redis_url, 1000, 0, why, 200);
	assert_int_equal(s->ops->del(s, "life-2", NULL, why, 200), 0);
	ecx_store_destroy(s);
	uint64_t t1 = now_ms();
	while (!in_redis("life-2") && now_ms() - t1 < 3000)
		usleep(50000);
	assert_true(in_redis("life-2"));
	kill(p.ch.pid, SIGKILL);
	tu_reap(&p.ch, 1000);
	uint64_t t0 = now_ms();
	while ((in_redis("life-2") || in_redis("life-3")) &&
	       now_ms() - t0 < 5000)
		usleep(100000);
	assert_false(in_redis("life-2"));
	assert_false(in_redis("life-3"));
	assert_true(now_ms() - t0 >= 500 && now_ms() - t0 < 4000);
}

static ecx_consumer *consumer(const char *registry)
{
	ecx_consumer_params cp = {.field_mask = ECX_CONSUMER_PARAM_REGISTRY |
	                                        ECX_CONSUMER_PARAM_TIMEOUT,
	                          .registry = registry,
	                          .timeout_ms = 2000};
	ecx_consumer *c;
	char why[200];
	if (ecx_consumer_create(&cp, &c, why, sizeof(why)) != 0)
		fail_msg("%s", why);
	return c;
}

/* Three producers, two consumers (this process and a peer process); a
 * batch spanning all three loads with one pull per producer; a producer
 * that is down fails only its own items. */
static void test_many_producers(void **state)
{
	(void)state;
	producer ps[3];
	char ids[12][16];
	for (int k = 0; k < 3; k++) {
		redis_producer_start(&ps[k], "16777216");
		for (int i = 0; i < 4; i++) {
			snprintf(ids[k * 4 + i], sizeof(ids[0]), "mp%d-%d", k,
			         i);
			put(&ps[k], ids[k * 4 + i], "65536");
		}
	}
	char path[512];
	snprintf(path, sizeof(path), "%s/ecx-test-peer", tu_bindir());
	char *argv[] = {path, "consumer", redis_url, NULL};
	tu_child other;
	assert_true(tu_spawn(&other, argv));
	char line[1024];
	assert_true(tu_line(&other, line, sizeof(line)));
	fprintf(other.in, "loop 10");
	for (int i = 0; i < 12; i++)
		fprintf(other.in, " %s", ids[i]);
	fprintf(other.in, "\n");
	fflush(other.in);

	ecx_consumer *c = consumer(redis_url);
	ecx_item it[12];
	memset(it, 0, sizeof(it));
	for (int i = 0; i < 12; i++)
		it[i].id = ids[i];
	assert_int_equal(ecx_consumer_lookup(c, it, 12), 0);
	for (int i = 0; i < 12; i++) {
		assert_int_equal(it[i].status, 0);
		it[i].dst = malloc(65536);
	}
	assert_string_equal(it[0].producer, ps[0].zmq);
	assert_string_equal(it[11].producer, ps[2].zmq);
	assert_int_equal(ecx_consumer_load(c, it, 12), 0);
	for (int i = 0; i < 12; i++)
		assert_true(tu_check(ids[i], it[i].dst, 65536));
	ecx_consumer_stats st;
	ecx_consumer_stats_get(c, &st);
	assert_int_equal(st.connections, 3);
	assert_true(tu_line(&other, line, sizeof(line)));
	assert_string_equal(line, "ok 10");

	/* Producer 1 goes away: only its four items fail. */
	kill(ps[1].ch.pid, SIGKILL);
	tu_reap(&ps[1].ch, 1000);
	uint64_t t0 = now_ms();
	int rc = ecx_consumer_load(c, it, 12);
	assert_int_not_equal(rc, 0);
	assert_true(now_ms() - t0 < 2000 + 1000);
	for (int i = 0; i < 12; i++) {
		if (i / 4 == 1)
			assert_int_not_equal(it[i].status, 0);
		else
			assert_int_equal(it[i].status, 0);
	}
	for (int i = 0; i < 12; i++)
		free(it[i].dst);
	ecx_consumer_destroy(c);
	tu_ask(&other, line, sizeof(line), "quit");
	tu_reap(&other, 5000);
	for (int k = 0; k < 3; k += 2) {
		tu_ask(&ps[k].ch, line, sizeof(line), "quit");
		tu_reap(&ps[k].ch, 5000);
	}
	/* The survivors unpublished their items when they stopped. */
	assert_false(in_redis("mp0-0"));
	assert_false(in_redis("mp2-3"));
}

/* A producer publishing through an HTTP registry in front of Redis: its
 * entries live while it renews them (by writing them again: the Redis
 * store has no /ec/renew), and leave within its TTL once it is killed. */
static void test_lease_through_http(void **state)
{
	(void)state;
	char why[200], url[64];
	ecx_registry_params rp = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                        ECX_REGISTRY_PARAM_PORT |
	                                        ECX_REGISTRY_PARAM_STORE,
	                          .bind_host = "127.0.0.1",
	                          .port = 0,
	                          .store = redis_url};
	ecx_registry *r;
	assert_int_equal(ecx_registry_create(&rp, &r, why, 200), 0);
	snprintf(url, sizeof(url), "http://127.0.0.1:%u", ecx_registry_port(r));
	producer p;
	producer_start(&p, NULL, "--registry", url, "--registry-ttl", "2",
	               NULL);
	put(&p, "lh-a", "4096");
	usleep(4500000); /* over twice the TTL */
	assert_true(in_redis("lh-a"));
	kill(p.ch.pid, SIGKILL);
	tu_reap(&p.ch, 1000);
	uint64_t t0 = now_ms();
	while (in_redis("lh-a") && now_ms() - t0 < 4000)
		usleep(100000);
	assert_false(in_redis("lh-a"));
	assert_true(now_ms() - t0 <= 2500);
	ecx_registry_destroy(r);
}

/* The producer address of id's entry in Redis ("" when absent). */
static void redis_holder(const char *id, char *out, size_t n)
{
	char why[200];
	ecx_store *s = ecx_store_redis_create(redis_url, 1000, 0, why, 200);
	ecx_lookup_item it = {.id = id};
	s->ops->mget(s, &it, 1, why, 200);
	ecx_store_destroy(s);
	ecx_strlcpy(out, it.found ? it.entry.producer_zmq : "", n);
}

/* Two producers hold one id on Redis (one entry per id there): stop either
 * and the id resolves to the other within one renewal period (its renewal
 * writes its entry again), and loads from it. */
static void test_two_holders_redis(void **state)
{
	(void)state;
	producer a, b;
	redis_producer_start(&a, "4194304");
	redis_producer_start(&b, "4194304");
	put(&a, "rd-two", "65536");
	put(&b, "rd-two", "65536");
	char line[256], who[256];
	/* Both holders are kept: the batched route names them. */
	{
		ecx_regclient_opts o = {.urls = redis_url, .timeout_ms = 1000};
		ecx_regclient *rc;
		char why[200];
		assert_int_equal(ecx_regclient_create(&o, &rc, why, 200), 0);
		ecx_lookup_item it = {.id = "rd-two"};
		assert_int_equal(
		    ecx_regclient_lookup_holders(rc, &it, 1, why, 200), 0);
		assert_true(it.found);
		assert_int_equal(it.nalt, 1);
		assert_string_equal(it.entry.producer_zmq, b.zmq);
		assert_string_equal(it.alt[0].producer_zmq, a.zmq);
		ecx_lookup_items_clear(&it, 1);
		ecx_regclient_destroy(rc);
	}
	/* First the last writer stops (its removal takes the entry: the
	 * other writes it again), then the other one (nothing to take). */
	for (int round = 0; round < 2; round++) {
		producer *gone = round == 0 ? &b : &a;
		producer *stays = round == 0 ? &a : &b;
		assert_true(tu_ask(&gone->ch, line, sizeof(line), "quit"));
		tu_reap(&gone->ch, 5000);
		uint64_t t0 = now_ms();
		redis_holder("rd-two", who, sizeof(who));
		while (strcmp(who, stays->zmq) != 0 && now_ms() - t0 < 2000) {
			usleep(50000);
			redis_holder("rd-two", who, sizeof(who));
		}
		assert_string_equal(who, stays->zmq);
		print_message("the id resolved to the other holder %llu ms "
		              "after one stopped\n",
		              (unsigned long long)(now_ms() - t0));
		ecx_consumer *c = consumer(redis_url);
		ecx_item it = {.id = "rd-two"};
		assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
		it.dst = malloc(65536);
		assert_int_equal(ecx_consumer_load(c, &it, 1), 0);
		assert_string_equal(it.producer, stays->zmq);
		assert_true(tu_check("rd-two", it.dst, 65536));
		free(it.dst);
		ecx_consumer_destroy(c);
		if (round == 0) {
			redis_producer_start(&b, "4194304");
			put(&b, "rd-two", "65536");
		}
	}
	/* A holder SIGKILLed while its entry is still there: a load that
	 * tries it first fails over to the other. */
	redis_producer_start(&a, "4194304");
	put(&a, "rd-two", "65536");
	kill(b.ch.pid, SIGKILL);
	tu_reap(&b.ch, 1000);
	ecx_consumer *c = consumer(redis_url);
	ecx_item it = {.id = "rd-two"};
	assert_int_equal(ecx_consumer_lookup(c, &it, 1), 0);
	ecx_strlcpy(it.producer, b.zmq, sizeof(it.producer));
	it.dst = malloc(65536);
	if (ecx_consumer_load(c, &it, 1) != 0)
		fail_msg("failover on Redis: %s", ecx_last_error());
	assert_string_equal(it.producer, a.zmq);
	assert_true(tu_check("rd-two", it.dst, 65536));
	free(it.dst);
	ecx_consumer_destroy(c);
	assert_true(tu_ask(&a.ch, line, sizeof(line), "quit"));
	tu_reap(&a.ch, 5000);
	/* b's holder entry leaves with its TTL (2 s). */
	uint64_t t0 = now_ms();
	while (in_redis("rd-two") && now_ms() - t0 < 4000)
		usleep(100000);
	assert_false(in_redis("rd-two"));
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_store),
	    cmocka_unit_test(test_ttl),
	    cmocka_unit_test(test_down),
	    cmocka_unit_test(test_http_over_redis),
	    cmocka_unit_test(test_producer_lifecycle),
	    cmocka_unit_test(test_many_producers),
	    cmocka_unit_test(test_two_holders_redis),
	    cmocka_unit_test(test_lease_through_http),
	};
	return cmocka_run_group_tests(tests, redis_start, redis_stop);
}
