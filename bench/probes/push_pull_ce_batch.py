"""Probe (one-off measurement, not a test): GPU0 -> GPU1 rows: push kernel, pull kernel (on GPU1), both at once, and cudaMemcpyBatchAsync.

Usage: python3 bench/probes/push_pull_ce_batch.py ROW_BYTES TOTAL_BYTES (needs cupy and cuda-python).

Results on 2x H200 are quoted in transport/nvlink_staged.py."""
import sys, time
import numpy as np
import cupy as cp

SRC = r'''
extern "C" __global__ void sm_rows(const char* __restrict__ src, char* __restrict__ dst,
    const long long* __restrict__ soff, const long long* __restrict__ doff, int nrows, int row_bytes)
{
  int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int nvec = row_bytes / 16;
  for (long long r = (long long)blockIdx.x * warps + warp; r < nrows; r += (long long)gridDim.x * warps) {
    const int4* s = (const int4*)(src + soff[r]);
    int4* d = (int4*)(dst + doff[r]);
    #pragma unroll 4
    for (int i = lane; i < nvec; i += 32) d[i] = s[i];
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

#ifndef STAGES
#define STAGES 4
#endif
// One thread per block drives TMA bulk copies: rows of a group land in one smem stage, then are stored.
extern "C" __global__ void tma_rows(const char* __restrict__ src, char* __restrict__ dst,
    const long long* __restrict__ soff, const long long* __restrict__ doff, int nrows, int row_bytes, int group_rows)
{
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[STAGES];
  if (threadIdx.x != 0) return;
  int ngroups = (nrows + group_rows - 1) / group_rows;
  int stage_bytes = group_rows * row_bytes;
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // my groups: g = blockIdx.x + k * gridDim.x, k = 0..
  int mine = ngroups > (int)blockIdx.x ? (ngroups - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto issue_load = [&](int k) {
    int g = blockIdx.x + k * gridDim.x, s = k % STAGES;
    int r0 = g * group_rows, r1 = min(r0 + group_rows, nrows);
    unsigned bar = smem_addr(&bars[s]);
    unsigned bytes = (unsigned)((r1 - r0) * row_bytes);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    unsigned char* st = smem + s * stage_bytes;
    for (int r = r0; r < r1; ++r)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(smem_addr(st + (r - r0) * row_bytes)), "l"(src + soff[r]), "r"(row_bytes), "r"(bar) : "memory");
  };
  for (int k = 0; k < STAGES - 1 && k < mine; ++k) issue_load(k);
  for (int k = 0; k < mine; ++k) {
    int s = k % STAGES, g = blockIdx.x + k * gridDim.x;
    unsigned bar = smem_addr(&bars[s]);
    unsigned parity = (k / STAGES) & 1;
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" :: "r"(bar), "r"(parity) : "memory");
    int r0 = g * group_rows, r1 = min(r0 + group_rows, nrows);
    unsigned char* st = smem + s * stage_bytes;
    for (int r = r0; r < r1; ++r)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
        :: "l"(dst + doff[r]), "r"(smem_addr(st + (r - r0) * row_bytes)), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k + STAGES - 1 < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue_load(k + STAGES - 1);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
'''


from cuda.bindings import runtime as rt

def main():
    row = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    total = int(float(sys.argv[2])) if len(sys.argv) > 2 else (2 << 30)
    n = total // row
    cp.cuda.Device(0).use()
    cp.cuda.runtime.deviceEnablePeerAccess(1)
    with cp.cuda.Device(1):
        cp.cuda.runtime.deviceEnablePeerAccess(0)
        dst = cp.zeros(n * row, dtype=cp.uint8)
        s1 = cp.cuda.Stream(non_blocking=True)
        mod1 = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
        pull = mod1.get_function("sm_rows")
    src = cp.random.randint(0, 255, n * row, dtype=cp.uint8)
    rng = np.random.default_rng(0)
    soff_h = rng.permutation(n).astype(np.int64) * row
    doff_h = rng.permutation(n).astype(np.int64) * row
    soff, doff = cp.asarray(soff_h), cp.asarray(doff_h)
    with cp.cuda.Device(1):
        soff1, doff1 = cp.asarray(soff_h), cp.asarray(doff_h)
    mod0 = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
    push = mod0.get_function("sm_rows")
    s0 = cp.cuda.Stream(non_blocking=True)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    with cp.cuda.Device(1):
        ee = cp.cuda.Event()
    nbytes = n * row
    gb = lambda ms: nbytes / ms / 1e6
    def timed(fn, reps=5):
        fn(); s0.synchronize(); s1.synchronize()
        ts = []
        for _ in range(reps):
            e0.record(s0); fn(); e1.record(s0); e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(ts))
    with cp.cuda.Device(1):
        dstc = cp.zeros(nbytes, dtype=cp.uint8)
    t_ce = timed(lambda: cp.cuda.runtime.memcpyPeerAsync(dstc.data.ptr, 1, src.data.ptr, 0, nbytes, s0.ptr))
    print(f"row {row}: CE peer {gb(t_ce):.1f} GB/s", flush=True)
    sms = 132
    def push_rows(a, b):
        push((sms * 4,), (256,), (src, dst, soff[a:b], doff[a:b], np.int32(b - a), np.int32(row)), stream=s0)
    def pull_rows(a, b):
        with cp.cuda.Device(1):
            pull((sms * 4,), (256,), (src, dst, soff1[a:b], doff1[a:b], np.int32(b - a), np.int32(row)), stream=s1)
    t = timed(lambda: push_rows(0, n))
    print(f"  push only {gb(t):.1f} = {t_ce/t*100:.1f}%", flush=True)
    def pull_all():
        s1.wait_event(e0); pull_rows(0, n); ee.record(s1); s0.wait_event(ee)
    t = timed(pull_all)
    print(f"  pull only {gb(t):.1f} = {t_ce/t*100:.1f}%", flush=True)
    for frac in (0.3, 0.5, 0.7):
        k = int(n * frac)
        def both():
            s1.wait_event(e0); pull_rows(k, n); push_rows(0, k); ee.record(s1); s0.wait_event(ee)
        t = timed(both)
        print(f"  push {frac:.0%} + pull rest {gb(t):.1f} = {t_ce/t*100:.1f}%", flush=True)
    # copy engine batch: rows as separate copies
    for chunk_rows in (1, 16, 64):
        m = min(n // chunk_rows, 65536)
        cb = chunk_rows * row
        sp = [src.data.ptr + int(x) for x in rng.permutation(n // chunk_rows)[:m] * cb]
        dp = [dst.data.ptr + int(x) for x in rng.permutation(n // chunk_rows)[:m] * cb]
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        def batch():
            err = rt.cudaMemcpyBatchAsync(dp, sp, [cb] * m, m, [attr], [0], 1, s0.ptr)
            if err[0] != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(str(err))
        try:
            t0 = time.perf_counter(); t = timed(batch); wall = time.perf_counter() - t0
            print(f"  CE batch {m} copies of {cb >> 10} KiB: {m * cb / t / 1e6:.1f} GB/s = {t_ce/t*100:.1f}% of CE (6 calls wall {wall*1e3:.0f} ms)", flush=True)
        except Exception as e:
            print("  CE batch failed:", repr(e)[:300], flush=True)
main()
