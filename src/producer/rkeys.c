/* rkeys.c - a connection's cache of the consumer's remote keys, unpacked
 * once and kept (for shared memory, unpacking maps the consumer's memory
 * here), and the mapping of its pages ahead of a write. */
#include "producer/producer.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define MOD "producer"

/* The connection's unpacked key for region g, unpacking it on a miss (and
 * dropping the least recently used entry no job holds). Progress thread
 * only. NULL when the key cannot be unpacked or every entry is held. */
rkey_ent *prod_rkey_get(conn *c, const ecx_region *g)
{
	rkey_ent *victim = NULL;
	for (int i = 0; i < RKEY_CACHE; i++) {
		rkey_ent *e = &c->rk[i];
		if (e->h != NULL && e->base == g->base && e->len == g->len &&
		    e->klen == g->rkey_len &&
		    memcmp(e->kbuf, g->rkey, g->rkey_len) == 0) {
			e->refs++;
			e->used = ecx_now_ns();
			return e;
		}
		if (e->refs == 0 &&
		    (victim == NULL || e->h == NULL ||
		     (victim->h != NULL && e->used < victim->used)))
			victim = e;
	}
	if (victim == NULL)
		return NULL;
	if (victim->h != NULL) {
		ucp_rkey_destroy(victim->h);
		free(victim->touched);
		free(victim->kbuf);
		memset(victim, 0, sizeof(*victim));
	}
	victim->kbuf = malloc(g->rkey_len);
	if (victim->kbuf == NULL)
		return NULL;
	if (ucp_ep_rkey_unpack(c->ep, g->rkey, &victim->h) != UCS_OK) {
		free(victim->kbuf);
		memset(victim, 0, sizeof(*victim));
		return NULL;
	}
	void *local;
	if (ucp_rkey_ptr(victim->h, g->base, &local) == UCS_OK) {
		victim->touched =
		    calloc(g->len / PREFAULT_CHUNK + 2, sizeof(uint8_t));
		if (victim->touched != NULL)
			victim->local = local;
	}
	memcpy(victim->kbuf, g->rkey, g->rkey_len);
	victim->klen = g->rkey_len;
	victim->base = g->base;
	victim->len = g->len;
	victim->refs = 1;
	victim->used = ecx_now_ns();
	return victim;
}

/* Where the consumer's memory is mapped into this process (shared
 * memory), maps the pages of [addr, addr + n) that this process has not
 * touched yet, a 2 MiB chunk at a time: one madvise instead of a page fault
 * per page inside the write (page faults are slow on these machines). */
void prod_rkey_prefault(rkey_ent *e, uint64_t addr, uint64_t n)
{
	if (e->local == NULL || n == 0)
		return;
	uint64_t first = (addr - e->base) / PREFAULT_CHUNK;
	uint64_t last = (addr + n - 1 - e->base) / PREFAULT_CHUNK;
	for (uint64_t k = first; k <= last; k++) {
		if (e->touched[k])
			continue;
		uint64_t lo = k * PREFAULT_CHUNK;
		uint64_t hi =
		    lo + PREFAULT_CHUNK < e->len ? lo + PREFAULT_CHUNK : e->len;
		uintptr_t page = (uintptr_t)ecx_page_size();
		uintptr_t a = (uintptr_t)(e->local + lo) / page * page;
		uintptr_t b = (uintptr_t)(e->local + hi);
		if (madvise((void *)a, b - a, MADV_POPULATE_WRITE) != 0)
			ecx_debug(MOD, "cannot prefault: %m");
		e->touched[k] = 1;
	}
}

void prod_rkeys_drop(conn *c)
{
	for (int i = 0; i < RKEY_CACHE; i++) {
		if (c->rk[i].h != NULL)
			ucp_rkey_destroy(c->rk[i].h);
		free(c->rk[i].touched);
		free(c->rk[i].kbuf);
		memset(&c->rk[i], 0, sizeof(c->rk[i]));
	}
}
