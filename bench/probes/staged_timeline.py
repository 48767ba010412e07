"""Probe (one-off measurement, not a test): a timeline of the staged NIXL path's chunks.

Writes one KV request of ``kvtransfer bench transport --kv`` (its planner, receiver and 64 MiB
blocks) through the staged mode only, and records, per chunk, with the host's monotonic clock
(one clock for both processes):

- sender: fill (gather queued) start and end, ready (its copies waited for), posted, its NIXL
  request seen DONE, Credit read;
- receiver: notification handled (start), scattered and answered (end).

Usage: python3 bench/probes/staged_timeline.py [--cuda [--peer-gpu G]] [--request page1|heads|demo]
       [--lanes SLOTSxBYTES,...] [--iters N] [--wire-gather BYTES]
Prints the rate against 64 MiB blocks (direct NIXL, same run), the time of each copy step on
both sides (the write's first chunk apart from the others), the medians of each step, then
the last write's timeline. ``--peer-gpu 0`` puts the receiver on the writer's GPU (one GPU: the
blocks rate is a local copy then, not NVLink; the staged path's steps are the same).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtransfer._procs import Child  # noqa: E402
from kvtransfer.benchmarks import transport as tools  # noqa: E402
from kvtransfer.benchmarks.transport_kv import REQUESTS, plan_request  # noqa: E402
from transport.base import WriteBatch  # noqa: E402

MiB = 1 << 20


def _traced_receiver(conn, total, cuda, env, staged, trace_path, gpu):
    from transport.nixl.staged import receiver as rx

    trace = []
    inner = rx.ReceiverLanes._chunk

    def chunk(self, sender, msg):
        t0 = time.monotonic()
        _CURRENT[0] = msg.index
        inner(self, sender, msg)
        trace.append((msg.seq, msg.index, t0, time.monotonic()))

    rx.ReceiverLanes._chunk = chunk
    steps = _time_steps(_staging_steps() + [(rx.ReceiverLanes, "_answer")])
    try:
        tools._receive(conn, total, cuda, env, False, staged, gpu)
    finally:
        np.save(trace_path, np.asarray(trace, dtype=np.float64).reshape(-1, 4))
        with open(trace_path + ".steps", "w") as f:
            for name, ts in steps.items():
                f.write(f"{name} {' '.join(f'{i}:{t:.6f}' for i, t in ts)}\n")


_CURRENT = [-1]  # the chunk index being handled (receiver) or filled (sender): steps are told apart by it


def _time_steps(classes):
    """Wrap the named steps (``[(owner, name)]``); returns {step: [(chunk index, seconds)]}."""
    steps = {}
    for owner, name in classes:
        inner = owner.__dict__[name]
        if isinstance(inner, classmethod):
            continue
        key = f"{owner.__name__}.{name}"
        steps[key] = []

        def timed(*a, _inner=inner, _out=steps[key], **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                _out.append((_CURRENT[0], time.perf_counter() - t0))
        setattr(owner, name, staticmethod(timed) if isinstance(inner, staticmethod) else timed)
    return steps


def _staging_steps():
    from transport.nixl.staged import copy as cp
    from transport.nixl.staged import kernel, wire

    return [(kernel.KernelStaging, n) for n in ("_get", "strided_rows", "strided_table", "stage_strided", "_upload",
                                            "_launch_strided", "ready")] + \
        [(wire.DestinationTable, "check"), (cp.HostStaging, "scatter_strided"), (cp.HostStaging, "gather_strided")]


def _print_steps(title, steps):
    print(f"{title} (ms): chunk 0 median / other chunks median / calls")
    for name, rows in steps:
        first = [1e3 * t for i, t in rows if i == 0]
        rest = [1e3 * t for i, t in rows if i > 0]
        if rows:
            print(f"  {name:40s} {statistics.median(first) if first else float('nan'):8.3f} "
                  f"{statistics.median(rest) if rest else float('nan'):8.3f} {len(rows):6d}")


def _trace_sender():
    """Patch the sender lane and staging; returns the list the records go to."""
    from transport.nixl.staged import lane as lane_mod
    from transport.nixl.staged import sender as tx
    from transport.nixl.staged.wire import Credit

    rec = []
    post, on_message = lane_mod.SenderLane._post_chunk, lane_mod.SenderLane.on_message

    def traced_fill(fill):
        def inner(self, lane, slot, index):
            t0 = time.monotonic()
            _CURRENT[0] = index
            out = fill(self, lane, slot, index)
            rec.append(("fill", self.seq, index, t0))
            rec.append(("filled", self.seq, index, time.monotonic()))
            return out
        return inner

    for kind in (tx.StagedTransfer, tx.StridedStagedTransfer):
        kind.fill = traced_fill(kind.fill)

    def _post_chunk(self, chunk, slot):
        ready = self.staging.ready

        def traced_ready(k=None):
            ready(k)
            rec.append(("ready", chunk.job.seq, chunk.index, time.monotonic()))

        self.staging.ready = traced_ready
        try:
            ok = post(self, chunk, slot)
        finally:
            del self.staging.ready
        rec.append(("posted", chunk.job.seq, chunk.index, time.monotonic()))
        return ok

    def _on_message(self, msg):
        if isinstance(msg, Credit):
            rec.append(("credit", msg.seq, msg.index, time.monotonic()))
        return on_message(self, msg)

    check = lane_mod.SenderLane._check_handles

    def _check_handles(self):
        before = [(e.job.seq, e.index, e) for e in self._inflight.values() if e.handle is not None]
        check(self)
        now = time.monotonic()
        rec.extend(("done", s, i, now) for s, i, e in before if e.handle is None)

    lane_mod.SenderLane._post_chunk, lane_mod.SenderLane.on_message = _post_chunk, _on_message
    lane_mod.SenderLane._check_handles = _check_handles
    return rec


def _lanes(text):
    out = []
    for part in text.split(","):
        slots, size = part.lower().split("x")
        mult = {"m": MiB, "k": 1024}.get(size[-1], 1)
        out.append((int(slots), int(size.rstrip("mk")) * mult))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--request", default=None, choices=tuple(REQUESTS))
    ap.add_argument("--lanes", type=_lanes, default=None, help="SLOTSxBYTES,... e.g. 4x128M,8x64M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--progress-thread", action="store_true")
    ap.add_argument("--peer-gpu", type=int, default=1, help="the receiver's GPU (0: one GPU, no NVLink)")
    ap.add_argument("--wire-gather", type=int, default=None, help="StagedNixlConfig.wire_gather_bytes")
    ap.add_argument("--profile", action="store_true", help="cProfile the sender over the timed writes")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    from transport.nixl import NixlConfig, NixlTransport
    from transport.nixl.staged import StagedNixlConfig

    req = REQUESTS[args.request or ("page1" if args.cuda else "demo")]
    kv = plan_request(req)
    block = 64 * MiB if args.cuda else 256 * 1024
    lanes = args.lanes or ([(4, 128 * MiB)] if args.cuda else [(4, 4 * MiB)])
    print(f"{req.name}: {kv.nbytes / MiB:.0f} MiB, {kv.strided.num_pairs} pairs x {kv.strided.num_slots} slots",
          flush=True)
    if args.cuda:
        import torch

        torch.cuda.set_device(0)
        src = torch.randint(0, 256, (kv.src_bytes,), dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        src_ptr, device = src.data_ptr(), 0
    else:
        src = np.random.default_rng(1).integers(0, 256, kv.src_bytes, dtype=np.uint8)
        src_ptr, device = src.ctypes.data, None
    rec = _trace_sender()
    from transport.nixl import NixlPeer

    tx_steps = _time_steps(_staging_steps() + [(NixlPeer, "write_strided")])
    total = max(kv.dst_bytes, -(-kv.nbytes // block) * block)
    for slots, slot_bytes in lanes:
        extra = {} if args.wire_gather is None else {"wire_gather_bytes": args.wire_gather}
        staged = StagedNixlConfig(slots=slots, **extra, **({"cuda_slot_bytes": slot_bytes} if args.cuda else
                                                           {"slot_bytes": slot_bytes}))
        path = os.path.join(args.out, f"rx-{slots}x{slot_bytes // MiB}M.npy")
        receiver = Child.spawn(_traced_receiver, (total, args.cuda, dict(os.environ), staged, path, args.peer_gpu), name="receiver")
        try:
            export = receiver.recv(tools.Ready, "its export", tools.READY_TIMEOUT_S).export
            ts = NixlTransport(NixlConfig(staged=staged, progress_thread=args.progress_thread))
            td = NixlTransport(NixlConfig(staged=StagedNixlConfig(enabled=False)))
            ps, pd = ts.connect(export), td.connect(export)
            (dst,) = ps.regions.values()
            sb = kv.strided_batch(ts.register(src_ptr, kv.src_bytes, device), dst.region_id)
            sid = td.register(src_ptr, kv.src_bytes, device)
            n = kv.nbytes // block
            offs = np.arange(n, dtype=np.int64) * block
            blocks = WriteBatch.of(np.full(n, sid), offs, np.full(n, dst.region_id),
                                   np.random.default_rng(2).permutation(offs), np.full(n, block))
            times = {"staged": [], "blocks": []}
            calls = []
            import cProfile
            import pstats

            prof = cProfile.Profile() if args.profile else None
            for i in range(args.iters + 1):
                if prof is not None and i == 1:
                    prof.enable()
                rec.clear()
                t0 = time.monotonic()
                tr = ps.write_strided(sb, notify=b"kv")
                t1 = time.monotonic()
                tr.wait(600)
                t2 = time.monotonic()
                pd.write(blocks, notify=b"kv").wait(600)
                t3 = time.monotonic()
                if i:
                    times["staged"].append(t2 - t0)
                    times["blocks"].append(t3 - t2)
                    calls.append(t1 - t0)
                start = t0
            last = list(rec)
            if prof is not None:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            ts.close()
            td.close()
        finally:
            receiver.stop(tools.Quit())
        rx = np.load(path)
        with open(path + ".steps") as f:
            rx_steps = [(name, [(int(i), float(t)) for i, t in (x.split(":") for x in ts)])
                        for name, *ts in (line.split() for line in f)]
        _print_steps("receiver steps", rx_steps)
        _print_steps("sender steps", [(k, list(v)) for k, v in tx_steps.items()])
        for v in tx_steps.values():
            v.clear()
        staged_gbps = kv.nbytes / statistics.median(times["staged"]) / 1e9
        blocks_gbps = n * block / statistics.median(times["blocks"]) / 1e9
        print(f"\n== lane {slots} x {slot_bytes // MiB} MiB: staged {staged_gbps:.2f} GB/s, 64 MiB blocks "
              f"{blocks_gbps:.2f} GB/s, ratio {100 * staged_gbps / blocks_gbps:.1f} %, "
              f"write_strided() call {1e3 * statistics.median(calls):.2f} ms", flush=True)
        seq = max(r[1] for r in last)
        by = {}
        for kind, s, idx, t in last:
            if s == seq:
                by.setdefault(idx, {})[kind] = t
        for s, idx, a, b in rx.tolist():
            if int(s) == seq:
                by.setdefault(int(idx), {}).update(rx_start=a, rx_end=b)
        print("chunk  fill filled  ready posted   done  rx_start rx_end  credit   (ms from write_strided() call)")
        steps = {k: [] for k in ("fill", "wait", "post", "wire", "notified", "scatter", "answer")}
        for idx in sorted(by):
            e = by[idx]
            f = lambda k: (e.get(k, float("nan")) - start) * 1e3  # noqa: E731
            print(f"{idx:5d} {f('fill'):6.2f} {f('filled'):6.2f} {f('ready'):6.2f} {f('posted'):6.2f} {f('done'):6.2f} {f('rx_start'):8.2f} "
                  f"{f('rx_end'):6.2f} {f('credit'):7.2f}")
            if all(k in e for k in ("fill", "ready", "filled", "posted", "rx_start", "rx_end", "credit")):
                steps["fill"].append(e["filled"] - e["fill"])
                steps["wait"].append(e["ready"] - e["filled"])
                steps["post"].append(e["posted"] - e["ready"])
                steps["wire"].append(e.get("done", float("nan")) - e["posted"])
                steps["notified"].append(e["rx_start"] - e.get("done", float("nan")))
                steps["scatter"].append(e["rx_end"] - e["rx_start"])
                steps["answer"].append(e["credit"] - e["rx_end"])
        print("medians (ms): " + "   ".join(f"{k} {1e3 * statistics.median(v):.3f}" for k, v in steps.items() if v))


if __name__ == "__main__":
    main()
