/*
 * client.c - the rendezvous client: ecx's hello as one ZeroMQ REQ round
 * trip on a socket of its own, every step bounded by the caller's timeout.
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

/* Whether anything listens at a tcp://HOST:PORT address: a plain TCP
 * connect, bounded by timeout_ms. ZeroMQ retries a refused connection
 * until the timeout, so without this a producer that is gone (its port
 * closed) would cost the whole timeout instead of failing at once.
 * Returns 0 when it connects or the address is not one this can check,
 * ECX_ECONNECT when refused, ECX_ETIMEDOUT when nothing answers. */
static int rdv_probe(const char *address, int timeout_ms, char *why,
                     size_t whylen)
{
	if (strncmp(address, "tcp://", 6) != 0)
		return 0;
	char host[ECX_ADDR_MAX];
	const char *h = address + 6;
	const char *colon = strrchr(h, ':');
	if (colon == NULL || colon == h || colon[1] == '\0' ||
	    (size_t)(colon - h) >= sizeof(host))
		return 0;
	memcpy(host, h, (size_t)(colon - h));
	host[colon - h] = '\0';
	if (host[0] == '[') { /* [v6] */
		size_t hl = strlen(host);
		if (hl < 3 || host[hl - 1] != ']')
			return 0;
		memmove(host, host + 1, hl - 2);
		host[hl - 2] = '\0';
	}
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
	                         .ai_flags = AI_NUMERICSERV};
	struct addrinfo *ai = NULL;
	if (getaddrinfo(host, colon + 1, &hints, &ai) != 0 || ai == NULL)
		return 0; /* ZeroMQ says what is wrong with it */
	int rc = 0;
	int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		goto out;
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
	int e = 0;
	if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
		e = errno;
		if (e == EINPROGRESS) {
			struct pollfd pf = {.fd = fd, .events = POLLOUT};
			int k = poll(&pf, 1, timeout_ms);
			socklen_t el = sizeof(e);
			if (k == 0)
				e = ETIMEDOUT;
			else if (k < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR,
			                             &e, &el) != 0)
				e = 0; /* cannot tell: leave it to ZeroMQ */
		}
	}
	if (e == ECONNREFUSED || e == ENETUNREACH || e == EHOSTUNREACH)
		rc = ecx_why(why, whylen, ECX_ECONNECT,
		             "producer %s does not answer (%s)", address,
		             strerror(e));
	else if (e == ETIMEDOUT)
		rc = ecx_why(why, whylen, ECX_ETIMEDOUT,
		             "producer %s does not answer (no connection "
		             "within %d ms)",
		             address, timeout_ms);
	close(fd);
out:
	freeaddrinfo(ai);
	return rc;
}

int ecx_rdv_hello(ecx_rdv_client *c, const char *address, const void *worker,
                  size_t worker_len, const char *token, int timeout_ms,
                  ecx_zresp *out, char *why, size_t whylen)
{
	int prc = rdv_probe(address, timeout_ms, why, whylen);
	if (prc != 0)
		return prc;
	void *s = zmq_socket(c->zctx, ZMQ_REQ);
	if (s == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "zmq_socket failed");
	int t = timeout_ms, zero = 0;
	zmq_setsockopt(s, ZMQ_SNDTIMEO, &t, sizeof(t));
	zmq_setsockopt(s, ZMQ_RCVTIMEO, &t, sizeof(t));
	zmq_setsockopt(s, ZMQ_CONNECT_TIMEOUT, &t, sizeof(t));
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	int64_t maxmsg = ECX_ZMQ_MAX_MSG;
	zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	/* Producers may be at IPv6 addresses (tcp://[::1]:PORT). */
	int ipv6 = 1;
	zmq_setsockopt(s, ZMQ_IPV6, &ipv6, sizeof(ipv6));
	char *msg = ecx_zreq_encode_hello(worker, worker_len, token,
	                                  c->transports, c->domain);
	int rc = 0;
	if (msg == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
		goto out;
	}
	if (zmq_connect(s, address) != 0) {
		rc = ecx_why(why, whylen, ECX_EINVAL,
		             "bad producer address '%s': %s", address,
		             zmq_strerror(zmq_errno()));
		goto out;
	}
	if (zmq_send(s, msg, strlen(msg), 0) < 0) {
		rc = ecx_why(why, whylen, ECX_ECONNECT,
		             "cannot reach producer %s: %s", address,
		             zmq_strerror(zmq_errno()));
		goto out;
	}
	zmq_msg_t m;
	zmq_msg_init(&m);
	if (zmq_msg_recv(&m, s, 0) < 0) {
		int e = zmq_errno();
		zmq_msg_close(&m);
		rc = ecx_why(why, whylen,
		             e == EAGAIN ? ECX_ETIMEDOUT : ECX_ECONNECT,
		             "producer %s did not answer within %d ms", address,
		             timeout_ms);
		goto out;
	}
	rc = ecx_zresp_decode(zmq_msg_data(&m), zmq_msg_size(&m), out, why,
	                      whylen);
	zmq_msg_close(&m);
	if (rc == 0 && !out->ok) {
		rc = ecx_why(why, whylen, out->err, "producer %s refused: %s",
		             address, out->detail);
		ecx_zresp_free(out);
	} else if (rc == 0 && out->worker == NULL) {
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "producer %s sent no worker address", address);
	}
out:
	free(msg);
	zmq_close(s);
	return rc;
}
