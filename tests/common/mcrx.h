/* mcrx.h - a Mooncake-wire receiver for the C tests, on real sockets
 * bound to loopback port 0: a handshake server as Mooncake's
 * SocketHandShakePlugin serves one (transfer_metadata_plugin.cpp: one frame
 * in, the metadata frame out, shutdown of the write side, wait for the
 * client's close) and a data port as its ServerSession
 * (tcp_transport_session_impl.h: header, range check against the one
 * registered buffer, body, 8-byte status; a rejection closes the
 * connection). Modes make it refuse, stall or answer garbage. The test
 * includes cmocka before this header. */
#ifndef ECX_TEST_MCRX_H
#define ECX_TEST_MCRX_H

#include "mooncake/frame.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { RX_OK, RX_REJECT, RX_STALL, RX_GARBAGE_META, RX_BAD_STATUS };

#define RX_CONNS 32

typedef struct rx {
	int family;
	int hs_lfd, data_lfd;
	uint16_t hs_port, data_port;
	pthread_t hs_thr, data_thr;
	pthread_t conn_thr[RX_CONNS];
	int conn_fd[RX_CONNS];
	int nconn;
	uint8_t *mem;
	size_t memlen;
	int version;
	int mode;
	int stop, data_stop;
	/* counters */
	int handshakes, accepts, headers, writes, rejects;
	char name[64];
} rx;

static inline int time_scale(void)
{
	const char *s = getenv("ECX_TEST_TIME_SCALE");
	int v = s ? atoi(s) : 1;
	return v > 0 ? v : 1;
}

static inline int listen_on(int family, uint16_t *port)
{
	int fd = socket(family, SOCK_STREAM, 0);
	assert_true(fd >= 0);
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_storage ss;
	memset(&ss, 0, sizeof(ss));
	socklen_t sl;
	if (family == AF_INET) {
		struct sockaddr_in *a = (struct sockaddr_in *)&ss;
		a->sin_family = AF_INET;
		a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		sl = sizeof(*a);
	} else {
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
		a->sin6_family = AF_INET6;
		a->sin6_addr = in6addr_loopback;
		sl = sizeof(*a);
	}
	if (bind(fd, (struct sockaddr *)&ss, sl) != 0) {
		close(fd);
		return -1;
	}
	assert_int_equal(listen(fd, 64), 0);
	sl = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sl);
	*port =
	    ntohs(family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
	                            : ((struct sockaddr_in6 *)&ss)->sin6_port);
	return fd;
}

/* accept, giving up every 50 ms to look at *stop. */
static inline int accept_or_stop(int lfd, int *stop)
{
	while (!__atomic_load_n(stop, __ATOMIC_ACQUIRE)) {
		struct pollfd pf = {.fd = lfd, .events = POLLIN};
		if (poll(&pf, 1, 50) > 0)
			return accept(lfd, NULL, NULL);
	}
	return -1;
}

static inline bool read_n(int fd, void *buf, size_t n, int *stop)
{
	size_t got = 0;
	while (got < n) {
		if (__atomic_load_n(stop, __ATOMIC_ACQUIRE))
			return false;
		struct pollfd pf = {.fd = fd, .events = POLLIN};
		if (poll(&pf, 1, 50) <= 0)
			continue;
		ssize_t r = recv(fd, (char *)buf + got, n - got, 0);
		if (r <= 0)
			return false;
		got += (size_t)r;
	}
	return true;
}

static inline void *hs_main(void *arg)
{
	rx *x = arg;
	for (;;) {
		int fd = accept_or_stop(x->hs_lfd, &x->stop);
		if (fd < 0)
			return NULL;
		uint8_t lb[8];
		uint64_t blen = 0;
		uint8_t *body = NULL;
		if (read_n(fd, lb, 8, &x->stop) &&
		    ecx_mc_hs_len_decode(lb, &blen, NULL, 0) == 0 &&
		    (body = malloc(blen)) != NULL &&
		    read_n(fd, body, blen, &x->stop) && body[0] == 1) {
			ecx_mc_buffer b = {x->name, (uint64_t)(uintptr_t)x->mem,
			                   x->memlen};
			ecx_mc_segment s;
			memset(&s, 0, sizeof(s));
			strcpy(s.name, x->name);
			s.tcp_data_port = x->data_port;
			s.tcp_proto_version = (uint8_t)x->version;
			s.n_buffers = 1;
			s.buffers = &b;
			size_t jl = 0, fl = 0;
			char *json = x->mode == RX_GARBAGE_META
			                 ? strdup("{\"name\": nope")
			                 : ecx_mc_segment_encode(&s, &jl);
			if (x->mode == RX_GARBAGE_META)
				jl = strlen(json);
			uint8_t *f = ecx_mc_hs_frame_encode(1, json, jl, &fl);
			assert_int_equal(send(fd, f, fl, MSG_NOSIGNAL),
			                 (ssize_t)fl);
			free(f);
			free(json);
			__atomic_fetch_add(&x->handshakes, 1, __ATOMIC_RELAXED);
			shutdown(fd, SHUT_WR);
			char c;
			struct pollfd pf = {.fd = fd, .events = POLLIN};
			poll(&pf, 1, 2000);
			(void)!recv(fd, &c, 1, 0);
		}
		free(body);
		close(fd);
	}
}

typedef struct conn_arg {
	rx *x;
	int fd;
} conn_arg;

static inline void *conn_main(void *arg)
{
	conn_arg *ca = arg;
	rx *x = ca->x;
	int fd = ca->fd;
	free(ca);
	if (x->mode == RX_STALL) {
		while (!__atomic_load_n(&x->data_stop, __ATOMIC_ACQUIRE))
			usleep(10000);
		return NULL;
	}
	uint8_t hb[ECX_MC_HDR_LEN];
	while (read_n(fd, hb, sizeof(hb), &x->data_stop)) {
		ecx_mc_hdr h;
		ecx_mc_hdr_decode(hb, &h);
		__atomic_fetch_add(&x->headers, 1, __ATOMIC_RELAXED);
		uint8_t sb[8];
		uint64_t base = (uint64_t)(uintptr_t)x->mem;
		if (x->mode == RX_REJECT || !ecx_mc_hdr_is_write(&h) ||
		    !ecx_mc_range_within(h.addr, h.size, base, x->memlen)) {
			ecx_mc_status_encode(ECX_MC_STATUS_REJECTED, sb);
			(void)!send(fd, sb, 8, MSG_NOSIGNAL);
			__atomic_fetch_add(&x->rejects, 1, __ATOMIC_RELAXED);
			break;
		}
		if (!read_n(fd, (void *)(uintptr_t)h.addr, h.size,
		            &x->data_stop))
			break;
		ecx_mc_status_encode(x->mode == RX_BAD_STATUS
		                         ? 0x1122334455667788ull
		                         : ECX_MC_STATUS_OK,
		                     sb);
		(void)!send(fd, sb, 8, MSG_NOSIGNAL);
		__atomic_fetch_add(&x->writes, 1, __ATOMIC_RELAXED);
	}
	return NULL;
}

static inline void *data_main(void *arg)
{
	rx *x = arg;
	for (;;) {
		int fd = accept_or_stop(x->data_lfd, &x->data_stop);
		if (fd < 0)
			return NULL;
		__atomic_fetch_add(&x->accepts, 1, __ATOMIC_RELAXED);
		assert_true(x->nconn < RX_CONNS);
		conn_arg *ca = malloc(sizeof(*ca));
		ca->x = x;
		ca->fd = fd;
		x->conn_fd[x->nconn] = fd;
		assert_int_equal(
		    pthread_create(&x->conn_thr[x->nconn], NULL, conn_main, ca),
		    0);
		x->nconn++;
	}
}

static inline void rx_data_start(rx *x)
{
	x->data_stop = 0;
	x->nconn = 0;
	x->data_lfd = listen_on(x->family, &x->data_port);
	assert_true(x->data_lfd >= 0);
	assert_int_equal(pthread_create(&x->data_thr, NULL, data_main, x), 0);
}

static inline void rx_data_stop(rx *x)
{
	__atomic_store_n(&x->data_stop, 1, __ATOMIC_RELEASE);
	pthread_join(x->data_thr, NULL);
	for (int i = 0; i < x->nconn; i++) {
		pthread_join(x->conn_thr[i], NULL);
		close(x->conn_fd[i]);
	}
	close(x->data_lfd);
}

/* Starts a receiver; false when the family cannot be bound here. */
static inline bool rx_start(rx *x, int family, size_t memlen, int version,
                            int mode)
{
	memset(x, 0, sizeof(*x));
	x->family = family;
	x->version = version;
	x->mode = mode;
	x->memlen = memlen;
	x->mem = calloc(1, memlen);
	assert_non_null(x->mem);
	x->hs_lfd = listen_on(family, &x->hs_port);
	if (x->hs_lfd < 0) {
		free(x->mem);
		return false;
	}
	snprintf(x->name, sizeof(x->name),
	         family == AF_INET ? "127.0.0.1:%u" : "[::1]:%u",
	         (unsigned)x->hs_port);
	rx_data_start(x);
	assert_int_equal(pthread_create(&x->hs_thr, NULL, hs_main, x), 0);
	return true;
}

static inline void rx_stop(rx *x)
{
	rx_data_stop(x);
	__atomic_store_n(&x->stop, 1, __ATOMIC_RELEASE);
	pthread_join(x->hs_thr, NULL);
	close(x->hs_lfd);
	free(x->mem);
}

#endif /* ECX_TEST_MCRX_H */
