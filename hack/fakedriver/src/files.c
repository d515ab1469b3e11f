/* The files a driver brings, under the driver root, kept in step with the state.
 *
 * Layout of the NVIDIA driver (MIG user guide, "Device Nodes and Capabilities",
 * https://docs.nvidia.com/datacenter/tesla/mig-user-guide/device-nodes-and-capabilities.html):
 * /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools, /dev/nvidia<minor> per GPU, and per MIG
 * instance /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access and .../gi<g>/ci<c>/access
 * holding "DeviceFileMinor: N", the minor of /dev/nvidia-caps/nvidia-cap<N> (plus mig/config and
 * mig/monitor). The numbers follow the order of the driver's /proc/driver/nvidia-caps/mig-minors
 * (config 1, monitor 2, then per GPU 15 GPU instances of 1 + 8 minors each, from 3); readers take
 * them from the access files, never from this formula.
 * Device nodes are character devices with /dev/null's numbers (1, 3): harmless stand-ins, made where
 * the process may mknod and skipped quietly elsewhere (the /proc files are plain files).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "fake.h"

static void mkdirs(const char *path)
{
	char buf[PATH_BUF];
	snprintf(buf, sizeof buf, "%s", path);
	for (char *p = buf + 1; *p; p++)
		if (*p == '/') {
			*p = '\0';
			mkdir(buf, 0755);
			*p = '/';
		}
	mkdir(buf, 0755);
}

static void node(const char *name)
{
	char path[PATH_BUF];
	struct stat st;
	snprintf(path, sizeof path, "%s/dev/%s", fake_root(), name);
	if (lstat(path, &st) == 0)
		return;
	char dir[PATH_BUF];
	snprintf(dir, sizeof dir, "%s", path);
	*strrchr(dir, '/') = '\0';
	mkdirs(dir);
	if (mknod(path, S_IFCHR | 0666, makedev(1, 3)) != 0 && errno != EEXIST)
		return; /* not allowed here (no CAP_MKNOD): no stand-in */
}

static void cap_file(const char *dir, unsigned int minor)
{
	char path[PATH_BUF];
	struct stat st;
	snprintf(path, sizeof path, "%s/access", dir);
	if (stat(path, &st) == 0)
		return;
	mkdirs(dir);
	FILE *f = fopen(path, "w");
	if (f) {
		/* the three lines the driver writes; mode 0444 (292): "world-readable" monitor-style access */
		fprintf(f, "DeviceFileMinor: %u\nDeviceFileMode: 292\nDeviceFileModify: 1\n", minor);
		fclose(f);
	}
	char name[64];
	snprintf(name, sizeof name, "nvidia-caps/nvidia-cap%u", minor);
	node(name);
}

static void drop_cap(const char *dir, unsigned int minor)
{
	char path[PATH_BUF];
	snprintf(path, sizeof path, "%s/access", dir);
	unlink(path);
	rmdir(dir);
	snprintf(path, sizeof path, "%s/dev/nvidia-caps/nvidia-cap%u", fake_root(), minor);
	unlink(path);
}

static unsigned int gi_minor(int gpu, int gi) { return 3u + (unsigned int)gpu * 135u + (unsigned int)gi * 9u; }

/* The same GPU with the same instances in both states: its files were made when `before` was read. */
static int unchanged(json_t *gpu, json_t *before, size_t i)
{
	json_t *old = before ? fake_gpu(before, (int)i) : NULL;
	return old && fake_int(old, "minor", -1) == fake_int(gpu, "minor", -1) &&
	       fake_int(old, "index", -1) == fake_int(gpu, "index", -1) &&
	       json_equal(json_object_get(old, "gpuInstances"), json_object_get(gpu, "gpuInstances"));
}

void fake_sync_files(json_t *state, json_t *before)
{
	char dir[PATH_BUF], sub[PATH_BUF];
	struct stat st;
	node("nvidiactl");
	node("nvidia-uvm");
	node("nvidia-uvm-tools");
	snprintf(dir, sizeof dir, "%s/proc/driver/nvidia/capabilities/mig/config", fake_root());
	cap_file(dir, 1);
	snprintf(dir, sizeof dir, "%s/proc/driver/nvidia/capabilities/mig/monitor", fake_root());
	cap_file(dir, 2);
	size_t i;
	json_t *gpu;
	json_array_foreach(json_object_get(state, "gpus"), i, gpu) {
		if (unchanged(gpu, before, i))
			continue; /* a stat() per possible instance of every GPU was most of a change's cost */
		int minor = (int)fake_int(gpu, "minor", fake_int(gpu, "index", (json_int_t)i));
		char name[32];
		snprintf(name, sizeof name, "nvidia%d", minor);
		node(name);
		for (int g = 0; g < MAX_GI - 1; g++) {
			json_t *gi = fake_gi(gpu, g);
			snprintf(dir, sizeof dir, "%s/proc/driver/nvidia/capabilities/gpu%d/mig/gi%d", fake_root(), minor, g);
			if (!gi && stat(dir, &st) != 0)
				continue;
			if (gi)
				cap_file(dir, gi_minor(minor, g));
			for (int c = 0; c < MAX_CI; c++) {
				snprintf(sub, sizeof sub, "%s/ci%d", dir, c);
				if (gi && fake_ci(gi, c))
					cap_file(sub, gi_minor(minor, g) + 1 + (unsigned int)c);
				else if (stat(sub, &st) == 0)
					drop_cap(sub, gi_minor(minor, g) + 1 + (unsigned int)c);
			}
			if (!gi)
				drop_cap(dir, gi_minor(minor, g));
		}
	}
}
