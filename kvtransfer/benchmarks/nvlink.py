"""``kvtransfer bench nvlink``: the NVLink backend against torch's peer copy, two processes.

Default: a Llama-3-70B-shaped request: 80 layers, K and V (160 per-layer buffers), 8 KV heads
x 128 dims bf16 (2 KiB per token row), 16,384 tokens at random pages of a pool twice that
size, written by this process (GPU 0) into a receiver process's pool (GPU 1). Cases:

    page 1 / 16 / 64   whole pages as rows (2 KiB / 32 KiB / 128 KiB), all 160 buffers
    head slice         one 256 B head of each token (decode TP 8: the receiver's pool holds
                       one KV head), page size 1, all 160 buffers

For each case, in the same run: ``kernel`` = the copy kernel alone on a resident row table
(CUDA events, median), ``write()`` = ``peer.write(batch).wait()`` wall time including the
bounds check, the row-table gather and its host-to-device copy (median), and torch's peer
copy of the same byte count between two contiguous tensors on GPU 0 and GPU 1 of this
process (CUDA events, median). The first write of each case is verified: the receiver
waits for its notification, then both sides checksum the rows (position-weighted).
With ``transport.nixl`` importable, page size 1 also runs through NIXL (one descriptor per
page) on a slice of the batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import traceback
from dataclasses import dataclass

import numpy as np

BACKENDS = ("nvlink", "nixl")


# -- a receiver process holding registered GPU buffers (also used by tests) ---------------


def _make_transport(backend: str, ipc_api: str = "auto"):
    if backend == "nvlink":
        from transport.nvlink import NvlinkConfig, NvlinkTransport

        return NvlinkTransport(NvlinkConfig(ipc_api=ipc_api))
    from transport.nixl import NixlTransport

    return NixlTransport()


def checksums(bufs: dict, region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list[int]:
    """Position-weighted checksum of the rows of each region (in order of first appearance).

    ``bufs`` maps region id -> uint8 CUDA tensor. Rows of one region must share one length
    that divides their offsets (true of page and head-slice rows).
    """
    import torch

    _, first = np.unique(region, return_index=True)
    out = []
    for rid in region[np.sort(first)]:
        sel = region == rid
        off, ln = offset[sel], length[sel]
        row = int(ln[0])
        if (ln != row).any() or (off % row).any() or row % 4:
            raise ValueError(f"region {rid}: checksums need equal rows (4-byte multiple) at multiples of their length")
        buf = bufs[int(rid)]
        idx = torch.from_numpy(off // row).to(buf.device)
        words = buf.view(-1, row)[idx].view(torch.int32).to(torch.int64)  # [rows, row // 4]
        weights = torch.arange(words.numel(), device=buf.device, dtype=torch.int64) % 65521 + 1
        out.append(int((words.view(-1) * weights).sum()))
    return out


def _receiver_main(conn, device: int, backends: tuple, ipc_api: str) -> None:
    """Serve commands from the pipe: alloc, export, fill, wait_notify, fetch, checksum, exit."""
    import torch

    torch.cuda.set_device(device)
    transports = {b: _make_transport(b, ipc_api) for b in backends}
    bufs: dict[int, torch.Tensor] = {}  # region id (same in every transport) -> uint8 tensor
    seen: list[bytes] = []
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "exit":
                    conn.send(("ok", None))
                    return
                if cmd == "alloc":  # sizes, fill byte -> region ids
                    sizes, fill = args
                    rids = []
                    for n in sizes:
                        t = torch.full((n,), fill, dtype=torch.uint8, device=device)
                        ids = {transports[b].register_tensor(t) for b in backends}
                        if len(ids) != 1:
                            raise RuntimeError(f"backends gave different region ids {ids}")
                        rids.append(ids.pop())
                        bufs[rids[-1]] = t
                    conn.send(("ok", rids))
                elif cmd == "export":
                    conn.send(("ok", {b: transports[b].export() for b in backends}))
                elif cmd == "fill":
                    rids, fill = args
                    for r in rids:
                        bufs[r].fill_(fill)
                    torch.cuda.synchronize(device)
                    conn.send(("ok", None))
                elif cmd == "wait_notify":  # payload, timeout -> True when it arrived
                    payload, timeout = args
                    deadline = time.monotonic() + timeout
                    while payload not in seen and time.monotonic() < deadline:
                        for t in transports.values():
                            seen.extend(t.poll_notifications())
                        time.sleep(1e-4)
                    found = payload in seen
                    if found:
                        seen.remove(payload)
                    conn.send(("ok", found))
                elif cmd == "fetch":
                    conn.send(("ok", [bufs[r].cpu().numpy() for r in args[0]]))
                elif cmd == "checksum":
                    conn.send(("ok", checksums(bufs, *args)))
                else:
                    conn.send(("err", f"unknown command {cmd!r}"))
            except Exception:  # report to the driving process, keep serving
                conn.send(("err", traceback.format_exc()))
    finally:
        for t in transports.values():
            t.close()


class RemoteBuffers:
    """A receiver process on ``device`` holding GPU buffers registered with ``backends``."""

    def __init__(self, device: int, backends: tuple = ("nvlink",), ipc_api: str = "auto", timeout_s: float = 120.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout_s
        self.proc = ctx.Process(target=_receiver_main, args=(child, device, tuple(backends), ipc_api), daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, *args):
        self._conn.send((cmd, *args))
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"receiver did not answer {cmd!r} within {self._timeout} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver failed on {cmd!r}:\n{value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=10)
        self._conn.close()


# -- the benchmark -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    src_region: np.ndarray  # [n]
    src_offset: np.ndarray  # [n]
    dst_region: np.ndarray  # [n]
    dst_offset: np.ndarray  # [n]
    length: np.ndarray  # [n]

    def batch(self, rows: slice = slice(None)):
        from transport.base import WriteBatch

        return WriteBatch.of(
            self.src_region[rows], self.src_offset[rows], self.dst_region[rows], self.dst_offset[rows], self.length[rows]
        )


def build_cases(args, src_rids, dst_rids, head_rids, rng) -> list[Case]:
    """Rows of the request for each page size, then the head-slice rows."""
    token_bytes = args.heads * args.head_dim * 2  # bf16
    num_bufs = len(src_rids)
    cases = []
    for page in args.page_sizes:
        num_pages, req_pages = args.pool_tokens // page, args.tokens // page
        src_pages = rng.choice(np.arange(1, num_pages), req_pages, replace=False)  # page 0: padding
        dst_pages = rng.choice(np.arange(1, num_pages), req_pages, replace=False)
        row = page * token_bytes
        cases.append(Case(
            f"page {page}",
            np.repeat(np.asarray(src_rids), req_pages), np.tile(src_pages * row, num_bufs),
            np.repeat(np.asarray(dst_rids), req_pages), np.tile(dst_pages * row, num_bufs),
            np.full(num_bufs * req_pages, row, dtype=np.int64),
        ))
    head_bytes = args.head_dim * 2
    src_slots = rng.choice(np.arange(1, args.pool_tokens), args.tokens, replace=False)
    dst_slots = rng.choice(np.arange(1, args.pool_tokens), args.tokens, replace=False)
    head = 0  # decode TP 8, rank 0 holds KV head 0
    cases.append(Case(
        "head slice",
        np.repeat(np.asarray(src_rids), args.tokens), np.tile(src_slots * token_bytes + head * head_bytes, num_bufs),
        np.repeat(np.asarray(head_rids), args.tokens), np.tile(dst_slots * head_bytes, num_bufs),
        np.full(num_bufs * args.tokens, head_bytes, dtype=np.int64),
    ))
    return cases


def _median_ms_events(fn, reps: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _median_s_wall(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransfer bench nvlink", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--src-device", type=int, default=0)
    ap.add_argument("--dst-device", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="also time other kernel tile shapes")
    ap.add_argument("--nixl-layers", type=int, default=4, help="layers of the NIXL page-1 slice")
    args = ap.parse_args(argv)
    args.pool_tokens = 2 * args.tokens

    import torch

    from transport import nvlink_kernel as kern
    from transport.nvlink import NvlinkTransport

    if torch.cuda.device_count() < 2:
        print("kvtransfer bench nvlink: needs two CUDA GPUs, found", torch.cuda.device_count())
        return 1
    nixl_ok = importlib.util.find_spec("nixl") is not None or importlib.util.find_spec("nixl_cu12") is not None
    backends = ("nvlink", "nixl") if nixl_ok else ("nvlink",)
    rng = np.random.default_rng(0)
    token_bytes = args.heads * args.head_dim * 2
    num_bufs = 2 * args.layers
    src_dev = torch.device("cuda", args.src_device)
    torch.cuda.set_device(src_dev)
    remote = RemoteBuffers(args.dst_device, backends)
    transports = {b: _make_transport(b) for b in backends}
    try:
        dst_rids = remote.call("alloc", [args.pool_tokens * token_bytes] * num_bufs, 0x5A)
        head_rids = remote.call("alloc", [args.pool_tokens * args.head_dim * 2] * num_bufs, 0x5A)
        src = {}
        for _ in range(num_bufs):
            t = torch.empty(args.pool_tokens * token_bytes // 4, dtype=torch.int32, device=src_dev)
            t.random_(-(2**31), 2**31 - 1)
            t = t.view(torch.uint8)  # [pool_tokens * token_bytes] bytes
            ids = {tr.register_tensor(t) for tr in transports.values()}
            src[ids.pop()] = t
        src_rids = sorted(src)
        exports = remote.call("export")
        peers = {b: transports[b].connect(exports[b]) for b in backends}
        peer = peers["nvlink"]
        cases = build_cases(args, src_rids, dst_rids, head_rids, rng)
        max_bytes = max(int(c.length.sum()) for c in cases)
        pc_src = torch.empty(max_bytes, dtype=torch.uint8, device=src_dev).random_(0, 255)
        pc_dst = torch.empty(max_bytes, dtype=torch.uint8, device=torch.device("cuda", args.dst_device))
        configs = [kern.KernelConfig()]
        if args.sweep:
            configs += [kern.KernelConfig(tile_bytes=t, num_warps=w) for t, w in ((4096, 4), (16384, 4), (16384, 8), (32768, 8))]
        results = []
        for case in cases:
            batch = case.batch()
            nbytes = batch.nbytes
            # verified write
            dst_ids = sorted(set(case.dst_region.tolist()))
            remote.call("fill", dst_ids, 0x5A)
            tag = f"verify {case.name}".encode()
            peer.write(batch, notify=tag).wait(timeout=120)
            if not remote.call("wait_notify", tag, 60.0):
                raise RuntimeError(f"{case.name}: notification did not arrive")
            want = checksums(src, case.src_region, case.src_offset, case.length)
            got = remote.call("checksum", case.dst_region, case.dst_offset, case.length)
            verified = want == got
            # kernel alone on a resident row table
            rows = peer.row_table(batch)
            rows_dev = torch.from_numpy(rows).to(src_dev)
            kernel_ms = {}
            for cfg in configs:
                plan = kern.plan_launch(len(batch), int(case.length.max()), kern.choose_path(rows), cfg)
                kernel_ms[cfg] = _median_ms_events(
                    lambda: kern.scatter_rows(rows_dev, plan, src_dev, cfg.num_warps), args.reps, args.warmup
                )
            write_s = _median_s_wall(lambda: peer.write(batch).wait(timeout=120), max(3, args.reps // 2))
            a, b = pc_src[:nbytes], pc_dst[:nbytes]
            copy_ms = _median_ms_events(lambda: b.copy_(a, non_blocking=True), args.reps, args.warmup)
            results.append((case, nbytes, verified, kernel_ms, write_s, copy_ms))
            del rows_dev
        nixl_line = _nixl_page1(args, cases[0], peers, remote) if "nixl" in peers else "nixl: not importable here, skipped"
    finally:
        for tr in transports.values():
            tr.close()
        remote.close()

    gbs = lambda nbytes, sec: nbytes / sec / 1e9  # noqa: E731
    print(f"\nnvlink bench: {args.layers} layers x K,V, {args.heads} heads x {args.head_dim} bf16, "
          f"{args.tokens} tokens, cuda:{args.src_device} -> cuda:{args.dst_device} (two processes), "
          f"{torch.cuda.get_device_name(src_dev)}")
    if args.sweep:
        print("kernel sweep (GB/s):", "  ".join(f"tile {c.tile_bytes} w{c.num_warps}" for c in configs))
        for case, nbytes, _, kernel_ms, _, _ in results:
            print(f"  {case.name:<11}", "  ".join(f"{gbs(nbytes, kernel_ms[c] / 1e3):8.1f}" for c in configs))
    head = f"{'case':<11} {'rows':>9} {'row B':>6} {'MiB':>7} {'kernel GB/s':>11} {'peer copy':>9} " \
           f"{'ratio':>6} {'write() GB/s':>12} {'ratio':>6} {'verified':>8}"
    print(head)
    print("-" * len(head))
    for case, nbytes, verified, kernel_ms, write_s, copy_ms in results:
        k = gbs(nbytes, kernel_ms[configs[0]] / 1e3)
        c = gbs(nbytes, copy_ms / 1e3)
        w = gbs(nbytes, write_s)
        print(f"{case.name:<11} {len(case.length):>9} {int(case.length[0]):>6} {nbytes / 2**20:>7.0f} {k:>11.1f} "
              f"{c:>9.1f} {k / c:>6.1%} {w:>12.1f} {w / c:>6.1%} {str(verified):>8}")
    print(nixl_line)
    return 0 if all(r[2] for r in results) else 2


def _nixl_page1(args, case: Case, peers, remote) -> str:
    """NIXL's one-descriptor-per-page path on the first ``nixl_layers`` layers of page size 1."""
    per_buf = args.tokens
    n = per_buf * 2 * args.nixl_layers
    sel = np.r_[0 : per_buf * args.nixl_layers, per_buf * args.layers : per_buf * (args.layers + args.nixl_layers)][:n]
    batch = case.batch(sel)
    nvl = _median_s_wall(lambda: peers["nvlink"].write(batch).wait(timeout=120), 3)
    tag = b"nixl page 1"
    t0 = time.perf_counter()
    peers["nixl"].write(batch, notify=tag).wait(timeout=300)
    nixl_s = time.perf_counter() - t0
    arrived = remote.call("wait_notify", tag, 60.0)
    nb = batch.nbytes
    return (f"nixl page 1 ({len(batch)} rows, {nb / 2**20:.0f} MiB): nixl {nb / nixl_s / 1e9:.2f} GB/s, "
            f"nvlink write() {nb / nvl / 1e9:.1f} GB/s, x{nixl_s / nvl:.0f}, notification {arrived}")
