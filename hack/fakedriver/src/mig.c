/* GPU-instance profiles, placements and GPU instances, with the driver's rules.
 *
 * Profiles, placements, memory, engines and multiprocessors come from the GPU's "mig" table in the
 * state (written by `sharing sim init` from the catalog). Return codes follow the @return lists of
 * each function in nvml.h. Handles: fake_handle(); whether the instance still exists is checked
 * against the state on every call (nvml.h, nvmlDeviceCreateGpuInstanceWithPlacement: "If the
 * parent device is unbound, reset or the GPU instance is destroyed explicitly, the GPU instance
 * handle would become invalid").
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "fake.h"

json_t *fake_profile_by_id(json_t *gpu, long long id)
{
	size_t i;
	json_t *p;
	json_array_foreach(json_object_get(json_object_get(gpu, "mig"), "profiles"), i, p)
		if (fake_int(p, "id", -1) == id) return p;
	return NULL;
}

static json_t *profile_by_enum(json_t *gpu, unsigned int e)
{
	size_t i;
	json_t *p;
	json_array_foreach(json_object_get(json_object_get(gpu, "mig"), "profiles"), i, p)
		if (fake_int(p, "enum", -1) == e) return p;
	return NULL;
}

static int mig_capable(json_t *gpu) { return fake_bool(gpu, "migCapable") && json_is_object(json_object_get(gpu, "mig")); }
int fake_mig_enabled(json_t *gpu) { return mig_capable(gpu) && fake_int(gpu, "migCurrent", 0) == NVML_DEVICE_MIG_ENABLE; }

int fake_gpu_busy(json_t *gpu)
{
	if (fake_has_processes(gpu))
		return 1;
	size_t i, j;
	json_t *gi, *ci;
	json_array_foreach(json_object_get(gpu, "gpuInstances"), i, gi)
		json_array_foreach(json_object_get(gi, "computeInstances"), j, ci) if (fake_has_processes(ci)) return 1;
	return 0;
}

/* A new MIG UUID per compute instance, kept in the state ("UUIDs are immutable for the lifetime of
 * a MIG device", nvmlDeviceGetUUID), in NVIDIA's R470+ form MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
 * (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/#device-enumeration). Derived from the
 * state's seed and a counter, so the same history gives the same UUIDs (an RFC 9562 version-8 UUID). */
static unsigned long long mix(unsigned long long x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

void fake_mig_uuid(json_t *state, char *out, size_t size)
{
	long long counter = fake_int(state, "uuidCounter", 0) + 1;
	json_object_set_new(state, "uuidCounter", json_integer(counter));
	unsigned long long h = 1469598103934665603ull;
	for (const char *s = fake_str(state, "seed", "sim"); *s; s++)
		h = (h ^ (unsigned char)*s) * 1099511628211ull;
	unsigned long long a = mix(h ^ (unsigned long long)counter), b = mix(a ^ 0x6d6967ull);
	a = (a & ~0xf000ull) | 0x8000ull;                  /* version 8 */
	b = (b & 0x3fffffffffffffffull) | 0x8000000000000000ull; /* variant 10 */
	snprintf(out, size, "MIG-%08llx-%04llx-%04llx-%04llx-%012llx", a >> 32, (a >> 16) & 0xffff, a & 0xffff,
		 b >> 48, b & 0xffffffffffffull);
}

/* ---- GPU instance profiles and placements -------------------------------------------------------- */

/* NOT_SUPPORTED "If device doesn't have MIG mode enabled or profile isn't supported" (the
 * nvmlDeviceGetGpuInstanceProfileInfoV doc). Current drivers answer while MIG is off too (what
 * mig-parted's and the agent's discovery read before enabling MIG); the older branch (personality
 * "r535") refuses while MIG is disabled, as NVIDIA's mig-parted notes for R535 (pkg/mig/discovery). */
static nvmlReturn_t gi_profile(json_t *state, json_t *gpu, unsigned int profile, json_t **found)
{
	if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (!mig_capable(gpu) || (fake_old_branch(state) && !fake_mig_enabled(gpu)))
		return NVML_ERROR_NOT_SUPPORTED;
	*found = profile_by_enum(gpu, profile);
	return *found ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

void fake_engines(json_t *p, unsigned int out[5])
{
	for (int i = 0; i < 5; i++)
		out[i] = (unsigned int)json_integer_value(json_array_get(json_object_get(p, "engines"), (size_t)i));
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
							     nvmlGpuInstanceProfileInfo_t *info)
{
	ENTER();
	GPU_OR_RETURN(device);
	json_t *p;
	if (!info)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if ((rc = gi_profile(state, gpu, profile, &p)) != NVML_SUCCESS)
		RETURN(rc);
	unsigned int e[5];
	fake_engines(p, e);
	*info = (nvmlGpuInstanceProfileInfo_t){
		.id = (unsigned int)fake_int(p, "id", 0), .isP2pSupported = 0,
		.sliceCount = (unsigned int)fake_int(p, "slices", 0),
		.instanceCount = (unsigned int)fake_int(p, "maxCount", 0),
		.multiprocessorCount = (unsigned int)fake_int(p, "sm", 0), .copyEngineCount = e[0],
		.decoderCount = e[1], .encoderCount = e[2], .jpegCount = e[3], .ofaCount = e[4],
		.memorySizeMB = (unsigned long long)fake_int(p, "memoryMiB", 0)};
	RETURN(NVML_SUCCESS);
}

/* The caller sets info->version (v2 or v3); INVALID_ARGUMENT "If ... info->version are invalid". */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
							      nvmlGpuInstanceProfileInfo_v2_t *info)
{
	ENTER();
	GPU_OR_RETURN(device);
	json_t *p;
	if (!info || (info->version != nvmlGpuInstanceProfileInfo_v2 && info->version != nvmlGpuInstanceProfileInfo_v3))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if ((rc = gi_profile(state, gpu, profile, &p)) != NVML_SUCCESS)
		RETURN(rc);
	unsigned int e[5];
	fake_engines(p, e);
	char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
	snprintf(name, sizeof name, "MIG %s", fake_str(p, "name", ""));
	if (info->version == nvmlGpuInstanceProfileInfo_v3) {
		nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)info;
		*v3 = (nvmlGpuInstanceProfileInfo_v3_t){
			.version = nvmlGpuInstanceProfileInfo_v3, .id = (unsigned int)fake_int(p, "id", 0),
			.sliceCount = (unsigned int)fake_int(p, "slices", 0),
			.instanceCount = (unsigned int)fake_int(p, "maxCount", 0),
			.multiprocessorCount = (unsigned int)fake_int(p, "sm", 0), .copyEngineCount = e[0],
			.decoderCount = e[1], .encoderCount = e[2], .jpegCount = e[3], .ofaCount = e[4],
			.memorySizeMB = (unsigned long long)fake_int(p, "memoryMiB", 0), .capabilities = 0};
		memcpy(v3->name, name, sizeof name);
		RETURN(NVML_SUCCESS);
	}
	*info = (nvmlGpuInstanceProfileInfo_v2_t){
		.version = nvmlGpuInstanceProfileInfo_v2, .id = (unsigned int)fake_int(p, "id", 0),
		.isP2pSupported = 0, .sliceCount = (unsigned int)fake_int(p, "slices", 0),
		.instanceCount = (unsigned int)fake_int(p, "maxCount", 0),
		.multiprocessorCount = (unsigned int)fake_int(p, "sm", 0), .copyEngineCount = e[0],
		.decoderCount = e[1], .encoderCount = e[2], .jpegCount = e[3], .ofaCount = e[4],
		.memorySizeMB = (unsigned long long)fake_int(p, "memoryMiB", 0)};
	memcpy(info->name, name, sizeof name);
	RETURN(NVML_SUCCESS);
}

/* "This API only returns all the possible placements for the given profile regardless of whether
 * MIG is enabled or not"; placements may be NULL "to discover number of allowed placements";
 * otherwise it "must be large enough" (count is output only, as in NVML). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
								       nvmlGpuInstancePlacement_t *placements,
								       unsigned int *count)
{
	ENTER();
	GPU_OR_RETURN(device);
	if (!count)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *p = mig_capable(gpu) ? fake_profile_by_id(gpu, profileId) : NULL;
	if (!p)
		RETURN(NVML_ERROR_NOT_SUPPORTED); /* "doesn't support MIG or profileId isn't supported" */
	json_t *starts = json_object_get(p, "placements");
	*count = (unsigned int)json_array_size(starts);
	if (placements)
		for (unsigned int i = 0; i < *count; i++)
			placements[i] = (nvmlGpuInstancePlacement_t){
				(unsigned int)json_integer_value(json_array_get(starts, i)), (unsigned int)fake_int(p, "size", 0)};
	RETURN(NVML_SUCCESS);
}

/* ---- GPU instances ---------------------------------------------------------------------------- */

static nvmlReturn_t create_gi(json_t *state, json_t *gpu, unsigned int profileId, const nvmlGpuInstancePlacement_t *at,
			      int *id)
{
	if (!fake_mig_enabled(gpu))
		return NVML_ERROR_NOT_SUPPORTED; /* "If device doesn't have MIG mode enabled" */
	json_t *p = fake_profile_by_id(gpu, profileId);
	if (!p || !at || at->size != (unsigned int)fake_int(p, "size", -1))
		return NVML_ERROR_INVALID_ARGUMENT;
	size_t i;
	json_t *s, *gi, *gis = json_object_get(gpu, "gpuInstances");
	int valid = 0;
	json_array_foreach(json_object_get(p, "placements"), i, s) valid |= json_integer_value(s) == at->start;
	if (!valid)
		return NVML_ERROR_INVALID_ARGUMENT; /* "placement ... invalid": not one of the possible placements */
	/* INSUFFICIENT_RESOURCES "If the requested GPU instance could not be created": the profile's
	 * maximum count, overlapping memory slices ("Creation of new GPU instance will fail if there is
	 * overlap with the already occupied memory slices", PossiblePlacements doc), or no compute slices left. */
	long long same = 0, compute = 0, used = 0;
	json_array_foreach(gis, i, gi) {
		long long start = fake_int(gi, "start", 0), size = fake_int(gi, "size", 0);
		same += fake_int(gi, "profileId", -1) == profileId;
		compute += fake_int(fake_profile_by_id(gpu, fake_int(gi, "profileId", -1)), "slices", 0);
		if (at->start < start + size && start < at->start + at->size)
			return NVML_ERROR_INSUFFICIENT_RESOURCES;
		used |= 1ll << fake_int(gi, "id", 0);
	}
	if (same >= fake_int(p, "maxCount", 0) ||
	    compute + fake_int(p, "slices", 0) > fake_int(json_object_get(gpu, "mig"), "computeSlices", 0))
		return NVML_ERROR_INSUFFICIENT_RESOURCES;
	for (*id = 0; *id < MAX_GI - 1 && (used >> *id & 1); (*id)++)
		;
	json_t *entry = json_pack("{s:i, s:I, s:i, s:i, s:[]}", "id", *id, "profileId", (json_int_t)profileId, "start",
				  (int)at->start, "size", (int)at->size, "computeInstances");
	json_array_append_new(gis, entry);
	(void)state;
	return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
								  const nvmlGpuInstancePlacement_t *placement,
								  nvmlGpuInstance_t *gpuInstance)
{
	ENTER();
	struct fake_handle *h = fake_check(device);
	if (!h || h->kind != K_GPU || !gpuInstance)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *state = fake_mutate_begin();
	if (!state)
		RETURN(NVML_ERROR_UNKNOWN);
	json_t *gpu = fake_gpu(state, h->gpu);
	int id = 0;
	nvmlReturn_t rc = !gpu ? NVML_ERROR_INVALID_ARGUMENT
			  : fake_bool(gpu, "lost") ? NVML_ERROR_GPU_IS_LOST
						   : create_gi(state, gpu, profileId, placement, &id);
	fake_mutate_end(state, rc == NVML_SUCCESS);
	if (rc == NVML_SUCCESS)
		*gpuInstance = (nvmlGpuInstance_t)fake_handle(K_GI, h->gpu, id, 0);
	RETURN(rc);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
						   nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
	ENTER();
	GPU_OR_RETURN(device);
	if (!count || !gpuInstances)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (!fake_mig_enabled(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	if (!fake_profile_by_id(gpu, profileId))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	size_t i;
	json_t *gi;
	unsigned int n = 0;
	json_array_foreach(json_object_get(gpu, "gpuInstances"), i, gi)
		if (fake_int(gi, "profileId", -1) == profileId)
			gpuInstances[n++] = (nvmlGpuInstance_t)fake_handle(K_GI, (int)fake_int(gpu, "index", 0),
									   (int)fake_int(gi, "id", 0), 0);
	*count = n;
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance)
{
	ENTER();
	GPU_OR_RETURN(device);
	if (!gpuInstance)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (!fake_mig_enabled(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	if (!fake_gi(gpu, (int)id))
		RETURN(NVML_ERROR_NOT_FOUND); /* "If the GPU instance is not found." */
	*gpuInstance = (nvmlGpuInstance_t)fake_handle(K_GI, (int)fake_int(gpu, "index", 0), (int)id, 0);
	RETURN(NVML_SUCCESS);
}

/* A GPU- or compute-instance handle whose instance still exists; INVALID_ARGUMENT otherwise. */
nvmlReturn_t fake_instance(const void *handle, int kind, json_t *state, json_t **gpu, json_t **gi, json_t **ci)
{
	struct fake_handle *h = fake_check(handle);
	if (!h || h->kind != kind || !state || !(*gpu = fake_gpu(state, h->gpu)))
		return NVML_ERROR_INVALID_ARGUMENT;
	if (fake_bool(*gpu, "lost"))
		return NVML_ERROR_GPU_IS_LOST;
	if (!(*gi = fake_gi(*gpu, h->gi)))
		return NVML_ERROR_INVALID_ARGUMENT;
	if (kind == K_CI && !(*ci = fake_ci(*gi, h->ci)))
		return NVML_ERROR_INVALID_ARGUMENT;
	return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
	ENTER();
	json_t *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_instance(gpuInstance, K_GI, fake_state(), &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS || !info)
		RETURN(rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT);
	info->device = (nvmlDevice_t)fake_handle(K_GPU, (int)fake_int(gpu, "index", 0), 0, 0);
	info->id = (unsigned int)fake_int(gi, "id", 0);
	info->profileId = (unsigned int)fake_int(gi, "profileId", 0);
	info->placement = (nvmlGpuInstancePlacement_t){(unsigned int)fake_int(gi, "start", 0),
						       (unsigned int)fake_int(gi, "size", 0)};
	RETURN(NVML_SUCCESS);
}

/* IN_USE "if processes (e.g. CUDA application) or compute instances are active on the GPU instance". */
FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
	ENTER();
	json_t *state = fake_mutate_begin(), *gpu = NULL, *gi = NULL, *ci = NULL;
	if (!state)
		RETURN(NVML_ERROR_UNKNOWN);
	nvmlReturn_t rc = fake_instance(gpuInstance, K_GI, state, &gpu, &gi, &ci);
	if (rc == NVML_SUCCESS && json_array_size(json_object_get(gi, "computeInstances")))
		rc = NVML_ERROR_IN_USE;
	if (rc == NVML_SUCCESS) {
		json_t *gis = json_object_get(gpu, "gpuInstances");
		size_t i;
		json_t *item;
		json_array_foreach(gis, i, item) if (item == gi) break;
		json_array_remove(gis, i);
	}
	fake_mutate_end(state, rc == NVML_SUCCESS);
	RETURN(rc);
}
