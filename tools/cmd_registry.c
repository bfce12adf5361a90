/* cmd_registry.c - `ecx registry`: a standalone HTTP registry daemon. */
#include "tool.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static const char help[] =
    "usage: ecx registry [--bind HOST] [--port PORT] [--token T]\n"
    "                    [--token-reads] [--threads N] [--store URL]\n"
    "                    [--registry-ttl S]\n"
    "\n"
    "Runs a standalone registry: the reference's GET /ec/info/{id}, plus\n"
    "POST /ec/lookup, PUT and DELETE /ec/info/{id}, POST /ec/renew,\n"
    "GET /ec/list, /metrics and /healthz. Producers publish to it with\n"
    "'ecx serve --registry URL' and renew their entries; consumers look ids\n"
    "up in it. Serves until SIGINT, SIGTERM or SIGHUP.\n"
    "\n"
    "Options:\n"
    "  --bind HOST      address to listen on (default 0.0.0.0)\n"
    "  --port PORT      port (default 9018; 0 picks a free one, printed)\n"
    "  --token T        require 'Authorization: Bearer T' on writes\n"
    "                   (default $ECX_TOKEN; none when unset: on an\n"
    "                   address other than loopback it warns at start)\n"
    "  --token-reads    require the token on reads too (not /healthz)\n"
    "  --threads N      serving threads (default 2)\n"
    "  --store URL      keep entries in Redis (redis://[:PASSWORD@]HOST:\n"
    "                   PORT[/DB], or behind Sentinel: redis+sentinel://\n"
    "                   [:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB])\n"
    "                   instead of memory, so several registries and\n"
    "                   Redis clients share them\n"
    "  --registry-ttl S entries a producer stops renewing leave S\n"
    "                   seconds later (default 30; 0: never). A producer\n"
    "                   that asks for its own lease ('ecx serve\n"
    "                   --registry-ttl') gets that one. An id may have\n"
    "                   several holders (producers): GET /ec/info answers\n"
    "                   the most recently renewed, POST /ec/lookup all\n"
    "  -h, --help       this text\n"
    "\n"
    "On start it prints 'listening on http://HOST:PORT' to stdout.\n"
    "Exit codes: 0 stopped by a signal, 1 could not start (the message\n"
    "says why: port taken, bad address), 2 usage error.\n";

int cmd_registry(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"bind", required_argument, NULL, 'b'},
	    {"port", required_argument, NULL, 'p'},
	    {"token", required_argument, NULL, 't'},
	    {"token-reads", no_argument, NULL, 'r'},
	    {"threads", required_argument, NULL, 'n'},
	    {"store", required_argument, NULL, 's'},
	    {"registry-ttl", required_argument, NULL, 'L'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	ecx_registry_params p = {.field_mask = ECX_REGISTRY_PARAM_BIND_HOST |
	                                       ECX_REGISTRY_PARAM_PORT |
	                                       ECX_REGISTRY_PARAM_TOKEN |
	                                       ECX_REGISTRY_PARAM_TOKEN_READS |
	                                       ECX_REGISTRY_PARAM_THREADS,
	                         .bind_host = "0.0.0.0",
	                         .port = ECX_REGISTRY_PORT_DEFAULT,
	                         .token = getenv("ECX_TOKEN"),
	                         .threads = 2};
	char bind[256], why[256], host[260];
	int c;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'b':
			if (!tool_host_check(optarg, why, sizeof(why)))
				return tool_bad_value("registry", "--bind",
				                      optarg, why);
			/* [::1] as ::1: the listener takes the address. */
			if (optarg[0] == '[')
				snprintf(bind, sizeof(bind), "%.*s",
				         (int)strlen(optarg) - 2, optarg + 1);
			else
				tool_strlcpy(bind, optarg, sizeof(bind));
			p.bind_host = bind;
			break;
		case 'p':
			if (!tool_parse_port(optarg, &p.port))
				return tool_bad_value("registry", "--port",
				                      optarg, "0 to 65535");
			break;
		case 't':
			p.token = optarg;
			break;
		case 'r':
			p.token_reads = 1;
			break;
		case 'n': {
			uint64_t v;
			if (!tool_parse_uint(optarg, 1, 64, &v))
				return tool_bad_value("registry", "--threads",
				                      optarg, "1 to 64");
			p.threads = (unsigned)v;
			break;
		}
		case 's':
			p.store = optarg;
			p.field_mask |= ECX_REGISTRY_PARAM_STORE;
			break;
		case 'L': {
			char *end;
			long t = strtol(optarg, &end, 10);
			if (end == optarg || *end != '\0' || t < 0 || t > 86400)
				return tool_fail(
				    "registry", EXIT_USAGE,
				    "--registry-ttl takes 0 to 86400 "
				    "seconds, not '%s'",
				    optarg);
			p.entry_ttl_s = (int)t;
			p.field_mask |= ECX_REGISTRY_PARAM_ENTRY_TTL;
			break;
		}
		case 'h':
			fputs(help, stdout);
			return EXIT_OK;
		default: /* getopt has said what is wrong */
			fputs("Run 'ecx registry --help' for its options.\n",
			      stderr);
			return EXIT_USAGE;
		}
	}
	if (optind != argc)
		return tool_fail("registry", EXIT_USAGE,
		                 "takes no arguments, only options ('%s'); see "
		                 "'ecx registry --help'",
		                 argv[optind]);
	if (p.token_reads && (p.token == NULL || p.token[0] == '\0'))
		return tool_fail("registry", EXIT_USAGE,
		                 "--token-reads needs --token or $ECX_TOKEN");
	tool_block_signals();
	ecx_registry *r;
	if (ecx_registry_create(&p, &r, why, sizeof(why)) != 0)
		return tool_fail("registry", EXIT_FAIL, "cannot start: %s",
		                 why);
	tool_warn_open("registry", p.bind_host, p.token,
	               "publish, replace and DELETE its entries");
	printf("listening on http://%s:%u\n",
	       tool_url_host(p.bind_host, host, sizeof(host)),
	       ecx_registry_port(r));
	fflush(stdout);
	int sig = tool_wait_signal();
	fprintf(stderr, "ecx registry: stopping on signal %d\n", sig);
	ecx_registry_destroy(r);
	return EXIT_OK;
}
