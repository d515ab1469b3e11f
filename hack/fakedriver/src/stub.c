/* libcuda.so.1 / libnvidia-ptxjitcompiler.so.1 stand-ins: real shared objects a CDI spec can list
 * and a container can dlopen, with no CUDA in them. cuInit answers CUDA_ERROR_NO_DEVICE (100,
 * cuda.h), the honest answer of a machine without NVIDIA hardware. */
__attribute__((visibility("default"))) int cuInit(unsigned int flags)
{
	(void)flags;
	return 100;
}

__attribute__((visibility("default"))) int cuDriverGetVersion(int *version)
{
	if (!version)
		return 1; /* CUDA_ERROR_INVALID_VALUE */
	*version = 13000;
	return 0;
}
