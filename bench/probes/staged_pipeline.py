"""Probe (one-off measurement, not a test): The staged scheme with hand-written CUDA kernels: gather on GPU0, copy engine, scatter on GPU1.

Usage: python3 bench/probes/staged_pipeline.py ROW_BYTES TOTAL_BYTES (needs cupy).

Results on 2x H200: bench/RESULTS.md ("Staged engine: why and when")."""
import sys, time
import numpy as np
import cupy as cp


GS = r"""
extern "C" __global__ void gather(const char* __restrict__ src, char* __restrict__ stage,
    const long long* __restrict__ soff, int nrows, int row_bytes)
{
  int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int nvec = row_bytes / 16;
  for (long long r = (long long)blockIdx.x * warps + warp; r < nrows; r += (long long)gridDim.x * warps) {
    const int4* s = (const int4*)(src + soff[r]);
    int4* d = (int4*)(stage + r * row_bytes);
    for (int i = lane; i < nvec; i += 32) d[i] = s[i];
  }
}
extern "C" __global__ void scatter(const char* __restrict__ stage, char* __restrict__ dst,
    const long long* __restrict__ doff, int nrows, int row_bytes)
{
  int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int nvec = row_bytes / 16;
  for (long long r = (long long)blockIdx.x * warps + warp; r < nrows; r += (long long)gridDim.x * warps) {
    const int4* s = (const int4*)(stage + r * row_bytes);
    int4* d = (int4*)(dst + doff[r]);
    for (int i = lane; i < nvec; i += 32) d[i] = s[i];
  }
}
"""

def main():
    row = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    total = int(float(sys.argv[2])) if len(sys.argv) > 2 else (2 << 30)
    n = total // row
    nbytes = n * row
    cp.cuda.Device(0).use()
    cp.cuda.runtime.deviceEnablePeerAccess(1)
    rng = np.random.default_rng(0)
    soff_h = rng.permutation(n).astype(np.int64) * row
    doff_h = rng.permutation(n).astype(np.int64) * row
    with cp.cuda.Device(1):
        cp.cuda.runtime.deviceEnablePeerAccess(0)
        dst = cp.zeros(nbytes, dtype=cp.uint8)
        dstc = cp.zeros(nbytes, dtype=cp.uint8)
        s1 = cp.cuda.Stream(non_blocking=True)
        scat = cp.RawModule(code=GS, options=("--gpu-architecture=sm_90",)).get_function("scatter")
        doff = cp.asarray(doff_h)
        stage1 = [cp.empty(256 << 20, dtype=cp.uint8) for _ in range(3)]
        ev1 = [cp.cuda.Event(disable_timing=True) for _ in range(3)]
    src = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    soff = cp.asarray(soff_h)
    gath = cp.RawModule(code=GS, options=("--gpu-architecture=sm_90",)).get_function("gather")
    stage0 = [cp.empty(256 << 20, dtype=cp.uint8) for _ in range(3)]
    sg, sc = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    evg = [cp.cuda.Event(disable_timing=True) for _ in range(3)]
    evc = [cp.cuda.Event(disable_timing=True) for _ in range(3)]
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    with cp.cuda.Device(1):
        eend = cp.cuda.Event(disable_timing=True)
    gb = lambda ms: nbytes / ms / 1e6
    def timed(fn, reps=5):
        fn(); cp.cuda.Device(0).synchronize(); cp.cuda.Device(1).synchronize()
        ts = []
        for _ in range(reps):
            e0.record(sg); fn(); e1.record(sg); e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(ts))
    t_ce = timed(lambda: cp.cuda.runtime.memcpyPeerAsync(dstc.data.ptr, 1, src.data.ptr, 0, nbytes, sg.ptr))
    print(f"row {row}: CE peer {gb(t_ce):.1f} GB/s", flush=True)
    def staged(chunk_bytes, nbuf, gblocks, sblocks):
        rows_per = chunk_bytes // row
        chunks = (n + rows_per - 1) // rows_per
        sc.wait_event(e0)
        with cp.cuda.Device(1):
            s1.wait_event(e0)
        for i in range(chunks):
            a, b = i * rows_per, min(n, (i + 1) * rows_per)
            k = i % nbuf
            if i >= nbuf:
                sg.wait_event(evc[k])          # staging0[k] free once its copy is done
            gath((gblocks,), (256,), (src, stage0[k], soff[a:b], np.int32(b - a), np.int32(row)), stream=sg)
            evg[k].record(sg)
            sc.wait_event(evg[k])
            if i >= nbuf:
                sc.wait_event(ev1[k])          # staging1[k] free once scattered
            cp.cuda.runtime.memcpyPeerAsync(stage1[k].data.ptr, 1, stage0[k].data.ptr, 0, (b - a) * row, sc.ptr)
            evc[k].record(sc)
            with cp.cuda.Device(1):
                s1.wait_event(evc[k])
                scat((sblocks,), (256,), (stage1[k], dst, doff[a:b], np.int32(b - a), np.int32(row)), stream=s1)
                ev1[k].record(s1)
        with cp.cuda.Device(1):
            eend.record(s1)
        sg.wait_event(eend)
    for chunk in (16 << 20, 64 << 20, 256 << 20):
        for nbuf in (2, 3):
            for blocks in (16, 32, 132):
                t0 = time.perf_counter()
                t = timed(lambda: staged(chunk, nbuf, blocks, blocks))
                host = (time.perf_counter() - t0) / 6 * 1e3
                sample = rng.choice(n, 4096, replace=False)
                want = cp.asnumpy(src.reshape(n, row)[cp.asarray(soff_h[sample] // row)])
                with cp.cuda.Device(1):
                    got = cp.asnumpy(dst.reshape(n, row)[cp.asarray(doff_h[sample] // row)])
                    dst.fill(0); cp.cuda.Device(1).synchronize()
                print(f"  staged chunk {chunk >> 20} MiB x{nbuf} bufs, {blocks} blocks: {gb(t):.1f} GB/s = {t_ce/t*100:.1f}%  ok={bool((got == want).all())} host {host:.1f} ms/call", flush=True)
main()
