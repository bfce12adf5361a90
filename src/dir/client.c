/* client.c - the registry client on libcurl: one persistent connection per
 * registry, bounded waits, back-off for registries that are down, and what
 * a failed request means. Lookups are client_lookup.c, listings and health
 * client_list.c, writes client_write.c. */
#include "dir/regclient.h"

#include <curl/curl.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MOD "regclient"
static size_t on_body(char *data, size_t sz, size_t nm, void *ud)
{
	buf *b = ud;
	size_t n = sz * nm;
	if (b->len + n > ECX_WIRE_MAX)
		return 0; /* too big: curl fails with a write error */
	if (b->len + n + 1 > b->cap) {
		size_t cap = (b->len + n + 1) * 2;
		if (cap < 16384)
			cap = 16384;
		char *p = realloc(b->p, cap);
		if (p == NULL)
			return 0;
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->len, data, n);
	b->len += n;
	b->p[b->len] = '\0';
	return n;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void)
{
	curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* Whether p, after spaces, starts with a scheme and "://". */
static bool starts_url(const char *p)
{
	while (*p == ' ')
		p++;
	size_t n = 0;
	while ((p[n] >= 'a' && p[n] <= 'z') || (p[n] >= 'A' && p[n] <= 'Z') ||
	       (n > 0 && ((p[n] >= '0' && p[n] <= '9') || p[n] == '+' ||
	                  p[n] == '-' || p[n] == '.')))
		n++;
	return n > 0 && strncmp(p + n, "://", 3) == 0;
}

/* The comma that ends the first URL of a comma-separated list, NULL when
 * it is the last. A redis+sentinel:// URL ends only at a comma that starts
 * another URL (scheme://), so that the commas between its sentinels stay
 * in it; any other URL, at its first comma. */
static const char *list_comma(const char *p)
{
	while (*p == ' ')
		p++;
	if (strncasecmp(p, "redis+sentinel://", 17) != 0)
		return strchr(p, ',');
	for (const char *c = strchr(p, ','); c != NULL;
	     c = strchr(c + 1, ',')) {
		const char *q = c + 1;
		while (*q == ' ')
			q++;
		if (*q == '\0' || *q == ',' || starts_url(q))
			return c;
	}
	return NULL;
}

/* Refuses URL u (n bytes) when its host is an IPv6 address without
 * brackets (http://::1:9018): its port cannot be told from the address.
 * The message shows the URL written right. Returns 0 or ECX_EINVAL. */
static int url_ipv6_check(const char *u, size_t n, char *why, size_t whylen)
{
	const char *sep = strstr(u, "://");
	if (sep == NULL || (size_t)(sep - u) >= n)
		return 0;
	size_t scheme = (size_t)(sep - u) + 3;
	size_t a = scheme, e = scheme;
	while (e < n && u[e] != '/')
		e++;
	for (size_t i = a; i < e; i++)
		if (u[i] == '@')
			a = i + 1;
	size_t colons = 0, last = 0;
	for (size_t i = a; i < e; i++)
		if (u[i] == ':')
			colons++, last = i;
	if (a == e || u[a] == '[' || colons < 2)
		return 0;
	/* The last part is the port when it is a number. */
	bool port = last + 1 < e;
	for (size_t i = last + 1; i < e; i++)
		port = port && u[i] >= '0' && u[i] <= '9';
	size_t hostend = port ? last : e;
	return ecx_why(why, whylen, ECX_EINVAL,
	               "registry URL '%.*s' has an IPv6 address without "
	               "brackets, so its port cannot be told from it: put "
	               "the address in brackets, %.*s[%.*s]%.*s%.*s",
	               (int)(n > 200 ? 200 : n), u, (int)a, u,
	               (int)(hostend - a), u + a, (int)(e - hostend),
	               u + hostend, (int)(n - e), u + e);
}

int ecx_regclient_create(const ecx_regclient_opts *o, ecx_regclient **out,
                         char *why, size_t whylen)
{
	pthread_once(&curl_once, curl_init_once);
	if (o == NULL || o->urls == NULL || o->urls[0] == '\0')
		return ecx_why(why, whylen, ECX_EINVAL,
		               "no registry URL given");
	ecx_regclient *c = calloc(1, sizeof(*c));
	if (c == NULL)
		return ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
	c->connect_timeout_ms =
	    o->connect_timeout_ms > 0 ? o->connect_timeout_ms : 1000;
	c->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 5000;
	c->ttl_s = o->ttl_s > 0 ? o->ttl_s : 0;
	c->spin_us = o->spin_us == ECX_REGC_SPIN_NONE ? 0
	             : o->spin_us <= 0                ? ECX_REGC_SPIN_US
	                                              : o->spin_us;
	int rc = 0;
	const char *p = o->urls;
	while (*p != '\0') {
		const char *comma = list_comma(p);
		size_t n = comma != NULL ? (size_t)(comma - p) : strlen(p);
		while (n > 0 && p[n - 1] == ' ')
			n--;
		while (n > 0 && *p == ' ')
			p++, n--;
		if (n > 0) {
			if (c->nregs == MAX_REGISTRIES) {
				rc = ecx_why(why, whylen, ECX_EINVAL,
				             "at most %d registries",
				             MAX_REGISTRIES);
				goto fail;
			}
			/* Schemes are case-insensitive (RFC 3986). */
			bool sentinel =
			    n > 17 &&
			    strncasecmp(p, "redis+sentinel://", 17) == 0;
			bool redis =
			    sentinel ||
			    (n > 8 && strncasecmp(p, "redis://", 8) == 0);
			if ((!redis &&
			     (n < 8 || strncasecmp(p, "http://", 7) != 0)) ||
			    n >= ECX_ADDR_MAX - 1) {
				bool zmq = strncasecmp(p, "tcp://", 6) == 0;
				rc = ecx_why(
				    why, whylen, ECX_EINVAL,
				    "registry URL '%.*s' is not "
				    "http://HOST:PORT, "
				    "redis://HOST:PORT[/DB] or "
				    "redis+sentinel://HOST:PORT[,HOST:"
				    "PORT...]/MASTER[/DB]%s",
				    (int)(n > 200 ? 200 : n), p,
				    zmq ? " (a tcp:// address is a producer's "
				          "ZeroMQ port, not a registry: give "
				          "the http:// one 'ecx serve' prints)"
				        : "");
				goto fail;
			}
			if (!sentinel &&
			    (rc = url_ipv6_check(p, n, why, whylen)) != 0)
				goto fail;
			reg_conn *g = &c->regs[c->nregs++];
			memcpy(g->url, p, n);
			while (n > 0 && g->url[n - 1] == '/')
				n--;
			g->url[n] = '\0';
			g->backoff_ms = 500;
			g->sentinel = sentinel;
			if (redis) {
				g->redis = ecx_store_redis_create(
				    g->url, c->timeout_ms, o->ttl_s, why,
				    whylen);
				if (g->redis == NULL) {
					rc = ECX_EINVAL;
					goto fail;
				}
			}
		}
		p += comma != NULL ? (size_t)(comma - p) + 1 : strlen(p);
	}
	if (c->nregs == 0) {
		rc = ecx_why(why, whylen, ECX_EINVAL, "no registry URL given");
		goto fail;
	}
	c->headers = curl_slist_append(NULL, "Content-Type: application/json");
	/* libcurl adds "Expect: 100-continue" to large bodies; it costs a
	 * round trip. */
	c->headers = curl_slist_append(c->headers, "Expect:");
	if (o->token != NULL && o->token[0] != '\0') {
		size_t tl = strlen(o->token) + 32;
		char *h = malloc(tl);
		if (h == NULL) {
			rc = ecx_why(why, whylen, ECX_ENOMEM, "out of memory");
			goto fail;
		}
		snprintf(h, tl, "Authorization: Bearer %s", o->token);
		c->headers = curl_slist_append(c->headers, h);
		memset(h, 0, tl);
		free(h);
	}
	*out = c;
	return 0;
fail:
	ecx_regclient_destroy(c);
	return rc;
}

void ecx_regclient_destroy(ecx_regclient *c)
{
	if (c == NULL)
		return;
	for (size_t i = 0; i < c->nregs; i++) {
		if (c->regs[i].curl != NULL)
			curl_easy_cleanup(c->regs[i].curl);
		if (c->regs[i].multi != NULL)
			curl_multi_cleanup(c->regs[i].multi);
		ecx_store_destroy(c->regs[i].redis);
		free(c->regs[i].rx.p);
	}
	curl_slist_free_all(c->headers);
	free(c);
}

long ecx_regclient_connects(const ecx_regclient *c)
{
	return c->connects;
}

/* Says what a failed request means for the user, with libcurl's own text
 * after it: the URL, what happened, the bound that ran out, and what to
 * check. h is the handle the request ran on. */
static int curl_err(const ecx_regclient *c, CURL *h, CURLcode cc,
                    const char *url, char *why, size_t whylen)
{
	const char *raw = curl_easy_strerror(cc);
	long oserr = 0;
	curl_off_t connect_us = 0;
	curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &oserr);
	curl_easy_getinfo(h, CURLINFO_CONNECT_TIME_T, &connect_us);
	switch (cc) {
	case CURLE_OPERATION_TIMEDOUT:
		if (connect_us == 0)
			return ecx_why(
			    why, whylen, ECX_ETIMEDOUT,
			    "registry %s: no connection within the "
			    "connect timeout of %d ms (is the host up, "
			    "and the port open between the hosts?) "
			    "(libcurl: %s)",
			    url, c->connect_timeout_ms, raw);
		return ecx_why(
		    why, whylen, ECX_ETIMEDOUT,
		    "registry %s took the connection but did not "
		    "answer within the request timeout of %d ms (is "
		    "it a registry, and is it overloaded or stopped?) "
		    "(libcurl: %s)",
		    url, c->timeout_ms, raw);
	case CURLE_COULDNT_CONNECT:
		if (oserr == ECONNREFUSED)
			return ecx_why(why, whylen, ECX_ECONNECT,
			               "registry %s refused the connection: "
			               "nothing listens on that port (is the "
			               "registry running, and is the port "
			               "right?) (libcurl: %s)",
			               url, raw);
		return ecx_why(
		    why, whylen, ECX_ECONNECT,
		    "cannot connect to registry %s: %s (libcurl: %s)", url,
		    oserr != 0 ? strerror((int)oserr) : "no route to it", raw);
	case CURLE_COULDNT_RESOLVE_HOST:
		return ecx_why(why, whylen, ECX_ECONNECT,
		               "registry %s: its host name does not resolve "
		               "(libcurl: %s)",
		               url, raw);
	case CURLE_UNSUPPORTED_PROTOCOL:
	case CURLE_WEIRD_SERVER_REPLY:
	case CURLE_GOT_NOTHING:
		/* A server that answers no HTTP: libcurl calls the bytes of a
		 * ZeroMQ greeting HTTP/0.9, an "unsupported protocol". */
		return ecx_why(
		    why, whylen, ECX_EPROTO,
		    "%s does not answer HTTP: is it a registry? (a "
		    "producer's ZeroMQ port, the tcp:// address "
		    "'ecx serve' prints, is not one; its registry is "
		    "the http:// address) (libcurl: %s)",
		    url, raw);
	case CURLE_URL_MALFORMAT:
		return ecx_why(why, whylen, ECX_EINVAL,
		               "registry URL %s is malformed (put an IPv6 "
		               "address in brackets: http://[::1]:9018) "
		               "(libcurl: %s)",
		               url, raw);
	default:
		return ecx_why(why, whylen, ECX_EIO, "registry %s: %s", url,
		               raw);
	}
}

/* The error of a failure in this client rather than in the registry (no
 * memory, a libcurl multi-handle failure): not a reason to back off from
 * the registry. */
static int multi_err(CURLMcode mc, char *why, size_t whylen)
{
	int e = mc == CURLM_OUT_OF_MEMORY ? ECX_ENOMEM : ECX_EINTERNAL;
	return ecx_why(why, whylen, e, "registry client: %s",
	               curl_multi_strerror(mc));
}

/* Runs g's prepared transfer to its end, its result in *cc. It polls the
 * connection (without sleeping) for up to c->spin_us, then sleeps in
 * curl_multi_poll, which wakes for curl's own timeouts too, so
 * CURLOPT_TIMEOUT_MS bounds the whole as it bounds curl_easy_perform. The
 * connection lives in g->multi's cache between requests. Returns 0, or
 * multi_err's error when the transfer could not be run. */
static int regc_perform(ecx_regclient *c, reg_conn *g, CURLcode *cc, char *why,
                        size_t whylen)
{
	if (g->multi == NULL && (g->multi = curl_multi_init()) == NULL)
		return multi_err(CURLM_OUT_OF_MEMORY, why, whylen);
	CURLMcode mc = curl_multi_add_handle(g->multi, g->curl);
	if (mc != CURLM_OK)
		return multi_err(mc, why, whylen);
	uint64_t spin_end = ecx_now_ns() + (uint64_t)c->spin_us * 1000u;
	int running = 1;
	for (;;) {
		mc = curl_multi_perform(g->multi, &running);
		if (mc != CURLM_OK || running == 0)
			break;
		/* Yielding lets a registry on this CPU answer. */
		if (ecx_now_ns() < spin_end)
			sched_yield();
		else if ((mc = curl_multi_poll(g->multi, NULL, 0, 1000,
		                               NULL)) != CURLM_OK)
			break;
	}
	bool done = false;
	CURLMsg *m;
	int left;
	while ((m = curl_multi_info_read(g->multi, &left)) != NULL)
		if (m->msg == CURLMSG_DONE && m->easy_handle == g->curl) {
			*cc = m->data.result;
			done = true;
		}
	curl_multi_remove_handle(g->multi, g->curl);
	if (!done)
		return multi_err(mc != CURLM_OK ? mc : CURLM_INTERNAL_ERROR,
		                 why, whylen);
	return 0;
}

/* One HTTP request on registry g's persistent connection. */
int regc_request(ecx_regclient *c, reg_conn *g, const char *method,
                 const char *path, const char *body, long *status, buf *resp,
                 char *why, size_t whylen)
{
	if (g->curl == NULL) {
		g->curl = curl_easy_init();
		if (g->curl == NULL)
			return ecx_why(why, whylen, ECX_ENOMEM,
			               "out of memory");
	}
	CURL *h = g->curl;
	char url[ECX_ADDR_MAX + 512];
	int ul = snprintf(url, sizeof(url), "%s%s", g->url, path);
	if (ul < 0 || (size_t)ul >= sizeof(url))
		return ecx_why(why, whylen, ECX_EINVAL, "URL too long");
	/* Options are set on every call: the handle keeps its connection. */
	curl_easy_setopt(h, CURLOPT_URL, url);
	curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(h, CURLOPT_TCP_NODELAY, 1L);
	curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
	                 (long)c->connect_timeout_ms);
	curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)c->timeout_ms);
	curl_easy_setopt(h, CURLOPT_HTTPHEADER, c->headers);
	curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
	curl_easy_setopt(h, CURLOPT_WRITEDATA, resp);
	curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http");
	curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, NULL);
	curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
	if (body != NULL) {
		curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
		curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
	}
	if (strcmp(method, "GET") != 0)
		curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
	CURLcode cc = CURLE_OK;
	int rc = regc_perform(c, g, &cc, why, whylen);
	if (rc != 0)
		return rc;
	long nc = 0;
	curl_easy_getinfo(h, CURLINFO_NUM_CONNECTS, &nc);
	c->connects += nc;
	if (cc != CURLE_OK)
		return curl_err(c, h, cc, g->url, why, whylen);
	curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
	return 0;
}

bool regc_usable(reg_conn *g, uint64_t now)
{
	return g->down_until_ms == 0 || now >= g->down_until_ms;
}

size_t regc_probe(const ecx_regclient *c, uint64_t now)
{
	size_t best = SIZE_MAX;
	for (size_t r = 0; r < c->nregs; r++) {
		const reg_conn *g = &c->regs[r];
		if (g->down_until_ms == 0 || now >= g->down_until_ms)
			return SIZE_MAX; /* one is usable */
		if (best == SIZE_MAX ||
		    g->down_until_ms < c->regs[best].down_until_ms)
			best = r;
	}
	if (best != SIZE_MAX && now < c->regs[best].failed_ms + 1000)
		return SIZE_MAX;
	return best;
}

void regc_mark(reg_conn *g, int rc)
{
	if (rc == 0) {
		if (g->down_until_ms != 0)
			ecx_warn(MOD, "registry %s answers again", g->url);
		g->down_until_ms = 0;
		g->backoff_ms = 500;
		return;
	}
	if (rc == ECX_ECONNECT || rc == ECX_ETIMEDOUT || rc == ECX_EIO ||
	    rc == ECX_EPROTO) {
		/* Said once an outage, not at each try. */
		if (g->down_until_ms == 0)
			ecx_warn(MOD,
			         "registry %s unusable; trying it again with "
			         "back-off",
			         g->url);
		g->failed_ms = ecx_now_ms();
		g->down_until_ms = g->failed_ms + g->backoff_ms;
		ecx_debug(MOD, "registry %s: next try in %llu ms", g->url,
		          (unsigned long long)g->backoff_ms);
		/* Behind Sentinel a failover takes seconds and each call
		 * already waits for it (up to its timeout): the back-off
		 * stays short, so that lookups resume soon after. */
		if (g->backoff_ms < (g->sentinel ? 1000u : 10000u))
			g->backoff_ms *= 2;
	}
}

bool regc_is_miss(const buf *b)
{
	cJSON *o = b->p != NULL ? cJSON_ParseWithLength(b->p, b->len) : NULL;
	const cJSON *d = cJSON_GetObjectItemCaseSensitive(o, "detail");
	bool miss = cJSON_IsObject(o) && cJSON_IsString(d) &&
	            strcmp(d->valuestring, ECX_MISS_DETAIL) == 0;
	cJSON_Delete(o);
	return miss;
}

/* Reads the detail of an error answer, or says what the body is. A 404
 * that is not a registry's miss comes from a server that is not a
 * registry, or from a path after the port: the URL is wrong. */
int regc_http_err(long status, const buf *b, const char *url, char *why,
                  size_t whylen)
{
	if (status == 404 && !regc_is_miss(b))
		return ecx_why(why, whylen, ECX_EINVAL,
		               "%s is not an ecx or reference registry: it "
		               "answered 404 Not Found to a registry request "
		               "(check the URL: a registry is "
		               "http://HOST:PORT, with no path)",
		               url);
	int e = status == 401 || status == 403 ? ECX_EAUTH
	        : status == 404                ? ECX_ENOTFOUND
	        : status == 413                ? ECX_ETOOBIG
	        : status >= 500                ? ECX_EIO
	                                       : ECX_EPROTO;
	cJSON *o = b->p != NULL ? cJSON_ParseWithLength(b->p, b->len) : NULL;
	const cJSON *d = cJSON_GetObjectItemCaseSensitive(o, "detail");
	ecx_why(why, whylen, e, "registry %s answered %ld: %s", url, status,
	        cJSON_IsString(d) ? d->valuestring : "(no detail)");
	cJSON_Delete(o);
	return e;
}
