/* worker.c - a UCX worker on the context: made in multi-thread mode with
 * the context's active-message handlers, its event descriptor and its
 * address (the main worker, ucx.c, and each side, side.c); and UCX's
 * statuses as ecx errors. Calls no other file of src/xfer. */
#include "xfer/ucx.h"
#include "xfer/ucx_priv.h"

int ecx_ucx_err(ucs_status_t st)
{
	switch (st) {
	case UCS_OK:
		return 0;
	case UCS_ERR_NO_MEMORY:
		return ECX_ENOMEM;
	case UCS_ERR_TIMED_OUT:
		return ECX_ETIMEDOUT;
	case UCS_ERR_UNREACHABLE:
	case UCS_ERR_CONNECTION_RESET:
	case UCS_ERR_ENDPOINT_TIMEOUT:
	case UCS_ERR_REJECTED:
		return ECX_ECLOSED;
	case UCS_ERR_INVALID_PARAM:
		return ECX_EINVAL;
	default:
		return ECX_EIO;
	}
}

/* Makes a worker on u's context with u's active-message handlers, its
 * event descriptor and its address. On failure, what was made is
 * destroyed and *w is NULL. */
ucs_status_t ecx_ucx_worker_make(ecx_ucx *u, ucp_worker_h *w, int *efd,
                                 ucp_address_t **addr, size_t *len)
{
	ucp_worker_params_t wp = {.field_mask =
	                              UCP_WORKER_PARAM_FIELD_THREAD_MODE,
	                          .thread_mode = UCS_THREAD_MODE_MULTI};
	ucs_status_t st = ucp_worker_create(u->ctx, &wp, w);
	if (st != UCS_OK) {
		*w = NULL;
		return st;
	}
	st = ucp_worker_get_efd(*w, efd);
	for (unsigned i = 0; st == UCS_OK && i < u->am.nam; i++) {
		ucp_am_handler_param_t ap = {
		    .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
		                  UCP_AM_HANDLER_PARAM_FIELD_CB |
		                  UCP_AM_HANDLER_PARAM_FIELD_ARG |
		                  UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
		    .id = u->am.am[i].id,
		    .cb = u->am.am[i].cb,
		    .arg = u->am.am[i].arg,
		    .flags = UCP_AM_FLAG_PERSISTENT_DATA};
		st = ucp_worker_set_am_recv_handler(*w, &ap);
	}
	if (st == UCS_OK)
		st = ucp_worker_get_address(*w, addr, len);
	if (st != UCS_OK) {
		ucp_worker_destroy(*w);
		*w = NULL;
	}
	return st;
}
