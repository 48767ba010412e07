"""``kvtransfer bench transport --kv``: one KV request's batch through NIXL staged, direct, and as blocks.

The request is planned by the real planner (``plan_kv_transfer`` over two MHA
:class:`~kvtransfer.layout.RankLayout`, prefill rank 0 -> decode rank 0, scattered pages as
``kvtransfer transfer-demo`` takes them). Each side's K/V buffers lie end to end in ONE registered
region (buffer ``b`` at ``b * buffer_bytes``), so the receiver of ``kvtransfer bench transport``
(one destination region, digests on request) serves unchanged. In one run, alternating:

- *staged*: the request as kvtransfer writes it to a NIXL peer with the staged mode on: the
  plan's :class:`~transport.base.StridedBatch` (``plan_batch``) through ``write_strided``
  (``transport.nixl.staged``: strided staged writes, O(P + S) host work per write);
- *direct*: the plan's flat batch through a transport with the staged mode off (one NIXL
  request of all ranges);
- *blocks*: the batch's byte count as ``--block`` blocks (default 256 KiB; 64 MiB with
  ``--cuda``) to a permutation of destination blocks: NIXL's rate for large ranges;
- host memory, one host: *staged, the sender's slots written by NIXL*: the staged path with
  ``shared_slots`` off (the staged path proper shares the receiver's slots there:
  :mod:`transport.nixl.staged.shared`), its bytes checked too;
- host memory: *staged with the sender's gather skipped*: the staged write through a lane of its
  own whose sender copies nothing into its slots (their bytes go out as they are, unchecked):
  the rate the receiver's scatter and the chunks' round trips (and the slot writes, where the
  slots are not shared) allow by themselves, a ceiling for the staged rate on this machine
  (docs/notes/nixl.md).

Requests: the CPU default is the demo's (16 layers, 8 x 128 bf16, 2,048 tokens, TP 2 -> 1,
pages 16 -> 64: 1 KiB head-slice rows, 64 MiB from prefill rank 0). ``--cuda`` runs the
80-layer / 8 x 128 bf16 / 16,384-token request twice, cuda:0 -> cuda:1: page 1 (whole 2 KiB
token rows, TP 1 -> 1) and as 256 B head slices (TP 8 -> 1, prefill rank 0's head), and adds
the NVLink engine on the same StridedBatch (``write_strided``, as kvtransfer writes to it).

``--two-hosts`` (host memory): the writer (this benchmark's paths) runs in one network
namespace and the receiver in another, NIXL over tcp on the veth pair between them
(:mod:`kvtransfer.netns`; root and ``ip`` needed): the wire a network socket, as between two
machines, where the wire's copies run in the kernel on both sides, not as one cma copy by the
writer.

Every path's bytes are checked once (the receiver's digest against a numpy reference of the
plan's flat ranges, built here) before the timed rounds. Beside the rates: the staged sender's
``write_strided()`` call time (median; its checks, chunk cuts and table uploads, and the
gathers of the first slots' chunks, which it posts before it returns).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from kvtransfer._procs import Child
from kvtransfer.benchmarks._report import time_once
from transport.base import StridedBatch, WriteBatch

KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class KvRequest:
    name: str
    layers: int
    heads: int
    head_dim: int
    tokens: int
    prefill_tp: int
    decode_tp: int
    prefill_page: int
    decode_page: int


DEMO = KvRequest("demo request: TP 2 -> 1, pages 16 -> 64, 1 KiB head-slice rows", 16, 8, 128, 2048, 2, 1, 16, 64)
GPU_PAGE1 = KvRequest("80 layers, 16,384 tokens, page 1, TP 1 -> 1 (2 KiB token rows)", 80, 8, 128, 16384, 1, 1, 1, 1)
GPU_HEADS = KvRequest("80 layers, 16,384 tokens, page 1, TP 8 -> 1 (256 B head slices)", 80, 8, 128, 16384, 8, 1, 1, 1)
REQUESTS = {"demo": DEMO, "page1": GPU_PAGE1, "heads": GPU_HEADS}  # --request


@dataclass(frozen=True)
class KvBatch:
    """The request's batch between two single-region pools."""

    src_bytes: int  # the prefill pool's region
    dst_bytes: int  # the decode pool's region
    src_offset: np.ndarray  # [n]
    dst_offset: np.ndarray  # [n]
    length: np.ndarray  # [n]
    strided: object = None  # plan_batch's StridedBatch over these regions (region 0 on each side), or None

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def batch(self, src_region: int, dst_region: int) -> WriteBatch:
        n = self.length.size
        return WriteBatch.of(np.full(n, src_region), self.src_offset, np.full(n, dst_region), self.dst_offset,
                             self.length)

    def strided_batch(self, src_region: int, dst_region: int):
        """The request as kvtransfer writes it: the plan's StridedBatch (None: the flat batch)."""
        if self.strided is None:
            return None
        sb = self.strided
        return StridedBatch(np.full(sb.num_pairs, src_region), sb.src_offset, sb.src_stride,
                            np.full(sb.num_pairs, dst_region), sb.dst_offset, sb.dst_stride, sb.length,
                            sb.src_slot, sb.dst_slot)

    def apply(self, src: np.ndarray, dst: np.ndarray) -> None:
        """The reference: the rows copied in plain numpy (rows of one length at multiples of it
        as one fancy-indexed copy of ``[rows, length]`` views, any other row by itself)."""
        for n in np.unique(self.length).tolist():
            sel = self.length == n
            so, do = self.src_offset[sel], self.dst_offset[sel]
            if not (so % n).any() and not (do % n).any() and not (src.size % n or dst.size % n):
                dst.reshape(-1, n)[do // n] = src.reshape(-1, n)[so // n]
                continue
            for a, b in zip(so.tolist(), do.tolist()):
                dst[b:b + n] = src[a:a + n]


def _scattered_slots(rng, page: int, tokens: int) -> tuple[np.ndarray, int]:
    """Slots of ``tokens`` tokens on random pages of a pool of twice the request (+ the padding
    page), and the pool's slot count."""
    pages = 2 * -(-tokens // page)
    order = rng.permutation(pages)[: -(-tokens // page)] + 1  # page 0 is padding
    slots = (order[:, None] * page + np.arange(page)[None, :]).ravel()[:tokens]
    return slots, (pages + 1) * page


def plan_request(req: KvRequest, seed: int = 0) -> KvBatch:
    """The request planned by ``plan_kv_transfer``, prefill rank 0 -> decode rank 0."""
    from kvtransfer.batches import BufferRegions, plan_batch
    from kvtransfer.layout import KVKind, RankLayout
    from kvtransfer.plan import plan_kv_transfer

    rng = np.random.default_rng(seed)
    src_slots, src_num = _scattered_slots(rng, req.prefill_page, req.tokens)
    dst_slots, dst_num = _scattered_slots(rng, req.decode_page, req.tokens)
    common = dict(layer_ids=range(req.layers), dtype="bfloat16", head_dim=req.head_dim, total_heads=req.heads)
    src = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=req.prefill_tp, page_size=req.prefill_page,
                               num_slots=src_num, **common)
    dst = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=req.decode_tp, page_size=req.decode_page,
                               num_slots=dst_num, **common)
    plan = plan_kv_transfer(src, dst, src_slots, dst_slots)
    s_buf, s_off, d_buf, d_off, length = plan.flatten()
    src_row = 2 * req.head_dim * req.heads // min(req.prefill_tp, req.heads)  # bf16 bytes per token per buffer
    dst_row = 2 * req.head_dim * req.heads // min(req.decode_tp, req.heads)
    src_buf, dst_buf = src_num * src_row, dst_num * dst_row  # bytes per buffer
    buffers = 2 * req.layers
    numbers = BufferRegions.of(range(buffers))  # region id = buffer number: rebased into one region below
    sb = plan_batch(plan, numbers, numbers)
    strided = None
    if isinstance(sb, StridedBatch):  # buffer b lies at b * buffer bytes of the one region on each side
        strided = StridedBatch(sb.src_region, sb.src_region * src_buf + sb.src_offset, sb.src_stride, sb.dst_region,
                               sb.dst_region * dst_buf + sb.dst_offset, sb.dst_stride, sb.length, sb.src_slot,
                               sb.dst_slot)
    return KvBatch(buffers * src_buf, buffers * dst_buf, s_buf * src_buf + s_off, d_buf * dst_buf + d_off,
                   np.asarray(length, dtype=np.int64), strided)


def _median_gbps(nbytes: int, times: list) -> float:
    return nbytes / statistics.median(times) / 1e9


def run_kv(args, tools, receiver_host=None) -> list[dict]:
    """Run each request of this machine kind; ``tools`` is :mod:`kvtransfer.benchmarks.transport`
    (its receiver process, messages and block descriptors); ``receiver_host``: a
    :class:`kvtransfer.netns.Host` the receiver runs on (None: beside this process)."""
    from transport.nixl import NixlConfig, NixlTransport
    from transport.nixl.staged import StagedNixlConfig

    requests = [GPU_PAGE1, GPU_HEADS] if args.cuda else [DEMO]
    if getattr(args, "request", None):
        requests = [REQUESTS[args.request]]
    rows = []
    for req in requests:
        kv = plan_request(req)
        shape = f", {kv.strided.num_pairs} pairs x {kv.strided.num_slots:,} slots" if kv.strided is not None else ""
        print(f"{req.name}: {kv.length.size:,} ranges{shape}, {kv.nbytes / MiB:.1f} MiB, "
              f"{int(kv.length[0])} B rows", flush=True)
        if args.cuda:
            import torch

            torch.cuda.set_device(0)
            src = torch.randint(0, 256, (kv.src_bytes,), dtype=torch.uint8, device="cuda:0")  # [src_bytes]
            torch.cuda.synchronize()
            src_ptr, device, host_src = src.data_ptr(), 0, src.cpu().numpy()
            staged = StagedNixlConfig(slots=args.slots, **({"cuda_slot_bytes": args.slot_bytes} if args.slot_bytes else {}))
        else:
            src = np.random.default_rng(1).integers(0, 256, kv.src_bytes, dtype=np.uint8)  # [src_bytes]
            src_ptr, device, host_src = src.ctypes.data, None, src
            wire = {} if args.wire_gather_bytes is None else {"wire_gather_bytes": args.wire_gather_bytes}
            staged = StagedNixlConfig(slot_bytes=args.slot_bytes or 4 * MiB, slots=args.slots, **wire)
        total = max(kv.dst_bytes, -(-kv.nbytes // args.block) * args.block)
        if receiver_host is None:
            receiver = Child.spawn(tools._receiver, (total, args.cuda, dict(os.environ), args.progress_thread, staged),
                                   name="receiver")
        else:
            receiver = Child.spawn(_receiver_on, (receiver_host, total, args.progress_thread, staged),
                                   name=f"receiver ({receiver_host.netns})")
        try:
            peer_bytes = receiver.recv(tools.Ready, "its export", tools.READY_TIMEOUT_S).export

            def connected(cfg: StagedNixlConfig) -> tuple:
                """``(transport, source region id, peer, destination region)``: a transport of
                its own with ``cfg``, the source registered, connected to the receiver."""
                t = NixlTransport(NixlConfig(progress_thread=args.progress_thread, staged=cfg))
                sid = t.register(src_ptr, kv.src_bytes, device)
                peer = t.connect(peer_bytes)
                (dst,) = peer.regions.values()
                return t, sid, peer, dst

            paths, sids = {}, {}
            variants = [("staged", staged), ("direct", StagedNixlConfig(enabled=False))]
            if not args.cuda and staged.shared_slots:  # on one host: also the slots written by NIXL
                variants.append(("unshared", dataclasses.replace(staged, shared_slots=False)))
            for name, cfg in variants:
                t, sid, peer, dst = connected(cfg)
                paths[name], sids[name] = (t, peer, kv.batch(sid, dst.region_id)), sid
            n_blocks = kv.nbytes // args.block
            blocks = np.arange(n_blocks, dtype=np.int64) * args.block  # [n_blocks]
            block_batch = WriteBatch.of(np.full(n_blocks, sid), blocks, np.full(n_blocks, dst.region_id),
                                        np.random.default_rng(2).permutation(blocks), np.full(n_blocks, args.block))
            paths["blocks"] = (t, peer, block_batch)  # through the direct transport (so are a few large ranges)
            staged_t, staged_peer, _ = paths["staged"]
            staged_batch = kv.strided_batch(sids["staged"], dst.region_id)
            calls: list = []  # seconds each staged write_strided() call took (the sender's host time before wait)
            writes = {name: (lambda p=p, b=b: p.write(b, notify=b"kv").wait(600)) for name, (_, p, b) in paths.items()}
            if staged_batch is not None:
                writes["staged"] = lambda: _timed_call(staged_peer, staged_batch, calls).wait(600)
                if "unshared" in paths:
                    _, unshared_peer, _ = paths["unshared"]
                    unshared_batch = kv.strided_batch(sids["unshared"], dst.region_id)
                    writes["unshared"] = lambda: unshared_peer.write_strided(unshared_batch, notify=b"kv").wait(600)
            _check(kv, host_src, total, 0 if args.cuda else 1, writes, block_batch, receiver, tools)
            if staged_batch is not None and not args.cuda:  # after the check: its bytes are not the request's
                bound_t, bound_sid, bound_peer, _ = connected(staged)
                paths["nogather"] = (bound_t, bound_peer, None)
                writes["nogather"] = _without_gather(bound_t, bound_peer,
                                                     kv.strided_batch(bound_sid, dst.region_id))
            lane = staged_t._core.lanes.get(staged_peer.name)
            if lane is None or lane.state.name != "READY":  # else the "staged" figures are direct ones
                raise RuntimeError(f"the staged path did not stage: {lane and (lane.state.name, lane.error)}")
            if not lane.shared and "unshared" in writes:  # another host: the two staged paths are one
                del writes["unshared"]
            times = {name: [] for name in writes}
            calls.clear()
            for _ in range(args.iters):  # alternate so all paths see the same background load
                for name, fn in writes.items():
                    times[name].append(time_once(fn))
            row = {"request": req.name, "ranges": int(kv.length.size), "nbytes": kv.nbytes, "shared": lane.shared,
                   **{f"{name}_gbps": _median_gbps(kv.nbytes if name != "blocks" else n_blocks * args.block, ts)
                      for name, ts in times.items()}}
            if calls:
                row["staged_call_ms"] = 1e3 * statistics.median(calls)
            if args.cuda:
                row["nvlink_gbps"] = _nvlink_gbps(kv, src, args.iters)
            rows.append(row)
            print(_format(row, args.block), flush=True)
            for t, _, _ in paths.values():
                t.close()  # closing twice is harmless
        finally:
            receiver.stop(tools.Quit())
    return rows


def run_kv_two_hosts(args, tools) -> list[dict]:
    """:func:`run_kv` with its paths in a writer process on one "host" and the receiver on
    another (module doc); the namespaces go when it returns."""
    from kvtransfer.netns import writer_on_two_hosts

    return writer_on_two_hosts(_kv_writer, (args,), list, 3600.0)


def _kv_writer(receiver_host, args) -> list[dict]:
    from kvtransfer.benchmarks import transport as tools

    return run_kv(args, tools, receiver_host)


def _receiver_on(conn, host, total: int, progress_thread: bool, staged) -> None:
    from kvtransfer._procs import report_failure
    from kvtransfer.benchmarks import transport as tools
    from kvtransfer.netns import enter

    try:
        enter(host)  # UCX over this host's veth (the writer's environment is not passed on)
    except Exception as exc:
        report_failure(conn, exc)
        raise SystemExit(1) from None
    tools._receiver(conn, total, False, {}, progress_thread, staged)


def _check(kv: KvBatch, host_src: np.ndarray, total: int, fill: int, writes: dict, block_batch: WriteBatch,
           receiver, tools) -> None:
    """Each path once, in turn, the destination's digest against the reference (the receiver's
    buffer starts as ``fill``: ones on the host, zeros on a GPU)."""
    want = np.full(total, fill, dtype=np.uint8)  # [total]
    blocks = KvBatch(0, 0, block_batch.src_offset, block_batch.dst_offset, block_batch.length)
    for name, ref in (("staged", kv), ("blocks", blocks), ("direct", kv), ("unshared", kv)):
        if name not in writes:
            continue
        writes[name]()
        ref.apply(host_src, want)
        receiver.send(tools.DigestRequest())
        got = receiver.recv(tools.Digest, "the destination's digest", tools.DIGEST_TIMEOUT_S).sha256
        if got != hashlib.sha256(want).hexdigest():
            raise RuntimeError(f"{name}: destination bytes differ from the reference")


def _without_gather(transport, peer, batch):
    """The staged write of ``batch`` through ``transport``'s own lane with the sender's gather
    skipped (its slots go out as they are, so the bytes are not checked): the rate the rest of
    the pipeline allows -- the slot writes (unless the slots are shared), the receiver's
    scatter and the per-chunk notifications and Credits -- when the sender's copy into its
    slots costs nothing."""
    peer.write_strided(batch, notify=b"kv").wait(600)  # opens the lane and its staging
    staging = transport._core.lanes.get(peer.name).staging
    staging.gather_strided = lambda *args: None  # this staging instance only
    return lambda: peer.write_strided(batch, notify=b"kv").wait(600)


def _timed_call(peer, batch, calls: list):
    """``peer.write_strided(batch)``, its call time appended to ``calls``; the transfer."""
    start = time.perf_counter()
    tr = peer.write_strided(batch, notify=b"kv")
    calls.append(time.perf_counter() - start)
    return tr


def _nvlink_gbps(kv: KvBatch, src, iters: int) -> float:
    """The NVLink engine on the same batch: this process's cuda:0 into a receiver on cuda:1."""
    from transport.nvlink import NvlinkTransport
    from kvtransfer.benchmarks._remote import RemoteBuffers

    remote = RemoteBuffers(device=1)
    try:
        (dst_rid,) = remote.alloc([kv.dst_bytes], 0)
        with NvlinkTransport() as t:
            sid = t.register_tensor(src)
            peer = t.connect(remote.export()["nvlink"])
            batch = kv.strided_batch(sid, dst_rid)  # as kvtransfer writes to an NVLink peer
            write = (lambda: peer.write_strided(batch).wait(600)) if batch is not None else \
                (lambda: peer.write(kv.batch(sid, dst_rid)).wait(600))
            write()
            times = [time_once(write) for _ in range(iters)]
    finally:
        remote.close()
    return _median_gbps(kv.nbytes, times)




def _format(row: dict, block: int) -> str:
    line = (f"  staged NIXL {row['staged_gbps']:7.2f} GB/s{' (slots shared)' if row.get('shared') else ''}   "
            f"direct NIXL {row['direct_gbps']:7.2f} GB/s   "
            f"NIXL {block // KiB} KiB blocks {row['blocks_gbps']:7.2f} GB/s   staged / blocks "
            f"{100 * row['staged_gbps'] / row['blocks_gbps']:5.1f} %   data ok")
    if "staged_call_ms" in row:
        line += f"   staged write_strided() call {row['staged_call_ms']:.1f} ms"
    if "nvlink_gbps" in row:
        line += f"   NVLink engine {row['nvlink_gbps']:7.2f} GB/s"
    if "unshared_gbps" in row:
        line += (f"\n  staged, the sender's slots written by NIXL {row['unshared_gbps']:7.2f} GB/s = "
                 f"{100 * row['unshared_gbps'] / row['blocks_gbps']:5.1f} % of blocks (data ok)")
    if "nogather_gbps" in row:
        line += (f"\n  staged with the sender's gather skipped (bytes not checked) {row['nogather_gbps']:7.2f} GB/s = "
                 f"{100 * row['nogather_gbps'] / row['blocks_gbps']:5.1f} % of blocks: "
                 + ("" if row.get("shared") else "the slot writes, ")
                 + "the receiver's scatter and the chunks' round trips alone")
    return line
