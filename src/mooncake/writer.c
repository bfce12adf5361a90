/* writer.c - writes into Mooncake sessions (see writer.h). */
#include "mooncake/writer.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MOD "mooncake"

/* What the writer knows of one session. */
typedef struct mc_peer {
	struct mc_peer *next;
	char session[ECX_MC_NAME_MAX];
	ecx_mc_segment seg;
	bool have_seg;
	uint64_t seg_until_ns;
	char data_host[ECX_MC_NAME_MAX]; /* from the descriptor's name */
	int idle[ECX_MC_POOL];
	int nidle;
	uint64_t used_ns;
} mc_peer;

struct ecx_mc_writer {
	pthread_mutex_t lock; /* the peers; never held across a wait */
	mc_peer *peers;
	size_t npeers;
	int stop_fd;   /* eventfd: readable once shutdown was called */
	bool stopping; /* atomic: shutdown was called */
	char *request; /* the metadata request frame */
	size_t request_len;
	ecx_mc_writer_stats st; /* atomic updates */
};

static void count(uint64_t *c, uint64_t n)
{
	__atomic_fetch_add(c, n, __ATOMIC_RELAXED);
}

/* ---- bounded socket waits ---- */

/* Waits for ev on fd until deadline_ns: 0, ECX_ETIMEDOUT, or ECX_ECLOSED
 * on shutdown. */
static int wait_fd(ecx_mc_writer *w, int fd, short ev, uint64_t deadline_ns,
                   short *revents)
{
	for (;;) {
		uint64_t now = ecx_now_ns();
		if (now >= deadline_ns)
			return ECX_ETIMEDOUT;
		uint64_t left_ms = (deadline_ns - now + 999999) / 1000000;
		struct pollfd pf[2] = {{.fd = fd, .events = ev},
		                       {.fd = w->stop_fd, .events = POLLIN}};
		int r = poll(pf, 2, left_ms > 60000 ? 60000 : (int)left_ms);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return ECX_EIO;
		if (pf[1].revents != 0)
			return ECX_ECLOSED;
		if (r > 0 && pf[0].revents != 0) {
			*revents = pf[0].revents;
			return 0;
		}
	}
}

/* Reads exactly n bytes. */
static int read_full(ecx_mc_writer *w, int fd, void *buf, size_t n,
                     uint64_t deadline_ns, char *why, size_t whylen)
{
	size_t got = 0;
	while (got < n) {
		ssize_t r = recv(fd, (char *)buf + got, n - got, 0);
		if (r > 0) {
			got += (size_t)r;
			continue;
		}
		if (r == 0)
			return ecx_why(why, whylen, ECX_ECLOSED,
			               "the peer closed the connection after "
			               "%zu of %zu bytes of its answer",
			               got, n);
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			return ecx_why(why, whylen, ECX_ECLOSED,
			               "reading the peer's answer: %s",
			               strerror(errno));
		short rev;
		int rc = wait_fd(w, fd, POLLIN, deadline_ns, &rev);
		if (rc != 0)
			return ecx_why(why, whylen, rc,
			               rc == ECX_ETIMEDOUT
			                   ? "no answer from the peer by the "
			                     "deadline"
			                   : "the writer is shutting down");
	}
	return 0;
}

/* Opens a non-blocking TCP connection (TCP_NODELAY) to host:port. */
static int connect_to(ecx_mc_writer *w, const char *host, uint16_t port,
                      uint64_t deadline_ns, int *out, char *why, size_t whylen)
{
	char ps[8];
	snprintf(ps, sizeof(ps), "%u", (unsigned)port);
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
	                         .ai_flags = AI_NUMERICSERV};
	struct addrinfo *ai = NULL;
	int g = getaddrinfo(host, ps, &hints, &ai);
	if (g != 0)
		return ecx_why(why, whylen, ECX_ECONNECT,
		               "cannot resolve %s: %s", host, gai_strerror(g));
	int rc = ECX_ECONNECT;
	char last[96] = "no address";
	for (struct addrinfo *a = ai; a != NULL; a = a->ai_next) {
		int fd = socket(a->ai_family,
		                a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
		                a->ai_protocol);
		if (fd < 0) {
			snprintf(last, sizeof(last), "%s", strerror(errno));
			continue;
		}
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		int c = connect(fd, a->ai_addr, a->ai_addrlen);
		if (c != 0 && errno == EINPROGRESS) {
			short rev = 0;
			int wr = wait_fd(w, fd, POLLOUT, deadline_ns, &rev);
			if (wr != 0) {
				close(fd);
				rc = wr;
				snprintf(last, sizeof(last), "%s",
				         wr == ECX_ETIMEDOUT
				             ? "no connection by the deadline"
				             : "the writer is shutting down");
				if (wr == ECX_ECLOSED)
					break;
				continue;
			}
			int err = 0;
			socklen_t el = sizeof(err);
			getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
			c = err == 0 ? 0 : -1;
			errno = err;
		}
		if (c != 0) {
			rc = ECX_ECONNECT;
			snprintf(last, sizeof(last), "%s", strerror(errno));
			close(fd);
			continue;
		}
		freeaddrinfo(ai);
		*out = fd;
		return 0;
	}
	freeaddrinfo(ai);
	return ecx_why(why, whylen, rc, "cannot connect to %s:%u: %s", host,
	               (unsigned)port, last);
}

/* Sends all of iov (modified), bounded by the deadline. When the peer
 * answers before the bytes are all sent (its reject status), *early is
 * set and the send stops. */
static int send_all(ecx_mc_writer *w, int fd, struct iovec *iov, int niov,
                    uint64_t deadline_ns, bool *early, char *why, size_t whylen)
{
	*early = false;
	while (niov > 0) {
		struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
		ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL);
		if (r >= 0) {
			size_t left = (size_t)r;
			while (niov > 0 && left >= iov->iov_len) {
				left -= iov->iov_len;
				iov++;
				niov--;
			}
			if (niov > 0) {
				iov->iov_base = (char *)iov->iov_base + left;
				iov->iov_len -= left;
			}
			continue;
		}
		if (errno == EINTR)
			continue;
		if (errno == EPIPE || errno == ECONNRESET) {
			*early = true; /* the answer, if any, says why */
			return 0;
		}
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			return ecx_why(why, whylen, ECX_EIO, "send: %s",
			               strerror(errno));
		short rev = 0;
		int rc = wait_fd(w, fd, POLLOUT | POLLIN, deadline_ns, &rev);
		if (rc != 0)
			return ecx_why(why, whylen, rc,
			               rc == ECX_ETIMEDOUT
			                   ? "the receiver took too little of "
			                     "the bytes by the deadline"
			                   : "the writer is shutting down");
		if (rev & (POLLIN | POLLHUP | POLLERR)) {
			*early = true;
			return 0;
		}
	}
	return 0;
}

/* ---- the handshake ---- */

/* Asks session host:port for its segment descriptor. */
static int handshake(ecx_mc_writer *w, const char *host, uint16_t port,
                     uint64_t deadline_ns, ecx_mc_segment *seg, char *why,
                     size_t whylen)
{
	int fd = -1;
	int rc = connect_to(w, host, port, deadline_ns, &fd, why, whylen);
	if (rc != 0)
		return rc;
	pthread_mutex_lock(&w->lock);
	char *req = malloc(w->request_len);
	size_t req_len = w->request_len;
	if (req != NULL)
		memcpy(req, w->request, req_len);
	pthread_mutex_unlock(&w->lock);
	if (req == NULL) {
		close(fd);
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	}
	struct iovec iov = {.iov_base = req, .iov_len = req_len};
	bool early = false;
	rc = send_all(w, fd, &iov, 1, deadline_ns, &early, why, whylen);
	free(req);
	uint8_t lenb[ECX_MC_HS_LEN_BYTES];
	if (rc == 0)
		rc = read_full(w, fd, lenb, sizeof(lenb), deadline_ns, why,
		               whylen);
	uint64_t blen = 0;
	if (rc == 0)
		rc = ecx_mc_hs_len_decode(lenb, &blen, why, whylen);
	uint8_t *body = NULL;
	if (rc == 0 && (body = malloc(blen)) == NULL)
		rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	if (rc == 0)
		rc = read_full(w, fd, body, blen, deadline_ns, why, whylen);
	close(fd);
	uint8_t type = 0;
	const char *json = NULL;
	size_t jl = 0;
	if (rc == 0)
		rc = ecx_mc_hs_body_decode(body, blen, &type, &json, &jl, why,
		                           whylen);
	if (rc == 0 && type != ECX_MC_HS_METADATA)
		rc = ecx_why(why, whylen, ECX_EPROTO,
		             "the answer to a metadata request is of type %u",
		             (unsigned)type);
	if (rc == 0)
		rc = ecx_mc_segment_decode(json, jl, seg, why, whylen);
	free(body);
	if (rc == 0)
		count(&w->st.handshakes, 1);
	return rc;
}

/* ---- peers ---- */

static void peer_close_idle(mc_peer *pe)
{
	for (int i = 0; i < pe->nidle; i++)
		close(pe->idle[i]);
	pe->nidle = 0;
}

static void peer_free(mc_peer *pe)
{
	peer_close_idle(pe);
	ecx_mc_segment_free(&pe->seg);
	free(pe);
}

/* The peer of session, made if new (the least recently used one is
 * forgotten when ECX_MC_PEERS_MAX are known). Called with the lock. */
static mc_peer *peer_get(ecx_mc_writer *w, const char *session)
{
	mc_peer **lru = NULL;
	for (mc_peer **pp = &w->peers; *pp != NULL; pp = &(*pp)->next) {
		if (strcmp((*pp)->session, session) == 0)
			return *pp;
		if (lru == NULL || (*pp)->used_ns < (*lru)->used_ns)
			lru = pp;
	}
	if (w->npeers >= ECX_MC_PEERS_MAX && lru != NULL) {
		mc_peer *old = *lru;
		*lru = old->next;
		peer_free(old);
		w->npeers--;
	}
	mc_peer *pe = calloc(1, sizeof(*pe));
	if (pe == NULL)
		return NULL;
	ecx_strlcpy(pe->session, session, sizeof(pe->session));
	pe->next = w->peers;
	w->peers = pe;
	w->npeers++;
	return pe;
}

/* Marks a peer's descriptor stale and drops its idle connections (after a
 * failure: the session may have restarted elsewhere). Takes the lock. */
static void peer_stale(ecx_mc_writer *w, const char *session)
{
	pthread_mutex_lock(&w->lock);
	mc_peer *pe = peer_get(w, session);
	if (pe != NULL) {
		pe->seg_until_ns = 0;
		peer_close_idle(pe);
	}
	pthread_mutex_unlock(&w->lock);
}

/* ---- one write ---- */

/* Writes on an open data connection and reads the status: 0 when the
 * receiver says the bytes are in place; *rejected when it refused them. */
static int write_on(ecx_mc_writer *w, int fd, uint64_t dst, const void *src,
                    uint64_t n, uint64_t deadline_ns, bool *rejected, char *why,
                    size_t whylen)
{
	*rejected = false;
	uint8_t hdr[ECX_MC_HDR_LEN];
	ecx_mc_hdr h = {
	    .size = n, .addr = dst, .opcode = ECX_MC_OP_WRITE | ECX_MC_OP_V2};
	ecx_mc_hdr_encode(&h, hdr);
	struct iovec iov[2] = {{.iov_base = hdr, .iov_len = sizeof(hdr)},
	                       {.iov_base = (void *)src, .iov_len = n}};
	bool early = false;
	int rc = send_all(w, fd, iov, 2, deadline_ns, &early, why, whylen);
	if (rc != 0)
		return rc;
	uint8_t sb[ECX_MC_STATUS_LEN];
	char rwhy[160];
	rc = read_full(w, fd, sb, sizeof(sb), deadline_ns, rwhy, sizeof(rwhy));
	if (rc != 0)
		return ecx_why(why, whylen, rc, "%s%s",
		               early ? "the receiver stopped taking the bytes; "
		                     : "",
		               rwhy);
	uint64_t st = ecx_mc_status_decode(sb);
	if (!ecx_mc_status_valid(st))
		return ecx_why(why, whylen, ECX_EPROTO,
		               "the receiver's answer is not a status frame "
		               "(0x%016llx)",
		               (unsigned long long)st);
	if (st != ECX_MC_STATUS_OK) {
		*rejected = true;
		return ecx_why(
		    why, whylen, ECX_EINVAL,
		    "the receiver refused the write of %llu bytes at "
		    "0x%llx (status %llu)",
		    (unsigned long long)n, (unsigned long long)dst,
		    (unsigned long long)(st & 0xFFFFFFFFu));
	}
	if (early)
		return ecx_why(
		    why, whylen, ECX_EPROTO,
		    "the receiver acknowledged a write before it had "
		    "all of its bytes");
	return 0;
}

int ecx_mc_write(ecx_mc_writer *w, const char *session, uint64_t dst,
                 const void *src, uint64_t n, uint64_t deadline_ns, char *why,
                 size_t whylen)
{
	char host[ECX_MC_NAME_MAX];
	uint16_t port = 0;
	int rc;
	if (n == 0)
		return ecx_why(why, whylen, ECX_EINVAL, "a write of 0 bytes");
	if (strlen(session) >= ECX_MC_NAME_MAX)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "session name longer than %d bytes",
		               ECX_MC_NAME_MAX - 1);
	if ((rc = ecx_mc_host_port(session, host, sizeof(host), &port, why,
	                           whylen)) != 0)
		return rc;
	bool fresh_seg = false; /* a handshake was made by this call */
	bool no_pool = false;   /* after a pooled connection failed */
	for (int attempt = 0;; attempt++) {
		pthread_mutex_lock(&w->lock);
		mc_peer *pe = peer_get(w, session);
		if (pe == NULL) {
			pthread_mutex_unlock(&w->lock);
			return ecx_why(why, whylen, ECX_ENOMEM,
			               "out of memory");
		}
		uint64_t now = ecx_now_ns();
		pe->used_ns = now;
		bool need = !pe->have_seg || now >= pe->seg_until_ns;
		pthread_mutex_unlock(&w->lock);
		if (need) {
			ecx_mc_segment seg;
			char hwhy[200];
			rc = handshake(w, host, port, deadline_ns, &seg, hwhy,
			               sizeof(hwhy));
			if (rc != 0) {
				count(&w->st.failed, 1);
				return ecx_why(why, whylen, rc,
				               "handshake with session %s: %s",
				               session, hwhy);
			}
			char dh[ECX_MC_NAME_MAX];
			uint16_t dp;
			/* decode checked the name's form already */
			ecx_mc_host_port(seg.name, dh, sizeof(dh), &dp, NULL,
			                 0);
			pthread_mutex_lock(&w->lock);
			pe = peer_get(w, session);
			if (pe == NULL) {
				pthread_mutex_unlock(&w->lock);
				ecx_mc_segment_free(&seg);
				return ecx_why(why, whylen, ECX_ENOMEM,
				               "out of memory");
			}
			/* Idle connections to another data port go. */
			if (strcmp(pe->data_host, dh) != 0 ||
			    pe->seg.tcp_data_port != seg.tcp_data_port)
				peer_close_idle(pe);
			ecx_mc_segment_free(&pe->seg);
			pe->seg = seg;
			pe->have_seg = true;
			pe->seg_until_ns =
			    ecx_now_ns() +
			    (uint64_t)ECX_MC_SEGMENT_TTL_MS * 1000000u;
			ecx_strlcpy(pe->data_host, dh, sizeof(pe->data_host));
			pthread_mutex_unlock(&w->lock);
			fresh_seg = true;
		}
		/* The checks against the descriptor, and a connection. */
		pthread_mutex_lock(&w->lock);
		pe = peer_get(w, session);
		if (pe == NULL || !pe->have_seg) {
			pthread_mutex_unlock(&w->lock);
			if (attempt < 2)
				continue; /* forgotten meanwhile */
			return ecx_why(why, whylen, ECX_ENOMEM,
			               "out of memory");
		}
		if (pe->seg.tcp_proto_version < 2) {
			unsigned v = pe->seg.tcp_proto_version;
			pthread_mutex_unlock(&w->lock);
			count(&w->st.failed, 1);
			return ecx_why(
			    why, whylen, ECX_EUNSUPPORTED,
			    "session %s speaks tcp_proto_version %u: "
			    "a write to it cannot be acknowledged",
			    session, v);
		}
		if (ecx_mc_segment_find(&pe->seg, dst, n) < 0) {
			size_t nb = pe->seg.n_buffers;
			pthread_mutex_unlock(&w->lock);
			if (!fresh_seg) {
				/* It may have registered memory since. */
				peer_stale(w, session);
				continue;
			}
			count(&w->st.failed, 1);
			return ecx_why(why, whylen, ECX_EINVAL,
			               "[0x%llx, +%llu) is outside the %zu "
			               "buffer(s) session %s advertises",
			               (unsigned long long)dst,
			               (unsigned long long)n, nb, session);
		}
		int fd = -1;
		if (!no_pool && pe->nidle > 0)
			fd = pe->idle[--pe->nidle];
		bool pooled = fd >= 0;
		char dh[ECX_MC_NAME_MAX];
		ecx_strlcpy(dh, pe->data_host, sizeof(dh));
		uint16_t dp = pe->seg.tcp_data_port;
		pthread_mutex_unlock(&w->lock);

		char wwhy[240];
		if (fd < 0) {
			rc = connect_to(w, dh, dp, deadline_ns, &fd, wwhy,
			                sizeof(wwhy));
			if (rc == 0) {
				count(&w->st.connects, 1);
			} else if (!fresh_seg && rc == ECX_ECONNECT) {
				/* The session may have moved its data port. */
				peer_stale(w, session);
				continue;
			} else {
				count(&w->st.failed, 1);
				return ecx_why(why, whylen, rc,
				               "data port of session %s: %s",
				               session, wwhy);
			}
		}
		bool rejected = false;
		rc = write_on(w, fd, dst, src, n, deadline_ns, &rejected, wwhy,
		              sizeof(wwhy));
		if (rc == 0) {
			count(&w->st.writes, 1);
			count(&w->st.bytes, n);
			pthread_mutex_lock(&w->lock);
			pe = peer_get(w, session);
			if (pe != NULL && pe->nidle < ECX_MC_POOL &&
			    strcmp(pe->data_host, dh) == 0 &&
			    pe->seg.tcp_data_port == dp) {
				pe->idle[pe->nidle++] = fd;
				fd = -1;
			}
			pthread_mutex_unlock(&w->lock);
			if (fd >= 0)
				close(fd);
			return 0;
		}
		close(fd);
		if (rejected) {
			count(&w->st.rejected, 1);
			return ecx_why(why, whylen, rc, "session %s: %s",
			               session, wwhy);
		}
		/* A pooled connection the peer had closed, or a peer that
		 * restarted: once more, fresh, if there is time. */
		if (pooled && attempt < 2 && rc != ECX_ETIMEDOUT &&
		    !__atomic_load_n(&w->stopping, __ATOMIC_ACQUIRE)) {
			no_pool = true;
			if (!fresh_seg)
				peer_stale(w, session);
			continue;
		}
		peer_stale(w, session);
		count(&w->st.failed, 1);
		return ecx_why(why, whylen, rc, "write to session %s: %s",
		               session, wwhy);
	}
}

/* ---- lifecycle ---- */

/* The metadata request frame: a descriptor of our own, as Mooncake's
 * writer sends its segment's. The writer has no data port and lends no
 * memory. Called with the lock, or before the writer is shared. */
static int make_request(ecx_mc_writer *w, const char *name)
{
	ecx_mc_segment self;
	memset(&self, 0, sizeof(self));
	ecx_strlcpy(self.name, name, sizeof(self.name));
	self.tcp_proto_version = 2;
	size_t jl = 0, fl = 0;
	char *json = ecx_mc_segment_encode(&self, &jl);
	char *f = json ? (char *)ecx_mc_hs_frame_encode(ECX_MC_HS_METADATA,
	                                                json, jl, &fl)
	               : NULL;
	free(json);
	if (f == NULL)
		return ECX_ENOMEM;
	free(w->request);
	w->request = f;
	w->request_len = fl;
	return 0;
}

void ecx_mc_writer_set_name(ecx_mc_writer *w, const char *self_name)
{
	pthread_mutex_lock(&w->lock);
	if (make_request(w, self_name) != 0)
		ecx_warn(MOD, "out of memory renaming the writer");
	pthread_mutex_unlock(&w->lock);
}

int ecx_mc_writer_create(const char *self_name, ecx_mc_writer **out, char *why,
                         size_t whylen)
{
	ecx_mc_writer *w = calloc(1, sizeof(*w));
	if (w == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	w->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (w->stop_fd < 0) {
		int e = errno;
		free(w);
		return ecx_why(why, whylen, ECX_EIO, "eventfd: %s",
		               strerror(e));
	}
	pthread_mutex_init(&w->lock, NULL);
	if (make_request(w, self_name ? self_name : "ecx-writer:1") != 0) {
		ecx_mc_writer_destroy(w);
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	}
	*out = w;
	return 0;
}

void ecx_mc_writer_shutdown(ecx_mc_writer *w)
{
	uint64_t one = 1;
	if (w == NULL)
		return;
	__atomic_store_n(&w->stopping, true, __ATOMIC_RELEASE);
	if (write(w->stop_fd, &one, sizeof(one)) < 0)
		ecx_warn(MOD, "writer shutdown: %s", strerror(errno));
}

void ecx_mc_writer_destroy(ecx_mc_writer *w)
{
	if (w == NULL)
		return;
	while (w->peers != NULL) {
		mc_peer *pe = w->peers;
		w->peers = pe->next;
		peer_free(pe);
	}
	close(w->stop_fd);
	free(w->request);
	pthread_mutex_destroy(&w->lock);
	free(w);
}

void ecx_mc_writer_stats_get(ecx_mc_writer *w, ecx_mc_writer_stats *out)
{
	out->handshakes = __atomic_load_n(&w->st.handshakes, __ATOMIC_RELAXED);
	out->connects = __atomic_load_n(&w->st.connects, __ATOMIC_RELAXED);
	out->writes = __atomic_load_n(&w->st.writes, __ATOMIC_RELAXED);
	out->bytes = __atomic_load_n(&w->st.bytes, __ATOMIC_RELAXED);
	out->rejected = __atomic_load_n(&w->st.rejected, __ATOMIC_RELAXED);
	out->failed = __atomic_load_n(&w->st.failed, __ATOMIC_RELAXED);
}
