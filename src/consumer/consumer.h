/*
 * consumer.h - the consumer role's internal header: its state and what its
 * files share. The role is one object (ecx_consumer) in these files,
 * which the public calls (api/consumer.c: their argument checks, the
 * handle's process; lookups through api/lookup.c) call into:
 *   consumer.c  lifecycle (create, destroy), stats
 *   conns.c     connections to producers (hello, endpoint, goodbyes)
 *   failures.c  what fails a connection and its pulls: endpoint errors,
 *               a producer's goodbye, its process seen to exit
 *   replies.c   what producers send back: replies, and data over TCP
 *   memory.c    the receive arena and the registration cache of the
 *               caller's memory (the Mooncake receiver's buffers follow
 *               them)
 *   load.c      loads: one pull per producer, bounded waits
 *   failover.c  the end of a load: load.c's wait, then other holders
 *               of an item that failed (it calls load.c, not back)
 *   mooncake.c  loads over Mooncake's TCP wire: the reference's pull op,
 *               answered by a write into this consumer's receiver
 *   push.c      push windows: writes on Mooncake's wire into the receive
 *               arena
 *   notify.c    loads a thread of the library's starts, waits for and
 *               ends, saying so on the caller's socket (it calls load.c
 *               and failover.c, not back)
 *
 * May include: every layer below (core, wire, mem, xfer, mooncake, rdv,
 * dir). Never:
 * producer/ or registry/ (a consumer reaches registries as a client).
 * Locks: c->lock guards connections, pulls in flight, the arena allocator,
 * the registration cache and the stats; it is never held while the worker
 * is progressed (reply handlers take it) nor across a network wait: a
 * connection being made is a placeholder in c->conns (connecting), and
 * other loads that need it wait on c->conn_cv. c->reg_lock serialises
 * registry lookups (the client is one thread at a time).
 */
#ifndef ECX_CONSUMER_H
#define ECX_CONSUMER_H

#include "dir/dir.h"
#include "mem/alloc.h"
#include "mooncake/receiver.h"
#include "rdv/rdv.h"
#include "xfer/ucx.h"

#include <ucm/api/ucm.h>

#include <pthread.h>

/* Registrations of destination memory are rounded out to pages. */
#define PAGE ecx_page_size()
/* How long a load waits past its deadline for the answers of producers
 * that stopped writing at the pull's expiry. */
#define ECX_LOAD_GRACE_NS (100u * 1000000u)
/* How long the UCX progress thread leaves the worker to callers after the
 * last wait on a load ends (xfer/ucx.h, linger_ns): what arrives for a
 * load nobody waits on meanwhile is taken at the next wait, test, or
 * when it looks again. */
#define ECX_LINGER_NS (5u * 1000000u)
/* Timed-out pulls to one producer address that may still write (zombies):
 * at this many, loads from that address fail with ECX_EBUSY until some
 * end, so a stalled producer cannot take the whole receive arena. */
#define ECX_ZOMBIES_MAX 8
/* How long destroy waits for the producers' answers to its goodbyes. */
#define ECX_BYE_WAIT_MS 1000

typedef struct cons_lane cons_lane;

typedef struct pconn {
	struct pconn *next;
	char address[ECX_ADDR_MAX];
	uint64_t epoch, id;
	uint64_t stale_epoch; /* an entry's epoch known not to be this one's */
	ucp_ep_h ep;
	unsigned transport; /* ECX_TR_SHM or ECX_TR_TCP, agreed in the hello */
	unsigned sending;   /* threads sending on ep now (under c->lock) */
	unsigned users;     /* pulls given this connection and not yet in
	                       flight or failed: it must not be freed */
	bool cut;           /* ep to be closed by the last sender */
	bool failed;
	/* The producer's wall clock in the hello's answer, and our monotonic
	 * clock at the midpoint of that round trip: a pull's expiry is the
	 * former plus the monotonic time from then to the load's deadline, so
	 * no wall-clock step after the hello moves it. */
	uint64_t hello_now_ms, hello_mono_ms;
	bool has_clock;  /* false for a producer that sent no clock */
	bool connecting; /* a placeholder: its hello is in flight */
	bool byeing;     /* a goodbye for it is in flight */
	/* A goodbye for it was sent: the producer closes its end, so an
	 * error on ep is no failure from then on (cons_pconn_on_error,
	 * failures.c). */
	bool bye_sent;
	/* The producer closes a connection idle for idle_ms (0: never said);
	 * one idle for half that is replaced before it is used. */
	uint64_t idle_ms, used_ms;
	/* A worker of its own where shared memory may be used, so that
	 * closing the connection lets go of the producer's segments (ucx.h);
	 * NULL: the consumer's worker. Set before the hello, fixed after. */
	ecx_ucx_side *side;
	/* Over shared memory, the producer's process (from the hello) and a
	 * descriptor that says when it ends (ecx_pid_watch; -1: none); where
	 * there is no pidfd_open, pid_poll: /proc is read for it instead
	 * (ecx_pid_exited, with its start time). gone once it has ended. */
	long pid;
	uint64_t pid_start;
	int pidfd;
	bool pid_poll;
	bool gone;
	/* Over TCP, its data lane (lane.c), set before the hello ends and
	 * fixed until its close; NULL: none. */
	cons_lane *lane;
	struct ecx_consumer *c;
} pconn;

/* Producers seen to exit, by address and epoch: a load of their items
 * fails at once (ECX_ECLOSED) rather than waiting for a hello nobody
 * answers. The last ECX_DEAD_MAX are kept. */
#define ECX_DEAD_MAX 16
typedef struct dead_peer {
	char address[ECX_ADDR_MAX];
	uint64_t epoch;
	long pid;
	bool bye; /* it said goodbye (ECX_AM_BYE), rather than exited */
} dead_peer;

/* failures.c */
/* Whether pc has been idle at now_ms for more than half the producer's
 * bound (idle_ms, from its hello): the producer may be closing it, so no
 * load sends on it any more (a pull on a closed connection is lost); it
 * is replaced. Called with c->lock. */
bool cons_pconn_idle(const pconn *pc, uint64_t now_ms);
/* Fails pc and every pull in flight on it with err (why, when not NULL,
 * the load's detail); its zombies end. Called with c->lock. */
void cons_pconn_fail_locked(ecx_consumer *c, pconn *pc, int err,
                            const char *why);
/* Fails pc and every pull in flight on it but its zombies, which end as a
 * failed connection's do (its goodbye's answer). Called with c->lock. */
void cons_pconn_fail_live_locked(ecx_consumer *c, pconn *pc, int err);

/* Checks every watched connection (at most once a millisecond, unless
 * force): one whose producer has exited is failed, its pulls in flight
 * fail with ECX_ECLOSED and its zombies end (nothing can land any more).
 * Takes c->lock. */
void cons_pconns_watch(ecx_consumer *c, bool force);
/* The handler of ECX_AM_BYE: the producer of that connection (and epoch)
 * is being destroyed; its pulls fail with ECX_ECLOSED as above. */
ucs_status_t cons_am_bye(void *arg, const void *header, size_t header_len,
                         void *data, size_t length,
                         const ucp_am_recv_param_t *param);
/* The error handler of pc's endpoint (arg: pc): fails pc and its pulls
 * with ECX_ECLOSED; logged as a failure only where a load uses pc. Takes
 * c->lock. */
void cons_pconn_on_error(void *arg, ucp_ep_h ep, ucs_status_t st);
/* Whether pc's producer is seen to have exited; if so pc is failed with
 * its pulls and remembered dead. Called with c->lock. */
bool cons_pconn_gone_locked(ecx_consumer *c, pconn *pc);
/* The dead producer at address with epoch (not 0), or NULL. Called with
 * c->lock. */
const dead_peer *cons_dead_find(const ecx_consumer *c, const char *address,
                                uint64_t epoch);
/* Writes into why (len bytes) the detail of a load's ECX_ECLOSED from
 * the producer at address, process pid, that left (bye: by its goodbye). */
void cons_dead_detail(const char *address, long pid, bool bye, char *why,
                      size_t len);

/* conns.c */
/* Marks pc failed and, over TCP, closes its endpoint now (or as soon as
 * no thread sends on it): UCX lands TCP puts through this side's worker,
 * so once the endpoint is closed nothing the producer posted earlier can
 * land. Called with c->lock; returns the endpoint for the caller to close
 * with cons_pconn_cut after unlocking, or NULL. */
ucp_ep_h cons_pconn_cut_locked(pconn *pc);
void cons_pconn_cut(ecx_consumer *c, ecx_ucx_side *side, ucp_ep_h ep);

/* A registration of memory that loads write into. */
typedef struct region {
	uint64_t base, len; /* atomics: read by the unmap hook */
	ucp_mem_h memh;
	void *rkey;
	size_t rkey_len;
	unsigned inuse;   /* loads in flight that name it */
	uint64_t used_at; /* for LRU */
	int stale;        /* atomic: memory was unmapped */
	bool live;
} region;

/* The cache of registrations of caller memory: all that the unmap hook
 * reads (its arg), an allocation of its own so that destroy's unchecked
 * free (consumer.c) covers this and nothing else of the consumer. */
typedef struct regcache {
	unsigned n; /* atomic: released at create, before the hook is set */
	region r[];
} regcache;

typedef struct pull {
	struct pull *next; /* in c->inflight */
	uint64_t req;
	pconn *pc;
	ecx_load *load;
	size_t *idx; /* which of the load's items */
	size_t n;
	region **regs; /* regions named, to unpin */
	size_t nregs;
	bool done;
	/* A pull whose load gave up on it (timed out) while the producer may
	 * still write: it keeps its regions and quarantines its receive-arena
	 * ranges until the producer's reply (sent after its last write is
	 * flushed) or the connection's failure ends it. load is NULL then. */
	bool zombie;
	uint64_t *quar; /* offsets of the arena allocations it quarantines */
	size_t nquar;
	/* Over TCP (data_am) the items' bytes come as active messages that
	 * this side receives into their destinations (replies.c): per item,
	 * whether they landed; the receives still landing; and whether the
	 * reply came before they were done (the last one then ends the pull).
	 */
	int *dstat;
	unsigned recving;
	bool answered;
	/* It asked for its connection's data lane (lane.c); its reply came
	 * (after its last byte, on the lane or not). */
	bool lane;
	bool replied;
} pull;

struct ecx_load {
	ecx_consumer *c;
	ecx_item *items;
	size_t n;
	pull **pulls;
	size_t npulls;
	uint64_t deadline_ns;
	char why[400]; /* the detail of a failure of error why_err */
	int why_err;
	/* With integrity on: each item's hash from its producer's reply, and
	 * its kind (ECX_HASH_XXH64 or _XXH3; 0: the reply had none). */
	uint64_t *xxh;
	unsigned char *has_xxh;
	/* With integrity on, per item (atomic): HASH_LANDED once a data
	 * receive or a landed notice (replies.c) says its bytes are in, then
	 * HASH_DONE when the waiting caller has hashed them (XXH3, into
	 * mine) while the rest of the load was still landing. */
	unsigned char *hstate;
	uint64_t *mine;
	/* Of an item put in pieces, each with a landed notice: the bytes
	 * the notices say are in (atomic), those the caller has hashed, and
	 * its XXH3 state meanwhile (NULL: none begun). */
	uint64_t *hupto, *hashed;
	void **hst;
	bool retry; /* a failover to other holders (load.c) */
	/* The caller waits as soon as the pulls are sent (ecx_consumer_load,
	 * a failover): it progresses the worker in place of the progress
	 * thread from the send of the last pull on (waiting: since then). */
	bool sync, waiting;
	/* Progressed by the progress thread (and callers' tests) while a
	 * thread of notify.c sleeps until it ends: its wait then leaves the
	 * worker to the progress thread at once, with no linger. */
	bool passive;
	/* One of its pulls asked for a data lane: its waits read lanes. */
	bool has_lane;
	/* Items loaded with the reference's pull over Mooncake's wire
	 * (mooncake.c): nmc of them, mc_left not answered yet (atomic). */
	struct mcpull *mc;
	size_t nmc;
	size_t mc_left;
	/* A load of ecx_consumer_load_notify: only c and bg are set, and
	 * notify.c's thread runs the real load (NULL for any other). */
	struct cons_bgload *bg;
};

typedef struct arena_alloc {
	uint64_t off, size;
	unsigned zombies; /* timed-out pulls that may still write here */
	bool freed;       /* freed by the caller: given back at zombies 0 */
} arena_alloc;

struct ecx_consumer {
	int pid; /* the creating process: calls from another are refused */
	pthread_mutex_t lock, reg_lock;
	pthread_cond_t conn_cv; /* a placeholder connection was settled */
	ecx_regclient *rc;
	char *token;
	int timeout_ms;
	bool integrity; /* check loaded bytes against producers' hashes */
	/* Tests only: ECX_TEST_HASH_XXH64, a checking consumer that asks for
	 * no hash kind and no landed notices, as one older than XXH3 did
	 * (its producers answer with xxh64). */
	bool test_hash_legacy;
	/* Tests only: ECX_TEST_NO_LEAD, pulls with fold but not lead, as a
	 * consumer older than lead sent (its producers put the reply in the
	 * data message's header). */
	bool test_no_lead;
	/* Over TCP, ask for the data as active messages received into the
	 * destinations (replies.c) rather than puts: ECX_TCP_DATA=am (the
	 * default) or put. */
	bool tcp_data_am;
	/* A pull over TCP asks for its connection's data lane when its
	 * items make at least this many bytes (ECX_TCP_LANE_MIN, 128 KiB);
	 * 0: never (ECX_TCP_LANE=0, or data as puts). */
	uint64_t lane_min;
	ecx_ucx *ucx;
	ecx_rdv_client *rdv;
	ecx_rdv_leaser *leaser; /* lookups' leases */
	pconn *conns;
	dead_peer dead[ECX_DEAD_MAX];
	unsigned ndead;    /* entries written, the next at ndead % MAX */
	uint64_t watch_ns; /* atomic: the last cons_pconns_watch */
	int bg_driver;     /* atomic: a notified load's thread drives the worker
	                    * (notify.c) */
	pull *inflight;
	uint64_t next_req;
	/* receive arena */
	region arena;
	void *arena_base;
	ecx_alloc alloc;
	arena_alloc *allocs;
	size_t nallocs, cap_allocs;
	/* zero-byte items name this, so every item has a destination */
	char zero[64];
	/* caller memory */
	regcache *rcache;
	bool hooked;
	ecx_consumer_stats st;
	uint64_t st_quarantined; /* arena allocations held by zombies */
	/* Mooncake's wire (mooncake.c): the mode (CONS_MC_*), where the
	 * receiver listens and what host its session names (NULL: the
	 * defaults), the receiver (started under lock at the first load that
	 * needs it, NULL before), the ZeroMQ context of the reference's pulls
	 * (the rendezvous client's) and their idle REQ sockets (under
	 * lock). */
	int mc_mode;
	char *mc_bind, *mc_host;
	ecx_mc_recv *mc;
	void *mc_zctx;
	struct mcsock *mc_idle;
	unsigned mc_nidle;
	/* Reference pulls that timed out unanswered: each keeps its socket
	 * and its receive-arena destination quarantined until the
	 * producer's late answer, or ECX_MC_ZOMBIE_MS (under lock). */
	struct mczombie *mc_zombies;
};

/* How long a timed-out reference pull's destination stays quarantined
 * at most: past the reference's own transfer timeout (30 s, and 1 ns per
 * byte). */
#define ECX_MC_ZOMBIE_MS 60000

/* consumer_params.mooncake */
#define CONS_MC_AUTO 0
#define CONS_MC_OFF 1
#define CONS_MC_FORCE 2

/* replies.c */
/* Takes the pull numbered req out of the in-flight list (NULL if it is not
 * there). Called with c->lock. */
pull *cons_pull_take(ecx_consumer *c, uint64_t req);
/* Fails every item of p and ends it. Called with c->lock. */
void cons_pull_fail(pull *p, int err);
/* Marks every item of p (with p->dstat allocated) as not come yet. */
void cons_pull_data_init(pull *p);
/* ECX_AM_DATA messages taken in this process, ECX_AM_REPLY messages, and
 * data messages with the reply at the front of their body (atomic; for
 * tests). */
extern uint64_t cons_data_messages, cons_reply_messages, cons_lead_messages;
/* ECX_AM_LANDED notices taken, and items hashed by a waiting caller
 * before their load's end, in this process (atomic; for tests). */
extern uint64_t cons_landed_messages, cons_hashed_early;
/* An item's hstate (ecx_load): its bytes are in; hashed. */
#define HASH_LANDED 1
#define HASH_DONE 2
/* With integrity on: hashes (XXH3) one item of l whose bytes have landed
 * and that is not hashed yet; returns 1 if it did, else 0. Called by the
 * thread waiting for l, without the lock. */
int cons_load_hash_landed(ecx_load *l);
/* Item i's XXH3 where it landed, every byte of it in: the rest of a hash
 * begun as its pieces landed, or all of it. Called by the thread waiting
 * for l, without the lock, once l's pulls are over. */
uint64_t cons_item_xxh3(ecx_load *l, size_t i);
/* With integrity on, once l's pulls are over: every item that arrived is
 * hashed where it landed and compared with the producer's hash; an item
 * without one fails ECX_EUNSUPPORTED, one that differs ECX_ECORRUPT. Called
 * by the thread waiting for l, without the lock. */
void cons_load_verify(ecx_load *l);
/* A data frame of items first..first+count-1 of pull req, len bytes, is
 * about to be read from lane: where it goes (marked landing), or NULL when
 * no pull of that lane's connection waits for it there (drop it). Takes
 * c->lock. */
char *cons_data_begin(ecx_consumer *c, const cons_lane *lane, uint64_t req,
                      uint32_t first, uint32_t count, size_t len);
/* Those items' receive ended with status (0: landed); the pull ends if
 * its reply came. Takes c->lock. */
void cons_data_end(ecx_consumer *c, uint64_t req, uint32_t first,
                   uint32_t count, int status);
/* With integrity on: the first upto bytes of item first of pull req
 * (a data frame of that item alone, being read) are in, for the waiting
 * caller to hash on while the rest comes. Takes c->lock. */
void cons_data_piece(ecx_consumer *c, const cons_lane *lane, uint64_t req,
                     uint32_t first, uint64_t upto);
/* The reply body of pull req (from lane, for a pull of its connection;
 * NULL: an active message, any) is taken. Takes c->lock. */
void cons_reply_take(ecx_consumer *c, const cons_lane *lane, uint64_t req,
                     const void *body, size_t len);

/* lane.c */
#define ECX_LANE_MIN_DEFAULT ((uint64_t)128 << 10)
extern uint64_t cons_lane_frames, cons_lanes_opened;
/* c->lane_min from the environment (ECX_TCP_LANE, ECX_TCP_LANE_MIN); 0
 * where data goes as puts. ECX_EINVAL, with why, for a bad value. */
int cons_lane_min(bool data_am, uint64_t *out, char *why, size_t whylen);
/* Opens pc's data lane where the hello's answer z offers one and c asks
 * for lanes (pc->lane; a lane that cannot be opened in 200 ms is none,
 * with a warning). Not under c->lock (pc is not visible yet). */
void cons_lane_open(ecx_consumer *c, pconn *pc, const ecx_zresp *z);
/* Stops l reading for good (a frame being read fails): nothing lands
 * after it returns. NULL: no-op. Never with c->lock. */
void cons_lane_kill(cons_lane *l);
/* Takes a reference to l (returned). Called with c->lock. */
cons_lane *cons_lane_ref_locked(cons_lane *l);
/* Drops a reference to l, freeing it at the last. Takes c->lock. */
void cons_lane_put(ecx_consumer *c, cons_lane *l);
/* The lanes of l's pulls still waited for, each referenced (up to cap;
 * cons_lane_put each). Takes c->lock. */
size_t cons_load_lanes(ecx_load *l, cons_lane **out, size_t cap);
/* Reads what l's pulls' lanes hold, without blocking: how many reads
 * took bytes. Never with c->lock. */
int cons_load_read_lanes(ecx_load *l);
/* Allocates (with integrity on) and frees l's hashing state. */
bool cons_load_hash_init(ecx_load *l, size_t n);
void cons_load_hash_free(ecx_load *l);
/* The handlers of ECX_AM_REPLY, ECX_AM_DATA and ECX_AM_LANDED. */
ucs_status_t cons_am_reply(void *arg, const void *header, size_t header_len,
                           void *data, size_t length,
                           const ucp_am_recv_param_t *param);
ucs_status_t cons_am_data(void *arg, const void *header, size_t header_len,
                          void *data, size_t length,
                          const ucp_am_recv_param_t *param);
ucs_status_t cons_am_landed(void *arg, const void *header, size_t header_len,
                            void *data, size_t length,
                            const ucp_am_recv_param_t *param);

/* conns.c */
/* Gives every pull of l a working connection (p->pc) to its producer and
 * calls ready for it at once; makes the missing ones: all hellos at once,
 * and goodbyes to replaced connections that still hold zombies (a
 * "closed" answer ends them), all bounded by the load's deadline, no lock
 * held across the network. A pull that gets no connection has its items
 * failed (and no ready). */
typedef void (*cons_ready_fn)(ecx_consumer *c, ecx_load *l, pull *p);
void cons_pconns_get(ecx_consumer *c, ecx_load *l, cons_ready_fn ready);
void cons_pconn_close(ecx_consumer *c, pconn *pc);

/* Says goodbye to every producer, in parallel, waiting up to
 * ECX_BYE_WAIT_MS (and the timeout) for the answers; ends the zombies of
 * the connections whose producer answered "closed". For destroy. */
void cons_pconns_bye(ecx_consumer *c);

/* consumer.c: the engines of ecx_consumer_create, _destroy and
 * _stats_get (ecx.h has their contracts), on a consumer of this process;
 * and the count of ids a lookup asked the registries for. */
int cons_create(const ecx_consumer_params *pp, ecx_consumer **out, char *why,
                size_t whylen);
void cons_destroy(ecx_consumer *c);
void cons_stats_get(ecx_consumer *c, ecx_consumer_stats *out);
void cons_lookups_count(ecx_consumer *c, size_t n);

/* load.c: a load that ends by deadline_ns (retry: a failover's, not
 * counted as new loads; sync: waited for at once, see ecx_load), and its
 * wait without failover, which frees it; why gets the detail of a failure
 * the load recorded (may be NULL). */
int cons_load_start(ecx_consumer *c, ecx_item *items, size_t n,
                    uint64_t deadline_ns, bool retry, bool sync,
                    ecx_load **out);
int cons_load_wait_once(ecx_load *l, char *why, size_t whylen);
/* load.c: whether every pull of l has ended (never blocks, progresses
 * nothing). */
bool cons_load_done(ecx_load *l);
/* load.c: one progress of l, 0 when it has ended (ecx_load_test). */
int cons_load_test(ecx_load *l);

/* failover.c: the end of a load: its wait (load.c), then the items that
 * failed tried at their other holders within the load's deadline, then l
 * freed. Returns 0 or the first item's error, with the detail in the last
 * error. failover.c calls load.c, never the other way. */
int cons_load_wait(ecx_load *l);

/* memory.c: the engines of ecx_consumer_arena, _alloc and _free (ptr
 * not NULL), each taking c->lock as it needs. */
void *cons_arena(ecx_consumer *c, uint64_t *capacity);
void *cons_alloc(ecx_consumer *c, size_t nbytes);
void cons_free(ecx_consumer *c, void *ptr);
/* notify.c: a load that says its end on fd (-1: none), msg and the
 * items' statuses, started here or (handshakes) by a thread of its own,
 * which sleeps on it and ends it unless a caller's test has; its test and
 * its wait (which joins the thread and frees it). */
#define ECX_NOTIFY_MSG_MAX 65536u
int cons_load_notify(ecx_consumer *c, ecx_item *items, size_t n,
                     uint64_t deadline_ns, int fd, const void *msg, size_t len,
                     ecx_load **out);
int cons_bg_test(ecx_load *l);
int cons_bg_wait(ecx_load *l);

/* memory.c. Called with c->lock. */
/* The unmap hook, on any thread that unmaps; arg: c->rcache, nothing
 * else of the consumer. */
void cons_on_unmap(ucm_event_type_t type, ucm_event_t *ev, void *arg);
/* A region is made or dropped: the Mooncake receiver's buffers, when it
 * runs, follow it. */
void cons_mc_region(ecx_consumer *c, const region *r, bool add);
void cons_region_drop(ecx_consumer *c, region *r);
/* The allocation of the receive arena that holds addr, or NULL; and the
 * end of one quarantine of the allocation at offset off (given back when
 * the caller has freed it and no other holds it). */
arena_alloc *cons_arena_alloc_at(ecx_consumer *c, uint64_t addr);
void cons_arena_unquarantine(ecx_consumer *c, uint64_t off);
/* Makes p (timed out, still in c->inflight) a zombie: quarantines the
 * receive-arena allocations its items land in. */
void cons_zombie_make(ecx_consumer *c, pull *p);
/* Ends zombie p (taken out of c->inflight): unpins its regions, gives back
 * the quarantined allocations the caller has freed, frees p. */
void cons_zombie_end(ecx_consumer *c, pull *p);
region *cons_region_for(ecx_consumer *c, void *ptr, uint64_t n, uint64_t lo,
                        uint64_t hi, int *err);
/* Before a pull into [lo, hi) that neither the receive arena nor a cached
 * registration covers: makes the pages of it that are not resident
 * (mincore) resident and writable (MADV_POPULATE_WRITE), in the caller's
 * thread, as a reader of a file faults its own buffer in. Else the
 * producer's writes into memory never touched fault it in a page at a
 * time (over shared memory with cma, from the producer's process, at a
 * fraction of this speed). Returns the pages populated (counted in the
 * stats). Called without c->lock. */
uint64_t cons_span_populate(ecx_consumer *c, uint64_t lo, uint64_t hi);

/* mooncake.c. Whether item x of a load goes over Mooncake's wire (its
 * producer speaks only the reference's protocol, or mode force). */
bool cons_mc_wants(const ecx_consumer *c, const ecx_item *x);
/* Sends the reference's pull for the n items of l at idx (each reserved
 * in the receiver until l's deadline), without waiting; an item that
 * cannot go is failed with its reason in l->why. */
void cons_mc_start(ecx_consumer *c, ecx_load *l, const size_t *idx, size_t n);
/* Takes the answers that have come (never blocks); returns how many. */
int cons_mc_poll(ecx_load *l);
/* Whether every reference pull of l has its answer. */
bool cons_mc_done(const ecx_load *l);
/* After l's wait: the pulls not answered time out; no byte lands in any
 * of l's ranges through the receiver once this returns. Frees l->mc. */
void cons_mc_finish(ecx_load *l);
/* Starts the receiver (and advertises the memory it may take) if it is not
 * running. Called with c->lock. */
int cons_mc_ensure(ecx_consumer *c, char *why, size_t whylen);
/* Parses the mooncake setting (NULL: ECX_MOONCAKE, else auto). */
int cons_mc_mode(const char *s, int *mode, char *why, size_t whylen);
/* Adds the receiver's counters to st; stops the receiver and frees what
 * mooncake.c holds. */
void cons_mc_stats(ecx_consumer *c, ecx_consumer_stats *st);
void cons_mc_destroy(ecx_consumer *c);

/* push.c: the engines of ecx_consumer_mooncake_session, _push_open,
 * _push_renew and _push_close (ecx.h has their contracts), on arguments
 * the public call checked; they take c->lock and set the last error.
 * cons_push_close returns the bytes that landed, and their XXH3 in *xxh3
 * where *whole (ecx_mc_recv_release_hashed). */
int cons_mc_session(ecx_consumer *c, const char **session);
int cons_push_open(ecx_consumer *c, const void *dst, uint64_t nbytes,
                   uint64_t timeout_ms, bool hashed, uint64_t *id);
int cons_push_renew(ecx_consumer *c, uint64_t id, uint64_t timeout_ms);
uint64_t cons_push_close(ecx_consumer *c, uint64_t id, uint64_t *xxh3,
                         bool *whole);

#endif /* ECX_CONSUMER_H */
