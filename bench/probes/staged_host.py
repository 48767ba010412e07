"""Probe (one-off measurement, not a test): where a staged write's host time goes, step by step.

Usage:
    python3 bench/probes/staged_host.py [--tokens T] [--page P] [--reps N] [--peer-gpu G]

A Llama-3-70B-shaped request (80 layers x K, V: 160 buffer pairs, 2 KiB token rows, ``T``
tokens in pages of ``P``) written with ``write_strided(engine=NvlinkEngine.STAGED)`` from an
nvlink transport on GPU 0 into a receiver process on GPU ``G`` (0: a loopback lane inside one
GPU, where the copy engine's part is short and the host's shows). Each write is waited for
before the next. Prints the medians, in microseconds from the call, of the steps the write
took -- on the direct path (since the staged pairs went resident): the chunks ``cut``
(``PairPlan.cuts``); on the general path (a tree before that): the tables ``uploaded`` (to
both GPUs, after ``prepare`` built them); then, either way, the pipeline ``enqueued``
(``StagedLane.run``: per chunk a gather, a copy-engine copy, a scatter and their events; ``enqueued
in C`` where ``StagedLane.run_native`` did it in one call of C), the
call ``returned`` and the transfer ``done`` (``wait()``) -- the number of chunks, the GPU time of
the pipeline (timing events on the writer's copy stream before its first gather and after the
lane's last scatter), and the same write's GPU time when a ``PreparedWrite`` is posted again
(its tables resident, nothing but the pipeline posted).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

from transport.base import StridedBatch
from transport.nvlink import NvlinkConfig, NvlinkEngine, NvlinkTransport
from transport.nvlink import direct
from transport.nvlink.staged import StagedLane
from kvtransfer.benchmarks._remote import RemoteBuffers

LAYERS, ROW = 80, 2048


class Stamps:
    """Host times of the steps of the write in progress, by name."""

    def __init__(self):
        self.now: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str, entered: str = "") -> None:
        """Stamp ``label`` when ``owner.name`` returns (and ``entered`` when it is called)."""
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            if entered:
                self.now[entered] = time.perf_counter()
            out = real(*args, **kwargs)
            self.now[label] = time.perf_counter()
            return out

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--peer-gpu", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top calls of the writes")
    ap.add_argument("--python-steps", action="store_true", help="NvlinkConfig(native=False): no C steps")
    args = ap.parse_args()

    torch.cuda.set_device(0)
    pool = 2 * args.tokens
    remote = RemoteBuffers(args.peer_gpu)
    t = NvlinkTransport(NvlinkConfig(engine=NvlinkEngine.STAGED, native=not args.python_steps))
    src = []
    for _ in range(2 * LAYERS):
        buf = torch.randint(0, 256, (pool * ROW,), dtype=torch.uint8, device="cuda:0")
        src.append((t.register_tensor(buf), buf))
    dst = remote.alloc([pool * ROW] * (2 * LAYERS), 0)
    peer = t.connect(remote.export()["nvlink"])
    rng = np.random.default_rng(0)
    pages = pool // args.page
    src_pages = rng.permutation(pages)[: args.tokens // args.page]
    dst_pages = rng.permutation(pages)[: args.tokens // args.page]
    row = ROW * args.page
    sb = StridedBatch.of([r for r, _ in src], 0, row, dst, 0, row, row, src_pages, dst_pages)

    stamps = Stamps()
    stamps.wrap(direct.CopyStream, "upload", "uploaded")
    if hasattr(direct.PairPlan, "cuts"):
        stamps.wrap(direct.PairPlan, "cuts", "cut")
        stamps.wrap(direct.SlotRing, "stage", "slots staged")
        stamps.wrap(StagedLane, "_ensure", "buffers checked")
    c_steps = t._native_steps()
    if c_steps is not None and hasattr(c_steps, "pipeline"):  # inside the C calls (module attributes can be replaced)
        stamps.wrap(c_steps, "upload_after", "slots uploaded")
        stamps.wrap(c_steps, "pipeline", "C returned", entered="C called")
    gpu = []  # [(start event, done event)] of the pipeline
    chunks = []

    def timed(real, label: str, bounds_at: int):
        def run(lane, *args, **kw):
            stream, bounds = args[bounds_at - 1], args[bounds_at]
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            done = real(lane, *args, **kw)
            stamps.now[label] = time.perf_counter()
            end = torch.cuda.Event(enable_timing=True)
            end.record(lane.scatter_stream)
            gpu.append((start, end))
            chunks.append(int(bounds.size - 1))
            return done
        return run

    StagedLane.run = timed(StagedLane.run, "enqueued", 1)
    if hasattr(StagedLane, "run_native"):  # (native, gather stream, bounds, ...): the pipeline in one C call
        StagedLane.run_native = timed(StagedLane.run_native, "enqueued in C", 2)
    steps: dict[str, list] = {}
    profile = cProfile.Profile() if args.profile else None
    for rep in range(args.reps + 3):
        if profile is not None and rep == 3:
            profile.enable()
        stamps.now.clear()
        t0 = time.perf_counter()
        tr = peer.write_strided(sb, engine=NvlinkEngine.STAGED)
        returned = time.perf_counter()
        tr.wait(timeout=60)
        done = time.perf_counter()
        if not (stamps.now.get("enqueued") or stamps.now.get("enqueued in C")):
            raise SystemExit(f"the staged engine is off for this peer: {peer.staged_error}")
        if rep >= 3:
            for k, v in sorted(stamps.now.items(), key=lambda kv: kv[1]) + [("returned", returned), ("done", done)]:
                steps.setdefault(k, []).append((v - t0) * 1e6)
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    pipeline_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in gpu[3:])
    with peer.prepare(sb, engine=NvlinkEngine.STAGED) as job:  # resident tables: the pipeline alone
        job.post().wait(timeout=60)
        gpu.clear()
        for _ in range(args.reps):
            job.post().wait(timeout=60)
        resident_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in gpu)
    mib = int(sb.nbytes) / 2**20
    print(f"staged write_strided, {args.tokens} tokens, page {args.page}: {sb.num_pairs} pairs x {sb.num_slots} slots, "
          f"{mib:.0f} MiB, {chunks[-1]} chunks, cuda:0 -> cuda:{args.peer_gpu}; medians of {args.reps}, us from the call")
    print("  " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in steps.items()))
    print(f"  pipeline on the GPU {pipeline_us:.1f} (first gather to last scatter; tables resident and only the "
          f"pipeline posted: {resident_us:.1f})")
    peer.close()
    t.close()
    remote.close()


if __name__ == "__main__":
    main()
