"""A tiny seeded hybrid model: full-attention layers (GQA over a :class:`pools.HybridLinearKVPool`)
and Mamba2 layers (state in the :class:`pools.MambaPool` of a :class:`pools.HybridReqToTokenPool`).

Every layer is ``h += mixer(norm(h)); h += mlp(norm(h))`` with the mixer either attention or
:class:`kvtransfer.models.mamba2.Mamba2Mixer`. Layer ids are global: the KV pool holds the
attention layers, the Mamba pool the others.
"""

from __future__ import annotations

from typing import Dict

import torch

from kvtransfer.models.attention import gqa_attention, gqa_decode_attention
from kvtransfer.models.base import Decoder, layer_weights
from kvtransfer.models.batch import DecodeInputs, ForwardBatch
from kvtransfer.models.config import EngineConfig, HybridConfig, LayerKind
from kvtransfer.models.engine import Pools
from kvtransfer.models.layers import Rotary, lm_head, rms_norm
from kvtransfer.models.mamba2 import Mamba2Mixer, add_seeded_mixer
from kvtransfer.models.parallel import TPGroup
from kvtransfer.models.seeded import WeightMaker
from pools import HybridLinearKVPool, HybridReqToTokenPool, MambaStateParams, PagedTokenToKVPoolAllocator


def seeded_weights(cfg: HybridConfig) -> Dict[str, torch.Tensor]:
    mk = WeightMaker(cfg.seed)
    mk.embeddings(cfg.vocab_size, cfg.hidden_size)
    h, d = cfg.hidden_size, cfg.head_dim
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"layers.{i}"
        mk.ones(f"{p}.attn_norm", h)
        if kind is LayerKind.ATTENTION:
            mk.normal(f"{p}.q", (cfg.num_heads * d, h))
            mk.normal(f"{p}.k", (cfg.num_kv_heads * d, h))
            mk.normal(f"{p}.v", (cfg.num_kv_heads * d, h))
            mk.normal(f"{p}.o", (h, cfg.num_heads * d))
        else:
            add_seeded_mixer(mk, f"{p}.mamba", cfg)
        mk.mlp(p, h, cfg.intermediate_size)
    return mk.weights


class TinyHybridModel(Decoder):
    """Hybrid forward over the hybrid pools (module docstring)."""

    def __init__(self, config: HybridConfig, weights: Dict[str, torch.Tensor], tp: TPGroup,
                 dtype: torch.dtype, device):
        super().__init__(config, weights, tp, dtype, device)
        self.heads = config.num_heads // tp.size
        self.kv_heads = config.num_kv_heads // tp.size
        self.layers = []
        for i, kind in enumerate(config.layer_kinds):
            w = layer_weights(weights, f"layers.{i}.")
            layer = self.mlp_weights(w)
            if kind is LayerKind.ATTENTION:
                layer.update(self.qkv_weights(w))
            else:
                layer["mamba"] = Mamba2Mixer(config, layer_weights(w, "mamba."), tp, dtype, self.device)
            self.layers.append(layer)
        self.rotary = Rotary.build(config.head_dim, config.rope_theta, config.max_context_len, self.device)

    def state_params(self) -> MambaStateParams:
        cfg = self.config
        return MambaStateParams.mamba2(
            tp_world_size=self.tp.size, intermediate_size=cfg.mamba_intermediate, n_groups=cfg.n_groups,
            num_heads=cfg.mamba_heads, head_dim=cfg.mamba_head_dim, state_size=cfg.state_size,
            conv_kernel=cfg.conv_kernel, layers=cfg.mamba_layers, conv_dtype=self.dtype,
            temporal_dtype=torch.float32,
        )

    def make_pools(self, ec: EngineConfig) -> Pools:
        """Rows + one Mamba slot per request; KV of this rank's heads for the attention layers."""
        cfg, dev = self.config, str(self.device)
        req = HybridReqToTokenPool(
            size=ec.max_requests, mamba_size=ec.max_requests, mamba_spec_state_size=0,
            max_context_len=cfg.max_context_len, device=dev, cache_params=self.state_params(),
            mamba_layer_ids=cfg.mamba_layers, enable_mamba_extra_buffer=False,
        )
        kv = HybridLinearKVPool(
            ec.max_tokens, self.dtype, ec.page_size, head_num=self.kv_heads, head_dim=cfg.head_dim,
            full_attention_layer_ids=cfg.attention_layers, enable_kvcache_transpose=False, device=dev,
            mamba_pool=req.mamba_pool,
        )
        return Pools(req, PagedTokenToKVPoolAllocator(ec.max_tokens, ec.page_size), kv)

    def layout_facts(self) -> dict:
        cfg = self.config  # the conv row is [x | B | C], cut one by one (Mamba2Mixer)
        groups = [cfg.mamba_intermediate, (cfg.n_groups, cfg.state_size), (cfg.n_groups, cfg.state_size)]
        return {"total_kv_heads": cfg.num_kv_heads, "conv_shard_groups": groups}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: Pools, all_logits: bool = False) -> torch.Tensor:
        cfg = self.config
        if batch.mamba_slots is None:
            raise ValueError("a hybrid model's batch needs mamba_slots, got None")
        h = self.embed[batch.input_ids]  # [T, hidden]
        r2t = pools.req_to_token.req_to_token
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w["attn_norm"], cfg.rms_eps)
            if "mamba" in w:
                h = h + w["mamba"].forward(x, batch, pools.req_to_token.mamba2_layer_cache(i))
            else:
                h = h + gqa_attention(x, w["qkv"], w["o"], i, pools.kv, r2t, batch, self.rotary, self.heads,
                                      self.kv_heads, cfg.head_dim, self.tp)
                if batch.after_layer is not None:  # the pool's KV layers up to this one hold their K/V
                    batch.after_layer(pools.kv.full_attention_layer_id_mapping[i] + 1)
            h = self.mlp(h, w)
        return self.logits(h, batch, all_logits)

    @torch.inference_mode()
    def forward_decode(self, inputs: DecodeInputs, pools: Pools) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one new token per request with no host synchronisation (the
        decode step a CUDA graph captures): the Mamba layers step their states by
        ``inputs.mamba_slots``, the attention layers read the pool in place."""
        cfg = self.config
        h = self.embed[inputs.input_ids]  # [B, hidden]
        r2t = pools.req_to_token.req_to_token
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w["attn_norm"], cfg.rms_eps)
            if "mamba" in w:
                h = h + w["mamba"].forward_decode(x, inputs.mamba_slots, pools.req_to_token.mamba2_layer_cache(i))
            else:
                h = h + gqa_decode_attention(x, w["qkv"], w["o"], i, pools.kv, r2t, inputs, self.rotary, self.heads,
                                             self.kv_heads, cfg.head_dim, self.tp)
            h = self.mlp(h, w)
        return lm_head(rms_norm(h, self.norm, cfg.rms_eps), self.lm_head, self.tp)
