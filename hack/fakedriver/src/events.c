/* Event sets: XID critical errors and GPU recovery actions from the state's "events" list.
 *
 * `sharing sim xid` appends {"seq", "gpu", "xid", "gi", "ci"}; `sharing sim reset` appends
 * {"seq", "gpu", "recovered": true}. A set delivers each event once, in order, for the GPUs
 * registered on it, and only events raised after the registration (nvmlDeviceRegisterEvents: "All
 * events that occurred before this call are not recorded").
 */
#include <time.h>

#include "fake.h"

#define MAX_SETS 64
#define SET_MAGIC 0x45564e54u

struct event_set {
	uint32_t magic;
	int used;
	long long cursor;                /* last event seen */
	long long since[MAX_GPUS];       /* eventSeq at registration */
	unsigned long long mask[MAX_GPUS];
};

static struct event_set sets[MAX_SETS];

static struct event_set *set_of(nvmlEventSet_t handle)
{
	struct event_set *s = (struct event_set *)handle;
	if (s < sets || s >= sets + MAX_SETS || s->magic != SET_MAGIC || !s->used)
		return NULL;
	return s;
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
	ENTER();
	if (!set)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	for (int i = 0; i < MAX_SETS; i++)
		if (!sets[i].used) {
			sets[i] = (struct event_set){.magic = SET_MAGIC, .used = 1,
						     .cursor = fake_int(fake_state(), "eventSeq", 0)};
			*set = (nvmlEventSet_t)&sets[i];
			RETURN(NVML_SUCCESS);
		}
	RETURN(NVML_ERROR_UNKNOWN);
}

/* XIDs always; recovery-action events only on the current branch (nvmlEventTypeGpuRecoveryAction
 * is new in the R575 headers). NOT_SUPPORTED "if the platform does not support this feature or some
 * of requested event types", and then "None of the requested eventTypes are registered". Events are
 * registered on the GPU: "This API does not currently support per-instance event reporting using
 * MIG device handles" (nvmlEventSetWait_v2). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
	ENTER();
	struct event_set *s = set_of(set);
	if (!s || (eventTypes & ~(unsigned long long)nvmlEventTypeAll))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (ci)
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	unsigned long long supported = nvmlEventTypeXidCriticalError;
	if (!fake_old_branch(state))
		supported |= nvmlEventTypeGpuRecoveryAction;
	if (eventTypes & ~supported)
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	int index = (int)fake_int(gpu, "index", 0);
	if (!s->mask[index])
		s->since[index] = fake_int(state, "eventSeq", 0);
	s->mask[index] |= eventTypes;
	RETURN(NVML_SUCCESS);
}

static int next_event(struct event_set *s, json_t *state, nvmlEventData_t *data)
{
	size_t i;
	json_t *e;
	json_array_foreach(json_object_get(state, "events"), i, e) {
		long long seq = fake_int(e, "seq", 0);
		if (seq <= s->cursor)
			continue;
		s->cursor = seq;
		int gpu = (int)fake_int(e, "gpu", -1);
		if (gpu < 0 || gpu >= MAX_GPUS || seq <= s->since[gpu])
			continue;
		data->device = (nvmlDevice_t)fake_handle(K_GPU, gpu, 0, 0);
		if (fake_bool(e, "recovered") && (s->mask[gpu] & nvmlEventTypeGpuRecoveryAction)) {
			/* The GPU needs no action any more (nvmlDeviceGetRecoveryAction_t: NVML_GPU_RECOVERY_ACTION_NONE). */
			*data = (nvmlEventData_t){data->device, nvmlEventTypeGpuRecoveryAction,
						  NVML_GPU_RECOVERY_ACTION_NONE, NA, NA};
			return 1;
		}
		if (json_object_get(e, "xid") && (s->mask[gpu] & nvmlEventTypeXidCriticalError)) {
			/* nvmlEventData_st: gpuInstanceId/computeInstanceId "set to 0xFFFFFFFF otherwise". */
			json_t *g = json_object_get(e, "gi"), *c = json_object_get(e, "ci");
			*data = (nvmlEventData_t){data->device, nvmlEventTypeXidCriticalError,
						  (unsigned long long)fake_int(e, "xid", 999),
						  json_is_integer(g) ? (unsigned int)json_integer_value(g) : NA,
						  json_is_integer(c) ? (unsigned int)json_integer_value(c) : NA};
			return 1;
		}
	}
	return 0;
}

/* "If some events are ready to be delivered at the time of the call, function returns immediately.
 * If there are no events ready to be delivered, function sleeps till event arrives but not longer
 * than specified timeout"; TIMEOUT "if no event arrived in specified timeout". The state is polled
 * every 10 ms with the library lock released, so other threads' calls go on meanwhile. */
FAKE_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
	ENTER();
	struct event_set *s = set_of(set);
	if (!s || !data)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	struct timespec start, now, pause = {0, 10 * 1000 * 1000};
	clock_gettime(CLOCK_MONOTONIC, &start);
	for (;;) {
		json_t *state = fake_state();
		if (state && next_event(s, state, data))
			RETURN(NVML_SUCCESS);
		clock_gettime(CLOCK_MONOTONIC, &now);
		long long waited = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
		if (waited >= timeoutms)
			RETURN(NVML_ERROR_TIMEOUT);
		fake_leave();
		nanosleep(&pause, NULL);
		fake_enter();
		if (!set_of(set))
			RETURN(NVML_ERROR_INVALID_ARGUMENT); /* freed by another thread meanwhile */
	}
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
	ENTER();
	struct event_set *s = set_of(set);
	if (!s)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	s->used = 0;
	RETURN(NVML_SUCCESS);
}
