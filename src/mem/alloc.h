/*
 * alloc.h - a first-fit allocator of ranges inside a fixed region (an
 * arena). It manages offsets only; the caller owns the memory. Not
 * thread-safe: the owner's lock covers it. Allocations are aligned to
 * ECX_ALLOC_ALIGN so items start on cache lines (and most on pages).
 *
 * May include: libc only. Never: touch the memory it manages, or lock.
 */
#ifndef ECX_MEM_ALLOC_H
#define ECX_MEM_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ECX_ALLOC_ALIGN 4096u

typedef struct ecx_alloc_block {
	struct ecx_alloc_block *next;
	uint64_t off, len;
} ecx_alloc_block;

typedef struct ecx_alloc {
	uint64_t capacity;
	uint64_t used;         /* bytes handed out, after rounding */
	ecx_alloc_block *free; /* sorted by offset, coalesced */
} ecx_alloc;

/* Initialises a as one free range of capacity bytes. Returns false when out
 * of memory. */
bool ecx_alloc_init(ecx_alloc *a, uint64_t capacity);
void ecx_alloc_fini(ecx_alloc *a);

/* The size a request of n bytes really takes (n rounded up; 0 takes one
 * unit so every item has a distinct address). */
uint64_t ecx_alloc_size(uint64_t n);

/* Takes n bytes; sets *off and returns true, or returns false when no free
 * range is large enough (or out of memory for bookkeeping). */
bool ecx_alloc_take(ecx_alloc *a, uint64_t n, uint64_t *off);

/* Returns the range taken at off for n bytes (the same n as taken). */
void ecx_alloc_give(ecx_alloc *a, uint64_t off, uint64_t n);

/* Copies src's free list into dst (for a dry run). False when out of
 * memory. */
bool ecx_alloc_clone(ecx_alloc *dst, const ecx_alloc *src);

/* The largest free range. */
uint64_t ecx_alloc_largest(const ecx_alloc *a);

#endif /* ECX_MEM_ALLOC_H */
