/*
 * producer.h - the producer role's internal header: its state and what its
 * files share. The role is one object (ecx_producer) in these files,
 * which the public calls (api/producer.c: their argument checks, the
 * handle's process) call into:
 *   producer.c  lifecycle (create, destroy), stats
 *   table.c     the item table, LRU list and pins (a leaf: calls no other
 *               file of the role)
 *   items.c     put and remove, eviction
 *   publish.c   publishing to the embedded or a remote registry
 *   serve.c     the pull service: jobs, puts or data sends, replies
 *   completions.c  a job's completions: flush, sends, landed notices
 *   conns.c     consumer connections: failure, idle close, reaping
 *   rkeys.c     a connection's remote keys and prefaulting
 *   hello.c     the rendezvous requests (hello, the reference's pull)
 *   refpull.c   the reference's pull served: writes into its Mooncake
 *               session (mooncake/writer.h) on threads of its own
 *   lease.c     leases: pins a lookup takes until the pull, a release or
 *               the expiry
 *   lane.c      data lanes (TCP): taking them, and the frames of pulls
 *               that asked for one
 *
 * May include: every layer below (core, wire, mem, xfer, rdv, dir,
 * registry). Never: consumer/. Locking: p->lock guards the items, the
 * allocator, the LRU list, the connections and the pull jobs; it is never
 * held across a registry call, a network wait or a memcpy of item bytes.
 */
#ifndef ECX_PRODUCER_H
#define ECX_PRODUCER_H

#include "dir/dir.h"
#include "mem/alloc.h"
#include "mooncake/writer.h"
#include "rdv/rdv.h"
#include "registry/server.h"
#include "xfer/ucx.h"

#include <pthread.h>

#define MAX_CONNS 4096
#define RKEY_CACHE 64 /* as many as one pull may name */
#define PREFAULT_CHUNK (2u << 20)
/* How long a goodbye waits for the connection's pulls in flight to end
 * before it answers (on the rendezvous thread, which serves hellos too:
 * short). A consumer that is told "not yet" asks again. */
#define BYE_WAIT_MS 50

typedef struct item {
	struct item *hnext;               /* hash chain */
	struct item *lru_prev, *lru_next; /* most recent at the head */
	uint64_t hash;
	uint64_t off;    /* in the arena */
	unsigned pins;   /* pulls reading it now */
	unsigned leases; /* leases on it now: not evicted while any */
	bool ready;      /* bytes in place and published */
	bool doomed;     /* removed while pinned: freed at the last unpin */
	/* With integrity on, hashes of the bytes: XXH3 set at put; xxh64,
	 * which older consumers check, made at the first pull that asks for
	 * it (serve.c, on the progress thread) and kept. */
	uint64_t xxh3, xxh64;
	bool has_xxh64;
	ecx_tensor_desc desc;
	char id[ECX_ID_MAX + 1];
} item;

/* A consumer's remote key, unpacked once and kept: for shared memory,
 * unpacking maps the consumer's segment into this process, and a fresh
 * mapping costs a page fault per page on the next write. */
typedef struct rkey_ent {
	uint64_t base, len;
	unsigned char *kbuf;
	size_t klen;
	ucp_rkey_h h;
	unsigned refs; /* jobs using it now */
	uint64_t used;
	char *local;      /* the region mapped here (shared memory), or NULL */
	uint8_t *touched; /* per PREFAULT_CHUNK of it: pages mapped here */
} rkey_ent;

typedef struct prod_lane prod_lane;
struct lane_msg;

typedef struct conn {
	uint64_t id;
	ucp_ep_h ep; /* made at the first pull */
	/* Over shared memory, the worker this connection's endpoints live on
	 * (its destroy is what lets go of the consumer's segments); NULL: the
	 * producer's own worker. */
	ecx_ucx_side *side;
	void *addr; /* the consumer's worker address, from its hello */
	size_t addr_len;
	uint64_t used_ns; /* hello, or a pull's start or end: idle since */
	/* The wall clock sent in the hello's answer, and the monotonic clock
	 * then: a pull's expiry (in that wall clock) is turned into monotonic
	 * time, so a later step of either wall clock changes nothing. */
	uint64_t hello_wall_ms, hello_mono_ms;
	unsigned transport; /* ECX_TR_SHM or ECX_TR_TCP, agreed in the hello */
	bool failed;        /* the endpoint reported an error: close it */
	/* atomic: the producer is being destroyed and no pull was in
	 * progress: none starts, and a goodbye (ECX_AM_BYE) goes once the
	 * progress thread has stopped (serve.c prod_serve_shutdown) */
	bool closing;
	bool drained; /* its side was drained before its close (conns.c) */
	bool closed;  /* its endpoint is closed; freed when jobs is 0 */
	uint64_t closed_ns;
	unsigned jobs; /* active jobs on it */
	/* Over TCP: the key its hello's answer gave for its data lane, and
	 * the lane once the consumer took it (set once, by the acceptor,
	 * under the lock; read atomically; freed with the connection). */
	unsigned char lane_key[ECX_LANE_KEY_LEN];
	prod_lane *lane;
	rkey_ent rk[RKEY_CACHE];
	struct conn *next;
	struct ecx_producer *p;
} conn;

/* A lease: item it pinned until expires_ns, unless a pull, a release or
 * the item's removal ends it first. Kept in a hash by number and in a list
 * by expiry (most leases have the same length, so a new one goes at or
 * near the tail). */
typedef struct lease {
	struct lease *hnext;
	struct lease *prev, *next;
	uint64_t num;
	uint64_t expires_ns;
	item *it;
} lease;

#define LEASE_BUCKETS 4096
#define MAX_LEASES 65536

/* One active-message send of a job's data (a pull with data_am). */
typedef struct job_send {
	struct job *j;
	ecx_am_data_hdr h; /* UCX may read it until the send completes */
	int status;        /* the send's, for its items */
	uint64_t upto;     /* a piece's landed notice: its body (else 0) */
	/* A data send by rendezvous for a pull with lead: its header and
	 * its body's two parts (padding, the items' bytes), which UCX may
	 * read until the send completes. */
	ecx_am_lead_hdr lh;
	ucp_dt_iov_t iov[2];
} job_send;

/* Why a reference pull was refused (the /metrics reason label). */
enum {
	REF_UNKNOWN_ID,  /* unknown mm_hash */
	REF_SIZE,        /* size mismatch */
	REF_TOKEN,       /* the producer asks a token; the op carries none */
	REF_DISABLED,    /* the producer was started with mooncake off */
	REF_BUSY,        /* too many reference pulls queued */
	REF_DESTINATION, /* outside the session's buffers, or refused there */
	REF_TIMEOUT,     /* the write did not end by the deadline */
	REF_UNREACHABLE, /* the session's ports cannot be reached */
	REF_FAILED,      /* any other failure of the write */
	REF_NREASONS
};

/* A reference pull waiting for, or in, a write. */
typedef struct ref_task {
	struct ref_task *next;
	ecx_rdv_ticket *ticket;
	item *it; /* pinned */
	const void *src;
	uint64_t nbytes, dst_ptr, deadline_ns;
	char session[ECX_ADDR_MAX];
} ref_task;

/* Threads that write reference pulls: one more is started while every
 * one is busy, up to REF_THREADS, so a receiver that stalls holds up one
 * thread until its pull's deadline, not the others' pulls. */
#define REF_THREADS 8
#define REF_QUEUE_MAX 1024

/* One pull, from its arrival to its reply. */
typedef struct job {
	struct job *next;
	uint64_t conn_id, req;
	char *msg; /* the JSON body */
	size_t len;
	/* while writing: */
	ecx_pull_req pr;
	item **items;  /* pinned item per request item, NULL if failed */
	int *status;   /* per request item */
	uint64_t *xxh; /* per request item, with integrity on */
	int hash_kind; /* what xxh holds: ECX_HASH_XXH64 or _XXH3 */
	/* Puts followed by landed notices (the pull asked "landed"): sends
	 * holds one per notice. */
	bool landed;
	/* Its data and reply go on its connection's lane (it asked, and
	 * the connection had one when it started). */
	prod_lane *lane;
	rkey_ent **rkeys; /* per region, entries of the connection's cache */
	rkey_ent *own;    /* per region, the job's own when the cache is full */
	conn *c;
	job_send *sends; /* data_am or landed: one per send posted (freed
	                    with j) */
	size_t nsends;
	/* Completions still to come (atomic): the flush, or each send of the
	 * data and the end of posting them. The last one marks j done. */
	unsigned pending;
	uint64_t deadline_ns;
	bool flushing, done;
	/* Given up with its flush (or sends) still in UCX (a peer dead over
	 * shared memory): the last callback frees it, if it ever runs. */
	bool abandoned;
	int flush_status;
	/* The reply went inside the data message (a pull with fold whose
	 * bytes are one message): fold_hdr is that message's header, the
	 * data header then the reply's JSON, which UCX may read until the
	 * send completes (freed with j). The pull was counted in the
	 * producer's stats as that reply says, before the send (a consumer
	 * that has its answer sees it counted); pre_* is what was counted. */
	bool folded;
	char *fold_hdr;
	/* Where the reply is at the front of the body (a pull with lead):
	 * the body's two parts, the lead and the items' bytes (inside
	 * fold_hdr's allocation). */
	ucp_dt_iov_t *fold_iov;
	uint64_t pre_served, pre_failed, pre_bytes;
} job;

struct ecx_producer {
	int pid; /* the creating process: calls from another are refused */
	pthread_mutex_t lock;
	/* arena */
	void *base;
	ucp_mem_h memh;
	ecx_alloc alloc;
	/* items */
	item **buckets;
	size_t nbuckets, nitems;
	item *lru_head, *lru_tail;
	/* identity */
	char address[ECX_ADDR_MAX];  /* producer_zmq */
	char domain[ECX_DOMAIN_MAX]; /* who can share memory with it */
	uint64_t epoch;
	char *token;
	size_t token_len;
	int timeout_ms;
	int idle_ms; /* connections idle this long are closed */
	/* This process's start time (ecx_pid_start), told in hellos. */
	uint64_t pid_start;
	/* registry */
	ecx_registry *registry; /* embedded, or NULL */
	ecx_regclient *remote;  /* remote, or NULL */
	int ttl_s;      /* of remote entries; renewed every third of it */
	bool integrity; /* hash items at put, send hashes with replies */
	/* Tests only: ECX_TEST_PULL_DELAY_MS, a pause before each item of a
	 * pull, for a producer that is slow rather than stopped. */
	unsigned test_delay_ms;
	/* Tests only: ECX_TEST_PUT_ONLY, a producer that puts whatever the
	 * pull asks, as one older than data_am does. */
	bool test_put_only;
	/* Tests only: ECX_TEST_HASH_XXH64, a producer that answers every
	 * pull with xxh64 and sends no landed notices, as one older than
	 * XXH3 did. */
	bool test_hash_legacy;
	/* Whether a pull's only rendezvous message over TCP gets padding
	 * before the items' bytes, where the pull asks for a lead
	 * (serve_data.c): where this CPU copies slowly a few bytes off a page
	 * (ecx_copy_offset_slow), or as ECX_TEST_RNDV_LEAD says (tests: "0"
	 * off, any other value on). */
	bool rndv_lead;
	/* The largest active-message header the workers take (UCX's
	 * max_am_header), asked once by the progress thread; 0: not yet. */
	size_t am_hdr_max;
	bool redis;
	bool hold_ready; /* the embedded registry is starting until set_ready */
	/* The publisher (publish.c) alone uses `remote`. Its queue and state
	 * are under pub_lock, never held across a registry call. */
	pthread_t pub_thread;
	pthread_mutex_t pub_lock;
	pthread_cond_t pub_cond; /* work for the publisher */
	pthread_cond_t pub_done; /* a waited op is done */
	struct pub_op *pub_head, *pub_tail;
	size_t pub_dels;         /* removals queued */
	uint64_t pub_down_until; /* registry down: next try then; 0 up */
	uint64_t pub_backoff_ms; /* the next back-off */
	char pub_down_why[256];
	/* The outage under way: since when, whether the log said it (once;
	 * a failure its caller reports is not said here), and when it last
	 * said it is still going on. */
	uint64_t pub_down_since, pub_down_told;
	bool pub_down_said;
	bool pub_inited, pub_running, pub_stop;
	/* data plane */
	ecx_ucx *ucx;
	conn *conns;
	size_t nconns;
	uint64_t next_conn;
	job *queue, *queue_tail; /* arrived, not yet started */
	job *active;             /* writing or flushing */
	/* leases */
	lease *lbuckets[LEASE_BUCKETS];
	lease *lhead, *ltail;             /* by expiry, soonest first */
	uint64_t lease_max_ms, lease_cap; /* cap: bytes leased at most */
	uint64_t lease_rng;
	bool closing; /* destroy has begun: the registry takes no lease */
	/* rendezvous */
	ecx_rdv_server *rdv;
	/* data lanes (lane.c): the listening socket (-1: none), its port,
	 * the acceptor thread and the pipe that stops it; lanes taken and
	 * refused (atomic) */
	int lane_ls, lane_wake[2];
	unsigned lane_port;
	pthread_t lane_th;
	bool lane_thread;
	uint64_t lanes_taken, lanes_refused;
	/* Tests only (ECX_TEST_LANE_FRAME): data frames made wrong on
	 * purpose, 'magic' (a frame no consumer reads) or 'req' (the data of
	 * a pull nobody waits for); 0 none. */
	int lane_test_frame;
	/* Frames the lanes' writers have done with, for the progress thread
	 * to complete (prod_lanes_complete), under lane_mu. */
	pthread_mutex_t lane_mu;
	struct lane_msg *lane_done, *lane_done_tail;
	/* reference pulls (refpull.c): ref_lock guards the queue and the
	 * threads; the counters are atomic */
	bool mooncake; /* serve them (ECX_PRODUCER_PARAM_MOONCAKE) */
	ecx_mc_writer *mc;
	pthread_mutex_t ref_lock;
	pthread_cond_t ref_cond;
	ref_task *ref_head, *ref_tail;
	size_t ref_queued;
	unsigned ref_threads, ref_idle;
	bool ref_stop;
	pthread_t ref_thr[REF_THREADS];
	uint64_t ref_pulls, ref_bytes, ref_refused[REF_NREASONS];
	ecx_producer_stats st;
};

/* producer.c: the engines of ecx_producer_create, _destroy, _stats_get,
 * _set_ready and _registry_port (ecx.h has their contracts). destroy and
 * stats_get take a producer of this process. */
int prod_create(const ecx_producer_params *pp, ecx_producer **out, char *why,
                size_t whylen);
void prod_destroy(ecx_producer *p);
void prod_stats_get(ecx_producer *p, ecx_producer_stats *out);
void prod_set_ready(ecx_producer *p);
uint16_t prod_registry_port(const ecx_producer *p);

/* items.c: the engines of ecx_producer_put(_stored), _reserve (op names
 * the call in the error detail: "put", "reserve"), _commit, _cancel and
 * _remove, on arguments the public call checked (p, desc and dst not
 * NULL); they set the last error. */
int prod_put(ecx_producer *p, const char *id, const ecx_tensor_desc *desc,
             const void *src, int *stored);
int prod_reserve(ecx_producer *p, const char *op, const char *id,
                 const ecx_tensor_desc *desc, void **dst);
int prod_commit(ecx_producer *p, const char *id);
int prod_cancel(ecx_producer *p, const char *id);
int prod_remove(ecx_producer *p, const char *id);

/* table.c: the item table, the LRU list and the pins. Called with p->lock
 * held. */
/* The item of id (ready or not), or NULL. */
item *prod_item_find(ecx_producer *p, const char *id);
/* Puts it in the table, at the head of the LRU list. */
void prod_item_insert(ecx_producer *p, item *it);
/* Takes it out of the table and the LRU list; the caller frees or dooms. */
void prod_item_unlink(ecx_producer *p, item *it);
/* Gives its bytes back to the arena and frees it (unlinked, unpinned). */
void prod_item_free(ecx_producer *p, item *it);
/* Marks it the most recently wanted (the head of the LRU list). */
void prod_item_touch(ecx_producer *p, item *it);
/* Pins it (a pull reads it now) and counts it pinned when it was not. */
void prod_item_pin(ecx_producer *p, item *it);
/* Ends one pin; at the last, it is no longer counted pinned, and freed
 * when it was removed meanwhile (doomed). */
void prod_item_unpin(ecx_producer *p, item *it);

/* lease.c. Called with p->lock held. */
/* Ends the leases past their expiry. */
void prod_leases_expire(ecx_producer *p);
/* Ends lease num if it is on item it; true when it did (a pull's). */
bool prod_lease_use(ecx_producer *p, uint64_t num, item *it);
/* Ends every lease on it (it is being removed). */
void prod_leases_drop_item(ecx_producer *p, item *it);
/* Ends every lease (destroy). */
void prod_leases_clear(ecx_producer *p);
/* lease.c: the rendezvous's "lease" and "release" answers. Take the lock. */
char *prod_lease_answer(ecx_producer *p, const ecx_zreq *r);
/* lease.c: ecx_producer_lease and ecx_producer_lease_end (arguments
 * checked): a lease this process takes on its own item, as the "lease"
 * answer grants one, and its end. Take the lock; lease_own sets the last
 * error. */
int prod_lease_own(ecx_producer *p, const char *id, int ms, uint64_t *num);
bool prod_lease_end_own(ecx_producer *p, uint64_t num);
/* lease.c: the embedded registry's leases in lookups (an
 * ecx_registry_lease_fn; arg is the producer). Takes the lock. */
void prod_lease_lookup(void *arg, ecx_lookup_item *items, size_t n,
                       uint64_t ms);
char *prod_release_answer(ecx_producer *p, const ecx_zreq *r);

/* publish.c. Called without p->lock. prod_publish returns once id is in
 * the registry, or with why it is not (at most timeout_ms; at once while
 * a remote registry is known to be down). prod_unpublish_many returns
 * once the ids left the registry, or were queued because it cannot be
 * reached (they leave when it is back), or after timeout_ms (queued). */
int prod_publisher_start(ecx_producer *p, char *why, size_t whylen);
/* Stops the publisher and unpublishes every item held (bounded: stops at
 * the first removal an unreachable registry does not take). */
void prod_publisher_stop(ecx_producer *p);
int prod_publish(ecx_producer *p, const char *id, const ecx_tensor_desc *d,
                 char *why, size_t whylen);
void prod_unpublish(ecx_producer *p, const char *id);
void prod_unpublish_many(ecx_producer *p, const char (*ids)[ECX_ID_MAX + 1],
                         size_t n);
/* Called with pub_lock held: queues the removal of id, no wait. */
void prod_unpublish_queue(ecx_producer *p, const char *id);
/* Removals waiting for an unreachable registry. */
size_t prod_unpublish_pending(ecx_producer *p);

/* serve.c */
ucs_status_t prod_am_pull(void *arg, const void *header, size_t header_len,
                          void *data, size_t length,
                          const ucp_am_recv_param_t *param);
void prod_progress(void *arg);
/* Fails what is in flight, closes every endpoint, frees every job and
 * connection. Called once, by destroy, before the worker goes. */
void prod_serve_shutdown(ecx_producer *p);

/* serve_data.c */
/* Sends items i..k-1 of job j's pull (len bytes from src, neighbours in
 * both memories) as one ECX_AM_DATA message; returns what ucp_am_send_nbx
 * returned, after counting a send in flight as one of j's completions.
 * The pull's last bytes, for a pull with fold, carry its reply
 * and go eagerly up to FOLD_EAGER_MAX (the reply at the front of the
 * body, for a pull with lead): the load is then one message each way, as
 * a socket's request and answer are. For a pull with lead, its only
 * message, sent by rendezvous, has padding before the items' bytes where
 * this CPU needs it (p->rndv_lead). */
ucs_status_ptr_t prod_data_send(ecx_producer *p, job *j, size_t i, size_t k,
                                void *src, uint64_t len);
/* Whether a producer pads a pull's only rendezvous message (p->rndv_lead):
 * where this CPU copies slowly to where UCX puts the body's first byte
 * (ecx_copy_offset_slow), or as ECX_TEST_RNDV_LEAD says; logged at debug. */
bool prod_rndv_lead(void);

/* Gives up the unfinished jobs of closed connection c (unpins, counts
 * failed, frees each at its last callback). Called with p->lock, on the
 * progress thread. */
void prod_jobs_abandon(ecx_producer *p, conn *c);

/* jobs.c: a job's end (its reply, counts, pins and release), used by the
 * pull service (serve.c). Progress thread only; each says whether it
 * wants p->lock held. */
/* The reply of job j as it stands (err: for the whole pull). */
ecx_pull_resp prod_job_resp(const job *j, int err, const char *detail);
/* Sends the reply of job j (when its connection still works). */
void prod_job_reply(job *j, int err, const char *detail);
/* Job j's items as its statuses stand: served (and their bytes), failed. */
void prod_job_tally(const job *j, uint64_t *served, uint64_t *failed,
                    uint64_t *bytes);
/* Takes back what a folded reply counted before its send (job_fold).
 * Called with the lock. */
void prod_job_uncount(ecx_producer *p, job *j);
/* Unpins the job's items. Called with the lock. */
void prod_job_unpin(ecx_producer *p, job *j);
/* Unpins what is still pinned and frees what the job holds but the job.
 * Called with the lock. */
void prod_job_release_parts(ecx_producer *p, job *j);
/* Unpins what is still pinned and frees the job. Called with the lock. */
void prod_job_release(ecx_producer *p, job *j);
/* The xxh64 of each item of j that has none yet (a pull from an older
 * consumer), made once and kept. Its bytes are checked against the XXH3
 * taken at put first: an item whose bytes changed since then fails with
 * ECX_ECORRUPT rather than get a hash of the changed bytes. Called from the
 * progress thread without the lock, the items pinned. */
void prod_job_hash_legacy(ecx_producer *p, job *j);

/* completions.c: UCX callbacks of a job's flush and data sends (user
 * data: the job; for sends, its job_send), and prod_landed_after, which
 * after the put of items i..k-1 of j (or, upto not 0, of item i's first
 * upto bytes) sends the landed notice once the put has completed at the
 * consumer. Each counts in j->pending; the last frees an abandoned job.
 * Progress thread only. */
void prod_job_free(job *j);
void prod_job_part_done(job *j, ucs_status_t st);
void prod_flush_done(void *request, ucs_status_t st, void *user_data);
void prod_send_done(void *request, ucs_status_t st, void *user_data);
void prod_landed_after(job *j, size_t i, size_t k, uint64_t upto);

/* conns.c */
/* The endpoint error callback of a connection (arg: the conn). */
void prod_conn_on_error(void *arg, ucp_ep_h ep, ucs_status_t st);
/* Whether closing c is its endpoint's forced close and its worker's destroy
 * back to back (a TCP connection with a worker of its own). */
bool prod_conn_goes_with_side(const conn *c);
/* Connection id, or NULL. Called with p->lock. */
conn *prod_conn_find(ecx_producer *p, uint64_t id);

/* lane.c */
/* Listens for data lanes on host (ECX_TCP_LANE_PORT, else any port) and
 * starts the acceptor; none with ECX_TCP_LANE=0. ECX_EINVAL (a setting it
 * does not know) or ECX_EIO, with why. */
int prod_lanes_start(ecx_producer *p, const char *bind, char *why,
                     size_t whylen);
/* Stops the acceptor and closes the listening socket (lanes taken stay
 * their connections'). */
void prod_lanes_stop(ecx_producer *p);
/* A fresh random key for a connection's lane (all zero, which no lane
 * matches, where the system has no entropy to give). */
void prod_lane_key(unsigned char *key);
/* Sends the bytes of send s (len from src) on lane l, counted in its job's
 * pending until sent or failed (then in s->status). Progress thread. */
ucs_status_ptr_t prod_lane_data(prod_lane *l, job_send *s, const void *src,
                                uint64_t len);
/* Sends the reply body (taken, freed) of pull req on l after the frames
 * before it; false (body freed, the lane and its connection failed) when
 * it cannot be queued. */
bool prod_lane_reply(prod_lane *l, uint64_t req, char *body);
/* Fails l: what is queued fails, the consumer sees the end. NULL: no-op. */
void prod_lane_shutdown(prod_lane *l);
/* prod_lane_shutdown, then waits until its writer sends nothing (what was
 * queued is failed, handed to prod_lanes_complete): then a job of its may
 * be abandoned. NULL: no-op. */
void prod_lane_quiesce(prod_lane *l);
/* Completes the frames the lanes' writers are done with: how many.
 * Progress thread (or the destroy, once it has stopped). */
int prod_lanes_complete(ecx_producer *p);
/* Shuts l down, joins its writer, frees it. NULL: no-op. */
void prod_lane_free(prod_lane *l);
/* Closes failed and idle connections and frees closed ones no job uses.
 * Progress thread only. */
void prod_conns_reap(ecx_producer *p);
/* Marks connection id failed (its endpoint is closed and it is freed by
 * the progress thread once no job uses it) and wakes the progress thread.
 * Returns whether the connection was there. Takes p->lock. */
bool prod_conn_drop(ecx_producer *p, uint64_t id);
/* Whether connection id is still in p->conns. Takes p->lock. */
bool prod_conn_exists(ecx_producer *p, uint64_t id);
/* Appends the producer's Prometheus lines (the embedded registry's
 * /metrics hook); returns what snprintf would. */
size_t prod_metrics(void *arg, char *buf, size_t len);

/* rkeys.c: the connection's cache of remote keys, and the mapping of
 * shared-memory pages ahead of a write. Progress thread only. */
rkey_ent *prod_rkey_get(conn *c, const ecx_region *g);
void prod_rkey_prefault(rkey_ent *e, uint64_t addr, uint64_t n);
void prod_rkeys_drop(conn *c);

/* hello.c: answers one rendezvous request (an rdv handler). */
char *prod_rdv_handle(void *arg, const ecx_zreq *r);

/* refpull.c. prod_ref_init and prod_ref_stop bracket the producer's life
 * (stop: before the rendezvous server goes; waits end at once, answers
 * every pull still queued or in flight). prod_ref_pull answers the
 * reference's pull on the rendezvous thread: a refusal at once, else a
 * ticket answered by a writer thread (ECX_RDV_LATER). prod_ref_refuse
 * counts a refusal decided elsewhere. prod_ref_metrics appends the
 * Prometheus lines. */
int prod_ref_init(ecx_producer *p, char *why, size_t whylen);
/* Once p->address is known: the name the writer gives peers. */
void prod_ref_named(ecx_producer *p);
void prod_ref_stop(ecx_producer *p);
char *prod_ref_pull(ecx_producer *p, const ecx_zreq *r);
void prod_ref_refuse(ecx_producer *p, int reason);
size_t prod_ref_metrics(ecx_producer *p, char *buf, size_t len);

/* push.c: ecx_producer_push_batch on a producer of this process and
 * items not NULL (n > 0) (the public calls, ecx_producer_push and
 * _push_batch, check them). Blocks the caller; sets the last error. */
int prod_push_batch(ecx_producer *p, ecx_push_item *items, size_t n,
                    uint64_t timeout_ms);
/* push.c: the engine of ecx_producer_item_xxh3 (p, id and out checked):
 * the XXH3 of held item id, kept from its put where integrity is on, else
 * hashed now from the arena with the item pinned (outside the lock). */
int prod_item_xxh3(ecx_producer *p, const char *id, uint64_t *out);

#endif /* ECX_PRODUCER_H */
