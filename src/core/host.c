/* host.c - facts about this host and process that the roles need: a
 * default address to advertise, a fresh epoch per start, whether memory
 * fits, and whether a process on this host is still there. */
#include "core/core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
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

/* MemAvailable of /proc/meminfo in bytes; false when it cannot be read. */
static bool mem_available(uint64_t *out)
{
	FILE *f = fopen("/proc/meminfo", "re");
	if (f == NULL)
		return false;
	char line[128];
	bool found = false;
	while (!found && fgets(line, sizeof(line), f) != NULL) {
		unsigned long long kb;
		if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
			*out = (uint64_t)kb * 1024u;
			found = true;
		}
	}
	fclose(f);
	return found;
}

/* Reads the start of the small file at path into buf (NUL-terminated);
 * false when it cannot be read or is empty. */
static bool read_small(const char *path, char *buf, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	ssize_t n = read(fd, buf, len - 1);
	close(fd);
	if (n <= 0)
		return false;
	buf[n] = '\0';
	return true;
}

/* The first number in file dir/name ("max" reads as UINT64_MAX), or
 * false. */
static bool read_u64(const char *dir, const char *name, uint64_t *out)
{
	char path[4200], buf[64];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	if (!read_small(path, buf, sizeof(buf)))
		return false;
	unsigned long long v;
	if (strncmp(buf, "max", 3) == 0)
		*out = UINT64_MAX;
	else if (sscanf(buf, "%llu", &v) == 1)
		*out = v;
	else
		return false;
	return true;
}

/* The value of key in dir's memory.stat, or 0. */
static uint64_t memstat(const char *dir, const char *key)
{
	char path[4200], line[256];
	snprintf(path, sizeof(path), "%s/memory.stat", dir);
	FILE *f = fopen(path, "re");
	if (f == NULL)
		return 0;
	unsigned long long v = 0;
	size_t kl = strlen(key);
	while (fgets(line, sizeof(line), f) != NULL) {
		if (strncmp(line, key, kl) == 0 && line[kl] == ' ') {
			sscanf(line + kl, "%llu", &v);
			break;
		}
	}
	fclose(f);
	return (uint64_t)v;
}

/* The room left under a memory limit: limit less what is charged, with the
 * page cache counted as room (the kernel reclaims it first). */
static uint64_t room(uint64_t limit, uint64_t used, uint64_t cache)
{
	uint64_t held = used > cache ? used - cache : 0;
	return limit > held ? limit - held : 0;
}

/* The memory this process's control group lets it still charge (cgroup v2
 * memory.max less memory.current, the smallest along its ancestors; v1
 * the hierarchical limit less usage), with the group's path in where; false
 * where no limit applies or none can be read. A group not found at its
 * path (a cgroup namespace) is read at the mount's root. */
static bool cgroup_room(uint64_t *out, char *where, size_t wlen)
{
	FILE *f = fopen("/proc/self/cgroup", "re");
	if (f == NULL)
		return false;
	char line[4096], v1[4096] = "", v2[4096] = "";
	bool has_v1 = false, has_v2 = false;
	while (fgets(line, sizeof(line), f) != NULL) {
		line[strcspn(line, "\n")] = '\0';
		char *c1 = strchr(line, ':');
		char *c2 = c1 != NULL ? strchr(c1 + 1, ':') : NULL;
		if (c2 == NULL)
			continue;
		*c2 = '\0';
		const char *ctl = c1 + 1, *path = c2 + 1;
		if (strcmp(line, "0") == 0 && ctl[0] == '\0') {
			has_v2 = true;
			ecx_strlcpy(v2, path, sizeof(v2));
			continue;
		}
		/* v1: "memory" among the comma-separated controllers. */
		for (const char *t = ctl; *t != '\0';) {
			size_t n = strcspn(t, ",");
			if (n == 6 && strncmp(t, "memory", 6) == 0) {
				has_v1 = true;
				ecx_strlcpy(v1, path, sizeof(v1));
			}
			t += n + (t[n] == ',');
		}
	}
	fclose(f);
	char dir[4200];
	struct stat st;
	bool found = false;
	uint64_t best = UINT64_MAX;
	if (has_v1) {
		snprintf(dir, sizeof(dir), "/sys/fs/cgroup/memory%s", v1);
		if (stat(dir, &st) != 0)
			snprintf(dir, sizeof(dir), "/sys/fs/cgroup/memory");
		uint64_t lim = memstat(dir, "hierarchical_memory_limit"), use;
		if (lim == 0)
			(void)read_u64(dir, "memory.limit_in_bytes", &lim);
		/* v1 reads "no limit" as a huge page-aligned number. */
		if (lim != 0 && lim < (UINT64_C(1) << 62) &&
		    read_u64(dir, "memory.usage_in_bytes", &use)) {
			best = room(lim, use, memstat(dir, "total_cache"));
			ecx_strlcpy(where, dir, wlen);
			found = true;
		}
	} else if (has_v2) {
		snprintf(dir, sizeof(dir), "/sys/fs/cgroup%s", v2);
		if (stat(dir, &st) != 0)
			snprintf(dir, sizeof(dir), "/sys/fs/cgroup");
		/* Up to the mount's root: a parent's limit holds too. */
		for (;;) {
			uint64_t lim, use;
			if (read_u64(dir, "memory.max", &lim) &&
			    lim != UINT64_MAX &&
			    read_u64(dir, "memory.current", &use)) {
				uint64_t r =
				    room(lim, use, memstat(dir, "file"));
				if (r < best) {
					best = r;
					ecx_strlcpy(where, dir, wlen);
				}
				found = true;
			}
			char *slash = strrchr(dir, '/');
			if (slash == NULL ||
			    slash - dir <= 14) /* /sys/fs/cgroup */
				break;
			*slash = '\0';
		}
	}
	*out = best;
	return found;
}

/* The free bytes of the file system at dir, or false. */
static bool fs_free(const char *dir, uint64_t *out)
{
	struct statvfs sv;
	if (statvfs(dir, &sv) != 0)
		return false;
	*out = (uint64_t)sv.f_bavail * sv.f_frsize;
	return true;
}

/* The largest System V segment this IPC namespace allows (shmmax, and
 * shmall pages), or false. */
static bool sysv_max(uint64_t *out)
{
	unsigned long long mx = 0, all = 0;
	FILE *f = fopen("/proc/sys/kernel/shmmax", "re");
	bool ok = f != NULL && fscanf(f, "%llu", &mx) == 1;
	if (f != NULL)
		fclose(f);
	f = fopen("/proc/sys/kernel/shmall", "re");
	ok = ok && f != NULL && fscanf(f, "%llu", &all) == 1;
	if (f != NULL)
		fclose(f);
	if (!ok)
		return false;
	uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
	uint64_t allb = all > UINT64_MAX / page ? UINT64_MAX : all * page;
	*out = mx < allb ? mx : allb;
	return true;
}

int ecx_mem_fits(const char *what, uint64_t len, const char *posix_dir,
                 bool *sysv, char *why, size_t whylen)
{
	uint64_t avail = 0, shm = 0, smax = 0;
	if (mem_available(&avail) && len > avail)
		return ecx_why(
		    why, whylen, ECX_ENOMEM,
		    "%s of %llu bytes (%.1f GiB) does not fit in "
		    "memory: %llu bytes (%.1f GiB) available "
		    "(MemAvailable, /proc/meminfo)",
		    what, (unsigned long long)len, (double)len / (1u << 30),
		    (unsigned long long)avail, (double)avail / (1u << 30));
	char where[4200];
	uint64_t cg = 0;
	if (cgroup_room(&cg, where, sizeof(where)) && len > cg)
		return ecx_why(
		    why, whylen, ECX_ENOMEM,
		    "%s of %llu bytes (%.1f GiB) does not fit in "
		    "memory: %llu bytes (%.1f GiB) left under the memory "
		    "limit of this process's control group (%s)",
		    what, (unsigned long long)len, (double)len / (1u << 30),
		    (unsigned long long)cg, (double)cg / (1u << 30), where);
	if (posix_dir != NULL && fs_free(posix_dir, &shm) && len > shm)
		return ecx_why(
		    why, whylen, ECX_ENOMEM,
		    "%s of %llu bytes (%.1f GiB) does not fit in "
		    "shared memory: %llu bytes (%.1f GiB) free in %s",
		    what, (unsigned long long)len, (double)len / (1u << 30),
		    (unsigned long long)shm, (double)shm / (1u << 30),
		    posix_dir);
	*sysv = !sysv_max(&smax) || len <= smax;
	return 0;
}

/* Reads process pid's state letter and start time from /proc/PID/stat;
 * false when it cannot. */
static bool pid_stat(long pid, char *state, uint64_t *start)
{
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
	if (!read_small(path, buf, sizeof(buf)))
		return false;
	/* The command may hold spaces and parentheses: fields count from the
	 * last ')'. The state is field 3, the first after it; the start time
	 * field 22, the 20th. */
	const char *s = strrchr(buf, ')');
	if (s == NULL || s[1] != ' ' || s[2] == '\0')
		return false;
	*state = s[2];
	for (int f = 0; f < 20 && s != NULL; f++)
		s = strchr(s + 1, ' ');
	unsigned long long v = 0;
	if (s == NULL || sscanf(s + 1, "%llu", &v) != 1)
		return false;
	*start = (uint64_t)v;
	return true;
}

uint64_t ecx_pid_start(long pid)
{
	char state;
	uint64_t start = 0;
	return pid_stat(pid, &state, &start) ? start : 0;
}

bool ecx_pid_exited(long pid, uint64_t start)
{
	char state = 0;
	uint64_t now = 0;
	if (!pid_stat(pid, &state, &now))
		return true;
	return now != start || state == 'Z' || state == 'X';
}

int ecx_pid_watch(long pid, uint64_t start)
{
	if (pid <= 0 || start == 0)
		return -1;
	int fd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
	if (fd < 0 && errno == ESRCH)
		return -2;
	if (fd < 0)
		return ecx_pid_exited(pid, start) ? -2 : -3;
	/* Read after the descriptor is open: a start time that matches then
	 * says the descriptor is that process's, not a later one's that got
	 * its number. */
	if (ecx_pid_start(pid) != start) {
		close(fd);
		return -2;
	}
	fcntl(fd, F_SETFD, FD_CLOEXEC);
	return fd;
}

bool ecx_pid_gone(int fd)
{
	struct pollfd pf = {.fd = fd, .events = POLLIN};
	return poll(&pf, 1, 0) == 1 && (pf.revents & (POLLIN | POLLHUP)) != 0;
}
