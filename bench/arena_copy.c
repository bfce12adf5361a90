/*
 * arena_copy.c - why a put copies into the arena with non-temporal stores
 * from 64 KiB (src/producer/items.c, STREAM_MIN): per item size, a copy
 * into a cold destination (the next of a ring of 1 GiB, touched before, as
 * the arena's places are) by memcpy and by SSE2 non-temporal stores (the
 * loop libecx uses), then the same bytes read at once by a thread on the
 * other CPU (a pull that comes straight after the put). Alternating, one
 * of each per round; mean microseconds.
 *
 *   ecx-bench-arena-copy [--rounds N]   (default 2000)
 *
 * The writer is pinned to CPU 0 and the reader to CPU 1 (2 CPUs at least,
 * else it stops saying so); the writer's wait for each read is bounded
 * (2 s), never a hang. x86-64 only (SSE2), as libecx's copy is.
 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <getopt.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING ((size_t)1 << 30)

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* libecx's copy into the arena (items.c), for a 16-byte-aligned dst. */
static void copy_nt(char *d, const char *s, size_t n)
{
	for (; n >= 64; n -= 64, d += 64, s += 64) {
		const __m128i *q = (const __m128i *)(const void *)s;
		__m128i a = _mm_loadu_si128(q), b = _mm_loadu_si128(q + 1);
		__m128i c = _mm_loadu_si128(q + 2), e = _mm_loadu_si128(q + 3);
		__m128i *o = (__m128i *)(void *)d;
		_mm_stream_si128(o, a);
		_mm_stream_si128(o + 1, b);
		_mm_stream_si128(o + 2, c);
		_mm_stream_si128(o + 3, e);
	}
	memcpy(d, s, n);
	_mm_sfence();
}

static char *ring, *out;
static size_t size;
static _Atomic(char *) posted; /* the item for the reader; NULL: none */
static _Atomic int stop;
static double read_us[2];
static int nread[2];
static _Atomic int mode;

static int pin(int cpu)
{
	cpu_set_t s;
	CPU_ZERO(&s);
	CPU_SET(cpu, &s);
	return pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

static _Atomic int reader_pinned = -1; /* pin(1)'s result */

static void *reader(void *arg)
{
	(void)arg;
	atomic_store(&reader_pinned, pin(1));
	while (!atomic_load(&stop)) {
		char *p = atomic_load(&posted);
		if (p == NULL)
			continue;
		double t0 = now_us();
		memcpy(out, p, size);
		int m = atomic_load(&mode);
		read_us[m] += now_us() - t0;
		nread[m]++;
		atomic_store(&posted, NULL);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	int rounds = 2000;
	static const struct option lo[] = {
	    {"rounds", required_argument, 0, 'r'}, {0, 0, 0, 0}};
	int ch;
	while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		if (ch != 'r' || (rounds = atoi(optarg)) < 2) {
			fprintf(stderr, "usage: ecx-bench-arena-copy "
			                "[--rounds N (2 or more)]\n");
			return 2;
		}
	}
	if (pin(0) != 0) {
		fprintf(stderr, "arena_copy: cannot pin to CPU 0\n");
		return 1;
	}
	static const size_t sizes[] = {16 << 10, 32 << 10, 64 << 10, 256 << 10,
	                               1 << 20};
	ring = aligned_alloc(4096, RING);
	out = aligned_alloc(4096, (size_t)1 << 20);
	char *src = aligned_alloc(4096, (size_t)1 << 20);
	if (ring == NULL || out == NULL || src == NULL) {
		fprintf(stderr, "arena_copy: out of memory\n");
		return 1;
	}
	memset(ring, 0, RING);
	memset(out, 0, (size_t)1 << 20);
	memset(src, 7, (size_t)1 << 20);
	pthread_t t;
	if (pthread_create(&t, NULL, reader, NULL) != 0) {
		fprintf(stderr, "arena_copy: cannot start the reader\n");
		return 1;
	}
	while (atomic_load(&reader_pinned) < 0)
		sched_yield();
	if (atomic_load(&reader_pinned) != 0) {
		fprintf(stderr, "arena_copy: cannot pin the reader to CPU 1 "
		                "(2 CPUs needed)\n");
		return 1;
	}
	printf("%8s | %12s %12s | %14s %14s\n", "size", "memcpy us", "nt us",
	       "read after mc", "read after nt");
	int rc = 0;
	for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]) && !rc; z++) {
		size = sizes[z];
		size_t slots = RING / size, at = 0;
		double write_us[2] = {0, 0};
		read_us[0] = read_us[1] = 0;
		nread[0] = nread[1] = 0;
		for (int r = 0; r < rounds && !rc; r++) {
			int m = r & 1;
			char *d = ring + (at++ % slots) * size;
			double t0 = now_us();
			if (m)
				copy_nt(d, src, size);
			else
				memcpy(d, src, size);
			write_us[m] += now_us() - t0;
			atomic_store(&mode, m);
			atomic_store(&posted, d);
			double dl = now_us() + 2e6;
			while (atomic_load(&posted) != NULL)
				if (now_us() > dl) {
					fprintf(stderr,
					        "arena_copy: the reader "
					        "did not read within 2 s\n");
					rc = 1;
					break;
				}
		}
		if (!rc)
			printf("%6zu KiB | %12.2f %12.2f | %14.2f %14.2f\n",
			       size >> 10, write_us[0] / (rounds - rounds / 2),
			       write_us[1] / (rounds / 2),
			       read_us[0] / nread[0], read_us[1] / nread[1]);
	}
	atomic_store(&stop, 1);
	if (rc == 0)
		pthread_join(t, NULL);
	return rc;
}
