/* mem.c - memory UCX maps for ecx: arenas it allocates (checked against
 * what this host can hold before a page is touched), the caller's memory
 * it registers, and remote keys packed for peers. */
#include "xfer/ucx.h"
#include "xfer/ucx_priv.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define MOD "ucx"

int ecx_ucx_mem_alloc(ecx_ucx *u, size_t len, void **addr, ucp_mem_h *memh,
                      char *why, size_t whylen)
{
	/* Refused before a page is touched when it cannot fit; the posix
	 * directory counts only where the user's UCX_ALLOC_PRIO lets UCX
	 * allocate there. */
	const char *prio = getenv("UCX_ALLOC_PRIO");
	const char *pdir = NULL;
	if (prio != NULL &&
	    (strstr(prio, "posix") != NULL || strstr(prio, "md:*") != NULL))
		pdir = getenv("UCX_POSIX_DIR") != NULL ? getenv("UCX_POSIX_DIR")
		                                       : "/dev/shm";
	bool sysv = true;
	int rc = ecx_mem_fits("an arena", len, pdir, &sysv, why, whylen);
	if (rc != 0)
		return rc;
	if (!sysv)
		ecx_info(
		    MOD,
		    "an arena of %zu bytes is over this host's System V "
		    "segment limit (kernel.shmmax, shmall): it is private "
		    "memory, which peers on this host reach by cross-memory "
		    "attach",
		    len);
	ucp_mem_map_params_t mp = {.field_mask =
	                               UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
	                               UCP_MEM_MAP_PARAM_FIELD_LENGTH |
	                               UCP_MEM_MAP_PARAM_FIELD_FLAGS,
	                           .address = NULL,
	                           .length = len,
	                           .flags = UCP_MEM_MAP_ALLOCATE};
	ucs_status_t st = ucp_mem_map(u->ctx, &mp, memh);
	if (st != UCS_OK)
		return ecx_why(why, whylen, ecx_ucx_err(st),
		               "cannot map %zu bytes with UCX: %s", len,
		               ucs_status_string(st));
	ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
	ucp_mem_query(*memh, &ma);
	/* First touch costs about 0.25 GiB/s here: pay it now, once. */
	memset(ma.address, 0, len);
	*addr = ma.address;
	return 0;
}

int ecx_ucx_mem_reg(ecx_ucx *u, void *addr, size_t len, ucp_mem_h *memh,
                    char *why, size_t whylen)
{
	ucp_mem_map_params_t mp = {.field_mask =
	                               UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
	                               UCP_MEM_MAP_PARAM_FIELD_LENGTH,
	                           .address = addr,
	                           .length = len};
	ucs_status_t st = ucp_mem_map(u->ctx, &mp, memh);
	if (st != UCS_OK)
		return ecx_why(why, whylen, ecx_ucx_err(st),
		               "cannot register %zu bytes at %p: %s", len, addr,
		               ucs_status_string(st));
	return 0;
}

void ecx_ucx_mem_unmap(ecx_ucx *u, ucp_mem_h memh)
{
	if (memh != NULL)
		ucp_mem_unmap(u->ctx, memh);
}

int ecx_ucx_rkey_pack(ecx_ucx *u, ucp_mem_h memh, void **buf, size_t *len)
{
	void *rb = NULL;
	size_t rl = 0;
	ucs_status_t st = ucp_rkey_pack(u->ctx, memh, &rb, &rl);
	if (st != UCS_OK)
		return ecx_ucx_err(st);
	void *copy = malloc(rl);
	if (copy != NULL)
		memcpy(copy, rb, rl);
	ucp_rkey_buffer_release(rb);
	if (copy == NULL)
		return ECX_ENOMEM;
	*buf = copy;
	*len = rl;
	return 0;
}
