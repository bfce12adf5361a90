/*
 * recv_sock.c - the receiver thread's sockets: its listening sockets,
 * their epoll registrations and TCP_NODELAY. Used by the data port
 * (receiver.c) and the handshake server (recv_hs.c); calls neither.
 */
#include "mooncake/receiver_priv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

void recv_nodelay(int fd)
{
	int one = 1;
	(void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* A listening socket at host (NULL or "": every address, dual-stack). */
int recv_listen(const char *host, uint16_t *port, char *why, size_t whylen)
{
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
	                         .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
	struct addrinfo *ai = NULL;
	bool any = host == NULL || host[0] == '\0';
	int fd = -1;
	if (any) {
		fd = socket(AF_INET6,
		            SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (fd >= 0) {
			int zero = 0;
			(void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero,
			                 sizeof(zero));
			struct sockaddr_in6 a = {.sin6_family = AF_INET6,
			                         .sin6_addr = in6addr_any};
			if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
				close(fd);
				fd = -1;
			}
		}
		if (fd < 0) {
			fd = socket(AF_INET,
			            SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
			            0);
			struct sockaddr_in a = {.sin_family = AF_INET};
			if (fd >= 0 &&
			    bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
				close(fd);
				fd = -1;
			}
		}
	} else {
		char h[ECX_MC_NAME_MAX];
		ecx_strlcpy(h, host, sizeof(h));
		size_t n = strlen(h);
		if (n > 1 && h[0] == '[' && h[n - 1] == ']') {
			memmove(h, h + 1, n - 2);
			h[n - 2] = '\0';
		}
		int e = getaddrinfo(h, "0", &hints, &ai);
		if (e != 0)
			return ecx_why(why, whylen, ECX_EINVAL,
			               "mooncake receiver: bind host '%s': %s",
			               host, gai_strerror(e));
		fd = socket(ai->ai_family,
		            SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (fd >= 0 && bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
			close(fd);
			fd = -1;
		}
		freeaddrinfo(ai);
	}
	if (fd < 0 || listen(fd, 128) != 0) {
		int err = errno;
		if (fd >= 0)
			close(fd);
		return ecx_why(why, whylen,
		               err == EADDRINUSE ? ECX_EADDRINUSE : ECX_EIO,
		               "mooncake receiver: cannot listen at %s: %s",
		               any ? "every address" : host, strerror(err));
	}
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sl);
	*port = ntohs(ss.ss_family == AF_INET6
	                  ? ((struct sockaddr_in6 *)&ss)->sin6_port
	                  : ((struct sockaddr_in *)&ss)->sin_port);
	return fd;
}

void recv_ep_add(ecx_mc_recv *r, int fd, uint32_t ev, tag *t)
{
	struct epoll_event e = {.events = ev, .data.ptr = t};
	(void)epoll_ctl(r->ep, EPOLL_CTL_ADD, fd, &e);
}

/* A registration ends with its descriptor only when no other descriptor
 * shares its file: a child forked in this process (Python's subprocess, say)
 * holds a copy until its exec, and meanwhile epoll would go on reporting the
 * file with a tag already freed. So every connection leaves epoll first. */
void recv_ep_close(ecx_mc_recv *r, int fd)
{
	(void)epoll_ctl(r->ep, EPOLL_CTL_DEL, fd, NULL);
	close(fd);
}

void recv_ep_mod(ecx_mc_recv *r, int fd, uint32_t ev, tag *t)
{
	struct epoll_event e = {.events = ev, .data.ptr = t};
	(void)epoll_ctl(r->ep, EPOLL_CTL_MOD, fd, &e);
}
