/*
 * failover.c - the other holders of an id: items a load could not get from
 * their holder (it is gone, unreachable, or no longer holds them) are
 * asked of the registry's other holders, one round per holder, within the
 * same load's deadline (docs/protocol.md, "an entry lives by a lease").
 * It owns the end of a load (cons_load_wait): the wait of load.c, then
 * the failover, then the error's detail; it calls load.c, never the
 * other way.
 */
#include "consumer/consumer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "consumer"

/* Errors after which another holder may serve the item: its holder is
 * gone, cannot be reached, or no longer holds it. (A timeout leaves no
 * time to try another.) */
static bool failover_worth(int s)
{
	return s == ECX_ECONNECT || s == ECX_ECLOSED || s == ECX_EIO ||
	       s == ECX_ENOTFOUND;
}

/* An item that failed on its holder, and the holders tried for it. */
typedef struct fo_item {
	size_t i; /* in the load's items */
	size_t ntried;
	char tried[ECX_HOLDERS_MAX][ECX_ADDR_MAX];
	int first_status;
	bool looked, listed; /* the first holder's entry was asked for, found */
	uint64_t age_ms;     /* its renewal's age, by the registry */
} fo_item;

static bool fo_tried(const fo_item *f, const char *producer)
{
	for (size_t k = 0; k < f->ntried; k++)
		if (strcmp(f->tried[k], producer) == 0)
			return true;
	return false;
}

static bool same_desc(const ecx_tensor_desc *a, const ecx_tensor_desc *b)
{
	return a->dtype == b->dtype && a->ndim == b->ndim &&
	       a->nbytes == b->nbytes &&
	       memcmp(a->shape, b->shape, a->ndim * sizeof(a->shape[0])) == 0;
}

/* Whether own, the words the load kept for its first failure (own_err),
 * are about item x's failure on its first holder (first) with status st:
 * the same error, and the item's words ("ID: ...") or its holder's (a
 * hello refused). Only a refusal, a timeout, a closed connection or a
 * transport error has words worth more than the generic ones. */
static bool fo_own_fits(const ecx_item *x, const char *first, int st,
                        const char *own, int own_err)
{
	size_t il = strlen(x->id);
	if (own == NULL || own[0] == '\0' || own_err != st ||
	    (failover_worth(st) && st != ECX_ECLOSED && st != ECX_EIO))
		return false;
	return (strncmp(own, x->id, il) == 0 && own[il] == ':') ||
	       (first[0] != '\0' && strstr(own, first) != NULL);
}

/* Says why item x (f: its failover record, or NULL) failed, in one line
 * that names the item first and its producer once; own (or NULL): the
 * load's words for its first failure, with own_err. */
static void fo_detail(const ecx_item *x, const fo_item *f, int timeout_ms,
                      const char *own, int own_err, char *out, size_t outlen)
{
	const char *first = f != NULL ? f->tried[0] : x->producer;
	int st = f != NULL ? f->first_status : x->status;
	char when[96] = "";
	if (f != NULL && f->looked && f->listed)
		snprintf(when, sizeof(when), " (entry renewed %.1f s ago)",
		         (double)f->age_ms / 1000.0);
	else if (f != NULL && f->looked)
		snprintf(when, sizeof(when),
		         " (its entry has left the registry)");
	int k;
	size_t il = strlen(x->id);
	if (fo_own_fits(x, first, st, own, own_err)) {
		bool named = strncmp(own, x->id, il) == 0 && own[il] == ':';
		k = named ? snprintf(out, outlen, "%s", own)
		          : snprintf(out, outlen, "%s: %s", x->id, own);
	} else if (f == NULL && st != ECX_ETIMEDOUT) {
		snprintf(out, outlen, "%s: %s (producer %s)", x->id,
		         core_strerror(st),
		         x->producer[0] ? x->producer : "none");
		return;
	} else if (st == ECX_ENOTFOUND)
		k = snprintf(out, outlen,
		             "%s: producer %s no longer holds it%s", x->id,
		             first, when);
	else if (st == ECX_ETIMEDOUT)
		k = snprintf(out, outlen,
		             "%s: producer %s did not finish within %d ms",
		             x->id, first, timeout_ms);
	else
		k = snprintf(out, outlen, "%s: producer %s does not answer%s",
		             x->id, first, when);
	if (f != NULL && f->ntried > 1 && k > 0 && (size_t)k < outlen)
		snprintf(out + k, outlen - (size_t)k,
		         "; %zu other holder%s failed too (last: %s)",
		         f->ntried - 1, f->ntried > 2 ? "s" : "",
		         core_strerror(x->status));
	else if (f != NULL && f->ntried == 1 && k > 0 && (size_t)k < outlen)
		snprintf(out + k, outlen - (size_t)k, "; no other holder");
}

/* Tries the items that failed on their holder at the registry's other
 * holders, one round per holder, within the load's deadline. Returns the
 * first item's error afterwards, with the detail for it in detail. */
static int failover(ecx_consumer *c, ecx_item *items, size_t n,
                    uint64_t deadline_ns, const char *own, int own_err,
                    char *detail, size_t dlen)
{
	size_t m = 0;
	for (size_t i = 0; i < n; i++)
		m += failover_worth(items[i].status) &&
		     items[i].producer[0] != '\0';
	fo_item *f = m > 0 ? calloc(m, sizeof(*f)) : NULL;
	ecx_lookup_item *li = m > 0 ? calloc(m, sizeof(*li)) : NULL;
	ecx_item *sub = m > 0 ? calloc(m, sizeof(*sub)) : NULL;
	size_t *map = m > 0 ? calloc(m, sizeof(*map)) : NULL;
	size_t *smap = m > 0 ? calloc(m, sizeof(*smap)) : NULL;
	if (m > 0 && (f == NULL || li == NULL || sub == NULL || map == NULL ||
	              smap == NULL || c->rc == NULL))
		m = 0; /* out of memory, or no registry: no failover */
	for (size_t i = 0, j = 0; i < n && j < m; i++) {
		if (!failover_worth(items[i].status) ||
		    items[i].producer[0] == '\0')
			continue;
		f[j].i = i;
		f[j].first_status = items[i].status;
		ecx_strlcpy(f[j].tried[0], items[i].producer, ECX_ADDR_MAX);
		f[j].ntried = 1;
		j++;
	}
	for (int round = 1; round < ECX_HOLDERS_MAX && m > 0; round++) {
		if (ecx_now_ns() + 1000000u >= deadline_ns)
			break;
		size_t k = 0;
		for (size_t j = 0; j < m; j++) {
			if (!failover_worth(items[f[j].i].status) ||
			    f[j].ntried == ECX_HOLDERS_MAX)
				continue;
			ecx_lookup_items_clear(&li[k], 1);
			memset(&li[k], 0, sizeof(li[k]));
			li[k].id = items[f[j].i].id;
			map[k++] = j;
		}
		if (k == 0)
			break;
		char why[256];
		pthread_mutex_lock(&c->reg_lock);
		ecx_regclient_lookup_holders(c->rc, li, k, why, sizeof(why));
		pthread_mutex_unlock(&c->reg_lock);
		size_t ns = 0;
		for (size_t q = 0; q < k; q++) {
			fo_item *fj = &f[map[q]];
			const ecx_item *x = &items[fj->i];
			if (round == 1)
				fj->looked = true;
			if (!li[q].found)
				continue;
			const ecx_entry *pick = NULL;
			for (uint32_t h = 0; h <= li[q].nalt; h++) {
				const ecx_entry *e =
				    h == 0 ? &li[q].entry : &li[q].alt[h - 1];
				if (round == 1 && strcmp(e->producer_zmq,
				                         fj->tried[0]) == 0) {
					fj->listed = true;
					fj->age_ms = e->age_ms;
				}
				if (pick == NULL &&
				    !fo_tried(fj, e->producer_zmq) &&
				    same_desc(&e->desc, &x->desc))
					pick = e;
			}
			if (pick == NULL)
				continue;
			ecx_strlcpy(fj->tried[fj->ntried++], pick->producer_zmq,
			            ECX_ADDR_MAX);
			sub[ns] = *x;
			ecx_strlcpy(sub[ns].producer, pick->producer_zmq,
			            sizeof(sub[ns].producer));
			sub[ns].epoch = ecx_entry_item_epoch(pick);
			sub[ns].lease = 0; /* a lease is its holder's alone */
			smap[ns++] = map[q];
		}
		if (ns == 0)
			break;
		ecx_debug(MOD, "failing over %zu items to other holders", ns);
		ecx_load *l;
		if (cons_load_start(c, sub, ns, deadline_ns, true, true, &l) !=
		    0)
			break;
		cons_load_wait_once(l, NULL, 0);
		for (size_t t = 0; t < ns; t++) {
			ecx_item *x = &items[f[smap[t]].i];
			x->status = sub[t].status;
			if (x->status == 0) {
				ecx_strlcpy(x->producer, sub[t].producer,
				            sizeof(x->producer));
				x->epoch = sub[t].epoch;
				x->lease = 0; /* the first holder's expires */
			}
		}
	}
	/* Counted once: failed when no holder could serve it. */
	size_t saved = 0;
	for (size_t j = 0; j < m; j++)
		saved += items[f[j].i].status == 0;
	pthread_mutex_lock(&c->lock);
	c->st.failed -= saved;
	pthread_mutex_unlock(&c->lock);
	int first = 0;
	detail[0] = '\0';
	for (size_t i = 0; i < n && first == 0; i++) {
		if (items[i].status == 0)
			continue;
		first = items[i].status;
		const fo_item *fi = NULL;
		for (size_t j = 0; j < m && fi == NULL; j++)
			if (f[j].i == i)
				fi = &f[j];
		fo_detail(&items[i], fi, c->timeout_ms, own, own_err, detail,
		          dlen);
	}
	free(f);
	if (li != NULL)
		ecx_lookup_items_clear(li, m);
	free(li);
	free(sub);
	free(map);
	free(smap);
	return first;
}

/* Waits for l to end (load.c), tries the items that failed at their other
 * holders, and frees l; returns 0 or the first item's error, with the
 * detail in the calling thread's last error. */
int cons_load_wait(ecx_load *l)
{
	ecx_consumer *c = l->c;
	ecx_item *items = l->items;
	size_t n = l->n;
	uint64_t deadline_ns = l->deadline_ns;
	char why[sizeof(l->why)];
	int first = cons_load_wait_once(l, why, sizeof(why));
	if (first == 0)
		return 0;
	char detail[768];
	/* The load's words for its first failure name the item or its
	 * producer: fo_detail uses them where they fit the item it
	 * reports, so that the line names each once. */
	first = failover(c, items, n, deadline_ns, why, first, detail,
	                 sizeof(detail));
	if (first == 0)
		return 0;
	size_t bad = 0;
	for (size_t i = 0; i < n; i++)
		bad += items[i].status != 0;
	return ecx_set_error(first, "%zu of %zu items failed; first: %s", bad,
	                     n, detail);
}
