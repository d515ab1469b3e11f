/* The fake NVIDIA driver's internals: the state file, handles, the files a driver brings.
 *
 * Every NVML entry point takes the library lock (fake_enter), reads the state through
 * fake_state() (re-parsed only when the file changed) or changes it through
 * fake_mutate_begin/fake_mutate_end (an exclusive flock on the sibling ".lock", the same lock
 * sharing/gpu/simstate.py takes; write a temporary file, rename). The schema is in ../README.md.
 */
#ifndef FAKE_H
#define FAKE_H

#include <jansson.h>
#include <stdint.h>

#include "nvml.h"

#define FAKE_EXPORT __attribute__((visibility("default")))
#define MAX_GPUS 64
#define MAX_GI 16 /* GPU instance ids 0..14 on every MIG product (nvidia-caps: 15 per GPU) */
#define MAX_CI 8  /* compute instance ids 0..7 per GPU instance */
#define PATH_BUF 8192 /* room for a path plus what is appended to it */
#define NA 0xFFFFFFFFu /* nvml.h nvmlProcessInfo_v2_st / nvmlEventData_st: "0xFFFFFFFF otherwise" */

enum kind { K_GPU = 1, K_GI, K_CI, K_MIG, K_EVENTS };

/* What an opaque NVML handle points at. One static object per (kind, gpu, gi, ci), so a handle
 * stays the same pointer for the life of the process and across state re-reads; whether the
 * thing it names still exists is checked against the state on every call. */
struct fake_handle {
	uint32_t magic;
	int kind;
	int gpu;
	int gi;
	int ci;
};

/* library: lock, initialisation count, personality */
void fake_enter(void);
void fake_leave(void);
int fake_initialised(void);
void fake_count_init(int delta);
void fake_delay(const char *call); /* the call's latency from the state, slept unlocked (README) */
void fake_count_call(void); /* FAKE_NVML_COUNTERS: see state.c */
#define ENTER()                                                                                    \
	do {                                                                                       \
		fake_enter();                                                                      \
		fake_count_call();                                                                 \
		if (!fake_initialised()) {                                                         \
			fake_leave();                                                              \
			return NVML_ERROR_UNINITIALIZED;                                           \
		}                                                                                  \
		fake_delay(__func__);                                                              \
	} while (0)
#define RETURN(code)                                                                               \
	do {                                                                                       \
		nvmlReturn_t rc_ = (code);                                                         \
		fake_leave();                                                                      \
		return rc_;                                                                        \
	} while (0)

/* state */
nvmlReturn_t fake_load_initial(void);
json_t *fake_state(void); /* the current state (borrowed; NULL: unreadable) */
json_t *fake_mutate_begin(void); /* gate, lock, fresh state; NULL: unreadable (lock released) */
void fake_mutate_end(json_t *state, int changed); /* count, write, unlock */
const char *fake_str(json_t *obj, const char *key, const char *fallback);
long long fake_int(json_t *obj, const char *key, long long fallback);
int fake_bool(json_t *obj, const char *key);
int fake_old_branch(json_t *state); /* personality "r535": see README */
long long fake_first_event(void);

/* handles */
struct fake_handle *fake_handle(int kind, int gpu, int gi, int ci);
struct fake_handle *fake_check(const void *handle); /* NULL: not one of ours */
json_t *fake_gpu(json_t *state, int index);        /* NULL: no such GPU */
json_t *fake_gi(json_t *gpu, int id);
json_t *fake_ci(json_t *gi, int id);
/* Resolve a GPU or MIG-device handle: NVML_SUCCESS, INVALID_ARGUMENT, NOT_FOUND or GPU_IS_LOST. */
nvmlReturn_t fake_device(const void *handle, json_t *state, json_t **gpu, json_t **gi, json_t **ci);

/* MIG */
json_t *fake_profile_by_id(json_t *gpu, long long id); /* from the GPU's "mig" table */
void fake_engines(json_t *profile, unsigned int out[5]); /* copy, decoder, encoder, jpeg, ofa */
/* A GPU- or compute-instance handle (kind K_GI or K_CI) whose instance still exists. */
nvmlReturn_t fake_instance(const void *handle, int kind, json_t *state, json_t **gpu, json_t **gi, json_t **ci);
int fake_mig_enabled(json_t *gpu);
int fake_gpu_busy(json_t *gpu); /* processes on the GPU itself or on any of its MIG devices */
void fake_mig_uuid(json_t *state, char *out, size_t size);

/* What runs on the GPUs (usage.c): the state's "processes" of each device, and MPS servers. */
#define MAX_PROCESSES 512
struct fake_process {
	unsigned int pid;
	unsigned long long used; /* bytes */
	unsigned int sm;         /* percent */
	unsigned int gi, ci;     /* NA outside MIG */
};
int fake_has_processes(json_t *device); /* a GPU's or a compute instance's own "processes" */
/* The compute processes of a MIG device (ci), or of a GPU with those of all its MIG devices. */
unsigned int fake_processes(json_t *gpu, json_t *gi, json_t *ci, struct fake_process *list, unsigned int max);
double fake_activity(json_t *gpu, json_t *gi); /* percent of the SMs busy: a GPU instance, or the GPU */

/* In an NVML function: resolve a whole-GPU handle into `state` and `gpu`, or return. */
#define GPU_OR_RETURN(handle)                                                                      \
	json_t *state = fake_state(), *gpu, *gi_, *ci_;                                            \
	nvmlReturn_t rc = fake_device((handle), state, &gpu, &gi_, &ci_);                          \
	if (rc != NVML_SUCCESS)                                                                    \
		RETURN(rc);                                                                        \
	if (ci_)                                                                                   \
		RETURN(NVML_ERROR_INVALID_ARGUMENT);

/* the files a driver brings */
void fake_sync_files(json_t *state, json_t *before); /* before: the state last synced, or NULL */
const char *fake_root(void);
const char *fake_state_path(void);

/* MPS: the records of live control daemons (mps.c) */
#define MAX_MPS_PIDS 64
/* The MPS server and client PIDs of the live daemons serving GPU `uuid`; returns the client count. */
int fake_mps_processes(const char *uuid, unsigned int *servers, unsigned int *nservers, unsigned int *clients, unsigned int max);
/* Whether an MPS server of a live daemon runs on the device `uuid` (a GPU's or a MIG device's). */
int fake_mps_serving(const char *uuid);

#endif
