/*
 * server.c - the rendezvous server: a ZeroMQ ROUTER socket read by one
 * thread that decodes each request and sends the handler's answer. Peers
 * are REQ sockets (the reference's and ecx's): each request comes as the
 * peer's routing frames, an empty delimiter and one body frame, and the
 * answer goes back behind the same routing frames. A handler may take a
 * ticket (ecx_rdv_defer) and answer later from another thread, so one slow
 * request does not hold up the others. A request of several body frames or
 * one that does not decode is answered with an error in the reference's
 * shape; a message without a delimiter is dropped (as REP drops it);
 * nothing a peer sends stops the thread.
 */
#include "rdv/rdv.h"

#include <zmq.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* Routing frames and body of one request at most (REQ sends one routing
 * frame through the ROUTER, its identity; a chain of proxies adds more). */
#define RDV_FRAMES_MAX 16

/* The routing frames of a request, kept until it is answered. */
struct ecx_rdv_ticket {
	struct ecx_rdv_ticket *next;
	struct ecx_rdv_server *s;
	size_t nroute;
	zmq_msg_t route[RDV_FRAMES_MAX]; /* the delimiter included */
	char *reply;                     /* set by ecx_rdv_answer */
};

struct ecx_rdv_server {
	ecx_rdv_server_opts o;
	void *zctx, *zsock;
	pthread_t thread;
	bool started;
	int stop;
	char address[ECX_ADDR_MAX];
	/* Answers given by other threads, sent by the server's thread. */
	pthread_mutex_t alock;
	ecx_rdv_ticket *answers;
	int wake_fd; /* eventfd: answers are queued */
};

char ecx_rdv_later[1];

/* The request being handled on the server's thread (for ecx_rdv_defer). */
static __thread ecx_rdv_ticket *rdv_current;
static __thread bool rdv_deferred;

static void ticket_free(ecx_rdv_ticket *t)
{
	for (size_t i = 0; i < t->nroute; i++)
		zmq_msg_close(&t->route[i]);
	free(t->reply);
	free(t);
}

/* Sends reply behind t's routing frames. */
static void send_answer(ecx_rdv_server *s, ecx_rdv_ticket *t, const char *reply)
{
	for (size_t i = 0; i < t->nroute; i++)
		if (zmq_msg_send(&t->route[i], s->zsock, ZMQ_SNDMORE) < 0)
			return;
	zmq_send(s->zsock, reply, strlen(reply), 0);
}

ecx_rdv_ticket *ecx_rdv_defer(void)
{
	if (rdv_current == NULL)
		return NULL;
	rdv_deferred = true;
	return rdv_current;
}

void ecx_rdv_answer(ecx_rdv_ticket *t, char *reply)
{
	ecx_rdv_server *s = t->s;
	if (reply == NULL)
		reply = strdup("{\"ok\":false,\"err\":\"out of memory\"}");
	t->reply = reply;
	pthread_mutex_lock(&s->alock);
	t->next = s->answers;
	s->answers = t;
	pthread_mutex_unlock(&s->alock);
	uint64_t one = 1;
	if (write(s->wake_fd, &one, sizeof(one)) < 0) {
		/* The counter is full: the thread is woken already. */
	}
}

/* Sends the answers other threads gave. */
static void rdv_send_answers(ecx_rdv_server *s)
{
	uint64_t n;
	if (read(s->wake_fd, &n, sizeof(n)) < 0) {
		/* Nothing was queued since the last read. */
	}
	pthread_mutex_lock(&s->alock);
	ecx_rdv_ticket *t = s->answers;
	s->answers = NULL;
	pthread_mutex_unlock(&s->alock);
	while (t != NULL) {
		ecx_rdv_ticket *next = t->next;
		if (t->reply != NULL)
			send_answer(s, t, t->reply);
		ticket_free(t);
		t = next;
	}
}

/* Reads one request (all of its frames) and answers it, or leaves the
 * answer to the handler's ticket. */
static void rdv_serve_one(ecx_rdv_server *s)
{
	ecx_rdv_ticket *t = calloc(1, sizeof(*t));
	zmq_msg_t m;
	zmq_msg_init(&m);
	if (zmq_msg_recv(&m, s->zsock, ZMQ_DONTWAIT) < 0 || t == NULL) {
		zmq_msg_close(&m);
		free(t);
		return;
	}
	t->s = s;
	/* Routing frames up to the empty delimiter, then the body. */
	bool delim = false, multi = false, over = false;
	for (;;) {
		bool more = zmq_msg_more(&m);
		if (!delim) {
			if (zmq_msg_size(&m) == 0)
				delim = true;
			if (t->nroute < RDV_FRAMES_MAX) {
				zmq_msg_t *k = &t->route[t->nroute++];
				zmq_msg_init(k);
				zmq_msg_move(k, &m);
			} else {
				over = true;
			}
			zmq_msg_close(&m);
			zmq_msg_init(&m);
			if (!more)
				break;
		} else {
			if (!more)
				break;
			multi = true;
			zmq_msg_close(&m);
			zmq_msg_init(&m);
		}
		if (zmq_msg_recv(&m, s->zsock, 0) < 0)
			break;
	}
	if (!delim || over) {
		zmq_msg_close(&m);
		ticket_free(t);
		return;
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
			rdv_current = t;
			rdv_deferred = false;
			reply = s->o.handle(s->o.arg, &r);
			rdv_current = NULL;
			ecx_zreq_free(&r);
			if (rdv_deferred) {
				/* The ticket's owner answers it. */
				if (reply != ecx_rdv_later)
					free(reply);
				zmq_msg_close(&m);
				return;
			}
		}
	}
	zmq_msg_close(&m);
	if (reply == NULL)
		reply = strdup("{\"ok\":false,\"err\":\"out of memory\"}");
	if (reply != NULL)
		send_answer(s, t, reply);
	free(reply);
	ticket_free(t);
}

static void *rdv_thread(void *arg)
{
	ecx_rdv_server *s = arg;
	while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
		if (s->o.tick != NULL)
			s->o.tick(s->o.arg);
		zmq_pollitem_t pi[2] = {
		    {.socket = s->zsock, .events = ZMQ_POLLIN},
		    {.fd = s->wake_fd, .events = ZMQ_POLLIN}};
		if (zmq_poll(pi, 2, 100) > 0) {
			if (pi[1].revents & ZMQ_POLLIN)
				rdv_send_answers(s);
			if (pi[0].revents & ZMQ_POLLIN)
				rdv_serve_one(s);
		}
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
	s->wake_fd = -1;
	pthread_mutex_init(&s->alock, NULL);
	int rc = ECX_ENOMEM;
	s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (s->wake_fd < 0) {
		rc = ecx_why(why, whylen, ECX_EIO, "eventfd: %s",
		             strerror(errno));
		goto fail;
	}
	s->zctx = zmq_ctx_new();
	if (s->zctx == NULL) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "zmq_ctx_new failed");
		goto fail;
	}
	zmq_ctx_set(s->zctx, ZMQ_IO_THREADS, 1);
	s->zsock = zmq_socket(s->zctx, ZMQ_ROUTER);
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
	/* Answers given after the thread stopped are dropped. */
	while (s->answers != NULL) {
		ecx_rdv_ticket *t = s->answers;
		s->answers = t->next;
		ticket_free(t);
	}
	if (s->wake_fd >= 0)
		close(s->wake_fd);
	pthread_mutex_destroy(&s->alock);
	if (s->zsock != NULL)
		zmq_close(s->zsock);
	if (s->zctx != NULL)
		zmq_ctx_term(s->zctx);
	free(s);
}
