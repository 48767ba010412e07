"""Probe (one-off measurement, not a test): Which GPUs can use a CUDA IPC mapping: opened under the local GPU, the owning GPU, or both.

Usage: PYTHONPATH=. python3 bench/probes/ipc_two_devices.py (two GPUs; cupy).

Results on 2x H200: bench/RESULTS.md ("Staged engine: why and when")."""
import multiprocessing as mp
import cupy as cp
import torch
from transport.nvlink import ipc as cuda_ipc

N = 1 << 20

def fill(ptr, device, value, off):
    with cp.cuda.Device(device):
        mem = cp.cuda.UnownedMemory(ptr + off, N, None, device_id=device)
        a = cp.ndarray((N,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
        a.fill(value)
        cp.cuda.Device(device).synchronize()

def writer(case, handle, offset, q):
    try:
        api = cuda_ipc.load_api()
        torch.cuda.init()
        for d in (0, 1):
            with cp.cuda.Device(d):
                try:
                    cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
                except Exception:
                    pass
        log = []
        if case == "open0_run0":
            p = cuda_ipc.open_handle(api, handle, 0) + offset; fill(p, 0, 11, 0); log.append("ok")
        elif case == "open0_run1":
            p = cuda_ipc.open_handle(api, handle, 0) + offset; fill(p, 1, 12, N); log.append("ok")
        elif case == "open1_run1":
            p = cuda_ipc.open_handle(api, handle, 1) + offset; fill(p, 1, 13, 2 * N); log.append("ok")
        elif case == "open_both":
            p0 = cuda_ipc.open_handle(api, handle, 0) + offset
            log.append("opened0")
            p1 = cuda_ipc.open_handle(api, handle, 1) + offset
            log.append(f"opened1 same={p0 == p1}")
            fill(p0, 0, 14, 3 * N); log.append("ran0")
            fill(p1, 1, 15, 4 * N); log.append("ran1")
        q.put((case, " ".join(log)))
    except Exception as e:
        q.put((case, f"{' '.join(log) if 'log' in dir() else ''} FAILED {type(e).__name__}: {str(e)[:200]}"))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    api = cuda_ipc.load_api()
    buf = torch.zeros(6 * N, dtype=torch.uint8, device="cuda:1")
    exp = cuda_ipc.export_region(api, buf.data_ptr(), buf.numel(), 1)
    for i, case in enumerate(["open0_run0", "open1_run1", "open_both", "open0_run1"]):
        q = ctx.Queue()
        p = ctx.Process(target=writer, args=(case, exp.handle, exp.offset, q))
        p.start(); p.join(120)
        res = q.get(timeout=5) if not q.empty() else (case, f"no result, exit {p.exitcode}")
        torch.cuda.synchronize(1)
        vals = [int(buf[k * N: (k + 1) * N].float().mean().item()) for k in range(5)]
        print(res, "slices:", vals, flush=True)
