"""``kvtransfer bench move_kv``: ``MHATokenToKVPool.move_kv_cache`` against a torch copy.

On CUDA (default shape: a Llama-3-8B-like pool, 32 layers x K and V = 64 per-layer
buffers, 8 KV heads x 128 dims bf16 = 2 KiB per token row; 32,768 tokens moved between
random distinct slots of a pool of 4 x that many): in the same run, CUDA-event medians of

    torch copy_        one contiguous device-to-device copy of the same byte count
    triton kernel      move_kv_cache with index checks off (the kernel launch alone)
    triton (checked)   move_kv_cache as a pool runs it by default (index range check)
    native torch       buf[tgt] = buf[src] per buffer

GB/s counts the bytes moved once (rows x row bytes x buffers), as for the copy. The issue's
goal is ``triton kernel`` >= 70% of ``torch copy_``. ``--sweep`` also times a few tile
configurations. The first Triton move is verified against a clone-and-index reference.

Without CUDA it runs the native path on a small shape and says so.
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Optional

from kvtransfer._args import HelpFormatter, description, non_negative_int, positive_int
from kvtransfer.benchmarks._report import time_cuda, time_wall

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtransfer bench move_kv", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    p.add_argument("--layers", type=positive_int, default=None, help="layers (default 32 on CUDA, 2 on CPU)")
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", type=positive_int, default=None, help="rows moved (default 32768 on CUDA, 256 on CPU)")
    p.add_argument("--page-size", type=positive_int, default=1)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--sweep", action="store_true", help="also time a few tile configurations")
    p.add_argument("--cpu", action="store_true", help="run the CPU variant even when CUDA is present")
    return p.parse_args(argv)


def _median_seconds(fn: Callable[[], None], iters: int, warmup: int, cuda: bool) -> float:
    """Median seconds of ``fn``: CUDA events on CUDA, wall clock on CPU."""
    return (time_cuda if cuda else time_wall)(fn, iters, warmup).median


def _verify(pool, tgt, src) -> None:
    """Move once with the pool's default backend; every buffer's target rows must then hold
    the source rows read before the move (tgt and src are disjoint here)."""
    import torch

    bufs = pool.k_buffer + pool.v_buffer
    want = [b[src].view(torch.uint8).clone() for b in bufs]
    pool.move_kv_cache(tgt, src)
    for i, (b, w) in enumerate(zip(bufs, want)):
        if not torch.equal(b[tgt].view(torch.uint8), w):
            raise RuntimeError(f"move_kv_cache differs from the reference in buffer {i}")


def main(argv: Optional[List[str]] = None) -> int:
    import torch

    from pools import kv_copy
    from pools.kv_copy import MoveBackend
    from pools.mha import MHATokenToKVPool

    args = _parse(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    layers = args.layers or (32 if cuda else 2)
    tokens = args.tokens or (32768 if cuda else 256)
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, DTYPES[args.dtype])
    pool = MHATokenToKVPool(
        4 * tokens, args.page_size, dtype, args.heads, args.head_dim, layers, device, enable_kv_cache_copy=cuda
    )
    fill = torch.Generator(device=device).manual_seed(1)
    for b in pool.k_buffer + pool.v_buffer:
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=fill, dtype=torch.uint8, device=device))
    g = torch.Generator().manual_seed(0)
    # Distinct random slots past the padding page: tgt and src disjoint.
    perm = torch.randperm(4 * tokens, generator=g)[: 2 * tokens] + args.page_size
    tgt, src = perm[:tokens].to(device), perm[tokens:].to(device)
    moved = tokens * sum(int(s) for s in pool.data_strides.tolist())  # bytes moved per move
    print(
        f"move_kv: {layers} layers x K,V = {2 * layers} buffers, {args.heads} heads x {args.head_dim} "
        f"{args.dtype}, {tokens} random rows of a {4 * tokens}-slot pool, {moved / 2**20:.1f} MiB per move"
    )

    def timed(fn: Callable[[], None]) -> float:
        return _median_seconds(fn, args.iters, args.warmup, cuda)

    rows = []
    if not cuda:
        print("device: CPU (no CUDA, or --cpu): native torch path only, small shape")
        pool.move_backend = MoveBackend.NATIVE
        _verify(pool, tgt, src)
        rows.append(("native torch (CPU)", timed(lambda: pool.move_kv_cache(tgt, src))))
        base = None
    else:
        print(f"device: {torch.cuda.get_device_name()}")
        _verify(pool, tgt, src)
        a = torch.empty(moved, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        base = timed(lambda: b.copy_(a))
        del a, b
        rows.append(("torch copy_", base))
        pool.check_inputs = False
        rows.append(("triton kernel", timed(lambda: pool.move_kv_cache(tgt, src))))
        pool.check_inputs = True
        rows.append(("triton (checked)", timed(lambda: pool.move_kv_cache(tgt, src))))
        native = lambda: pool.move_kv_cache(tgt, src, backend=MoveBackend.NATIVE)  # noqa: E731
        rows.append(("native torch", timed(native)))
        if args.sweep:
            table = pool.kv_copy_table
            for block_locs in (16, 32, 64):
                for program_bytes in (16 * 1024, 32 * 1024, 64 * 1024):
                    cfg = kv_copy.launch_config(table, tokens, block_locs, program_bytes)
                    fn = lambda cfg=cfg: kv_copy.launch(table, tgt, src, cfg)  # noqa: E731
                    label = f"  locs {block_locs} x {cfg.block_words * table.word_bytes} B w{cfg.num_warps}"
                    rows.append((label, timed(fn)))

    print(f"{'case':<28} {'ms':>9} {'GB/s':>9} {'vs copy_':>9}")
    for name, sec in rows:
        ratio = f"{base / sec:8.1%}" if base else "       -"
        print(f"{name:<28} {sec * 1e3:9.3f} {moved / sec / 1e9:9.1f} {ratio:>9}")
    if base:
        kernel = dict(rows)["triton kernel"]
        verdict = "meets" if base / kernel >= 0.7 else "MISSES"
        print(f"triton kernel at {base / kernel:.1%} of torch copy_: {verdict} the 70% goal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
