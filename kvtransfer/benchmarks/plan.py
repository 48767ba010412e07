"""``kvtransfer bench plan``: time the transfer planner on one long request.

Default: a 131,072-token request, an 80-layer MHA pool (8 KV heads, head_dim 128, bf16),
page size 1, random distinct slots on both sides, prefill TP 2 -> decode TP 4, the pair
(prefill rank 0, decode rank 0). Prints the factored-plan time (warm: the buffer-pair table
is cached per layout pair, as at handshake; cold: first call), the flatten time, and entry
counts (factored table sizes, flattened entries, and the one-entry-per-(buffer, token) count
a per-token planner would emit).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvtransfer._args import HelpFormatter, description, positive_int
from kvtransfer.benchmarks._report import time_wall
from kvtransfer.plan import KVKind, RankLayout, _pair_table, plan_kv_transfer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransfer bench plan", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--tokens", type=positive_int, default=131072)
    ap.add_argument("--layers", type=positive_int, default=80)
    ap.add_argument("--heads", type=positive_int, default=8, help="total KV heads")
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--prefill-tp", type=positive_int, default=2)
    ap.add_argument("--decode-tp", type=positive_int, default=4)
    ap.add_argument("--page-size", type=positive_int, default=1)
    ap.add_argument("--slots", choices=("random", "contiguous"), default="random")
    ap.add_argument("--pool-tokens", type=positive_int, default=None, help="slots per pool (default 2 x tokens)")
    ap.add_argument("--repeat", type=positive_int, default=20)
    ap.add_argument("--flatten-repeat", type=positive_int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.pool_tokens is not None and args.pool_tokens < args.tokens:
        ap.error(f"--pool-tokens ({args.pool_tokens}) must hold the request's --tokens ({args.tokens})")

    pool = 2 * args.tokens if args.pool_tokens is None else args.pool_tokens
    num_slots = pool + args.page_size  # size, plus the padding page
    common = dict(page_size=args.page_size, layer_ids=range(args.layers), dtype="bfloat16",
                  head_dim=args.head_dim, total_heads=args.heads, num_slots=num_slots)
    src = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=args.prefill_tp, **common)
    dst = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=args.decode_tp, **common)
    rng = np.random.default_rng(args.seed)
    if args.slots == "random":
        src_slots = rng.choice(np.arange(args.page_size, num_slots), args.tokens, replace=False)
        dst_slots = rng.choice(np.arange(args.page_size, num_slots), args.tokens, replace=False)
    else:
        src_slots = np.arange(args.page_size, args.page_size + args.tokens)
        dst_slots = src_slots + args.tokens

    _pair_table.cache_clear()
    t0 = time.perf_counter()
    plan = plan_kv_transfer(src, dst, src_slots, dst_slots)
    cold = time.perf_counter() - t0
    warm = time_wall(lambda: plan_kv_transfer(src, dst, src_slots, dst_slots), args.repeat).samples
    t0 = time.perf_counter()
    flat = plan.flatten()
    fcold = time.perf_counter() - t0
    entries = int(flat[0].size)
    flat = None  # free it first: the timed runs reuse its memory instead of faulting fresh pages in
    ftimes = time_wall(plan.flatten, args.flatten_repeat).samples

    print(f"plan bench: {args.tokens} tokens, {args.layers} layers MHA H={args.heads} head_dim={args.head_dim} "
          f"bf16, page {args.page_size}, {args.slots} slots of {pool}, TP {args.prefill_tp} -> {args.decode_tp}, "
          f"pair (prefill 0, decode 0)")
    print(f"  factored plan  : median {statistics.median(warm) * 1e3:8.3f} ms, min {min(warm) * 1e3:.3f} ms "
          f"(warm, {args.repeat} runs); cold {cold * 1e3:.3f} ms")
    print(f"  plan tables    : {plan.num_pairs} buffer pairs x {plan.num_runs} slot runs")
    print(f"  flatten        : median {statistics.median(ftimes) * 1e3:8.1f} ms ({args.flatten_repeat} runs); first call {fcold * 1e3:.1f} ms "
          f"(fresh memory)")
    print(f"  entries        : {entries} flattened, {plan.num_token_entries} at one per (buffer, token), "
          f"{plan.nbytes / 2**20:.1f} MiB in {plan.nbytes / max(entries, 1):.0f} B/entry")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
