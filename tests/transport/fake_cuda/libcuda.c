/* A stand-in for libcuda.so.1, for the C lander's tests on machines without a GPU
 * (tests/transport/test_nvlink_lander_c.py): an "event" is the address of a uint64 flag in host
 * memory that the test sets -- 0 running, 1 completed, 2 failed (a CUDA error) -- and every other
 * entry point the native module resolves succeeds doing nothing. Primary-context retains and
 * releases are counted (fake_retained, fake_released). */
#include <stdint.h>

typedef int CUresult;

int fake_retained = 0, fake_released = 0;

CUresult cuEventQuery(void *event) {
    uint64_t v = __atomic_load_n((volatile uint64_t *)event, __ATOMIC_ACQUIRE);
    return v == 1 ? 0 : v == 2 ? 700 /* CUDA_ERROR_ILLEGAL_ADDRESS */ : 600 /* CUDA_ERROR_NOT_READY */;
}
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) {
    __atomic_add_fetch(&fake_retained, 1, __ATOMIC_SEQ_CST);
    *ctx = (void *)(uintptr_t)(device + 1);
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int device) {
    __atomic_add_fetch(&fake_released, 1, __ATOMIC_SEQ_CST);
    return 0;
}
CUresult cuGetErrorName(CUresult code, const char **name) { *name = "FAKE_ERROR"; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = 0; return 0; }
CUresult cuCtxGetDevice(int *device) { *device = 0; return 0; }
CUresult cuMemcpyHtoDAsync_v2(void) { return 0; }
CUresult cuEventCreate(void) { return 0; }
CUresult cuEventDestroy_v2(void) { return 0; }
CUresult cuEventRecord(void) { return 0; }
CUresult cuStreamWaitEvent(void) { return 0; }
CUresult cuLaunchKernel(void) { return 0; }
