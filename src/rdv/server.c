/*
 * server.c - the rendezvous server: a ZeroMQ REP socket read by one thread
 * that decodes each request and sends the handler's answer. A request of
 * several frames or one that does not decode is answered with an error in
 * the reference's shape; nothing a peer sends stops the thread.
 */
#include "rdv/rdv.h"

#include <zmq.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ecx_rdv_server {
	ecx_rdv_server_opts o;
	void *zctx, *zsock;
	pthread_t thread;
	bool started;
	int stop;
	char address[ECX_ADDR_MAX];
};

/* Reads one request (all of its frames) and answers it. */
static void rdv_serve_one(ecx_rdv_server *s)
{
	zmq_msg_t m;
	zmq_msg_init(&m);
	if (zmq_msg_recv(&m, s->zsock, ZMQ_DONTWAIT) < 0) {
		zmq_msg_close(&m);
		return;
	}
	bool multi = false;
	while (zmq_msg_more(&m)) {
		multi = true;
		zmq_msg_close(&m);
		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, s->zsock, 0) < 0)
			break;
	}
	char *reply;
	char why[200];
	if (multi) {
		reply =
		    ecx_zresp_encode_error(ECX_EPROTO, "expected one frame");
	} else {
		ecx_zreq r;
		int rc = ecx_zreq_decode(zmq_msg_data(&m), zmq_msg_size(&m), &r,
		                         why, sizeof(why));
		if (rc != 0) {
			reply = ecx_zresp_encode_error(rc, why);
		} else {
			reply = s->o.handle(s->o.arg, &r);
			ecx_zreq_free(&r);
		}
	}
	zmq_msg_close(&m);
	if (reply == NULL)
		reply = strdup("{\"ok\":false,\"err\":\"out of memory\"}");
	if (reply != NULL)
		zmq_send(s->zsock, reply, strlen(reply), 0);
	free(reply);
}

static void *rdv_thread(void *arg)
{
	ecx_rdv_server *s = arg;
	while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
		if (s->o.tick != NULL)
			s->o.tick(s->o.arg);
		zmq_pollitem_t pi = {.socket = s->zsock, .events = ZMQ_POLLIN};
		if (zmq_poll(&pi, 1, 100) > 0)
			rdv_serve_one(s);
	}
	return NULL;
}

int ecx_rdv_server_create(const ecx_rdv_server_opts *o, ecx_rdv_server **out,
                          char *why, size_t whylen)
{
	ecx_rdv_server *s = calloc(1, sizeof(*s));
	if (s == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	s->o = *o;
	int rc = ECX_ENOMEM;
	s->zctx = zmq_ctx_new();
	if (s->zctx == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "zmq_ctx_new failed");
		goto fail;
	}
	zmq_ctx_set(s->zctx, ZMQ_IO_THREADS, 1);
	s->zsock = zmq_socket(s->zctx, ZMQ_REP);
	if (s->zsock == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "zmq_socket failed");
		goto fail;
	}
	int64_t maxmsg = ECX_ZMQ_MAX_MSG;
	int linger = 0;
	zmq_setsockopt(s->zsock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	zmq_setsockopt(s->zsock, ZMQ_LINGER, &linger, sizeof(linger));
	/* ZeroMQ takes IPv6 addresses only when asked to; "::" then listens
	 * on IPv4 too. In URLs an IPv6 address goes in brackets. */
	int ipv6 = 1;
	zmq_setsockopt(s->zsock, ZMQ_IPV6, &ipv6, sizeof(ipv6));
	bool v6 = strchr(o->bind, ':') != NULL && o->bind[0] != '[';
	char ep[ECX_ADDR_MAX];
	if (o->port == 0)
		snprintf(ep, sizeof(ep), "tcp://%s%s%s:*", v6 ? "[" : "",
		         o->bind, v6 ? "]" : "");
	else
		snprintf(ep, sizeof(ep), "tcp://%s%s%s:%u", v6 ? "[" : "",
		         o->bind, v6 ? "]" : "", o->port);
	if (zmq_bind(s->zsock, ep) != 0) {
		int e = zmq_errno();
		rc = ecx_why(
		    why, whylen, e == EADDRINUSE ? ECX_EADDRINUSE : ECX_EINVAL,
		    "cannot bind ZeroMQ socket at %s: %s", ep, zmq_strerror(e));
		goto fail;
	}
	char last[ECX_ADDR_MAX];
	size_t ll = sizeof(last);
	zmq_getsockopt(s->zsock, ZMQ_LAST_ENDPOINT, last, &ll);
	const char *colon = strrchr(last, ':');
	bool adv6 = strchr(o->advertise, ':') != NULL && o->advertise[0] != '[';
	snprintf(s->address, sizeof(s->address), "tcp://%s%.200s%s:%.16s",
	         adv6 ? "[" : "", o->advertise, adv6 ? "]" : "",
	         colon != NULL ? colon + 1 : "0");
	if (pthread_create(&s->thread, NULL, rdv_thread, s) != 0) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "cannot start thread");
		goto fail;
	}
	s->started = true;
	*out = s;
	return 0;
fail:
	ecx_rdv_server_destroy(s);
	return rc;
}

const char *ecx_rdv_server_address(const ecx_rdv_server *s)
{
	return s->address;
}

void ecx_rdv_server_destroy(ecx_rdv_server *s)
{
	if (s == NULL)
		return;
	__atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
	if (s->started)
		pthread_join(s->thread, NULL);
	if (s->zsock != NULL)
		zmq_close(s->zsock);
	if (s->zctx != NULL)
		zmq_ctx_term(s->zctx);
	free(s);
}
