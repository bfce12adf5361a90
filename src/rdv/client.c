/*
 * client.c - the rendezvous client: round trips to producers (the hello,
 * the goodbye), each on a ZeroMQ REQ socket of its own, many at once in
 * one poll, all bounded by one deadline.
 */
#include "rdv/rdv.h"

#include <zmq.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

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
	if (k->err == 0 && !k->resp.ok) {
		k->err = ecx_why(k->why, sizeof(k->why), k->resp.err,
		                 "producer %s refused: %s", k->address,
		                 k->resp.detail);
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
		if (socks == NULL || pi == NULL || which == NULL)
			calls[i].err =
			    ecx_why(calls[i].why, sizeof(calls[i].why),
			            ECX_ENOMEM, "out of memory");
		else
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
