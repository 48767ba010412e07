"""Probe (one-off measurement, not a test): ``kvtransfer bench transport --kv``'s CPU request
between two "hosts" -- the writer in one network namespace, the receiver in another, NIXL over
tcp on the veth pair between them (``tests/kvtransfer/_hosts.py``, as
``tests/kvtransfer/test_two_hosts.py`` builds them; needs root and ``ip``).

The demo's request (16 layers, 8 x 128 bf16, 2,048 tokens, TP 2 -> 1, pages 16 -> 64: 65,536
rows of 1 KiB, 64 MiB) written staged (``write_strided``, the default ``StagedNixlConfig``) and
as 256 KiB blocks (direct NIXL) alternately; the receiver's digest of its region is checked
against a numpy reference after the first staged write. Prints the rates and their ratio per
round, then the medians.

Usage: python3 bench/probes/two_hosts_kv.py [--iters N] [--rounds R] [--wire-gather BYTES]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvtransfer._procs import Child  # noqa: E402
from kvtransfer.benchmarks import transport as tools  # noqa: E402
from kvtransfer.netns import TwoHosts, enter, netns_unavailable  # noqa: E402

BLOCK = 256 << 10


def _receiver(conn, host, total):
    enter(host)
    tools._receiver(conn, total, False, {}, False)


def _writer(conn, host, export, total, iters, rounds, wire_gather):
    enter(host)
    from kvtransfer.benchmarks.transport_kv import DEMO, plan_request
    from transport.base import WriteBatch
    from transport.nixl import NixlConfig, NixlTransport
    from transport.nixl_staged import StagedNixlConfig

    kv = plan_request(DEMO)
    src = np.random.default_rng(1).integers(0, 256, kv.src_bytes, dtype=np.uint8)
    want = np.ones(total, dtype=np.uint8)  # the receiver's buffer starts as ones
    kv.apply(src, want)
    extra = {} if wire_gather is None else {"wire_gather_bytes": wire_gather}
    ts, td = NixlTransport(NixlConfig(staged=StagedNixlConfig(**extra))), NixlTransport(NixlConfig(staged=StagedNixlConfig(enabled=False)))
    ps, pd = ts.connect(export), td.connect(export)
    (dst,) = ps.regions.values()
    staged = kv.strided_batch(ts.register(src.ctypes.data, kv.src_bytes), dst.region_id)
    sid = td.register(src.ctypes.data, kv.src_bytes)
    n = kv.nbytes // BLOCK
    offs = np.arange(n, dtype=np.int64) * BLOCK
    blocks = WriteBatch.of(np.full(n, sid), offs, np.full(n, dst.region_id),
                           np.random.default_rng(2).permutation(offs), np.full(n, BLOCK))
    ps.write_strided(staged, notify=b"kv").wait(600)
    conn.send(("digest", hashlib.sha256(memoryview(want)).hexdigest()))
    conn.recv()  # the parent compared the receiver's digest
    for _ in range(rounds):
        times = {"staged": [], "blocks": []}
        for _ in range(iters):
            t0 = time.monotonic()
            ps.write_strided(staged, notify=b"kv").wait(600)
            t1 = time.monotonic()
            pd.write(blocks, notify=b"kv").wait(600)
            times["staged"].append(t1 - t0)
            times["blocks"].append(time.monotonic() - t1)
        conn.send(("round", kv.nbytes / statistics.median(times["staged"]) / 1e9,
                   n * BLOCK / statistics.median(times["blocks"]) / 1e9))
    ts.close()
    td.close()
    conn.send(("done",))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--wire-gather", type=int, default=None, help="StagedNixlConfig.wire_gather_bytes")
    args = ap.parse_args()
    why = netns_unavailable()
    if why:
        raise SystemExit(f"two hosts need network namespaces: {why}")
    from kvtransfer.benchmarks.transport_kv import DEMO, plan_request

    kv = plan_request(DEMO)
    print(f"{DEMO.name}: {kv.nbytes >> 20} MiB; writer in one namespace, receiver in another, tcp over veth",
          flush=True)
    with TwoHosts() as hosts:
        total = max(kv.dst_bytes, kv.nbytes)
        rx = Child.spawn(_receiver, (hosts.b, total), name="receiver")
        try:
            export = rx.recv(tools.Ready, "its export", tools.READY_TIMEOUT_S).export
            tx = Child.spawn(_writer, (hosts.a, export, total, args.iters, args.rounds, args.wire_gather), name="writer")
            try:
                _, want = tx.recv(tuple, "the reference digest", 600)
                rx.send(tools.DigestRequest())
                got = rx.recv(tools.Digest, "its digest", tools.DIGEST_TIMEOUT_S).sha256
                print("data ok" if got == want else f"DATA WRONG: {got} != {want}", flush=True)
                tx.send("go")
                ratios, staged, blocks = [], [], []
                for _ in range(args.rounds):
                    _, s, b = tx.recv(tuple, "a round", 600)
                    staged.append(s)
                    blocks.append(b)
                    ratios.append(100 * s / b)
                    print(f"  staged NIXL {s:6.2f} GB/s   NIXL 256 KiB blocks {b:6.2f} GB/s   staged / blocks "
                          f"{100 * s / b:5.1f} %", flush=True)
                tx.recv(tuple, "its end", 60)
            finally:
                tx.stop()
            print(f"medians: staged {statistics.median(staged):.2f} GB/s, blocks {statistics.median(blocks):.2f} "
                  f"GB/s, ratio {statistics.median(ratios):.1f} % (per-round ratios "
                  f"{min(ratios):.1f}-{max(ratios):.1f} %)")
        finally:
            rx.stop(tools.Quit())


if __name__ == "__main__":
    main()
