/* Fuzzes the registry's request router: method, path, query, token header
 * and body all come from the input, against a registry with a token and a
 * few entries. Every answer must be a status code in range with a body, and
 * every error body JSON with a "detail". */
#include "registry/server.h"

#include <stdlib.h>
#include <string.h>

static ecx_registry *reg;

static void setup(void)
{
	if (ecx_registry_create_detached("tok", &reg) != 0)
		abort();
	ecx_store *s = ecx_registry_store(reg);
	ecx_entry e;
	memset(&e, 0, sizeof(e));
	uint64_t dims[2] = {4, 4};
	ecx_tensor_set(&e.desc, ECX_DTYPE_FLOAT32, 2, dims);
	strcpy(e.producer_zmq, "tcp://127.0.0.1:1");
	s->ops->put(s, "a", &e, NULL, 0);
	s->ops->put(s, "b", &e, NULL, 0);
}

/* Splits the input at '\n' into up to 7 fields: method, url, after, limit,
 * producer, authorization, body (the rest). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (reg == NULL)
		setup();
	char *buf = malloc(size + 1);
	memcpy(buf, data, size);
	buf[size] = '\0';
	char *f[7] = {0};
	char *p = buf;
	for (int i = 0; i < 6 && p != NULL; i++) {
		f[i] = p;
		p = strchr(p, '\n');
		if (p != NULL)
			*p++ = '\0';
	}
	f[6] = p;
	static const char *methods[] = {"GET",  "PUT",  "DELETE",
	                                "POST", "HEAD", "PATCH"};
	ecx_reg_http q = {
	    .method =
	        methods[(f[0] && f[0][0] ? (unsigned char)f[0][0] : 0) % 6],
	    .url = f[1] ? f[1] : "/",
	    .arg_after = f[2] && f[2][0] ? f[2] : NULL,
	    .arg_limit = f[3] && f[3][0] ? f[3] : NULL,
	    .arg_producer = f[4] && f[4][0] ? f[4] : NULL,
	    .authorization = f[5] && f[5][0] ? f[5] : NULL,
	    .body = f[6],
	    .len = f[6] ? size - (size_t)(f[6] - buf) : 0};
	ecx_reg_answer a = {0};
	ecx_registry_route(reg, &q, &a);
	if (a.body == NULL || a.status < 200 || a.status > 599)
		abort();
	if (a.status >= 400) {
		cJSON *o = cJSON_Parse(a.body);
		if (!cJSON_IsString(
		        cJSON_GetObjectItemCaseSensitive(o, "detail")))
			abort();
		cJSON_Delete(o);
	}
	free(a.body);
	free(buf);
	return 0;
}
