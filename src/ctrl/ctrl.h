/*
 * ctrl.h - the control plane's constants: the UCX active-message ids and
 * headers of ecx's pull, shared by producer.c and consumer.c.
 *
 * After the ZeroMQ hello (wire.h: ecx_zreq/ecx_zresp) the consumer sends
 * each pull as active message ECX_AM_PULL with header ecx_am_hdr {conn,
 * req} and a JSON body (ecx_pull_req); the producer writes the items with
 * UCX puts, flushes, and answers with ECX_AM_REPLY, header {conn, req} and
 * body ecx_pull_resp.
 */
#ifndef ECX_CTRL_H
#define ECX_CTRL_H

#include <stdint.h>
#include <stdlib.h>

#define ECX_AM_PULL 17
#define ECX_AM_REPLY 18

typedef struct ecx_am_hdr {
	uint64_t conn; /* the connection number the hello gave */
	uint64_t req;  /* the consumer's request number */
} ecx_am_hdr;

/* An active message in flight: UCX reads the header and the body until the
 * send completes (UCX 1.13 has no flag to copy the header), so both live
 * on the heap and the send's callback frees them (ecx_am_out_free). */
typedef struct ecx_am_out {
	ecx_am_hdr h;
	char *body;
} ecx_am_out;

/* Largest ZeroMQ message the producer accepts. */
#define ECX_ZMQ_MAX_MSG (64 * 1024)

static inline void ecx_am_out_free(ecx_am_out *o)
{
	if (o != NULL) {
		free(o->body);
		free(o);
	}
}

#endif /* ECX_CTRL_H */
