/* cmd_bench.c - `ecx bench`: the entry point: --help, the options (into a
 * bench_opts every benchmark is given) and which benchmarks run; each
 * benchmark is in a file of its own (bench.h says which), interleaved with
 * its baseline in the same run (baseline, ecx, baseline, ecx, ...), ratios
 * from adjacent pairs. */
#include "tool.h"

#include "bench.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char help[] =
    "usage: ecx bench [--quick] [--check] [--json] [--redis URL]\n"
    "                 [--via LIST] [--peer-wrap PROG --peer-addr ADDR]\n"
    "                 [registry|transfer|file|all]\n"
    "\n"
    "Benchmarks, each interleaved with the baseline it is compared with\n"
    "in the same run: baseline, ecx, baseline, ecx, ... (5 repetitions,\n"
    "3 with --quick); a ratio comes from each adjacent pair, and tables\n"
    "give the median of the repetitions with [min-max] beside it.\n"
    "\n"
    "  registry  single lookups over one persistent connection against\n"
    "            the reference's way: a new HTTP client (a new libcurl\n"
    "            handle and connection) per lookup; the same lookups\n"
    "            sleeping at once on each answer instead of polling for\n"
    "            it first (200 us), with the CPU each way costs; batched\n"
    "            lookups of 256 ids against single ones; beside them the\n"
    "            machine's floor, a 1-byte TCP round trip to another\n"
    "            thread\n"
    "  transfer  loads of 64 KiB, 1 MiB and 7 MiB items (7 MiB: 1024 x\n"
    "            3584 bf16, one Qwen2.5-VL-7B image) in batches of 1, 8\n"
    "            and 32 from a producer process, over shared memory into\n"
    "            the receive arena (shm) and into the caller's memory\n"
    "            (shm*), and over TCP (tcp). Baselines, moving the\n"
    "            producer's bytes (checked before timing): single-thread\n"
    "            memcpy into destinations prepared the same way (shm),\n"
    "            and raw TCP from another process, one stream as ecx uses\n"
    "            one endpoint, TCP_NODELAY, socket buffers kernel-tuned\n"
    "            as UCX leaves them, the faster of a receiver blocking in\n"
    "            recv and one polling its socket as ecx's consumer polls,\n"
    "            both measured in each repetition (tcp), under the\n"
    "            TCP congestion control of the consumer's namespace (the\n"
    "            header names it; --json: tcp_cc). warm: the same\n"
    "            ids into the same destinations each load; cold (batches\n"
    "            1 and 8): ids not loaded for at least 32 MiB of loads\n"
    "            (more than the CPU caches), into destinations unused\n"
    "            as long (receive arena: a ring of allocations; shm*:\n"
    "            memory never touched, registered afresh), and the\n"
    "            baseline alike. Untimed: the first 128 loads of\n"
    "            ecx's connection, and the first load of each block of\n"
    "            single loads, ecx's and the baseline's (--json:\n"
    "            first_load_p50_us)\n"
    "  file      the file-per-item baseline (vLLM's ECExampleConnector:\n"
    "            a safetensors file per item in /dev/shm) loaded (open,\n"
    "            parse, malloc, read) against malloc and memcpy\n"
    "  all       all of them (the default)\n"
    "\n"
    "Options:\n"
    "  --quick   fewer iterations (CI runs 'all --quick --check')\n"
    "  --check   assert the targets, exit 1 naming each row that misses:\n"
    "            shm 7 MiB warm loads >= 0.5x memcpy; shm 64 KiB x1 warm\n"
    "            p50 < 100 us; registry persistent p50 < 150 us and\n"
    "            batched >= 20x single ids/s; tcp warm loads of 1 MiB\n"
    "            and 7 MiB >= 0.9x raw TCP; 64 KiB and 1 MiB x1 warm, shm\n"
    "            and tcp: p99 <= 3x p50. With --quick, floors for a\n"
    "            loaded machine are reported and not checked (load\n"
    "            alone moves each by as much as a 2x regression does;\n"
    "            docs/bench.md): shm 7 MiB >= 0.4x memcpy and tcp >=\n"
    "            0.5x raw TCP (medians of the groups' rows), registry\n"
    "            256 x single p50 / batch p50 >= 20x, best p50s of shm\n"
    "            64 KiB < 400 us and registry < 250 us, p99 <= 3x p50;\n"
    "            a benchmark that fails still fails the run\n"
    "  --json    one JSON object per result line\n"
    "  --redis URL  registry: also batched lookups against this Redis\n"
    "            (redis://HOST:PORT; bench/redis_vs_http.sh starts one)\n"
    "  --via LIST  transfer: only these rows, comma-separated: shm,\n"
    "            user (shm*), tcp (default: these three), mooncake (mc:\n"
    "            tcp over the reference's pull and Mooncake's wire)\n"
    "  --peer-wrap PROG  transfer: start the producer and the raw TCP\n"
    "            sender as 'PROG /path/to/ecx ARGS...'; PROG must exec\n"
    "            its arguments (e.g. a script entering another network\n"
    "            namespace: bench/two_hosts.sh). Needs --via tcp or\n"
    "            mooncake, and --peer-addr\n"
    "  --peer-addr ADDR  transfer: the IPv4 address they bind and are\n"
    "            reached at (default 127.0.0.1)\n"
    "  -h, --help\n"
    "\n"
    "Exit codes: 0 done (and, with --check, every target met), 1 a\n"
    "benchmark failed or a target was missed, 2 usage.\n";

/* --via: "shm,user,tcp" or any part of it, into *mask. */
static bool parse_via(const char *arg, unsigned *mask)
{
	char *buf = strdup(arg);
	if (buf == NULL)
		return false;
	bool ok = true;
	*mask = 0;
	for (char *sv, *t = strtok_r(buf, ",", &sv); t != NULL;
	     t = strtok_r(NULL, ",", &sv)) {
		unsigned bit = bench_via_bit(t);
		ok = ok && bit != 0; /* not a row: refused */
		*mask |= bit;
	}
	free(buf);
	return ok && *mask != 0;
}

int cmd_bench(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"quick", no_argument, NULL, 'q'},
	    {"check", no_argument, NULL, 'c'},
	    {"json", no_argument, NULL, 'j'},
	    {"producer-for-bench", required_argument, NULL, 'P'},
	    {"tcp-source-for-bench", no_argument, NULL, 'S'},
	    {"redis", required_argument, NULL, 'R'},
	    {"via", required_argument, NULL, 'V'},
	    {"peer-wrap", required_argument, NULL, 'W'},
	    {"peer-addr", required_argument, NULL, 'A'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0}};
	bench_opts o = {.via_mask = BENCH_VIA_DEFAULT,
	                .peer_addr = "127.0.0.1"};
	int c;
	bool addr_given = false;
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
		switch (c) {
		case 'q':
			o.quick = true;
			break;
		case 'c':
			o.check = true;
			break;
		case 'j':
			o.json = true;
			break;
		case 'P':
			return bench_producer(&o, optarg);
		case 'S':
			return bench_tcp_source(&o);
		case 'R':
			o.redis_url = optarg;
			break;
		case 'V':
			if (!parse_via(optarg, &o.via_mask))
				return tool_fail(
				    "bench", EXIT_USAGE,
				    "--via '%s': a comma-separated "
				    "list of shm, user, tcp",
				    optarg);
			break;
		case 'W':
			if (access(optarg, X_OK) != 0)
				return tool_fail("bench", EXIT_USAGE,
				                 "--peer-wrap '%s': %m",
				                 optarg);
			o.peer_wrap = optarg;
			break;
		case 'A': {
			struct in_addr ia;
			if (inet_pton(AF_INET, optarg, &ia) != 1)
				return tool_fail("bench", EXIT_USAGE,
				                 "--peer-addr '%s': an IPv4 "
				                 "address, such as 127.0.0.1",
				                 optarg);
			o.peer_addr = optarg;
			addr_given = true;
			break;
		}
		case 'h':
			fputs(help, stdout);
			return EXIT_OK;
		default:
			fputs(help, stderr);
			return EXIT_USAGE;
		}
	}
	/* The wrapper runs the producer and the raw TCP sender elsewhere:
	 * only tcp rows can reach them there, and only at an address given. */
	unsigned tcpish = bench_via_bit("tcp") | bench_via_bit("mooncake");
	if (o.peer_wrap != NULL && ((o.via_mask & ~tcpish) != 0 || !addr_given))
		return tool_fail("bench", EXIT_USAGE,
		                 "--peer-wrap needs --via tcp or mooncake and "
		                 "--peer-addr (the address its peers bind in "
		                 "their namespace); see 'ecx bench --help'");
	const char *what = optind < argc ? argv[optind] : "all";
	if (argc - optind > 1) {
		fputs(help, stderr);
		return EXIT_USAGE;
	}
	bool all = strcmp(what, "all") == 0;
	if (!all && strcmp(what, "registry") != 0 &&
	    strcmp(what, "transfer") != 0 && strcmp(what, "file") != 0)
		return tool_fail("bench", EXIT_USAGE,
		                 "unknown benchmark '%s' (registry, transfer, "
		                 "file, all)",
		                 what);
	signal(SIGPIPE, SIG_IGN);
	curl_global_init(CURL_GLOBAL_DEFAULT);
	int rc = EXIT_OK;
	if (rc == EXIT_OK && (all || strcmp(what, "registry") == 0))
		rc = bench_registry(&o);
	if (rc == EXIT_OK && (all || strcmp(what, "transfer") == 0))
		rc = bench_transfer(&o);
	if (rc == EXIT_OK && (all || strcmp(what, "file") == 0))
		rc = bench_file(&o);
	curl_global_cleanup();
	int nmissed = bench_missed(), nreported = bench_reported();
	if (rc == EXIT_OK && o.check) {
		if (nmissed > 0)
			return tool_fail(
			    "bench", EXIT_FAIL, "%d row(s) missed their %s",
			    nmissed, o.quick ? "--quick floors" : "targets");
		if (!o.json && nreported > 0)
			printf("check: every checked %s met; %d row(s) below "
			       "what they report (not checked)\n",
			       o.quick ? "--quick floor" : "target", nreported);
		else if (!o.json)
			printf("check: every %s met\n",
			       o.quick ? "--quick floor" : "target");
	}
	return rc;
}
