/*
 * api.h - what the public entry points of src/api/ share: the one path of
 * lookups, leases and releases behind ecx_consumer_lookup, _lookup_lease,
 * _release and ecx_client_lookup, _lookup_lease, _release (lookup.c).
 *
 * May include: every layer. Never: included by a layer; api/ is the top,
 * and nothing below calls into it.
 */
#ifndef ECX_API_H
#define ECX_API_H

#include "dir/dir.h"
#include "rdv/rdv.h"

#include <pthread.h>

/* Whom a lookup asks: the registry client (rc_lock, when not NULL,
 * serialises its use: a consumer's threads share it; an ecx_client is one
 * thread's at a time), and the leaser that asks producers for leases and
 * ends them, with the token and the bound on its round trips. */
typedef struct api_lookup {
	ecx_regclient *rc;
	pthread_mutex_t *rc_lock;
	ecx_rdv_leaser *leaser;
	const char *token;
	int timeout_ms;
} api_lookup;

/* The checks of a lookup's or a release's arguments, after the handle's
 * process was checked: ECX_EINVAL, set as the last error, without the
 * handle (what names its kind: "consumer") or without items for n > 0,
 * or for lease_ms < 0; else 0. */
int api_lookup_check(const void *handle, const char *what,
                     const ecx_item *items, size_t n, int lease_ms);

/* Looks the n items up (ecx_consumer_lookup's contract in ecx.h) and,
 * with lease_ms, leases what was found (ecx_consumer_lookup_lease's):
 * a producer's embedded registry leases in the lookup, the producers of
 * the rest are asked after it, even when a registry failed (what the
 * others found stands, and a hit is leased or a miss). An id that breaks
 * the rules (ecx_id_check) fails the call with ECX_EID before any
 * request: its item's status is ECX_EID, every other's ECX_ENOTFOUND,
 * and nothing is leased. *asked is the number of ids the registries were
 * given (0 when the call failed before). Blocks up to the timeouts;
 * returns 0 or the error, set as the last error. */
int api_lookup_run(const api_lookup *lk, ecx_item *items, size_t n,
                   uint64_t lease_ms, size_t *asked);

/* Ends the leases of the n items (ecx_consumer_release's contract). */
int api_release(const api_lookup *lk, ecx_item *items, size_t n);

#endif /* ECX_API_H */
