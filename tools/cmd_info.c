/* cmd_info.c - `ecx info` and `ecx ls`: read a registry. */
#include "tool.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static const char info_help[] =
    "usage: ecx info [--json] [--token T] [--timeout MS] REGISTRY ID\n"
    "\n"
    "Prints the registry entry of one item: dtype, shape, size and the\n"
    "producer that holds it. REGISTRY is http://HOST:PORT or\n"
    "redis://HOST:PORT[/DB], or several separated by commas (the first\n"
    "that has the id answers).\n"
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
    "(at most 1000) until all are shown. REGISTRY is http://HOST:PORT or\n"
    "redis://HOST:PORT[/DB] (what producers publish there); of a\n"
    "comma-separated list, the first is listed.\n"
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

static ecx_client *open_client(const char *cmd, const char *urls,
                               const tool_common *t, int *rc)
{
	ecx_client_params p = {.field_mask = ECX_CLIENT_PARAM_REGISTRY |
	                                     ECX_CLIENT_PARAM_TOKEN |
	                                     ECX_CLIENT_PARAM_TIMEOUT |
	                                     ECX_CLIENT_PARAM_CONNECT_TIMEOUT,
	                       .registry = urls,
	                       .token = t->token,
	                       .timeout_ms = t->timeout_ms,
	                       .connect_timeout_ms = t->timeout_ms};
	ecx_client *c = NULL;
	char why[256];
	if (ecx_client_create(&p, &c, why, sizeof(why)) != 0)
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
	ecx_client *c = open_client("info", argv[optind], &t, &rc);
	if (c == NULL)
		return rc;
	ecx_item it = {.id = id, .status = ECX_ENOTFOUND};
	rc = ecx_client_lookup(c, &it, 1);
	ecx_client_destroy(c);
	if (rc != 0 && it.status != 0)
		return tool_fail("info", EXIT_FAIL, "%s", ecx_last_error());
	if (it.status != 0)
		return tool_fail("info", EXIT_NOTFOUND, "%s: unknown mm_hash",
		                 id);
	if (t.json) {
		char *s = ecx_item_to_json(&it);
		printf("%s\n", s != NULL ? s : "{}");
		ecx_free(s);
		return EXIT_OK;
	}
	char b[32];
	printf("id:        %s\ndtype:     %s\nshape:     ", id,
	       ecx_dtype_name(it.desc.dtype));
	print_shape(&it.desc);
	printf("\nnbytes:    %llu (%s)\nproducer:  %s\n",
	       (unsigned long long)it.desc.nbytes,
	       tool_bytes(it.desc.nbytes, b, sizeof(b)), it.producer);
	return EXIT_OK;
}

/* One page of a listing, kept until the page has come in whole: nothing
 * is printed for a request that fails. */
typedef struct ls_page {
	ecx_item *rows;
	char (*ids)[ECX_ID_MAX + 1];
	size_t n, cap;
} ls_page;

static int ls_keep(void *arg, const ecx_item *it)
{
	ls_page *p = arg;
	if (p->n == p->cap)
		return ECX_EPROTO; /* more rows than the page holds */
	p->rows[p->n] = *it;
	tool_strlcpy(p->ids[p->n], it->id, sizeof(p->ids[0]));
	p->rows[p->n].id = p->ids[p->n];
	p->n++;
	return 0;
}

static void ls_print(const ecx_item *it, bool json)
{
	if (json) {
		/* The registry's entry with the id last, as GET /ec/list
		 * gives it (ids need no JSON escaping). */
		char *s = ecx_item_to_json(it);
		size_t l = s != NULL ? strlen(s) : 0;
		if (l > 0 && s[l - 1] == '}')
			printf("%.*s,\"id\":\"%s\"}\n", (int)(l - 1), s,
			       it->id);
		ecx_free(s);
		return;
	}
	char shape[64] = "";
	size_t off = 0;
	for (uint32_t i = 0; i < it->desc.ndim && off < sizeof(shape); i++)
		off += (size_t)snprintf(shape + off, sizeof(shape) - off,
		                        "%s%llu", i ? "x" : "",
		                        (unsigned long long)it->desc.shape[i]);
	printf("%-66s %-10s %-14s %10llu  %s\n", it->id,
	       ecx_dtype_name(it->desc.dtype), shape,
	       (unsigned long long)it->desc.nbytes, it->producer);
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
	/* Of a list, the first registry: it is where a producer publishes. */
	const char *urls = argv[optind];
	char first[ECX_ADDR_MAX];
	size_t fl = strcspn(urls, ",");
	if (fl >= sizeof(first))
		return tool_fail("ls", EXIT_USAGE, "registry URL too long");
	memcpy(first, urls, fl);
	first[fl] = '\0';
	ecx_client *c = open_client("ls", first, &t, &rc);
	if (c == NULL)
		return rc;
	ls_page page = {.rows = calloc((size_t)limit, sizeof(ecx_item)),
	                .ids = calloc((size_t)limit, sizeof(*page.ids)),
	                .cap = (size_t)limit};
	if (page.rows == NULL || page.ids == NULL) {
		free(page.rows);
		free(page.ids);
		ecx_client_destroy(c);
		return tool_fail("ls", EXIT_FAIL, "out of memory");
	}
	char after[ECX_ID_MAX + 1] = "";
	size_t shown = 0;
	uint64_t bytes = 0;
	bool header = false;
	rc = EXIT_OK;
	for (;;) {
		char next[ECX_ID_MAX + 1];
		page.n = 0;
		if (ecx_client_list(c, after, (size_t)limit, ls_keep, &page,
		                    next, sizeof(next), NULL) != 0) {
			rc = tool_fail("ls", EXIT_FAIL, "%s", ecx_last_error());
			break;
		}
		if (!t.json && !header) {
			printf("%-66s %-10s %-14s %10s  %s\n", "ID", "DTYPE",
			       "SHAPE", "BYTES", "PRODUCER");
			header = true;
		}
		for (size_t i = 0; i < page.n; i++) {
			ls_print(&page.rows[i], t.json);
			shown++;
			bytes += page.rows[i].desc.nbytes;
		}
		if (next[0] == '\0')
			break;
		tool_strlcpy(after, next, sizeof(after));
	}
	free(page.rows);
	free(page.ids);
	ecx_client_destroy(c);
	if (rc == EXIT_OK && !t.json) {
		char b[32];
		printf("%zu entries, %s\n", shown,
		       tool_bytes(bytes, b, sizeof(b)));
	}
	return rc;
}
