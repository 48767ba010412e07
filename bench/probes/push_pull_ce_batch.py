"""Probe (one-off measurement, not a test): GPU0 -> GPU1 rows: push kernel, pull kernel (on GPU1), both at once, and cudaMemcpyBatchAsync.

Usage: python3 bench/probes/push_pull_ce_batch.py ROW_BYTES TOTAL_BYTES (needs cupy and cuda-python).

Results on 2x H200: bench/RESULTS.md ("Staged engine: why and when")."""
import sys, time
import numpy as np
import cupy as cp

from sm_vs_tma import SRC  # the push and TMA kernels (run from bench/probes/ or with it on sys.path)


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
