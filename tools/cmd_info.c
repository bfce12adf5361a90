/* cmd_info.c - `ecx info` and `ecx ls`: read a registry. */
#include "tool.h"

#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const char info_help[] =
    "usage: ecx info [--json] [--token T] [--timeout DUR] REGISTRY ID\n"
    "\n"
    "Prints the registry entry of one item: dtype, shape, size and the\n"
    "producer that holds it (\"a reference producer\" when the entry has\n"
    "none of ecx's fields: its items load over Mooncake's TCP wire).\n"
    "REGISTRY is http://HOST:PORT, redis://[:PASSWORD@]HOST[:PORT][/DB]\n"
    "or redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER\n"
    "[/DB], or several separated by commas (the first that has the id\n"
    "answers).\n"
    "\n"
    "Options:\n"
    "  --json           print the entry as the registry's JSON\n"
    "  --token T        bearer token (default $ECX_TOKEN)\n"
    "  --timeout DUR    bound on each request, with its unit: 500ms, 2s\n"
    "                   (default 5s)\n"
    "  -h, --help       this text\n"
    "\n"
    "Exit codes: 0 found, 3 not found, 1 registry error, 2 usage error.\n";

static const char ls_help[] =
    "usage: ecx ls [--json] [--limit N] [--token T] [--timeout DUR]\n"
    "              REGISTRY\n"
    "\n"
    "Lists a registry's entries, sorted by id, fetching pages of --limit\n"
    "(at most 1000) until all are shown. REGISTRY is http://HOST:PORT,\n"
    "redis://[:PASSWORD@]HOST[:PORT][/DB] or\n"
    "redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]\n"
    "(what producers publish there), or several separated\n"
    "by commas: each is listed in turn, in the order given (an\n"
    "id that several hold is shown once per registry). A registry that\n"
    "fails is said on stderr and the others are still listed; the exit\n"
    "code is then 1.\n"
    "\n"
    "Options:\n"
    "  --json           one JSON array of the entries (each an object:\n"
    "                   the entry and its id; with several registries,\n"
    "                   also the registry's URL), one element a line\n"
    "  --limit N        entries per page (default 500)\n"
    "  --token T        bearer token (default $ECX_TOKEN)\n"
    "  --timeout DUR    bound on each request, with its unit: 500ms, 2s\n"
    "                   (default 5s)\n"
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
		case 'l': {
			uint64_t v;
			if (limit == NULL ||
			    !tool_parse_uint(optarg, 1, 1000, &v))
				return tool_bad_value(cmd, "--limit", optarg,
				                      "1 to 1000");
			*limit = (int)v;
			break;
		}
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
	if (argc - optind == 0)
		return tool_missing("info", "REGISTRY and ID");
	if (argc - optind == 1)
		return tool_missing("info", "ID (after REGISTRY)");
	if (argc - optind > 2)
		return tool_fail(
		    "info", EXIT_USAGE,
		    "one REGISTRY and one ID; '%s' is one too many",
		    argv[optind + 2]);
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
	printf("\nnbytes:    %llu (%s)\nproducer:  %s%s\n",
	       (unsigned long long)it.desc.nbytes,
	       tool_bytes(it.desc.nbytes, b, sizeof(b)), it.producer,
	       it.epoch == ECX_EPOCH_REFERENCE
	           ? " (a reference producer: its entry has none of ecx's "
	             "fields; loads use its pull op over Mooncake's wire)"
	           : "");
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

/* Prints one entry: a row of the table, or with --json an element of the
 * array (the first opens it on a line of its own, each later one is
 * preceded by a comma). */
static void ls_print(const ecx_item *it, bool json, const char *url,
                     size_t shown)
{
	if (json) {
		/* The registry's entry with the id last, as GET /ec/list
		 * gives it; and where it was listed, of several. */
		char *s = ecx_item_to_json(it);
		cJSON *o = s != NULL ? cJSON_Parse(s) : NULL;
		ecx_free(s);
		if (o == NULL)
			o = cJSON_CreateObject();
		cJSON_AddStringToObject(o, "id", it->id);
		if (url != NULL)
			cJSON_AddStringToObject(o, "registry", url);
		fputs(shown > 0 ? ",\n" : "\n", stdout);
		char *line = cJSON_PrintUnformatted(o);
		cJSON_Delete(o);
		fputs(line != NULL ? line : "{}", stdout);
		cJSON_free(line);
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
	if (argc - optind == 0)
		return tool_missing("ls", "REGISTRY");
	if (argc - optind > 1)
		return tool_fail("ls", EXIT_USAGE,
		                 "one REGISTRY (several are joined by commas); "
		                 "'%s' is one too many",
		                 argv[optind + 1]);
	/* Each registry of a list in turn. */
	char urls[TOOL_REGISTRIES_MAX][ECX_ADDR_MAX], why[128];
	int nu = tool_registry_split(argv[optind], urls, why, sizeof(why));
	if (nu < 0)
		return tool_fail("ls", EXIT_USAGE, "%s", why);
	if (nu == 0)
		return tool_missing("ls", "REGISTRY");
	size_t nurls = (size_t)nu;
	ls_page page = {.rows = calloc((size_t)limit, sizeof(ecx_item)),
	                .ids = calloc((size_t)limit, sizeof(*page.ids)),
	                .cap = (size_t)limit};
	if (page.rows == NULL || page.ids == NULL) {
		free(page.rows);
		free(page.ids);
		return tool_fail("ls", EXIT_FAIL, "out of memory");
	}
	/* Every URL is checked before anything is printed: a bad one is a
	 * usage error, with no half-written output. */
	ecx_client *clients[TOOL_REGISTRIES_MAX] = {0};
	for (size_t u = 0; u < nurls; u++) {
		rc = EXIT_OK;
		clients[u] = open_client("ls", urls[u], &t, &rc);
		if (clients[u] == NULL) {
			for (size_t k = 0; k < u; k++)
				ecx_client_destroy(clients[k]);
			free(page.rows);
			free(page.ids);
			return rc;
		}
	}
	size_t shown = 0, failed = 0;
	uint64_t bytes = 0;
	bool header = false;
	/* --json prints one JSON array, every entry on a line of its own,
	 * written as the pages come (memory stays one page however many
	 * entries there are); a registry that fails leaves it valid. */
	if (t.json)
		fputs("[", stdout);
	for (size_t u = 0; u < nurls; u++) {
		ecx_client *c = clients[u];
		char shown_url[ECX_ADDR_MAX];
		tool_mask(urls[u], shown_url, sizeof(shown_url));
		char after[ECX_ID_MAX + 1] = "";
		for (;;) {
			char next[ECX_ID_MAX + 1];
			page.n = 0;
			if (ecx_client_list(c, after, (size_t)limit, ls_keep,
			                    &page, next, sizeof(next),
			                    NULL) != 0) {
				tool_fail("ls", EXIT_FAIL, "%s",
				          ecx_last_error());
				failed++;
				break;
			}
			if (!t.json && !header) {
				printf("%-66s %-10s %-14s %10s  %s\n", "ID",
				       "DTYPE", "SHAPE", "BYTES", "PRODUCER");
				header = true;
			}
			for (size_t i = 0; i < page.n; i++) {
				ls_print(&page.rows[i], t.json,
				         nurls > 1 ? shown_url : NULL, shown);
				shown++;
				bytes += page.rows[i].desc.nbytes;
			}
			if (next[0] == '\0')
				break;
			tool_strlcpy(after, next, sizeof(after));
		}
		ecx_client_destroy(c);
	}
	if (t.json)
		fputs("\n]\n", stdout);
	free(page.rows);
	free(page.ids);
	if (failed < nurls && !t.json) {
		char b[32];
		if (nurls > 1)
			printf("%zu entries, %s, in %zu of %zu registries\n",
			       shown, tool_bytes(bytes, b, sizeof(b)),
			       nurls - failed, nurls);
		else
			printf("%zu entries, %s\n", shown,
			       tool_bytes(bytes, b, sizeof(b)));
	}
	return failed > 0 ? EXIT_FAIL : EXIT_OK;
}
