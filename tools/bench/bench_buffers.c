/* bench_buffers.c - the transfer benchmark's memory and socket I/O:
 * item sizes, the baselines' pools of the producer's bytes, memory
 * prepared the way ecx's is (pre-faulted, or never touched), the check
 * that it is, and whole sends and receives for raw TCP. */
#include "tool.h"

#include "bench.h"
#include "gen.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

const bench_size sizes[] = {
    {"64KiB", 32, 1024, 1024}, /* 64 MiB */
    {"1MiB", 512, 1024, 64},   /* 64 MiB */
    {"7MiB", 1024, 3584, 32},  /* 224 MiB */
};

size_t size_bytes(int s)
{
	return (size_t)(sizes[s].rows * sizes[s].cols * 2);
}

/* Memory never touched before (so its first touch faults), and never
 * recycled by malloc: each call maps afresh. */
void *fresh_map(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE,
	               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

/* Pre-faulted memory. */
void *warm_alloc(size_t n)
{
	void *p = malloc(n);
	if (p != NULL)
		tool_prefault(p, n);
	return p;
}

/* Whether every page of [p, p+n) is in memory (mincore): how the baselines'
 * memory is checked to be prepared as ecx's is, before it is timed. */
bool resident(const void *p, size_t n)
{
	long pg = sysconf(_SC_PAGESIZE);
	uintptr_t a = (uintptr_t)p / (uintptr_t)pg * (uintptr_t)pg;
	size_t len = (uintptr_t)p + n - a,
	       np = (len + (size_t)pg - 1) / (size_t)pg;
	unsigned char *v = malloc(np ? np : 1);
	bool ok = v != NULL && mincore((void *)a, len, v) == 0;
	for (size_t i = 0; ok && i < np; i++)
		ok = (v[i] & 1) != 0;
	free(v);
	return ok;
}

/* Size s's pool of items holding the producer's bytes (gen_fill of the
 * same ids), for the baselines to send or copy what ecx moves: memory
 * holding data, not calloc's never-written pages (every read of those
 * hits the one zero page). */
char *pool_alloc(int s)
{
	size_t sz = size_bytes(s);
	char *p = malloc((size_t)sizes[s].pool * sz);
	for (int i = 0; p != NULL && i < sizes[s].pool; i++) {
		char id[64];
		snprintf(id, sizeof(id), "%s-%d", sizes[s].name, i);
		gen_fill(id, p + (size_t)i * sz, sz);
	}
	return p;
}

#define POLL_IDLE_NS 30000000000ull

bool full_io(int fd, void *p, size_t n, io_mode m)
{
	char *c = p;
	uint64_t idle_since = 0;
	while (n > 0) {
		ssize_t k = m == IO_SEND   ? send(fd, c, n, MSG_NOSIGNAL)
		            : m == IO_POLL ? recv(fd, c, n, MSG_DONTWAIT)
		                           : recv(fd, c, n, 0);
		if (k < 0 && m == IO_POLL &&
		    (errno == EAGAIN || errno == EINTR)) {
			uint64_t now = tool_now_ns();
			if (idle_since == 0)
				idle_since = now;
			else if (now - idle_since > POLL_IDLE_NS) {
				errno = ETIMEDOUT;
				return false;
			}
			continue;
		}
		if (k == 0)
			errno = ECONNRESET;
		else if (k < 0 && m == IO_RECV &&
		         (errno == EAGAIN || errno == EWOULDBLOCK))
			errno = ETIMEDOUT; /* SO_RCVTIMEO ran out */
		if (k <= 0)
			return false;
		idle_since = 0;
		c += k;
		n -= (size_t)k;
	}
	return true;
}

/* Loads per block: about budget bytes, within [lo, hi]. */
int block_iters(const bench_opts *o, size_t bytes)
{
	size_t budget = o->quick ? (64u << 20) : (256u << 20);
	int lo = o->quick ? 3 : 4, hi = o->quick ? 15 : 40;
	size_t n = budget / bytes;
	return n < (size_t)lo ? lo : n > (size_t)hi ? hi : (int)n;
}
