/*
 * table.c - the producer's item table: a hash table by id, the LRU list
 * (most recently wanted at the head, evicted from the tail by items.c), and
 * the pins of the pulls that read an item now. It owns that state and calls
 * no other file of the role: put and remove (items.c), leases (lease.c)
 * and pulls (serve.c, jobs.c, refpull.c) use it. Called with p->lock held.
 */
#include "producer/producer.h"

#include <stdlib.h>
#include <string.h>

static uint64_t id_hash(const char *s)
{
	return ecx_hash_str(s);
}

item *prod_item_find(ecx_producer *p, const char *id)
{
	uint64_t h = id_hash(id);
	for (item *it = p->buckets[h & (p->nbuckets - 1)]; it; it = it->hnext)
		if (it->hash == h && strcmp(it->id, id) == 0)
			return it;
	return NULL;
}

static void lru_unlink(ecx_producer *p, item *it)
{
	if (it->lru_prev)
		it->lru_prev->lru_next = it->lru_next;
	else
		p->lru_head = it->lru_next;
	if (it->lru_next)
		it->lru_next->lru_prev = it->lru_prev;
	else
		p->lru_tail = it->lru_prev;
	it->lru_prev = it->lru_next = NULL;
}

static void lru_push(ecx_producer *p, item *it)
{
	it->lru_prev = NULL;
	it->lru_next = p->lru_head;
	if (p->lru_head)
		p->lru_head->lru_prev = it;
	p->lru_head = it;
	if (p->lru_tail == NULL)
		p->lru_tail = it;
}

void prod_item_touch(ecx_producer *p, item *it)
{
	lru_unlink(p, it);
	lru_push(p, it);
}

void prod_item_insert(ecx_producer *p, item *it)
{
	it->hash = id_hash(it->id);
	size_t b = it->hash & (p->nbuckets - 1);
	it->hnext = p->buckets[b];
	p->buckets[b] = it;
	p->nitems++;
	lru_push(p, it);
}

void prod_item_unlink(ecx_producer *p, item *it)
{
	item **pp = &p->buckets[it->hash & (p->nbuckets - 1)];
	while (*pp != it)
		pp = &(*pp)->hnext;
	*pp = it->hnext;
	p->nitems--;
	lru_unlink(p, it);
}

void prod_item_free(ecx_producer *p, item *it)
{
	ecx_alloc_give(&p->alloc, it->off, it->desc.nbytes);
	free(it);
}

void prod_item_pin(ecx_producer *p, item *it)
{
	if (it->pins++ == 0)
		p->st.pinned++;
}

void prod_item_unpin(ecx_producer *p, item *it)
{
	if (--it->pins == 0) {
		p->st.pinned--;
		if (it->doomed)
			prod_item_free(p, it);
	}
}
