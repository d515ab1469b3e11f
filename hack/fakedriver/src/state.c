/* The state file under its lock, the library lock, handles, and the crash and gate test hooks.
 *
 * Reads never lock: every writer (this library, sharing/gpu/simstate.py) replaces the file by a
 * rename, so an open() sees one whole version, and an unchanged (inode, mtime, ctime, size) means
 * unchanged content: an idle poll costs one stat(), not a JSON parse. Writes take the exclusive
 * flock on "<state>.lock" that simstate.locked() takes, re-read, change, write ".<name>.tmp" and
 * rename it over the state.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"

#define MAGIC 0x4e564d4cu /* "NVML" */

static pthread_mutex_t lib_lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static long long first_event;
static char state_path[PATH_BUF];
static char root_path[PATH_BUF];
static json_t *cached;
static struct stat cached_id;
static int lock_fd = -1;
static long process_mutations;

static struct fake_handle gpus[MAX_GPUS];
static struct fake_handle gis[MAX_GPUS][MAX_GI];
static struct fake_handle cis[MAX_GPUS][MAX_GI][MAX_CI];
static struct fake_handle migs[MAX_GPUS][MAX_GI][MAX_CI];

/* FAKE_NVML_COUNTERS=PATH, a bench hook: two uint64 at the start of PATH (created, mapped shared)
 * count the calls this process made into the library and the CPU time (CLOCK_THREAD_CPUTIME_ID,
 * ns) its threads spent inside it, so a bench can tell the caller's own CPU from the fake driver's
 * JSON work, which a real driver does not do. Updated under the library lock; unset: no cost but
 * one branch. */
static uint64_t *counters;
static int counters_checked;
static __thread struct timespec clocked_in;

static void map_counters(void)
{
	counters_checked = 1;
	const char *path = getenv("FAKE_NVML_COUNTERS");
	if (!path || !*path)
		return;
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	struct stat st;
	if (fstat(fd, &st) == 0 && (st.st_size >= 16 || ftruncate(fd, 16) == 0)) {
		void *p = mmap(NULL, 16, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p != MAP_FAILED)
			counters = p;
	}
	close(fd);
}

void fake_enter(void)
{
	pthread_mutex_lock(&lib_lock);
	if (!counters_checked)
		map_counters();
	if (counters)
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &clocked_in);
}

void fake_leave(void)
{
	if (counters) {
		struct timespec now;
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
		counters[1] += (uint64_t)((now.tv_sec - clocked_in.tv_sec) * 1000000000LL +
					  (now.tv_nsec - clocked_in.tv_nsec));
	}
	pthread_mutex_unlock(&lib_lock);
}

void fake_count_call(void)
{
	if (counters)
		counters[0]++;
}
int fake_initialised(void) { return init_count > 0; }
void fake_count_init(int delta) { init_count += delta; }
long long fake_first_event(void) { return first_event; }
const char *fake_root(void) { return root_path; }

/* The state's "latencies" ({"<exported NVML symbol>": seconds}): the call sleeps that long before
 * it does anything, as a driver call that waits on the hardware does. The library lock is released
 * meanwhile, so other threads' calls go on (README.md, "Latencies"). __func__ is the symbol: nvml.h's
 * #defines (nvmlDeviceGetHandleByIndex -> ..._v2) rename the definitions too. Read from the state as
 * last parsed, without the stat() that checks for a newer one (it would double an idle call's cost):
 * the call itself reads the state, so a change counts from this process's next call on. */
void fake_delay(const char *call)
{
	json_t *seconds = json_object_get(json_object_get(cached, "latencies"), call);
	double s = json_is_number(seconds) ? json_number_value(seconds) : 0.0;
	if (!(s > 0.0))
		return;
	struct timespec pause = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
	fake_leave();
	while (nanosleep(&pause, &pause) != 0 && errno == EINTR)
		;
	fake_enter();
}
const char *fake_state_path(void) { return state_path; }

static int ends_with(const char *s, const char *suffix)
{
	size_t n = strlen(s), m = strlen(suffix);
	return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* The state: $FAKE_NVML_STATE, else <driver root>/var/lib/fake-nvidia/gpus.json where the driver
 * root is the directory above usr/lib/x86_64-linux-gnu/ holding this library (dladdr), so in a
 * container nothing but the driver's own files says where its GPUs are. The files it makes go
 * under $FAKE_NVML_ROOT, else the root the state file lies in (see README.md). */
static void find_paths(void)
{
	const char *env = getenv("FAKE_NVML_STATE");
	const char *suffix = "/var/lib/fake-nvidia/gpus.json";
	if (env && *env) {
		snprintf(state_path, sizeof state_path, "%s", env);
	} else {
		Dl_info info;
		char lib[PATH_BUF] = ".";
		if (dladdr((void *)&fake_enter, &info) && info.dli_fname)
			snprintf(lib, sizeof lib, "%s", info.dli_fname);
		char *slash = strrchr(lib, '/');
		if (slash)
			*slash = '\0';
		/* the directory canonical (nvidia-smi finds the library as $ORIGIN/../lib/...), the
		 * file not: a linked-in library belongs to the root it is linked into */
		char dir[PATH_BUF];
		if (realpath(lib, dir))
			snprintf(lib, sizeof lib, "%s", dir);
		if (ends_with(lib, "/usr/lib/x86_64-linux-gnu"))
			lib[strlen(lib) - strlen("/usr/lib/x86_64-linux-gnu")] = '\0';
		snprintf(state_path, sizeof state_path, "%s%s", lib, suffix);
	}
	const char *root = getenv("FAKE_NVML_ROOT");
	if (root && *root) {
		snprintf(root_path, sizeof root_path, "%s", root);
	} else if (ends_with(state_path, suffix)) {
		snprintf(root_path, sizeof root_path, "%.*s", (int)(strlen(state_path) - strlen(suffix)),
			 state_path);
	} else {
		snprintf(root_path, sizeof root_path, "%s", state_path);
		char *slash = strrchr(root_path, '/');
		if (slash)
			*slash = '\0';
		else
			snprintf(root_path, sizeof root_path, ".");
	}
}

static int same_file(const struct stat *a, const struct stat *b)
{
	return a->st_ino == b->st_ino && a->st_size == b->st_size &&
	       a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
	       a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

/* The whole file in one read, then parsed: jansson's json_loadfd reads one byte per read() call,
 * which made every parse of a fleet node's state thousands of system calls. */
static json_t *parse(struct stat *id)
{
	int fd = open(state_path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return NULL;
	json_t *state = NULL;
	char *text = NULL;
	if (fstat(fd, id) == 0 && id->st_size > 0 && (text = malloc((size_t)id->st_size)) != NULL) {
		size_t got = 0, size = (size_t)id->st_size;
		ssize_t n;
		while (got < size && (n = read(fd, text + got, size - got)) > 0)
			got += (size_t)n;
		if (got == size)
			state = json_loadb(text, size, 0, NULL);
		free(text);
	}
	close(fd);
	if (state && !json_is_array(json_object_get(state, "gpus"))) {
		json_decref(state);
		state = NULL;
	}
	return state;
}

json_t *fake_state(void)
{
	struct stat now;
	if (cached && stat(state_path, &now) == 0 && same_file(&now, &cached_id))
		return cached;
	struct stat id;
	json_t *state = parse(&id);
	if (!state)
		return NULL;
	fake_sync_files(state, cached); /* another process (`sharing sim reset`) may have changed instances */
	json_decref(cached);
	cached = state;
	cached_id = id;
	return cached;
}

nvmlReturn_t fake_load_initial(void)
{
	if (!state_path[0])
		find_paths();
	json_t *state = fake_state();
	if (!state)
		return NVML_ERROR_DRIVER_NOT_LOADED; /* no GPUs: as when the kernel module is missing */
	first_event = fake_int(state, "eventSeq", 0);
	return NVML_SUCCESS;
}

/* SHARING_SIM_GATE=PATH: before a change, write PATH.waiting and wait (up to 120 s) for PATH to
 * appear, consume it, go on: the protocol of sharing/gpu/simstate.py pass_gate(). */
static void pass_gate(void)
{
	const char *gate = getenv("SHARING_SIM_GATE");
	if (!gate || !*gate)
		return;
	char waiting[PATH_BUF];
	snprintf(waiting, sizeof waiting, "%s.waiting", gate);
	FILE *f = fopen(waiting, "w");
	if (f) {
		fprintf(f, "%d", (int)getpid());
		fclose(f);
	}
	struct timespec start, now, pause = {0, 10 * 1000 * 1000};
	clock_gettime(CLOCK_MONOTONIC, &start);
	while (unlink(gate) != 0 && errno == ENOENT) {
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec - start.tv_sec > 120)
			break;
		nanosleep(&pause, NULL); /* the gate is a file another process makes: nothing to wait on */
	}
	unlink(waiting);
}

json_t *fake_mutate_begin(void)
{
	fake_leave(); /* other threads' calls go on while a change waits at the gate */
	pass_gate();
	fake_enter();
	char lock[PATH_BUF];
	snprintf(lock, sizeof lock, "%s.lock", state_path);
	lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
	if (lock_fd < 0)
		return NULL;
	if (flock(lock_fd, LOCK_EX) != 0) {
		close(lock_fd);
		lock_fd = -1;
		return NULL;
	}
	struct stat id;
	json_t *state = parse(&id);
	if (!state) {
		close(lock_fd);
		lock_fd = -1;
	}
	return state;
}

/* Count the call ("mutatingCalls") and, if it changed the hardware, the change ("mutations"), as
 * sharing/gpu/simstate.py counters() reads them; write; unlock. SHARING_SIM_CRASH_AFTER=N kills the process
 * (exit 137) right after its N-th change, for the crash-recovery tests. */
void fake_mutate_end(json_t *state, int changed)
{
	json_object_set_new(state, "mutatingCalls", json_integer(fake_int(state, "mutatingCalls", 0) + 1));
	if (changed)
		json_object_set_new(state, "mutations", json_integer(fake_int(state, "mutations", 0) + 1));
	char tmp[PATH_BUF];
	const char *slash = strrchr(state_path, '/');
	if (slash)
		snprintf(tmp, sizeof tmp, "%.*s/.%s.tmp", (int)(slash - state_path), state_path, slash + 1);
	else
		snprintf(tmp, sizeof tmp, ".%s.tmp", state_path);
	if (json_dump_file(state, tmp, JSON_COMPACT) == 0 && rename(tmp, state_path) == 0) {
		fake_sync_files(state, cached);
		json_decref(cached);
		cached = state;
		stat(state_path, &cached_id);
	} else {
		json_decref(state);
	}
	close(lock_fd);
	lock_fd = -1;
	if (changed) {
		process_mutations++;
		const char *crash = getenv("SHARING_SIM_CRASH_AFTER");
		if (crash && *crash && atol(crash) == process_mutations)
			_exit(137);
	}
}

const char *fake_str(json_t *obj, const char *key, const char *fallback)
{
	const char *s = json_string_value(json_object_get(obj, key));
	return s ? s : fallback;
}

long long fake_int(json_t *obj, const char *key, long long fallback)
{
	json_t *v = json_object_get(obj, key);
	return json_is_integer(v) ? json_integer_value(v) : fallback;
}

int fake_bool(json_t *obj, const char *key) { return json_is_true(json_object_get(obj, key)); }

int fake_old_branch(json_t *state) { return strcmp(fake_str(state, "personality", "r580"), "r535") == 0; }

/* ---- handles ---------------------------------------------------------------------------------- */

struct fake_handle *fake_handle(int kind, int gpu, int gi, int ci)
{
	if (gpu < 0 || gpu >= MAX_GPUS || gi < 0 || gi >= MAX_GI || ci < 0 || ci >= MAX_CI)
		return NULL;
	struct fake_handle *h = kind == K_GPU  ? &gpus[gpu]
				: kind == K_GI ? &gis[gpu][gi]
				: kind == K_CI ? &cis[gpu][gi][ci]
					       : &migs[gpu][gi][ci];
	*h = (struct fake_handle){MAGIC, kind, gpu, gi, ci};
	return h;
}

static int within(const void *p, const void *base, size_t size)
{
	return (const char *)p >= (const char *)base && (const char *)p < (const char *)base + size;
}

struct fake_handle *fake_check(const void *handle)
{
	if (!handle || !(within(handle, gpus, sizeof gpus) || within(handle, gis, sizeof gis) ||
			 within(handle, cis, sizeof cis) || within(handle, migs, sizeof migs)))
		return NULL;
	struct fake_handle *h = (struct fake_handle *)handle;
	return h->magic == MAGIC ? h : NULL;
}

json_t *fake_gpu(json_t *state, int index)
{
	json_t *list = json_object_get(state, "gpus");
	return index >= 0 && (size_t)index < json_array_size(list) ? json_array_get(list, index) : NULL;
}

static json_t *by_id(json_t *list, int id)
{
	size_t i;
	json_t *item;
	json_array_foreach(list, i, item) if (fake_int(item, "id", -1) == id) return item;
	return NULL;
}

json_t *fake_gi(json_t *gpu, int id) { return by_id(json_object_get(gpu, "gpuInstances"), id); }
json_t *fake_ci(json_t *gi, int id) { return by_id(json_object_get(gi, "computeInstances"), id); }

nvmlReturn_t fake_device(const void *handle, json_t *state, json_t **gpu, json_t **gi, json_t **ci)
{
	struct fake_handle *h = fake_check(handle);
	if (!h || (h->kind != K_GPU && h->kind != K_MIG) || !state)
		return NVML_ERROR_INVALID_ARGUMENT;
	*gpu = fake_gpu(state, h->gpu);
	*gi = *ci = NULL;
	if (!*gpu)
		return NVML_ERROR_INVALID_ARGUMENT;
	/* nvml.h: GPU_IS_LOST "if the target GPU has fallen off the bus or is otherwise inaccessible" */
	if (fake_bool(*gpu, "lost"))
		return NVML_ERROR_GPU_IS_LOST;
	if (h->kind == K_MIG) {
		*gi = fake_gi(*gpu, h->gi);
		*ci = *gi ? fake_ci(*gi, h->ci) : NULL;
		if (!*ci)
			return NVML_ERROR_INVALID_ARGUMENT; /* the MIG device was destroyed: a stale handle */
	}
	return NVML_SUCCESS;
}
