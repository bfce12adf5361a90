/* ucx_priv.h - what the files of src/xfer share: the context and side
 * structures, and the calls between them, each used one way (ucx.c calls
 * side.c and worker.c; side.c calls worker.c). Nothing outside src/xfer
 * includes it. */
#ifndef ECX_XFER_UCX_PRIV_H
#define ECX_XFER_UCX_PRIV_H

#include "xfer/ucx.h"

#include <poll.h>
#include <pthread.h>
#include <stdbool.h>

/* A worker of its own for one peer (see ucx.h); on u's list of sides. */
struct ecx_ucx_side {
	ucp_worker_h worker;
	int efd;
	ucp_address_t *addr;
	size_t addr_len;
	struct ecx_ucx_side *next;
};

struct ecx_ucx {
	ucp_context_h ctx;
	ucp_worker_h worker;
	int efd;
	ucp_address_t *addr;
	size_t addr_len;
	ecx_ucx_opts am; /* the active-message handlers, for sides */
	/* Sides: added by any thread, progressed and polled by the progress
	 * thread with side_lock held, which its callbacks run under. */
	pthread_mutex_t side_lock;
	ecx_ucx_side *sides;
	unsigned nsides;
	/* One side made ahead by the maker thread (under side_lock), so a
	 * connection does not wait the 5-10 ms a worker takes to make. */
	ecx_ucx_side *spare;
	pthread_t maker;
	bool maker_started, maker_stop;
	pthread_cond_t maker_cv;
	struct pollfd *pfd; /* the progress thread's poll set */
	size_t pfd_cap;
	pthread_t thread;
	bool thread_started;
	int stop;
	void (*on_progress)(void *arg);
	void *arg;
	uint64_t spin_ns;
	int waiters;        /* callers progressing the worker themselves */
	uint64_t linger_ns; /* ecx_ucx_opts */
	uint64_t waited_ns; /* when the last of them was done */
	bool kick;          /* ecx_ucx_wake: the thread stops lingering */
	/* The progress thread sleeps on wait_cv while waiters > 0, and for
	 * linger_ns after (ucx.c, ucx_park) */
	pthread_mutex_t wait_lock;
	pthread_cond_t wait_cv;
	unsigned transports; /* ECX_TR_* this context may use */
};

/* Makes a worker on u's context with u's active-message handlers, its
 * event descriptor and its address (worker.c). On failure, what was made
 * is destroyed and *w is NULL. */
ucs_status_t ecx_ucx_worker_make(ecx_ucx *u, ucp_worker_h *w, int *efd,
                                 ucp_address_t **addr, size_t *len);
/* Starts the maker thread (side.c); where shared memory may be used. */
void ecx_ucx_sides_start(ecx_ucx *u);
/* Stops the maker and destroys the spare and every side left (side.c). */
void ecx_ucx_sides_stop(ecx_ucx *u);

#endif
