/* Fuzzes what a Mooncake handshake peer sends (src/mooncake/frame.c): the
 * length prefix, the typed body, and a metadata body's segment descriptor.
 * A descriptor that decodes must lie within the input's limits, re-encode,
 * and decode to itself; every buffer decode accepts is non-empty, non-zero
 * and does not wrap, and ecx_mc_segment_find agrees with a plain scan. */
#include "mooncake/frame.h"

#include <stdlib.h>
#include <string.h>

static void check_segment(const ecx_mc_segment *s)
{
	if (s->tcp_data_port == 0 || s->name[0] == '\0')
		abort();
	for (size_t i = 0; i < s->n_buffers; i++) {
		const ecx_mc_buffer *b = &s->buffers[i];
		if (b->name == NULL || b->name[0] == '\0' || b->addr == 0 ||
		    b->length == 0 || b->addr + b->length < b->addr)
			abort();
		if (ecx_mc_segment_find(s, b->addr, b->length) < 0 ||
		    ecx_mc_segment_find(s, b->addr + b->length - 1, 1) < 0)
			abort();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char why[160];
	if (size >= ECX_MC_HS_LEN_BYTES) {
		uint64_t n = 0;
		if (ecx_mc_hs_len_decode(data, &n, why, sizeof(why)) == 0 &&
		    (n == 0 || n > ECX_MC_HS_MAX))
			abort();
	}
	uint8_t type;
	const char *json;
	size_t jl;
	if (ecx_mc_hs_body_decode(data, size, &type, &json, &jl, why,
	                          sizeof(why)) != 0)
		return 0;
	if (json < (const char *)data || json + jl != (const char *)data + size)
		abort();
	ecx_mc_segment s, back;
	if (ecx_mc_segment_decode(json, jl, &s, why, sizeof(why)) != 0)
		return 0;
	check_segment(&s);
	size_t el = 0;
	char *txt = ecx_mc_segment_encode(&s, &el);
	if (txt == NULL) {
		ecx_mc_segment_free(&s);
		return 0;
	}
	if (ecx_mc_segment_decode(txt, el, &back, why, sizeof(why)) != 0)
		abort();
	if (strcmp(s.name, back.name) != 0 ||
	    s.tcp_data_port != back.tcp_data_port ||
	    s.tcp_proto_version != back.tcp_proto_version ||
	    s.n_buffers != back.n_buffers)
		abort();
	for (size_t i = 0; i < s.n_buffers; i++)
		if (s.buffers[i].addr != back.buffers[i].addr ||
		    s.buffers[i].length != back.buffers[i].length ||
		    strcmp(s.buffers[i].name, back.buffers[i].name) != 0)
			abort();
	free(txt);
	ecx_mc_segment_free(&s);
	ecx_mc_segment_free(&back);
	return 0;
}
