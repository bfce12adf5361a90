/* cmd_get.c - `ecx get`: pull one item into a .npy file. */
#include "tool.h"

#include "gen.h"
#include "npy.h"

#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static const char help[] =
    "usage: ecx get [OPTIONS] REGISTRY ID -o FILE.npy\n"
    "\n"
    "Looks ID up in REGISTRY (http://HOST:PORT,\n"
    "redis://[:PASSWORD@]HOST[:PORT][/DB] or\n"
    "redis+sentinel://[:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB],\n"
    "or several separated by commas: the first that has the id answers),\n"
    "pulls it from its producer and writes it as a .npy file that\n"
    "numpy.load opens with the item's dtype and shape.\n"
    "\n"
    "numpy has no bfloat16 or float8 dtypes: those items are written with\n"
    "a one-field structured dtype over the raw bits, named after the torch\n"
    "dtype. Read them back with\n"
    "    a = numpy.load('x.npy')['bfloat16']            # uint16 bits\n"
    "    t = torch.from_numpy(a.view(numpy.int16)).view(torch.bfloat16)\n"
    "(float8_e4m3fn and float8_e5m2 alike, over uint8 and int8).\n"
    "\n"
    "The file is written whole or not at all: into .FILE.PID.part beside\n"
    "it, renamed to FILE once complete. A failure (a full disk) or SIGINT,\n"
    "SIGTERM or SIGHUP meanwhile removes the .part file and leaves a FILE\n"
    "that was there as it was; a FILE replaced keeps its permissions.\n"
    "A FILE that is a symbolic link is written through to the file it\n"
    "names. (A device or pipe such as /dev/null is written in place, and\n"
    "so, with a warning, is a FILE whose folder takes no new file.)\n"
    "\n"
    "Options:\n"
    "  -o, --output FILE    where to write (required; '-' is not allowed)\n"
    "  --verify             check the bytes against 'ecx serve --synthetic'\n"
    "                       (they depend only on the id)\n"
    "  --verify-hash        check the bytes against the hash (XXH3) the\n"
    "                       producer took at put (it must run with\n"
    "                       --verify-hash)\n"
    "  --transport T        auto (default), tcp or shm\n"
    "  --mooncake M         auto (default, $ECX_MOONCAKE), off or force:\n"
    "                       how an item of a reference producer loads (over\n"
    "                       Mooncake's TCP wire), and whether every item does\n"
    "  --token T            bearer token (default $ECX_TOKEN)\n"
    "  --timeout DUR        bound on each step, with its unit: 500ms, 2s\n"
    "                       (default 5s)\n"
    "  --json               print the result as JSON\n"
    "  -h, --help           this text\n"
    "\n"
    "Exit codes: 0 written, 3 id not found, 1 other failure (among them a\n"
    "REGISTRY that is no ecx or reference registry: a 404 that is not\n"
    "their {\"detail\": \"unknown mm_hash\"}), 2 usage.\n";

int cmd_get(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"output", required_argument, NULL, 'o'},
	    {"verify", no_argument, NULL, 'v'},
	    {"verify-hash", no_argument, NULL, 'H'},
	    {"transport", required_argument, NULL, 'T'},
	    {"mooncake", required_argument, NULL, 'M'},
	    TOOL_OPT_ENTRIES,
	    {NULL, 0, NULL, 0}};
	const char *out = NULL, *transport = NULL, *mooncake = NULL;
	tool_common t = {.token = getenv("ECX_TOKEN"), .timeout_ms = 5000};
	bool verify = false, hash = false;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "ho:", opts, NULL)) != -1) {
		switch (c) {
		case 'o':
			out = optarg;
			break;
		case 'v':
			verify = true;
			break;
		case 'H':
			hash = true;
			break;
		case 'T':
			transport = optarg;
			break;
		case 'M':
			mooncake = optarg;
			break;
		default: {
			int rc = tool_opt("get", help, c, optarg, &t);
			if (rc >= 0)
				return rc;
		}
		}
	}
	if (argc - optind == 0)
		return tool_missing("get", "REGISTRY and ID");
	if (argc - optind == 1)
		return tool_missing("get", "ID (after REGISTRY)");
	if (argc - optind > 2)
		return tool_fail("get", EXIT_USAGE,
		                 "one REGISTRY and one ID, then -o FILE; "
		                 "'%s' is one too many",
		                 argv[optind + 2]);
	if (out == NULL)
		return tool_missing("get", "-o FILE (the .npy file to write)");
	if (strcmp(out, "-") == 0 || out[0] == '\0')
		return tool_fail("get", EXIT_USAGE,
		                 "-o takes a file name ('-' is not allowed: a "
		                 ".npy file goes to a file)");
	const char *id = argv[optind + 1];
	char why[256];
	if (ecx_id_check(id, why, sizeof(why)) != 0)
		return tool_fail("get", EXIT_USAGE, "%s", why);
	ecx_consumer_params cp = {
	    .field_mask =
	        ECX_CONSUMER_PARAM_REGISTRY | ECX_CONSUMER_PARAM_TOKEN |
	        ECX_CONSUMER_PARAM_TIMEOUT | ECX_CONSUMER_PARAM_RECV_CAPACITY |
	        ECX_CONSUMER_PARAM_TRANSPORT | ECX_CONSUMER_PARAM_INTEGRITY |
	        ECX_CONSUMER_PARAM_MOONCAKE,
	    .registry = argv[optind],
	    .token = t.token,
	    .timeout_ms = t.timeout_ms,
	    .recv_capacity = 0,
	    .transport = transport,
	    .integrity = hash,
	    .mooncake = mooncake};
	ecx_consumer *cons;
	int rc = ecx_consumer_create(&cp, &cons, why, sizeof(why));
	if (rc != 0)
		return tool_fail("get",
		                 rc == ECX_EINVAL ? EXIT_USAGE : EXIT_FAIL,
		                 "%s", why);
	ecx_item it = {.id = id};
	uint64_t t0 = tool_now_ns();
	rc = ecx_consumer_lookup(cons, &it, 1);
	if (rc != 0 && it.status != 0) {
		ecx_consumer_destroy(cons);
		return tool_fail("get", EXIT_FAIL, "%s", ecx_last_error());
	}
	if (it.status == ECX_ENOTFOUND) {
		ecx_consumer_destroy(cons);
		return tool_fail("get", EXIT_NOTFOUND, "%s: unknown mm_hash",
		                 id);
	}
	it.dst = malloc(it.desc.nbytes ? it.desc.nbytes : 1);
	if (it.dst == NULL) {
		ecx_consumer_destroy(cons);
		return tool_fail("get", EXIT_FAIL, "out of memory");
	}
	rc = ecx_consumer_load(cons, &it, 1);
	uint64_t took = tool_now_ns() - t0;
	/* "1 of 1 items failed; first: WHY": the why, which names the item
	 * and its producer, is what to print. */
	const char *detail = strstr(ecx_last_error(), "first: ");
	char msg[768];
	if (detail != NULL)
		snprintf(msg, sizeof(msg), "%s", detail + 7);
	else
		snprintf(msg, sizeof(msg), "%s from %s: %s", id, it.producer,
		         ecx_strerror(it.status));
	ecx_consumer_destroy(cons);
	if (rc != 0) {
		free(it.dst);
		return tool_fail(
		    "get", rc == ECX_ENOTFOUND ? EXIT_NOTFOUND : EXIT_FAIL,
		    "%s", msg);
	}
	if (verify && !gen_check(id, it.dst, it.desc.nbytes)) {
		free(it.dst);
		return tool_fail("get", EXIT_FAIL,
		                 "%s: bytes differ from the synthetic item",
		                 id);
	}
	rc = npy_write(out, &it.desc, it.dst, why, sizeof(why));
	free(it.dst);
	if (rc != 0)
		return tool_fail("get", EXIT_FAIL, "%s", why);
	char b[32];
	if (t.json) {
		cJSON *j = cJSON_CreateObject();
		cJSON_AddStringToObject(j, "id", id);
		cJSON_AddStringToObject(j, "dtype",
		                        ecx_dtype_name(it.desc.dtype));
		cJSON *shape = cJSON_AddArrayToObject(j, "shape");
		for (uint32_t i = 0; shape != NULL && i < it.desc.ndim; i++)
			cJSON_AddItemToArray(
			    shape,
			    cJSON_CreateNumber((double)it.desc.shape[i]));
		cJSON_AddNumberToObject(j, "nbytes", (double)it.desc.nbytes);
		cJSON_AddStringToObject(j, "producer", it.producer);
		cJSON_AddStringToObject(j, "file", out);
		cJSON_AddNumberToObject(j, "seconds", (double)took / 1e9);
		cJSON_AddBoolToObject(j, "verified", verify);
		if (!tool_json_print(j))
			return tool_fail("get", EXIT_FAIL, "out of memory");
	} else
		printf("%s: %s %s from %s in %.2f ms -> %s%s\n", id,
		       ecx_dtype_name(it.desc.dtype),
		       tool_bytes(it.desc.nbytes, b, sizeof(b)), it.producer,
		       (double)took / 1e6, out, verify ? " (verified)" : "");
	return EXIT_OK;
}
