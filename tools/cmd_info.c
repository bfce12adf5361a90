/* cmd_info.c - `ecx info` and `ecx ls`: read a registry. */
#include "tool.h"

#include "registry/server.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static const char info_help[] =
    "usage: ecx info [--json] [--token T] [--timeout MS] REGISTRY ID\n"
    "\n"
    "Prints the registry entry of one item: dtype, shape, size and the\n"
    "producer that holds it. REGISTRY is http://HOST:PORT, or several\n"
    "separated by commas (the first that has the id answers).\n"
    "\n"
    "Options:\n"
    "  --json           print the entry as the registry's JSON\n"
    "  --token T        bearer token (default $ECX_TOKEN)\n"
    "  --timeout MS     bound on each request: 500ms, 2s (default 5s)\n"
    "  -h, --help       this text\n"
    "\n"
    "Exit codes: 0 found, 3 not found, 1 registry error, 2 usage error.\n";

static const char ls_help[] =
    "usage: ecx ls [--json] [--limit N] [--token T] [--timeout MS] REGISTRY\n"
    "\n"
    "Lists a registry's entries, sorted by id, fetching pages of --limit\n"
    "(at most 1000) until all are shown.\n"
    "\n"
    "Options:\n"
    "  --json           one JSON object per line (id and entry)\n"
    "  --limit N        entries per page (default 500)\n"
    "  --token T        bearer token (default $ECX_TOKEN)\n"
    "  --timeout MS     bound on each request (default 5s)\n"
    "  -h, --help       this text\n"
    "\n"
    "Exit codes: 0 success, 1 registry error, 2 usage error.\n";

static const struct option read_opts[] = {
    {"limit", required_argument, NULL, 'l'},
    TOOL_OPT_ENTRIES,
    {NULL, 0, NULL, 0}};

/* Parses the options info and ls share; returns -1 to go on, else an exit
 * code. */
static int read_args(const char *cmd, const char *help, int argc, char **argv,
                     tool_common *t, int *limit)
{
	t->token = getenv("ECX_TOKEN");
	t->timeout_ms = 5000;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", read_opts, NULL)) != -1) {
		switch (c) {
		case 'l':
			*limit = atoi(optarg);
			if (limit == NULL || *limit < 1 || *limit > 1000)
				return tool_fail(cmd, EXIT_USAGE,
				                 "--limit takes 1 to 1000");
			break;
		default: {
			int rc = tool_opt(cmd, help, c, optarg, t);
			if (rc >= 0)
				return rc;
		}
		}
	}
	return -1;
}

static ecx_regclient *open_client(const char *cmd, const char *urls,
                                  const tool_common *t, int *rc)
{
	ecx_regclient_opts o = {.urls = urls,
	                        .token = t->token,
	                        .connect_timeout_ms = t->timeout_ms,
	                        .timeout_ms = t->timeout_ms};
	ecx_regclient *c = NULL;
	char why[256];
	if (ecx_regclient_create(&o, &c, why, sizeof(why)) != 0)
		*rc = tool_fail(cmd, EXIT_USAGE, "%s", why);
	return c;
}

static void print_shape(const ecx_tensor_desc *d)
{
	for (uint32_t i = 0; i < d->ndim; i++)
		printf("%s%llu", i ? "x" : "", (unsigned long long)d->shape[i]);
	if (d->ndim == 0)
		printf("scalar");
}

int cmd_info(int argc, char **argv)
{
	tool_common t = {0};
	int limit = 0;
	int rc = read_args("info", info_help, argc, argv, &t, &limit);
	if (rc >= 0)
		return rc;
	if (argc - optind != 2) {
		fputs(info_help, stderr);
		return EXIT_USAGE;
	}
	const char *id = argv[optind + 1];
	char why[256];
	if (ecx_id_check(id, why, sizeof(why)) != 0)
		return tool_fail("info", EXIT_USAGE, "%s", why);
	ecx_regclient *c = open_client("info", argv[optind], &t, &rc);
	if (c == NULL)
		return rc;
	ecx_lookup_item it = {.id = id};
	rc = ecx_regclient_lookup(c, &it, 1, why, sizeof(why));
	ecx_regclient_destroy(c);
	if (rc != 0 && !it.found)
		return tool_fail("info", EXIT_FAIL, "%s", why);
	if (!it.found)
		return tool_fail("info", EXIT_NOTFOUND, "%s: unknown mm_hash",
		                 id);
	if (t.json) {
		char *s = ecx_entry_encode(&it.entry);
		printf("%s\n", s != NULL ? s : "{}");
		free(s);
		return EXIT_OK;
	}
	char b[32];
	printf("id:        %s\ndtype:     %s\nshape:     ", id,
	       ecx_dtype_name(it.entry.desc.dtype));
	print_shape(&it.entry.desc);
	printf("\nnbytes:    %llu (%s)\nproducer:  %s\n",
	       (unsigned long long)it.entry.desc.nbytes,
	       tool_bytes(it.entry.desc.nbytes, b, sizeof(b)),
	       it.entry.producer_zmq);
	return EXIT_OK;
}

int cmd_ls(int argc, char **argv)
{
	tool_common t = {0};
	int limit = 500;
	int rc = read_args("ls", ls_help, argc, argv, &t, &limit);
	if (rc >= 0)
		return rc;
	if (argc - optind != 1) {
		fputs(ls_help, stderr);
		return EXIT_USAGE;
	}
	ecx_regclient *c = open_client("ls", argv[optind], &t, &rc);
	if (c == NULL)
		return rc;
	char after[ECX_ID_MAX + 1] = "";
	char why[256];
	size_t shown = 0;
	uint64_t bytes = 0;
	rc = EXIT_OK;
	if (!t.json)
		printf("%-66s %-10s %-14s %10s  %s\n", "ID", "DTYPE", "SHAPE",
		       "BYTES", "PRODUCER");
	for (;;) {
		char path[ECX_ID_MAX + 64];
		snprintf(path, sizeof(path), "/ec/list?limit=%d%s%s", limit,
		         after[0] ? "&after=" : "", after);
		long status = 0;
		char *body = NULL;
		size_t len = 0;
		if (ecx_regclient_get_raw(c, path, &status, &body, &len, why,
		                          sizeof(why)) != 0) {
			rc = tool_fail("ls", EXIT_FAIL, "%s", why);
			break;
		}
		cJSON *o = cJSON_ParseWithLength(body, len);
		const cJSON *items =
		    cJSON_GetObjectItemCaseSensitive(o, "items");
		const cJSON *next = cJSON_GetObjectItemCaseSensitive(o, "next");
		if (status != 200 || !cJSON_IsArray(items)) {
			const cJSON *d =
			    cJSON_GetObjectItemCaseSensitive(o, "detail");
			rc = tool_fail("ls", EXIT_FAIL,
			               "registry answered %ld: %s", status,
			               cJSON_IsString(d) ? d->valuestring
			                                 : "not a listing");
			cJSON_Delete(o);
			free(body);
			break;
		}
		const cJSON *x;
		cJSON_ArrayForEach (x, items) {
			ecx_entry e;
			const cJSON *id =
			    cJSON_GetObjectItemCaseSensitive(x, "id");
			if (!cJSON_IsString(id) ||
			    ecx_entry_from_json(x, &e, why, sizeof(why)) != 0)
				continue;
			shown++;
			bytes += e.desc.nbytes;
			if (t.json) {
				char *s = cJSON_PrintUnformatted(x);
				printf("%s\n", s);
				free(s);
				continue;
			}
			char shape[64] = "";
			size_t off = 0;
			for (uint32_t i = 0; i < e.desc.ndim; i++)
				off += (size_t)snprintf(
				    shape + off, sizeof(shape) - off, "%s%llu",
				    i ? "x" : "",
				    (unsigned long long)e.desc.shape[i]);
			printf("%-66s %-10s %-14s %10llu  %s\n",
			       id->valuestring, ecx_dtype_name(e.desc.dtype),
			       shape, (unsigned long long)e.desc.nbytes,
			       e.producer_zmq);
		}
		bool more = cJSON_IsString(next);
		if (more)
			ecx_strlcpy(after, next->valuestring, sizeof(after));
		cJSON_Delete(o);
		free(body);
		if (!more)
			break;
	}
	ecx_regclient_destroy(c);
	if (rc == EXIT_OK && !t.json) {
		char b[32];
		printf("%zu entries, %s\n", shown,
		       tool_bytes(bytes, b, sizeof(b)));
	}
	return rc;
}
