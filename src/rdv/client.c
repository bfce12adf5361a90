/*
 * client.c - the rendezvous client: round trips to producers (the hello,
 * the goodbye), each on a ZeroMQ REQ socket of its own, many at once in
 * one poll, all bounded by one deadline.
 */
#include "rdv/rdv.h"

#include <zmq.h>

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

struct ecx_rdv_client {
	void *zctx;
	unsigned transports;
	char domain[ECX_DOMAIN_MAX];
};

void *ecx_rdv_client_zctx(ecx_rdv_client *c)
{
	return c->zctx;
}

int ecx_rdv_client_create(ecx_rdv_client **out, char *why, size_t whylen)
{
	ecx_rdv_client *c = calloc(1, sizeof(*c));
	if (c == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	c->zctx = zmq_ctx_new();
	if (c->zctx == NULL) {
		free(c);
		return ecx_why(why, whylen, ECX_ENOMEM, "zmq_ctx_new failed");
	}
	zmq_ctx_set(c->zctx, ZMQ_IO_THREADS, 1);
	*out = c;
	return 0;
}

void ecx_rdv_client_offer(ecx_rdv_client *c, unsigned transports,
                          const char *domain)
{
	c->transports = transports;
	ecx_strlcpy(c->domain, domain, sizeof(c->domain));
}

void ecx_rdv_client_destroy(ecx_rdv_client *c)
{
	if (c == NULL)
		return;
	zmq_ctx_term(c->zctx);
	free(c);
}

/* A plain TCP connect to a tcp://HOST:PORT address, started without
 * waiting: the socket, -1 when the address is not one this can check (or
 * no socket), or -2 with *err set when it failed at once (refused). */
static int probe_start(const char *address, int *err)
{
	*err = 0;
	if (strncmp(address, "tcp://", 6) != 0)
		return -1;
	char host[ECX_ADDR_MAX];
	const char *h = address + 6;
	const char *colon = strrchr(h, ':');
	if (colon == NULL || colon == h || colon[1] == '\0' ||
	    (size_t)(colon - h) >= sizeof(host))
		return -1;
	memcpy(host, h, (size_t)(colon - h));
	host[colon - h] = '\0';
	if (host[0] == '[') { /* [v6] */
		size_t hl = strlen(host);
		if (hl < 3 || host[hl - 1] != ']')
			return -1;
		memmove(host, host + 1, hl - 2);
		host[hl - 2] = '\0';
	}
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
	                         .ai_flags = AI_NUMERICSERV};
	struct addrinfo *ai = NULL;
	if (getaddrinfo(host, colon + 1, &hints, &ai) != 0 || ai == NULL)
		return -1; /* ZeroMQ says what is wrong with it */
	int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd >= 0) {
		fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
		if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 &&
		    errno != EINPROGRESS) {
			*err = errno;
			close(fd);
			fd = -2;
		}
	}
	freeaddrinfo(ai);
	return fd;
}

/* How long the probes may hold the hellos up: a producer whose port is
 * closed answers a connect at once (refused), a live one within a round
 * trip; one still silent after this is left to ZeroMQ and the deadline. */
#define PROBE_MS 200

/* Whether anything listens at each call's address: plain TCP connects,
 * all at once, bounded by PROBE_MS. ZeroMQ retries a refused connection
 * until the deadline, so without this a producer that is gone (its port
 * closed) would cost the whole timeout instead of failing at once. A call
 * whose connect is refused (or whose network is unreachable) fails with
 * ECX_ECONNECT; the others go on. Never past deadline_ns. */
static void probe_many(ecx_rdv_call *calls, size_t n, uint64_t deadline_ns)
{
	struct pollfd *pf = calloc(n + 1, sizeof(*pf));
	if (pf == NULL)
		return;
	size_t pending = 0;
	for (size_t i = 0; i < n; i++) {
		int e;
		int fd = probe_start(calls[i].address, &e);
		pf[i] =
		    (struct pollfd){.fd = fd >= 0 ? fd : -1, .events = POLLOUT};
		pending += fd >= 0;
		if (fd == -2 && (e == ECONNREFUSED || e == ENETUNREACH ||
		                 e == EHOSTUNREACH))
			calls[i].err = ecx_why(
			    calls[i].why, sizeof(calls[i].why), ECX_ECONNECT,
			    "producer %s does not answer (%s)",
			    calls[i].address, strerror(e));
	}
	uint64_t until = ecx_now_ns() + (uint64_t)PROBE_MS * 1000000u;
	if (until > deadline_ns)
		until = deadline_ns;
	while (pending > 0) {
		uint64_t now = ecx_now_ns();
		if (now >= until)
			break;
		int k = poll(pf, (nfds_t)n,
		             (int)((until - now + 999999u) / 1000000u));
		if (k <= 0)
			break;
		for (size_t i = 0; i < n; i++) {
			if (pf[i].fd < 0 || pf[i].revents == 0)
				continue;
			int e = 0;
			socklen_t el = sizeof(e);
			if (getsockopt(pf[i].fd, SOL_SOCKET, SO_ERROR, &e,
			               &el) == 0 &&
			    (e == ECONNREFUSED || e == ENETUNREACH ||
			     e == EHOSTUNREACH))
				calls[i].err =
				    ecx_why(calls[i].why, sizeof(calls[i].why),
				            ECX_ECONNECT,
				            "producer %s does not answer (%s)",
				            calls[i].address, strerror(e));
			close(pf[i].fd);
			pf[i].fd = -1;
			pending--;
		}
	}
	for (size_t i = 0; i < n; i++)
		if (pf[i].fd >= 0)
			close(pf[i].fd);
	free(pf);
}

char *ecx_rdv_hello_encode(ecx_rdv_client *c, const void *worker,
                           size_t worker_len, const char *token)
{
	return ecx_zreq_encode_hello(worker, worker_len, token, c->transports,
	                             c->domain);
}

int ecx_rdv_hello(ecx_rdv_client *c, const char *address, const void *worker,
                  size_t worker_len, const char *token, int timeout_ms,
                  ecx_zresp *out, char *why, size_t whylen)
{
	char *msg = ecx_rdv_hello_encode(c, worker, worker_len, token);
	if (msg == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	ecx_rdv_call call = {.address = address, .req = msg};
	ecx_rdv_call_many(c, &call, 1,
	                  ecx_now_ns() + (uint64_t)timeout_ms * 1000000u);
	free(msg);
	if (call.err != 0)
		return ecx_why(why, whylen, call.err, "%s", call.why);
	if (call.resp.worker == NULL) {
		ecx_zresp_free(&call.resp);
		return ecx_why(why, whylen, ECX_EPROTO,
		               "producer %s sent no worker address", address);
	}
	*out = call.resp;
	return 0;
}

/* Opens call k's socket and sends its request without waiting. Returns
 * the socket, or NULL with the call failed. */
static void *call_send(ecx_rdv_client *c, ecx_rdv_call *k)
{
	void *s = zmq_socket(c->zctx, ZMQ_REQ);
	if (s == NULL) {
		k->err = ecx_why(k->why, sizeof(k->why), ECX_ENOMEM,
		                 "zmq_socket failed");
		return NULL;
	}
	int zero = 0;
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	int64_t maxmsg = ECX_ZMQ_MAX_MSG;
	zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	/* Producers may be at IPv6 addresses (tcp://[::1]:PORT). */
	int ipv6 = 1;
	zmq_setsockopt(s, ZMQ_IPV6, &ipv6, sizeof(ipv6));
	if (zmq_connect(s, k->address) != 0) {
		k->err = ecx_why(k->why, sizeof(k->why), ECX_EINVAL,
		                 "bad producer address '%s': %s", k->address,
		                 zmq_strerror(zmq_errno()));
		zmq_close(s);
		return NULL;
	}
	/* The connect made the pipe: the request is queued at once and goes
	 * when the connection is up. */
	if (zmq_send(s, k->req, strlen(k->req), ZMQ_DONTWAIT) < 0) {
		k->err = ecx_why(k->why, sizeof(k->why), ECX_ECONNECT,
		                 "cannot reach producer %s: %s", k->address,
		                 zmq_strerror(zmq_errno()));
		zmq_close(s);
		return NULL;
	}
	return s;
}

/* Reads call k's answer from socket s. */
static void call_recv(ecx_rdv_call *k, void *s)
{
	zmq_msg_t m;
	zmq_msg_init(&m);
	if (zmq_msg_recv(&m, s, ZMQ_DONTWAIT) < 0) {
		k->err = ecx_why(k->why, sizeof(k->why), ECX_ECONNECT,
		                 "producer %s: %s", k->address,
		                 zmq_strerror(zmq_errno()));
		zmq_msg_close(&m);
		return;
	}
	k->err = ecx_zresp_decode(zmq_msg_data(&m), zmq_msg_size(&m), &k->resp,
	                          k->why, sizeof(k->why));
	zmq_msg_close(&m);
	if (k->err == 0 && !k->resp.ok &&
	    strcmp(k->resp.detail, "unknown op") == 0) {
		/* The reference's answer to what it does not speak. */
		k->err = ecx_why(
		    k->why, sizeof(k->why), ECX_EUNSUPPORTED,
		    "producer %s answers 'unknown op': it speaks only the "
		    "reference's protocol (no hello, lease or goodbye); its "
		    "items load with the reference's pull over Mooncake's wire "
		    "when their entries have no ecx_epoch (a lookup gives them "
		    "epoch ECX_EPOCH_REFERENCE)",
		    k->address);
		ecx_zresp_free(&k->resp);
	} else if (k->err == 0 && !k->resp.ok) {
		k->err = ecx_why(k->why, sizeof(k->why), k->resp.err,
		                 "producer %s refused: %s%s", k->address,
		                 k->resp.detail,
		                 k->resp.err == ECX_EAUTH
		                     ? " (the consumer's token must be the "
		                       "one the producer was started with)"
		                     : "");
		ecx_zresp_free(&k->resp);
	}
}

static void call_end(ecx_rdv_call *k)
{
	if (k->done != NULL)
		k->done(k->arg, k);
}

void ecx_rdv_call_many(ecx_rdv_client *c, ecx_rdv_call *calls, size_t n,
                       uint64_t deadline_ns)
{
	void **socks = calloc(n + 1, sizeof(*socks));
	zmq_pollitem_t *pi = calloc(n + 1, sizeof(*pi));
	size_t *which = calloc(n + 1, sizeof(*which));
	for (size_t i = 0; i < n; i++) {
		memset(&calls[i].resp, 0, sizeof(calls[i].resp));
		calls[i].err = 0;
		calls[i].why[0] = '\0';
	}
	probe_many(calls, n, deadline_ns);
	for (size_t i = 0; i < n; i++) {
		if (calls[i].err == 0 &&
		    (socks == NULL || pi == NULL || which == NULL))
			calls[i].err =
			    ecx_why(calls[i].why, sizeof(calls[i].why),
			            ECX_ENOMEM, "out of memory");
		else if (calls[i].err == 0)
			socks[i] = call_send(c, &calls[i]);
		if (socks == NULL || socks[i] == NULL)
			call_end(&calls[i]);
	}
	uint64_t t0 = ecx_now_ns();
	for (;;) {
		size_t k = 0;
		for (size_t i = 0; socks != NULL && i < n; i++) {
			if (socks[i] == NULL)
				continue;
			pi[k] = (zmq_pollitem_t){.socket = socks[i],
			                         .events = ZMQ_POLLIN};
			which[k++] = i;
		}
		uint64_t now = ecx_now_ns();
		if (k == 0 || now >= deadline_ns)
			break;
		long ms = (long)((deadline_ns - now + 999999u) / 1000000u);
		if (zmq_poll(pi, (int)k, ms) < 0 && zmq_errno() != EINTR)
			break;
		for (size_t j = 0; j < k; j++) {
			if (!(pi[j].revents & ZMQ_POLLIN))
				continue;
			size_t i = which[j];
			call_recv(&calls[i], socks[i]);
			zmq_close(socks[i]);
			socks[i] = NULL;
			call_end(&calls[i]);
		}
	}
	for (size_t i = 0; socks != NULL && i < n; i++) {
		if (socks[i] == NULL)
			continue;
		calls[i].err = ecx_why(
		    calls[i].why, sizeof(calls[i].why), ECX_ETIMEDOUT,
		    "producer %s did not answer within %llu ms",
		    calls[i].address,
		    (unsigned long long)((ecx_now_ns() - t0) / 1000000u));
		zmq_close(socks[i]);
		call_end(&calls[i]);
	}
	free(which);
	free(pi);
	free(socks);
}
