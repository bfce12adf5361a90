/* Fuzzes the decoders of the producer's ZeroMQ socket. */
#include "wire/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char why[160];
	ecx_zreq r;
	if (ecx_zreq_decode((const char *)data, size, &r, why, 160) == 0)
		ecx_zreq_free(&r);
	ecx_zresp z;
	if (ecx_zresp_decode((const char *)data, size, &z, why, 160) == 0)
		ecx_zresp_free(&z);
	/* The reference's answer to its pull, as a consumer reads it. */
	bool ok;
	int64_t ret;
	char err[64];
	(void)ecx_ref_reply_decode((const char *)data, size, &ok, &ret, err,
	                           sizeof(err), why, 160);
	return 0;
}
