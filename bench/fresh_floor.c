/*
 * fresh_floor.c - the floor under `ecx demo`'s fresh-memory rows: what
 * one thread needs to put the demo's bytes into memory never touched
 * before, with no ecx in it. A source of --items items of --item-kib each
 * in shared memory (a memfd, as the producer's arena and the file
 * baseline's /dev/shm are), then, per run, into fresh anonymous memory,
 * one mapping per item as `ecx consume --memory fresh` makes them:
 *
 *   populate+copy  MADV_POPULATE_WRITE of every item's mapping (the
 *                  kernel zeroes every page), then memcpy item by item:
 *                  ecx's consumer (it populates fresh caller memory before
 *                  the pull);
 *   copy faulting  memcpy item by item, a page fault per page;
 *   pread          pread from the memfd item by item: the file
 *                  baseline's read, without its open and parse;
 *   copy only      memcpy into memory populated before timing (the
 *                  pre-faulted rows' floor).
 *
 *   ecx-bench-fresh-floor [--items N] [--item-kib K] [--runs R]
 *                         (defaults 200, 4580, 3: the demo's 894.6 MiB)
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static char *fresh(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE,
	               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("fresh_floor: mmap");
		exit(1);
	}
	return p;
}

static void populate(char *p, size_t n)
{
	if (madvise(p, n, MADV_POPULATE_WRITE) != 0) {
		perror("fresh_floor: MADV_POPULATE_WRITE");
		exit(1);
	}
}

int main(int argc, char **argv)
{
	long items = 200, item_kib = 4580, runs = 3;
	static const struct option lo[] = {
	    {"items", required_argument, 0, 'n'},
	    {"item-kib", required_argument, 0, 'k'},
	    {"runs", required_argument, 0, 'r'},
	    {0, 0, 0, 0}};
	int ch;
	while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		long v = atol(optarg);
		if (ch == 'n' && v >= 1 && v <= 100000)
			items = v;
		else if (ch == 'k' && v >= 4 && v <= (1 << 20))
			item_kib = v;
		else if (ch == 'r' && v >= 1 && v <= 100)
			runs = v;
		else {
			fprintf(
			    stderr,
			    "usage: ecx-bench-fresh-floor [--items 1..100000] "
			    "[--item-kib 4..1048576] [--runs 1..100]\n");
			return 2;
		}
	}
	size_t item = (size_t)item_kib << 10, tot = item * (size_t)items;
	int fd = memfd_create("fresh-floor", 0);
	if (fd < 0 || ftruncate(fd, (off_t)tot) != 0) {
		perror("fresh_floor: memfd");
		return 1;
	}
	char *src = mmap(NULL, tot, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (src == MAP_FAILED) {
		perror("fresh_floor: mmap of the source");
		return 1;
	}
	memset(src, 0x5a, tot);
	printf("%ld items of %ld KiB (%.1f MiB), seconds per pass\n", items,
	       item_kib, (double)tot / 1048576.0);
	printf("%4s | %9s %9s %14s | %14s %9s %10s\n", "run", "populate",
	       "copy", "populate+copy", "copy faulting", "pread", "copy only");
	char **m = calloc((size_t)items, sizeof(*m));
	if (m == NULL) {
		fprintf(stderr, "fresh_floor: out of memory\n");
		return 1;
	}
	for (long r = 0; r < runs; r++) {
		/* Seconds: populate, copy faulting, pread, copy only, and
		 * the copy after populate. */
		double t[5];
		for (int pass = 0; pass < 4; pass++) {
			for (long i = 0; i < items; i++)
				m[i] = fresh(item);
			if (pass == 3) /* copy only: populated untimed */
				for (long i = 0; i < items; i++)
					populate(m[i], item);
			double t0 = now_s();
			if (pass == 0)
				for (long i = 0; i < items; i++)
					populate(m[i], item);
			double t1 = now_s();
			for (long i = 0; i < items; i++) {
				if (pass != 2) {
					memcpy(m[i], src + i * item, item);
				} else if (pread(fd, m[i], item,
				                 (off_t)(i * item)) !=
				           (ssize_t)item) {
					perror("fresh_floor: pread");
					return 1;
				}
			}
			double t2 = now_s();
			if (pass == 0) {
				t[0] = t1 - t0; /* populate */
				t[4] = t2 - t1; /* then copy */
			} else {
				t[pass] = t2 - t0;
			}
			for (long i = 0; i < items; i++)
				munmap(m[i], item);
		}
		printf("%4ld | %9.3f %9.3f %14.3f | %14.3f %9.3f %10.3f\n",
		       r + 1, t[0], t[4], t[0] + t[4], t[1], t[2], t[3]);
	}
	free(m);
	return 0;
}
