/* host.c - facts about this host and process that the roles need: a
 * default address to advertise and a fresh epoch per start. */
#include "core/core.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
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

/* The inode of one of this process's namespaces, or 0. */
static unsigned long long ns_inode(const char *name)
{
	char path[64];
	struct stat st;
	snprintf(path, sizeof(path), "/proc/self/ns/%s", name);
	return stat(path, &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

void ecx_shm_domain(char *out, size_t len)
{
	char boot[64] = "";
	int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, boot, sizeof(boot) - 1);
		boot[n > 0 ? n : 0] = '\0';
		boot[strcspn(boot, "\n")] = '\0';
		close(fd);
	}
	snprintf(out, len, "%s/ipc:%llu/pid:%llu/mnt:%llu/uid:%u", boot,
	         ns_inode("ipc"), ns_inode("pid"), ns_inode("mnt"),
	         (unsigned)geteuid());
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
