/* What the fake nvidia-cuda-mps-control daemons (mpsctl.c) tell the library: their MPS servers and
 * clients, per GPU.
 *
 * Each daemon writes <state dir>/mps/<pid>.json (replaced by rename, so a reader sees one whole
 * version) and holds an exclusive flock on <pid>.lock while it lives. A record whose lock this
 * process can take belongs to a daemon that is gone (killed without cleaning up): it is ignored,
 * whatever PID namespace the daemon ran in.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "fake.h"

static int alive(const char *dir, const char *pid)
{
	char lock[PATH_BUF];
	snprintf(lock, sizeof lock, "%s/%s.lock", dir, pid);
	int fd = open(lock, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	int taken = flock(fd, LOCK_SH | LOCK_NB) == 0;
	close(fd); /* closing drops a lock taken here */
	return !taken;
}

int fake_mps_serving(const char *uuid)
{
	unsigned int servers[MAX_MPS_PIDS], clients[MAX_MPS_PIDS], nservers = 0;
	fake_mps_processes(uuid, servers, &nservers, clients, MAX_MPS_PIDS);
	return nservers > 0;
}

int fake_mps_processes(const char *uuid, unsigned int *servers, unsigned int *nservers, unsigned int *clients,
		       unsigned int max)
{
	char dir[PATH_BUF];
	snprintf(dir, sizeof dir, "%s", fake_state_path());
	char *slash = strrchr(dir, '/');
	if (slash)
		*slash = '\0';
	else
		snprintf(dir, sizeof dir, ".");
	snprintf(dir + strlen(dir), sizeof dir - strlen(dir), "/mps");
	unsigned int n = 0;
	*nservers = 0;
	DIR *d = opendir(dir);
	if (!d)
		return 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		size_t len = strlen(e->d_name);
		if (e->d_name[0] == '.' || len < 6 || strcmp(e->d_name + len - 5, ".json") != 0)
			continue;
		char pid[NAME_MAX + 1];
		snprintf(pid, sizeof pid, "%.*s", (int)(len - 5), e->d_name);
		if (!alive(dir, pid))
			continue;
		char path[PATH_BUF];
		snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
		json_t *record = json_load_file(path, 0, NULL);
		if (!record)
			continue;
		int serves = 0;
		size_t i;
		json_t *v;
		json_array_foreach(json_object_get(record, "gpus"), i, v) serves |= strcmp(json_string_value(v) ? json_string_value(v) : "", uuid) == 0;
		long long server = fake_int(record, "serverPid", 0);
		if (serves && server > 0) {
			if (*nservers < max)
				servers[(*nservers)++] = (unsigned int)server;
			json_array_foreach(json_object_get(record, "clients"), i, v) if (n < max && json_is_integer(v))
				clients[n++] = (unsigned int)json_integer_value(v);
		}
		json_decref(record);
	}
	closedir(d);
	return (int)n;
}
