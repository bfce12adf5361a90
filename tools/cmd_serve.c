/* cmd_serve.c - `ecx serve`: a producer daemon. */
#include "tool.h"

#include "gen.h"
#include "npy.h"
#include "serve.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx serve [OPTIONS] [[ID=]FILE ...]\n"
    "\n"
    "Runs a producer: keeps items in a registered arena, publishes them to\n"
    "a registry (its own embedded one, or --registry), and serves pulls\n"
    "until SIGINT, SIGTERM or SIGHUP, then unpublishes what it published.\n"
    "A signal while it starts or while items are still going in stops it\n"
    "too (within a second), unpublishing what was published.\n"
    "\n"
    "Items come from files (a .npy file, known by its first bytes, carries\n"
    "its dtype and shape; any other file is raw bytes and needs --dtype\n"
    "and --shape), named ID or else the file's name without its\n"
    "extension, or are synthetic:\n"
    "  --synthetic N        N items of --shape and --dtype, ids PREFIX-0...\n"
    "  --workload qwen      --count items shaped like Qwen2.5-VL image\n"
    "                       embeddings (64 to 2691 x 3584 bfloat16)\n"
    "  --count N            items of the workload (default 200)\n"
    "  --prefix P           id prefix of generated items (default\n"
    "                       'synthetic' or 'qwen')\n"
    "  --shape AxB...       shape, e.g. 1024x3584\n"
    "  --dtype D            torch dtype name, e.g. bfloat16\n"
    "Synthetic bytes depend only on the id, so 'ecx get --verify' checks.\n"
    "Without --synthetic or --workload, --shape and --dtype describe the\n"
    "files: a .npy file that holds another shape or dtype is refused.\n"
    "\n"
    "Options:\n"
    "  --bind HOST          listen address or host name (default 0.0.0.0;\n"
    "                       an IPv6 address such as ::1, or :: for all)\n"
    "  --port PORT          embedded registry port (default 9018, the\n"
    "                       reference's registry_http_port; 0 picks one)\n"
    "  --registry URL       publish to this registry instead of embedding\n"
    "                       one: http://HOST:PORT,\n"
    "                       redis://[:PASSWORD@]HOST[:PORT][/DB] or\n"
    "                       redis+sentinel://[:PASSWORD@]HOST[:PORT]\n"
    "                       [,HOST[:PORT]...]/MASTER[/DB];\n"
    "                       while it does not answer, serve waits for it\n"
    "                       (said on stderr), then publishes and serves\n"
    "  --registry-ttl S     entries leave the registry (HTTP or Redis) S\n"
    "                       seconds after this producer stops renewing\n"
    "                       them (default 30; it renews every third of it,\n"
    "                       at most every 2 s); with the embedded registry,\n"
    "                       the lease of entries other producers PUT\n"
    "  --advertise HOST     host consumers reach this producer at\n"
    "                       (default: the bind address, or this host's\n"
    "                       first non-loopback IPv4 address)\n"
    "  --zmq-port PORT      rendezvous port (default: a free one)\n"
    "  --capacity SIZE      arena size, 4KiB or more (default 1GiB):\n"
    "                       bytes or a number with a unit, KiB, MiB,\n"
    "                       GiB, TiB (or K, M, G, T; powers of 1024) or\n"
    "                       KB, MB, GB, TB (powers of 1000), e.g. 512MiB;\n"
    "                       more than this host's available memory is\n"
    "                       refused at once\n"
    "  --transport T        auto (default), tcp or shm\n"
    "  --token T            required on pulls and registry writes\n"
    "                       (default $ECX_TOKEN); without one on an\n"
    "                       address other than loopback, serve warns\n"
    "  --timeout DUR        bound on transfers and registry calls, with\n"
    "                       its unit: 500ms, 2s (default 5s)\n"
    "  --verify-hash        hash each item at put (XXH3) and send the hash\n"
    "                       with every pull, for consumers that check it\n"
    "  --no-mooncake        refuse the reference's pull op (by default it\n"
    "                       is served: the item is written into the\n"
    "                       consumer's Mooncake session over Mooncake's\n"
    "                       TCP wire)\n"
    "  --json               print the ready line as JSON\n"
    "  -h, --help           this text\n"
    "\n"
    "\n"
    "The embedded registry's /healthz answers 503 {\"starting\": true}\n"
    "until every item is put and published, then 200: when it is ok, the\n"
    "items are found.\n"
    "Entries removed from the registry (a DELETE by HTTP) while it holds\n"
    "their items are published again within 2 s (the renew period).\n"
    "\n"
    "Once serving it prints one line to stdout: 'serving N items (SIZE) at\n"
    "tcp://HOST:PORT, registry URL', N and SIZE counting the items kept\n"
    "(when the arena could not hold them all, the line says how many were\n"
    "evicted for room), or with --json {\"registry\": URL, \"producer\":\n"
    "ADDR, \"items\": N, \"bytes\": B, \"put\": ITEMS PUT, \"put_bytes\": B,\n"
    "\"evicted\": N, \"capacity\": B, \"put_seconds\": S}. A registry\n"
    "URL's password is never printed, here or in any message: it shows\n"
    "as ***.\n"
    "Exit codes: 128+N stopped by signal N, at any time, after\n"
    "unpublishing what it published (130 SIGINT, 143 SIGTERM); 1 failure;\n"
    "2 usage error.\n";

/* While the producer starts: a signal ends the process at once, or, if
 * the producer has started meanwhile, is handed to the put phase. */
static bool started;
static int handed_sig;

static void *watch_start(void *arg)
{
	(void)arg;
	while (!__atomic_load_n(&started, __ATOMIC_ACQUIRE)) {
		int sig = tool_poll_signal(50);
		if (sig == 0)
			continue;
		if (!__atomic_load_n(&started, __ATOMIC_ACQUIRE)) {
			fprintf(stderr,
			        "ecx serve: stopped on signal %d while "
			        "starting; nothing was published\n",
			        sig);
			_exit(128 + sig);
		}
		handed_sig = sig;
		break;
	}
	return NULL;
}

/* Checks the options that need no producer: exit code, or -1 to go on. */
static int serve_check(const serve_opts *o, int nfiles)
{
	ecx_dtype dt;
	uint64_t dims[ECX_MAX_DIMS];
	uint32_t nd;
	if (o->synthetic > 0 && o->workload != NULL)
		return tool_fail("serve", EXIT_USAGE,
		                 "give --synthetic or --workload, not both");
	if (o->dtype != NULL && ecx_dtype_parse(o->dtype, &dt) != 0)
		return tool_fail("serve", EXIT_USAGE,
		                 "unknown --dtype '%s' (float16, bfloat16, "
		                 "float32, float64, int8, uint8, int16, "
		                 "int32, int64, bool, float8_e4m3fn, "
		                 "float8_e5m2)",
		                 o->dtype);
	if (o->shape != NULL && !parse_shape(o->shape, dims, &nd))
		return tool_bad_value("serve", "--shape", o->shape,
		                      "whole numbers joined by x, e.g. "
		                      "1024x3584, at most 8 of them");
	char why[256];
	if (o->prefix != NULL) {
		char probe[ECX_ID_MAX + 1];
		snprintf(probe, sizeof(probe), "%s-0", o->prefix);
		if (ecx_id_check(probe, why, sizeof(why)) != 0)
			return tool_fail("serve", EXIT_USAGE, "--prefix: %s",
			                 why);
	}
	if (nfiles == 0 && o->synthetic == 0 && o->workload == NULL &&
	    (o->shape != NULL || o->dtype != NULL))
		return tool_missing("serve",
		                    "--synthetic N or files for --shape and "
		                    "--dtype to describe");
	return -1;
}

/* The ready line, on stdout: what is kept, what was evicted for room. */
static bool serve_ready(const serve_run *r, const serve_opts *o,
                        const char *reg)
{
	ecx_producer_stats st;
	ecx_producer_stats_get(r->prod, &st);
	uint64_t kept = st.items, evicted = st.evictions, bytes = 0;
	if (evicted == 0 || r->nsizes == 0)
		bytes = r->put_bytes;
	else
		for (uint64_t i = 0; i < kept && i < r->put; i++)
			bytes += r->sizes[(r->put - 1 - i) % r->nsizes];
	const char *addr = ecx_producer_address(r->prod);
	double put_s = (double)r->put_ns / 1e9;
	if (o->json) {
		cJSON *j = cJSON_CreateObject();
		cJSON_AddStringToObject(j, "registry", reg);
		cJSON_AddStringToObject(j, "producer", addr);
		cJSON_AddNumberToObject(j, "items", (double)kept);
		cJSON_AddNumberToObject(j, "bytes", (double)bytes);
		cJSON_AddNumberToObject(j, "put", (double)r->put);
		cJSON_AddNumberToObject(j, "put_bytes", (double)r->put_bytes);
		cJSON_AddNumberToObject(j, "evicted", (double)evicted);
		cJSON_AddNumberToObject(j, "capacity", (double)st.capacity);
		cJSON_AddNumberToObject(j, "put_seconds", put_s);
		return tool_json_print(j);
	}
	char b[32], c[32];
	if (evicted == 0)
		printf("serving %llu items (%s) at %s, registry %s\n",
		       (unsigned long long)kept,
		       tool_bytes(bytes, b, sizeof(b)), addr, reg);
	else
		printf("serving %llu items (%s; %llu more were evicted for "
		       "room: the arena holds %s) at %s, registry %s\n",
		       (unsigned long long)kept,
		       tool_bytes(bytes, b, sizeof(b)),
		       (unsigned long long)evicted,
		       tool_bytes(st.capacity, c, sizeof(c)), addr, reg);
	return true;
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
	    {"no-mooncake", no_argument, NULL, 'M'},
	    TOOL_OPT_ENTRIES,
	    {NULL, 0, NULL, 0}};
	serve_opts o = {.count = 200};
	ecx_producer_params *p = &o.p;
	p->field_mask = ECX_PRODUCER_PARAM_BIND_HOST |
	                ECX_PRODUCER_PARAM_REGISTRY_PORT |
	                ECX_PRODUCER_PARAM_TOKEN | ECX_PRODUCER_PARAM_TIMEOUT |
	                ECX_PRODUCER_PARAM_STARTING;
	/* The embedded registry's /healthz says ok once the items are in. */
	p->starting = 1;
	p->bind_host = "0.0.0.0";
	p->registry_port = ECX_REGISTRY_PORT_DEFAULT;
	tool_common t = {.token = getenv("ECX_TOKEN"), .timeout_ms = 5000};
	char bind[INET6_ADDRSTRLEN + 1], adv[ECX_ADDR_MAX], why[256];
	bool port_given = false;
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		uint16_t port;
		uint64_t v;
		switch (c) {
		case 'b':
			if (!tool_bind_resolve(optarg, bind, sizeof(bind), why,
			                       sizeof(why)))
				return tool_bad_value("serve", "--bind", optarg,
				                      why);
			p->bind_host = bind;
			break;
		case 'p':
			if (!tool_parse_port(optarg, &port))
				return tool_bad_value("serve", "--port", optarg,
				                      "0 to 65535");
			p->registry_port = port;
			port_given = true;
			break;
		case 'r':
			p->field_mask |= ECX_PRODUCER_PARAM_REGISTRY;
			p->field_mask &=
			    ~(uint64_t)ECX_PRODUCER_PARAM_REGISTRY_PORT;
			p->registry = optarg;
			break;
		case 'a': {
			size_t n = strlen(optarg);
			if (!tool_host_check(optarg, why, sizeof(why)))
				return tool_bad_value("serve", "--advertise",
				                      optarg, why);
			/* One form inside ecx: [::1] is kept as ::1. */
			if (optarg[0] == '[')
				snprintf(adv, sizeof(adv), "%.*s", (int)(n - 2),
				         optarg + 1);
			else
				tool_strlcpy(adv, optarg, sizeof(adv));
			p->field_mask |= ECX_PRODUCER_PARAM_ADVERTISE_HOST;
			p->advertise_host = adv;
			break;
		}
		case 'z':
			if (!tool_parse_port(optarg, &p->zmq_port))
				return tool_bad_value("serve", "--zmq-port",
				                      optarg, "0 to 65535");
			p->field_mask |= ECX_PRODUCER_PARAM_ZMQ_PORT;
			break;
		case 'c':
			if (ecx_size_parse(optarg, &p->capacity_bytes, why,
			                   sizeof(why)) != 0)
				return tool_fail("serve", EXIT_USAGE,
				                 "--capacity: %s", why);
			if (p->capacity_bytes < 4096)
				return tool_bad_value(
				    "serve", "--capacity", optarg,
				    "4KiB or more, e.g. 1GiB");
			p->field_mask |= ECX_PRODUCER_PARAM_CAPACITY;
			break;
		case 'T':
			if (strcmp(optarg, "auto") != 0 &&
			    strcmp(optarg, "tcp") != 0 &&
			    strcmp(optarg, "shm") != 0)
				return tool_bad_value("serve", "--transport",
				                      optarg,
				                      "auto, tcp or shm");
			p->field_mask |= ECX_PRODUCER_PARAM_TRANSPORT;
			p->transport = optarg;
			break;
		case 'S':
			if (!tool_parse_uint(optarg, 1, UINT32_MAX,
			                     &o.synthetic))
				return tool_bad_value("serve", "--synthetic",
				                      optarg,
				                      "a count, 1 or more");
			break;
		case 'w':
			if (strcmp(optarg, "qwen") != 0)
				return tool_bad_value("serve", "--workload",
				                      optarg, "qwen");
			o.workload = optarg;
			break;
		case 'n':
			if (!tool_parse_uint(optarg, 1, UINT32_MAX, &o.count))
				return tool_bad_value("serve", "--count",
				                      optarg,
				                      "a count, 1 or more");
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
		case 'M':
			p->field_mask |= ECX_PRODUCER_PARAM_MOONCAKE;
			p->mooncake = 0;
			break;
		case 'L':
			if (!tool_parse_uint(optarg, 0, 86400 * 365, &v))
				return tool_bad_value(
				    "serve", "--registry-ttl", optarg,
				    "whole seconds, 0 for none");
			p->registry_ttl_s = (int)v;
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
	if (port_given && (p->field_mask & ECX_PRODUCER_PARAM_REGISTRY))
		return tool_fail("serve", EXIT_USAGE,
		                 "give --registry (publish there) or --port "
		                 "(an embedded registry), not both");
	int rc = serve_check(&o, argc - optind);
	if (rc >= 0)
		return rc;
	for (int i = optind; i < argc; i++) {
		const char *eq = strchr(argv[i], '=');
		ecx_tensor_desc d;
		rc = read_item(
		    eq != NULL && eq - argv[i] <= ECX_ID_MAX ? eq + 1 : argv[i],
		    &o, o.synthetic > 0 || o.workload != NULL, &d, NULL);
		if (rc != EXIT_OK)
			return rc;
	}
	tool_warn_open("serve", p->bind_host, p->token,
	               (p->field_mask & ECX_PRODUCER_PARAM_REGISTRY)
	                   ? "pull its items"
	                   : "pull its items and replace or DELETE its "
	                     "registry's entries");
	tool_block_signals();
	/* The registry as the command prints it: its password masked. */
	char shown_reg[ECX_ADDR_MAX + 32];
	serve_run r = {.registry = (p->field_mask & ECX_PRODUCER_PARAM_REGISTRY)
	                               ? tool_mask(p->registry, shown_reg,
	                                           sizeof(shown_reg))
	                               : NULL};
	uint64_t cap = (p->field_mask & ECX_PRODUCER_PARAM_CAPACITY)
	                   ? p->capacity_bytes
	                   : (uint64_t)1 << 30;
	r.nsizes = (size_t)(cap / 4096);
	r.sizes = calloc(r.nsizes, sizeof(*r.sizes));
	if (r.sizes == NULL)
		r.nsizes = 0; /* the ready line then counts bytes put */
	/* Starting UCX can take seconds on a busy host: a signal meanwhile
	 * ends the process at once (nothing is published yet). */
	pthread_t watcher;
	bool watching = pthread_create(&watcher, NULL, watch_start, NULL) == 0;
	rc = ecx_producer_create(p, &r.prod, why, sizeof(why));
	__atomic_store_n(&started, true, __ATOMIC_RELEASE);
	if (watching)
		pthread_join(watcher, NULL);
	r.sig = handed_sig;
	if (rc != 0) {
		free(r.sizes);
		return tool_fail("serve", EXIT_FAIL, "cannot start: %s", why);
	}
	if (r.sig == 0)
		rc = serve_files(&r, argc - optind, argv + optind, &o);
	if (rc == EXIT_OK && r.sig == 0 &&
	    (o.synthetic > 0 || o.workload != NULL))
		rc = serve_generated(&r, &o);
	if (rc == EXIT_OK && r.sig == 0)
		r.sig = tool_poll_signal(0);
	if (rc != EXIT_OK || r.sig != 0) {
		ecx_producer_destroy(r.prod);
		free(r.sizes);
		if (r.sig == 0)
			return rc;
		/* Stopped before it was ready: what it published is
		 * unpublished (by destroy), and the exit says it did not
		 * finish, as a shell's would. */
		fprintf(stderr,
		        "%secx serve: stopped on signal %d while putting "
		        "items (%llu put); unpublished them\n",
		        isatty(STDERR_FILENO) ? "\n" : "", r.sig,
		        (unsigned long long)r.put);
		return 128 + r.sig;
	}
	char reg[ECX_ADDR_MAX + 32];
	const char *addr = ecx_producer_address(r.prod);
	if (r.registry != NULL) {
		tool_strlcpy(reg, r.registry, sizeof(reg)); /* masked */
	} else {
		/* The advertised host of producer_zmq ([::1] for an IPv6
		 * one), with the registry port. */
		const char *h = addr + 6; /* after tcp:// */
		const char *colon = strrchr(h, ':');
		snprintf(reg, sizeof(reg), "http://%.*s:%u", (int)(colon - h),
		         h, ecx_producer_registry_port(r.prod));
	}
	/* Every item is put, so published: the embedded registry is healthy
	 * from now on. */
	ecx_producer_set_ready(r.prod);
	bool ready = serve_ready(&r, &o, reg);
	free(r.sizes);
	if (!ready) {
		ecx_producer_destroy(r.prod);
		return tool_fail("serve", EXIT_FAIL, "out of memory");
	}
	fflush(stdout);
	int sig = tool_wait_signal();
	ecx_producer_stats st;
	ecx_producer_stats_get(r.prod, &st);
	ecx_producer_destroy(r.prod);
	char b[32];
	fprintf(stderr,
	        "ecx serve: stopped on signal %d; served %llu items (%s) in "
	        "%llu pulls; unpublished %llu items\n",
	        sig, (unsigned long long)st.items_served,
	        tool_bytes(st.bytes_served, b, sizeof(b)),
	        (unsigned long long)st.pulls, (unsigned long long)st.items);
	return 128 + sig; /* as a shell reports a process a signal ended */
}
