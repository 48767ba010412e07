"""A tiny seeded DeepSeek-V2-style model: multi-head latent attention over an MLA pool.

Per layer and token the pool keeps one row ``[kv_lora_rank latent c | qk_rope_head_dim k_pe]``
(the normed latent and the rotated shared rope key). Attention decompresses the latent of every
cached token with ``kv_b`` into per-head ``k_nope`` and ``v``:

    q = W_q x                      -> [heads, nope | rope]   (rope part rotated)
    [c | k_pe] = W_kv_a x          -> c normed, k_pe rotated (one rope key shared by the heads)
    [k_nope | v] = W_kv_b c        -> [heads, nope | v_head_dim]
    score = q_nope . k_nope + q_pe . k_pe,  scale (nope + rope)^-1/2

On CUDA the attention runs in the absorbed-weight form over the pool's rows in place
(:mod:`kvtransfer.models.mla_attention`); the CPU path decompresses as above.

Tensor parallel: query heads (``W_q`` rows, ``W_kv_b`` rows, ``W_o`` columns) are split; ``W_kv_a``
and the latent are replicated, so every rank's pool holds the same full rows (what a decode
rank of any TP size needs).

Weights (full): ``embed``, ``norm``, ``lm_head``; per layer ``attn_norm``, ``q``
``[heads * (nope + rope), hidden]``, ``kv_a`` ``[rank + rope, hidden]``, ``kv_norm`` ``[rank]``,
``kv_b`` ``[heads * (nope + v), rank]``, ``o`` ``[hidden, heads * v]``, and the MLP.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from kvtransfer.models.attention import paged_attention
from kvtransfer.models.base import Decoder, layer_weights
from kvtransfer.models.batch import ForwardBatch
from kvtransfer.models.config import EngineConfig, MLAConfig
from kvtransfer.models.engine import Pools
from kvtransfer.models.layers import Rotary, rms_norm
from kvtransfer.models.mla_attention import mla_attention
from kvtransfer.models.parallel import TPGroup, shard
from kvtransfer.models.seeded import WeightMaker
from pools import MLATokenToKVPool, PagedTokenToKVPoolAllocator, ReqToTokenPool


def seeded_weights(cfg: MLAConfig) -> Dict[str, torch.Tensor]:
    mk = WeightMaker(cfg.seed)
    mk.embeddings(cfg.vocab_size, cfg.hidden_size)
    h, n = cfg.hidden_size, cfg.num_heads
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        mk.ones(f"{p}.attn_norm", h)
        mk.normal(f"{p}.q", (n * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), h))
        mk.normal(f"{p}.kv_a", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h))
        mk.ones(f"{p}.kv_norm", cfg.kv_lora_rank)
        mk.normal(f"{p}.kv_b", (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        mk.normal(f"{p}.o", (h, n * cfg.v_head_dim))
        mk.mlp(p, h, cfg.intermediate_size)
    return mk.weights


class TinyMLAModel(Decoder):
    """MLA forward over an :class:`pools.MLATokenToKVPool` (module docstring)."""

    def __init__(self, config: MLAConfig, weights: Dict[str, torch.Tensor], tp: TPGroup,
                 dtype: torch.dtype, device):
        super().__init__(config, weights, tp, dtype, device)
        self.heads = config.num_heads // tp.size
        self.layers = []
        for i in range(config.num_layers):
            w = layer_weights(weights, f"layers.{i}.")
            self.layers.append({
                **self.mlp_weights(w),
                "kv_norm": self.put(w["kv_norm"]),
                "q": self.put(shard(w["q"], tp)),  # [heads / tp * (nope + rope), hidden]
                "kv_a": self.put(w["kv_a"]),  # [rank + rope, hidden], replicated
                "kv_b": self.put(shard(w["kv_b"], tp)),  # [heads / tp * (nope + v), rank]
                "o": self.put(shard(w["o"], tp, 1)),  # [hidden, heads / tp * v]
            })
        self.rotary = Rotary.build(config.qk_rope_head_dim, config.rope_theta, config.max_context_len, self.device)

    def make_pools(self, ec: EngineConfig) -> Pools:
        """One latent row per token and layer, the same on every rank."""
        cfg, dev = self.config, str(self.device)
        kv = MLATokenToKVPool(ec.max_tokens, ec.page_size, self.dtype, kv_lora_rank=cfg.kv_lora_rank,
                              qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=cfg.num_layers, device=dev)
        return Pools(ReqToTokenPool(ec.max_requests, cfg.max_context_len, device=dev),
                     PagedTokenToKVPoolAllocator(ec.max_tokens, ec.page_size), kv)

    def _attention(self, x, w, layer_id: int, batch: ForwardBatch, pools: Pools) -> torch.Tensor:
        cfg, t, n = self.config, x.shape[0], self.heads
        nope, rope, rank, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        q = F.linear(x, w["q"]).view(t, n, nope + rope)  # [T, heads, nope + rope]
        q = torch.cat((q[..., :nope], self.rotary.apply(q[..., nope:], batch.positions)), dim=-1)
        kv_a = F.linear(x, w["kv_a"])  # [T, rank + rope]
        latent = rms_norm(kv_a[:, :rank], w["kv_norm"], cfg.rms_eps).view(t, 1, rank)  # [T, 1, rank]
        k_pe = self.rotary.apply(kv_a[:, rank:].reshape(t, 1, rope), batch.positions)  # [T, 1, rope]
        pools.kv.set_mla_kv_buffer(layer_id, batch.out_cache_loc, latent, k_pe)
        rows = pools.kv.get_key_buffer(layer_id)  # [rows, 1, rank + rope]
        r2t, scale = pools.req_to_token.req_to_token, (nope + rope) ** -0.5
        if x.is_cuda:  # absorbed weights, the rows read in place
            kv_b = w["kv_b"].view(n, nope + vd, rank)  # [heads, nope + v, rank]
            o = mla_attention(q[..., :nope], q[..., nope:], kv_b[:, :nope], kv_b[:, nope:], rows, r2t,
                              batch.extend_index, scale)  # [T, heads, v]
            return self.tp.all_reduce(F.linear(o.reshape(t, n * vd), w["o"]))

        def gather(slots):
            cached = rows[slots][:, 0].to(x.dtype)  # [S, rank + rope]
            s = cached.shape[0]
            kv = F.linear(cached[:, :rank], w["kv_b"]).view(s, n, nope + vd)  # [S, heads, nope + v]
            k = torch.cat((kv[..., :nope], cached[:, None, rank:].expand(s, n, rope)), dim=-1)  # [S, heads, nope + rope]
            return k, kv[..., nope:]

        o = paged_attention(q, gather, r2t, batch, scale, vd)
        return self.tp.all_reduce(F.linear(o.reshape(t, n * vd), w["o"]))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: Pools, all_logits: bool = False) -> torch.Tensor:
        h = self.embed[batch.input_ids]  # [T, hidden]
        for i, w in enumerate(self.layers):
            h = h + self._attention(rms_norm(h, w["attn_norm"], self.config.rms_eps), w, i, batch, pools)
            if batch.after_layer is not None:
                batch.after_layer(i + 1)
            h = self.mlp(h, w)
        return self.logits(h, batch, all_logits)
