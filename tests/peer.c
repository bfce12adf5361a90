/*
 * peer.c - a producer or consumer in a process of its own, for end-to-end
 * tests, driven by lines on stdin with one answer line each on stdout.
 *
 *   ecx-test-peer producer [--capacity BYTES] [--transport T] [--token T]
 *                          [--registry URL] [--bind HOST] [--timeout MS]
 *                          [--registry-port P] [--zmq-port P] [--integrity]
 *                          [--lease-max-ms MS] [--lease-share PCT]
 *                          [--idle MS]
 *     prints "ready REGISTRY_PORT PRODUCER_ZMQ", then takes:
 *     put ID DTYPE D0xD1...   -> ok | err NAME detail
 *     remove ID               -> ok | err NAME detail
 *     corrupt ID              -> ok (flips a byte of ID in the arena, after
 *                                its hash was taken: memory going bad)
 *     stats                   -> stats items N used N pinned N ...
 *     close                   -> closed (destroys the producer; the
 *                                process stays, answering only quit)
 *     quit                    -> bye (after destroying the producer)
 *
 *   ecx-test-peer consumer REGISTRY [--transport T] [--token T]
 *                          [--timeout MS] [--integrity] [--recv BYTES]
 *                          [--arena]
 *     (--arena: loads land in the receive arena, else in malloc'd memory)
 *     prints "ready", then takes:
 *     load ID...   -> ok | err NAME: per-item names (verifies bytes)
 *     loop N ID... -> loads the ids N times ("ok COUNT" at the end)
 *     stall ID...  -> "stalling", sends the pull, then SIGSTOPs itself
 *     quit         -> bye
 */
#include "common/testutil.h"
#include "producer/producer.h" /* for "corrupt" */

#include <getopt.h>
#include <time.h>

static int parse_shape(const char *s, uint64_t *shape, uint32_t *nd)
{
	*nd = 0;
	if (strcmp(s, "scalar") == 0)
		return 0;
	while (*s != '\0' && *nd < ECX_MAX_DIMS) {
		char *end;
		shape[(*nd)++] = strtoull(s, &end, 10);
		if (end == s)
			return -1;
		s = *end == 'x' ? end + 1 : end;
	}
	return 0;
}

static int run_producer(int argc, char **argv)
{
	ecx_producer_params p = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_CAPACITY | ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_TIMEOUT,
	    .capacity_bytes = 64u << 20,
	    .bind_host = "127.0.0.1",
	    .registry_port = 0,
	    .timeout_ms = 3000};
	static const struct option opts[] = {
	    {"capacity", required_argument, NULL, 'c'},
	    {"transport", required_argument, NULL, 't'},
	    {"token", required_argument, NULL, 'k'},
	    {"registry", required_argument, NULL, 'r'},
	    {"bind", required_argument, NULL, 'b'},
	    {"timeout", required_argument, NULL, 'T'},
	    {"registry-port", required_argument, NULL, 'R'},
	    {"zmq-port", required_argument, NULL, 'Z'},
	    {"registry-ttl", required_argument, NULL, 'L'},
	    {"integrity", no_argument, NULL, 'I'},
	    {"lease-max-ms", required_argument, NULL, 'M'},
	    {"lease-share", required_argument, NULL, 'S'},
	    {"idle", required_argument, NULL, 'D'},
	    {NULL, 0, NULL, 0}};
	int c;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'c':
			p.capacity_bytes = strtoull(optarg, NULL, 10);
			break;
		case 't':
			p.field_mask |= ECX_PRODUCER_PARAM_TRANSPORT;
			p.transport = optarg;
			break;
		case 'k':
			p.field_mask |= ECX_PRODUCER_PARAM_TOKEN;
			p.token = optarg;
			break;
		case 'r':
			p.field_mask |= ECX_PRODUCER_PARAM_REGISTRY;
			p.field_mask &=
			    ~(uint64_t)ECX_PRODUCER_PARAM_REGISTRY_PORT;
			p.registry = optarg;
			break;
		case 'b':
			p.bind_host = optarg;
			break;
		case 'T':
			p.timeout_ms = atoi(optarg);
			break;
		case 'R':
			p.registry_port = atoi(optarg);
			break;
		case 'L':
			p.field_mask |= ECX_PRODUCER_PARAM_REGISTRY_TTL;
			p.registry_ttl_s = atoi(optarg);
			break;
		case 'I':
			p.field_mask |= ECX_PRODUCER_PARAM_INTEGRITY;
			p.integrity = 1;
			break;
		case 'M':
			p.field_mask |= ECX_PRODUCER_PARAM_LEASE_MAX_MS;
			p.lease_max_ms = atoi(optarg);
			break;
		case 'S':
			p.field_mask |= ECX_PRODUCER_PARAM_LEASE_SHARE;
			p.lease_share_pct = atoi(optarg);
			break;
		case 'D':
			p.field_mask |= ECX_PRODUCER_PARAM_IDLE;
			p.idle_ms = atoi(optarg);
			break;
		case 'Z':
			p.field_mask |= ECX_PRODUCER_PARAM_ZMQ_PORT;
			p.zmq_port = (uint16_t)atoi(optarg);
			break;
		default:
			return 2;
		}
	}
	ecx_producer *prod;
	char why[256];
	if (ecx_producer_create(&p, &prod, why, sizeof(why)) != 0) {
		printf("fail %s\n", why);
		return 1;
	}
	printf("ready %u %s\n", ecx_producer_registry_port(prod),
	       ecx_producer_address(prod));
	fflush(stdout);
	char line[4096];
	while (fgets(line, sizeof(line), stdin) != NULL) {
		char cmd[32], id[512], dt[32], shp[128];
		int n = sscanf(line, "%31s %511s %31s %127s", cmd, id, dt, shp);
		if (prod == NULL && !(n == 1 && strcmp(cmd, "quit") == 0)) {
			printf("err EINVAL closed\n");
		} else if (n >= 1 && strcmp(cmd, "put") == 0 && n == 4) {
			ecx_tensor_desc d;
			uint64_t shape[ECX_MAX_DIMS];
			uint32_t nd;
			ecx_dtype dtype;
			int rc = ecx_dtype_parse(dt, &dtype);
			if (rc == 0 && parse_shape(shp, shape, &nd) == 0)
				rc = ecx_tensor_set(&d, dtype, nd, shape);
			if (rc == 0) {
				void *buf = malloc(d.nbytes ? d.nbytes : 1);
				tu_fill(id, buf, d.nbytes);
				rc = ecx_producer_put(prod, id, &d, buf);
				free(buf);
			}
			if (rc == 0)
				printf("ok\n");
			else
				printf("err %s %s\n", ecx_err_name(rc),
				       ecx_last_error());
		} else if (n == 2 && strcmp(cmd, "corrupt") == 0) {
			/* Reaches into the producer (this is its test peer):
			 * the bytes change after put hashed them. */
			pthread_mutex_lock(&prod->lock);
			item *it = prod_item_find(prod, id);
			if (it != NULL && it->desc.nbytes > 0)
				((unsigned char *)prod->base)[it->off] ^= 0x5a;
			pthread_mutex_unlock(&prod->lock);
			printf(it != NULL ? "ok\n" : "err ENOTFOUND\n");
		} else if (n == 2 && strcmp(cmd, "remove") == 0) {
			int rc = ecx_producer_remove(prod, id);
			printf(rc == 0 ? "ok\n" : "err %s\n", ecx_err_name(rc));
		} else if (n == 1 && strcmp(cmd, "stats") == 0) {
			ecx_producer_stats s;
			ecx_producer_stats_get(prod, &s);
			printf(
			    "stats items %llu used %llu pinned %llu evictions "
			    "%llu pulls %llu served %llu failed %llu bytes "
			    "%llu regs %llu conns %llu\n",
			    (unsigned long long)s.items,
			    (unsigned long long)s.bytes_used,
			    (unsigned long long)s.pinned,
			    (unsigned long long)s.evictions,
			    (unsigned long long)s.pulls,
			    (unsigned long long)s.items_served,
			    (unsigned long long)s.items_failed,
			    (unsigned long long)s.bytes_served,
			    (unsigned long long)s.registrations,
			    (unsigned long long)s.connections);
		} else if (n == 1 && strcmp(cmd, "leases") == 0) {
			ecx_producer_stats s;
			ecx_producer_stats_get(prod, &s);
			printf(
			    "leases held %llu bytes %llu granted %llu refused "
			    "%llu expired %llu released %llu used %llu "
			    "items %llu evictions %llu\n",
			    (unsigned long long)s.leases,
			    (unsigned long long)s.leased_bytes,
			    (unsigned long long)s.leases_granted,
			    (unsigned long long)s.leases_refused,
			    (unsigned long long)s.leases_expired,
			    (unsigned long long)s.leases_released,
			    (unsigned long long)s.leases_used,
			    (unsigned long long)s.items,
			    (unsigned long long)s.evictions);
		} else if (n == 1 && strcmp(cmd, "close") == 0) {
			/* Destroys the producer; the process stays. */
			ecx_producer_destroy(prod);
			prod = NULL;
			printf("closed\n");
		} else if (n == 1 && strcmp(cmd, "quit") == 0) {
			break;
		} else {
			printf("err EINVAL unknown command\n");
		}
		fflush(stdout);
	}
	ecx_producer_destroy(prod);
	printf("bye\n");
	fflush(stdout);
	return 0;
}

static bool into_arena; /* --arena */

static int load_ids(ecx_consumer *cons, char **ids, size_t n, char *report,
                    size_t rlen)
{
	ecx_item *items = calloc(n, sizeof(*items));
	for (size_t i = 0; i < n; i++)
		items[i].id = ids[i];
	int rc = ecx_consumer_lookup(cons, items, n);
	for (size_t i = 0; i < n; i++) {
		if (items[i].status == 0)
			items[i].dst =
			    into_arena
			        ? ecx_consumer_alloc(cons, items[i].desc.nbytes)
			        : malloc(items[i].desc.nbytes + 1);
		if (items[i].status == 0 && items[i].dst == NULL)
			items[i].status = ECX_ENOSPC;
	}
	if (rc == 0)
		rc = ecx_consumer_load(cons, items, n);
	size_t off = 0;
	report[0] = '\0';
	for (size_t i = 0; i < n; i++) {
		int s = items[i].status;
		if (s == 0 &&
		    !tu_check(ids[i], items[i].dst, items[i].desc.nbytes))
			s = ECX_EINTERNAL, rc = rc ? rc : ECX_EINTERNAL;
		off += (size_t)snprintf(report + off, rlen - off, " %s",
		                        s == 0 ? "ok" : ecx_err_name(s));
		if (into_arena)
			ecx_consumer_free(cons, items[i].dst);
		else
			free(items[i].dst);
	}
	free(items);
	return rc;
}

static int run_consumer(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	ecx_consumer_params p = {.field_mask = ECX_CONSUMER_PARAM_REGISTRY |
	                                       ECX_CONSUMER_PARAM_TIMEOUT |
	                                       ECX_CONSUMER_PARAM_RECV_CAPACITY,
	                         .registry = argv[1],
	                         .timeout_ms = 3000,
	                         .recv_capacity = 16u << 20};
	static const struct option opts[] = {
	    {"transport", required_argument, NULL, 't'},
	    {"token", required_argument, NULL, 'k'},
	    {"timeout", required_argument, NULL, 'T'},
	    {"integrity", no_argument, NULL, 'I'},
	    {"recv", required_argument, NULL, 'V'},
	    {"arena", no_argument, NULL, 'A'},
	    {NULL, 0, NULL, 0}};
	int c;
	optind = 2;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		if (c == 't') {
			p.field_mask |= ECX_CONSUMER_PARAM_TRANSPORT;
			p.transport = optarg;
		} else if (c == 'k') {
			p.field_mask |= ECX_CONSUMER_PARAM_TOKEN;
			p.token = optarg;
		} else if (c == 'T') {
			p.timeout_ms = atoi(optarg);
		} else if (c == 'I') {
			p.field_mask |= ECX_CONSUMER_PARAM_INTEGRITY;
			p.integrity = 1;
		} else if (c == 'V') {
			p.recv_capacity = strtoull(optarg, NULL, 10);
		} else if (c == 'A') {
			into_arena = true;
		} else {
			return 2;
		}
	}
	ecx_consumer *cons;
	char why[256];
	if (ecx_consumer_create(&p, &cons, why, sizeof(why)) != 0) {
		printf("fail %s\n", why);
		return 1;
	}
	printf("ready\n");
	fflush(stdout);
	char line[8192];
	while (fgets(line, sizeof(line), stdin) != NULL) {
		char *ids[256];
		size_t n = 0;
		char *save, *tok = strtok_r(line, " \n", &save);
		char *cmd = tok;
		long loops = 1;
		if (cmd != NULL && strcmp(cmd, "loop") == 0) {
			tok = strtok_r(NULL, " \n", &save);
			loops = tok ? atol(tok) : 1;
		}
		while ((tok = strtok_r(NULL, " \n", &save)) != NULL && n < 256)
			ids[n++] = tok;
		if (cmd == NULL || strcmp(cmd, "quit") == 0)
			break;
		if (strcmp(cmd, "stall") == 0) {
			/* Sends the pull, then stops this whole process before
			 * it can take the data: a consumer that stalls. */
			ecx_item *it = calloc(n, sizeof(*it));
			for (size_t i = 0; i < n; i++)
				it[i].id = ids[i];
			ecx_consumer_lookup(cons, it, n);
			for (size_t i = 0; i < n; i++)
				it[i].dst = malloc(it[i].desc.nbytes + 1);
			ecx_load *l;
			printf("stalling\n");
			fflush(stdout);
			ecx_consumer_load_start(cons, it, n, &l);
			/* Long enough for the pull to leave, far shorter than
			 * the transfer of the test's item (tens of MiB) over
			 * TCP. */
			struct timespec t0, t1;
			clock_gettime(CLOCK_MONOTONIC, &t0);
			do {
				ecx_load_test(l);
				clock_gettime(CLOCK_MONOTONIC, &t1);
			} while ((t1.tv_sec - t0.tv_sec) * 1000000000L +
			             (t1.tv_nsec - t0.tv_nsec) <
			         300000L);
			raise(SIGSTOP);
			ecx_load_wait(l);
			for (size_t i = 0; i < n; i++)
				free(it[i].dst);
			free(it);
			continue;
		}
		char report[4096];
		int rc = 0;
		long good = 0;
		char first_bad[4200] = "";
		for (long k = 0; k < loops; k++) {
			rc = load_ids(cons, ids, n, report, sizeof(report));
			good += rc == 0;
			if (rc != 0 && first_bad[0] == '\0')
				snprintf(first_bad, sizeof(first_bad),
				         " (first failure: %s:%s %s)",
				         ecx_err_name(rc), report,
				         ecx_last_error());
		}
		if (strcmp(cmd, "loop") == 0)
			printf("ok %ld%s\n", good, first_bad);
		else if (rc == 0)
			printf("ok%s\n", report);
		else
			printf("err %s:%s\n", ecx_err_name(rc), report);
		fflush(stdout);
	}
	ecx_consumer_destroy(cons);
	printf("bye\n");
	fflush(stdout);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && strcmp(argv[1], "producer") == 0)
		return run_producer(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "consumer") == 0)
		return run_consumer(argc - 1, argv + 1);
	fprintf(stderr, "usage: ecx-test-peer producer|consumer ...\n");
	return 2;
}
