/*
 * The Redis store behind Redis Sentinel (redis+sentinel://), against real
 * processes on 127.0.0.1, started and stopped here: a master and a replica
 * (redis-server, with a password) and a sentinel (redis-sentinel) that
 * fails over after 1 s, named in the URLs after a sentinel port where
 * nothing listens. Wrong master names and passwords, a master that turned
 * replica behind the sentinel's back (never written), a failover the
 * sentinel starts (its +switch-master notice) and one after the master is
 * killed, and every sentinel stopped: each call within its bound.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/port.h"

#include "common/testutil.h"
#include "dir/dir.h"
#include "dir/regclient.h"
#include "dir/store.h"

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>

#define PASS "s3cret"
#define MASTER "ecxm"

static char dir[] = "/tmp/ecx-sentinel-XXXXXX";
static int port_a, port_b, port_s, port_dead;
static pid_t pid_a, pid_b, pid_s;
static char url[256];
static bool have_sentinel;

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static pid_t spawn(char **argv)
{
	extern char **environ;
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	pid_t pid = -1;
	if (posix_spawn(&pid, argv[0], &fa, NULL, argv, environ) != 0)
		pid = -1;
	posix_spawn_file_actions_destroy(&fa);
	return pid;
}

static pid_t start_redis(int port, int master_port)
{
	char p[16], mp[16];
	snprintf(p, sizeof(p), "%d", port);
	snprintf(mp, sizeof(mp), "%d", master_port);
	char *argv[] = {"/usr/bin/redis-server",
	                "--port",
	                p,
	                "--bind",
	                "127.0.0.1",
	                "--save",
	                "",
	                "--appendonly",
	                "no",
	                "--dir",
	                dir,
	                "--requirepass",
	                PASS,
	                "--masterauth",
	                PASS,
	                "--logfile",
	                "",
	                master_port ? "--replicaof" : NULL,
	                "127.0.0.1",
	                mp,
	                NULL};
	return spawn(argv);
}

/* One command to the server at port (with the password when auth). */
static redisReply *cmd(int port, bool auth, const char *fmt, ...)
{
	struct timeval tv = {.tv_sec = 1};
	redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
	if (c == NULL || c->err) {
		redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, tv);
	if (auth)
		freeReplyObject(redisCommand(c, "AUTH " PASS));
	va_list ap;
	va_start(ap, fmt);
	redisReply *r = redisvCommand(c, fmt, ap);
	va_end(ap);
	redisFree(c);
	return r;
}

/* The master's port the sentinel names, 0 when it answers none. */
static int sentinel_master(void)
{
	redisReply *r =
	    cmd(port_s, false, "SENTINEL get-master-addr-by-name " MASTER);
	int port = r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == 2
	               ? atoi(r->element[1]->str)
	               : 0;
	freeReplyObject(r);
	return port;
}

/* Whether the server at port says (INFO replication) it has role, and,
 * for a replica, its link to the master up. */
static bool has_role(int port, const char *role)
{
	redisReply *r = cmd(port, true, "INFO replication");
	char want[32];
	snprintf(want, sizeof(want), "role:%s", role);
	bool ok = r != NULL && r->type == REDIS_REPLY_STRING &&
	          strstr(r->str, want) != NULL &&
	          (strcmp(role, "master") == 0 ||
	           strstr(r->str, "master_link_status:up") != NULL);
	freeReplyObject(r);
	return ok;
}

static bool key_on(int port, const char *key)
{
	redisReply *r = cmd(port, true, "EXISTS %s", key);
	bool yes =
	    r != NULL && r->type == REDIS_REPLY_INTEGER && r->integer == 1;
	freeReplyObject(r);
	return yes;
}

/* Whether the sentinel counts the server at port as a replica it could
 * promote (it learns of replicas from their INFO, every few seconds). */
static bool sentinel_sees_replica(int port)
{
	redisReply *r = cmd(port_s, false, "SENTINEL REPLICAS " MASTER);
	bool ok = false;
	for (size_t i = 0; r != NULL && r->type == REDIS_REPLY_ARRAY &&
	                   i < r->elements && !ok;
	     i++) {
		const redisReply *x = r->element[i];
		int p = 0, good = 0;
		for (size_t f = 0; f + 1 < x->elements; f += 2) {
			const char *k = x->element[f]->str,
			           *v = x->element[f + 1]->str;
			if (strcmp(k, "port") == 0)
				p = atoi(v);
			good += (strcmp(k, "flags") == 0 &&
			         strcmp(v, "slave") == 0) ||
			        (strcmp(k, "role-reported") == 0 &&
			         strcmp(v, "slave") == 0) ||
			        (strcmp(k, "master-link-status") == 0 &&
			         strcmp(v, "ok") == 0);
		}
		ok = p == port && good == 3;
	}
	freeReplyObject(r);
	return ok;
}

/* Waits until the sentinel names master m, m says master and the other
 * is its replica with the link up, as the sentinel sees too. */
static bool settled(int m, int replica, int ms)
{
	for (uint64_t end = now_ms() + (uint64_t)ms; now_ms() < end;) {
		if (sentinel_master() == m && has_role(m, "master") &&
		    (replica == 0 || (has_role(replica, "slave") &&
		                      sentinel_sees_replica(replica))))
			return true;
		usleep(100000);
	}
	return false;
}

static int setup(void **state)
{
	(void)state;
	if (access("/usr/bin/redis-sentinel", X_OK) != 0 ||
	    access("/usr/bin/redis-server", X_OK) != 0)
		return 0; /* each test skips */
	if (mkdtemp(dir) == NULL)
		return -1;
	port_a = tu_free_port();
	port_b = tu_free_port();
	port_s = tu_free_port();
	port_dead = tu_free_port();
	if ((pid_a = start_redis(port_a, 0)) < 0 ||
	    (pid_b = start_redis(port_b, port_a)) < 0)
		return -1;
	char conf[512];
	snprintf(conf, sizeof(conf), "%s/sentinel.conf", dir);
	FILE *f = fopen(conf, "w");
	if (f == NULL)
		return -1;
	fprintf(f,
	        "port %d\nbind 127.0.0.1\ndir %s\nlogfile \"\"\n"
	        "sentinel monitor " MASTER " 127.0.0.1 %d 1\n"
	        "sentinel auth-pass " MASTER " " PASS "\n"
	        "sentinel down-after-milliseconds " MASTER " 1000\n"
	        "sentinel failover-timeout " MASTER " 2000\n",
	        port_s, dir, port_a);
	fclose(f);
	char *argv[] = {"/usr/bin/redis-sentinel", conf, NULL};
	if ((pid_s = spawn(argv)) < 0)
		return -1;
	snprintf(url, sizeof(url),
	         "redis+sentinel://:" PASS "@127.0.0.1:%d,127.0.0.1:%d/" MASTER,
	         port_dead, port_s);
	if (!settled(port_a, port_b, 15000))
		return -1;
	have_sentinel = true;
	return 0;
}

static int teardown(void **state)
{
	(void)state;
	pid_t pids[] = {pid_s, pid_a, pid_b};
	for (size_t i = 0; i < 3; i++) {
		if (pids[i] > 0) {
			kill(pids[i], SIGCONT);
			kill(pids[i], SIGKILL);
			waitpid(pids[i], NULL, 0);
		}
	}
	char c[128];
	snprintf(c, sizeof(c), "rm -rf %s", dir);
	return system(c) == 0 ? 0 : -1;
}

#define NEED_SENTINEL()             \
	do {                        \
		if (!have_sentinel) \
			skip();     \
	} while (0)

static ecx_entry entry(const char *zmq)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	uint64_t dims[] = {64};
	ecx_tensor_set(&e.desc, ECX_DTYPE_UINT8, 1, dims);
	ecx_strlcpy(e.producer_zmq, zmq, sizeof(e.producer_zmq));
	e.epoch = 7;
	return e;
}

/* Bad URLs are refused when the store is made; the commas of a sentinel
 * list stay in one registry URL, and a comma before a scheme starts the
 * next. */
static void test_urls(void **state)
{
	(void)state;
	char why[256];
	const char *bad[] = {"redis+sentinel://127.0.0.1:1",
	                     "redis+sentinel://127.0.0.1:1/",
	                     "redis+sentinel://127.0.0.1:99999/m",
	                     "redis+sentinel:///m",
	                     "redis+sentinel://h:1/m/x",
	                     "redis+sentinel://h:1/m,h:2"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		why[0] = '\0';
		assert_null(
		    ecx_store_redis_create(bad[i], 500, 0, why, sizeof(why)));
		assert_non_null(strstr(why, "redis+sentinel://"));
	}
	ecx_store *s = ecx_store_redis_create("redis+sentinel://a:1,b,c:3/m/2",
	                                      500, 0, why, sizeof(why));
	assert_non_null(s);
	ecx_store_destroy(s);
	ecx_regclient_opts o = {
	    .urls = "redis+sentinel://127.0.0.1:1, 127.0.0.1:2/m,"
	            "http://127.0.0.1:3, REDIS+SENTINEL://h:4,h:5/n/1"};
	ecx_regclient *c;
	assert_int_equal(ecx_regclient_create(&o, &c, why, sizeof(why)), 0);
	assert_int_equal(c->nregs, 3);
	assert_string_equal(c->regs[0].url,
	                    "redis+sentinel://127.0.0.1:1, 127.0.0.1:2/m");
	assert_true(c->regs[0].sentinel && c->regs[0].redis != NULL);
	assert_string_equal(c->regs[1].url, "http://127.0.0.1:3");
	assert_true(c->regs[2].sentinel);
	ecx_regclient_destroy(c);
	/* Other URLs end at their first comma, as before. */
	o.urls = "http://127.0.0.1:3,127.0.0.1:4";
	assert_int_equal(ecx_regclient_create(&o, &c, why, sizeof(why)),
	                 ECX_EINVAL);
	assert_non_null(strstr(why, "'127.0.0.1:4'"));
}

/* A master name the sentinels do not know: a clear error, at once. */
static void test_wrong_master(void **state)
{
	(void)state;
	NEED_SENTINEL();
	char u[256], why[320];
	snprintf(u, sizeof(u), "redis+sentinel://127.0.0.1:%d/nosuch", port_s);
	ecx_store *s = ecx_store_redis_create(u, 3000, 0, why, sizeof(why));
	assert_non_null(s);
	ecx_entry e = entry("tcp://p:1");
	uint64_t t0 = now_ms();
	assert_int_equal(s->ops->put(s, "wm-1", &e, why, sizeof(why)),
	                 ECX_EINVAL);
	assert_true(now_ms() - t0 < 1500);
	assert_non_null(strstr(why, "knows no master named 'nosuch'"));
	ecx_store_destroy(s);
}

/* A password the master refuses: ECX_EAUTH that says so, at once. */
static void test_wrong_password(void **state)
{
	(void)state;
	NEED_SENTINEL();
	char u[256], why[320];
	snprintf(u, sizeof(u), "redis+sentinel://:nope@127.0.0.1:%d/" MASTER,
	         port_s);
	ecx_store *s = ecx_store_redis_create(u, 3000, 0, why, sizeof(why));
	assert_non_null(s);
	ecx_entry e = entry("tcp://p:1");
	uint64_t t0 = now_ms();
	assert_int_equal(s->ops->put(s, "wp-1", &e, why, sizeof(why)),
	                 ECX_EAUTH);
	assert_true(now_ms() - t0 < 1500);
	assert_non_null(strstr(why, "refused the password"));
	assert_null(strstr(why, "nope"));
	ecx_store_destroy(s);
}

/* Entries through the master the sentinel names (after a sentinel that
 * is not there). */
static void test_through_sentinel(void **state)
{
	(void)state;
	NEED_SENTINEL();
	char why[320];
	ecx_store *s = ecx_store_redis_create(url, 2000, 0, why, sizeof(why));
	assert_non_null(s);
	ecx_entry e = entry("tcp://p:1");
	assert_int_equal(s->ops->put(s, "ts-1", &e, why, sizeof(why)), 0);
	ecx_entry got;
	assert_int_equal(s->ops->get(s, "ts-1", &got, why, sizeof(why)), 0);
	assert_int_equal(got.desc.nbytes, 64);
	assert_true(key_on(port_a, "ecx:ts-1"));
	assert_int_equal(ecx_store_redis_ping(s, why, sizeof(why)), 0);
	ecx_store_destroy(s);
}

/* A failover the sentinel makes with the master still up: once the
 * sentinel has said +switch-master, a store connected to the old master,
 * which still takes writes (the sentinel demotes it later), writes to the
 * new one: only the notice can tell it. */
static void test_switch_followed(void **state)
{
	(void)state;
	NEED_SENTINEL();
	char why[320];
	ecx_store *s = ecx_store_redis_create(url, 3000, 0, why, sizeof(why));
	ecx_entry e = entry("tcp://p:1");
	assert_int_equal(s->ops->put(s, "sw-1", &e, why, sizeof(why)), 0);
	struct timeval tv = {.tv_sec = 20};
	redisContext *sub = redisConnectWithTimeout("127.0.0.1", port_s, tv);
	assert_true(sub != NULL && sub->err == 0);
	redisSetTimeout(sub, tv);
	freeReplyObject(redisCommand(sub, "SUBSCRIBE +switch-master"));
	redisReply *r = cmd(port_s, false, "SENTINEL FAILOVER " MASTER);
	assert_non_null(r);
	if (r->type == REDIS_REPLY_ERROR)
		print_message("# SENTINEL FAILOVER: %s\n", r->str);
	assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
	freeReplyObject(r);
	void *note = NULL;
	assert_int_equal(redisGetReply(sub, &note), REDIS_OK);
	freeReplyObject(note);
	redisFree(sub);
	assert_true(settled(port_b, 0, 20000));
	bool old_takes_writes = has_role(port_a, "master");
	uint64_t t0 = now_ms();
	int rc = s->ops->put(s, "sw-2", &e, why, sizeof(why));
	print_message("# first put after +switch-master: %s in %llu ms (the "
	              "old master %s)\n",
	              ecx_err_name(rc), (unsigned long long)(now_ms() - t0),
	              old_takes_writes ? "still a master" : "a replica");
	assert_int_equal(rc, 0);
	assert_true(key_on(port_b, "ecx:sw-2"));
	if (old_takes_writes && has_role(port_a, "master"))
		assert_false(key_on(port_a, "ecx:sw-2"));
	ecx_store_destroy(s);
	/* The old master is turned replica here rather than waiting for the
	 * sentinel to do it (it takes its time): the next test needs it. */
	freeReplyObject(cmd(port_a, true, "REPLICAOF 127.0.0.1 %d", port_b));
}

/* The master is killed: calls keep their bound while the sentinel fails
 * over, and succeed again on the new master. */
static void test_failover_followed(void **state)
{
	(void)state;
	NEED_SENTINEL();
	char why[320];
	const int bound = 2000;
	ecx_store *s = ecx_store_redis_create(url, bound, 0, why, sizeof(why));
	ecx_entry e = entry("tcp://p:1");
	assert_int_equal(s->ops->put(s, "fo-1", &e, why, sizeof(why)), 0);
	int old = sentinel_master(), other = old == port_a ? port_b : port_a;
	pid_t *victim = old == port_a ? &pid_a : &pid_b;
	assert_true(settled(old, other, 20000));
	kill(*victim, SIGKILL);
	waitpid(*victim, NULL, 0);
	*victim = -1;
	uint64_t t0 = now_ms(), longest = 0;
	int fails = 0, rc = -1;
	while (now_ms() - t0 < 20000) {
		uint64_t c0 = now_ms();
		ecx_lookup_item it = {.id = "fo-1"};
		rc = s->ops->put(s, "fo-2", &e, why, sizeof(why));
		if (rc == 0)
			rc = s->ops->mget(s, &it, 1, why, sizeof(why));
		uint64_t took = now_ms() - c0;
		longest = took > longest ? took : longest;
		if (rc == 0)
			break;
		fails++;
	}
	print_message("# master killed: calls work again after %llu ms (%d "
	              "failed, the longest %llu ms, bound %d ms)\n",
	              (unsigned long long)(now_ms() - t0), fails,
	              (unsigned long long)longest, bound);
	assert_int_equal(rc, 0);
	/* Two calls (a put, then an lookup) per try. */
	assert_true(longest <= 2 * (uint64_t)bound + 300);
	assert_int_equal(sentinel_master(), other);
	assert_true(key_on(other, "ecx:fo-2"));
	ecx_store_destroy(s);
}

/* Every sentinel stopped (SIGSTOP: connections are taken, nothing
 * answers): a store that has no master yet fails within its timeout; one
 * connected to the master keeps working. */
static void test_sentinels_down(void **state)
{
	(void)state;
	NEED_SENTINEL();
	char why[320];
	ecx_store *live = ecx_store_redis_create(url, 800, 0, why, sizeof(why));
	assert_int_equal(ecx_store_redis_ping(live, why, sizeof(why)), 0);
	kill(pid_s, SIGSTOP);
	ecx_store *s = ecx_store_redis_create(url, 800, 0, why, sizeof(why));
	ecx_entry e = entry("tcp://p:1");
	uint64_t t0 = now_ms();
	int rc = s->ops->put(s, "sd-1", &e, why, sizeof(why));
	uint64_t took = now_ms() - t0;
	print_message("# every sentinel stopped: %s in %llu ms: %s\n",
	              ecx_err_name(rc), (unsigned long long)took, why);
	assert_true(rc == ECX_ETIMEDOUT || rc == ECX_ECONNECT);
	assert_true(took >= 700 && took <= 800 + 300);
	assert_int_equal(live->ops->put(live, "sd-2", &e, why, sizeof(why)), 0);
	kill(pid_s, SIGCONT);
	ecx_store_destroy(s);
	ecx_store_destroy(live);
	/* Only sentinels where nothing listens: refused, and bounded. */
	char u[128];
	snprintf(u, sizeof(u), "redis+sentinel://127.0.0.1:%d/" MASTER,
	         port_dead);
	s = ecx_store_redis_create(u, 500, 0, why, sizeof(why));
	t0 = now_ms();
	rc = ecx_store_redis_ping(s, why, sizeof(why));
	took = now_ms() - t0;
	assert_int_equal(rc, ECX_ECONNECT);
	assert_true(took <= 500 + 300);
	assert_non_null(strstr(why, "no master within 500 ms"));
	ecx_store_destroy(s);
}

/* The master the sentinel still names has become a replica (that takes
 * writes: replica-read-only no): the store does not write to it, and its
 * call ends within its timeout. */
static void test_replica_never_written(void **state)
{
	(void)state;
	NEED_SENTINEL();
	/* The master the failover left (y) turns replica of the other (x,
	 * started again on its port) behind the sentinel's back. */
	int y = sentinel_master(), x = y == port_a ? port_b : port_a;
	pid_t *px = y == port_a ? &pid_b : &pid_a;
	if (*px < 0)
		*px = start_redis(x, 0);
	for (int i = 0; i < 100 && !has_role(x, "master"); i++)
		usleep(50000);
	freeReplyObject(cmd(y, true, "CONFIG SET replica-read-only no"));
	freeReplyObject(cmd(y, true, "REPLICAOF 127.0.0.1 %d", x));
	for (int i = 0; i < 100 && !has_role(y, "slave"); i++)
		usleep(50000);
	char why[320];
	ecx_store *s = ecx_store_redis_create(url, 600, 0, why, sizeof(why));
	assert_non_null(s);
	ecx_entry e = entry("tcp://p:1");
	uint64_t t0 = now_ms();
	int rc = s->ops->put(s, "rn-1", &e, why, sizeof(why));
	uint64_t took = now_ms() - t0;
	print_message("# put with the named master a replica: %s in %llu ms: "
	              "%s\n",
	              ecx_err_name(rc), (unsigned long long)took, why);
	assert_true(took < 600 + 400);
	assert_int_equal(sentinel_master(), y); /* still named */
	assert_int_not_equal(rc, 0);
	assert_non_null(strstr(why, "not a master"));
	assert_false(key_on(y, "ecx:rn-1"));
	assert_false(key_on(x, "ecx:rn-1"));
	ecx_store_destroy(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_urls),
	    cmocka_unit_test(test_wrong_master),
	    cmocka_unit_test(test_wrong_password),
	    cmocka_unit_test(test_through_sentinel),
	    cmocka_unit_test(test_switch_followed),
	    cmocka_unit_test(test_failover_followed),
	    cmocka_unit_test(test_sentinels_down),
	    cmocka_unit_test(test_replica_never_written),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
