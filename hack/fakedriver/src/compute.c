/* Compute instances and MIG devices, with the driver's rules (return codes: the @return lists of
 * each function in nvml.h). The GPU instance they live in: mig.c.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "fake.h"

/* ---- compute instances --------------------------------------------------------------------------- */

/* NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE .. _6_SLICE (nvml.h) -> compute slices; REV1 and NVL
 * variants are not played. */
static const int ci_slices[NVML_COMPUTE_INSTANCE_PROFILE_COUNT] = {1, 2, 3, 4, 7, 8, 6, 0, 0};

/* Which compute-instance sizes a GPU instance of `whole` slices offers: all of it, or at most about
 * half (A100 7g: 1c,2c,3c,4c,7c; 4g: 1c,2c,4c; 3g: 1c,2c,3c: `nvidia-smi mig -lcip`, MIG user guide
 * "Supported MIG Profiles"). */
static int ci_supported(int slices, long long whole)
{
	return slices > 0 && slices <= whole && (slices == whole || 2 * slices <= whole + 1);
}

static nvmlReturn_t ci_profile(json_t *gpu, json_t *gi, unsigned int profile, unsigned int engProfile, json_t **gip)
{
	if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		return NVML_ERROR_INVALID_ARGUMENT;
	*gip = fake_profile_by_id(gpu, fake_int(gi, "profileId", -1));
	return ci_supported(ci_slices[profile], fake_int(*gip, "slices", 0)) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

static void fill_ci_info(json_t *gip, unsigned int profile, nvmlComputeInstanceProfileInfo_v2_t *info)
{
	long long whole = fake_int(gip, "slices", 1);
	int slices = ci_slices[profile];
	unsigned int e[5];
	fake_engines(gip, e);
	info->id = profile; /* the profile id is the NVML_COMPUTE_INSTANCE_PROFILE_* value */
	info->sliceCount = (unsigned int)slices;
	info->instanceCount = (unsigned int)(whole / slices);
	info->multiprocessorCount = (unsigned int)(fake_int(gip, "sm", 0) / whole * slices);
	info->sharedCopyEngineCount = e[0];
	info->sharedDecoderCount = e[1];
	info->sharedEncoderCount = e[2];
	info->sharedJpegCount = e[3];
	info->sharedOfaCount = e[4];
	if (slices == whole)
		snprintf(info->name, sizeof info->name, "MIG %s", fake_str(gip, "name", ""));
	else
		snprintf(info->name, sizeof info->name, "MIG %dc.%s", slices, fake_str(gip, "name", ""));
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
								       unsigned int engProfile,
								       nvmlComputeInstanceProfileInfo_v2_t *info)
{
	ENTER();
	json_t *gpu = NULL, *gi = NULL, *ci = NULL, *gip = NULL;
	nvmlReturn_t rc = fake_instance(gpuInstance, K_GI, fake_state(), &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!info || (info->version != nvmlComputeInstanceProfileInfo_v2 && info->version != nvmlComputeInstanceProfileInfo_v3))
		RETURN(NVML_ERROR_INVALID_ARGUMENT); /* "If ... info, or info->version are invalid" */
	if ((rc = ci_profile(gpu, gi, profile, engProfile, &gip)) != NVML_SUCCESS)
		RETURN(rc);
	if (info->version == nvmlComputeInstanceProfileInfo_v3) {
		nvmlComputeInstanceProfileInfo_v2_t v2 = {.version = nvmlComputeInstanceProfileInfo_v2};
		fill_ci_info(gip, profile, &v2);
		nvmlComputeInstanceProfileInfo_v3_t *v3 = (nvmlComputeInstanceProfileInfo_v3_t *)info;
		memset(v3, 0, sizeof *v3);
		v3->version = nvmlComputeInstanceProfileInfo_v3;
		memcpy(&v3->id, &v2.id, offsetof(nvmlComputeInstanceProfileInfo_v2_t, name) - offsetof(nvmlComputeInstanceProfileInfo_v2_t, id));
		memcpy(v3->name, v2.name, sizeof v3->name);
		RETURN(NVML_SUCCESS);
	}
	fill_ci_info(gip, profile, info);
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
								      unsigned int engProfile,
								      nvmlComputeInstanceProfileInfo_t *info)
{
	if (!info)
		return NVML_ERROR_INVALID_ARGUMENT;
	nvmlComputeInstanceProfileInfo_v2_t v2 = {.version = nvmlComputeInstanceProfileInfo_v2};
	nvmlReturn_t rc = nvmlGpuInstanceGetComputeInstanceProfileInfoV(gpuInstance, profile, engProfile, &v2);
	if (rc == NVML_SUCCESS)
		memcpy(info, &v2.id, sizeof *info);
	return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
							      nvmlComputeInstance_t *computeInstance)
{
	ENTER();
	if (!computeInstance)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *state = fake_mutate_begin(), *gpu = NULL, *gi = NULL, *ci = NULL, *gip = NULL;
	if (!state)
		RETURN(NVML_ERROR_UNKNOWN);
	nvmlReturn_t rc = fake_instance(gpuInstance, K_GI, state, &gpu, &gi, &ci);
	if (rc == NVML_SUCCESS)
		rc = profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT ? NVML_ERROR_INVALID_ARGUMENT
									: ci_profile(gpu, gi, profileId, 0, &gip);
	json_t *cis = json_object_get(gi, "computeInstances");
	long long used = 0, ids = 0, taken = 0;
	int id = 0, mig = 0;
	if (rc == NVML_SUCCESS) {
		size_t i, j;
		json_t *c, *g;
		json_array_foreach(cis, i, c) {
			used += fake_int(c, "size", 0);
			ids |= 1ll << fake_int(c, "id", 0);
		}
		json_array_foreach(json_object_get(gpu, "gpuInstances"), i, g)
			json_array_foreach(json_object_get(g, "computeInstances"), j, c) taken |= 1ll << fake_int(c, "migIndex", 0);
		if (used + ci_slices[profileId] > fake_int(gip, "slices", 0))
			rc = NVML_ERROR_INSUFFICIENT_RESOURCES; /* "could not be created" */
	}
	if (rc == NVML_SUCCESS) {
		for (; id < MAX_CI - 1 && (ids >> id & 1); id++)
			;
		/* MIG device indices: the lowest free one on the GPU, so destroying leaves holes
		 * (nvmlDeviceGetMigDeviceHandleByIndex: NOT_FOUND "if no valid MIG device was found at index"). */
		for (; mig < 62 && (taken >> mig & 1); mig++)
			;
		char uuid[64];
		fake_mig_uuid(state, uuid, sizeof uuid);
		json_array_append_new(cis, json_pack("{s:i, s:i, s:I, s:i, s:i, s:s, s:[]}", "id", id, "profileId",
						     (int)profileId, "start", (json_int_t)used, "size", ci_slices[profileId],
						     "migIndex", mig, "uuid", uuid, "processes"));
		*computeInstance = (nvmlComputeInstance_t)fake_handle(K_CI, (int)fake_int(gpu, "index", 0),
								      (int)fake_int(gi, "id", 0), id);
	}
	fake_mutate_end(state, rc == NVML_SUCCESS);
	RETURN(rc);
}

FAKE_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
							    nvmlComputeInstance_t *computeInstances, unsigned int *count)
{
	ENTER();
	json_t *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_instance(gpuInstance, K_GI, fake_state(), &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS)
		RETURN(rc);
	if (!computeInstances || !count || profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	size_t i;
	json_t *c;
	unsigned int n = 0;
	json_array_foreach(json_object_get(gi, "computeInstances"), i, c)
		if (fake_int(c, "profileId", -1) == profileId)
			computeInstances[n++] = (nvmlComputeInstance_t)fake_handle(
				K_CI, (int)fake_int(gpu, "index", 0), (int)fake_int(gi, "id", 0), (int)fake_int(c, "id", 0));
	*count = n;
	RETURN(NVML_SUCCESS);
}

/* nvml.h nvmlComputeInstanceInfo_st: "nvmlDevice_t device; //!< Parent device", the GPU's handle
 * (not the MIG device's), and "nvmlGpuInstance_t gpuInstance; //!< Parent GPU instance". */
FAKE_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info)
{
	ENTER();
	json_t *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_instance(computeInstance, K_CI, fake_state(), &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS || !info)
		RETURN(rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT);
	int index = (int)fake_int(gpu, "index", 0), g = (int)fake_int(gi, "id", 0);
	info->device = (nvmlDevice_t)fake_handle(K_GPU, index, 0, 0);
	info->gpuInstance = (nvmlGpuInstance_t)fake_handle(K_GI, index, g, 0);
	info->id = (unsigned int)fake_int(ci, "id", 0);
	info->profileId = (unsigned int)fake_int(ci, "profileId", 0);
	info->placement = (nvmlComputeInstancePlacement_t){(unsigned int)fake_int(ci, "start", 0),
							   (unsigned int)fake_int(ci, "size", 0)};
	RETURN(NVML_SUCCESS);
}

/* IN_USE "If the compute instance is in use. This error would be returned if processes (e.g. CUDA
 * application) are active on the compute instance." */
FAKE_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
	ENTER();
	json_t *state = fake_mutate_begin(), *gpu = NULL, *gi = NULL, *ci = NULL;
	if (!state)
		RETURN(NVML_ERROR_UNKNOWN);
	nvmlReturn_t rc = fake_instance(computeInstance, K_CI, state, &gpu, &gi, &ci);
	/* An MPS server on the MIG device is a process there (its daemon's clients are attached). */
	if (rc == NVML_SUCCESS && (fake_has_processes(ci) || fake_mps_serving(fake_str(ci, "uuid", ""))))
		rc = NVML_ERROR_IN_USE;
	if (rc == NVML_SUCCESS) {
		json_t *cis = json_object_get(gi, "computeInstances");
		size_t i;
		json_t *item;
		json_array_foreach(cis, i, item) if (item == ci) break;
		json_array_remove(cis, i);
	}
	fake_mutate_end(state, rc == NVML_SUCCESS);
	RETURN(rc);
}

/* ---- MIG devices ------------------------------------------------------------------------------- */

/* "Returns zero if MIG is not supported or enabled" (nvmlDeviceGetMaxMigDeviceCount). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
	ENTER();
	GPU_OR_RETURN(device);
	if (!count)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*count = fake_mig_enabled(gpu) ? (unsigned int)fake_int(json_object_get(gpu, "mig"), "computeSlices", 0) : 0;
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
	ENTER();
	GPU_OR_RETURN(device);
	if (!migDevice)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (!fake_mig_enabled(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	if (index >= (unsigned int)fake_int(json_object_get(gpu, "mig"), "computeSlices", 0))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	size_t i, j;
	json_t *gi, *ci;
	json_array_foreach(json_object_get(gpu, "gpuInstances"), i, gi)
		json_array_foreach(json_object_get(gi, "computeInstances"), j, ci)
			/* "hidden": a test hook, a compute instance not enumerated as a MIG device */
			if (fake_int(ci, "migIndex", -1) == index && !fake_bool(ci, "hidden")) {
				*migDevice = (nvmlDevice_t)fake_handle(K_MIG, (int)fake_int(gpu, "index", 0),
								       (int)fake_int(gi, "id", 0), (int)fake_int(ci, "id", 0));
				RETURN(NVML_SUCCESS);
			}
	RETURN(NVML_ERROR_NOT_FOUND);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
	ENTER();
	struct fake_handle *h = fake_check(device);
	if (!h || (h->kind != K_GPU && h->kind != K_MIG) || !isMigDevice)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*isMigDevice = h->kind == K_MIG;
	RETURN(NVML_SUCCESS);
}

/* A whole GPU has no GPU- or compute-instance id: NOT_SUPPORTED "if this query is not supported by the device". */
static nvmlReturn_t mig_ids(nvmlDevice_t device, unsigned int *id, int compute)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS || !id)
		RETURN(rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT);
	if (!ci)
		RETURN(NVML_ERROR_NOT_SUPPORTED);
	*id = (unsigned int)fake_int(compute ? ci : gi, "id", 0);
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) { return mig_ids(device, id, 0); }
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) { return mig_ids(device, id, 1); }

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
	ENTER();
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;
	nvmlReturn_t rc = fake_device(migDevice, state, &gpu, &gi, &ci);
	if (rc != NVML_SUCCESS || !device || !ci)
		RETURN(rc != NVML_SUCCESS ? rc : NVML_ERROR_INVALID_ARGUMENT);
	*device = (nvmlDevice_t)fake_handle(K_GPU, (int)fake_int(gpu, "index", 0), 0, 0);
	RETURN(NVML_SUCCESS);
}
