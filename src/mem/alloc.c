/* alloc.c - first-fit range allocator with a sorted, coalesced free list. */
#include "mem/alloc.h"

#include <stdlib.h>

bool ecx_alloc_init(ecx_alloc *a, uint64_t capacity)
{
	a->capacity = capacity;
	a->used = 0;
	a->free = NULL;
	if (capacity == 0)
		return true;
	a->free = malloc(sizeof(*a->free));
	if (a->free == NULL)
		return false;
	a->free->next = NULL;
	a->free->off = 0;
	a->free->len = capacity;
	return true;
}

void ecx_alloc_fini(ecx_alloc *a)
{
	while (a->free != NULL) {
		ecx_alloc_block *n = a->free->next;
		free(a->free);
		a->free = n;
	}
}

uint64_t ecx_alloc_size(uint64_t n)
{
	if (n == 0)
		n = 1;
	return (n + ECX_ALLOC_ALIGN - 1) / ECX_ALLOC_ALIGN * ECX_ALLOC_ALIGN;
}

bool ecx_alloc_take(ecx_alloc *a, uint64_t n, uint64_t *off)
{
	n = ecx_alloc_size(n);
	for (ecx_alloc_block **p = &a->free; *p != NULL; p = &(*p)->next) {
		ecx_alloc_block *b = *p;
		if (b->len < n)
			continue;
		*off = b->off;
		b->off += n;
		b->len -= n;
		if (b->len == 0) {
			*p = b->next;
			free(b);
		}
		a->used += n;
		return true;
	}
	return false;
}

void ecx_alloc_give(ecx_alloc *a, uint64_t off, uint64_t n)
{
	n = ecx_alloc_size(n);
	a->used -= n;
	ecx_alloc_block *prev = NULL, *next = a->free;
	while (next != NULL && next->off < off) {
		prev = next;
		next = next->next;
	}
	bool joins_prev = prev != NULL && prev->off + prev->len == off;
	bool joins_next = next != NULL && off + n == next->off;
	if (joins_prev && joins_next) {
		prev->len += n + next->len;
		prev->next = next->next;
		free(next);
	} else if (joins_prev) {
		prev->len += n;
	} else if (joins_next) {
		next->off = off;
		next->len += n;
	} else {
		ecx_alloc_block *b = malloc(sizeof(*b));
		if (b == NULL)
			return; /* the range is lost to fragmentation, not
			           reused */
		b->off = off;
		b->len = n;
		b->next = next;
		if (prev != NULL)
			prev->next = b;
		else
			a->free = b;
	}
}

uint64_t ecx_alloc_largest(const ecx_alloc *a)
{
	uint64_t m = 0;
	for (const ecx_alloc_block *b = a->free; b != NULL; b = b->next)
		if (b->len > m)
			m = b->len;
	return m;
}

bool ecx_alloc_clone(ecx_alloc *dst, const ecx_alloc *src)
{
	dst->capacity = src->capacity;
	dst->used = src->used;
	dst->free = NULL;
	ecx_alloc_block **tail = &dst->free;
	for (const ecx_alloc_block *b = src->free; b != NULL; b = b->next) {
		ecx_alloc_block *c = malloc(sizeof(*c));
		if (c == NULL) {
			ecx_alloc_fini(dst);
			return false;
		}
		*c = *b;
		c->next = NULL;
		*tail = c;
		tail = &c->next;
	}
	return true;
}
