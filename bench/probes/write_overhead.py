"""Probe (one-off measurement, not a test): where the host time of one NVLink write goes.

Usage: python3 bench/probes/write_overhead.py [TOKENS] (two GPUs).

Prints: the medians of the host steps of the general path of ``peer.write_strided`` (all of
it before the direct path) (bounds, route, pinned allocation, table build, plan, upload, launch + event, wait),
a cProfile of whole writes, the cost of a few raw CUDA calls, and how late a host thread sees
an event that completed (a spinning ``cudaEventQuery`` loop against ``cudaEventSynchronize``
on a spin and on a blocking-sync event)."""
import cProfile
import pstats
import statistics
import sys
import threading
import time

import numpy as np
import torch

from transport.base import StridedBatch
from transport.nvlink import NvlinkEngine
from kvtransfer.benchmarks._remote import RemoteBuffers, make_transport


def med_us(xs):
    return statistics.median(xs) * 1e6


def setup(tokens, page=1, layers=80, heads=8, head_dim=128):
    token_bytes = heads * head_dim * 2
    pool = 2 * tokens
    remote = RemoteBuffers(1, ("nvlink",))
    dst = remote.alloc([pool * token_bytes] * (2 * layers), 0x5A)
    tr = make_transport("nvlink")
    src = []
    keep = []
    for _ in range(2 * layers):
        t = torch.empty(pool * token_bytes, dtype=torch.uint8, device="cuda:0")
        keep.append(t)
        src.append(tr.register_tensor(t))
    peer = tr.connect(remote.export()["nvlink"])
    rng = np.random.default_rng(0)
    row = page * token_bytes
    sp = rng.choice(np.arange(1, pool // page), tokens // page, replace=False)
    dp = rng.choice(np.arange(1, pool // page), tokens // page, replace=False)
    sb = StridedBatch.of(np.asarray(src), 0, row, np.asarray(dst), 0, row, row, sp, dp)
    return remote, tr, peer, sb, keep


def steps(tr, peer, sb, reps=30):
    from transport.nvlink import prepare as jobs
    from transport.nvlink import kernel as kern

    t = {k: [] for k in ("bounds", "route", "pinned", "table", "plan", "upload", "enqueue", "wait", "total")}
    cfg = peer._config
    for _ in range(reps):
        t0 = time.perf_counter()
        peer.tables.check_bounds(sb)
        t1 = time.perf_counter()
        peer._route.lane_for(NvlinkEngine.KERNEL, sb.nbytes, len(sb), int(sb.length.max()))
        t2 = time.perf_counter()
        host = torch.empty(kern.strided_table_size(sb.num_pairs, sb.num_slots), dtype=torch.int64, pin_memory=True)
        t3 = time.perf_counter()
        table = peer.tables.strided_table(sb, out=host.numpy(), checked=True)
        t4 = time.perf_counter()
        plan = peer.tables.strided_plan(sb, table)
        t5 = time.perf_counter()
        job = jobs.PreparedWrite(peer._post_job, host, lambda td, dev, st, b=0, e=None, stage=None: kern.scatter_strided(
            td, sb.num_pairs, sb.num_slots, plan, dev, cfg.kernel.num_warps, checked=True, stream=st), sb.nbytes)
        dev_tables = peer._copy.upload(job)
        t6 = time.perf_counter()
        ev = peer._copy.enqueue(job, dev_tables)
        t7 = time.perf_counter()
        while not ev.query():
            pass
        t8 = time.perf_counter()
        for k, a, b in (("bounds", t0, t1), ("route", t1, t2), ("pinned", t2, t3), ("table", t3, t4),
                        ("plan", t4, t5), ("upload", t5, t6), ("enqueue", t6, t7), ("wait", t7, t8),
                        ("total", t0, t8)):
            t[k].append(b - a)
    return {k: med_us(v) for k, v in t.items()}


def whole(peer, sb, reps=30):
    wall = []
    for _ in range(reps):
        t0 = time.perf_counter()
        peer.write_strided(sb).wait(timeout=60)
        wall.append(time.perf_counter() - t0)
    return med_us(wall)


def event_latency(reps=20):
    """us from a spinning query loop seeing an event to a synchronize()ing thread seeing it."""
    out = {}
    for name, blocking in (("spin event sync", False), ("blocking-sync event", True)):
        lat = []
        for _ in range(reps):
            ev = torch.cuda.Event(blocking=blocking)
            torch.cuda._sleep(2_000_000)  # ~1 ms
            ev.record()
            seen = {}

            def waiter():
                ev.synchronize()
                seen["t"] = time.perf_counter()

            th = threading.Thread(target=waiter)
            th.start()
            while not ev.query():
                pass
            tq = time.perf_counter()
            th.join()
            lat.append(seen["t"] - tq)
        out[name] = med_us(lat)
    return out


def raw_costs(reps=200):
    from transport.nvlink import ipc

    api = ipc.load_api()
    s = torch.cuda.Stream()
    h = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(4096, dtype=torch.uint8, device="cuda:0")
    ev = api.event_create()
    r = {}
    for name, fn in (
        ("cudaMemcpyAsync 4 KiB H2D (api)", lambda: api.memcpy_async(d.data_ptr(), h.data_ptr(), 4096, s.cuda_stream)),
        ("cudaEventRecord (api)", lambda: api.event_record(ev, s.cuda_stream)),
        ("torch.cuda.Event()+record", lambda: torch.cuda.Event().record(s)),
        ("torch.empty pinned 64 KiB", lambda: torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)),
        ("torch.empty cuda 64 KiB", lambda: torch.empty(1 << 16, dtype=torch.uint8, device="cuda:0")),
        ("stream.wait_stream(current)", lambda: s.wait_stream(torch.cuda.current_stream())),
    ):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        r[name] = med_us(ts)
    torch.cuda.synchronize()
    return r


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    torch.cuda.set_device(0)
    remote, tr, peer, sb, keep = setup(tokens)
    try:
        for _ in range(3):
            peer.write_strided(sb).wait(timeout=60)
        print(f"write_overhead probe: {tokens} tokens page 1, {sb.num_pairs} pairs x {sb.num_slots} slots, "
              f"{sb.nbytes / 2**20:.0f} MiB")
        for k, v in steps(tr, peer, sb).items():
            print(f"  general path step {k:<8} {v:9.1f} us")
        print(f"  write_strided().wait() wall {whole(peer, sb):.1f} us "
              f"({'direct path' if hasattr(peer, 'pair_plans') else 'general path'})")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            peer.write_strided(sb).wait(timeout=60)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        for k, v in raw_costs().items():
            print(f"  raw {k:<34} {v:8.1f} us")
        for k, v in event_latency().items():
            print(f"  late by {k:<24} {v:8.1f} us")
    finally:
        tr.close()
        remote.close()


if __name__ == "__main__":
    main()
