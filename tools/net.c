/* net.c - host names and bind addresses as the command's flags take them,
 * and the warning a daemon gives when it listens open to the network. */
#include "tool.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <netdb.h>
#include <string.h>

bool tool_host_check(const char *host, char *why, size_t whylen)
{
	size_t n = strlen(host);
	char v6[INET6_ADDRSTRLEN + 2];
	struct in6_addr a6;
	if (n > 0 && host[0] == '[' && host[n - 1] == ']' &&
	    n - 2 < sizeof(v6)) {
		memcpy(v6, host + 1, n - 2);
		v6[n - 2] = '\0';
		if (inet_pton(AF_INET6, v6, &a6) == 1)
			return true;
	}
	if (strchr(host, ':') != NULL) {
		if (inet_pton(AF_INET6, host, &a6) == 1)
			return true;
		tool_why(why, whylen, 0, "not an IPv6 address");
		return false;
	}
	if (n == 0 || n > 253) {
		tool_why(why, whylen, 0, "a host name is 1 to 253 characters");
		return false;
	}
	for (const char *p = host; *p != '\0'; p++) {
		if (!isalnum((unsigned char)*p) && *p != '-' && *p != '.' &&
		    *p != '_') {
			tool_why(why, whylen, 0,
			         "a host name or IP address: letters, "
			         "digits, '-' and '.'");
			return false;
		}
	}
	return true;
}

const char *tool_url_host(const char *host, char *buf, size_t len)
{
	if (strchr(host, ':') != NULL && host[0] != '[')
		snprintf(buf, len, "[%s]", host);
	else
		snprintf(buf, len, "%s", host);
	return buf;
}

bool tool_bind_resolve(const char *host, char *buf, size_t len, char *why,
                       size_t whylen)
{
	if (!tool_host_check(host, why, whylen))
		return false;
	size_t n = strlen(host);
	if (host[0] == '[') { /* [::1] -> ::1 */
		snprintf(buf, len, "%.*s", (int)(n - 2), host + 1);
		return true;
	}
	struct in6_addr a;
	if (inet_pton(AF_INET, host, &a) == 1 ||
	    inet_pton(AF_INET6, host, &a) == 1) {
		snprintf(buf, len, "%s", host);
		return true;
	}
	/* A name: its IPv4 address where it has one (as 'localhost' on most
	 * hosts), else its IPv6 one. */
	static const int families[] = {AF_INET, AF_INET6};
	int err = 0;
	for (size_t i = 0; i < 2; i++) {
		struct addrinfo hints = {.ai_family = families[i],
		                         .ai_socktype = SOCK_STREAM},
		                *res = NULL;
		err = getaddrinfo(host, NULL, &hints, &res);
		if (err != 0)
			continue;
		err = getnameinfo(res->ai_addr, res->ai_addrlen, buf,
		                  (socklen_t)len, NULL, 0, NI_NUMERICHOST);
		freeaddrinfo(res);
		if (err == 0)
			return true;
	}
	tool_why(why, whylen, 0, "cannot resolve it: %s", gai_strerror(err));
	return false;
}

/* Whether a numeric address is a loopback one (127.0.0.0/8, ::1, or
 * ::ffff:127.x.y.z). */
static bool numeric_loopback(const char *host)
{
	unsigned char a[16];
	if (inet_pton(AF_INET, host, a) == 1)
		return a[0] == 127;
	if (inet_pton(AF_INET6, host, a) != 1)
		return false;
	static const unsigned char one[16] = {[15] = 1};
	static const unsigned char v4[12] = {[10] = 0xff, [11] = 0xff};
	return memcmp(a, one, 16) == 0 ||
	       (memcmp(a, v4, 12) == 0 && a[12] == 127);
}

void tool_warn_open(const char *cmd, const char *bind, const char *token,
                    const char *what)
{
	if (token != NULL && token[0] != '\0')
		return;
	char num[INET6_ADDRSTRLEN + 1], why[128];
	const char *h = bind;
	if (tool_bind_resolve(bind, num, sizeof(num), why, sizeof(why)))
		h = num;
	if (numeric_loopback(h))
		return;
	fprintf(stderr,
	        "ecx %s: warning: listening on %s with no token: anyone who "
	        "reaches it can %s (give --token T or $ECX_TOKEN, or --bind "
	        "127.0.0.1)\n",
	        cmd, bind, what);
}
