/*
 * recv_hs.c - the receiver's handshake server: one request per
 * connection (metadata, probe, notify), answered, the write side shut,
 * then closed when the client closes; bounded in time and in number.
 */
#define _GNU_SOURCE /* accept4 */
#include "mooncake/receiver_priv.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

void recv_hs_close(ecx_mc_recv *r, hsconn *h, bool refused)
{
	for (size_t i = 0; i < ECX_MC_HS_CONNS_MAX; i++)
		if (r->hs[i] == h)
			r->hs[i] = NULL;
	recv_ep_close(r, h->fd);
	if (refused)
		COUNT(r, hs_refused);
	free(h->body);
	free(h->out);
	free(h);
}

/* The metadata answer: this session, its data port, the buffers. */
static char *metadata(ecx_mc_recv *r, size_t *len)
{
	ecx_mc_segment s;
	memset(&s, 0, sizeof(s));
	ecx_strlcpy(s.name, r->session, sizeof(s.name));
	s.tcp_data_port = r->data_port;
	s.tcp_proto_version = 2;
	pthread_mutex_lock(&r->lock);
	s.buffers = calloc(r->nbufs + 1, sizeof(*s.buffers));
	if (s.buffers != NULL) {
		s.n_buffers = r->nbufs;
		for (size_t i = 0; i < r->nbufs; i++)
			s.buffers[i] =
			    (ecx_mc_buffer){.name = r->session,
			                    .addr = r->bufs[i].addr,
			                    .length = r->bufs[i].len};
	}
	pthread_mutex_unlock(&r->lock);
	char *out = s.buffers != NULL ? ecx_mc_segment_encode(&s, len) : NULL;
	free(s.buffers);
	return out;
}

/* A whole request in h->body: the answer to send, or false to close. */
static bool hs_answer(ecx_mc_recv *r, hsconn *h)
{
	uint8_t type;
	const char *json;
	size_t jlen;
	char why[160];
	if (ecx_mc_hs_body_decode(h->body, h->need, &type, &json, &jlen, why,
	                          sizeof(why)) != 0) {
		ecx_debug(MOD, "handshake refused: %s", why);
		return false;
	}
	/* Mooncake's server parses every request and closes on bad JSON. */
	cJSON *o = cJSON_ParseWithLength(json, jlen);
	if (o == NULL) {
		ecx_debug(MOD, "handshake refused: its JSON does not parse");
		return false;
	}
	cJSON_Delete(o);
	char *ans = NULL;
	size_t alen = 0;
	if (type == ECX_MC_HS_METADATA) {
		ans = metadata(r, &alen);
	} else if (type == ECX_MC_HS_PROBE) {
		ans = strdup(ECX_MC_PROBE_REPLY);
		alen = ans ? strlen(ans) : 0;
	} else if (type == ECX_MC_HS_NOTIFY) {
		ans = strdup(ECX_MC_NOTIFY_REPLY);
		alen = ans ? strlen(ans) : 0;
	} else {
		ecx_debug(MOD,
		          "handshake refused: type %u (RDMA queue pairs) "
		          "is not spoken here",
		          (unsigned)type);
		return false;
	}
	if (ans == NULL)
		return false;
	h->out = ecx_mc_hs_frame_encode(type, ans, alen, &h->outlen);
	free(ans);
	if (h->out == NULL)
		return false;
	h->outoff = 0;
	h->state = HS_WRITE;
	return true;
}

void recv_hs_event(ecx_mc_recv *r, hsconn *h)
{
	for (;;) {
		if (h->state == HS_WRITE) {
			ssize_t n = send(h->fd, h->out + h->outoff,
			                 h->outlen - h->outoff, MSG_NOSIGNAL);
			if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
				recv_ep_mod(r, h->fd, EPOLLOUT, &h->t);
				return;
			}
			if (n <= 0) {
				recv_hs_close(r, h, true);
				return;
			}
			h->outoff += (size_t)n;
			if (h->outoff < h->outlen)
				continue;
			/* Answered: the write side closes, and the client
			 * closes the connection. */
			COUNT(r, hs_served);
			shutdown(h->fd, SHUT_WR);
			h->state = HS_DRAIN;
			recv_ep_mod(r, h->fd, EPOLLIN, &h->t);
			continue;
		}
		uint8_t *dst;
		size_t want;
		if (h->state == HS_LEN) {
			dst = h->len + h->have;
			want = sizeof(h->len) - h->have;
		} else if (h->state == HS_BODY) {
			if (h->have == h->cap) {
				size_t cap = h->cap ? h->cap * 4 : 4096;
				if (cap > h->need)
					cap = h->need;
				uint8_t *b = realloc(h->body, cap);
				if (b == NULL) {
					recv_hs_close(r, h, true);
					return;
				}
				h->body = b;
				h->cap = cap;
			}
			dst = h->body + h->have;
			want = h->cap - h->have;
		} else {
			dst = r->scratch;
			want = 64;
		}
		ssize_t n = recv(h->fd, dst, want, 0);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		if (n <= 0) {
			recv_hs_close(r, h, h->state != HS_DRAIN);
			return;
		}
		if (h->state == HS_DRAIN)
			continue;
		h->have += (size_t)n;
		if (h->state == HS_LEN && h->have == sizeof(h->len)) {
			char why[160];
			if (ecx_mc_hs_len_decode(h->len, &h->need, why,
			                         sizeof(why)) != 0) {
				ecx_debug(MOD, "handshake refused: %s", why);
				recv_hs_close(r, h, true);
				return;
			}
			h->state = HS_BODY;
			h->have = 0;
		} else if (h->state == HS_BODY && h->have == h->need) {
			if (!hs_answer(r, h)) {
				recv_hs_close(r, h, true);
				return;
			}
		}
	}
}

void recv_hs_accept(ecx_mc_recv *r)
{
	for (;;) {
		int fd =
		    accept4(r->hs_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		size_t slot = ECX_MC_HS_CONNS_MAX;
		for (size_t i = 0; i < ECX_MC_HS_CONNS_MAX; i++)
			if (r->hs[i] == NULL) {
				slot = i;
				break;
			}
		hsconn *h =
		    slot < ECX_MC_HS_CONNS_MAX ? calloc(1, sizeof(*h)) : NULL;
		if (h == NULL) {
			/* Over the cap: a flood is turned away, the
			 * handshakes under way go on. */
			close(fd);
			COUNT(r, hs_refused);
			continue;
		}
		recv_nodelay(fd);
		h->t.kind = K_HS;
		h->fd = fd;
		h->deadline_ms = ecx_now_ms() + ECX_MC_HS_TIMEOUT_MS;
		r->hs[slot] = h;
		recv_ep_add(r, fd, EPOLLIN, &h->t);
	}
}
