/* ucx.c - UCX context, worker and progress thread (memory: mem.c; making a
 * worker: worker.c). */
#include "xfer/ucx.h"
#include "xfer/ucx_priv.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <ucs/debug/log_def.h>
#include <uct/api/uct.h>
#include <unistd.h>

#define MOD "ucx"

/* Finds the name of the interface that holds address host. */
static bool iface_of(const char *host, char *name, size_t len)
{
	struct addrinfo hints = {.ai_flags = AI_NUMERICHOST}, *res = NULL;
	if (getaddrinfo(host, NULL, &hints, &res) != 0)
		return false;
	struct ifaddrs *ifs = NULL, *i;
	bool found = false;
	if (getifaddrs(&ifs) == 0) {
		for (i = ifs; i != NULL && !found; i = i->ifa_next) {
			if (i->ifa_addr == NULL ||
			    i->ifa_addr->sa_family != res->ai_family)
				continue;
			if (res->ai_family == AF_INET &&
			    ((struct sockaddr_in *)i->ifa_addr)
			            ->sin_addr.s_addr ==
			        ((struct sockaddr_in *)res->ai_addr)
			            ->sin_addr.s_addr)
				found = true;
			if (res->ai_family == AF_INET6 &&
			    memcmp(&((struct sockaddr_in6 *)i->ifa_addr)
			                ->sin6_addr,
			           &((struct sockaddr_in6 *)res->ai_addr)
			                ->sin6_addr,
			           16) == 0)
				found = true;
			if (found)
				ecx_strlcpy(name, i->ifa_name, len);
		}
		freeifaddrs(ifs);
	}
	freeaddrinfo(res);
	return found;
}

/* Sets a UCX option unless the user's environment sets it (as env, or as
 * UCX_name). Transport options go by their name inside the transport's
 * table ("TX_SEG_SIZE" for UCX_TCP_TX_SEG_SIZE). */
static void ucx_default_env(ucp_config_t *cfg, const char *env,
                            const char *name, const char *val)
{
	char plain[64];
	snprintf(plain, sizeof(plain), "UCX_%s", name);
	if ((env != NULL && getenv(env) != NULL) || getenv(plain) != NULL)
		return;
	ucs_status_t st = ucp_config_modify(cfg, name, val);
	if (st != UCS_OK)
		ecx_warn(MOD, "cannot set UCX %s=%s: %s", name, val,
		         ucs_status_string(st));
	else
		ecx_debug(MOD, "UCX %s=%s", name, val);
}

static void ucx_default(ucp_config_t *cfg, const char *name, const char *val)
{
	ucx_default_env(cfg, NULL, name, val);
}

/* UCX's own messages go to ecx's log, not straight to the terminal: ecx
 * reports each failure itself, naming the peer and the cause, so UCX's
 * errors are details, shown at info (ECX_LOG=info, or -v). Only what UCX's
 * own level (UCX_LOG_LEVEL, default warn) lets through arrives here. */
static ucs_log_func_rc_t ucx_log(const char *file, unsigned line,
                                 const char *function, ucs_log_level_t level,
                                 const ucs_log_component_config_t *comp,
                                 const char *fmt, va_list ap)
{
	(void)function;
	(void)comp;
	ecx_log_level l = level <= UCS_LOG_LEVEL_FATAL  ? ECX_LOG_ERROR
	                  : level <= UCS_LOG_LEVEL_WARN ? ECX_LOG_INFO
	                                                : ECX_LOG_DEBUG;
	if (ecx_log_enabled(l)) {
		char msg[512];
		vsnprintf(msg, sizeof(msg), fmt, ap);
		const char *base = strrchr(file, '/');
		ecx_logf(l, "ucx", "%s (%s:%u)", msg,
		         base != NULL ? base + 1 : file, line);
	}
	return UCS_LOG_FUNC_RC_STOP;
}

static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static int ucx_wait_on(ucp_worker_h w, ucs_status_ptr_t req,
                       uint64_t deadline_ns);

static void log_init_once(void)
{
	ucs_log_push_handler(ucx_log);
}

/* Arms the worker and every side for a wake-up, filling u->pfd with their
 * event descriptors (*n of them); false when one has events already.
 * Progress thread only. */
static bool ucx_arm(ecx_ucx *u, size_t *n)
{
	if (ucp_worker_arm(u->worker) == UCS_ERR_BUSY)
		return false;
	bool armed = true;
	size_t k = 0;
	u->pfd[k++] = (struct pollfd){.fd = u->efd, .events = POLLIN};
	pthread_mutex_lock(&u->side_lock);
	for (ecx_ucx_side *s = u->sides; s != NULL; s = s->next) {
		if (ucp_worker_arm(s->worker) == UCS_ERR_BUSY) {
			armed = false;
			break;
		}
		if (k == u->pfd_cap) {
			size_t cap = u->pfd_cap * 2;
			struct pollfd *m = realloc(u->pfd, cap * sizeof(*m));
			if (m == NULL)
				break; /* polled at the next round (100 ms) */
			u->pfd = m;
			u->pfd_cap = cap;
		}
		u->pfd[k++] = (struct pollfd){.fd = s->efd, .events = POLLIN};
	}
	pthread_mutex_unlock(&u->side_lock);
	*n = k;
	return armed;
}

/* Whether the progress thread stays asleep now, leaving the worker to
 * callers: while one progresses it itself (waiters), and for linger_ns
 * after the last of them is done, unless woken (ecx_ucx_wake). */
static bool ucx_parks(ecx_ucx *u)
{
	if (__atomic_load_n(&u->waiters, __ATOMIC_ACQUIRE) > 0)
		return true;
	return u->linger_ns > 0 &&
	       !__atomic_load_n(&u->kick, __ATOMIC_ACQUIRE) &&
	       ecx_now_ns() < __atomic_load_n(&u->waited_ns, __ATOMIC_ACQUIRE) +
	                          u->linger_ns;
}

/* The progress thread's sleep while it parks (ucx_parks): a caller polls
 * the worker, and a second poller would only take its time and the
 * worker's lock; after the caller, the next load of a caller that loads
 * again and again (within linger_ns) finds the worker to itself, the
 * thread neither woken by that load's answer (its event descriptor is not
 * armed) nor at the end of each wait: on two cores each wake-up can take
 * the core of the producer's copy. With linger_ns, a parked thread looks
 * again every linger_ns; stop and ecx_ucx_wake end the sleep. */
static void ucx_park(ecx_ucx *u)
{
	pthread_mutex_lock(&u->wait_lock);
	while (!__atomic_load_n(&u->stop, __ATOMIC_ACQUIRE) && ucx_parks(u)) {
		if (u->linger_ns == 0) {
			pthread_cond_wait(&u->wait_cv, &u->wait_lock);
			continue;
		}
		uint64_t now = ecx_now_ns(), until = now + u->linger_ns;
		if (__atomic_load_n(&u->waiters, __ATOMIC_ACQUIRE) == 0)
			until =
			    __atomic_load_n(&u->waited_ns, __ATOMIC_ACQUIRE) +
			    u->linger_ns;
		if (until <= now)
			continue;
		struct timespec ts; /* wait_cv's clock: the realtime one */
		clock_gettime(CLOCK_REALTIME, &ts);
		uint64_t t = (uint64_t)ts.tv_sec * 1000000000u +
		             (uint64_t)ts.tv_nsec + (until - now);
		ts.tv_sec = (time_t)(t / 1000000000u);
		ts.tv_nsec = (long)(t % 1000000000u);
		pthread_cond_timedwait(&u->wait_cv, &u->wait_lock, &ts);
	}
	__atomic_store_n(&u->kick, false, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&u->wait_lock);
}

static void *ucx_thread(void *p)
{
	ecx_ucx *u = p;
	uint64_t active = ecx_now_ns();
	while (!__atomic_load_n(&u->stop, __ATOMIC_ACQUIRE)) {
		if (ucx_parks(u)) {
			ucx_park(u);
			active = ecx_now_ns();
			continue;
		}
		unsigned n = ecx_ucx_progress(u);
		if (u->on_progress != NULL)
			u->on_progress(u->arg);
		uint64_t now = ecx_now_ns();
		if (n > 0) {
			active = now;
			continue;
		}
		if (now - active < u->spin_ns) {
			/* Polls, but lets a thread that waits for this CPU
			 * run first: on a shared core, the consumer of the
			 * answer just sent, which a poll without a yield
			 * kept off the core for the whole spin. */
			sched_yield();
			continue;
		}
		size_t npfd = 0;
		if (!ucx_arm(u, &npfd))
			continue;
		poll(u->pfd, npfd, 100);
		active = ecx_now_ns();
	}
	return NULL;
}

/* The transports of "auto" where the user does not set UCX_TLS: all but
 * posix (see ecx_ucx_create) and UCX's CUDA transports (cuda_copy,
 * cuda_ipc, gdr_copy), which serve device memory while ecx's arenas are
 * host memory: left out, a UCX built with CUDA neither opens CUDA for them
 * nor page-locks the arenas itself. Only CUDA transports this UCX has are
 * named (UCX warns about the others). Writes the UCX_TLS it set, or the
 * environment's, to tls. */
static void ucx_auto_tls(ucp_config_t *cfg, char *tls, size_t len)
{
	static const struct {
		const char *component, *transport;
	} cuda[] = {{"cuda_cpy", "cuda_copy"},
	            {"cuda_ipc", "cuda_ipc"},
	            {"gdr_copy", "gdr_copy"}};
	const char *env = getenv("UCX_TLS");
	if (env != NULL) {
		snprintf(tls, len, "%s", env);
		return;
	}
	size_t off = (size_t)snprintf(tls, len, "^posix");
	uct_component_h *comps = NULL;
	unsigned n = 0;
	if (uct_query_components(&comps, &n) == UCS_OK) {
		for (unsigned i = 0; i < n; i++) {
			uct_component_attr_t a = {
			    .field_mask = UCT_COMPONENT_ATTR_FIELD_NAME};
			if (uct_component_query(comps[i], &a) != UCS_OK)
				continue;
			for (size_t k = 0; k < sizeof(cuda) / sizeof(cuda[0]);
			     k++) {
				if (strcmp(a.name, cuda[k].component) != 0)
					continue;
				int w = snprintf(tls + off, len - off, ",%s",
				                 cuda[k].transport);
				if (w > 0 && (size_t)w < len - off)
					off += (size_t)w;
			}
		}
		uct_release_component_list(comps);
	}
	ucx_default(cfg, "TLS", tls);
}

int ecx_ucx_create(const ecx_ucx_opts *o, ecx_ucx **out, char *why,
                   size_t whylen)
{
	ecx_ucx *u = calloc(1, sizeof(*u));
	if (u == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	pthread_once(&log_once, log_init_once);
	u->efd = -1;
	pthread_mutex_init(&u->side_lock, NULL);
	pthread_cond_init(&u->maker_cv, NULL);
	pthread_mutex_init(&u->wait_lock, NULL);
	pthread_cond_init(&u->wait_cv, NULL);
	u->pfd_cap = 16;
	u->pfd = malloc(u->pfd_cap * sizeof(*u->pfd));
	if (u->pfd == NULL) {
		pthread_mutex_destroy(&u->side_lock);
		pthread_cond_destroy(&u->maker_cv);
		pthread_mutex_destroy(&u->wait_lock);
		pthread_cond_destroy(&u->wait_cv);
		free(u);
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	}
	u->on_progress = o->on_progress;
	u->spin_ns = o->spin_ns;
	u->linger_ns = o->linger_ns;
	u->arg = o->arg;
	ucp_config_t *cfg = NULL;
	ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
	int rc;
	if (st != UCS_OK) {
		rc = ecx_why(why, whylen, ECX_EIO, "UCX configuration: %s",
		             ucs_status_string(st));
		goto fail;
	}
	/* Threads that progress a worker take its lock: as a spinlock (UCX's
	 * default), one that finds it taken spins until the holder, maybe
	 * preempted by it on a busy core, runs again (a time slice). */
	ucx_default(cfg, "USE_MT_MUTEX", "y");
	/* Measured here: 8 MiB puts over TCP go from 0.2-0.9 GB/s to
	 * 1.2-3.4 GB/s with these segment sizes. */
	const char *tr = o->transport != NULL ? o->transport : "auto";
	/* Only where TCP may be used: UCX warns about options no transport
	 * takes. */
	const char *tls = getenv("UCX_TLS");
	bool tcp = strcmp(tr, "shm") != 0 &&
	           (tls == NULL || tls[0] == '^' ||
	            strstr(tls, "tcp") != NULL || strstr(tls, "all") != NULL);
	if (tcp) {
		ucx_default_env(cfg, "UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE",
		                "256k");
		ucx_default_env(cfg, "UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE",
		                "1m");
	}
	u->transports = strcmp(tr, "tcp") == 0   ? ECX_TR_TCP
	                : strcmp(tr, "shm") == 0 ? ECX_TR_SHM
	                                         : ECX_TR_SHM | ECX_TR_TCP;
	/* Shared memory goes over System V segments (and cross-memory
	 * attach), never UCX's posix transport: that one creates a named
	 * file in /dev/shm for each segment, writes it whole and only then
	 * unlinks it, so a process killed in between (at the start of a large
	 * arena, or of any worker's FIFO) leaves the file, and its memory,
	 * behind. A System V segment is marked for removal as soon as it is
	 * attached, so it goes with the last process that has it mapped.
	 * The memory-type cache (hooks on CUDA allocations) has no device
	 * memory to find here. */
	char autotls[64] = "";
	if (getenv("UCX_MEMTYPE_CACHE") == NULL &&
	    ucp_config_modify(cfg, "MEMTYPE_CACHE", "n") != UCS_OK)
		ecx_debug(MOD, "this UCX has no MEMTYPE_CACHE setting");
	if (strcmp(tr, "tcp") == 0)
		ucx_default(cfg, "TLS", "tcp,self");
	else if (strcmp(tr, "shm") == 0)
		ucx_default(cfg, "TLS", "sysv,cma,self");
	else if (strcmp(tr, "auto") == 0)
		ucx_auto_tls(cfg, autotls, sizeof(autotls));
	else {
		ucp_config_release(cfg);
		rc = ecx_why(why, whylen, ECX_EINVAL,
		             "unknown transport '%s' (auto, tcp, shm)", tr);
		goto fail;
	}
	if (tls != NULL)
		ecx_info(MOD, "transport %s, UCX_TLS=%s (the environment's)",
		         tr, tls);
	else if (strcmp(tr, "auto") != 0)
		ecx_info(MOD, "transport %s, UCX_TLS=%s", tr,
		         strcmp(tr, "tcp") == 0 ? "tcp,self" : "sysv,cma,self");
	else
		ecx_info(MOD, "transport auto, UCX_TLS=%s", autotls);
	/* Arenas likewise: System V first, then private memory, which peers
	 * on this host reach by cross-memory attach. */
	ucx_default(cfg, "ALLOC_PRIO", ECX_UCX_ALLOC_PRIO);
	const char *h = o->bind_host;
	if (h != NULL && h[0] != '\0' && strcmp(h, "0.0.0.0") != 0 &&
	    strcmp(h, "::") != 0) {
		char dev[IF_NAMESIZE + 8];
		if (iface_of(h, dev, sizeof(dev)))
			ucx_default(cfg, "NET_DEVICES", dev);
		else
			ecx_warn(MOD, "no interface holds %s; UCX picks", h);
	}
	ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES |
	                                 UCP_PARAM_FIELD_MT_WORKERS_SHARED,
	                   .features = UCP_FEATURE_RMA | UCP_FEATURE_AM |
	                               UCP_FEATURE_WAKEUP,
	                   .mt_workers_shared = 1};
	st = ucp_init(&pp, cfg, &u->ctx);
	ucp_config_release(cfg);
	if (st != UCS_OK) {
		rc = ecx_why(why, whylen, ECX_EIO, "UCX init: %s",
		             ucs_status_string(st));
		goto fail;
	}
	memcpy(u->am.am, o->am, sizeof(o->am));
	u->am.nam = o->nam;
	st =
	    ecx_ucx_worker_make(u, &u->worker, &u->efd, &u->addr, &u->addr_len);
	if (st != UCS_OK) {
		rc = ecx_why(why, whylen, ECX_EIO, "UCX worker: %s",
		             ucs_status_string(st));
		goto fail;
	}
	if (pthread_create(&u->thread, NULL, ucx_thread, u) != 0) {
		rc = ecx_why(why, whylen, ECX_ENOMEM, "cannot start thread");
		goto fail;
	}
	u->thread_started = true;
	/* Where shared memory may be used, connections get sides: one is
	 * made now, in the background, and one kept ready after each use. */
	if (u->transports & ECX_TR_SHM)
		ecx_ucx_sides_start(u);
	*out = u;
	return 0;
fail:
	ecx_ucx_destroy(u);
	return rc;
}

void ecx_ucx_stop(ecx_ucx *u)
{
	if (u->thread_started) {
		pthread_mutex_lock(&u->wait_lock);
		__atomic_store_n(&u->stop, 1, __ATOMIC_RELEASE);
		pthread_cond_signal(&u->wait_cv);
		pthread_mutex_unlock(&u->wait_lock);
		ucp_worker_signal(u->worker);
		pthread_join(u->thread, NULL);
		u->thread_started = false;
	}
}

void ecx_ucx_destroy(ecx_ucx *u)
{
	if (u == NULL)
		return;
	ecx_ucx_stop(u);
	ecx_ucx_sides_stop(u);
	if (u->addr != NULL)
		ucp_worker_release_address(u->worker, u->addr);
	if (u->worker != NULL)
		ucp_worker_destroy(u->worker);
	if (u->ctx != NULL)
		ucp_cleanup(u->ctx);
	pthread_cond_destroy(&u->maker_cv);
	pthread_mutex_destroy(&u->side_lock);
	pthread_cond_destroy(&u->wait_cv);
	pthread_mutex_destroy(&u->wait_lock);
	free(u->pfd);
	free(u);
}

ucp_context_h ecx_ucx_context(ecx_ucx *u)
{
	return u->ctx;
}
ucp_worker_h ecx_ucx_worker(ecx_ucx *u)
{
	return u->worker;
}
size_t ecx_ucx_max_am_header(ucp_worker_h w)
{
	ucp_worker_attr_t a = {.field_mask =
	                           UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER};
	return ucp_worker_query(w, &a) == UCS_OK ? a.max_am_header : 0;
}
void ecx_ucx_wake(ecx_ucx *u)
{
	ucp_worker_signal(u->worker);
	if (u->linger_ns > 0) {
		pthread_mutex_lock(&u->wait_lock);
		__atomic_store_n(&u->kick, true, __ATOMIC_RELEASE);
		pthread_cond_signal(&u->wait_cv);
		pthread_mutex_unlock(&u->wait_lock);
	}
}

void ecx_ucx_waiting(ecx_ucx *u, bool on)
{
	if (on) {
		__atomic_add_fetch(&u->waiters, 1, __ATOMIC_ACQ_REL);
	} else if (u->linger_ns > 0) {
		/* The thread lingers on by itself (ucx_park): no wake-up. */
		__atomic_store_n(&u->waited_ns, ecx_now_ns(), __ATOMIC_RELEASE);
		__atomic_sub_fetch(&u->waiters, 1, __ATOMIC_ACQ_REL);
	} else if (__atomic_sub_fetch(&u->waiters, 1, __ATOMIC_ACQ_REL) == 0) {
		/* Under the lock, so the thread cannot miss it between its
		 * test of waiters and its wait. */
		pthread_mutex_lock(&u->wait_lock);
		pthread_cond_signal(&u->wait_cv);
		pthread_mutex_unlock(&u->wait_lock);
	}
}

void ecx_ucx_address(ecx_ucx *u, const void **addr, size_t *len)
{
	*addr = u->addr;
	*len = u->addr_len;
}

unsigned ecx_ucx_transports(const ecx_ucx *u)
{
	return u->transports;
}

int ecx_ucx_ep_create(ecx_ucx *u, const void *addr, size_t len,
                      unsigned transport, ucp_err_handler_cb_t on_error,
                      void *arg, ucp_ep_h *ep, char *why, size_t whylen)
{
	return ecx_ucx_side_ep_create(u, NULL, addr, len, transport, on_error,
	                              arg, ep, why, whylen);
}

int ecx_ucx_side_ep_create(ecx_ucx *u, ecx_ucx_side *side, const void *addr,
                           size_t len, unsigned transport,
                           ucp_err_handler_cb_t on_error, void *arg,
                           ucp_ep_h *ep, char *why, size_t whylen)
{
	(void)len;
	/* UCX's shared-memory transports cannot report a failed peer, and
	 * asking for that reporting excludes them: so it is asked for
	 * exactly when the connection is to use TCP. */
	ucp_ep_params_t ep_params = {
	    .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
	                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
	                  UCP_EP_PARAM_FIELD_ERR_HANDLER,
	    .address = addr,
	    .err_mode = transport == ECX_TR_TCP ? UCP_ERR_HANDLING_MODE_PEER
	                                        : UCP_ERR_HANDLING_MODE_NONE,
	    .err_handler = {.cb = on_error, .arg = arg}};
	ucs_status_t st = ucp_ep_create(side != NULL ? side->worker : u->worker,
	                                &ep_params, ep);
	if (st != UCS_OK)
		return ecx_why(why, whylen, ecx_ucx_err(st),
		               "cannot reach peer worker: %s",
		               ucs_status_string(st));
	return 0;
}

void ecx_ucx_ep_close(ecx_ucx *u, ucp_ep_h ep, unsigned transport,
                      int timeout_ms)
{
	ecx_ucx_side_ep_close(u, NULL, ep, transport, timeout_ms);
}

void ecx_ucx_side_ep_close(ecx_ucx *u, ecx_ucx_side *side, ucp_ep_h ep,
                           unsigned transport, int timeout_ms)
{
	if (ep == NULL)
		return;
	/* UCX defines a forced close only for endpoints made with peer
	 * error handling (ucp.h); the others close in flush mode, which the
	 * wait below bounds. */
	ucp_request_param_t p = {
	    .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
	    .flags = transport == ECX_TR_TCP ? UCP_EP_CLOSE_FLAG_FORCE : 0};
	ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
	ucx_wait_on(side != NULL ? side->worker : u->worker, req,
	            ecx_now_ns() + (uint64_t)timeout_ms * 1000000u);
}

int ecx_ucx_wait(ecx_ucx *u, ucs_status_ptr_t req, uint64_t deadline_ns)
{
	return ucx_wait_on(u->worker, req, deadline_ns);
}

static int ucx_wait_on(ucp_worker_h w, ucs_status_ptr_t req,
                       uint64_t deadline_ns)
{
	if (req == NULL)
		return 0;
	if (UCS_PTR_IS_ERR(req))
		return ecx_ucx_err(UCS_PTR_STATUS(req));
	ucs_status_t st;
	uint64_t spin_until = ecx_now_ns() + 2000000u;
	while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) {
		if (ecx_now_ns() > spin_until)
			usleep(20);
		else
			sched_yield();
		if (ecx_now_ns() >= deadline_ns) {
			ucp_request_cancel(w, req);
			/* Cancelled requests complete on a later progress. */
			for (int i = 0; i < 1000 && ucp_request_check_status(
			                                req) == UCS_INPROGRESS;
			     i++)
				ucp_worker_progress(w);
			ucp_request_free(req);
			return ECX_ETIMEDOUT;
		}
		ucp_worker_progress(w);
	}
	ucp_request_free(req);
	return ecx_ucx_err(st);
}

/* An active message in flight: UCX 1.13 reads the header and the body until
 * the send completes (it has no flag to copy the header), so both live on
 * the heap and the send's callback frees them. */
typedef struct am_out {
	ecx_am_hdr h;
	char *body;
} am_out;

static void am_out_free(am_out *o)
{
	if (o != NULL) {
		free(o->body);
		free(o);
	}
}

static void am_send_done(void *request, ucs_status_t st, void *user_data)
{
	if (st != UCS_OK)
		ecx_warn(MOD, "active message send failed: %s",
		         ucs_status_string(st));
	am_out_free(user_data);
	ucp_request_free(request);
}

int ecx_ucx_am_send(ucp_ep_h ep, unsigned id, uint64_t conn, uint64_t req,
                    char *body, bool *pending)
{
	if (pending != NULL)
		*pending = false;
	am_out *o = body != NULL ? calloc(1, sizeof(*o)) : NULL;
	if (o == NULL) {
		free(body);
		return ECX_ENOMEM;
	}
	o->h = (ecx_am_hdr){.conn = conn, .req = req};
	o->body = body;
	ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
	                                          UCP_OP_ATTR_FIELD_USER_DATA |
	                                          UCP_OP_ATTR_FIELD_FLAGS,
	                          .cb.send = am_send_done,
	                          .user_data = o,
	                          .flags = UCP_AM_SEND_FLAG_EAGER};
	ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, &o->h, sizeof(o->h), body,
	                                     strlen(body), &rp);
	if (r == NULL || UCS_PTR_IS_ERR(r)) {
		am_out_free(o);
		return r == NULL ? 0 : ecx_ucx_err(UCS_PTR_STATUS(r));
	}
	if (pending != NULL)
		*pending = true;
	return 0;
}
