/* Fuzzes the data port's frames and session names (src/mooncake/frame.c):
 * a 24-byte header decodes and re-encodes to the same 17 meaningful bytes
 * (padding zeroed); a status frame reads back what it encodes; the range
 * check agrees with arithmetic done in 128 bits; a session name that
 * parses gives a non-empty host without ':' (unless it was bracketed) and
 * a port in 1..65535. */
#include "mooncake/frame.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size >= ECX_MC_HDR_LEN) {
		ecx_mc_hdr h;
		ecx_mc_hdr_decode(data, &h);
		uint8_t out[ECX_MC_HDR_LEN];
		ecx_mc_hdr_encode(&h, out);
		if (memcmp(out, data, 17) != 0)
			abort();
		for (int i = 17; i < ECX_MC_HDR_LEN; i++)
			if (out[i] != 0)
				abort();
		uint64_t st = ecx_mc_status_decode(data);
		uint8_t sb[ECX_MC_STATUS_LEN];
		ecx_mc_status_encode(st, sb);
		if (memcmp(sb, data, sizeof(sb)) != 0)
			abort();
		/* [addr, addr+size) within [base, base+length) */
		uint64_t base = ecx_mc_status_decode(data + 16);
		uint64_t length = h.size ^ h.addr;
		unsigned __int128 a = h.addr, e = a + h.size, b = base,
		                  be = b + length;
		bool want = h.size != 0 && e <= UINT64_MAX &&
		            be <= UINT64_MAX && b <= a && e <= be;
		if (ecx_mc_range_within(h.addr, h.size, base, length) != want)
			abort();
	}
	char name[ECX_MC_NAME_MAX + 8];
	size_t n = size < sizeof(name) - 1 ? size : sizeof(name) - 1;
	memcpy(name, data, n);
	name[n] = '\0';
	char host[64];
	uint16_t port = 0;
	if (ecx_mc_host_port(name, host, sizeof(host), &port, NULL, 0) == 0) {
		if (host[0] == '\0' || port == 0)
			abort();
		if (name[0] != '[' && strchr(host, ':') != NULL)
			abort();
	}
	return 0;
}
