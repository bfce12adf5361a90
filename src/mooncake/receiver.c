/*
 * receiver.c - the handshake server and data port of a consumer's
 * Mooncake session (receiver.h says what it accepts), on one thread with
 * epoll over non-blocking sockets.
 */
#define _GNU_SOURCE
#include "mooncake/receiver_priv.h"

#include <cjson/cJSON.h>
#include <xxhash.h>
#ifdef ECX_HAVE_XXH3_DISPATCH
#include <xxh_x86dispatch.h> /* XXH3 with the widest vectors the CPU has */
#endif

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- tables (under r->lock) ---- */

static res *res_find(ecx_mc_recv *r, uint64_t id)
{
	for (size_t i = 0; i < r->nres; i++)
		if (r->res[i].id == id)
			return &r->res[i];
	return NULL;
}

/* The reservation that holds all of [addr, addr + size): one that has not
 * expired at now where there is one (an expired one that overlaps it, not
 * yet released, must not turn its writes away), else an expired one, else
 * NULL. */
static res *res_cover(ecx_mc_recv *r, uint64_t addr, uint64_t size,
                      uint64_t now)
{
	res *expired = NULL;
	for (size_t i = 0; i < r->nres; i++) {
		res *x = &r->res[i];
		if (x->dead ||
		    !ecx_mc_range_within(addr, size, x->addr, x->len))
			continue;
		if (now < x->expiry_ns)
			return x;
		if (expired == NULL)
			expired = x;
	}
	return expired;
}

/* Bytes [at, at + n) are to land through x: every other reservation they
 * overlap has its memory changed by other than its own writes, so its
 * hash (if any) is void. Released ones still in the table too: their
 * release has not taken its hash yet. O(nres), as res_cover. */
static void res_break_others(ecx_mc_recv *r, const res *x, uint64_t at,
                             uint64_t n)
{
	for (size_t i = 0; i < r->nres; i++) {
		res *o = &r->res[i];
		if (o != x && at < o->addr + o->len && o->addr < at + n)
			o->broken = true;
	}
}

int ecx_mc_recv_buffer_add(ecx_mc_recv *r, uint64_t addr, uint64_t len)
{
	if (len == 0 || addr == 0)
		return 0;
	pthread_mutex_lock(&r->lock);
	int rc = 0;
	if (r->nbufs == r->capbufs) {
		size_t cap = r->capbufs ? r->capbufs * 2 : 16;
		buf *b = realloc(r->bufs, cap * sizeof(*b));
		if (b == NULL)
			rc = ECX_ENOMEM;
		else {
			r->bufs = b;
			r->capbufs = cap;
		}
	}
	if (rc == 0)
		r->bufs[r->nbufs++] = (buf){addr, len};
	pthread_mutex_unlock(&r->lock);
	return rc;
}

void ecx_mc_recv_buffer_remove(ecx_mc_recv *r, uint64_t addr)
{
	pthread_mutex_lock(&r->lock);
	for (size_t i = 0; i < r->nbufs; i++)
		if (r->bufs[i].addr == addr) {
			r->bufs[i] = r->bufs[--r->nbufs];
			break;
		}
	pthread_mutex_unlock(&r->lock);
}

static uint64_t reserve(ecx_mc_recv *r, uint64_t addr, uint64_t len,
                        uint64_t expiry_ns, bool hashed)
{
	if (len == 0 || addr + len < addr)
		return 0;
	XXH3_state_t *xs = NULL;
	if (hashed) {
		if ((xs = XXH3_createState()) == NULL)
			return 0;
		XXH3_64bits_reset(xs);
	}
	uint64_t id = 0;
	pthread_mutex_lock(&r->lock);
	if (r->nres == r->capres) {
		size_t cap = r->capres ? r->capres * 2 : 64;
		res *n = realloc(r->res, cap * sizeof(*n));
		if (n != NULL) {
			r->res = n;
			r->capres = cap;
		}
	}
	if (r->nres < r->capres) {
		id = ++r->next_id;
		r->res[r->nres++] = (res){.id = id,
		                          .addr = addr,
		                          .len = len,
		                          .expiry_ns = expiry_ns,
		                          .xs = xs};
	}
	pthread_mutex_unlock(&r->lock);
	if (id == 0)
		XXH3_freeState(xs);
	return id;
}

uint64_t ecx_mc_recv_reserve(ecx_mc_recv *r, uint64_t addr, uint64_t len,
                             uint64_t expiry_ns)
{
	return reserve(r, addr, len, expiry_ns, false);
}

uint64_t ecx_mc_recv_reserve_hashed(ecx_mc_recv *r, uint64_t addr, uint64_t len,
                                    uint64_t expiry_ns)
{
	return reserve(r, addr, len, expiry_ns, true);
}

bool ecx_mc_recv_extend(ecx_mc_recv *r, uint64_t id, uint64_t expiry_ns)
{
	pthread_mutex_lock(&r->lock);
	res *x = res_find(r, id);
	bool found = x != NULL && !x->dead;
	if (found)
		x->expiry_ns = expiry_ns;
	pthread_mutex_unlock(&r->lock);
	return found;
}

uint64_t ecx_mc_recv_landed(ecx_mc_recv *r, uint64_t id)
{
	pthread_mutex_lock(&r->lock);
	res *x = res_find(r, id);
	uint64_t n = x != NULL ? x->landed : 0;
	pthread_mutex_unlock(&r->lock);
	return n;
}

uint64_t ecx_mc_recv_release_hashed(ecx_mc_recv *r, uint64_t id, uint64_t *xxh3,
                                    bool *whole)
{
	*whole = false;
	pthread_mutex_lock(&r->lock);
	res *x = res_find(r, id);
	if (x == NULL) {
		pthread_mutex_unlock(&r->lock);
		return 0;
	}
	x->dead = true;
	/* The thread checks dead before each recv into the range: what is
	 * under way now is one non-blocking recv (and its hashing). */
	while ((x = res_find(r, id))->busy > 0)
		pthread_cond_wait(&r->cv, &r->lock);
	uint64_t n = x->landed;
	XXH3_state_t *xs = x->xs;
	*whole = xs != NULL && !x->broken && x->hashed == x->len;
	*x = r->res[--r->nres];
	pthread_mutex_unlock(&r->lock);
	if (*whole)
		*xxh3 = XXH3_64bits_digest(xs);
	XXH3_freeState(xs);
	return n;
}

uint64_t ecx_mc_recv_release(ecx_mc_recv *r, uint64_t id)
{
	uint64_t h;
	bool whole;
	return ecx_mc_recv_release_hashed(r, id, &h, &whole);
}

void ecx_mc_recv_stats_get(ecx_mc_recv *r, ecx_mc_recv_stats *out)
{
	pthread_mutex_lock(&r->lock);
	*out = r->st;
	pthread_mutex_unlock(&r->lock);
}

/* ---- data ---- */

static void d_close(ecx_mc_recv *r, dconn *d, bool cut)
{
	for (size_t i = 0; i < ECX_MC_DATA_CONNS_MAX; i++)
		if (r->dc[i] == d)
			r->dc[i] = NULL;
	recv_ep_close(r, d->fd);
	if (cut)
		COUNT(r, cut);
	free(d);
}

/* Sends d's status (v2) and goes on to the next header, or closes; returns
 * false when d is gone. */
static bool d_status(ecx_mc_recv *r, dconn *d, uint64_t status)
{
	if (!d->v2) {
		if (d->close_after) {
			d_close(r, d, false);
			return false;
		}
		d->state = D_HDR;
		d->have = 0;
		return true;
	}
	ecx_mc_status_encode(status, d->st);
	d->st_off = 0;
	d->state = D_STATUS;
	return true;
}

/* Header complete: decides what becomes of its body. */
static bool d_header(ecx_mc_recv *r, dconn *d)
{
	ecx_mc_hdr_decode(d->hdr, &d->h);
	d->v2 = ecx_mc_hdr_v2(&d->h);
	d->got = 0;
	d->res_id = 0;
	d->reject = false;
	d->close_after = false;
	uint64_t now = ecx_now_ns();
	pthread_mutex_lock(&r->lock);
	if (!ecx_mc_hdr_is_write(&d->h)) {
		r->st.rej_read++;
		d->close_after = true; /* a READ's answer would be its bytes */
	} else if (d->h.size == 0 || d->h.addr + d->h.size < d->h.addr) {
		r->st.rej_header++;
		d->close_after = true;
	} else {
		res *x = res_cover(r, d->h.addr, d->h.size, now);
		if (x == NULL)
			r->st.rej_range++;
		else if (now >= x->expiry_ns)
			r->st.rej_expired++;
		else
			d->res_id = x->id;
		d->close_after = d->res_id == 0 && d->h.size > ECX_MC_DRAIN_MAX;
	}
	pthread_mutex_unlock(&r->lock);
	if (d->res_id != 0) {
		d->state = D_LAND;
		return true;
	}
	d->reject = true;
	if (d->close_after || !ecx_mc_hdr_is_write(&d->h))
		return d_status(r, d, ECX_MC_STATUS_REJECTED);
	d->state = D_DROP;
	return true;
}

/* One recv of the body into its reservation, if it still holds; else
 * the rest is dropped. Returns the recv's result (-2: switched to drop). */
static ssize_t d_land(ecx_mc_recv *r, dconn *d)
{
	uint64_t now = ecx_now_ns();
	pthread_mutex_lock(&r->lock);
	res *x = res_find(r, d->res_id);
	bool ok = x != NULL && !x->dead && now < x->expiry_ns;
	uint64_t at = d->h.addr + d->got;
	/* Hashed in order only: these bytes follow the hashed ones. */
	XXH3_state_t *xs = NULL;
	if (ok) {
		x->busy++;
		if (x->xs != NULL && !x->broken && at == x->addr + x->hashed)
			xs = x->xs;
		/* Before the bytes land, not after: a release of another
		 * reservation they overlap, on another thread while the recv
		 * copies, must not take a hash of bytes being overwritten.
		 * (Voids at worst what the recv then does not reach.) */
		res_break_others(r, x, at, d->h.size - d->got);
	} else {
		r->st.rej_expired++;
	}
	pthread_mutex_unlock(&r->lock);
	if (!ok) {
		d->reject = true;
		d->close_after = d->h.size - d->got > ECX_MC_DRAIN_MAX;
		if (d->close_after) {
			d_status(r, d, ECX_MC_STATUS_REJECTED);
		} else {
			d->state = D_DROP;
		}
		return -2;
	}
	ssize_t n = recv(d->fd, (void *)(uintptr_t)at, d->h.size - d->got, 0);
	int err = errno;
	/* Still busy: release waits for this before it frees the state. */
	if (n > 0 && xs != NULL)
		XXH3_64bits_update(xs, (const void *)(uintptr_t)at, (size_t)n);
	pthread_mutex_lock(&r->lock);
	x = res_find(r, d->res_id);
	if (n > 0 && xs != NULL)
		x->hashed += (uint64_t)n;
	else if (n > 0)
		x->broken = true;
	if (--x->busy == 0 && x->dead)
		pthread_cond_broadcast(&r->cv);
	if (n > 0 && d->got + (uint64_t)n == d->h.size) {
		x->landed += d->h.size;
		r->st.writes++;
		r->st.bytes += d->h.size;
	}
	pthread_mutex_unlock(&r->lock);
	errno = err;
	return n;
}

static void d_event(ecx_mc_recv *r, dconn *d)
{
	uint64_t spin_until = 0;
	for (;;) {
		ssize_t n;
		if (d->state == D_STATUS) {
			n = send(d->fd, d->st + d->st_off,
			         sizeof(d->st) - d->st_off, MSG_NOSIGNAL);
			if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
				recv_ep_mod(r, d->fd, EPOLLOUT, &d->t);
				return;
			}
			if (n <= 0) {
				d_close(r, d, false);
				return;
			}
			d->st_off += (size_t)n;
			if (d->st_off < sizeof(d->st))
				continue;
			if (d->close_after) {
				/* The peer reads the status, then sees the
				 * end. */
				shutdown(d->fd, SHUT_WR);
				d_close(r, d, false);
				return;
			}
			recv_ep_mod(r, d->fd, EPOLLIN, &d->t);
			d->state = D_HDR;
			d->have = 0;
			continue;
		}
		if (d->state == D_HDR) {
			n = recv(d->fd, d->hdr + d->have,
			         sizeof(d->hdr) - d->have, 0);
		} else if (d->state == D_LAND) {
			n = d_land(r, d);
			if (n == -2)
				continue;
		} else {
			uint64_t left = d->h.size - d->got;
			n = recv(d->fd, r->scratch,
			         left < sizeof(r->scratch) ? left
			                                   : sizeof(r->scratch),
			         0);
		}
		if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
			/* Mid-body the next bytes are most often microseconds
			 * away: asking again for a short while costs less than
			 * a sleep in epoll_wait and a wake-up per burst. */
			if (d->state != D_LAND && d->state != D_DROP)
				return;
			uint64_t now = ecx_now_ns();
			if (spin_until == 0)
				spin_until = now + ECX_MC_SPIN_NS;
			if (now >= spin_until)
				return;
			continue;
		}
		if (n <= 0) {
			/* The peer went: mid-request is a cut. */
			d_close(r, d, d->state != D_HDR || d->have > 0);
			return;
		}
		d->last_ms = ecx_now_ms();
		spin_until = 0;
		if (d->state == D_HDR) {
			d->have += (size_t)n;
			if (d->have == sizeof(d->hdr) && !d_header(r, d))
				return;
			continue;
		}
		d->got += (uint64_t)n;
		if (d->got < d->h.size)
			continue;
		if (!d_status(r, d,
		              d->reject ? ECX_MC_STATUS_REJECTED
		                        : ECX_MC_STATUS_OK))
			return;
	}
}

static void d_accept(ecx_mc_recv *r)
{
	for (;;) {
		int fd = accept4(r->data_fd, NULL, NULL,
		                 SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		size_t slot = ECX_MC_DATA_CONNS_MAX;
		for (size_t i = 0; i < ECX_MC_DATA_CONNS_MAX; i++)
			if (r->dc[i] == NULL) {
				slot = i;
				break;
			}
		dconn *d =
		    slot < ECX_MC_DATA_CONNS_MAX ? calloc(1, sizeof(*d)) : NULL;
		if (d == NULL) {
			close(fd);
			continue;
		}
		recv_nodelay(fd);
		d->t.kind = K_DATA;
		d->fd = fd;
		d->last_ms = ecx_now_ms();
		r->dc[slot] = d;
		recv_ep_add(r, fd, EPOLLIN, &d->t);
	}
}

/* Closes handshakes out of time and data connections that stalled. */
static void sweep(ecx_mc_recv *r)
{
	uint64_t now = ecx_now_ms();
	for (size_t i = 0; i < ECX_MC_HS_CONNS_MAX; i++)
		if (r->hs[i] != NULL && now >= r->hs[i]->deadline_ms)
			recv_hs_close(r, r->hs[i], r->hs[i]->state != HS_DRAIN);
	for (size_t i = 0; i < ECX_MC_DATA_CONNS_MAX; i++) {
		dconn *d = r->dc[i];
		if (d == NULL)
			continue;
		bool mid = d->state != D_HDR || d->have > 0;
		if (now - d->last_ms >=
		    (mid ? ECX_MC_DATA_STALL_MS : ECX_MC_DATA_IDLE_MS))
			d_close(r, d, mid);
	}
}

static void *run(void *arg)
{
	ecx_mc_recv *r = arg;
	struct epoll_event ev[32];
	for (;;) {
		int n = epoll_wait(r->ep, ev, 32, 100);
		for (int i = 0; i < n; i++) {
			tag *t = ev[i].data.ptr;
			switch (t->kind) {
			case K_STOP:
				return NULL;
			case K_HS_LISTEN:
				recv_hs_accept(r);
				break;
			case K_DATA_LISTEN:
				d_accept(r);
				break;
			case K_HS:
				recv_hs_event(r, (hsconn *)t);
				break;
			case K_DATA:
				d_event(r, (dconn *)t);
				break;
			}
		}
		sweep(r);
	}
}

/* ---- create, destroy ---- */

const char *ecx_mc_recv_session(const ecx_mc_recv *r)
{
	return r->session;
}

int ecx_mc_recv_create(const char *bind_host, const char *adv_host,
                       ecx_mc_recv **out, char *why, size_t whylen)
{
	ecx_mc_recv *r = calloc(1, sizeof(*r));
	if (r == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_mutex_init(&r->lock, NULL);
	pthread_cond_init(&r->cv, NULL);
	r->ep = r->stopfd = r->hs_fd = r->data_fd = -1;
	int rc = 0;
	r->hs_fd = recv_listen(bind_host, &r->hs_port, why, whylen);
	if (r->hs_fd < 0) {
		rc = r->hs_fd;
		r->hs_fd = -1;
		goto fail;
	}
	r->data_fd = recv_listen(bind_host, &r->data_port, why, whylen);
	if (r->data_fd < 0) {
		rc = r->data_fd;
		r->data_fd = -1;
		goto fail;
	}
	char host[ECX_MC_NAME_MAX - 8];
	if (adv_host != NULL && adv_host[0] != '\0')
		ecx_strlcpy(host, adv_host, sizeof(host));
	else if (bind_host != NULL && bind_host[0] != '\0')
		ecx_strlcpy(host, bind_host, sizeof(host));
	else
		ecx_default_host(host, sizeof(host));
	bool v6 = strchr(host, ':') != NULL && host[0] != '[';
	snprintf(r->session, sizeof(r->session), "%s%s%s:%u", v6 ? "[" : "",
	         host, v6 ? "]" : "", (unsigned)r->hs_port);
	r->ep = epoll_create1(EPOLL_CLOEXEC);
	r->stopfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (r->ep < 0 || r->stopfd < 0) {
		rc = ecx_why(why, whylen, ECX_EIO,
		             "mooncake receiver: epoll: %s", strerror(errno));
		goto fail;
	}
	r->stop_tag.kind = K_STOP;
	r->hs_tag.kind = K_HS_LISTEN;
	r->data_tag.kind = K_DATA_LISTEN;
	recv_ep_add(r, r->stopfd, EPOLLIN, &r->stop_tag);
	recv_ep_add(r, r->hs_fd, EPOLLIN, &r->hs_tag);
	recv_ep_add(r, r->data_fd, EPOLLIN, &r->data_tag);
	if (pthread_create(&r->thread, NULL, run, r) != 0) {
		rc = ecx_why(why, whylen, ECX_ENOMEM,
		             "mooncake receiver: cannot start its thread");
		goto fail;
	}
	r->started = true;
	ecx_info(MOD, "receiver at session %s (data port %u)", r->session,
	         (unsigned)r->data_port);
	*out = r;
	return 0;
fail:
	ecx_mc_recv_destroy(r);
	return rc;
}

void ecx_mc_recv_destroy(ecx_mc_recv *r)
{
	if (r == NULL)
		return;
	if (r->started) {
		uint64_t one = 1;
		ssize_t w = write(r->stopfd, &one, sizeof(one));
		(void)w;
		pthread_join(r->thread, NULL);
	}
	for (size_t i = 0; i < ECX_MC_HS_CONNS_MAX; i++)
		if (r->hs[i] != NULL)
			recv_hs_close(r, r->hs[i], false);
	for (size_t i = 0; i < ECX_MC_DATA_CONNS_MAX; i++)
		if (r->dc[i] != NULL)
			d_close(r, r->dc[i], false);
	if (r->hs_fd >= 0)
		close(r->hs_fd);
	if (r->data_fd >= 0)
		close(r->data_fd);
	if (r->stopfd >= 0)
		close(r->stopfd);
	if (r->ep >= 0)
		close(r->ep);
	for (size_t i = 0; i < r->nres; i++)
		XXH3_freeState(r->res[i].xs);
	free(r->res);
	free(r->bufs);
	pthread_mutex_destroy(&r->lock);
	pthread_cond_destroy(&r->cv);
	free(r);
}
