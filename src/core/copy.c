/*
 * copy.c - whether this CPU copies slowly into a destination that lies a
 * few bytes past its source modulo 4 KiB (ecx_copy_offset_slow).
 *
 * On some x86-64 CPUs `rep movsb`, which glibc's memcpy and the kernel's
 * copies into a socket use, runs many times slower at such a distance
 * (the AMD EPYC of docs/deploy.md: 64 KiB in 34-107 us against 1.5-2.7).
 * A producer pads a pull's only rendezvous message over TCP so that the
 * kernel's copy of the arena's bytes does not land 21 bytes (UCX 1.13's
 * headers) into the socket's page; on a CPU without that penalty the
 * padding only costs (docs/deploy.md, "The rendezvous lead, where the CPU
 * needs it"), so the producer asks this first, naming the distance.
 * Measured once per process: a 64 KiB copy to that many bytes past its
 * source against one to 64 bytes past, the fastest of several of each,
 * interleaved. Elsewhere than x86-64 the copy timed is memcpy's, a
 * stand-in for the kernel's.
 */
#include "core/core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define PROBE_LEN ((size_t)64 << 10)
#define PROBE_REPS 12
/* Slower than this many times the copy 64 bytes off counts as the
 * penalty: far from both the CPUs without it (1.0-1.3x) and the one with
 * it (13x or more). */
#define PROBE_SLOW 4.0

/* The one distance measured and its ratio (0: not measured: no memory,
 * or a clock too coarse to tell), under probe_lock. */
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t probe_off;
static double probe_ratio;

/* The copy the kernel makes into a socket on x86-64 (rep movsb); memcpy
 * elsewhere. */
static void probe_copy(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
	__asm__ volatile("rep movsb"
	                 : "+D"(dst), "+S"(src), "+c"(n)
	                 :
	                 : "memory");
#else
	memcpy(dst, src, n);
	__asm__ volatile("" : : "r"(dst) : "memory");
#endif
}

static uint64_t probe_time(char *dst, const char *src)
{
	uint64_t t0 = ecx_now_ns();
	probe_copy(dst, src, PROBE_LEN);
	return ecx_now_ns() - t0;
}

static double probe(size_t at)
{
	double ratio = 0;
	size_t len = PROBE_LEN + 4096;
	char *src = aligned_alloc(4096, len);
	char *dst = aligned_alloc(4096, len);
	if (src != NULL && dst != NULL) {
		memset(src, 0x5a, len);
		memset(dst, 0, len);
		uint64_t off = UINT64_MAX, on = UINT64_MAX;
		for (int i = 0; i < PROBE_REPS; i++) {
			uint64_t a = probe_time(dst + at, src);
			uint64_t b = probe_time(dst + 64, src);
			off = a < off ? a : off;
			on = b < on ? b : on;
		}
		if (on > 0) /* else a clock too coarse to tell: unmeasured */
			ratio = (double)off / (double)on;
	}
	free(src);
	free(dst);
	return ratio;
}

bool ecx_copy_offset_slow(size_t off, double *ratio)
{
	pthread_mutex_lock(&probe_lock);
	if (probe_off != off) { /* the first call (one distance, in practice) */
		probe_ratio = off > 0 && off < 64 ? probe(off) : 0;
		probe_off = off;
	}
	double r = probe_ratio;
	pthread_mutex_unlock(&probe_lock);
	if (ratio != NULL)
		*ratio = r;
	/* Not measured: as before the probe, the padding is kept. */
	return r == 0 || r >= PROBE_SLOW;
}
