/*
 * client.c - the rendezvous client: ecx's hello as one ZeroMQ REQ round
 * trip on a socket of its own, every step bounded by the caller's timeout.
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

int ecx_rdv_hello(ecx_rdv_client *c, const char *address, const void *worker,
                  size_t worker_len, const char *token, int timeout_ms,
                  ecx_zresp *out, char *why, size_t whylen)
{
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
