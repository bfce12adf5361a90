/*
 * push_floor.c - the least time a push over shared memory can take on this
 * machine: its one copy and the two messages every push needs between
 * processes (the op that tells the consumer's shard the bytes are there,
 * the ready event that tells its scheduler), with nothing else.
 *
 * Two processes. The encoder (this one) wrote each item's bytes into
 * shared memory beforehand; the shard (a child) copies them into its own
 * pre-faulted memory, which is the whole data path of the best push there
 * is (ecx's fetch pulls with cross-memory attach, a copy of the same
 * kind). Both sides rotate over 96 MiB of slots, so a push's source and
 * destination are out of the CPU's caches, as push_shm.py's cold copy is.
 * Per repetition, in turn, each after an idle --gap-us (the shard parked
 * in its receive, as between real pushes):
 *   copy  the shard's cold copy alone, timed in the shard: the baseline;
 *   zmq   upstream's wire: the op as one frame on a REQ socket to the
 *         shard's REP (answered at once, as ecx_fetch is), the copy, the
 *         event as one frame on the shard's PUSH socket to this
 *         process's PULL; timed here, from the op's send to the event;
 *   unix  the same two messages on an AF_UNIX SOCK_SEQPACKET pair, the
 *         fastest way between two processes here (no I/O threads).
 * Both messages carry the sender's CLOCK_MONOTONIC time, so each one-way
 * time is read too (one host, one clock).
 *
 *   ecx-bench-push-floor [--n N] [--gap-us US]   (defaults 40, 1000)
 *
 * Prints medians per size and copy/push: the largest ratio against a
 * cold copy that any push over that channel can reach here, before any
 * work of its own (a table, a hash, a pull message, Python).
 */
#include <zmq.h>

#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
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

static const size_t sizes[] = {64u << 10, 1u << 20, 7u << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

/* What the encoder asks of the shard over the SEQPACKET pair. */
struct cmd {
	char kind; /* 'C' copy alone, 'U' push on unix, 'Z' push on zmq,
	              'Q' quit */
	uint32_t slot;
	uint64_t nbytes;
	double sent_us;
};

struct reply {
	double copy_us; /* the copy, timed by the shard */
	double op_us;   /* the op's one way */
	double sent_us; /* when the event left */
};

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
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

/* Bounds every receive on fd and on each ZeroMQ socket given (NULL
 * ends the list), and drops unsent frames at close. */
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

static int slots_of(size_t nbytes)
{
	return (int)(POOL / nbytes);
}

/* The shard: serves the encoder's commands until 'Q' or its end of the
 * pair closes. */
static int shard(int fd, const char *src, const char *ends[2])
{
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
	if (zmq_connect(rep, ends[0]) != 0 || zmq_connect(push, ends[1]) != 0)
		return 1;
	struct cmd c;
	while (recv(fd, &c, sizeof(c), 0) == (ssize_t)sizeof(c) &&
	       c.kind != 'Q') {
		struct reply r = {0};
		size_t off = (size_t)c.slot * c.nbytes;
		if (c.kind == 'C') {
			double t0 = now_us();
			memcpy(dst + off, src + off, c.nbytes);
			r.copy_us = now_us() - t0;
			if (send(fd, &r, sizeof(r), 0) != (ssize_t)sizeof(r))
				return 1;
		} else if (c.kind == 'U') {
			r.op_us = now_us() - c.sent_us;
			memcpy(dst + off, src + off, c.nbytes);
			r.sent_us = now_us();
			if (send(fd, &r, sizeof(r), 0) != (ssize_t)sizeof(r))
				return 1;
		} else { /* 'Z': the op comes on the REP socket */
			struct cmd op;
			if (zmq_recv(rep, &op, sizeof(op), 0) != sizeof(op))
				return 1;
			r.op_us = now_us() - op.sent_us;
			if (zmq_send(rep, "", 0, 0) != 0) /* accepted at once */
				return 1;
			memcpy(dst + op.slot * op.nbytes,
			       src + op.slot * op.nbytes, op.nbytes);
			r.sent_us = now_us();
			if (zmq_send(push, &r, sizeof(r), 0) != sizeof(r))
				return 1;
		}
	}
	zmq_close(rep);
	zmq_close(push);
	zmq_ctx_term(ctx);
	return 0;
}

static int ask(int fd, struct cmd *c, struct reply *r)
{
	return send(fd, c, sizeof(*c), 0) == (ssize_t)sizeof(*c) &&
	               recv(fd, r, sizeof(*r), 0) == (ssize_t)sizeof(*r)
	           ? 0
	           : -1;
}

int main(int argc, char **argv)
{
	int n = 40, gap_us = 1000;
	static const struct option opts[] = {
	    {"n", required_argument, NULL, 'n'},
	    {"gap-us", required_argument, NULL, 'g'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (o == 'n')
			n = atoi(optarg);
		else if (o == 'g')
			gap_us = atoi(optarg);
		else {
			fprintf(o == 'h' ? stdout : stderr,
			        "usage: ecx-bench-push-floor [--n N (>= 5, "
			        "default 40)] [--gap-us US (>= 0, default "
			        "1000)]\n");
			return o == 'h' ? 0 : 2;
		}
	}
	if (n < 5 || gap_us < 0) {
		fprintf(stderr, "--n must be >= 5 and --gap-us >= 0\n");
		return 2;
	}
	char *src = mmap(NULL, POOL, PROT_READ | PROT_WRITE,
	                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (src == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	for (size_t i = 0; i < POOL; i++) /* the encoder's output */
		src[i] = (char)(i * 131u >> 7);
	/* This process binds both ZeroMQ sockets (port 0 on loopback) and
	 * the shard connects, so no port is guessed. */
	void *ctx = zmq_ctx_new();
	void *req = zmq_socket(ctx, ZMQ_REQ), *pull = zmq_socket(ctx, ZMQ_PULL);
	char ends[2][128];
	size_t len = sizeof(ends[0]);
	if (zmq_bind(req, "tcp://127.0.0.1:*") != 0 ||
	    zmq_getsockopt(req, ZMQ_LAST_ENDPOINT, ends[0], &len) != 0 ||
	    zmq_bind(pull, "tcp://127.0.0.1:*") != 0 ||
	    (len = sizeof(ends[1]),
	     zmq_getsockopt(pull, ZMQ_LAST_ENDPOINT, ends[1], &len) != 0)) {
		fprintf(stderr, "zmq: %s\n", zmq_strerror(zmq_errno()));
		return 1;
	}
	int sp[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp) != 0) {
		perror("socketpair");
		return 1;
	}
	fflush(stdout);
	pid_t pid = fork();
	if (pid == 0) {
		close(sp[0]);
		const char *e[2] = {ends[0], ends[1]};
		_exit(shard(sp[1], src, e));
	}
	close(sp[1]);
	int fd = sp[0];
	bound_waits(fd, req, pull, (void *)NULL);
	double *t[7];
	for (int k = 0; k < 7; k++)
		t[k] = malloc(sizeof(double) * (size_t)n);
	printf("push floor: a cold copy (shard, shared memory -> its own "
	       "pre-faulted memory) and the two messages a push needs, "
	       "medians of %d, %d us idle before each\n",
	       n, gap_us);
	printf("size      copy_us  zmq_us  zmq_op_us  zmq_event_us  "
	       "unix_us  unix_op_us  unix_event_us  copy/zmq  copy/unix\n");
	int rc = 0;
	for (size_t s = 0; s < NSIZES && rc == 0; s++) {
		size_t nb = sizes[s];
		int k = slots_of(nb), slot = 0;
		for (int i = -2; i < n && rc == 0; i++) { /* 2 untimed */
			struct cmd c = {.nbytes = nb};
			struct reply r;
			/* copy alone */
			c.kind = 'C';
			c.slot = (uint32_t)(slot++ % k);
			usleep((useconds_t)gap_us);
			if (ask(fd, &c, &r) != 0) {
				rc = 1;
				break;
			}
			double copy = r.copy_us;
			/* unix */
			c.kind = 'U';
			c.slot = (uint32_t)(slot++ % k);
			usleep((useconds_t)gap_us);
			c.sent_us = now_us();
			if (ask(fd, &c, &r) != 0) {
				rc = 1;
				break;
			}
			double t1 = now_us();
			double unx = t1 - c.sent_us, u_op = r.op_us,
			       u_ev = t1 - r.sent_us;
			/* zmq: the shard told to take its next op there */
			c.kind = 'Z';
			if (send(fd, &c, sizeof(c), 0) != (ssize_t)sizeof(c)) {
				rc = 1;
				break;
			}
			c.slot = (uint32_t)(slot++ % k);
			usleep((useconds_t)gap_us);
			c.sent_us = now_us();
			char ok;
			if (zmq_send(req, &c, sizeof(c), 0) != sizeof(c) ||
			    zmq_recv(req, &ok, 0, 0) != 0 ||
			    zmq_recv(pull, &r, sizeof(r), 0) != sizeof(r)) {
				rc = 1;
				break;
			}
			t1 = now_us();
			if (i < 0)
				continue;
			t[0][i] = copy;
			t[1][i] = t1 - c.sent_us;
			t[2][i] = r.op_us;
			t[3][i] = t1 - r.sent_us;
			t[4][i] = unx;
			t[5][i] = u_op;
			t[6][i] = u_ev;
		}
		if (rc != 0)
			break;
		double m[7];
		for (int j = 0; j < 7; j++)
			m[j] = median(t[j], n);
		char label[32];
		snprintf(label, sizeof(label), "%zu%s",
		         nb >> 20 ? nb >> 20 : nb >> 10,
		         nb >> 20 ? "MiB" : "KiB");
		printf("%-8s %8.1f %7.1f %10.1f %13.1f %8.1f %11.1f %14.1f "
		       "%9.2f %10.2f\n",
		       label, m[0], m[1], m[2], m[3], m[4], m[5], m[6],
		       m[0] / m[1], m[0] / m[4]);
	}
	struct cmd q = {.kind = 'Q'};
	if (rc != 0) { /* stopped or gone: not waited for */
		fprintf(stderr,
		        "push floor: the shard stopped answering "
		        "(no answer within %d ms)\n",
		        WAIT_MS);
		kill(pid, SIGKILL);
	} else {
		(void)send(fd, &q, sizeof(q), 0);
	}
	int st;
	waitpid(pid, &st, 0);
	zmq_close(req);
	zmq_close(pull);
	zmq_ctx_term(ctx);
	return rc;
}
