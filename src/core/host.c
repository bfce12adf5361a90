/* host.c - facts about this host and process that the roles need: a
 * default address to advertise and a fresh epoch per start. */
#include "core/core.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

void ecx_default_host(char *out, size_t len)
{
	ecx_strlcpy(out, "127.0.0.1", len);
	struct ifaddrs *ifs = NULL;
	if (getifaddrs(&ifs) != 0)
		return;
	for (struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
		if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET)
			continue;
		struct in_addr a =
		    ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
		if ((ntohl(a.s_addr) >> 24) == 127)
			continue;
		inet_ntop(AF_INET, &a, out, (socklen_t)len);
		break;
	}
	freeifaddrs(ifs);
}

uint64_t ecx_random_epoch(void)
{
	uint64_t v = 0;
	int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		if (read(fd, &v, sizeof(v)) != (ssize_t)sizeof(v))
			v = 0;
		close(fd);
	}
	v ^= ecx_now_ns() ^ ((uint64_t)getpid() << 32);
	v &= ECX_JSON_INT_MAX - 1;
	return v != 0 ? v : 1;
}
