/*
 * lane.c - the consumer's data lanes (TCP; wire.h, docs/protocol.md "The
 * data lane"): opened after a hello whose answer offers one, then read
 * without blocking by whoever waits for a load with a pull on it (the
 * caller of ecx_load_wait or ecx_load_test, a notified load's thread),
 * straight from the socket into the items' destinations. A pull asks for
 * its lane when its items make at least c->lane_min bytes.
 *
 * A lane that ends or breaks the protocol fails its connection (every
 * pull on it fails, the next load makes a new one); a load that
 * times out kills the lanes of its pulls before it returns
 * (cons_lane_kill), so no byte lands after. Locking: l->mu is held while
 * reading (never waited on with c->lock held); c->lock guards l->refs and
 * is taken inside l->mu.
 */
#include "consumer/consumer.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MOD "consumer"
/* How long a lane may take to open (connect, and the producer's answer
 * to its hello), added once to a connection's first load at most. */
#define LANE_OPEN_MS 200
/* The buffer a frame for a pull no longer waited for is read into. */
#define DRAIN_BUF (64u << 10)
/* The most one call reads before it returns to its caller's loop. */
#define READ_MAX ((uint64_t)4 << 20)

/* What a lane is reading: a frame's header, its data into the items'
 * destinations, a frame nobody waits for (dropped), a reply. */
enum { RD_HDR, RD_DATA, RD_DRAIN, RD_REPLY };

struct cons_lane {
	ecx_consumer *c;
	int fd;
	uint64_t conn;
	unsigned refs; /* under c->lock: its connection's, each reader's */
	pthread_mutex_t mu;
	bool stop; /* atomic: a kill waits for the reader; it stops now */
	/* under mu */
	bool dead;
	int rd;
	ecx_lane_hdr h;
	size_t hgot;
	uint64_t got;
	char *dst, *buf;
};

/* Data frames this process's consumers read from lanes (atomic): what
 * tests read to tell which way a pull's data came. */
uint64_t cons_lane_frames, cons_lanes_opened;

/* Connects to host:port (the producer's rendezvous host) within ms: the
 * socket, or -1. */
static int lane_connect(const char *address, unsigned port, int ms)
{
	char host[ECX_ADDR_MAX];
	const char *h =
	    strncmp(address, "tcp://", 6) == 0 ? address + 6 : address;
	const char *colon = strrchr(h, ':');
	if (colon == NULL || colon == h || (size_t)(colon - h) >= sizeof(host))
		return -1;
	memcpy(host, h, (size_t)(colon - h));
	host[colon - h] = '\0';
	if (host[0] == '[') {
		size_t hl = strlen(host);
		if (hl < 3 || host[hl - 1] != ']')
			return -1;
		memmove(host, host + 1, hl - 2);
		host[hl - 2] = '\0';
	}
	char ps[8];
	snprintf(ps, sizeof(ps), "%u", port);
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
	                         .ai_flags = AI_NUMERICSERV};
	struct addrinfo *ai = NULL;
	if (getaddrinfo(host, ps, &hints, &ai) != 0 || ai == NULL)
		return -1;
	int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd >= 0) {
		fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
		int err = 0;
		socklen_t el = sizeof(err);
		struct pollfd pf = {.fd = fd, .events = POLLOUT};
		if ((connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 &&
		     (errno != EINPROGRESS || poll(&pf, 1, ms) != 1 ||
		      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 ||
		      err != 0))) {
			close(fd);
			fd = -1;
		}
	}
	freeaddrinfo(ai);
	return fd;
}

/* Sends the hello and reads the producer's answer (the same bytes) within
 * ms: 0, or -1. */
static int lane_hello(int fd, const ecx_lane_hello *h, int ms)
{
	if (send(fd, h, sizeof(*h), MSG_NOSIGNAL | MSG_DONTWAIT) !=
	    (ssize_t)sizeof(*h))
		return -1;
	uint64_t until = ecx_now_ns() + (uint64_t)ms * 1000000u;
	ecx_lane_hello a;
	size_t got = 0;
	while (got < sizeof(a)) {
		uint64_t now = ecx_now_ns();
		if (now >= until)
			return -1;
		struct pollfd pf = {.fd = fd, .events = POLLIN};
		int r = poll(&pf, 1, (int)((until - now) / 1000000u) + 1);
		if (r < 0 && errno != EINTR)
			return -1;
		if (r <= 0)
			continue;
		ssize_t n =
		    recv(fd, (char *)&a + got, sizeof(a) - got, MSG_DONTWAIT);
		if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
			return -1;
		if (n > 0)
			got += (size_t)n;
	}
	return memcmp(&a, h, sizeof(a)) == 0 ? 0 : -1;
}

void cons_lane_open(ecx_consumer *c, pconn *pc, const ecx_zresp *z)
{
	if (c->lane_min == 0 || z->lane_port == 0 ||
	    pc->transport != ECX_TR_TCP)
		return;
	ecx_lane_hello h = {.magic = ECX_LANE_MAGIC,
	                    .version = ECX_LANE_VERSION,
	                    .conn = z->conn};
	memcpy(h.key, z->lane_key, sizeof(h.key));
	/* Tests only: a wrong key, which the producer must refuse. */
	if (getenv("ECX_TEST_LANE_BAD_KEY") != NULL)
		h.key[0] ^= 1;
	uint64_t t0 = ecx_now_ns();
	int fd = lane_connect(pc->address, z->lane_port, LANE_OPEN_MS);
	int left = LANE_OPEN_MS - (int)((ecx_now_ns() - t0) / 1000000u);
	if (fd >= 0 && (left <= 0 || lane_hello(fd, &h, left) != 0)) {
		close(fd);
		fd = -2;
	}
	if (fd < 0) {
		ecx_warn(MOD,
		         "data lane to %s (port %u) %s: its data goes as "
		         "active messages",
		         pc->address, z->lane_port,
		         fd == -1 ? "cannot be reached"
		                  : "refused, or not answered in time");
		return;
	}
	cons_lane *l = calloc(1, sizeof(*l));
	if (l == NULL) {
		close(fd);
		return;
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	l->c = c;
	l->fd = fd;
	l->conn = z->conn;
	l->refs = 1;
	pthread_mutex_init(&l->mu, NULL);
	/* pc is listed already (a placeholder): a lane's failure looks it
	 * up by its lane, under the lock. */
	pthread_mutex_lock(&c->lock);
	pc->lane = l;
	pthread_mutex_unlock(&c->lock);
	__atomic_add_fetch(&cons_lanes_opened, 1, __ATOMIC_RELAXED);
	ecx_debug(MOD, "data lane to %s open", pc->address);
}

static void lane_free(cons_lane *l)
{
	if (l->fd >= 0)
		close(l->fd);
	free(l->buf);
	pthread_mutex_destroy(&l->mu);
	free(l);
}

cons_lane *cons_lane_ref_locked(cons_lane *l)
{
	l->refs++;
	return l;
}

void cons_lane_put(ecx_consumer *c, cons_lane *l)
{
	pthread_mutex_lock(&c->lock);
	bool last = --l->refs == 0;
	pthread_mutex_unlock(&c->lock);
	if (last)
		lane_free(l);
}

/* Ends what l was reading: a data frame's receive fails (err), so its
 * pull ends. Then l reads nothing more. Called with l->mu, not c->lock. */
static void lane_stop(cons_lane *l, int err)
{
	if (l->rd == RD_DATA)
		cons_data_end(l->c, l->h.req, l->h.first, l->h.count, err);
	free(l->buf);
	l->buf = NULL;
	l->rd = RD_HDR;
	l->dead = true;
	shutdown(l->fd, SHUT_RDWR);
}

void cons_lane_kill(cons_lane *l)
{
	if (l == NULL)
		return;
	/* A thread reading it stops at its next read (lane_read). */
	__atomic_store_n(&l->stop, true, __ATOMIC_RELEASE);
	pthread_mutex_lock(&l->mu);
	if (!l->dead)
		lane_stop(l, ECX_ETIMEDOUT);
	pthread_mutex_unlock(&l->mu);
}

/* l ended or broke the protocol (why): its connection fails, and every
 * pull on it (zombies end: nothing of theirs can land any more, the lane
 * being dead and active messages for a pull not waited for refused); the
 * next load makes a new connection. Called with neither lock. */
static void lane_fail(cons_lane *l, const char *why)
{
	ecx_consumer *c = l->c;
	pthread_mutex_lock(&l->mu);
	bool was = l->dead;
	if (!was)
		lane_stop(l, ECX_ECLOSED);
	pthread_mutex_unlock(&l->mu);
	if (was)
		return;
	pthread_mutex_lock(&c->lock);
	pconn *pc = c->conns;
	while (pc != NULL && pc->lane != l)
		pc = pc->next;
	if (pc != NULL) {
		ecx_warn(MOD, "connection to producer %s failed: data lane: %s",
		         pc->address, why);
		cons_pconn_fail_locked(c, pc, ECX_ECLOSED, why);
	}
	pthread_mutex_unlock(&c->lock);
}

/* Reads what l's socket holds, frame by frame, without blocking: how many
 * reads took bytes, or -1 where l ended or broke the protocol (*why).
 * Called with l->mu. */
static int lane_read(cons_lane *l, const char **why)
{
	int did = 0;
	uint64_t took = 0;
	/* Bounded: a reader returns to its own load (whose deadline may
	 * pass) after READ_MAX, and at once when a kill waits. */
	while (!l->dead && took < READ_MAX &&
	       !__atomic_load_n(&l->stop, __ATOMIC_ACQUIRE)) {
		void *at;
		size_t want;
		switch (l->rd) {
		case RD_HDR:
			at = (char *)&l->h + l->hgot;
			want = sizeof(l->h) - l->hgot;
			break;
		case RD_DATA:
			at = l->dst + l->got;
			want = l->h.len - l->got;
			break;
		case RD_DRAIN:
			at = l->buf;
			want = l->h.len - l->got < DRAIN_BUF ? l->h.len - l->got
			                                     : DRAIN_BUF;
			break;
		default:
			at = l->buf + l->got;
			want = l->h.len - l->got;
			break;
		}
		ssize_t r = want > 0 ? recv(l->fd, at, want, MSG_DONTWAIT) : 0;
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return did;
		if (want > 0 && r <= 0) {
			*why = r == 0 ? "the producer closed it"
			              : "its socket failed";
			return -1;
		}
		did++;
		took += (uint64_t)r;
		if (l->rd == RD_HDR) {
			l->hgot += (size_t)r;
			if (l->hgot < sizeof(l->h))
				continue;
			l->hgot = 0;
			l->got = 0;
			if (l->h.magic != ECX_LANE_MAGIC ||
			    (l->h.kind != ECX_LANE_DATA &&
			     l->h.kind != ECX_LANE_REPLY) ||
			    (l->h.kind == ECX_LANE_REPLY &&
			     l->h.len > ECX_LANE_REPLY_MAX)) {
				*why = "a frame it cannot read";
				return -1;
			}
			if (l->h.kind == ECX_LANE_REPLY) {
				l->buf = malloc(l->h.len + 1);
				l->rd = RD_REPLY;
			} else {
				__atomic_add_fetch(&cons_lane_frames, 1,
				                   __ATOMIC_RELAXED);
				l->dst =
				    l->h.len == (size_t)l->h.len
				        ? cons_data_begin(
				              l->c, l, l->h.req, l->h.first,
				              l->h.count, (size_t)l->h.len)
				        : NULL;
				l->rd = RD_DATA;
				if (l->dst == NULL) {
					/* Not a pull waited for (or not
					 * where its items go): dropped. */
					ecx_debug(MOD,
					          "lane data for pull %llu "
					          "dropped (%llu bytes)",
					          (unsigned long long)l->h.req,
					          (unsigned long long)l->h.len);
					l->buf = malloc(DRAIN_BUF);
					l->rd = RD_DRAIN;
				}
			}
			if ((l->rd == RD_REPLY || l->rd == RD_DRAIN) &&
			    l->buf == NULL) {
				l->rd = RD_HDR;
				*why = "out of memory";
				return -1;
			}
		} else {
			l->got += (uint64_t)r;
		}
		if (l->got < l->h.len && l->rd == RD_DATA && l->c->integrity &&
		    l->h.count == 1) {
			/* An item's piece in: its waiting caller hashes it
			 * now, while it sits in the CPU's caches, before
			 * this reads on. */
			cons_data_piece(l->c, l, l->h.req, l->h.first, l->got);
			return did;
		}
		if (l->got < l->h.len)
			continue;
		/* A frame is whole. */
		if (l->rd == RD_DATA)
			cons_data_end(l->c, l->h.req, l->h.first, l->h.count,
			              0);
		else if (l->rd == RD_REPLY)
			cons_reply_take(l->c, l, l->h.req, l->buf,
			                (size_t)l->h.len);
		if (l->rd != RD_DATA) {
			free(l->buf);
			l->buf = NULL;
		}
		l->rd = RD_HDR;
	}
	return did;
}

static int lanes_read(cons_lane **lanes, size_t n)
{
	int did = 0;
	for (size_t i = 0; i < n; i++) {
		cons_lane *l = lanes[i];
		if (pthread_mutex_trylock(&l->mu) != 0)
			continue; /* another thread reads it now */
		const char *why = NULL;
		int r = l->dead ? 0 : lane_read(l, &why);
		pthread_mutex_unlock(&l->mu);
		if (r < 0)
			lane_fail(l, why);
		else
			did += r;
	}
	return did;
}

size_t cons_load_lanes(ecx_load *l, cons_lane **out, size_t cap)
{
	ecx_consumer *c = l->c;
	size_t n = 0;
	pthread_mutex_lock(&c->lock);
	for (size_t k = 0; k < l->npulls && n < cap; k++) {
		pull *p = l->pulls[k];
		if (!p->lane || __atomic_load_n(&p->done, __ATOMIC_ACQUIRE) ||
		    p->pc == NULL || p->pc->lane == NULL)
			continue;
		cons_lane *ln = p->pc->lane;
		bool seen = false;
		for (size_t i = 0; i < n && !seen; i++)
			seen = out[i] == ln;
		if (!seen) {
			ln->refs++;
			out[n++] = ln;
		}
	}
	pthread_mutex_unlock(&c->lock);
	return n;
}

int cons_load_read_lanes(ecx_load *l)
{
	if (!__atomic_load_n(&l->has_lane, __ATOMIC_ACQUIRE))
		return 0;
	/* A lane per pull at most: on the stack for a load from a few
	 * producers. Without memory for more, the first 16 now. */
	cons_lane *buf[16], **lanes = NULL;
	size_t cap = 16;
	if (l->npulls > cap)
		lanes = malloc(l->npulls * sizeof(*lanes));
	if (lanes != NULL)
		cap = l->npulls;
	else
		lanes = buf;
	size_t n = cons_load_lanes(l, lanes, cap);
	int did = lanes_read(lanes, n);
	for (size_t i = 0; i < n; i++)
		cons_lane_put(l->c, lanes[i]);
	if (lanes != buf)
		free(lanes);
	return did;
}

int cons_lane_min(bool data_am, uint64_t *out, char *why, size_t whylen)
{
	const char *on = getenv("ECX_TCP_LANE");
	const char *min = getenv("ECX_TCP_LANE_MIN");
	*out = 0;
	if (on != NULL && on[0] != '\0' && strcmp(on, "0") != 0 &&
	    strcmp(on, "1") != 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "ECX_TCP_LANE=%s: use 1 (the default) or 0", on);
	uint64_t v = ECX_LANE_MIN_DEFAULT;
	char w[200];
	if (min != NULL && min[0] != '\0' &&
	    (core_size_parse(min, &v, w, sizeof(w)) != 0 || v == 0))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "ECX_TCP_LANE_MIN=%s: %s", min,
		               v == 0 ? "a size of at least 1 byte" : w);
	if (data_am && (on == NULL || strcmp(on, "0") != 0))
		*out = v;
	return 0;
}
