/*
 * producer.c - the public entry points of a producer (ecx_producer_*):
 * the checks of the arguments and of the handle's process, then one call
 * into the producer role (producer/producer.c, items.c, push.c), which
 * reports its failures through the calling thread's last error.
 */
#include "producer/producer.h"

#include <string.h>

int ecx_producer_create(const ecx_producer_params *params, ecx_producer **out,
                        char *why, size_t whylen)
{
	return prod_create(params, out, why, whylen);
}

void ecx_producer_destroy(ecx_producer *p)
{
	/* In a forked child: the parent's state, left as it is (leaked). */
	if (p == NULL || ecx_forked(p->pid, "producer"))
		return;
	prod_destroy(p);
}

/* The checks of a put's arguments; 0 when they hold. */
static int put_args(ecx_producer *p, const ecx_tensor_desc *desc,
                    const void *src)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL || desc == NULL || (src == NULL && desc->nbytes > 0))
		return ecx_set_error(ECX_EINVAL, "put: missing argument");
	return 0;
}

int ecx_producer_put(ecx_producer *p, const char *id,
                     const ecx_tensor_desc *desc, const void *src)
{
	int rc = put_args(p, desc, src);
	return rc != 0 ? rc : prod_put(p, id, desc, src, NULL);
}

int ecx_producer_put_stored(ecx_producer *p, const char *id,
                            const ecx_tensor_desc *desc, const void *src,
                            int *stored)
{
	if (stored == NULL)
		return ecx_set_error(ECX_EINVAL, "put: missing argument");
	int rc = put_args(p, desc, src);
	return rc != 0 ? rc : prod_put(p, id, desc, src, stored);
}

int ecx_producer_reserve(ecx_producer *p, const char *id,
                         const ecx_tensor_desc *desc, void **dst)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL || desc == NULL || dst == NULL)
		return ecx_set_error(ECX_EINVAL, "reserve: missing argument");
	*dst = NULL;
	return prod_reserve(p, "reserve", id, desc, dst);
}

int ecx_producer_commit(ecx_producer *p, const char *id)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL)
		return ecx_set_error(ECX_EINVAL, "commit: missing argument");
	return prod_commit(p, id);
}

int ecx_producer_cancel(ecx_producer *p, const char *id)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL)
		return ecx_set_error(ECX_EINVAL, "cancel: missing argument");
	return prod_cancel(p, id);
}

void *ecx_producer_arena(ecx_producer *p, uint64_t *capacity)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return NULL;
	if (capacity != NULL)
		*capacity = p->alloc.capacity;
	return p->base;
}

int ecx_producer_remove(ecx_producer *p, const char *id)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL || id == NULL)
		return ecx_set_error(ECX_EINVAL, "remove: missing argument");
	return prod_remove(p, id);
}

void ecx_producer_stats_get(ecx_producer *p, ecx_producer_stats *out)
{
	if (p != NULL && ecx_forked(p->pid, "producer")) {
		memset(out, 0, sizeof(*out));
		return;
	}
	prod_stats_get(p, out);
}

const char *ecx_producer_address(const ecx_producer *p)
{
	return p->address;
}

uint16_t ecx_producer_registry_port(const ecx_producer *p)
{
	return prod_registry_port(p);
}

void ecx_producer_set_ready(ecx_producer *p)
{
	if (p != NULL)
		prod_set_ready(p);
}

int ecx_producer_push_batch(ecx_producer *p, ecx_push_item *items, size_t n,
                            uint64_t timeout_ms)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL || (items == NULL && n > 0))
		return ecx_set_error(ECX_EINVAL, "push: missing argument");
	return prod_push_batch(p, items, n, timeout_ms);
}

int ecx_producer_push(ecx_producer *p, const char *id, const char *dst_session,
                      uint64_t dst_ptr, uint64_t nbytes, uint64_t timeout_ms)
{
	ecx_push_item e = {.id = id,
	                   .dst_session = dst_session,
	                   .dst_ptr = dst_ptr,
	                   .nbytes = nbytes};
	return ecx_producer_push_batch(p, &e, 1, timeout_ms);
}

int ecx_producer_item_xxh3(ecx_producer *p, const char *id, uint64_t *out)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL || id == NULL || out == NULL)
		return ecx_set_error(ECX_EINVAL, "item hash: missing argument");
	return prod_item_xxh3(p, id, out);
}

const char *ecx_producer_last_error(void)
{
	return core_last_error();
}

int ecx_producer_lease(ecx_producer *p, const char *id, int ms, uint64_t *lease)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL || id == NULL || lease == NULL || ms < 0)
		return ecx_set_error(ECX_EINVAL, "lease: missing argument");
	*lease = 0;
	return prod_lease_own(p, id, ms, lease);
}

int ecx_producer_lease_end(ecx_producer *p, uint64_t lease)
{
	if (p != NULL && ecx_forked(p->pid, "producer"))
		return ECX_EFORK;
	if (p == NULL)
		return ecx_set_error(ECX_EINVAL, "lease end: missing argument");
	return lease == 0 ? 0 : prod_lease_end_own(p, lease) ? 1 : 0;
}
