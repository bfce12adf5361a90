/*
 * push_floor.c - the least time a push over shared memory can take on this
 * machine when the op and the ready event travel between processes: its
 * copies and those two messages, with nothing else.
 *
 * Two processes. The encoder (this one) wrote each item's bytes into
 * shared memory beforehand; the shard (a child) copies them into its own
 * pre-faulted memory, which is the whole data path of the best push there
 * is (ecx's fetch pulls with cross-memory attach, a copy of the same
 * kind). Both sides rotate over 96 MiB of slots, so a push's sources and
 * destinations are out of the CPU's caches, as push_shm.py's cold copy is.
 * A push carries --batch items (one op, as reserve_batch / complete_batch
 * and ecx_fetch carry many). Per repetition, in turn, each after an idle
 * --gap-us (the shard parked in its receive, as between real pushes):
 *   copy  the shard's cold copies alone, timed in the shard: the baseline;
 *   zmq   upstream's wire: the op as one frame on a REQ socket to the
 *         shard's REP, the copies, an event per item as one frame each on
 *         the shard's PUSH socket to this process's PULL, then the REP's
 *         answer (the order that costs least: nothing wakes this process
 *         before the bytes are in); timed here, from the op's send to the
 *         last event;
 *   unix  the same messages on an AF_UNIX SOCK_SEQPACKET pair, a kernel
 *         path with no I/O threads between (not the only one: a futex or
 *         a flag polled in shared memory were not measured).
 * Both messages carry the sender's CLOCK_MONOTONIC time, so each one-way
 * time is read too (one host, one clock), and the shard times its copies
 * inside each push.
 *
 *   ecx-bench-push-floor [--n N] [--gap-us US] [--batch K]
 *                        (defaults 40, 1000, 1)
 *
 * Prints medians per size and copy/push: the largest ratio against cold
 * copies that a push whose two messages take that channel can reach here,
 * before any work of its own (a table, a hash, a pull message, Python).
 * In a process that is both (vLLM's single-process executor) the event is
 * no message between processes, and this floor does not apply.
 */
#include <zmq.h>

#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define POOL (96u << 20)
/* Every receive gives up after this long (a peer gone or stuck): the
 * benchmark ends with an error, never hangs. */
#define WAIT_MS 5000
#define BATCH_MAX 64
#define N_MAX 100000

static const size_t sizes[] = {64u << 10, 1u << 20, 7u << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

/* What the encoder asks of the shard over the SEQPACKET pair, and the op
 * on either channel. */
struct cmd {
	char kind; /* 'C' copies alone, 'U' push on unix, 'Z' push on zmq,
	              'Q' quit */
	uint32_t slot, batch; /* slots slot.. slot+batch-1 (mod the pool's) */
	uint64_t nbytes;
	double sent_us;
};

/* The shard's answer to 'C', and each event of a push. */
struct reply {
	double copy_us; /* the push's copies, timed by the shard */
	double op_us;   /* the op's one way */
	double sent_us; /* when this event left */
};

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static void sleep_us(long us)
{
	struct timespec ts = {.tv_sec = us / 1000000,
	                      .tv_nsec = us % 1000000 * 1000};
	nanosleep(&ts, NULL);
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_d);
	return v[n / 2];
}

/* Bounds every receive on fd and on each ZeroMQ socket given (NULL ends
 * the list), and drops unsent frames at close. */
static void bound_waits(int fd, ...)
{
	struct timeval tv = {.tv_sec = WAIT_MS / 1000};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	va_list ap;
	va_start(ap, fd);
	for (void *z; (z = va_arg(ap, void *)) != NULL;) {
		int ms = WAIT_MS, zero = 0;
		zmq_setsockopt(z, ZMQ_RCVTIMEO, &ms, sizeof(ms));
		zmq_setsockopt(z, ZMQ_SNDTIMEO, &ms, sizeof(ms));
		zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof(zero));
	}
	va_end(ap);
}

/* The copies of c's items, from src into dst; their time in us. */
static double copy_items(char *dst, const char *src, const struct cmd *c)
{
	uint32_t k = (uint32_t)(POOL / c->nbytes);
	double t0 = now_us();
	for (uint32_t i = 0; i < c->batch; i++) {
		size_t off = (size_t)((c->slot + i) % k) * c->nbytes;
		memcpy(dst + off, src + off, c->nbytes);
	}
	return now_us() - t0;
}

/* The shard: connects to the endpoints the encoder sends first, then
 * serves its commands until 'Q', an error, or no command for WAIT_MS
 * (the encoder gone). Returns the process's exit status. */
static int shard(int fd, const char *src)
{
	char ends[2][128];
	if (recv(fd, ends, sizeof(ends), 0) != (ssize_t)sizeof(ends))
		return 1;
	char *dst = mmap(NULL, POOL, PROT_READ | PROT_WRITE,
	                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (dst == MAP_FAILED)
		return 1;
	memset(dst, 1, POOL); /* pre-faulted, as a receive arena is */
	/* A child maps its parent's shared pages at their first touch:
	 * touched here, so no copy pays page faults. */
	volatile char sink = 0;
	for (size_t i = 0; i < POOL; i += 4096)
		sink ^= src[i];
	void *ctx = zmq_ctx_new();
	void *rep = zmq_socket(ctx, ZMQ_REP), *push = zmq_socket(ctx, ZMQ_PUSH);
	bound_waits(fd, rep, push, (void *)NULL);
	int rc = 1;
	if (zmq_connect(rep, ends[0]) != 0 || zmq_connect(push, ends[1]) != 0)
		goto out;
	if (send(fd, "", 1, 0) != 1) /* ready */
		goto out;
	struct cmd c;
	for (;;) {
		if (recv(fd, &c, sizeof(c), 0) != (ssize_t)sizeof(c))
			goto out;
		if (c.kind == 'Q')
			break;
		struct reply r = {0};
		if (c.kind == 'C') {
			r.copy_us = copy_items(dst, src, &c);
			if (send(fd, &r, sizeof(r), 0) != (ssize_t)sizeof(r))
				goto out;
		} else if (c.kind == 'U') {
			r.op_us = now_us() - c.sent_us;
			r.copy_us = copy_items(dst, src, &c);
			for (uint32_t i = 0; i < c.batch; i++) {
				r.sent_us = now_us();
				if (send(fd, &r, sizeof(r), 0) !=
				    (ssize_t)sizeof(r))
					goto out;
			}
		} else { /* 'Z': the op comes on the REP socket */
			struct cmd op;
			if (zmq_recv(rep, &op, sizeof(op), 0) != sizeof(op))
				goto out;
			r.op_us = now_us() - op.sent_us;
			r.copy_us = copy_items(dst, src, &op);
			for (uint32_t i = 0; i < op.batch; i++) {
				r.sent_us = now_us();
				if (zmq_send(push, &r, sizeof(r), 0) !=
				    sizeof(r))
					goto out;
			}
			if (zmq_send(rep, "", 0, 0) != 0)
				goto out;
		}
	}
	rc = 0;
out:
	zmq_close(rep);
	zmq_close(push);
	zmq_ctx_term(ctx);
	return rc;
}

/* Reads batch events from the unix pair (z NULL) or the PULL socket z;
 * the last one in *r, when it came in *t. 0, or -1 saying why in why. */
static int events(int fd, void *z, uint32_t batch, struct reply *r, double *t,
                  const char **why)
{
	for (uint32_t i = 0; i < batch; i++) {
		ssize_t n = z != NULL ? zmq_recv(z, r, sizeof(*r), 0)
		                      : recv(fd, r, sizeof(*r), 0);
		if (n != (ssize_t)sizeof(*r)) {
			*why = n == 0  ? "the shard closed its end"
			       : n < 0 ? "no event within the bound"
			               : "an event of the wrong size";
			return -1;
		}
	}
	*t = now_us();
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f,
	        "usage: ecx-bench-push-floor [--n N (5..%d, default 40)] "
	        "[--gap-us US (0..%d, default 1000)] [--batch K (1..%d, "
	        "default 1)]\n",
	        N_MAX, WAIT_MS * 500, BATCH_MAX);
}

int main(int argc, char **argv)
{
	long n = 40, gap_us = 1000, batch = 1;
	static const struct option opts[] = {
	    {"n", required_argument, NULL, 'n'},
	    {"gap-us", required_argument, NULL, 'g'},
	    {"batch", required_argument, NULL, 'b'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		char *end = NULL;
		long v = optarg != NULL ? strtol(optarg, &end, 10) : 0;
		if (optarg != NULL && (end == optarg || *end != '\0'))
			v = -1;
		if (o == 'n')
			n = v;
		else if (o == 'g')
			gap_us = v;
		else if (o == 'b')
			batch = v;
		else {
			usage(o == 'h' ? stdout : stderr);
			return o == 'h' ? 0 : 2;
		}
	}
	/* An idle gap of half the receive bound at most, so neither side
	 * takes the other's pause for its end. */
	if (n < 5 || n > N_MAX || gap_us < 0 || gap_us > WAIT_MS * 500 ||
	    batch < 1 || batch > BATCH_MAX) {
		usage(stderr);
		return 2;
	}
	char *src = mmap(NULL, POOL, PROT_READ | PROT_WRITE,
	                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	double *t[8];
	for (int k = 0; k < 8; k++)
		t[k] = malloc(sizeof(double) * (size_t)n);
	bool oom = src == MAP_FAILED;
	for (int k = 0; k < 8; k++)
		oom = oom || t[k] == NULL;
	if (oom) {
		for (int k = 0; k < 8; k++)
			free(t[k]);
		fprintf(stderr, "push floor: out of memory\n");
		return 1;
	}
	for (size_t i = 0; i < POOL; i++) /* the encoder's output */
		src[i] = (char)(i * 131u >> 7);
	int sp[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp) != 0) {
		perror("socketpair");
		return 1;
	}
	/* The shard forks before any ZeroMQ context exists, then gets the
	 * endpoints this process bound (port 0 on loopback) over the pair. */
	fflush(stdout);
	pid_t pid = fork();
	if (pid < 0) {
		perror("fork");
		return 1;
	}
	if (pid == 0) {
		close(sp[0]);
		_exit(shard(sp[1], src));
	}
	close(sp[1]);
	int fd = sp[0];
	void *ctx = zmq_ctx_new();
	void *req = zmq_socket(ctx, ZMQ_REQ), *pull = zmq_socket(ctx, ZMQ_PULL);
	bound_waits(fd, req, pull, (void *)NULL);
	char ends[2][128] = {{0}};
	size_t len = sizeof(ends[0]);
	const char *why = NULL;
	char ok;
	if (zmq_bind(req, "tcp://127.0.0.1:*") != 0 ||
	    zmq_getsockopt(req, ZMQ_LAST_ENDPOINT, ends[0], &len) != 0 ||
	    zmq_bind(pull, "tcp://127.0.0.1:*") != 0 ||
	    (len = sizeof(ends[1]),
	     zmq_getsockopt(pull, ZMQ_LAST_ENDPOINT, ends[1], &len) != 0))
		why = zmq_strerror(zmq_errno());
	else if (send(fd, ends, sizeof(ends), 0) != (ssize_t)sizeof(ends) ||
	         recv(fd, &ok, 1, 0) != 1)
		why = "the shard did not start";
	if (why == NULL) {
		printf("push floor: cold copies (shard, shared memory -> its "
		       "own pre-faulted memory) and the two messages of a "
		       "push, %ld item(s) a push, medians of %ld, %ld us idle "
		       "before each\n",
		       batch, n, gap_us);
		printf("size      copy_us  zmq_us  zmq_op_us  zmq_event_us  "
		       "zmq_copy_us  unix_us  unix_op_us  unix_event_us  "
		       "copy/zmq  copy/unix\n");
	}
	uint32_t slot = 0;
	for (size_t s = 0; s < NSIZES && why == NULL; s++) {
		struct cmd c = {.nbytes = sizes[s], .batch = (uint32_t)batch};
		for (long i = -2; i < n && why == NULL; i++) { /* 2 untimed */
			struct reply r;
			double t1;
			/* copies alone */
			c.kind = 'C';
			c.slot = slot;
			slot += (uint32_t)batch;
			sleep_us(gap_us);
			if (send(fd, &c, sizeof(c), 0) != (ssize_t)sizeof(c) ||
			    events(fd, NULL, 1, &r, &t1, &why) != 0)
				break;
			double copy = r.copy_us;
			/* unix */
			c.kind = 'U';
			c.slot = slot;
			slot += (uint32_t)batch;
			sleep_us(gap_us);
			c.sent_us = now_us();
			if (send(fd, &c, sizeof(c), 0) != (ssize_t)sizeof(c) ||
			    events(fd, NULL, c.batch, &r, &t1, &why) != 0)
				break;
			double unx = t1 - c.sent_us, u_op = r.op_us,
			       u_ev = t1 - r.sent_us;
			/* zmq: the shard told to take its next op there */
			c.kind = 'Z';
			if (send(fd, &c, sizeof(c), 0) != (ssize_t)sizeof(c)) {
				why = "the shard closed its end";
				break;
			}
			c.slot = slot;
			slot += (uint32_t)batch;
			sleep_us(gap_us);
			c.sent_us = now_us();
			if (zmq_send(req, &c, sizeof(c), 0) != sizeof(c) ||
			    events(fd, pull, c.batch, &r, &t1, &why) != 0 ||
			    zmq_recv(req, &ok, 0, 0) != 0) {
				if (why == NULL)
					why = zmq_strerror(zmq_errno());
				break;
			}
			if (i < 0)
				continue;
			t[0][i] = copy;
			t[1][i] = t1 - c.sent_us;
			t[2][i] = r.op_us;
			t[3][i] = t1 - r.sent_us;
			t[4][i] = r.copy_us;
			t[5][i] = unx;
			t[6][i] = u_op;
			t[7][i] = u_ev;
		}
		if (why != NULL)
			break;
		double m[8];
		for (int j = 0; j < 8; j++)
			m[j] = median(t[j], (int)n);
		size_t nb = sizes[s];
		char label[32];
		snprintf(label, sizeof(label), "%zu%s",
		         nb >> 20 ? nb >> 20 : nb >> 10,
		         nb >> 20 ? "MiB" : "KiB");
		printf("%-8s %8.1f %7.1f %10.1f %13.1f %12.1f %8.1f %11.1f "
		       "%14.1f %9.2f %10.2f\n",
		       label, m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7],
		       m[0] / m[1], m[0] / m[5]);
		fflush(stdout);
	}
	int st = 0;
	if (why != NULL) { /* stopped, gone or failed: not waited for */
		fprintf(stderr, "push floor: %s\n", why);
		kill(pid, SIGKILL);
	} else {
		struct cmd q = {.kind = 'Q'};
		if (send(fd, &q, sizeof(q), 0) != (ssize_t)sizeof(q))
			kill(pid, SIGKILL);
	}
	/* The shard ends on 'Q' at once, or within WAIT_MS of this end's
	 * close: never an unbounded wait. */
	close(fd);
	waitpid(pid, &st, 0);
	zmq_close(req);
	zmq_close(pull);
	zmq_ctx_term(ctx);
	for (int k = 0; k < 8; k++)
		free(t[k]);
	munmap(src, POOL);
	if (why == NULL && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
		fprintf(stderr, "push floor: the shard failed (status %d)\n",
		        st);
		return 1;
	}
	return why != NULL;
}
