/* port.h - a free TCP port on 127.0.0.1, for test servers that cannot bind
 * port 0 themselves (redis-server, redis-sentinel, a registry started again
 * on the port it had). Header only. */
#ifndef ECX_TEST_PORT_H
#define ECX_TEST_PORT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

/* A port the kernel just handed out on 127.0.0.1 and took back: free now,
 * though another process may take it before the caller binds it. */
static inline int tu_free_port(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
	                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	socklen_t sl = sizeof(sa);
	getsockname(fd, (struct sockaddr *)&sa, &sl);
	close(fd);
	return ntohs(sa.sin_port);
}

#endif
