/*
 * receiver_priv.h - what the receiver's files share: its state, the
 * handshake connections (recv_hs.c) and the helpers of the thread's
 * sockets (recv_sock.c, used by receiver.c and recv_hs.c). Everything here
 * is the receiver thread's, except what ecx_mc_recv.lock guards
 * (reservations, buffers, stats).
 */
#ifndef ECX_MOONCAKE_RECEIVER_PRIV_H
#define ECX_MOONCAKE_RECEIVER_PRIV_H

#include "mooncake/frame.h"
#include "mooncake/receiver.h"

#include <pthread.h>
#include <stdbool.h>

#define MOD "mooncake"

/* What an epoll event names: a listener, a connection, or the stop. */
enum { K_STOP, K_HS_LISTEN, K_DATA_LISTEN, K_HS, K_DATA };

typedef struct tag {
	int kind;
} tag;

typedef struct res {
	uint64_t id, addr, len, expiry_ns, landed;
	unsigned busy; /* recvs into it under way */
	bool dead;     /* released: nothing more lands */
	/* A hashed reservation's XXH3 state (NULL: not hashed) of
	 * [addr, addr + hashed), fed by the thread with each recv that
	 * lands at addr + hashed, while busy; broken once a recv landed
	 * anywhere else (a gap, or over bytes already hashed), or bytes
	 * landed in its range through another reservation. */
	void *xs;
	uint64_t hashed;
	bool broken;
} res;

typedef struct buf {
	uint64_t addr, len;
} buf;

/* A handshake connection: one request, one answer. */
enum { HS_LEN, HS_BODY, HS_WRITE, HS_DRAIN };
typedef struct hsconn {
	tag t;
	int fd;
	int state;
	uint64_t deadline_ms;
	uint8_t len[ECX_MC_HS_LEN_BYTES];
	size_t have;
	uint64_t need;
	uint8_t *body;
	size_t cap;
	uint8_t *out;
	size_t outlen, outoff;
} hsconn;

/* A data connection: headers, bodies, statuses in turn. */
enum { D_HDR, D_LAND, D_DROP, D_STATUS };
typedef struct dconn {
	tag t;
	int fd;
	int state;
	uint8_t hdr[ECX_MC_HDR_LEN];
	size_t have;
	ecx_mc_hdr h;
	uint64_t res_id, got;
	uint8_t st[ECX_MC_STATUS_LEN];
	size_t st_off;
	bool v2, reject, close_after;
	uint64_t last_ms;
} dconn;

struct ecx_mc_recv {
	pthread_mutex_t lock;
	pthread_cond_t cv; /* a recv into a released reservation ended */
	res *res;
	size_t nres, capres;
	uint64_t next_id;
	buf *bufs;
	size_t nbufs, capbufs;
	ecx_mc_recv_stats st;
	/* The thread's own from here. */
	pthread_t thread;
	bool started;
	int ep, stopfd, hs_fd, data_fd;
	tag stop_tag, hs_tag, data_tag;
	uint16_t hs_port, data_port;
	hsconn *hs[ECX_MC_HS_CONNS_MAX];
	dconn *dc[ECX_MC_DATA_CONNS_MAX];
	uint8_t scratch[1u << 16];
	char session[ECX_MC_NAME_MAX];
};

#define COUNT(r, f)                               \
	do {                                      \
		pthread_mutex_lock(&(r)->lock);   \
		(r)->st.f++;                      \
		pthread_mutex_unlock(&(r)->lock); \
	} while (0)

/* recv_sock.c: a listening socket at host (NULL or "": every address,
 * dual-stack), non-blocking, with its port in *port: the descriptor, or a
 * negative ecx error with why; epoll registrations (a connection leaves
 * epoll before its close); TCP_NODELAY. */
int recv_listen(const char *host, uint16_t *port, char *why, size_t whylen);
void recv_ep_add(ecx_mc_recv *r, int fd, uint32_t ev, tag *t);
void recv_ep_mod(ecx_mc_recv *r, int fd, uint32_t ev, tag *t);
void recv_ep_close(ecx_mc_recv *r, int fd);
void recv_nodelay(int fd);

/* recv_hs.c: the handshake listener's accepts, a connection's events, and
 * its end (refused: counted as such). */
void recv_hs_accept(ecx_mc_recv *r);
void recv_hs_event(ecx_mc_recv *r, hsconn *h);
void recv_hs_close(ecx_mc_recv *r, hsconn *h, bool refused);

#endif /* ECX_MOONCAKE_RECEIVER_PRIV_H */
