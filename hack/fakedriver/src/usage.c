/* What the GPUs are doing: compute processes, memory, utilization, power and temperature.
 *
 * The state lists the processes of each device ("processes" of a GPU without MIG, of each compute
 * instance of a GPU in MIG mode: {"pid", "usedMiB", "sm"}; `sharing sim busy`), and each GPU's
 * "powerWatts" and "temperatureC" (`sharing sim sensors`). Everything here is derived from those,
 * with the rules of each function's doc comment in nvml.h (quoted where applied). GPM: gpm.c.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fake.h"

#define DEFAULT_POWER_W 60.0 /* an idle data-center GPU's draw; `sharing sim sensors` sets it */
#define DEFAULT_TEMPERATURE_C 35
#define SAMPLE_PERIOD_US 166667ull /* nvmlDeviceGetUtilizationRates: a sample period "between 1 second and 1/6 second" */

int fake_has_processes(json_t *device) { return json_array_size(json_object_get(device, "processes")) > 0; }

static void add(struct fake_process *list, unsigned int *n, unsigned int max, unsigned int pid,
		unsigned long long used, unsigned int sm, unsigned int gi, unsigned int ci)
{
	if (*n < max)
		list[(*n)++] = (struct fake_process){pid, used, sm, gi, ci};
}

/* The state's processes of one device (a GPU or a compute instance), then the MPS servers of the
 * live daemons bound to it (an MPS server is a compute process of its device, as nvidia-smi lists
 * `nvidia-cuda-mps-server`, type "M+C"; its clients: nvmlDeviceGetMPSComputeRunningProcesses). */
static void of_device(json_t *device, unsigned int gi, unsigned int ci, struct fake_process *list, unsigned int *n,
		      unsigned int max)
{
	size_t i;
	json_t *p;
	json_array_foreach(json_object_get(device, "processes"), i, p) {
		long long sm = fake_int(p, "sm", 0);
		add(list, n, max, (unsigned int)fake_int(p, "pid", 0), (unsigned long long)fake_int(p, "usedMiB", 0) << 20,
		    (unsigned int)(sm < 0 ? 0 : sm > 100 ? 100 : sm), gi, ci);
	}
	unsigned int servers[MAX_MPS_PIDS], clients[MAX_MPS_PIDS], nservers = 0;
	fake_mps_processes(fake_str(device, "uuid", ""), servers, &nservers, clients, MAX_MPS_PIDS);
	for (unsigned int s = 0; s < nservers; s++)
		add(list, n, max, servers[s], 1ull << 20, 0, gi, ci);
}

unsigned int fake_processes(json_t *gpu, json_t *gi, json_t *ci, struct fake_process *list, unsigned int max)
{
	unsigned int n = 0;
	if (ci) {
		of_device(ci, (unsigned int)fake_int(gi, "id", 0), (unsigned int)fake_int(ci, "id", 0), list, &n, max);
		return n;
	}
	of_device(gpu, NA, NA, list, &n, max); /* "0xFFFFFFFF otherwise" (nvmlProcessInfo_v2_st) */
	size_t i, j;
	json_t *g, *c;
	json_array_foreach(json_object_get(gpu, "gpuInstances"), i, g)
		json_array_foreach(json_object_get(g, "computeInstances"), j, c)
			of_device(c, (unsigned int)fake_int(g, "id", 0), (unsigned int)fake_int(c, "id", 0), list, &n, max);
	return n;
}

/* Percent of the device's SMs its processes keep busy: their "sm" summed, at most 100. For a GPU
 * in MIG mode, each GPU instance's activity weighed by its compute slices. */
double fake_activity(json_t *gpu, json_t *gi)
{
	struct fake_process list[MAX_PROCESSES];
	if (gi) {
		double sum = 0;
		size_t j;
		json_t *c;
		json_array_foreach(json_object_get(gi, "computeInstances"), j, c) {
			unsigned int n = fake_processes(gpu, gi, c, list, MAX_PROCESSES);
			for (unsigned int k = 0; k < n; k++)
				sum += list[k].sm;
		}
		return sum > 100 ? 100 : sum;
	}
	if (!fake_mig_enabled(gpu)) {
		double sum = 0;
		unsigned int n = fake_processes(gpu, NULL, NULL, list, MAX_PROCESSES);
		for (unsigned int k = 0; k < n; k++)
			sum += list[k].sm;
		return sum > 100 ? 100 : sum;
	}
	double weighted = 0, slices = (double)fake_int(json_object_get(gpu, "mig"), "computeSlices", 1);
	size_t i;
	json_t *g;
	json_array_foreach(json_object_get(gpu, "gpuInstances"), i, g) {
		json_t *profile = fake_profile_by_id(gpu, fake_int(g, "profileId", -1));
		weighted += fake_activity(gpu, g) * (double)fake_int(profile, "slices", 0);
	}
	return slices > 0 ? weighted / slices : 0;
}

/* ---- processes --------------------------------------------------------------------------------- */

/* nvml.h note: "In MIG mode, if device handle is provided, the API returns aggregate information,
 * only if the caller has appropriate privileges. Per-instance information can be queried by using
 * specific MIG device handles." With "unprivilegedProcesses" in the state (an unprivileged
 * container) both answer NO_PERMISSION. Call with *infoCount = 0: "The return code will be
 * NVML_ERROR_INSUFFICIENT_SIZE, or NVML_SUCCESS if none are running"; "infoCount will contain
 * minimal amount of space necessary" when it is too small. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
								 nvmlProcessInfo_t *infos)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!infoCount || (*infoCount && !infos))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (fake_mig_enabled(gpu) && fake_bool(state, "unprivilegedProcesses"))
		RETURN(NVML_ERROR_NO_PERMISSION);
	struct fake_process found[MAX_PROCESSES];
	unsigned int n = fake_processes(gpu, gi, ci, found, MAX_PROCESSES);
	if (*infoCount < n) {
		*infoCount = n;
		RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
	}
	for (unsigned int i = 0; i < n; i++)
		infos[i] = (nvmlProcessInfo_t){.pid = found[i].pid, .usedGpuMemory = found[i].used,
					       .gpuInstanceId = found[i].gi, .computeInstanceId = found[i].ci};
	*infoCount = n;
	RETURN(NVML_SUCCESS);
}

/* ---- memory ------------------------------------------------------------------------------------ */

/* Total: the GPU's memory, or for a MIG device its GPU instance profile's
 * (nvmlGpuInstanceProfileInfo_v2_t.memorySizeMB: "Per-instance information can be queried by using
 * specific MIG device handles"); used: what the processes there use (a MIG device: every compute
 * instance of its GPU instance, whose memory they share); nothing reserved. A GPU handle in MIG
 * mode gives the aggregate (nvml.h: "only if the caller has appropriate privileges"; the state's
 * "unprivilegedProcesses" plays that for the process lists only). */
static nvmlReturn_t memory_of(nvmlDevice_t device, unsigned long long *total, unsigned long long *used)
{
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		return rc;
	long long mib = ci ? fake_int(fake_profile_by_id(gpu, fake_int(gi, "profileId", -1)), "memoryMiB", 0)
			   : fake_int(gpu, "memoryMiB", 0);
	struct fake_process list[MAX_PROCESSES];
	unsigned int n = 0;
	if (ci) {
		size_t j;
		json_t *c;
		json_array_foreach(json_object_get(gi, "computeInstances"), j, c)
			n += fake_processes(gpu, gi, c, list + n, MAX_PROCESSES - n);
	} else {
		n = fake_processes(gpu, NULL, NULL, list, MAX_PROCESSES);
	}
	*total = (unsigned long long)mib << 20;
	*used = 0;
	for (unsigned int i = 0; i < n; i++)
		*used += list[i].used;
	if (*used > *total)
		*used = *total;
	return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
	ENTER();
	if (!memory)
		RETURN(NVML_ERROR_INVALID_ARGUMENT); /* "if \a device is invalid or \a memory is NULL" */
	unsigned long long total = 0, used = 0;
	nvmlReturn_t rc = memory_of(device, &total, &used);
	if (rc == NVML_SUCCESS)
		*memory = (nvmlMemory_t){.total = total, .free = total - used, .used = used};
	RETURN(rc);
}

/* The v2 struct carries its version (nvmlMemory_v2); another is ARGUMENT_VERSION_MISMATCH ("The
 * provided version is invalid/unsupported"). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
	ENTER();
	if (!memory)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (memory->version != nvmlMemory_v2)
		RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
	unsigned long long total = 0, used = 0;
	nvmlReturn_t rc = memory_of(device, &total, &used);
	if (rc == NVML_SUCCESS)
		*memory = (nvmlMemory_v2_t){.version = nvmlMemory_v2, .total = total, .reserved = 0,
					    .free = total - used, .used = used};
	RETURN(rc);
}

/* ---- utilization ------------------------------------------------------------------------------- */

/* "On MIG-enabled GPUs, querying device utilization rates is not currently supported." `gpu`: the
 * processes' SM activity; `memory` (time the memory was read or written) is not played: 0. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!utilization)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (ci || fake_mig_enabled(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	*utilization = (nvmlUtilization_t){.gpu = (unsigned int)(fake_activity(gpu, NULL) + 0.5), .memory = 0};
	RETURN(NVML_SUCCESS);
}

/* "One utilization sample structure is returned per process running, that had some non-zero
 * utilization during the last sample period", stamped with the CPU time in microseconds of the
 * sample period it belongs to; "If no valid sample entries are found since the lastSeenTimeStamp,
 * NVML_ERROR_NOT_FOUND is returned". The caller learns the count from a call with `utilization`
 * NULL (INSUFFICIENT_SIZE and the count: the convention nvidia-ml-py's wrapper relies on). "On
 * MIG-enabled GPUs, querying process utilization is not currently supported." */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
							 unsigned int *processSamplesCount,
							 unsigned long long lastSeenTimeStamp)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!processSamplesCount)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (ci || fake_mig_enabled(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	unsigned long long us = (unsigned long long)now.tv_sec * 1000000ull + (unsigned long long)now.tv_nsec / 1000ull;
	unsigned long long stamp = us - us % SAMPLE_PERIOD_US;
	struct fake_process list[MAX_PROCESSES];
	unsigned int n = fake_processes(gpu, NULL, NULL, list, MAX_PROCESSES), found = 0;
	for (unsigned int i = 0; i < n; i++)
		found += list[i].sm > 0;
	if (found == 0 || stamp <= lastSeenTimeStamp)
		RETURN(NVML_ERROR_NOT_FOUND);
	if (!utilization || *processSamplesCount < found) {
		*processSamplesCount = found;
		RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
	}
	unsigned int k = 0;
	for (unsigned int i = 0; i < n; i++)
		if (list[i].sm > 0)
			utilization[k++] = (nvmlProcessUtilizationSample_t){.pid = list[i].pid, .timeStamp = stamp,
									    .smUtil = list[i].sm};
	*processSamplesCount = k;
	RETURN(NVML_SUCCESS);
}

/* ---- power and temperature ------------------------------------------------------------------------ */

/* A GPU's readings ("powerWatts", "temperatureC" in the state); a MIG device handle has none of its
 * own here (NOT_SUPPORTED: nvml.h documents no per-instance power or temperature). */
static nvmlReturn_t sensors(nvmlDevice_t device, json_t **gpu)
{
	json_t *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, fake_state(), gpu, &gi, &ci);
	if (rc == NVML_SUCCESS && ci)
		rc = NVML_ERROR_NOT_SUPPORTED;
	return rc;
}

/* Milliwatts, "for this GPU ... and its associated circuitry (e.g. memory)". */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
	ENTER();
	json_t *gpu = NULL;
	nvmlReturn_t rc = sensors(device, &gpu);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!power)
		RETURN(NVML_ERROR_INVALID_ARGUMENT); /* "if \a device is invalid or \a power is NULL" */
	json_t *watts = json_object_get(gpu, "powerWatts");
	*power = (unsigned int)((json_is_number(watts) ? json_number_value(watts) : DEFAULT_POWER_W) * 1000.0 + 0.5);
	RETURN(NVML_SUCCESS);
}

/* The die sensor only (NVML_TEMPERATURE_GPU): another existing sensor is NOT_SUPPORTED "if the
 * device does not have the specified sensor", an unknown one INVALID_ARGUMENT ("sensorType is
 * invalid"). */
static nvmlReturn_t temperature_of(nvmlDevice_t device, nvmlTemperatureSensors_t sensor, int *celsius)
{
	json_t *gpu = NULL;
	nvmlReturn_t rc = sensors(device, &gpu);
	if (rc != NVML_SUCCESS)
		return rc;
	if ((unsigned int)sensor >= NVML_TEMPERATURE_COUNT)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (sensor != NVML_TEMPERATURE_GPU)
		return NVML_ERROR_NOT_SUPPORTED;
	*celsius = (int)fake_int(gpu, "temperatureC", DEFAULT_TEMPERATURE_C);
	return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
	ENTER();
	if (!temperature)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (temperature->version != nvmlTemperature_v1)
		RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH); /* "If the provided version is invalid/unsupported" */
	int celsius = 0;
	nvmlReturn_t rc = temperature_of(device, temperature->sensorType, &celsius);
	if (rc == NVML_SUCCESS)
		temperature->temperature = celsius;
	RETURN(rc);
}

/* Deprecated in NVML 13 ("Use nvmlDeviceGetTemperatureV instead"); older drivers have only this. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp)
{
	ENTER();
	if (!temp)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	int celsius = 0;
	nvmlReturn_t rc = temperature_of(device, sensorType, &celsius);
	if (rc == NVML_SUCCESS)
		*temp = (unsigned int)celsius;
	RETURN(rc);
}
