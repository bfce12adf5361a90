/*
 * publish.c - the producer's entries in a registry: into the embedded
 * registry's store directly, or through the registry client to a remote
 * HTTP registry or Redis, kept alive and restored after restarts.
 */
#include "producer/producer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "producer"

/* ---- registry ---- */

int prod_publish(ecx_producer *p, const char *id, const ecx_tensor_desc *d,
                 char *why, size_t whylen)
{
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	e.desc = *d;
	ecx_strlcpy(e.producer_zmq, p->address, sizeof(e.producer_zmq));
	e.epoch = p->epoch;
	if (p->registry != NULL) {
		ecx_store *s = ecx_registry_store(p->registry);
		int rc = s->ops->put(s, id, &e, why, whylen);
		if (rc == 0)
			ecx_registry_count_publish(p->registry, false);
		return rc;
	}
	pthread_mutex_lock(&p->remote_lock);
	int rc = ecx_regclient_put(p->remote, id, &e, why, whylen);
	pthread_mutex_unlock(&p->remote_lock);
	return rc;
}

/* Removes id from the registry if it is still this producer's entry. */
void prod_unpublish(ecx_producer *p, const char *id)
{
	char why[256];
	int rc;
	if (p->registry != NULL) {
		ecx_store *s = ecx_registry_store(p->registry);
		rc = s->ops->del(s, id, p->address, why, sizeof(why));
		if (rc == 0)
			ecx_registry_count_publish(p->registry, true);
	} else {
		pthread_mutex_lock(&p->remote_lock);
		rc = ecx_regclient_delete(p->remote, id, p->address, why,
		                          sizeof(why));
		pthread_mutex_unlock(&p->remote_lock);
	}
	if (rc != 0 && rc != ECX_ENOTFOUND)
		ecx_warn(MOD, "cannot unpublish %s: %s", id, why);
}

void prod_registry_sync(ecx_producer *p)
{
	if (p->remote == NULL || ecx_now_ms() < p->next_refresh_ms)
		return;
	uint64_t period = p->ttl_s > 0 ? (uint64_t)p->ttl_s * 1000 / 3 : 2000;
	p->next_refresh_ms = ecx_now_ms() + (period < 2000 ? period : 2000);
	if (p->redis && p->ttl_s <= 0)
		return;
	pthread_mutex_lock(&p->lock);
	size_t n = 0;
	char(*ids)[ECX_ID_MAX + 1] = malloc((p->nitems + 1) * sizeof(*ids));
	const char **ptrs = malloc((p->nitems + 1) * sizeof(*ptrs));
	ecx_entry *es = malloc((p->nitems + 1) * sizeof(*es));
	for (size_t b = 0; ids && ptrs && es && b < p->nbuckets; b++) {
		for (item *it = p->buckets[b]; it != NULL; it = it->hnext) {
			if (!it->ready)
				continue;
			ecx_strlcpy(ids[n], it->id, sizeof(ids[n]));
			ptrs[n] = ids[n];
			memset(&es[n], 0, sizeof(es[n]));
			es[n].desc = it->desc;
			ecx_strlcpy(es[n].producer_zmq, p->address,
			            sizeof(es[n].producer_zmq));
			es[n].epoch = p->epoch;
			n++;
		}
	}
	pthread_mutex_unlock(&p->lock);
	char why[256];
	size_t again = 0;
	pthread_mutex_lock(&p->remote_lock);
	int rc = ecx_regclient_sync(p->remote, ptrs, es, n, &again, why,
	                            sizeof(why));
	pthread_mutex_unlock(&p->remote_lock);
	if (rc != 0)
		ecx_warn(MOD, "registry: %s (publishing again when it is back)",
		         why);
	else if (again > 0 && !p->redis)
		ecx_info(MOD,
		         "the registry restarted: published %zu items "
		         "again",
		         again);
	free(ids);
	free(ptrs);
	free(es);
}
