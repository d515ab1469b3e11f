/* nvidia-smi stand-in over the fake libnvidia-ml.so.1: `nvidia-smi -L` lists the GPUs and MIG
 * devices in nvidia-smi's own format ("GPU 0: NAME (UUID: GPU-...)", "  MIG 1g.5gb  Device  0:
 * (UUID: MIG-...)"); any other use prints the driver version and the GPU list. */
#include <stdio.h>
#include <string.h>

#include "nvml.h"

static int fail(const char *what, nvmlReturn_t rc)
{
	fprintf(stderr, "%s: %s\n", what, nvmlErrorString(rc));
	return rc == NVML_ERROR_DRIVER_NOT_LOADED ? 9 : 255;
}

int main(int argc, char **argv)
{
	nvmlReturn_t rc = nvmlInit_v2();
	if (rc != NVML_SUCCESS)
		return fail("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", rc);
	int list = argc > 1 && strcmp(argv[1], "-L") == 0;
	if (!list) {
		char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "";
		nvmlSystemGetDriverVersion(version, sizeof version);
		printf("NVIDIA-SMI (gpu-sharing fake driver)   Driver Version: %s\n", version);
	}
	unsigned int count = 0;
	nvmlDeviceGetCount_v2(&count);
	for (unsigned int i = 0; i < count; i++) {
		nvmlDevice_t gpu;
		char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "", uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
		if (nvmlDeviceGetHandleByIndex_v2(i, &gpu) != NVML_SUCCESS)
			continue;
		if ((rc = nvmlDeviceGetName(gpu, name, sizeof name)) != NVML_SUCCESS) {
			printf("GPU %u: Unable to determine the device handle: %s\n", i, nvmlErrorString(rc));
			continue;
		}
		nvmlDeviceGetUUID(gpu, uuid, sizeof uuid);
		printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
		unsigned int max = 0;
		nvmlDeviceGetMaxMigDeviceCount(gpu, &max);
		for (unsigned int m = 0; m < max; m++) {
			nvmlDevice_t mig;
			if (nvmlDeviceGetMigDeviceHandleByIndex(gpu, m, &mig) != NVML_SUCCESS)
				continue;
			nvmlDeviceGetName(mig, name, sizeof name);
			nvmlDeviceGetUUID(mig, uuid, sizeof uuid);
			const char *profile = strstr(name, "MIG ");
			printf("  %s Device %2u: (UUID: %s)\n", profile ? profile : name, m, uuid);
		}
	}
	nvmlShutdown();
	return 0;
}
