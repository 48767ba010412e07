"""``kvtransfer layouts``: the layout exports of the pools for a few model shapes.

What a decode node registers and a prefill node plans against: per buffer kind, how many
buffers (one per layer), the bytes of one page item, and the bytes one token costs.
Pools are built small (a few pages) on the CPU: item lengths do not depend on the pool size.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from kvtransfer._args import HelpFormatter, description, positive_int


def _shapes(page_size: int, tp_size: int):
    from pools import (HybridLinearKVPool, MambaPool, MambaStateParams, MHATokenToKVPool,
                       MHATokenToKVPoolFP4, MLATokenToKVPool, NSATokenToKVPool)

    size = 4 * max(page_size, 64)
    yield "Llama-3-70B  MHA bf16 (8 KV heads x 128, 80 layers)", MHATokenToKVPool(
        size, page_size, torch.bfloat16, head_num=max(1, 8 // tp_size), head_dim=128, layer_num=80, device="cpu")
    yield "Llama-3-70B  MHA fp8", MHATokenToKVPool(
        size, page_size, torch.float8_e4m3fn, head_num=max(1, 8 // tp_size), head_dim=128, layer_num=80, device="cpu")
    yield "Llama-3-70B  MHA fp4 (packed + block-16 scales)", MHATokenToKVPoolFP4(
        size, page_size, torch.bfloat16, head_num=max(1, 8 // tp_size), head_dim=128, layer_num=80, device="cpu")
    yield "DeepSeek-V3  MLA bf16 (512 + 64, 61 layers)", MLATokenToKVPool(
        size, page_size, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=61, device="cpu")
    yield "DeepSeek-V3.2 NSA (page 64, index_k fp8 + fp32 scales)", NSATokenToKVPool(
        256, 64, 512, torch.bfloat16, 64, 61, "cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576)
    params = MambaStateParams.mamba2(tp_world_size=tp_size, intermediate_size=8192, n_groups=8, num_heads=128,
                                     head_dim=64, state_size=128, conv_kernel=4, layers=list(range(0, 52, 2)))
    mamba = MambaPool(size=8, spec_state_size=0, cache_params=params, device="cpu")
    yield "Nemotron-H-like hybrid (26 Mamba2 + 26 attention layers)", HybridLinearKVPool(
        size, torch.bfloat16, page_size, head_num=max(1, 8 // tp_size), head_dim=128,
        full_attention_layer_ids=list(range(1, 52, 2)), enable_kvcache_transpose=False, device="cpu", mamba_pool=mamba)


def _describe(infos) -> str:
    _, _, items = infos
    groups = Counter(items)
    return ", ".join(f"{n} x {item:,} B" for item, n in groups.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransfer layouts", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--tp-size", type=positive_int, default=1, help="shard heads/state as one rank of this TP")
    args = ap.parse_args(argv)
    print(f"page size {args.page_size}, TP {args.tp_size} (one rank's pools); item = one page (KV) / one slot (state)")
    for name, pool in _shapes(args.page_size, args.tp_size):
        kv = pool.get_contiguous_buf_infos()
        per_token = sum(kv[2]) // pool.page_size
        print(f"\n{name}\n  KV buffers:    {len(kv[0])} ({_describe(kv)}), {per_token:,} B per token")
        state = getattr(pool, "get_state_buf_infos", None)
        if state is not None:
            infos = state()
            dims = getattr(pool, "get_state_dim_per_tensor", lambda: None)()
            dims_text = "" if dims is None else f", TP-sliced dims {sorted(set(dims))}"
            print(f"  state buffers: {len(infos[0])} ({_describe(infos)}){dims_text}")
    return 0
