/*
 * lookup.c - the one lookup, lease and release path that the consumer's
 * public lookups (api/consumer.c) and the registry client's (api/client.c)
 * go through: the registries asked through dir/'s client, then the
 * producers through rdv/'s leaser.
 */
#include "api/api.h"

#include <stdlib.h>

int api_lookup_check(const void *handle, const char *what,
                     const ecx_item *items, size_t n, int lease_ms)
{
	if (handle == NULL || (items == NULL && n > 0))
		return ecx_set_error(ECX_EINVAL, "no %s or no items", what);
	if (lease_ms < 0)
		return ecx_set_error(ECX_EINVAL, "lease_ms cannot be negative");
	return 0;
}

/* Copies what the registries answered into the items. */
static void items_fill(ecx_item *items, const ecx_lookup_item *li, size_t n,
                       bool leased)
{
	for (size_t i = 0; i < n; i++) {
		items[i].status = li[i].found ? 0 : ECX_ENOTFOUND;
		if (leased)
			items[i].lease = li[i].found ? li[i].entry.lease : 0;
		if (!li[i].found)
			continue;
		items[i].desc = li[i].entry.desc;
		ecx_strlcpy(items[i].producer, li[i].entry.producer_zmq,
		            sizeof(items[i].producer));
		items[i].epoch = ecx_entry_item_epoch(&li[i].entry);
	}
}

/* After an id broke the rules: no registry was asked. */
static void items_refused(ecx_item *items, size_t n, bool leased)
{
	for (size_t i = 0; i < n; i++) {
		items[i].status = core_id_check(items[i].id, NULL, 0) != 0
		                      ? ECX_EID
		                      : ECX_ENOTFOUND;
		if (leased)
			items[i].lease = 0;
	}
}

int api_lookup_run(const api_lookup *lk, ecx_item *items, size_t n,
                   uint64_t lease_ms, size_t *asked)
{
	*asked = 0;
	if (n == 0)
		return 0;
	/* The registry client sets each one's found, entry (when found) and
	 * holders: nothing else needs clearing (a batch's array is large).
	 * A NULL id is its to refuse. */
	ecx_lookup_item *li = malloc(n * sizeof(*li));
	if (li == NULL)
		return ecx_set_error(ECX_ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++) {
		li[i].id = items[i].id;
		li[i].found = false;
		li[i].nalt = 0;
		li[i].alt = NULL;
	}
	char why[256] = "";
	if (lk->rc_lock != NULL)
		pthread_mutex_lock(lk->rc_lock);
	int rc = lease_ms != 0
	             ? ecx_regclient_lookup_lease(lk->rc, li, n, lease_ms, why,
	                                          sizeof(why))
	             : ecx_regclient_lookup(lk->rc, li, n, why, sizeof(why));
	if (lk->rc_lock != NULL)
		pthread_mutex_unlock(lk->rc_lock);
	*asked = n;
	if (rc == ECX_EID)
		items_refused(items, n, lease_ms != 0);
	else
		items_fill(items, li, n, lease_ms != 0);
	ecx_lookup_items_clear(li, n);
	free(li);
	if (rc != 0)
		ecx_set_error(rc, "%s", why);
	if (lease_ms != 0 && rc != ECX_EID)
		ecx_rdv_lease(lk->leaser, items, n, lease_ms, lk->token,
		              lk->timeout_ms, NULL);
	return rc;
}

int api_release(const api_lookup *lk, ecx_item *items, size_t n)
{
	char why[256];
	int rc = ecx_rdv_release(lk->leaser, items, n, lk->token,
	                         lk->timeout_ms, why, sizeof(why));
	return rc != 0 ? ecx_set_error(rc, "%s", why) : 0;
}
