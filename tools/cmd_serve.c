/* cmd_serve.c - `ecx serve`: a producer daemon. */
#include "tool.h"

#include "gen.h"
#include "npy.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx serve [OPTIONS] [[ID=]FILE ...]\n"
    "\n"
    "Runs a producer: keeps items in a registered arena, publishes them to\n"
    "a registry (its own embedded one, or --registry), and serves pulls\n"
    "until SIGINT, SIGTERM or SIGHUP, then unpublishes what it published.\n"
    "\n"
    "Items come from files (a .npy file carries its dtype and shape; any\n"
    "other file is raw bytes and needs --dtype and --shape), named ID or\n"
    "else the file's name without its extension, or are synthetic:\n"
    "  --synthetic N        N items of --shape and --dtype, ids PREFIX-0...\n"
    "  --workload qwen      --count items shaped like Qwen2.5-VL image\n"
    "                       embeddings (64 to 2691 x 3584 bfloat16)\n"
    "  --count N            items of the workload (default 200)\n"
    "  --prefix P           id prefix of generated items (default\n"
    "                       'synthetic' or 'qwen')\n"
    "  --shape AxB...       shape, e.g. 1024x3584\n"
    "  --dtype D            torch dtype name, e.g. bfloat16\n"
    "Synthetic bytes depend only on the id, so 'ecx get --verify' checks.\n"
    "\n"
    "Options:\n"
    "  --bind HOST          listen address (default 0.0.0.0)\n"
    "  --port PORT          embedded registry port (default 9018, the\n"
    "                       reference's registry_http_port; 0 picks one)\n"
    "  --registry URL       publish to this registry instead of embedding\n"
    "                       one: http://HOST:PORT or redis://HOST:PORT[/DB]\n"
    "  --registry-ttl S     with Redis: entries expire S seconds after this\n"
    "                       producer stops renewing them (default 30)\n"
    "  --advertise HOST     host consumers reach this producer at\n"
    "                       (default: the bind address, or this host's\n"
    "                       first non-loopback IPv4 address)\n"
    "  --zmq-port PORT      rendezvous port (default: a free one)\n"
    "  --capacity SIZE      arena size, e.g. 512MiB (default 1GiB)\n"
    "  --transport T        auto (default), tcp or shm\n"
    "  --token T            required on pulls and registry writes\n"
    "                       (default $ECX_TOKEN)\n"
    "  --timeout MS         bound on transfers and registry calls (5s)\n"
    "  --verify-hash        hash each item at put (xxh64) and send the hash\n"
    "                       with every pull, for consumers that check it\n"
    "  --json               print the ready line as JSON\n"
    "  -h, --help           this text\n"
    "\n"
    "Once serving it prints one line to stdout: 'serving N items (SIZE) at\n"
    "tcp://HOST:PORT, registry URL', or with --json {\"registry\": URL,\n"
    "\"producer\": ADDR, \"items\": N, \"bytes\": B, \"put_seconds\": S}.\n"
    "Exit codes: 0 stopped by a signal, 1 failure, 2 usage error.\n";

typedef struct serve_opts {
	ecx_producer_params p;
	size_t synthetic, count;
	const char *workload, *prefix, *shape, *dtype;
	bool json;
} serve_opts;

static bool parse_shape(const char *s, uint64_t *dims, uint32_t *nd)
{
	*nd = 0;
	while (*s != '\0') {
		char *end;
		if (*nd == ECX_MAX_DIMS)
			return false;
		dims[(*nd)++] = strtoull(s, &end, 10);
		if (end == s || (*end != 'x' && *end != '\0'))
			return false;
		s = *end == 'x' ? end + 1 : end;
	}
	return *nd > 0;
}

/* Time spent in ecx_producer_put, for the ready line. */
static uint64_t put_ns;

/* A progress line on stderr while items go in, when it is a terminal. */
static void progress(size_t done, size_t total, uint64_t bytes)
{
	static int tty = -1;
	if (tty < 0)
		tty = isatty(STDERR_FILENO);
	if (!tty || total < 2)
		return;
	char b[32];
	fprintf(stderr, "\recx serve: %zu/%zu items (%s)\033[K%s", done, total,
	        tool_bytes(bytes, b, sizeof(b)), done == total ? "\n" : "");
}

/* Puts one item, reporting failures; returns false on failure. */
static bool serve_put(ecx_producer *prod, const char *id,
                      const ecx_tensor_desc *d, const void *data)
{
	uint64_t t0 = tool_now_ns();
	int rc = ecx_producer_put(prod, id, d, data);
	put_ns += tool_now_ns() - t0;
	if (rc != 0)
		tool_fail("serve", EXIT_FAIL, "%s", ecx_last_error());
	return rc == 0;
}

static int serve_files(ecx_producer *prod, int n, char **files,
                       const serve_opts *o, size_t *items, uint64_t *bytes)
{
	for (int i = 0; i < n; i++) {
		char id[ECX_ID_MAX + 1], why[256];
		const char *path = files[i];
		const char *eq = strchr(path, '=');
		if (eq != NULL && (size_t)(eq - path) <= ECX_ID_MAX) {
			memcpy(id, path, (size_t)(eq - path));
			id[eq - path] = '\0';
			path = eq + 1;
		} else {
			const char *base = strrchr(path, '/');
			tool_strlcpy(id, base ? base + 1 : path, sizeof(id));
			char *dot = strrchr(id, '.');
			if (dot != NULL && dot != id)
				*dot = '\0';
		}
		if (ecx_id_check(id, why, sizeof(why)) != 0)
			return tool_fail("serve", EXIT_USAGE,
			                 "%s: %s (name it with ID=%s)", path,
			                 why, path);
		ecx_tensor_desc d;
		void *data = NULL;
		size_t plen = strlen(path);
		int rc;
		if (plen > 4 && strcmp(path + plen - 4, ".npy") == 0) {
			rc = npy_read(path, &d, &data, why, sizeof(why));
		} else {
			ecx_dtype dt;
			uint64_t dims[ECX_MAX_DIMS];
			uint32_t nd;
			if (o->dtype == NULL || o->shape == NULL ||
			    ecx_dtype_parse(o->dtype, &dt) != 0 ||
			    !parse_shape(o->shape, dims, &nd))
				return tool_fail(
				    "serve", EXIT_USAGE,
				    "%s is raw bytes: give --dtype "
				    "and --shape",
				    path);
			rc = ecx_tensor_set(&d, dt, nd, dims);
			FILE *f = rc == 0 ? fopen(path, "rb") : NULL;
			data = malloc(d.nbytes ? d.nbytes : 1);
			if (f == NULL || data == NULL ||
			    fread(data, 1, d.nbytes, f) != d.nbytes ||
			    fgetc(f) != EOF)
				rc = tool_why(
				    why, sizeof(why), ECX_ESIZE,
				    "%s is not %llu bytes (its --shape "
				    "and --dtype)",
				    path, (unsigned long long)d.nbytes);
			if (f != NULL)
				fclose(f);
		}
		if (rc != 0) {
			free(data);
			return tool_fail("serve", EXIT_FAIL, "%s", why);
		}
		bool ok = serve_put(prod, id, &d, data);
		free(data);
		if (!ok)
			return EXIT_FAIL;
		(*items)++;
		*bytes += d.nbytes;
		progress((size_t)i + 1, (size_t)n, *bytes);
	}
	return EXIT_OK;
}

static int serve_generated(ecx_producer *prod, const serve_opts *o,
                           size_t *items, uint64_t *bytes)
{
	size_t n = o->workload != NULL ? o->count : o->synthetic;
	ecx_tensor_desc fixed;
	if (o->workload == NULL) {
		ecx_dtype dt;
		uint64_t dims[ECX_MAX_DIMS];
		uint32_t nd;
		if (o->dtype == NULL || ecx_dtype_parse(o->dtype, &dt) != 0)
			return tool_fail(
			    "serve", EXIT_USAGE,
			    "--synthetic needs --dtype (a torch dtype "
			    "name such as bfloat16)");
		if (o->shape == NULL || !parse_shape(o->shape, dims, &nd))
			return tool_fail("serve", EXIT_USAGE,
			                 "--synthetic needs --shape, e.g. "
			                 "1024x3584");
		if (ecx_tensor_set(&fixed, dt, nd, dims) != 0)
			return tool_fail("serve", EXIT_USAGE,
			                 "shape too large");
	}
	const char *prefix = o->prefix != NULL     ? o->prefix
	                     : o->workload != NULL ? o->workload
	                                           : "synthetic";
	void *buf = NULL;
	size_t cap = 0;
	for (size_t i = 0; i < n; i++) {
		ecx_tensor_desc d = fixed;
		if (o->workload != NULL) {
			uint64_t dims[2] = {gen_qwen_tokens(i), 3584};
			ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
		}
		if (d.nbytes > cap) {
			free(buf);
			cap = d.nbytes;
			buf = malloc(cap);
			if (buf == NULL)
				return tool_fail("serve", EXIT_FAIL,
				                 "out of memory");
		}
		char id[ECX_ID_MAX + 1];
		snprintf(id, sizeof(id), "%s-%zu", prefix, i);
		gen_fill(id, buf, d.nbytes);
		if (!serve_put(prod, id, &d, buf)) {
			free(buf);
			return EXIT_FAIL;
		}
		(*items)++;
		*bytes += d.nbytes;
		progress(i + 1, n, *bytes);
	}
	free(buf);
	return EXIT_OK;
}

int cmd_serve(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"bind", required_argument, NULL, 'b'},
	    {"port", required_argument, NULL, 'p'},
	    {"registry", required_argument, NULL, 'r'},
	    {"advertise", required_argument, NULL, 'a'},
	    {"zmq-port", required_argument, NULL, 'z'},
	    {"capacity", required_argument, NULL, 'c'},
	    {"transport", required_argument, NULL, 'T'},

	    {"synthetic", required_argument, NULL, 'S'},
	    {"workload", required_argument, NULL, 'w'},
	    {"count", required_argument, NULL, 'n'},
	    {"prefix", required_argument, NULL, 'P'},
	    {"shape", required_argument, NULL, 's'},
	    {"dtype", required_argument, NULL, 'd'},
	    {"registry-ttl", required_argument, NULL, 'L'},
	    {"verify-hash", no_argument, NULL, 'H'},
	    TOOL_OPT_ENTRIES,
	    {NULL, 0, NULL, 0}};
	serve_opts o = {.count = 200};
	ecx_producer_params *p = &o.p;
	p->field_mask = ECX_PRODUCER_PARAM_BIND_HOST |
	                ECX_PRODUCER_PARAM_REGISTRY_PORT |
	                ECX_PRODUCER_PARAM_TOKEN | ECX_PRODUCER_PARAM_TIMEOUT;
	p->bind_host = "0.0.0.0";
	p->registry_port = ECX_REGISTRY_PORT_DEFAULT;
	tool_common t = {.token = getenv("ECX_TOKEN"), .timeout_ms = 5000};
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		uint16_t port;
		switch (c) {
		case 'b':
			p->bind_host = optarg;
			break;
		case 'p':
			if (!tool_parse_port(optarg, &port))
				return tool_fail("serve", EXIT_USAGE,
				                 "bad --port '%s'", optarg);
			p->registry_port = port;
			break;
		case 'r':
			p->field_mask |= ECX_PRODUCER_PARAM_REGISTRY;
			p->field_mask &=
			    ~(uint64_t)ECX_PRODUCER_PARAM_REGISTRY_PORT;
			p->registry = optarg;
			break;
		case 'a':
			p->field_mask |= ECX_PRODUCER_PARAM_ADVERTISE_HOST;
			p->advertise_host = optarg;
			break;
		case 'z':
			if (!tool_parse_port(optarg, &p->zmq_port))
				return tool_fail("serve", EXIT_USAGE,
				                 "bad --zmq-port '%s'", optarg);
			p->field_mask |= ECX_PRODUCER_PARAM_ZMQ_PORT;
			break;
		case 'c':
			if (!tool_parse_size(optarg, &p->capacity_bytes))
				return tool_fail(
				    "serve", EXIT_USAGE,
				    "bad --capacity '%s' (e.g. 1GiB)", optarg);
			p->field_mask |= ECX_PRODUCER_PARAM_CAPACITY;
			break;
		case 'T':
			p->field_mask |= ECX_PRODUCER_PARAM_TRANSPORT;
			p->transport = optarg;
			break;
		case 'S':
			o.synthetic = strtoul(optarg, NULL, 10);
			if (o.synthetic == 0)
				return tool_fail(
				    "serve", EXIT_USAGE,
				    "--synthetic takes a count > 0");
			break;
		case 'w':
			if (strcmp(optarg, "qwen") != 0)
				return tool_fail(
				    "serve", EXIT_USAGE,
				    "unknown --workload '%s' (qwen)", optarg);
			o.workload = optarg;
			break;
		case 'n':
			o.count = strtoul(optarg, NULL, 10);
			break;
		case 'P':
			o.prefix = optarg;
			break;
		case 's':
			o.shape = optarg;
			break;
		case 'd':
			o.dtype = optarg;
			break;
		case 'H':
			p->field_mask |= ECX_PRODUCER_PARAM_INTEGRITY;
			p->integrity = 1;
			break;
		case 'L':
			p->registry_ttl_s = atoi(optarg);
			if (p->registry_ttl_s < 0)
				return tool_fail("serve", EXIT_USAGE,
				                 "bad --registry-ttl '%s'",
				                 optarg);
			p->field_mask |= ECX_PRODUCER_PARAM_REGISTRY_TTL;
			break;
		default: {
			int rc = tool_opt("serve", help, c, optarg, &t);
			if (rc >= 0)
				return rc;
		}
		}
	}
	p->token = t.token;
	p->timeout_ms = t.timeout_ms;
	o.json = t.json;
	if (o.synthetic > 0 && o.workload != NULL)
		return tool_fail("serve", EXIT_USAGE,
		                 "give --synthetic or --workload, not both");
	char why[256];
	if (o.prefix != NULL) {
		char probe[ECX_ID_MAX + 1];
		snprintf(probe, sizeof(probe), "%s-0", o.prefix);
		if (ecx_id_check(probe, why, sizeof(why)) != 0)
			return tool_fail("serve", EXIT_USAGE, "--prefix: %s",
			                 why);
	}
	tool_block_signals();
	ecx_producer *prod;
	if (ecx_producer_create(p, &prod, why, sizeof(why)) != 0)
		return tool_fail("serve", EXIT_FAIL, "cannot start: %s", why);
	size_t items = 0;
	uint64_t bytes = 0;
	int rc =
	    serve_files(prod, argc - optind, argv + optind, &o, &items, &bytes);
	if (rc == EXIT_OK && (o.synthetic > 0 || o.workload != NULL))
		rc = serve_generated(prod, &o, &items, &bytes);
	double put_s = (double)put_ns / 1e9;
	if (rc != EXIT_OK) {
		ecx_producer_destroy(prod);
		return rc;
	}
	char reg[ECX_ADDR_MAX + 32];
	const char *addr = ecx_producer_address(prod);
	if (p->field_mask & ECX_PRODUCER_PARAM_REGISTRY) {
		tool_strlcpy(reg, p->registry, sizeof(reg));
	} else {
		/* The advertised host of producer_zmq, with the registry port.
		 */
		const char *h = addr + 6; /* after tcp:// */
		const char *colon = strrchr(h, ':');
		snprintf(reg, sizeof(reg), "http://%.*s:%u", (int)(colon - h),
		         h, ecx_producer_registry_port(prod));
	}
	char b[32];
	if (o.json)
		printf(
		    "{\"registry\": \"%s\", \"producer\": \"%s\", \"items\": "
		    "%zu, \"bytes\": %llu, \"put_seconds\": %.6f}\n",
		    reg, addr, items, (unsigned long long)bytes, put_s);
	else
		printf("serving %zu items (%s) at %s, registry %s\n", items,
		       tool_bytes(bytes, b, sizeof(b)), addr, reg);
	fflush(stdout);
	int sig = tool_wait_signal();
	ecx_producer_stats st;
	ecx_producer_stats_get(prod, &st);
	ecx_producer_destroy(prod);
	fprintf(stderr,
	        "ecx serve: stopped on signal %d; served %llu items (%s) in "
	        "%llu pulls; unpublished %llu items\n",
	        sig, (unsigned long long)st.items_served,
	        tool_bytes(st.bytes_served, b, sizeof(b)),
	        (unsigned long long)st.pulls, (unsigned long long)st.items);
	return EXIT_OK;
}
