/* The library and the whole-GPU calls: init, versions, identity, PCI, MPS clients, compute mode, MIG mode.
 *
 * Return codes follow the @return lists of NVIDIA's nvml.h (nvidia-nvml-dev), the function's own
 * doc comment unless a comment says otherwise.
 */
#include <stdio.h>
#include <string.h>

#include "fake.h"

/* nvmlInit_v2 = nvmlInitWithFlags(0); nvml.h: "NVML_ERROR_DRIVER_NOT_LOADED if NVIDIA driver is not
 * running" (here: no state file). Init and shutdown are reference counted (nvmlShutdown: "the last
 * call ... closes the library"). */
FAKE_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
	(void)flags;
	fake_enter();
	nvmlReturn_t rc = fake_initialised() ? NVML_SUCCESS : fake_load_initial();
	if (rc == NVML_SUCCESS) {
		fake_count_init(1);
	}
	fake_leave();
	return rc;
}

FAKE_EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

FAKE_EXPORT nvmlReturn_t nvmlShutdown(void)
{
	ENTER();
	fake_count_init(-1);
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
	switch (result) {
	case NVML_SUCCESS: return "Success";
	case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
	case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
	case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
	case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
	case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
	case NVML_ERROR_NOT_FOUND: return "Not Found";
	case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
	case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
	case NVML_ERROR_TIMEOUT: return "Timeout";
	case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
	case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
	case NVML_ERROR_RESET_REQUIRED: return "GPU requires reset";
	case NVML_ERROR_IN_USE: return "In use by another client";
	case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
	case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
	default: return "Unknown Error";
	}
}

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *value)
{
	if (!out)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (strlen(value) >= length)
		return NVML_ERROR_INSUFFICIENT_SIZE; /* "if \a length is too small" */
	strcpy(out, value);
	return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
	ENTER();
	json_t *state = fake_state();
	const char *fallback = state && fake_old_branch(state) ? "535.261.03" : "580.65.06";
	RETURN(copy_string(version, length, fake_str(state, "driverVersion", fallback)));
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
	ENTER();
	json_t *state = fake_state();
	if (!cudaDriverVersion)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*cudaDriverVersion = (int)fake_int(state, "cudaVersion", state && fake_old_branch(state) ? 12020 : 13000);
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
	return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
	ENTER();
	json_t *state = fake_state();
	if (!deviceCount || !state)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*deviceCount = (unsigned int)json_array_size(json_object_get(state, "gpus"));
	RETURN(NVML_SUCCESS);
}

/* A lost GPU still gets its handle here (every query on it then answers GPU_IS_LOST), as the
 * agent's reader expects; nvml.h lists GPU_IS_LOST for this call too. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
	ENTER();
	json_t *state = fake_state();
	if (!device || !state || index >= MAX_GPUS || !fake_gpu(state, (int)index))
		RETURN(NVML_ERROR_INVALID_ARGUMENT); /* "if \a index is invalid or \a device is NULL" */
	*device = (nvmlDevice_t)fake_handle(K_GPU, (int)index, 0, 0);
	RETURN(NVML_SUCCESS);
}

/* GPU or MIG UUIDs: "When used with MIG device handles the API returns globally unique UUIDs which
 * can be used to identify MIG devices across both GPU and MIG devices" (nvmlDeviceGetUUID). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
	ENTER();
	json_t *state = fake_state();
	if (!uuid || !device || !state)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	size_t i, j, k;
	json_t *gpu, *gi, *ci;
	json_array_foreach(json_object_get(state, "gpus"), i, gpu) {
		if (strcmp(fake_str(gpu, "uuid", ""), uuid) == 0) {
			*device = (nvmlDevice_t)fake_handle(K_GPU, (int)i, 0, 0);
			RETURN(NVML_SUCCESS);
		}
		json_array_foreach(json_object_get(gpu, "gpuInstances"), j, gi)
			json_array_foreach(json_object_get(gi, "computeInstances"), k, ci)
				if (strcmp(fake_str(ci, "uuid", ""), uuid) == 0) {
					*device = (nvmlDevice_t)fake_handle(K_MIG, (int)i, (int)fake_int(gi, "id", 0),
									    (int)fake_int(ci, "id", 0));
					RETURN(NVML_SUCCESS);
				}
	}
	RETURN(NVML_ERROR_NOT_FOUND);
}

#define DEVICE_OR_RETURN(handle)                                                                   \
	json_t *state = fake_state(), *gpu = NULL, *gi = NULL, *ci = NULL;                                              \
	nvmlReturn_t rc = fake_device((handle), state, &gpu, &gi, &ci);                            \
	if (rc != NVML_SUCCESS)                                                                    \
		RETURN(rc);

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	RETURN(copy_string(uuid, length, fake_str(ci ? ci : gpu, "uuid", "")));
}

/* A MIG device is named after its GPU and profile, as nvidia-smi -L shows it:
 * "NVIDIA A100-SXM4-40GB MIG 1g.5gb". */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	char text[NVML_DEVICE_NAME_V2_BUFFER_SIZE * 2];
	if (ci) {
		json_t *profile = fake_profile_by_id(gpu, fake_int(gi, "profileId", -1));
		snprintf(text, sizeof text, "%s MIG %s", fake_str(gpu, "name", ""), fake_str(profile, "name", "?"));
	} else {
		snprintf(text, sizeof text, "%s", fake_str(gpu, "name", ""));
	}
	RETURN(copy_string(name, length, text));
}

static void pci_of(json_t *gpu, int index, unsigned int *bus, char *busId, char *legacy)
{
	*bus = (unsigned int)fake_int(gpu, "pciBus", 0x10 + index);
	snprintf(busId, NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE, "00000000:%02X:00.0", *bus);
	if (legacy)
		snprintf(legacy, NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE, "0000:%02X:00.0", *bus);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!pci || ci)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	memset(pci, 0, sizeof *pci);
	pci_of(gpu, (int)fake_int(gpu, "index", 0), &pci->bus, pci->busId, pci->busIdLegacy);
	pci->pciDeviceId = (unsigned int)fake_int(gpu, "pciDeviceId", 0);
	pci->pciSubSystemId = (unsigned int)fake_int(gpu, "pciSubsystemId", 0);
	RETURN(NVML_SUCCESS);
}

/* nvml.h: "NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, //!< The provided version is invalid/unsupported";
 * the caller sets version = nvmlPciInfoExt_v1. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_t *pci)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!pci || ci)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (pci->version != nvmlPciInfoExt_v1)
		RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
	unsigned int cls = (unsigned int)fake_int(gpu, "pciClass", 0x030200);
	pci_of(gpu, (int)fake_int(gpu, "index", 0), &pci->bus, pci->busId, NULL);
	pci->domain = 0;
	pci->device = 0;
	pci->pciDeviceId = (unsigned int)fake_int(gpu, "pciDeviceId", 0);
	pci->pciSubSystemId = (unsigned int)fake_int(gpu, "pciSubsystemId", 0);
	pci->baseClass = cls >> 16;
	pci->subClass = (cls >> 8) & 0xFF;
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!major || !minor)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *cc = json_object_get(gpu, "computeCapability");
	*major = (int)json_integer_value(json_array_get(cc, 0));
	*minor = (int)json_integer_value(json_array_get(cc, 1));
	RETURN(NVML_SUCCESS);
}

/* nvml.h nvmlBrandType_t. Data-center GPUs report NVML_BRAND_NVIDIA (go-nvlib names it "Nvidia", as
 * NVIDIA's DRA driver shows it for an A100: dra-driver-nvidia-gpu
 * site/content/docs/reference/resourceslice-attributes.md); the state's "brand" overrides it. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!type)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*type = (nvmlBrandType_t)fake_int(gpu, "brand", NVML_BRAND_NVIDIA);
	RETURN(NVML_SUCCESS);
}

/* nvml.h NVML_DEVICE_ARCH_*, from the compute capability (https://developer.nvidia.com/cuda-gpus):
 * 7.0 Volta, 7.5 Turing, 8.0-8.7 Ampere, 8.9 Ada, 9.x Hopper, 10.x and 12.x Blackwell. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!arch)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *cc = json_object_get(gpu, "computeCapability");
	long long major = json_integer_value(json_array_get(cc, 0)), minor = json_integer_value(json_array_get(cc, 1));
	nvmlDeviceArchitecture_t found = NVML_DEVICE_ARCH_UNKNOWN;
	if (major == 7)
		found = minor < 5 ? NVML_DEVICE_ARCH_VOLTA : NVML_DEVICE_ARCH_TURING;
	else if (major == 8)
		found = minor < 9 ? NVML_DEVICE_ARCH_AMPERE : NVML_DEVICE_ARCH_ADA;
	else if (major == 9)
		found = NVML_DEVICE_ARCH_HOPPER;
	else if (major == 10 || major == 12)
		found = NVML_DEVICE_ARCH_BLACKWELL;
	*arch = found;
	RETURN(NVML_SUCCESS);
}

/* The minor number of /dev/nvidia<minor> (nvmlDeviceGetMinorNumber doc). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!minorNumber || ci)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*minorNumber = (unsigned int)fake_int(gpu, "minor", fake_int(gpu, "index", 0));
	RETURN(NVML_SUCCESS);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, nvmlGpuVirtualizationMode_t *mode)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!mode)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*mode = (nvmlGpuVirtualizationMode_t)fake_int(state, "virtualizationMode", NVML_GPU_VIRTUALIZATION_MODE_NONE);
	RETURN(NVML_SUCCESS);
}

static void add_process(nvmlProcessInfo_t *list, unsigned int *n, unsigned int pid)
{
	list[*n] = (nvmlProcessInfo_t){.pid = pid, .usedGpuMemory = 1u << 20, .gpuInstanceId = NA, .computeInstanceId = NA};
	(*n)++;
}

/* The clients of the GPU's MPS servers ("Get information about processes with a compute context
 * running on a device as MPS clients"; same calling convention as the call above). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
								    nvmlProcessInfo_t *infos)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!infoCount || (*infoCount && !infos))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	nvmlProcessInfo_t found[MAX_MPS_PIDS];
	unsigned int servers[MAX_MPS_PIDS], clients[MAX_MPS_PIDS], nservers = 0, n = 0;
	int count = fake_mps_processes(fake_str(ci ? ci : gpu, "uuid", ""), servers, &nservers, clients, MAX_MPS_PIDS);
	for (int i = 0; i < count; i++)
		add_process(found, &n, clients[i]);
	if (*infoCount < n) {
		*infoCount = n;
		RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
	}
	if (n)
		memcpy(infos, found, n * sizeof *found);
	*infoCount = n;
	RETURN(NVML_SUCCESS);
}

/* ---- compute mode ------------------------------------------------------------------------------ */

/* "computeMode" in the state; "Under Linux it is not persistent across reboots and always resets to
 * Default" (nvmlDeviceSetComputeMode), so absent means NVML_COMPUTEMODE_DEFAULT. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!mode)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	*mode = (nvmlComputeMode_t)fake_int(ci ? ci : gpu, "computeMode", NVML_COMPUTEMODE_DEFAULT);
	RETURN(NVML_SUCCESS);
}

/* INVALID_ARGUMENT "if device is invalid or mode is invalid" (EXCLUSIVE_THREAD: "Support Removed");
 * "If MIG is enabled on a GPU, device must be MIG device handle" (NOT_SUPPORTED otherwise). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode)
{
	ENTER();
	if (mode != NVML_COMPUTEMODE_DEFAULT && mode != NVML_COMPUTEMODE_PROHIBITED &&
	    mode != NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	struct fake_handle *h = fake_check(device);
	if (!h || (h->kind != K_GPU && h->kind != K_MIG))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *state = fake_mutate_begin(), *gpu = NULL, *gi = NULL, *ci = NULL;
	if (!state)
		RETURN(NVML_ERROR_UNKNOWN);
	nvmlReturn_t rc = fake_device(device, state, &gpu, &gi, &ci);
	if (rc == NVML_SUCCESS && !ci && fake_mig_enabled(gpu))
		rc = NVML_ERROR_NOT_SUPPORTED;
	json_t *target = ci ? ci : gpu;
	int changed = rc == NVML_SUCCESS && fake_int(target, "computeMode", NVML_COMPUTEMODE_DEFAULT) != mode;
	if (changed)
		json_object_set_new(target, "computeMode", json_integer(mode));
	fake_mutate_end(state, changed);
	RETURN(rc);
}

/* ---- MIG mode ----------------------------------------------------------------------------------- */

static int mig_capable(json_t *gpu) { return fake_bool(gpu, "migCapable") && json_is_object(json_object_get(gpu, "mig")); }

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
	ENTER();
	DEVICE_OR_RETURN(device);
	if (!currentMode || !pendingMode || ci)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	if (!mig_capable(gpu))
		RETURN(NVML_ERROR_NOT_SUPPORTED); /* "If \a device doesn't support MIG mode" */
	*currentMode = (unsigned int)fake_int(gpu, "migCurrent", 0);
	*pendingMode = (unsigned int)fake_int(gpu, "migPending", 0);
	RETURN(NVML_SUCCESS);
}

/* nvmlDeviceSetMigMode: the mode becomes pending; "On certain platforms like pass-through
 * virtualization, where reset functionality may not be exposed directly, VM reboot is required.
 * activationStatus would return NVML_ERROR_RESET_REQUIRED for such cases" (state
 * "pendingModeChanges"); "if device unbind fails because the device isn't idle, NVML_ERROR_IN_USE
 * would be returned" (a busy GPU: pending until `sharing sim reset`); otherwise it applies at once.
 * MIG cannot be disabled while GPU instances exist: IN_USE (MIG user guide, "Disable MIG": destroy
 * the instances first, https://docs.nvidia.com/datacenter/tesla/mig-user-guide/). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus)
{
	ENTER();
	if (!activationStatus || (mode != NVML_DEVICE_MIG_DISABLE && mode != NVML_DEVICE_MIG_ENABLE))
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	struct fake_handle *h = fake_check(device);
	if (!h || h->kind != K_GPU)
		RETURN(NVML_ERROR_INVALID_ARGUMENT);
	json_t *state = fake_mutate_begin();
	if (!state)
		RETURN(NVML_ERROR_UNKNOWN);
	json_t *gpu = fake_gpu(state, h->gpu);
	nvmlReturn_t rc = NVML_SUCCESS;
	if (!gpu)
		rc = NVML_ERROR_INVALID_ARGUMENT;
	else if (fake_bool(gpu, "lost"))
		rc = NVML_ERROR_GPU_IS_LOST;
	else if (!mig_capable(gpu))
		rc = NVML_ERROR_NOT_SUPPORTED;
	else if (mode == NVML_DEVICE_MIG_DISABLE && json_array_size(json_object_get(gpu, "gpuInstances")))
		rc = NVML_ERROR_IN_USE;
	if (rc != NVML_SUCCESS) {
		fake_mutate_end(state, 0);
		RETURN(rc);
	}
	json_object_set_new(gpu, "migPending", json_integer(mode));
	*activationStatus = NVML_SUCCESS;
	if (fake_int(gpu, "migCurrent", 0) != mode) {
		if (fake_bool(state, "pendingModeChanges"))
			*activationStatus = NVML_ERROR_RESET_REQUIRED;
		else if (fake_gpu_busy(gpu))
			*activationStatus = NVML_ERROR_IN_USE;
		else
			json_object_set_new(gpu, "migCurrent", json_integer(mode));
	}
	fake_mutate_end(state, 1);
	RETURN(NVML_SUCCESS);
}
