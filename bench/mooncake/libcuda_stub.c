/* A stand-in libcuda.so.1 for machines without a GPU driver, so that Mooncake's Transfer Engine
 * (whose wheel links the driver) loads for its tcp transport, which never calls it. Every entry
 * point the engine links answers CUDA_ERROR_NO_DEVICE (100); the error strings say why. */
#define CUDA_ERROR_NO_DEVICE 100

static const char *const why = "no CUDA driver on this machine (kvtransfer's stand-in libcuda.so.1)";

int cuGetErrorName(int error, const char **name) { (void)error; *name = why; return 0; }
int cuGetErrorString(int error, const char **text) { (void)error; *text = why; return 0; }

#define NO_DEVICE(name) int name(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuInit)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuGetProcAddress)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)
