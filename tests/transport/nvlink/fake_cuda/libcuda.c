/* A stand-in for libcuda.so.1, for the C steps' tests on machines without a GPU
 * (tests/transport/nvlink/test_nvlink_lander_c.py): an "event" is the address of a uint64 flag in host
 * memory that the test sets -- 0 running, 1 completed, 2 failed (a CUDA error) -- and every other
 * entry point the native module resolves succeeds doing nothing. Primary-context retains and
 * releases are counted (fake_retained, fake_released), and so are event queries (fake_queries).
 *
 * With fake_logging set, the calls that enqueue work -- context switches, stream waits, event
 * records, copies, launches -- go to fake_log (fake_logged entries, FAKE_LOG at most), a launch's
 * parameters read at the sizes in fake_param_sizes; the call numbered fake_fail_at (from 1,
 * counting logged calls; 0: none) fails with CUresult 1. */
#include <stdint.h>
#include <string.h>

typedef int CUresult;

int fake_retained = 0, fake_released = 0;
long fake_queries = 0;  /* cuEventQuery calls */

#define FAKE_LOG 4096
enum { CTX = 1, WAIT = 2, RECORD = 3, COPY = 4, LAUNCH = 5 };
typedef struct { uint64_t call, a[16]; } entry;
entry fake_log[FAKE_LOG];
int fake_logged = 0, fake_logging = 0, fake_fail_at = 0;
int fake_param_sizes[16];

static CUresult logged(uint64_t call, const uint64_t *a, int n) {
    if (!fake_logging || fake_logged >= FAKE_LOG)
        return 0;
    entry *e = &fake_log[fake_logged++];
    memset(e, 0, sizeof *e);
    e->call = call;
    memcpy(e->a, a, n * sizeof *a);
    return fake_logged == fake_fail_at ? 1 : 0;
}

CUresult cuEventQuery(void *event) {
    __atomic_add_fetch(&fake_queries, 1, __ATOMIC_RELAXED);
    uint64_t v = __atomic_load_n((volatile uint64_t *)event, __ATOMIC_ACQUIRE);
    return v == 1 ? 0 : v == 2 ? 700 /* CUDA_ERROR_ILLEGAL_ADDRESS */ : 600 /* CUDA_ERROR_NOT_READY */;
}
CUresult cuCtxSetCurrent(void *ctx) {
    uint64_t a[1] = {(uintptr_t)ctx};
    return logged(CTX, a, 1);
}
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
CUresult cuMemcpyAsync(uint64_t dst, uint64_t src, uint64_t n, void *stream) {
    uint64_t a[4] = {dst, src, n, (uintptr_t)stream};
    return logged(COPY, a, 4);
}
CUresult cuEventCreate(void) { return 0; }
CUresult cuEventDestroy_v2(void) { return 0; }
CUresult cuEventRecord(void *event, void *stream) {
    uint64_t a[2] = {(uintptr_t)event, (uintptr_t)stream};
    return logged(RECORD, a, 2);
}
CUresult cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    uint64_t a[2] = {(uintptr_t)stream, (uintptr_t)event};
    return logged(WAIT, a, 2);
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
    uint64_t a[16] = {(uintptr_t)f, gx, bx, shared, (uintptr_t)stream};
    for (int i = 0; i < 11 && fake_param_sizes[i]; i++)
        a[5 + i] = fake_param_sizes[i] == 8 ? *(uint64_t *)params[i] : (uint64_t)(int64_t)*(int32_t *)params[i];
    return logged(LAUNCH, a, 16);
}
