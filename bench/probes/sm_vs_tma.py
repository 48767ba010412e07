"""Probe (one-off measurement, not a test): GPU0 -> GPU1 rows at random places: 16-byte SM stores vs TMA bulk copies (cp.async.bulk) vs the copy engine.

Usage (a 2-GPU machine with cupy): python3 bench/probes/sm_vs_tma.py ROW_BYTES TOTAL_BYTES, e.g. 2048 2e9.

Results on 2x H200: bench/RESULTS.md ("Staged engine: why and when")."""
import sys
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

def main():
    row = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    total = int(float(sys.argv[2])) if len(sys.argv) > 2 else (2 << 30)
    n = total // row
    cp.cuda.Device(0).use()
    cp.cuda.runtime.deviceEnablePeerAccess(1)
    with cp.cuda.Device(1):
        cp.cuda.runtime.deviceEnablePeerAccess(0)
        dst = cp.zeros(n * row, dtype=cp.uint8)
        dstc = cp.zeros(total, dtype=cp.uint8)
    src = cp.random.randint(0, 255, n * row, dtype=cp.uint8)
    rng = np.random.default_rng(0)
    soff = cp.asarray(rng.permutation(n).astype(np.int64) * row)
    doff = cp.asarray(rng.permutation(n).astype(np.int64) * row)
    s0 = cp.cuda.Stream(non_blocking=True)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    def timed(fn, reps=5):
        fn(); s0.synchronize()
        ts = []
        for _ in range(reps):
            e0.record(s0); fn(); e1.record(s0); e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(ts))
    nbytes = n * row
    def ce():
        cp.cuda.runtime.memcpyPeerAsync(dstc.data.ptr, 1, src.data.ptr, 0, nbytes, s0.ptr)
    t_ce = timed(ce)
    gb = lambda ms: nbytes / ms / 1e6
    print(f"row {row} B rows {n} bytes {nbytes}: copy engine peer {gb(t_ce):.1f} GB/s", flush=True)
    soff_h = cp.asnumpy(soff) // row; doff_h = cp.asnumpy(doff) // row
    sample = rng.choice(n, size=min(n, 20000), replace=False)
    want = cp.asnumpy(src.reshape(n, row)[cp.asarray(soff_h[sample])])
    def check(name):
        with cp.cuda.Device(1):
            got = cp.asnumpy(dst.reshape(n, row)[cp.asarray(doff_h[sample])])
            dst.fill(0)
            cp.cuda.Device(1).synchronize()
        return bool((got == want).all())
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    for stages in (2, 4, 8):
        mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-DSTAGES={stages}", "--gpu-architecture=sm_90"))
        smk, tma = mod.get_function("sm_rows"), mod.get_function("tma_rows")
        if stages == 4:
            for warps, blocks_per_sm in ((8, 4), (16, 2), (4, 8)):
                f = lambda: smk((sms * blocks_per_sm,), (warps * 32,), (src, dst, soff, doff, np.int32(n), np.int32(row)), stream=s0)
                t = timed(f); ok = check("sm")
                print(f"  sm int4 warps {warps} x {blocks_per_sm}/SM: {gb(t):.1f} GB/s = {t_ce/t*100:.1f}% ok={ok}", flush=True)
        for group_bytes in (8 << 10, 16 << 10, 32 << 10):
            grp = max(1, group_bytes // row)
            smem = stages * grp * row
            if smem > 200 << 10:
                continue
            tma.max_dynamic_shared_size_bytes = smem
            for bps in (1, 2, 4, 8):
                if bps * (smem + 1024) > 227 << 10:
                    continue
                f = lambda: tma((sms * bps,), (32,), (src, dst, soff, doff, np.int32(n), np.int32(row), np.int32(grp)), stream=s0, shared_mem=smem)
                try:
                    t = timed(f); ok = check("tma")
                except Exception as e:
                    print("  tma failed", stages, grp, bps, e); return
                print(f"  tma stages {stages} group {grp} rows ({grp*row>>10} KiB) {bps}/SM: {gb(t):.1f} GB/s = {t_ce/t*100:.1f}% ok={ok}", flush=True)

if __name__ == "__main__":
    main()
