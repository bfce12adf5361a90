/* side.c - sides: a UCX worker per peer connection where closing must let
 * go of the peer's shared memory (ucx.h explains why), the maker thread that
 * keeps one made ahead, and the progress of all of them. */
#include "xfer/ucx_priv.h"

#include "core/core.h"

#include <stdlib.h>
#include <time.h>

unsigned ecx_ucx_progress(ecx_ucx *u)
{
	unsigned n = ucp_worker_progress(u->worker);
	pthread_mutex_lock(&u->side_lock);
	for (ecx_ucx_side *s = u->sides; s != NULL; s = s->next)
		n += ucp_worker_progress(s->worker);
	pthread_mutex_unlock(&u->side_lock);
	return n;
}

/* A side, made; NULL with st set when it cannot be. */
static ecx_ucx_side *side_make(ecx_ucx *u, ucs_status_t *st)
{
	ecx_ucx_side *s = calloc(1, sizeof(*s));
	if (s == NULL) {
		*st = UCS_ERR_NO_MEMORY;
		return NULL;
	}
	*st =
	    ecx_ucx_worker_make(u, &s->worker, &s->efd, &s->addr, &s->addr_len);
	if (*st != UCS_OK) {
		free(s);
		return NULL;
	}
	return s;
}

static void side_free(ecx_ucx_side *s)
{
	ucp_worker_release_address(s->worker, s->addr);
	ucp_worker_destroy(s->worker);
	free(s);
}

/* Keeps one spare side made while sides are in use. */
static void *maker_thread(void *arg)
{
	ecx_ucx *u = arg;
	pthread_mutex_lock(&u->side_lock);
	while (!u->maker_stop) {
		if (u->spare != NULL) {
			pthread_cond_wait(&u->maker_cv, &u->side_lock);
			continue;
		}
		/* Not at once: the connection that took the last spare is
		 * making its first load now, and making a worker takes a
		 * core for 5-10 ms (its shared memory's first touch). */
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		if (u->nsides > 0) /* else the first, made at once */
			ts.tv_nsec += 200000000;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		while (!u->maker_stop &&
		       pthread_cond_timedwait(&u->maker_cv, &u->side_lock,
		                              &ts) == 0)
			;
		if (u->maker_stop)
			break;
		pthread_mutex_unlock(&u->side_lock);
		ucs_status_t st;
		ecx_ucx_side *s = side_make(u, &st);
		pthread_mutex_lock(&u->side_lock);
		if (s == NULL) { /* made at the next create, or later here */
			clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_sec += 1;
			pthread_cond_timedwait(&u->maker_cv, &u->side_lock,
			                       &ts);
		} else if (u->maker_stop) {
			pthread_mutex_unlock(&u->side_lock);
			side_free(s);
			pthread_mutex_lock(&u->side_lock);
		} else {
			u->spare = s;
		}
	}
	pthread_mutex_unlock(&u->side_lock);
	return NULL;
}

int ecx_ucx_side_create(ecx_ucx *u, ecx_ucx_side **out, char *why,
                        size_t whylen)
{
	pthread_mutex_lock(&u->side_lock);
	/* Each side holds file descriptors (its event descriptor, and a
	 * listening socket per TCP device under "auto") and 4 MiB of shared
	 * memory: past the cap, a peer shares the main worker instead. */
	if (u->nsides >= ECX_UCX_SIDES_MAX) {
		pthread_mutex_unlock(&u->side_lock);
		return ecx_why(why, whylen, ECX_EBUSY,
		               "%d connections have one already",
		               ECX_UCX_SIDES_MAX);
	}
	ecx_ucx_side *s = u->spare;
	u->spare = NULL;
	pthread_mutex_unlock(&u->side_lock);
	if (s == NULL) {
		ucs_status_t st;
		if ((s = side_make(u, &st)) == NULL)
			return ecx_why(why, whylen, ecx_ucx_err(st),
			               "UCX worker: %s", ucs_status_string(st));
	}
	pthread_mutex_lock(&u->side_lock);
	s->next = u->sides;
	u->sides = s;
	u->nsides++;
	pthread_cond_signal(&u->maker_cv); /* make the next one */
	pthread_mutex_unlock(&u->side_lock);
	/* The progress thread may be asleep on a poll set without it. */
	ucp_worker_signal(u->worker);
	*out = s;
	return 0;
}

ucp_worker_h ecx_ucx_side_worker(const ecx_ucx_side *s)
{
	return s->worker;
}

void ecx_ucx_side_address(const ecx_ucx_side *s, const void **addr, size_t *len)
{
	*addr = s->addr;
	*len = s->addr_len;
}

void ecx_ucx_side_destroy(ecx_ucx *u, ecx_ucx_side *s)
{
	if (s == NULL)
		return;
	pthread_mutex_lock(&u->side_lock);
	for (ecx_ucx_side **sp = &u->sides; *sp != NULL; sp = &(*sp)->next)
		if (*sp == s) {
			*sp = s->next;
			u->nsides--;
			break;
		}
	pthread_mutex_unlock(&u->side_lock);
	side_free(s);
}

void ecx_ucx_sides_start(ecx_ucx *u)
{
	u->maker_started =
	    pthread_create(&u->maker, NULL, maker_thread, u) == 0;
}

void ecx_ucx_sides_stop(ecx_ucx *u)
{
	pthread_mutex_lock(&u->side_lock);
	u->maker_stop = true;
	pthread_cond_broadcast(&u->maker_cv);
	pthread_mutex_unlock(&u->side_lock);
	if (u->maker_started)
		pthread_join(u->maker, NULL);
	u->maker_started = false;
	if (u->spare != NULL)
		side_free(u->spare);
	u->spare = NULL;
	while (u->sides != NULL)
		ecx_ucx_side_destroy(u, u->sides);
}

void ecx_ucx_side_drain(ecx_ucx_side *side)
{
	uint64_t start = ecx_now_ns(), quiet = start;
	unsigned did = 0;
	for (;;) {
		uint64_t now = ecx_now_ns();
		unsigned n = ucp_worker_progress(side->worker);
		if (n > 0)
			quiet = now;
		did += n;
		if (now - quiet >= ECX_SIDE_QUIET_NS ||
		    now - start >= ECX_SIDE_DRAIN_NS) {
			ecx_debug("ucx", "side drained: %u events in %llu us",
			          did,
			          (unsigned long long)(now - start) / 1000u);
			return;
		}
	}
}

void ecx_ucx_side_destroy_forced(ecx_ucx *u, ecx_ucx_side *side, ucp_ep_h ep)
{
	if (ep != NULL) {
		ucp_request_param_t p = {.op_attr_mask =
		                             UCP_OP_ATTR_FIELD_FLAGS,
		                         .flags = UCP_EP_CLOSE_FLAG_FORCE};
		ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
		if (req != NULL && !UCS_PTR_IS_ERR(req))
			ucp_request_free(req); /* not waited for: see ucx.h */
	}
	ecx_ucx_side_destroy(u, side);
}
