/*
 * The public registry client (ecx_client_*, ecx.h) against real servers:
 * an HTTP registry on a free port of 127.0.0.1, and a redis-server on a
 * free port in a temporary folder, both started and stopped here. Only the
 * public header is used.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <ecx/ecx.h>

#include "common/port.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static pid_t redis_pid;
static char redis_url[64];
static char redis_dir[] = "/tmp/ecx-client-redis-XXXXXX";

static ecx_client *client(const char *url, const char *token)
{
	ecx_client_params p = {.field_mask = ECX_CLIENT_PARAM_REGISTRY |
	                                     ECX_CLIENT_PARAM_TOKEN |
	                                     ECX_CLIENT_PARAM_TIMEOUT,
	                       .registry = url,
	                       .token = token,
	                       .timeout_ms = 2000};
	ecx_client *c = NULL;
	char why[200] = "";
	if (ecx_client_create(&p, &c, why, sizeof(why)) != 0)
		fail_msg("client %s: %s", url, why);
	return c;
}

static int redis_start(void **state)
{
	(void)state;
	if (mkdtemp(redis_dir) == NULL)
		return -1;
	char port[16];
	snprintf(port, sizeof(port), "%d", tu_free_port());
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
	int rc = posix_spawn(&redis_pid, argv[0], &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	if (rc != 0)
		return -1;
	snprintf(redis_url, sizeof(redis_url), "redis://127.0.0.1:%s", port);
	/* Ready when it answers a PING (which also tests health on Redis). */
	ecx_client *c = client(redis_url, NULL);
	for (int i = 0; i < 100; i++) {
		uint64_t epoch = 1;
		if (ecx_client_health(c, &epoch) == 0 && epoch == 0) {
			ecx_client_destroy(c);
			return 0;
		}
		usleep(50000);
	}
	ecx_client_destroy(c);
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

static ecx_registry *start(const char *token, char *url, size_t urllen)
{
	ecx_registry_params p = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                       ECX_REGISTRY_PARAM_PORT |
	                                       ECX_REGISTRY_PARAM_TOKEN,
	                         .bind_host = "127.0.0.1",
	                         .port = 0,
	                         .token = token};
	ecx_registry *r = NULL;
	char why[200];
	if (ecx_registry_create(&p, &r, why, sizeof(why)) != 0)
		fail_msg("registry: %s", why);
	snprintf(url, urllen, "http://127.0.0.1:%u", ecx_registry_port(r));
	return r;
}

static ecx_item item(const char *id, uint64_t rows, const char *producer)
{
	ecx_item it;
	memset(&it, 0, sizeof(it));
	it.id = id;
	uint64_t shape[2] = {rows, 16};
	assert_int_equal(ecx_tensor_set(&it.desc, ECX_DTYPE_BFLOAT16, 2, shape),
	                 0);
	snprintf(it.producer, sizeof(it.producer), "%s", producer);
	it.epoch = 77;
	return it;
}

static void test_create_errors(void **state)
{
	(void)state;
	ecx_client *c = NULL;
	char why[200] = "";
	ecx_client_params p = {.field_mask = ECX_CLIENT_PARAM_REGISTRY,
	                       .registry = "ftp://127.0.0.1:1"};
	assert_int_equal(ecx_client_create(&p, &c, why, sizeof(why)),
	                 ECX_EINVAL);
	assert_null(c);
	assert_non_null(strstr(why, "ftp://127.0.0.1:1"));
	assert_non_null(strstr(ecx_last_error(), "ftp://"));
	p.field_mask = 0;
	assert_int_equal(ecx_client_create(&p, &c, why, sizeof(why)),
	                 ECX_EINVAL);
	assert_int_equal(ecx_client_create(NULL, &c, NULL, 0), ECX_EINVAL);
	ecx_client_destroy(NULL);
}

static void test_lookup_publish_remove(void **state)
{
	(void)state;
	char url[64];
	ecx_registry *r = start(NULL, url, sizeof(url));
	ecx_client *c = client(url, NULL);
	uint64_t epoch = 0;
	assert_int_equal(ecx_client_health(c, &epoch), 0);
	assert_true(epoch != 0);

	ecx_item a = item("cl-a", 3, "tcp://10.0.0.1:5555");
	ecx_item b = item("cl-b", 5, "tcp://10.0.0.2:5555");
	assert_int_equal(ecx_client_publish(c, &a), 0);
	assert_int_equal(ecx_client_publish(c, &b), 0);

	ecx_item q[3] = {{.id = "cl-b"}, {.id = "cl-missing"}, {.id = "cl-a"}};
	assert_int_equal(ecx_client_lookup(c, q, 3), 0);
	assert_int_equal(q[0].status, 0);
	assert_int_equal(q[1].status, ECX_ENOTFOUND);
	assert_int_equal(q[2].status, 0);
	assert_int_equal(q[0].desc.nbytes, 5 * 16 * 2);
	assert_int_equal(q[0].desc.dtype, ECX_DTYPE_BFLOAT16);
	assert_string_equal(q[0].producer, "tcp://10.0.0.2:5555");
	assert_int_equal(q[2].epoch, 77);
	assert_int_equal(q[2].desc.shape[0], 3);
	/* One id alone takes the GET route. */
	ecx_item one = {.id = "cl-a"};
	assert_int_equal(ecx_client_lookup(c, &one, 1), 0);
	assert_int_equal(one.status, 0);
	assert_string_equal(one.producer, "tcp://10.0.0.1:5555");

	/* A bad id or a bad descriptor is refused before any request. */
	ecx_item bad = item("no/slash", 1, "tcp://h:1");
	assert_int_equal(ecx_client_publish(c, &bad), ECX_EID);
	assert_non_null(strstr(ecx_last_error(), "no/slash"));
	bad = item("cl-c", 1, "tcp://h:1");
	bad.desc.nbytes++;
	assert_int_equal(ecx_client_publish(c, &bad), ECX_ESIZE);
	bad = item("cl-c", 1, "");
	assert_int_equal(ecx_client_publish(c, &bad), ECX_EINVAL);
	ecx_item badq = {.id = "a b"};
	assert_int_equal(ecx_client_lookup(c, &badq, 1), ECX_EID);

	/* Removal conditional on the producer. */
	assert_int_equal(ecx_client_remove(c, "cl-a", "tcp://other:1"),
	                 ECX_ENOTFOUND);
	assert_int_equal(ecx_client_remove(c, "cl-a", "tcp://10.0.0.1:5555"),
	                 0);
	assert_int_equal(ecx_client_remove(c, "cl-a", NULL), ECX_ENOTFOUND);
	assert_int_equal(ecx_client_remove(c, "cl-b", NULL), 0);
	one = (ecx_item){.id = "cl-a"};
	assert_int_equal(ecx_client_lookup(c, &one, 1), 0);
	assert_int_equal(one.status, ECX_ENOTFOUND);

	/* All of it over one persistent connection. */
	assert_int_equal(ecx_client_connections(c), 1);
	ecx_client_destroy(c);
	ecx_registry_destroy(r);
}

static void test_token(void **state)
{
	(void)state;
	char url[64];
	ecx_registry *r = start("s3cret", url, sizeof(url));
	ecx_client *anon = client(url, NULL);
	ecx_client *auth = client(url, "s3cret");
	ecx_item a = item("tok-a", 1, "tcp://h:1");
	assert_int_equal(ecx_client_publish(anon, &a), ECX_EAUTH);
	assert_non_null(strstr(ecx_last_error(), "401"));
	assert_int_equal(ecx_client_publish(auth, &a), 0);
	ecx_item q = {.id = "tok-a"};
	assert_int_equal(ecx_client_lookup(anon, &q, 1), 0);
	assert_int_equal(q.status, 0);
	ecx_client_destroy(anon);
	ecx_client_destroy(auth);
	ecx_registry_destroy(r);
}

static void test_down(void **state)
{
	(void)state;
	char url[64];
	snprintf(url, sizeof(url), "http://127.0.0.1:%d", tu_free_port());
	ecx_client *c = client(url, NULL);
	uint64_t epoch = 5;
	assert_int_equal(ecx_client_health(c, &epoch), ECX_ECONNECT);
	assert_int_equal(epoch, 5); /* outputs are written only on success */
	assert_non_null(strstr(ecx_last_error(), url));
	char next[ECX_ID_MAX + 1];
	int calls = 0;
	assert_int_equal(ecx_client_list(c, NULL, 10, NULL, &calls, next,
	                                 sizeof(next), NULL),
	                 ECX_EINVAL);
	ecx_client_destroy(c);
}

/* An HTTP server that is no registry: every request is answered 404 with
 * a body that is not the registries' miss, and the connection closed. */
typedef struct not_registry {
	int fd;
	unsigned port;
	volatile int stop;
	pthread_t thr;
} not_registry;

static void *not_registry_run(void *arg)
{
	not_registry *nr = arg;
	while (!nr->stop) {
		struct pollfd pf = {.fd = nr->fd, .events = POLLIN};
		if (poll(&pf, 1, 50) != 1)
			continue;
		int c = accept(nr->fd, NULL, NULL);
		if (c < 0)
			continue;
		/* The request's head (its body, if any, is left unread). */
		char buf[4096];
		size_t got = 0;
		while (got < sizeof(buf) - 1) {
			struct pollfd cf = {.fd = c, .events = POLLIN};
			if (poll(&cf, 1, 2000) != 1)
				break;
			ssize_t k = read(c, buf + got, sizeof(buf) - 1 - got);
			if (k <= 0)
				break;
			got += (size_t)k;
			buf[got] = '\0';
			if (strstr(buf, "\r\n\r\n") != NULL)
				break;
		}
		static const char ans[] = "HTTP/1.1 404 Not Found\r\n"
		                          "Content-Type: text/plain\r\n"
		                          "Content-Length: 9\r\n"
		                          "Connection: close\r\n\r\n"
		                          "not here\n";
		ssize_t w = write(c, ans, sizeof(ans) - 1);
		(void)w;
		close(c);
	}
	return NULL;
}

static void not_registry_start(not_registry *nr)
{
	memset(nr, 0, sizeof(*nr));
	nr->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	assert_true(nr->fd >= 0);
	struct sockaddr_in a = {.sin_family = AF_INET,
	                        .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t al = sizeof(a);
	assert_int_equal(bind(nr->fd, (struct sockaddr *)&a, sizeof(a)), 0);
	assert_int_equal(listen(nr->fd, 16), 0);
	assert_int_equal(getsockname(nr->fd, (struct sockaddr *)&a, &al), 0);
	nr->port = ntohs(a.sin_port);
	assert_int_equal(pthread_create(&nr->thr, NULL, not_registry_run, nr),
	                 0);
}

static void not_registry_stop(not_registry *nr)
{
	nr->stop = 1;
	pthread_join(nr->thr, NULL);
	close(nr->fd);
}

/* The lookups of a client and of a consumer, side by side. */
typedef struct looker {
	const char *what;
	int (*lookup)(void *h, ecx_item *it, size_t n);
	int (*lease)(void *h, ecx_item *it, size_t n, int ms);
	int (*release)(void *h, ecx_item *it, size_t n);
	void *h;
} looker;

static int cl_lookup(void *h, ecx_item *it, size_t n)
{
	return ecx_client_lookup(h, it, n);
}
static int cl_lease(void *h, ecx_item *it, size_t n, int ms)
{
	return ecx_client_lookup_lease(h, it, n, ms);
}
static int cl_release(void *h, ecx_item *it, size_t n)
{
	return ecx_client_release(h, it, n);
}
static int co_lookup(void *h, ecx_item *it, size_t n)
{
	return ecx_consumer_lookup(h, it, n);
}
static int co_lease(void *h, ecx_item *it, size_t n, int ms)
{
	return ecx_consumer_lookup_lease(h, it, n, ms);
}
static int co_release(void *h, ecx_item *it, size_t n)
{
	return ecx_consumer_release(h, it, n);
}

/* Items whose outputs hold what an earlier call left: a call must write
 * every status (and, leased, every lease) it reports on. */
static void stale(ecx_item *it, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		it[i].status = 12345;
		it[i].lease = 99;
	}
}

/* The consumer's lookups and the client's go through one path, so they
 * agree on every case: no handle, or no items for n > 0, is ECX_EINVAL
 * before any request; an id that breaks the rules, or a NULL one, fails
 * the call with ECX_EID before any request, that item's status ECX_EID
 * and every other's ECX_ENOTFOUND (a status an earlier call left never
 * reads as a hit), and nothing leased; and a lookup that one registry of
 * the list failed (ECX_EINVAL: a server that is no registry) still
 * leases what the others found (a hit has a lease, or is a miss). */
static void test_lookup_arguments_agree(void **state)
{
	(void)state;
	char rurl[64], urls[160], why[256] = "";
	ecx_registry *r = start(NULL, rurl, sizeof(rurl));
	not_registry nr;
	not_registry_start(&nr);
	snprintf(urls, sizeof(urls), "%s,http://127.0.0.1:%u", rurl, nr.port);
	ecx_producer_params pp = {.field_mask = ECX_PRODUCER_PARAM_CAPACITY |
	                                        ECX_PRODUCER_PARAM_BIND_HOST |
	                                        ECX_PRODUCER_PARAM_REGISTRY |
	                                        ECX_PRODUCER_PARAM_TRANSPORT,
	                          .capacity_bytes = 1u << 20,
	                          .bind_host = "127.0.0.1",
	                          .registry = rurl,
	                          .transport = "tcp"};
	ecx_producer *prod = NULL;
	if (ecx_producer_create(&pp, &prod, why, sizeof(why)) != 0)
		fail_msg("producer: %s", why);
	uint64_t shape[1] = {64};
	ecx_tensor_desc d;
	assert_int_equal(ecx_tensor_set(&d, ECX_DTYPE_UINT8, 1, shape), 0);
	char bytes[64] = {1};
	assert_int_equal(ecx_producer_put(prod, "agree-a", &d, bytes), 0);

	ecx_client *cl = client(urls, NULL);
	ecx_consumer_params cp = {.field_mask =
	                              ECX_CONSUMER_PARAM_REGISTRY |
	                              ECX_CONSUMER_PARAM_RECV_CAPACITY |
	                              ECX_CONSUMER_PARAM_TRANSPORT,
	                          .registry = urls,
	                          .recv_capacity = 0,
	                          .transport = "tcp"};
	ecx_consumer *co = NULL;
	if (ecx_consumer_create(&cp, &co, why, sizeof(why)) != 0)
		fail_msg("consumer: %s", why);
	looker lk[2] = {{"client", cl_lookup, cl_lease, cl_release, cl},
	                {"consumer", co_lookup, co_lease, co_release, co}};
	for (int k = 0; k < 2; k++) {
		looker *l = &lk[k];
		print_message("%s\n", l->what);
		/* No handle, no items. */
		ecx_item it[2] = {{.id = "agree-a"}, {.id = "agree-missing"}};
		assert_int_equal(l->lookup(NULL, it, 1), ECX_EINVAL);
		assert_int_equal(l->lookup(l->h, NULL, 1), ECX_EINVAL);
		assert_int_equal(l->lease(NULL, it, 1, 0), ECX_EINVAL);
		assert_int_equal(l->lease(l->h, NULL, 1, 0), ECX_EINVAL);
		assert_int_equal(l->lease(l->h, it, 1, -1), ECX_EINVAL);
		assert_int_equal(l->release(NULL, it, 1), ECX_EINVAL);
		assert_int_equal(l->release(l->h, NULL, 1), ECX_EINVAL);
		assert_int_equal(l->lookup(l->h, NULL, 0), 0);
		assert_int_equal(l->lease(l->h, NULL, 0, 0), 0);

		/* An id that breaks the rules. */
		ecx_item bad[2] = {{.id = "agree-a"}, {.id = "a b"}};
		stale(bad, 2);
		assert_int_equal(l->lookup(l->h, bad, 2), ECX_EID);
		assert_int_equal(bad[0].status, ECX_ENOTFOUND);
		assert_int_equal(bad[1].status, ECX_EID);
		stale(bad, 2);
		assert_int_equal(l->lease(l->h, bad, 2, 0), ECX_EID);
		assert_int_equal(bad[0].status, ECX_ENOTFOUND);
		assert_int_equal(bad[1].status, ECX_EID);
		assert_int_equal(bad[0].lease, 0);
		assert_int_equal(bad[1].lease, 0);

		/* A NULL id. */
		ecx_item none[2] = {{.id = NULL}, {.id = "agree-a"}};
		stale(none, 2);
		assert_int_equal(l->lookup(l->h, none, 2), ECX_EID);
		assert_non_null(strstr(ecx_last_error(), "id is missing"));
		assert_int_equal(none[0].status, ECX_EID);
		assert_int_equal(none[1].status, ECX_ENOTFOUND);
		stale(none, 2);
		assert_int_equal(l->lease(l->h, none, 2, 0), ECX_EID);
		assert_non_null(strstr(ecx_last_error(), "id is missing"));
		assert_int_equal(none[0].status, ECX_EID);
		assert_int_equal(none[0].lease, 0);
		assert_int_equal(none[1].lease, 0);

		/* The second registry is no registry: ECX_EINVAL, with what
		 * the first found filled in, and leased. */
		stale(it, 2);
		assert_int_equal(l->lookup(l->h, it, 2), ECX_EINVAL);
		assert_non_null(strstr(ecx_last_error(), "404"));
		assert_int_equal(it[0].status, 0);
		assert_int_equal(it[0].desc.nbytes, 64);
		assert_int_equal(it[1].status, ECX_ENOTFOUND);
		stale(it, 2);
		assert_int_equal(l->lease(l->h, it, 2, 30000), ECX_EINVAL);
		assert_int_equal(it[0].status, 0);
		assert_int_not_equal(it[0].lease, 0);
		assert_int_not_equal(it[0].lease, 99);
		assert_int_equal(it[1].status, ECX_ENOTFOUND);
		assert_int_equal(it[1].lease, 0);
		assert_int_equal(l->release(l->h, it, 1), 0);
		assert_int_equal(it[0].lease, 0);
	}
	ecx_producer_stats ps;
	ecx_producer_stats_get(prod, &ps);
	assert_int_equal(ps.leases_granted, 2);
	assert_int_equal(ps.leases_released, 2);
	ecx_consumer_destroy(co);
	ecx_client_destroy(cl);
	ecx_producer_destroy(prod);
	not_registry_stop(&nr);
	ecx_registry_destroy(r);
}

/* A registry that was down and comes back is asked again within about a
 * second, whatever back-off it had reached: with every registry of a list
 * backing off, the soonest due is probed once a second. (Before, lookups
 * failed at once until the back-off, up to 10 s, ran out.) */
static void test_back_after_outage(void **state)
{
	(void)state;
	int port = tu_free_port();
	char url[64];
	snprintf(url, sizeof(url), "http://127.0.0.1:%d", port);
	ecx_client *c = client(url, NULL);
	/* 3.6 s of failed lookups: the back-off reaches 4 s. */
	uint64_t t0 = now_ms();
	while (now_ms() - t0 < 3600) {
		ecx_item q = {.id = "out-a"};
		assert_int_not_equal(ecx_client_lookup(c, &q, 1), 0);
		usleep(20000);
	}
	ecx_registry_params p = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                       ECX_REGISTRY_PARAM_PORT,
	                         .bind_host = "127.0.0.1",
	                         .port = (uint16_t)port};
	ecx_registry *r = NULL;
	char why[200];
	if (ecx_registry_create(&p, &r, why, sizeof(why)) != 0)
		fail_msg("registry on port %d: %s", port, why);
	ecx_client *w = client(url, NULL);
	ecx_item a = item("out-a", 3, "tcp://10.0.0.1:5555");
	assert_int_equal(ecx_client_publish(w, &a), 0);
	uint64_t t1 = now_ms(), back = 0;
	bool found = false; /* back may be 0 ms: the back-off can be over */
	while (!found && now_ms() - t1 < 6000) {
		ecx_item q = {.id = "out-a"};
		found = ecx_client_lookup(c, &q, 1) == 0 && q.status == 0;
		back = now_ms() - t1;
		if (!found)
			usleep(20000);
	}
	print_message("back after the outage: %llu ms%s\n",
	              (unsigned long long)back, found ? "" : " (never)");
	assert_true(found);
	const char *sc = getenv("ECX_TEST_TIME_SCALE");
	assert_true(back <= 1500u * (uint64_t)(sc != NULL ? atoi(sc) : 1));
	ecx_client_destroy(w);
	ecx_client_destroy(c);
	ecx_registry_destroy(r);
}

typedef struct seen {
	char ids[64][ECX_ID_MAX + 1];
	uint64_t bytes[64];
	size_t n;
	int stop_at; /* return 42 at this call (1-based); 0: never */
} seen;

static int collect(void *arg, const ecx_item *it)
{
	seen *s = arg;
	if (s->n == 64)
		return -1;
	snprintf(s->ids[s->n], sizeof(s->ids[0]), "%s", it->id);
	s->bytes[s->n] = it->desc.nbytes;
	s->n++;
	assert_int_equal(it->epoch, 77);
	assert_string_equal(it->producer, "tcp://10.1.1.1:7000");
	return s->stop_at != 0 && (int)s->n == s->stop_at ? 42 : 0;
}

/* Lists everything in pages of `page`, checking order, count and the
 * continuation; returns the number of pages. */
static int list_all(ecx_client *c, size_t page, seen *s, size_t expect)
{
	char after[ECX_ID_MAX + 1] = "", next[ECX_ID_MAX + 1];
	int pages = 0;
	memset(s, 0, sizeof(*s));
	for (;;) {
		uint64_t total = 0;
		size_t before = s->n;
		assert_int_equal(ecx_client_list(c, after, page, collect, s,
		                                 next, sizeof(next), &total),
		                 0);
		pages++;
		assert_int_equal(total, expect);
		assert_true(s->n - before <= page);
		if (next[0] == '\0')
			break;
		/* A page that says more follows is full and ends at next. */
		assert_int_equal(s->n - before, page);
		assert_string_equal(next, s->ids[s->n - 1]);
		snprintf(after, sizeof(after), "%s", next);
		assert_true(pages < 100);
	}
	assert_int_equal(s->n, expect);
	for (size_t i = 1; i < s->n; i++)
		assert_true(strcmp(s->ids[i - 1], s->ids[i]) < 0);
	return pages;
}

static void check_listing(const char *url)
{
	ecx_client *c = client(url, NULL);
	enum { N = 20 };
	/* Published out of order; ids with '+', ':' and '@', which a query
	 * string must carry escaped. */
	for (int k = 0; k < N; k++) {
		int i = (k * 7) % N;
		char id[64];
		snprintf(id, sizeof(id), "ls+%02d:x@y", i);
		ecx_item it = item(id, (uint64_t)i + 1, "tcp://10.1.1.1:7000");
		assert_int_equal(ecx_client_publish(c, &it), 0);
	}
	seen *s = malloc(sizeof(*s));
	assert_non_null(s);
	/* 7 + 7 + 6 */
	assert_int_equal(list_all(c, 7, s, N), 3);
	for (int i = 0; i < N; i++) {
		char id[64];
		snprintf(id, sizeof(id), "ls+%02d:x@y", i);
		assert_string_equal(s->ids[i], id);
		assert_int_equal(s->bytes[i], ((uint64_t)i + 1) * 16 * 2);
	}
	/* Pages that end exactly at the end say the listing is complete. */
	assert_int_equal(list_all(c, 5, s, N), 4);
	assert_int_equal(list_all(c, 1000, s, N), 1);
	assert_int_equal(list_all(c, 1, s, N), N);

	/* After the last id: nothing, complete. */
	char next[ECX_ID_MAX + 1] = "x";
	uint64_t total = 0;
	memset(s, 0, sizeof(*s));
	assert_int_equal(ecx_client_list(c, "ls+99", 10, collect, s, next,
	                                 sizeof(next), &total),
	                 0);
	assert_int_equal(s->n, 0);
	assert_string_equal(next, "");
	assert_int_equal(total, N);

	/* The callback stops the listing and its value comes back. */
	memset(s, 0, sizeof(*s));
	s->stop_at = 3;
	strcpy(next, "unchanged");
	assert_int_equal(
	    ecx_client_list(c, NULL, 10, collect, s, next, sizeof(next), NULL),
	    42);
	assert_int_equal(s->n, 3);
	assert_string_equal(next, "unchanged");

	/* Bad pages. */
	memset(s, 0, sizeof(*s));
	assert_int_equal(
	    ecx_client_list(c, NULL, 0, collect, s, next, sizeof(next), NULL),
	    ECX_EINVAL);
	assert_int_equal(ecx_client_list(c, NULL, 1001, collect, s, next,
	                                 sizeof(next), NULL),
	                 ECX_EINVAL);
	assert_int_equal(
	    ecx_client_list(c, "a/b", 10, collect, s, next, sizeof(next), NULL),
	    ECX_EID);
	assert_int_equal(s->n, 0);

	for (int i = 0; i < N; i++) {
		char id[64];
		snprintf(id, sizeof(id), "ls+%02d:x@y", i);
		assert_int_equal(ecx_client_remove(c, id, NULL), 0);
	}
	assert_int_equal(list_all(c, 10, s, 0), 1);
	free(s);
	ecx_client_destroy(c);
}

static void test_list_http(void **state)
{
	(void)state;
	char url[64];
	ecx_registry *r = start(NULL, url, sizeof(url));
	check_listing(url);
	ecx_registry_destroy(r);
}

static void test_list_redis(void **state)
{
	(void)state;
	check_listing(redis_url);
}

static void test_lookup_redis(void **state)
{
	(void)state;
	ecx_client *c = client(redis_url, NULL);
	ecx_item a = item("rd-a", 4, "tcp://10.0.0.9:1");
	assert_int_equal(ecx_client_publish(c, &a), 0);
	ecx_item q[2] = {{.id = "rd-a"}, {.id = "rd-none"}};
	assert_int_equal(ecx_client_lookup(c, q, 2), 0);
	assert_int_equal(q[0].status, 0);
	assert_int_equal(q[1].status, ECX_ENOTFOUND);
	assert_string_equal(q[0].producer, "tcp://10.0.0.9:1");
	assert_int_equal(ecx_client_remove(c, "rd-a", "tcp://other:1"),
	                 ECX_ENOTFOUND);
	assert_int_equal(ecx_client_remove(c, "rd-a", "tcp://10.0.0.9:1"), 0);
	ecx_client_destroy(c);
}

static void test_json(void **state)
{
	(void)state;
	ecx_item a = item("js-a", 2, "tcp://10.0.0.3:9");
	char *s = ecx_item_to_json(&a);
	assert_non_null(s);
	assert_non_null(strstr(s, "\"producer_zmq\":\"tcp://10.0.0.3:9\""));
	assert_non_null(strstr(s, "\"dtype\":\"bfloat16\""));
	ecx_item b;
	memset(&b, 0, sizeof(b));
	b.id = "kept";
	char why[200] = "";
	assert_int_equal(ecx_item_from_json(s, strlen(s), &b, why, sizeof(why)),
	                 0);
	assert_string_equal(b.id, "kept");
	assert_memory_equal(&b.desc, &a.desc, sizeof(a.desc));
	assert_string_equal(b.producer, a.producer);
	assert_int_equal(b.epoch, 77);
	ecx_free(s);

	const char *junk = "{\"nbytes\": 3}";
	assert_int_equal(
	    ecx_item_from_json(junk, strlen(junk), &b, why, sizeof(why)),
	    ECX_EPROTO);
	assert_true(why[0] != '\0');
	/* Not NUL-terminated: only len bytes are read. */
	char cut[8] = {'{', '}', 'x', 'x', 'x', 'x', 'x', 'x'};
	assert_int_equal(ecx_item_from_json(cut, 2, &b, NULL, 0), ECX_EPROTO);

	ecx_item bad = a;
	bad.desc.nbytes = 1;
	assert_null(ecx_item_to_json(&bad));
	assert_true(ecx_last_error()[0] != '\0');
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_create_errors),
	    cmocka_unit_test(test_lookup_publish_remove),
	    cmocka_unit_test(test_token),
	    cmocka_unit_test(test_down),
	    cmocka_unit_test(test_lookup_arguments_agree),
	    cmocka_unit_test(test_back_after_outage),
	    cmocka_unit_test(test_list_http),
	    cmocka_unit_test(test_json),
	    cmocka_unit_test(test_lookup_redis),
	    cmocka_unit_test(test_list_redis),
	};
	return cmocka_run_group_tests(tests, redis_start, redis_stop);
}
