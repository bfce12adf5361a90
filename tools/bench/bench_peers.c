/* bench_peers.c - the transfer benchmark's other side, in processes of
 * their own as a real producer is: ecx's producer and the raw TCP
 * baseline's sender (`ecx bench --producer-for-bench`, `--tcp-source-for-
 * bench`), the socket settings both TCP ends share, and the benchmark's
 * side of them: starting the raw TCP source, waiting for the producer's
 * items to be listed. */
#include "tool.h"

#include "bench.h"
#include "gen.h"
#include "proc.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

/* ecx's producer polls its worker for 200 us after its last work before
 * it sleeps (src/producer/producer.c, spin_ns), so a pull that follows
 * at once finds it awake; the raw TCP source waits for its next request
 * the same way, or each baseline load would start by waking it. */
#define SOURCE_SPIN_NS 200000u

/* Polls fd, without sleeping, until it is readable or spin_ns passed. */
static void spin_readable(int fd, uint64_t spin_ns)
{
	uint64_t end = tool_now_ns() + spin_ns;
	struct pollfd p = {.fd = fd, .events = POLLIN};
	while (poll(&p, 1, 0) == 0 && tool_now_ns() < end)
		;
}

/* The producer side of the transfer benchmark: each size's pool of items,
 * then serves until SIGTERM. */
int bench_producer(const bench_opts *o, const char *transport)
{
	tool_block_signals();
	/* With integrity on: it costs the producer a hash per put (not
	 * timed here), and only consumers that ask check it. */
	ecx_producer_params p = {
	    .field_mask =
	        ECX_PRODUCER_PARAM_BIND_HOST |
	        ECX_PRODUCER_PARAM_REGISTRY_PORT | ECX_PRODUCER_PARAM_CAPACITY |
	        ECX_PRODUCER_PARAM_TRANSPORT | ECX_PRODUCER_PARAM_INTEGRITY,
	    .bind_host = o->peer_addr,
	    .registry_port = 0,
	    .capacity_bytes = 400u << 20,
	    .transport = transport,
	    .integrity = 1};
	ecx_producer *prod;
	char why[256];
	if (ecx_producer_create(&p, &prod, why, sizeof(why)) != 0)
		return tool_fail("bench", EXIT_FAIL, "producer: %s", why);
	void *buf = malloc(7u << 20);
	for (int s = 0; s < NSIZES; s++) {
		for (int i = 0; i < sizes[s].pool; i++) {
			char id[64];
			snprintf(id, sizeof(id), "%s-%d", sizes[s].name, i);
			uint64_t dims[2] = {sizes[s].rows, sizes[s].cols};
			ecx_tensor_desc d;
			ecx_tensor_set(&d, ECX_DTYPE_BFLOAT16, 2, dims);
			gen_fill(id, buf, d.nbytes);
			if (ecx_producer_put(prod, id, &d, buf) != 0)
				return tool_fail("bench", EXIT_FAIL, "%s",
				                 ecx_last_error());
		}
	}
	free(buf);
	printf("ready %u\n", ecx_producer_registry_port(prod));
	fflush(stdout);
	tool_wait_signal();
	ecx_producer_destroy(prod);
	return EXIT_OK;
}

void tcp_tune(int fd)
{
	/* TCP_NODELAY; socket buffers left to the kernel's autotuning, as
	 * UCX leaves its own (UCX_TCP_SNDBUF/RCVBUF=auto); fixed 4 MiB
	 * buffers read no better across the veth (docs/bench.md). */
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* The raw TCP baseline's sender, a process of its own as ecx's producer
 * is: one connection, requests in, items out, until end of file. Each
 * size's pool is as large as the producer's, so cold rows read cold
 * memory here too. */
int bench_tcp_source(const bench_opts *o)
{
	int l = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET};
	inet_pton(AF_INET, o->peer_addr, &sa.sin_addr);
	socklen_t sl = sizeof(sa);
	if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
	    getsockname(l, (struct sockaddr *)&sa, &sl) != 0 ||
	    listen(l, 1) != 0)
		return tool_fail("bench", EXIT_FAIL, "tcp source: %m");
	printf("ready %u\n", ntohs(sa.sin_port));
	fflush(stdout);
	int c = accept(l, NULL, NULL);
	close(l);
	if (c < 0)
		return EXIT_FAIL;
	tcp_tune(c);
	char *pool = NULL;
	uint64_t have = 0;
	uint32_t n = 0;
	tcp_req q;
	while (spin_readable(c, SOURCE_SPIN_NS),
	       full_io(c, &q, sizeof(q), IO_RECV)) {
		if (q.bytes != have) {
			free(pool);
			pool = NULL;
			n = 0;
			int ps = -1;
			for (int s = 0; s < NSIZES; s++)
				if (size_bytes(s) == q.bytes) {
					n = (uint32_t)sizes[s].pool;
					ps = s;
				}
			if (ps < 0 || (pool = pool_alloc(ps)) == NULL)
				break;
			have = q.bytes;
		}
		bool ok = true;
		for (uint32_t k = 0; k < q.count && ok; k++)
			ok = full_io(c, pool + ((q.first + k) % n) * q.bytes,
			             q.bytes, IO_SEND);
		if (!ok)
			break;
	}
	free(pool);
	close(c);
	return EXIT_OK;
}

/* The kernel's TCP buffer ceilings and congestion control, for the
 * table header. */
void tcp_limits(char *buf, size_t len)
{
	unsigned long w[3] = {0}, r[3] = {0};
	FILE *f = fopen("/proc/sys/net/ipv4/tcp_wmem", "r");
	if (f != NULL) {
		if (fscanf(f, "%lu %lu %lu", &w[0], &w[1], &w[2]) != 3)
			w[2] = 0;
		fclose(f);
	}
	f = fopen("/proc/sys/net/ipv4/tcp_rmem", "r");
	if (f != NULL) {
		if (fscanf(f, "%lu %lu %lu", &r[0], &r[1], &r[2]) != 3)
			r[2] = 0;
		fclose(f);
	}
	char a[32], b[32], cc[32];
	snprintf(buf, len, "up to %s send, %s receive, congestion control %s",
	         tool_bytes(w[2], a, sizeof(a)), tool_bytes(r[2], b, sizeof(b)),
	         tcp_cc(cc, sizeof(cc)));
}

const char *tcp_cc(char *buf, size_t len)
{
	snprintf(buf, len, "unknown");
	FILE *f = fopen("/proc/sys/net/ipv4/tcp_congestion_control", "r");
	if (f == NULL)
		return buf;
	if (fgets(buf, (int)len, f) == NULL)
		snprintf(buf, len, "unknown");
	fclose(f);
	buf[strcspn(buf, "\n")] = '\0';
	return buf;
}

/* ---- the transfer benchmark's side: starting and awaiting them ---- */

bool producer_settled(ecx_consumer *c)
{
	enum { MAXPOOL = 1024 + 64 + 32 };
	static ecx_item it[MAXPOOL];
	static char ids[MAXPOOL][32];
	size_t n = 0;
	for (int s = 0; s < NSIZES; s++)
		for (int i = 0; i < sizes[s].pool && n < MAXPOOL; i++, n++)
			snprintf(ids[n], sizeof(ids[n]), "%s-%d", sizes[s].name,
			         i);
	uint64_t end = tool_now_ns() + 60000000000ull;
	while (tool_now_ns() < end) {
		memset(it, 0, sizeof(it));
		for (size_t i = 0; i < n; i++)
			it[i].id = ids[i];
		ecx_consumer_lookup(c, it, n);
		size_t found = 0;
		for (size_t i = 0; i < n; i++)
			found += it[i].status == 0;
		if (found == n)
			return true;
		usleep(100000);
	}
	return false;
}

bool tcp_source_start(const bench_opts *o, proc *pr, int *fd)
{
	char *a[] = {"bench", "--peer-addr", (char *)o->peer_addr,
	             "--tcp-source-for-bench", NULL};
	char line[64];
	unsigned port;
	if (!proc_start_via(pr, o->peer_wrap, a) ||
	    !proc_line(pr, line, sizeof(line), 30000) ||
	    sscanf(line, "ready %u", &port) != 1)
		return false;
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_port = htons((uint16_t)port)};
	inet_pton(AF_INET, o->peer_addr, &sa.sin_addr);
	*fd = socket(AF_INET, SOCK_STREAM, 0);
	if (*fd < 0 || connect(*fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
		return false;
	tcp_tune(*fd);
	/* The blocking receiver's bound, as IO_POLL's: 30 s without a byte. */
	struct timeval tv = {.tv_sec = 30};
	setsockopt(*fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	return true;
}
