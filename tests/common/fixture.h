/* fixture.h - what the cmocka tests that run a producer share: the clock,
 * a producer in a process of its own (tests/peer.c: start, put, its stats
 * lines, stop) and its registry's Prometheus metrics. A failure is the
 * test's (cmocka's fail_msg and asserts); include after <cmocka.h>. */
#ifndef ECX_TEST_FIXTURE_H
#define ECX_TEST_FIXTURE_H

#include "common/testutil.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

/* Monotonic milliseconds. */
static inline uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A producer peer: the process, the port of its registry, its ZeroMQ
 * address and its registry's URL (http://127.0.0.1:port). */
typedef struct producer {
	tu_child ch;
	unsigned port;
	char zmq[256];
	char url[64];
} producer;

/* The peer helper's path (ecx-test-peer beside the tests). */
static inline void peer_path(char *out, size_t n)
{
	snprintf(out, n, "%s/ecx-test-peer", tu_bindir());
}

/* Starts `ecx-test-peer producer [--transport T] ARGS...` (transport NULL:
 * the peer's default; args NULL-terminated) and reads its ready line; on
 * failure the line (or why there is none) in why and false, the process
 * gone. */
static inline bool producer_startv(producer *p, const char *transport,
                                   char *const *args, char *why, size_t n)
{
	char path[512];
	peer_path(path, sizeof(path));
	char *argv[32] = {path, "producer"};
	int k = 2;
	if (transport != NULL) {
		argv[k++] = "--transport";
		argv[k++] = (char *)transport;
	}
	for (; args != NULL && *args != NULL && k < 30; args++)
		argv[k++] = *args;
	argv[k] = NULL;
	if (!tu_spawn(&p->ch, argv)) {
		snprintf(why, n, "cannot start ecx-test-peer in %s",
		         tu_bindir());
		return false;
	}
	char line[512];
	if (!tu_line(&p->ch, line, sizeof(line))) {
		snprintf(why, n, "no ready line");
		tu_reap(&p->ch, 5000);
		return false;
	}
	if (sscanf(line, "ready %u %255s", &p->port, p->zmq) != 2) {
		snprintf(why, n, "%s", line);
		tu_reap(&p->ch, 5000);
		return false;
	}
	snprintf(p->url, sizeof(p->url), "http://127.0.0.1:%u", p->port);
	return true;
}

/* Starts a producer peer with extra arguments (a NULL-terminated array);
 * false (instead of failing the test) when it could not start, e.g. its
 * fixed port was taken. */
static inline bool producer_try(producer *p, const char *transport,
                                char **extra)
{
	char why[512];
	return producer_startv(p, transport, extra, why, sizeof(why));
}

/* Starts a producer peer with extra arguments (NULL-terminated), or fails
 * the test. */
static inline void producer_start(producer *p, const char *transport, ...)
{
	char *args[32];
	int n = 0;
	va_list ap;
	va_start(ap, transport);
	const char *a;
	while ((a = va_arg(ap, const char *)) != NULL && n < 30)
		args[n++] = (char *)a;
	va_end(ap);
	args[n] = NULL;
	char why[512];
	if (!producer_startv(p, transport, args, why, sizeof(why)))
		fail_msg("producer did not start: %s", why);
}

/* Puts an item of the peer's bytes for id; the answer must start with
 * want ("ok", "err ENOSPC", ...). */
static inline void producer_put(producer *p, const char *id, const char *dtype,
                                const char *shape, const char *want)
{
	char ans[512];
	assert_true(
	    tu_ask(&p->ch, ans, sizeof(ans), "put %s %s %s", id, dtype, shape));
	if (strncmp(ans, want, strlen(want)) != 0)
		fail_msg("put %s: %s (wanted %s)", id, ans, want);
}

/* A "name value" field of the line the peer answers cmd with ("stats",
 * "leases"); -1 when the line has no such field. */
static inline long long producer_field(producer *p, const char *cmd,
                                       const char *name)
{
	char ans[1024];
	assert_true(tu_ask(&p->ch, ans, sizeof(ans), "%s", cmd));
	return tu_field(ans, name);
}

/* A field of the producer's "stats" line: served, failed, items, used,
 * evictions, pinned, conns, regs, ... (tests/peer.c). */
static inline long long producer_stat(producer *p, const char *name)
{
	return producer_field(p, "stats", name);
}

/* Asks the peer to quit (it must answer) and waits (5 s at most, then
 * kills it); returns its wait status. */
static inline int producer_quit(producer *p)
{
	char ans[64];
	assert_true(tu_ask(&p->ch, ans, sizeof(ans), "quit"));
	return tu_reap(&p->ch, 5000);
}

/* producer_quit, and the peer must have exited with 0. */
static inline void producer_stop(producer *p)
{
	int st = producer_quit(p);
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* GET path from the registry at 127.0.0.1:port into buf (headers and
 * body); false when it cannot. */
static inline bool http_get(unsigned port, const char *path, char *buf,
                            size_t n)
{
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0)
		return false;
	struct sockaddr_in a = {.sin_family = AF_INET,
	                        .sin_port = htons((uint16_t)port),
	                        .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	struct timeval tv = {.tv_sec = 5};
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	char req[256];
	int len = snprintf(req, sizeof(req),
	                   "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
	                   "Connection: close\r\n\r\n",
	                   path);
	size_t got = 0;
	if (connect(s, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    write(s, req, (size_t)len) == len) {
		ssize_t r;
		while (got + 1 < n && (r = read(s, buf + got, n - 1 - got)) > 0)
			got += (size_t)r;
	}
	close(s);
	buf[got] = '\0';
	return got > 0;
}

/* The value of a Prometheus line "name V" in text, or -1. */
static inline long long metric(const char *text, const char *name)
{
	char key[128];
	snprintf(key, sizeof(key), "\n%s ", name);
	const char *p = strstr(text, key);
	return p != NULL ? atoll(p + strlen(key)) : -1;
}

/* The producer's metrics (GET /metrics on its registry) into buf, or fails
 * the test. */
static inline void producer_metrics(producer *p, char *buf, size_t n)
{
	if (!http_get(p->port, "/metrics", buf, n))
		fail_msg("GET http://127.0.0.1:%u/metrics: no answer", p->port);
}

#endif
