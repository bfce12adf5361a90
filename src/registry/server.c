/* server.c - the HTTP registry on libmicrohttpd: the daemon, its requests
 * and listening socket, and the registry's creation and destruction. */
#include "registry/registry_priv.h"

#include <microhttpd.h>

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MOD "registry"

/* Per-request state, from the first call of the handler to completion. */
typedef struct reg_req {
	uint64_t start_ns;
	char *body;
	size_t len;
	bool too_big;
} reg_req;

static enum MHD_Result reg_handle(void *cls, struct MHD_Connection *c,
                                  const char *url, const char *method,
                                  const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
	(void)version;
	ecx_registry *r = cls;
	reg_req *q = *con_cls;
	if (q == NULL) {
		q = calloc(1, sizeof(*q));
		if (q == NULL)
			return MHD_NO;
		q->start_ns = ecx_now_ns();
		*con_cls = q;
		return MHD_YES;
	}
	if (*upload_size > 0) {
		size_t n = *upload_size;
		*upload_size = 0;
		if (q->too_big || q->len + n > ECX_REG_MAX_BODY) {
			q->too_big = true;
			return MHD_YES;
		}
		char *b = realloc(q->body, q->len + n + 1);
		if (b == NULL)
			return MHD_NO;
		memcpy(b + q->len, upload, n);
		q->body = b;
		q->len += n;
		q->body[q->len] = '\0';
		return MHD_YES;
	}
	ecx_reg_http h = {
	    .method = method,
	    .url = url,
	    .arg_after =
	        MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "after"),
	    .arg_limit =
	        MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "limit"),
	    .arg_producer = MHD_lookup_connection_value(
	        c, MHD_GET_ARGUMENT_KIND, "producer_zmq"),
	    .arg_lease_ms = MHD_lookup_connection_value(
	        c, MHD_GET_ARGUMENT_KIND, "ecx_lease_ms"),
	    .authorization = MHD_lookup_connection_value(
	        c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
	    .body = q->body,
	    .len = q->len,
	    .too_big = q->too_big};
	ecx_reg_answer a = {0};
	ecx_registry_route(r, &h, &a);
	struct MHD_Response *resp = MHD_create_response_from_buffer(
	    strlen(a.body), a.body, MHD_RESPMEM_MUST_FREE);
	if (resp == NULL) {
		free(a.body);
		return MHD_NO;
	}
	MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, a.ctype);
	if (a.status == MHD_HTTP_UNAUTHORIZED)
		MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
		                        "Bearer");
	enum MHD_Result ret = MHD_queue_response(c, a.status, resp);
	MHD_destroy_response(resp);
	return ret;
}

static void reg_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                          enum MHD_RequestTerminationCode toe)
{
	(void)c;
	(void)toe;
	ecx_registry *r = cls;
	reg_req *q = *con_cls;
	if (q == NULL)
		return;
	uint64_t us = (ecx_now_ns() - q->start_ns) / 1000;
	size_t b = 0;
	while (b < NLAT && us > lat_bounds_us[b])
		b++;
	count(&r->lat_buckets[b], 1);
	count(&r->lat_count, 1);
	count(&r->lat_sum_us, us);
	count(&r->requests, 1);
	free(q->body);
	free(q);
	*con_cls = NULL;
}

/* Decodes %XX in the URL in place, as libmicrohttpd would, except %00: a
 * NUL would cut the id short ("a%00b" would look up "a"), so it stays
 * encoded and the id check refuses the '%'. */
static size_t reg_unescape(void *cls, struct MHD_Connection *c, char *s)
{
	(void)cls;
	(void)c;
	char *w = s;
	for (const char *r = s; *r != '\0'; r++) {
		int hi, lo;
		if (r[0] == '%' && (hi = ecx_hex_digit(r[1])) >= 0 &&
		    (lo = ecx_hex_digit(r[2])) >= 0 && (hi | lo) != 0) {
			*w++ = (char)(hi << 4 | lo);
			r += 2;
		} else {
			*w++ = *r;
		}
	}
	*w = '\0';
	return (size_t)(w - s);
}

static void reg_mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	char line[512];
	vsnprintf(line, sizeof(line), fmt, ap);
	size_t n = strlen(line);
	while (n > 0 && line[n - 1] == '\n')
		line[--n] = '\0';
	ecx_debug(MOD, "libmicrohttpd: %s", line);
}

/* Binds the listening socket here rather than in libmicrohttpd so that a
 * taken port or a bad address is reported precisely. */
static int reg_listen(const char *host, uint16_t port, int *fd_out,
                      uint16_t *port_out, char *why, size_t whylen)
{
	struct addrinfo hints, *res = NULL;
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
	char ps[8];
	snprintf(ps, sizeof(ps), "%u", port);
	int gai = getaddrinfo(host, ps, &hints, &res);
	if (gai != 0)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "cannot use bind address '%s': %s", host,
		               gai_strerror(gai));
	int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC,
	                res->ai_protocol);
	if (fd < 0) {
		freeaddrinfo(res);
		return ecx_why(why, whylen, ECX_EIO, "socket: %s",
		               strerror(errno));
	}
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
		int e = errno;
		freeaddrinfo(res);
		close(fd);
		if (e == EADDRINUSE)
			return ecx_why(why, whylen, ECX_EADDRINUSE,
			               "port %u on %s is already in use (is "
			               "another registry or producer running?)",
			               port, host);
		return ecx_why(
		    why, whylen, e == EADDRNOTAVAIL ? ECX_EINVAL : ECX_EIO,
		    "cannot bind %s:%u: %s", host, port, strerror(e));
	}
	freeaddrinfo(res);
	if (listen(fd, 512) != 0) {
		int e = errno;
		close(fd);
		return ecx_why(why, whylen, ECX_EIO, "listen: %s", strerror(e));
	}
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sl);
	*port_out = ntohs(ss.ss_family == AF_INET6
	                      ? ((struct sockaddr_in6 *)&ss)->sin6_port
	                      : ((struct sockaddr_in *)&ss)->sin_port);
	*fd_out = fd;
	return 0;
}

int reg_server_create(const ecx_registry_params *p, bool starting,
                      ecx_registry **out, char *why, size_t whylen)
{
	uint64_t m = p != NULL ? p->field_mask : 0;
	const char *host = (m & ECX_REGISTRY_PARAM_BIND_HOST) && p->bind_host
	                       ? p->bind_host
	                       : "0.0.0.0";
	uint16_t port =
	    (m & ECX_REGISTRY_PARAM_PORT) ? p->port : ECX_REGISTRY_PORT_DEFAULT;
	const char *token =
	    (m & ECX_REGISTRY_PARAM_TOKEN) && p->token && p->token[0] ? p->token
	                                                              : NULL;
	unsigned threads =
	    (m & ECX_REGISTRY_PARAM_THREADS) && p->threads ? p->threads : 2;
	const char *store =
	    (m & ECX_REGISTRY_PARAM_STORE) && p->store ? p->store : "memory";
	int entry_ttl = (m & ECX_REGISTRY_PARAM_ENTRY_TTL)
	                    ? p->entry_ttl_s
	                    : ECX_ENTRY_TTL_DEFAULT;
	if (threads > 64)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "at most 64 registry threads");
	if (entry_ttl < 0 || entry_ttl > ECX_TTL_MAX_S)
		return ecx_why(why, whylen, ECX_EINVAL,
		               "the entry TTL is 0 to %d seconds, not %d",
		               ECX_TTL_MAX_S, entry_ttl);
	if (strcmp(store, "memory") != 0 && !ecx_store_is_redis_url(store))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "unknown registry store '%s' (memory, "
		               "redis://host:port[/db] or redis+sentinel://"
		               "host:port[,host:port...]/master[/db])",
		               store);

	ecx_registry *r = calloc(1, sizeof(*r));
	if (r != NULL)
		r->pid = (int)getpid();
	if (r == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	r->epoch = (ecx_now_ns() ^ ((uint64_t)getpid() << 40)) %
	               (ECX_JSON_INT_MAX - 1) +
	           1;
	r->entry_ttl_s = entry_ttl;
	r->starting = starting;
	r->token_reads = (m & ECX_REGISTRY_PARAM_TOKEN_READS) &&
	                 p->token_reads && token != NULL;
	int rc = ECX_ENOMEM;
	if (token != NULL) {
		r->token = strdup(token);
		r->token_len = strlen(token);
		if (r->token == NULL)
			goto fail;
	}
	if (ecx_store_is_redis_url(store)) {
		r->store = ecx_store_redis_create(store, 5000, 0, why, whylen);
		if (r->store == NULL) {
			rc = ECX_EINVAL;
			goto fail;
		}
		r->redis = true;
		/* It starts anyway (Redis may come later); /healthz says. */
		char down[256];
		if (ecx_store_redis_ping(r->store, down, sizeof(down)) != 0)
			ecx_warn(MOD,
			         "%s (/healthz answers 503 until it "
			         "answers)",
			         down);
	} else {
		r->store = ecx_store_mem_create();
		if (r->store == NULL)
			goto fail;
	}
	int fd = -1;
	rc = reg_listen(host, port, &fd, &r->port, why, whylen);
	if (rc != 0)
		goto fail;
	r->mhd = MHD_start_daemon(
	    MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL |
	        MHD_USE_ERROR_LOG | MHD_USE_SUPPRESS_DATE_NO_CLOCK,
	    0, NULL, NULL, reg_handle, r, MHD_OPTION_LISTEN_SOCKET, fd,
	    MHD_OPTION_THREAD_POOL_SIZE, threads, MHD_OPTION_NOTIFY_COMPLETED,
	    reg_completed, r, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)60,
	    MHD_OPTION_CONNECTION_LIMIT, (unsigned)1000,
	    MHD_OPTION_EXTERNAL_LOGGER, reg_mhd_log, NULL,
	    MHD_OPTION_UNESCAPE_CALLBACK, reg_unescape, NULL, MHD_OPTION_END);
	if (r->mhd == NULL) {
		close(fd);
		rc = ecx_why(why, whylen, ECX_EIO,
		             "libmicrohttpd could not start on %s:%u", host,
		             r->port);
		goto fail;
	}
	bool v6 = strchr(host, ':') != NULL; /* a URL brackets IPv6 */
	ecx_info(MOD, "listening on http://%s%s%s:%u (store %s%s)",
	         v6 ? "[" : "", host, v6 ? "]" : "", r->port, store,
	         token ? ", token required for writes" : "");
	*out = r;
	return 0;
fail:
	if (rc == ECX_ENOMEM)
		ecx_why(why, whylen, rc, "out of memory");
	ecx_store_destroy(r->store);
	free(r->token);
	free(r);
	return rc;
}

void ecx_registry_set_starting(ecx_registry *r, bool starting)
{
	__atomic_store_n(&r->starting, starting, __ATOMIC_RELEASE);
}

uint16_t reg_server_port(const ecx_registry *r)
{
	return r->port;
}

ecx_store *ecx_registry_store(ecx_registry *r)
{
	return r->store;
}

void ecx_registry_count_publish(ecx_registry *r, bool removal)
{
	count(removal ? &r->removals : &r->publishes, 1);
}

uint64_t ecx_registry_http_writes(ecx_registry *r)
{
	return __atomic_load_n(&r->http_writes, __ATOMIC_RELAXED);
}

void reg_server_destroy(ecx_registry *r)
{
	if (r == NULL)
		return;
	/* In a forked child: the parent's daemon, left as it is (leaked). */
	if (ecx_forked(r->pid, "registry"))
		return;
	if (r->mhd != NULL)
		MHD_stop_daemon(r->mhd); /* closes the listening socket */
	ecx_store_destroy(r->store);
	if (r->token != NULL)
		memset(r->token, 0, r->token_len);
	free(r->token);
	free(r);
}

int ecx_registry_create_detached(const char *token, ecx_registry **out)
{
	ecx_registry *r = calloc(1, sizeof(*r));
	if (r != NULL)
		r->pid = (int)getpid();
	if (r == NULL)
		return ECX_ENOMEM;
	r->store = ecx_store_mem_create();
	r->entry_ttl_s = ECX_ENTRY_TTL_DEFAULT;
	if (token != NULL) {
		r->token = strdup(token);
		r->token_len = strlen(token);
	}
	if (r->store == NULL || (token != NULL && r->token == NULL)) {
		reg_server_destroy(r);
		return ECX_ENOMEM;
	}
	*out = r;
	return 0;
}
