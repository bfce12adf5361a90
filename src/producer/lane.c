/*
 * lane.c - the producer's data lanes (TCP; wire.h, docs/protocol.md "The
 * data lane"): a listening socket beside the rendezvous one, a thread that
 * takes each consumer's lane (its hello checked against the key its
 * connection was given in the hello's answer), and the frames of pulls
 * that asked for it. A frame goes from the progress thread without
 * blocking where the socket takes it whole; what it does not take goes on
 * the lane's queue, which the lane's writer thread sends in order, each
 * frame within the producer's timeout. A lane that fails (a send error,
 * a frame past its time, its connection closing) is shut down: what is
 * queued fails at once, and the consumer sees its end.
 *
 * Locking: l->mu guards a lane's queue and state; the producer's lock
 * guards which lane a connection has (set once by the acceptor).
 */
#define _GNU_SOURCE /* accept4, pipe2 */
#include "producer/producer.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MOD "producer"
/* How long a consumer has to send its lane hello once connected (it sends
 * it at once), and how many hellos are read side by side (past that, new
 * connections wait in the listening socket's backlog). */
#define LANE_HELLO_MS 100
#define HELLO_WAITING 64
/* How often a writer waiting on a full socket looks at its lane's state. */
#define LANE_POLL_MS 50

struct lane_msg {
	struct lane_msg *next;
	ecx_lane_hdr h;
	const void *src; /* the items' bytes (data), or NULL */
	char *body;      /* the reply's JSON (reply; freed with it) */
	job_send *s;     /* data: the send it completes */
	size_t off;      /* bytes of header and body sent */
	uint64_t deadline_ns;
	int rc; /* how it went, once done (on p->lane_done) */
};
typedef struct lane_msg lane_msg;

struct prod_lane {
	int fd;
	ecx_producer *p;
	uint64_t conn;
	conn *cn; /* its connection, once taken (outlives the lane) */
	pthread_t th;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	lane_msg *head, *tail;
	bool busy;   /* the writer is sending a frame off the queue */
	bool broken; /* failed or closing: every frame fails at once */
	bool stop;   /* the writer ends once the queue is empty */
};

static int msg_iov(lane_msg *m, struct iovec *iov)
{
	size_t off = m->off;
	int n = 0;
	if (off < sizeof(m->h)) {
		iov[n++] = (struct iovec){.iov_base = (char *)&m->h + off,
		                          .iov_len = sizeof(m->h) - off};
		off = 0;
	} else {
		off -= sizeof(m->h);
	}
	const char *b = m->src != NULL ? m->src : m->body;
	if (m->h.len > off)
		iov[n++] = (struct iovec){.iov_base = (char *)b + off,
		                          .iov_len = m->h.len - off};
	return n;
}

static bool msg_sent(const lane_msg *m)
{
	return m->off == sizeof(m->h) + m->h.len;
}

/* One non-blocking send of what is left of m: 0 (sent, or the socket is
 * full: see msg_sent), or ECX_ECLOSED. */
static int msg_send_some(int fd, lane_msg *m)
{
	struct iovec iov[2];
	struct msghdr mh = {.msg_iov = iov,
	                    .msg_iovlen = (size_t)msg_iov(m, iov)};
	ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
	if (w >= 0) {
		m->off += (size_t)w;
		return 0;
	}
	return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR
	           ? 0
	           : ECX_ECLOSED;
}

/* m has gone (rc 0) or failed: its send completes (data), its memory goes.
 * Progress thread only: a job's completions all run there (an abandon
 * there must not race one). */
static void msg_done(lane_msg *m, int rc)
{
	if (m->s != NULL) {
		if (rc != 0)
			m->s->status = rc;
		prod_job_part_done(m->s->j, UCS_OK);
	}
	free(m->body);
	free(m);
}

/* The writer's m is done: handed to the progress thread (woken) to
 * complete. */
static void msg_hand(prod_lane *l, lane_msg *m, int rc)
{
	ecx_producer *p = l->p;
	m->rc = rc;
	m->next = NULL;
	pthread_mutex_lock(&p->lane_mu);
	if (p->lane_done_tail != NULL)
		p->lane_done_tail->next = m;
	else
		p->lane_done = m;
	p->lane_done_tail = m;
	pthread_mutex_unlock(&p->lane_mu);
	ecx_ucx_wake(p->ucx);
}

int prod_lanes_complete(ecx_producer *p)
{
	pthread_mutex_lock(&p->lane_mu);
	lane_msg *m = p->lane_done;
	p->lane_done = p->lane_done_tail = NULL;
	pthread_mutex_unlock(&p->lane_mu);
	int n = 0;
	while (m != NULL) {
		lane_msg *next = m->next;
		msg_done(m, m->rc);
		m = next;
		n++;
	}
	return n;
}

/* Marks l failed and shuts its socket down (the consumer sees the end; a
 * blocked send returns). With why (a failure, not a close), its
 * connection fails too, as one whose endpoint failed: the progress thread
 * closes it. Called with l->mu. */
static void lane_break(prod_lane *l, const char *why)
{
	if (!l->broken && why != NULL) {
		ecx_warn(MOD,
		         "data lane of connection %llu: %s; closing the "
		         "connection",
		         (unsigned long long)l->conn, why);
		if (l->cn != NULL) {
			__atomic_store_n(&l->cn->failed, true,
			                 __ATOMIC_RELEASE);
			ecx_ucx_wake(l->p->ucx);
		}
	}
	__atomic_store_n(&l->broken, true, __ATOMIC_RELEASE);
	shutdown(l->fd, SHUT_RDWR);
	pthread_cond_broadcast(&l->cv);
}

/* Sends m whole, waiting on a full socket, until its deadline: 0,
 * ECX_ETIMEDOUT or ECX_ECLOSED. */
static int msg_send(prod_lane *l, lane_msg *m)
{
	for (;;) {
		int rc = msg_send_some(l->fd, m);
		if (rc != 0 || msg_sent(m))
			return rc;
		if (__atomic_load_n(&l->broken, __ATOMIC_ACQUIRE))
			return ECX_ECLOSED;
		uint64_t now = ecx_now_ns();
		if (now >= m->deadline_ns)
			return ECX_ETIMEDOUT;
		uint64_t left_ms = (m->deadline_ns - now) / 1000000u + 1;
		struct pollfd pf = {.fd = l->fd, .events = POLLOUT};
		poll(&pf, 1,
		     left_ms < LANE_POLL_MS ? (int)left_ms : LANE_POLL_MS);
	}
}

static void *lane_writer(void *arg)
{
	prod_lane *l = arg;
	pthread_mutex_lock(&l->mu);
	for (;;) {
		while (l->head == NULL && !l->stop)
			pthread_cond_wait(&l->cv, &l->mu);
		lane_msg *m = l->head;
		if (m == NULL)
			break; /* stopped, nothing queued */
		l->head = m->next;
		if (l->head == NULL)
			l->tail = NULL;
		bool broken = l->broken;
		l->busy = true;
		pthread_mutex_unlock(&l->mu);
		int rc = broken ? ECX_ECLOSED : msg_send(l, m);
		pthread_mutex_lock(&l->mu);
		l->busy = false;
		if (rc != 0)
			lane_break(l, rc == ECX_ETIMEDOUT
			                  ? "the consumer takes no more bytes"
			                  : "the consumer closed it");
		pthread_cond_broadcast(&l->cv); /* a quiesce waits for it */
		pthread_mutex_unlock(&l->mu);
		msg_hand(l, m, rc);
		pthread_mutex_lock(&l->mu);
	}
	pthread_mutex_unlock(&l->mu);
	return NULL;
}

/* Sends m on l in order: at once where nothing is queued and the socket
 * takes it whole, else by the writer. Progress thread. */
static void lane_push(prod_lane *l, lane_msg *m)
{
	m->deadline_ns = ecx_now_ns() + (uint64_t)l->p->timeout_ms * 1000000u;
	pthread_mutex_lock(&l->mu);
	if (l->broken) {
		pthread_mutex_unlock(&l->mu);
		msg_done(m, ECX_ECLOSED);
		return;
	}
	if (l->head == NULL && !l->busy) {
		int rc = msg_send_some(l->fd, m);
		if (rc != 0)
			lane_break(l, "the consumer closed it");
		if (rc != 0 || msg_sent(m)) {
			pthread_mutex_unlock(&l->mu);
			msg_done(m, rc);
			return;
		}
	}
	if (l->tail != NULL)
		l->tail->next = m;
	else
		l->head = m;
	l->tail = m;
	pthread_cond_signal(&l->cv);
	pthread_mutex_unlock(&l->mu);
}

ucs_status_ptr_t prod_lane_data(prod_lane *l, job_send *s, const void *src,
                                uint64_t len)
{
	lane_msg *m = calloc(1, sizeof(*m));
	if (m == NULL)
		return UCS_STATUS_PTR(UCS_ERR_NO_MEMORY);
	m->h = (ecx_lane_hdr){.magic = ECX_LANE_MAGIC,
	                      .kind = ECX_LANE_DATA,
	                      .first = s->h.first,
	                      .count = s->h.count,
	                      .req = s->h.req,
	                      .len = len};
	if (l->p->lane_test_frame == 'm')
		m->h.magic ^= 1;
	else if (l->p->lane_test_frame == 'r')
		m->h.req += 1u << 20;
	m->src = src;
	m->s = s;
	/* Counted before it may complete (at once, below). */
	__atomic_add_fetch(&s->j->pending, 1, __ATOMIC_ACQ_REL);
	lane_push(l, m);
	return (ucs_status_ptr_t)(uintptr_t)1; /* in flight; never freed */
}

bool prod_lane_reply(prod_lane *l, uint64_t req, char *body)
{
	size_t len = body != NULL ? strlen(body) : 0;
	lane_msg *m = body != NULL && len <= ECX_LANE_REPLY_MAX
	                  ? calloc(1, sizeof(*m))
	                  : NULL;
	if (m == NULL) {
		/* Its data went on this lane: no other way can follow them in
		 * order, so the lane fails, and the consumer with it. */
		free(body);
		pthread_mutex_lock(&l->mu);
		lane_break(l, "a reply could not be queued (too long, or out "
		              "of memory)");
		pthread_mutex_unlock(&l->mu);
		return false;
	}
	m->h = (ecx_lane_hdr){.magic = ECX_LANE_MAGIC,
	                      .kind = ECX_LANE_REPLY,
	                      .req = req,
	                      .len = len};
	m->body = body;
	lane_push(l, m);
	return true;
}

void prod_lane_shutdown(prod_lane *l)
{
	if (l == NULL)
		return;
	pthread_mutex_lock(&l->mu);
	lane_break(l, NULL);
	pthread_mutex_unlock(&l->mu);
}

void prod_lane_quiesce(prod_lane *l)
{
	if (l == NULL)
		return;
	pthread_mutex_lock(&l->mu);
	lane_break(l, NULL);
	/* The writer fails what is queued at once (broken), and a send in
	 * progress ends within a poll slice (its socket shut down). */
	while (l->head != NULL || l->busy)
		pthread_cond_wait(&l->cv, &l->mu);
	pthread_mutex_unlock(&l->mu);
}

void prod_lane_free(prod_lane *l)
{
	if (l == NULL)
		return;
	pthread_mutex_lock(&l->mu);
	lane_break(l, NULL);
	l->stop = true;
	pthread_cond_broadcast(&l->cv);
	pthread_mutex_unlock(&l->mu);
	/* The writer fails what is queued (the lane is broken) and ends. */
	pthread_join(l->th, NULL);
	close(l->fd);
	pthread_mutex_destroy(&l->mu);
	pthread_cond_destroy(&l->cv);
	free(l);
}

/* ---- taking lanes ---- */

void prod_lane_key(unsigned char *key)
{
	size_t got = 0;
	while (got < ECX_LANE_KEY_LEN) {
		ssize_t r = getrandom(key + got, ECX_LANE_KEY_LEN - got, 0);
		if (r < 0 && errno != EINTR)
			break;
		if (r > 0)
			got += (size_t)r;
	}
	if (got < ECX_LANE_KEY_LEN) {
		/* No entropy source: a key nobody can guess is not to be
		 * had, so none is given (a zero key matches nothing). */
		memset(key, 0, ECX_LANE_KEY_LEN);
	}
}

static bool key_zero(const unsigned char *k)
{
	unsigned char acc = 0;
	for (size_t i = 0; i < ECX_LANE_KEY_LEN; i++)
		acc |= k[i];
	return acc == 0;
}

/* Whether h names a connection of p's that may take a lane, with its
 * key; else why. Called with p->lock. */
static conn *lane_conn(ecx_producer *p, const ecx_lane_hello *h,
                       const char **why)
{
	conn *c = p->conns;
	while (c != NULL && c->id != h->conn)
		c = c->next;
	bool ok = c != NULL && c->transport == ECX_TR_TCP && c->lane == NULL &&
	          !__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE) &&
	          !c->closed && !key_zero(c->lane_key) &&
	          ecx_ct_equal((const char *)c->lane_key, ECX_LANE_KEY_LEN,
	                       (const char *)h->key, ECX_LANE_KEY_LEN);
	*why = c == NULL         ? "no such connection"
	       : c->lane != NULL ? "the connection has a lane"
	                         : "wrong key, or no lane for it";
	return ok ? c : NULL;
}

/* Makes fd connection h->conn's lane if h says so with its key: checked,
 * then published (checked again under the lock) and answered; else NULL
 * (why says). */
static prod_lane *lane_take(ecx_producer *p, int fd, const ecx_lane_hello *h,
                            const char **why)
{
	if (h->magic != ECX_LANE_MAGIC || h->version != ECX_LANE_VERSION) {
		*why = "not a lane hello of this version";
		return NULL;
	}
	pthread_mutex_lock(&p->lock);
	bool ok = lane_conn(p, h, why) != NULL;
	pthread_mutex_unlock(&p->lock);
	if (!ok)
		return NULL;
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
	prod_lane *l = calloc(1, sizeof(*l));
	if (l == NULL) {
		*why = "out of memory";
		return NULL;
	}
	l->fd = fd;
	l->p = p;
	l->conn = h->conn;
	pthread_mutex_init(&l->mu, NULL);
	pthread_cond_init(&l->cv, NULL);
	if (pthread_create(&l->th, NULL, lane_writer, l) != 0) {
		pthread_mutex_destroy(&l->mu);
		pthread_cond_destroy(&l->cv);
		free(l);
		*why = "no thread for it";
		return NULL;
	}
	/* Published before it is answered, so every pull the consumer sends
	 * once it has the answer finds it; answered before anything else is
	 * sent on it (a frame waits for l->mu). */
	pthread_mutex_lock(&p->lock);
	conn *c = lane_conn(p, h, why);
	if (c != NULL) {
		pthread_mutex_lock(&l->mu);
		l->cn = c;
		__atomic_store_n(&c->lane, l, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&p->lock);
	if (c == NULL) {
		l->fd = -1; /* the caller's to close */
		prod_lane_free(l);
		return NULL;
	}
	/* The socket is empty: 32 bytes go at once. If they do not, the
	 * lane fails, and its connection with it. */
	if (send(fd, h, sizeof(*h), MSG_NOSIGNAL | MSG_DONTWAIT) !=
	    (ssize_t)sizeof(*h))
		lane_break(l, "its answer could not be sent");
	pthread_mutex_unlock(&l->mu);
	return l;
}

/* A connection whose hello is still coming. */
typedef struct hello_wait {
	int fd;
	size_t got;
	uint64_t until_ns;
	ecx_lane_hello h;
} hello_wait;

/* Takes or refuses the lane of w, whose hello came whole (got), or did not
 * in time, or whose socket ended; w's descriptor is then the lane's, or
 * closed. */
static void hello_done(ecx_producer *p, hello_wait *w, bool got)
{
	const char *why = "no hello in time";
	prod_lane *l = got ? lane_take(p, w->fd, &w->h, &why) : NULL;
	if (l == NULL) {
		ecx_warn(MOD, "data lane refused: %s", why);
		__atomic_add_fetch(&p->lanes_refused, 1, __ATOMIC_RELAXED);
		close(w->fd);
	} else {
		__atomic_add_fetch(&p->lanes_taken, 1, __ATOMIC_RELAXED);
		ecx_debug(MOD, "data lane of connection %llu taken",
		          (unsigned long long)w->h.conn);
	}
	w->fd = -1;
}

/* Takes lanes: accepts connections and reads their hellos side by side,
 * each within LANE_HELLO_MS, so a silent one holds up no other. */
static void *lane_acceptor(void *arg)
{
	ecx_producer *p = arg;
	hello_wait w[HELLO_WAITING];
	size_t nw = 0;
	for (;;) {
		struct pollfd pf[2 + HELLO_WAITING] = {
		    {.fd = p->lane_wake[0], .events = POLLIN},
		    {.fd = nw < HELLO_WAITING ? p->lane_ls : -1,
		     .events = POLLIN}};
		uint64_t now = ecx_now_ns(), next = UINT64_MAX;
		for (size_t k = 0; k < nw; k++) {
			pf[2 + k] =
			    (struct pollfd){.fd = w[k].fd, .events = POLLIN};
			if (w[k].until_ns < next)
				next = w[k].until_ns;
		}
		int ms = next == UINT64_MAX ? -1
		         : next <= now      ? 0
		                       : (int)((next - now) / 1000000u) + 1;
		if (poll(pf, 2 + nw, ms) < 0 && errno != EINTR) {
			usleep(10000); /* never spins */
			continue;
		}
		if (pf[0].revents != 0)
			break;
		now = ecx_now_ns();
		for (size_t k = 0; k < nw; k++) {
			hello_wait *x = &w[k];
			if (pf[2 + k].revents != 0) {
				ssize_t r =
				    recv(x->fd, (char *)&x->h + x->got,
				         sizeof(x->h) - x->got, MSG_DONTWAIT);
				if (r > 0)
					x->got += (size_t)r;
				if (x->got == sizeof(x->h))
					hello_done(p, x, true);
				else if (r == 0 || (r < 0 && errno != EAGAIN &&
				                    errno != EINTR))
					hello_done(p, x, false);
			}
			if (x->fd >= 0 && now >= x->until_ns)
				hello_done(p, x, false);
		}
		size_t kept = 0; /* pollfd k + 2 matched w[k] until here */
		for (size_t k = 0; k < nw; k++)
			if (w[k].fd >= 0)
				w[kept++] = w[k];
		nw = kept;
		if (!(pf[1].revents & POLLIN))
			continue;
		int fd = accept4(p->lane_ls, NULL, NULL, SOCK_CLOEXEC);
		if (fd < 0) {
			/* Out of descriptors, say: backs off, never spins. */
			if (errno != EINTR && errno != ECONNABORTED &&
			    errno != EAGAIN && errno != EWOULDBLOCK)
				usleep(10000);
			continue;
		}
		w[nw++] = (hello_wait){
		    .fd = fd,
		    .until_ns = now + (uint64_t)LANE_HELLO_MS * 1000000u};
	}
	for (size_t k = 0; k < nw; k++)
		close(w[k].fd);
	return NULL;
}

int prod_lanes_start(ecx_producer *p, const char *host, char *why,
                     size_t whylen)
{
	p->lane_ls = p->lane_wake[0] = p->lane_wake[1] = -1;
	const char *off = getenv("ECX_TCP_LANE");
	if (off != NULL && strcmp(off, "0") == 0) {
		ecx_debug(MOD, "no data lanes (ECX_TCP_LANE=0)");
		return 0;
	}
	if (off != NULL && off[0] != '\0' && strcmp(off, "1") != 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "ECX_TCP_LANE=%s: use 1 (the default) or 0",
		               off);
	const char *t = getenv("ECX_TEST_LANE_FRAME");
	p->lane_test_frame = t == NULL                 ? 0
	                     : strcmp(t, "magic") == 0 ? 'm'
	                     : strcmp(t, "req") == 0   ? 'r'
	                                               : 0;
	/* Where the rendezvous socket listens (a name resolved the same
	 * way), never wider. */
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
	                         .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
	struct addrinfo *ai = NULL;
	/* ECX_TCP_LANE_PORT: a fixed port (a firewall's rule), else any. */
	const char *port = getenv("ECX_TCP_LANE_PORT");
	char *end = NULL;
	long pn = port != NULL && port[0] != '\0' ? strtol(port, &end, 10) : 0;
	if (port != NULL && port[0] != '\0' &&
	    (*end != '\0' || pn < 1 || pn > 65535))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "ECX_TCP_LANE_PORT=%s: a port, 1 to 65535",
		               port);
	char ps[8];
	snprintf(ps, sizeof(ps), "%ld", pn);
	int gai = getaddrinfo(host, ps, &hints, &ai);
	if (gai != 0 || ai == NULL)
		return ecx_why(why, whylen, ECX_EIO,
		               "data lane: cannot bind %s: %s", host,
		               gai_strerror(gai));
	/* Not blocking: an accept after poll never holds the hellos up. */
	int fd = socket(ai->ai_family,
	                SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	int one = 1;
	if (fd >= 0)
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 ||
	    listen(fd, 128) != 0) {
		int e = errno;
		freeaddrinfo(ai);
		if (fd >= 0)
			close(fd);
		return ecx_why(why, whylen, ECX_EIO,
		               "data lane: cannot listen on %s port %s: %s",
		               host, ps, strerror(e));
	}
	freeaddrinfo(ai);
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sl);
	p->lane_port = ss.ss_family == AF_INET6
	                   ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
	                   : ntohs(((struct sockaddr_in *)&ss)->sin_port);
	if (pipe2(p->lane_wake, O_CLOEXEC) != 0) {
		close(fd);
		return ecx_why(why, whylen, ECX_EIO, "data lane: %s",
		               strerror(errno));
	}
	p->lane_ls = fd;
	if (pthread_create(&p->lane_th, NULL, lane_acceptor, p) != 0) {
		prod_lanes_stop(p);
		return ecx_why(why, whylen, ECX_EIO,
		               "data lane: no thread for it");
	}
	p->lane_thread = true;
	ecx_debug(MOD, "data lanes on port %u", p->lane_port);
	return 0;
}

void prod_lanes_stop(ecx_producer *p)
{
	if (p->lane_thread) {
		ssize_t w = write(p->lane_wake[1], "x", 1);
		(void)w;
		pthread_join(p->lane_th, NULL);
		p->lane_thread = false;
	}
	if (p->lane_ls >= 0)
		close(p->lane_ls);
	for (int i = 0; i < 2; i++)
		if (p->lane_wake[i] >= 0)
			close(p->lane_wake[i]);
	p->lane_ls = p->lane_wake[0] = p->lane_wake[1] = -1;
}
