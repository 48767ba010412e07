"""Probe (one-off measurement, not a test): the host time of one staged chunk's fill on a GPU, step by step.

Usage: python3 bench/probes/staged_fill_host.py [--request page1|heads] [--slot-bytes 128M] (one GPU).

Fills slot after slot of a ``KernelStaging`` with the strided chunks of one
``kvtransfer bench transport --kv`` request (its planner) as the sender does, and prints the
median host microseconds of each step (the GPU work is waited for outside the timed steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtransfer.benchmarks.transport_kv import REQUESTS, plan_request  # noqa: E402
from transport.nixl.staged.kernel import KernelStaging  # noqa: E402
from transport.nixl.staged.sender import strided_bounds  # noqa: E402
from transport.nixl.staged.wire import DestinationTable, StridedChunk, StridedHeader, encode, strided_data_start  # noqa: E402


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--request", default="page1", choices=tuple(REQUESTS))
    ap.add_argument("--slot-bytes", type=int, default=128 << 20)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    kv = plan_request(REQUESTS[args.request])
    sb = kv.strided
    torch.cuda.set_device(0)
    src = torch.empty(kv.src_bytes, dtype=torch.uint8, device="cuda:0")
    staging = KernelStaging(4, args.slot_bytes, "cuda:0")
    addr = src.data_ptr() + sb.src_offset
    p, n = sb.num_pairs, sb.num_slots
    at = strided_data_start(p, n)
    bounds = strided_bounds(sb.length, n, args.slot_bytes - at)
    t = {k: [] for k in ("rows+table (per write)", "header", "launch", "pack", "put header", "put table", "event",
                         "stream ctx", "stage_strided (all)", "note encode")}
    clock = time.perf_counter
    for r in range(args.rounds):
        c0 = clock()
        rows = staging.strided_rows(addr, sb.src_stride, sb.length, sb.src_slot)
        head = staging.strided_table(DestinationTable(sb.dst_region, sb.dst_offset, sb.dst_stride, sb.length,
                                                      sb.dst_slot).pack())
        t["rows+table (per write)"].append(clock() - c0)
        for i in range(min(bounds.size - 1, 4)):
            a, b = int(bounds[i]), int(bounds[i + 1])
            k = i % 4
            nbytes = rows.offset_of(b) - rows.offset_of(a)
            c0 = clock()
            header = StridedHeader(1, r, i, bounds.size - 1, a, b, nbytes, p, n)
            c1 = clock()
            with staging._on_stream():
                c2 = clock()
                staging._launch_strided(k, at, rows, a, b, gather=True)
                c3 = clock()
                packed = header.pack()
                c4 = clock()
                staging._put(k, packed)
                c5 = clock()
                staging._put(k, head, 128)
                c6 = clock()
                staging.queued(k)
                c7 = clock()
            c8 = clock()
            encode(StridedChunk(1, r, i, bounds.size - 1, k, None))
            c9 = clock()
            for key, d in (("header", c1 - c0), ("launch", c3 - c2), ("pack", c4 - c3), ("put header", c5 - c4),
                           ("put table", c6 - c5), ("event", c7 - c6), ("stream ctx", (c2 - c1) + (c8 - c7)),
                           ("note encode", c9 - c8)):
                t[key].append(d)
            staging.ready(k)
            c0 = clock()
            staging.stage_strided(k, at, rows, a, b, header, head)
            t["stage_strided (all)"].append(clock() - c0)
            staging.ready(k)
    print(f"{args.request}: {bounds.size - 1} chunks of <= {args.slot_bytes >> 20} MiB; median host microseconds:")
    for key, v in t.items():
        print(f"  {key:24s} {1e6 * statistics.median(v):8.1f}")


if __name__ == "__main__":
    main()
