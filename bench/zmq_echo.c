/*
 * zmq_echo.c - a ZeroMQ REP server that does nothing but answer: the far
 * end of the least control a push on upstream's wire can have.
 *
 * bench/push_mooncake.py starts it beside the consumer's control shard and
 * times, after a write, one round trip to it with a complete_batch-shaped
 * frame: the write and the complete's round trip with no table, no Python
 * and no ready event at the far end. What a push takes beyond that is the
 * control's own work (docs/bench.md, "The floor of a push over Mooncake's
 * wire").
 *
 *   ecx-bench-zmq-echo HOST
 *
 * Binds a REP socket to an ephemeral port of HOST (an IPv6 address works
 * too), prints that port on a line of its own, and answers every request
 * with {"ok":true,"result":{}} until its standard input closes (its parent
 * gone) or it is interrupted.
 */
#include <zmq.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define REPLY "{\"ok\":true,\"result\":{}}"

int main(int argc, char **argv)
{
	if (argc != 2 || argv[1][0] == '-') {
		fprintf(stderr, "usage: ecx-bench-zmq-echo HOST\n");
		return 2;
	}
	int rc = 1;
	void *ctx = zmq_ctx_new();
	void *rep = ctx ? zmq_socket(ctx, ZMQ_REP) : NULL;
	char ep[300], last[300];
	size_t len = sizeof(last);
	int one = 1, zero = 0;
	/* An IPv6 address goes in brackets (given with them or not). */
	const char *h = argv[1];
	size_t hl = strlen(h);
	if (h[0] == '[' && hl > 1 && h[hl - 1] == ']')
		h++, hl -= 2;
	snprintf(ep, sizeof(ep),
	         memchr(h, ':', hl) ? "tcp://[%.*s]:*" : "tcp://%.*s:*",
	         (int)hl, h);
	if (rep == NULL ||
	    zmq_setsockopt(rep, ZMQ_IPV6, &one, sizeof(one)) != 0 ||
	    zmq_setsockopt(rep, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
	    zmq_bind(rep, ep) != 0 ||
	    zmq_getsockopt(rep, ZMQ_LAST_ENDPOINT, last, &len) != 0) {
		fprintf(stderr, "ecx-bench-zmq-echo: cannot bind %s: %s\n", ep,
		        zmq_strerror(zmq_errno()));
		goto out;
	}
	const char *port = strrchr(last, ':');
	printf("%s\n", port ? port + 1 : "0");
	fflush(stdout);

	zmq_pollitem_t items[] = {{rep, 0, ZMQ_POLLIN, 0},
	                          {NULL, STDIN_FILENO, ZMQ_POLLIN, 0}};
	char buf[4096], drop[256];
	for (;;) {
		if (zmq_poll(items, 2, -1) < 0) {
			rc = zmq_errno() == EINTR ? 0 : 1;
			break;
		}
		if (items[1].revents) { /* input, or its end: the parent */
			if (read(STDIN_FILENO, drop, sizeof(drop)) <= 0) {
				rc = 0;
				break;
			}
		}
		if (items[0].revents & ZMQ_POLLIN) {
			/* The request in, every frame of it (a longer frame is
			 * cut, as nothing reads it), the answer out. */
			int more = 1;
			size_t ml = sizeof(more);
			while (more && zmq_recv(rep, buf, sizeof(buf), 0) >= 0)
				if (zmq_getsockopt(rep, ZMQ_RCVMORE, &more,
				                   &ml))
					break;
			if (more ||
			    zmq_send(rep, REPLY, strlen(REPLY), 0) < 0) {
				fprintf(stderr, "ecx-bench-zmq-echo: %s\n",
				        zmq_strerror(zmq_errno()));
				break;
			}
		}
	}
out:
	if (rep)
		zmq_close(rep);
	if (ctx)
		zmq_ctx_term(ctx);
	return rc;
}
