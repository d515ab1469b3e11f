/* GPU Performance Monitoring (GPM): samples of a GPU or of one of its GPU instances, and the metrics
 * between two of them.
 *
 * nvml.h: every GPM call is "For Hopper &tm; or newer fully supported devices"; the caller asks
 * nvmlGpmQueryDeviceSupport, which answers in `isSupportedDevice` (here: compute capability 9.0 or
 * newer, as NVIDIA numbers Hopper and Blackwell), and a sample of an older GPU (an A100) is refused
 * with NOT_SUPPORTED. A sample keeps what it was taken of, when (CLOCK_MONOTONIC) and the activity
 * the state gives its target then (usage.c, fake_activity); nvmlGpmMetricsGet averages the two
 * samples' activity, which is the activity between them while it stays as the state says.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake.h"

#define SAMPLE_MAGIC 0x47504d53u /* "GPMS" */

/* nvml.h declares the sample only as a pointer to this (incomplete) struct: its content is the
 * library's own. */
struct nvmlGpmSample_st {
	uint32_t magic;
	int taken;
	int gpu;
	int gi; /* -1: the whole GPU */
	double at;
	double activity;
};

static int hopper_or_newer(json_t *gpu)
{
	return json_integer_value(json_array_get(json_object_get(gpu, "computeCapability"), 0)) >= 9;
}

static struct nvmlGpmSample_st *valid(nvmlGpmSample_t sample)
{
	return sample && sample->magic == SAMPLE_MAGIC ? sample : NULL;
}

/* "Indicates GPM support per system for the supplied device"; the struct carries its version. */
FAKE_EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci); /* "supports the device handle and MIG device handle" */
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!gpmSupport)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION)
		RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
	gpmSupport->isSupportedDevice = (unsigned int)hopper_or_newer(gpu);
	RETURN(NVML_SUCCESS);
}

/* "NVML_ERROR_INVALID_ARGUMENT if an invalid pointer is provided". */
FAKE_EXPORT nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample)
{
	ENTER();
	if (!gpmSample)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	struct nvmlGpmSample_st *sample = calloc(1, sizeof *sample);
	if (!sample)
		RETURN(NVML_ERROR_MEMORY); /* "if system memory is insufficient" */
	sample->magic = SAMPLE_MAGIC;
	*gpmSample = sample;
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample)
{
	ENTER();
	struct nvmlGpmSample_st *sample = valid(gpmSample);
	if (!sample)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	sample->magic = 0;
	free(sample);
	RETURN(NVML_SUCCESS);
}

static nvmlReturn_t take(json_t *gpu, json_t *gi, struct nvmlGpmSample_st *sample)
{
	if (!hopper_or_newer(gpu))
		return NVML_ERROR_NOT_SUPPORTED;
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	sample->taken = 1;
	sample->gpu = (int)fake_int(gpu, "index", 0);
	sample->gi = gi ? (int)fake_int(gi, "id", 0) : -1;
	sample->at = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
	sample->activity = fake_activity(gpu, gi);
	return NVML_SUCCESS;
}

/* "This API supports the device handle and MIG device handle": a MIG device's sample is its GPU
 * instance's. */
FAKE_EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	struct nvmlGpmSample_st *sample = valid(gpmSample);
	if (!sample)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	RETURN(take(gpu, ci ? gi : NULL, sample));
}

/* A GPU instance by its id on a GPU's handle; NOT_FOUND when the GPU has no such instance (as
 * nvmlDeviceGetGpuInstanceById: "If the GPU instance is not found"), NOT_SUPPORTED with MIG off. */
FAKE_EXPORT nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t gpmSample)
{
	ENTER();
	GPU_OR_RETURN(device);
	struct nvmlGpmSample_st *sample = valid(gpmSample);
	if (!sample)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (!hopper_or_newer(gpu) || !fake_mig_enabled(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	json_t *gi = gpuInstanceId < MAX_GI ? fake_gi(gpu, (int)gpuInstanceId) : NULL;
	if (!gi)
		RETURN(NVML_ERROR_NOT_FOUND);
	RETURN(take(gpu, gi, sample));
}

/* The version is NVML_GPM_METRICS_GET_VERSION; both samples taken, of the same GPU or GPU instance,
 * the second later. Each metric answers in its own `nvmlReturn`: GRAPHICS_UTIL ("Percentage of time
 * any compute/graphics app was active") and SM_UTIL ("Percentage of SMs that were busy") are played,
 * both the processes' activity (the fake's SMs are all busy while an engine is); every other known
 * metric answers NOT_SUPPORTED, an id past NVML_GPM_METRIC_MAX INVALID_ARGUMENT. */
FAKE_EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
	ENTER();
	if (!metricsGet)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION)
		RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
	struct nvmlGpmSample_st *a = valid(metricsGet->sample1), *b = valid(metricsGet->sample2);
	if (!a || !b || !a->taken || !b->taken || metricsGet->numMetrics > NVML_GPM_METRIC_MAX || a->gpu != b->gpu ||
	    a->gi != b->gi || !(b->at > a->at))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	double value = (a->activity + b->activity) / 2.0;
	for (unsigned int i = 0; i < metricsGet->numMetrics; i++) {
		nvmlGpmMetric_t *m = &metricsGet->metrics[i];
		memset(&m->metricInfo, 0, sizeof m->metricInfo); /* "Those can be NULL if not defined" */
		m->value = 0;
		if (m->metricId >= NVML_GPM_METRIC_MAX) {
			m->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
		} else if (m->metricId == NVML_GPM_METRIC_GRAPHICS_UTIL || m->metricId == NVML_GPM_METRIC_SM_UTIL) {
			m->nvmlReturn = NVML_SUCCESS;
			m->value = value;
		} else {
			m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
		}
	}
	RETURN(NVML_SUCCESS);
}
