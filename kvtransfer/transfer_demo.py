"""``kvtransfer transfer-demo``: one request's KV cache from prefill ranks to decode ranks, for real.

Separate processes: ``--prefill-tp`` prefill ranks and ``--decode-tp`` decode ranks, each
with its own MHA pool on the CPU (page sizes may differ between the sides) and its own NIXL
(UCX) transport over loopback. The parent process only relays the handshake:

1. every decode rank reserves pages for the request, registers its K/V buffers and sends
   (layout, transport export, destination slots);
2. every prefill rank fills its pool with its head shard of a deterministic "model" KV
   (a seeded random tensor per layer), registers its buffers and sends its layout;
3. for each decode rank, the prefill ranks that write into it (``senders_for``) plan the
   transfer (``plan_kv_transfer``) and write it with one batched write and a notification
   (``kvtransfer.batches.write_plan``: buffer numbers to region ids through both sides'
   :class:`~kvtransfer.batches.BufferRegions`);
4. each decode rank waits for its senders' notifications, then compares its whole pool
   region for the request against its own shard of the same seeded reference.

A table of bytes, entries before coalescing (one per token per buffer, as a per-token
design would issue) and after, plan and transfer times, and GB/s is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from kvtransfer._args import HelpFormatter, description
from kvtransfer._procs import Child

HANDSHAKE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DemoConfig:
    prefill_tp: int = 2
    decode_tp: int = 1
    total_heads: int = 8
    head_dim: int = 128
    layers: int = 16
    tokens: int = 2048
    prefill_page_size: int = 16
    decode_page_size: int = 64
    dtype: str = "bfloat16"
    seed: int = 1234
    progress_thread: bool = False

    def validate(self) -> None:
        for name in ("prefill_tp", "decode_tp", "total_heads", "head_dim", "layers", "tokens",
                     "prefill_page_size", "decode_page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("prefill_tp", "decode_tp"):
            tp = getattr(self, name)
            h = self.total_heads
            if not (h % tp == 0 or tp % h == 0):
                raise ValueError(f"--{name.replace('_', '-')}={tp} and --total-heads={h}: one must divide the other")


def _torch_dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def local_heads(total_heads: int, tp_rank: int, tp_size: int) -> slice:
    """Heads of rank ``tp_rank``, by the one TP sharding rule (``kvtransfer.layout.shard_units``):
    a contiguous range, or one replicated head when TP > heads."""
    from kvtransfer.layout import shard_units

    held = shard_units(total_heads, tp_rank, tp_size).units
    return slice(held.start, held.stop)


def reference_kv(cfg: DemoConfig, layer: int, which: int):
    """The 'model' output: full K (which=0) or V (which=1) of one layer, [tokens, heads, head_dim]."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + layer * 2 + which)
    full = torch.randn(cfg.tokens, cfg.total_heads, cfg.head_dim, generator=g)  # [tokens, H, D]
    return full.to(_torch_dtype(cfg.dtype))


def _make_rank(cfg: DemoConfig, tp_rank: int, tp_size: int, page_size: int):
    """Pool, allocator and transport of one rank; the request's slots on it; its layout."""
    import torch

    from kvtransfer.batches import BufferRegions
    from kvtransfer.layout import RankLayout
    from pools.allocator import PagedTokenToKVPoolAllocator
    from pools.mha import MHATokenToKVPool
    from transport.nixl import NixlConfig, NixlTransport

    heads = local_heads(cfg.total_heads, tp_rank, tp_size)
    # Room for twice the request, so its pages land at scattered places of the pool.
    num_pages = 2 * -(-cfg.tokens // page_size) + 1
    size = num_pages * page_size
    pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=_torch_dtype(cfg.dtype),
                            head_num=heads.stop - heads.start, head_dim=cfg.head_dim,
                            layer_num=cfg.layers, device="cpu")
    alloc = PagedTokenToKVPoolAllocator(size, page_size, device="cpu")
    # Take every page, give back a random half: the request gets scattered pages.
    rng = np.random.default_rng(cfg.seed + 7919 * tp_rank + page_size)
    all_slots = alloc.alloc(alloc.available_size())
    pages = all_slots.view(-1, page_size)  # [num_pages, page_size]
    order = torch.from_numpy(rng.permutation(pages.shape[0]))
    need = -(-cfg.tokens // page_size)
    alloc.free(pages[order[need:]].reshape(-1))
    slots = pages[order[:need]].reshape(-1)[: cfg.tokens]  # [tokens]
    layout = RankLayout.from_pools(pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=cfg.total_heads)
    transport = NixlTransport(NixlConfig(progress_thread=cfg.progress_thread))
    regions = BufferRegions.register(transport, pool.get_contiguous_buf_infos())
    return pool, slots, layout, transport, regions, heads


def _prefill_rank(cfg: DemoConfig, tp_rank: int, conn) -> None:
    from kvtransfer.batches import BufferRegions, plan_batch, write_batch
    from kvtransfer.layout import RankLayout
    from kvtransfer.plan import plan_kv_transfer

    pool, slots, layout, transport, regions, heads = _make_rank(cfg, tp_rank, cfg.prefill_tp, cfg.prefill_page_size)
    with transport:
        for layer in range(cfg.layers):  # "run the prompt": store this rank's heads
            pool.set_kv_buffer(layer, slots, reference_kv(cfg, layer, 0)[:, heads], reference_kv(cfg, layer, 1)[:, heads])
        conn.send(("ready", layout.to_msgpack(), slots.numpy()))
        rows = []
        while True:
            msg = conn.recv()
            if msg[0] == "done":
                break
            _, decode_rank, dst_layout_bytes, peer_bytes, dst_regions, dst_slots = msg
            dst_layout = RankLayout.from_msgpack(dst_layout_bytes)
            dst_regions = BufferRegions.from_wire(dst_regions)
            t0 = time.perf_counter()
            plan = plan_kv_transfer(layout, dst_layout, slots.numpy(), dst_slots)
            t1 = time.perf_counter()
            batch = plan_batch(plan, regions, dst_regions)
            t2 = time.perf_counter()
            peer = transport.connect(peer_bytes)
            t3 = time.perf_counter()
            write_batch(peer, batch, notify=f"prefill{tp_rank}".encode()).wait(timeout=HANDSHAKE_TIMEOUT_S)
            t4 = time.perf_counter()
            peer.close()
            rows.append(dict(prefill=tp_rank, decode=decode_rank, nbytes=batch.nbytes,
                             per_token=plan.num_token_entries, factored=f"{plan.num_pairs}x{plan.num_runs}",
                             entries=plan.num_entries,
                             plan_ms=(t1 - t0) * 1e3, batch_ms=(t2 - t1) * 1e3,
                             write_ms=(t4 - t3) * 1e3))
        conn.send(("stats", rows))


def _decode_rank(cfg: DemoConfig, tp_rank: int, conn) -> None:
    import torch

    pool, slots, layout, transport, regions, heads = _make_rank(cfg, tp_rank, cfg.decode_tp, cfg.decode_page_size)
    with transport:
        conn.send(("ready", layout.to_msgpack(), transport.export(), regions.to_wire(), slots.numpy()))
        expected = conn.recv()  # the prefill ranks that write here
        got, deadline = set(), time.monotonic() + HANDSHAKE_TIMEOUT_S
        while got != expected:
            got.update(int(n.payload.decode().removeprefix("prefill")) for n in transport.poll_notifications())
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode rank {tp_rank}: notifications from {sorted(got)}, expected {sorted(expected)}")
            time.sleep(1e-3)
        bad = 0
        for layer in range(cfg.layers):
            k, v = pool.get_kv_buffer(layer)
            for which, buf in ((0, k), (1, v)):
                want = reference_kv(cfg, layer, which)[:, heads]  # [tokens, local heads, D]
                bad += int((buf[slots] != want).any(dim=-1).sum())
        untouched = torch.ones(pool.size + pool.page_size, dtype=torch.bool)
        untouched[slots] = False
        stray = int(sum(bool(pool.get_kv_buffer(layer)[0][untouched].any()) for layer in range(cfg.layers)))
        conn.send(("verified", bad, stray))


def _child(conn, role: str, cfg: DemoConfig, tp_rank: int) -> None:
    try:
        (_prefill_rank if role == "prefill" else _decode_rank)(cfg, tp_rank, conn)
    except BaseException as exc:  # report to the parent, never die silently
        conn.send(("error", f"{role} rank {tp_rank}: {exc!r}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _recv(child, what: str):
    """The next message of ``child`` (a :class:`~kvtransfer._procs.Child`); one that died or
    did not answer raises ChildFailed naming its rank and how it ended."""
    msg = child.recv(tuple, what, HANDSHAKE_TIMEOUT_S)
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


def run(cfg: DemoConfig) -> int:
    from kvtransfer.layout import RankLayout
    from kvtransfer.plan import senders_for

    cfg.validate()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # children inherit: keep the table readable
    ranks = {}
    for role, tp in (("decode", cfg.decode_tp), ("prefill", cfg.prefill_tp)):
        for r in range(tp):
            ranks[role, r] = Child.spawn(_child, (role, cfg, r), name=f"{role} rank {r}")
    try:
        t0 = time.perf_counter()
        decode = {r: _recv(ranks["decode", r], "its handshake") for r in range(cfg.decode_tp)}
        prefill = {r: _recv(ranks["prefill", r], "its handshake") for r in range(cfg.prefill_tp)}
        RankLayout.from_msgpack(prefill[0][1]).check_compatible(RankLayout.from_msgpack(decode[0][1]))
        for d, (_, layout_bytes, export, dst_regions, dst_slots) in decode.items():
            senders = senders_for(RankLayout.from_msgpack(layout_bytes), cfg.prefill_tp)
            ranks["decode", d].send(set(senders))
            for p in senders:
                ranks["prefill", p].send(("write", d, layout_bytes, export, dst_regions, dst_slots))
        verdicts = {d: _recv(ranks["decode", d], "its verification") for d in range(cfg.decode_tp)}
        for p in range(cfg.prefill_tp):
            ranks["prefill", p].send(("done",))
        stats = [row for p in range(cfg.prefill_tp) for row in _recv(ranks["prefill", p], "its stats")[1]]
        wall = time.perf_counter() - t0
    finally:
        for child in ranks.values():
            child.stop()
    return _report(cfg, stats, verdicts, wall)


def _report(cfg: DemoConfig, stats: list, verdicts: dict, wall: float) -> int:
    print(f"kvtransfer transfer-demo: MHA {cfg.layers} layers x K,V, {cfg.total_heads} KV heads x {cfg.head_dim} {cfg.dtype}, "
          f"{cfg.tokens} tokens; prefill TP {cfg.prefill_tp} (page {cfg.prefill_page_size}) -> "
          f"decode TP {cfg.decode_tp} (page {cfg.decode_page_size}); NIXL/UCX over loopback, CPU memory")
    head = (f"{'prefill':>7} {'decode':>6} {'MiB':>8} {'per-token':>10} {'pairs x runs':>12} {'ranges':>9} "
            f"{'plan ms':>8} {'batch ms':>8} {'write ms':>9} {'GB/s':>6}")
    print(head)
    print("-" * len(head))
    for s in sorted(stats, key=lambda s: (s["decode"], s["prefill"])):
        gbps = s["nbytes"] / (s["write_ms"] * 1e-3) / 1e9
        print(f"{s['prefill']:>7} {s['decode']:>6} {s['nbytes'] / 2**20:>8.1f} {s['per_token']:>10,} {s['factored']:>12} {s['entries']:>9,} "
              f"{s['plan_ms']:>8.2f} {s['batch_ms']:>8.2f} {s['write_ms']:>9.1f} {gbps:>6.2f}")
    ok = True
    for d, (_, bad, stray) in sorted(verdicts.items()):
        good = bad == 0 and stray == 0
        ok &= good
        print(f"decode rank {d}: {'OK' if good else 'MISMATCH'} — {bad} token rows differ from the reference, "
              f"{stray} layers with bytes outside the request's slots")
    print(f"{'all decode ranks match the reference' if ok else 'FAILED'} ({wall:.1f} s end to end, processes included)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    d = DemoConfig()
    ap = argparse.ArgumentParser(prog="kvtransfer transfer-demo", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    for name in ("prefill_tp", "decode_tp", "total_heads", "head_dim", "layers", "tokens",
                 "prefill_page_size", "decode_page_size", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--progress-thread", action="store_true", help="run NIXL's progress thread")
    args = ap.parse_args(argv)
    cfg = DemoConfig(**vars(args))
    try:
        return run(cfg)
    except (ValueError, TimeoutError, RuntimeError) as exc:
        print(f"kvtransfer transfer-demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
