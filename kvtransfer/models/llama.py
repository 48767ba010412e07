"""A Llama-architecture decoder over an MHA pool, tensor parallel (SmolLM2-135M is one).

Weights come in as a dict of full (unsharded) float tensors in Hugging Face's layout
(``[out_features, in_features]``; Q/K rows in half-split rope order):

    embed [vocab, hidden]        norm [hidden]
    layers.{i}.attn_norm [hidden]   layers.{i}.ffn_norm [hidden]
    layers.{i}.q [heads * head_dim, hidden]   .k / .v [kv_heads * head_dim, hidden]
    layers.{i}.o [hidden, heads * head_dim]
    layers.{i}.gate / .up [ffn, hidden]       layers.{i}.down [hidden, ffn]
    lm_head [vocab, hidden]      (absent when the embeddings are tied)

Rank ``r`` of ``t`` keeps query heads ``r*heads/t ..``, KV heads ``r*kv_heads/t ..`` (so its
pool holds exactly those heads), FFN columns ``r*ffn/t ..`` and vocabulary rows ``r*vocab/t ..``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from kvtransfer.models.attention import gqa_attention, gqa_decode_attention
from kvtransfer.models.base import Decoder, layer_weights
from kvtransfer.models.batch import DecodeInputs, ExtendInputs, ForwardBatch
from kvtransfer.models.config import EngineConfig, LlamaConfig
from kvtransfer.models.engine import Pools
from kvtransfer.models.fused import add_rms_norm, decode_linear, silu_mul
from kvtransfer.models.layers import Rotary, lm_head, rms_norm
from kvtransfer.models.parallel import TPGroup
from pools import MHATokenToKVPool, PagedTokenToKVPoolAllocator, ReqToTokenPool


class LlamaModel(Decoder):
    """Llama forward over the pools (module docstring); ``forward`` returns fp32 logits."""

    def __init__(self, config: LlamaConfig, weights: Dict[str, torch.Tensor], tp: TPGroup,
                 dtype: torch.dtype, device):
        super().__init__(config, weights, tp, dtype, device)
        self.heads = config.num_heads // tp.size
        self.kv_heads = config.num_kv_heads // tp.size
        self.layers = []
        for i in range(config.num_layers):
            w = layer_weights(weights, f"layers.{i}.")
            self.layers.append({**self.mlp_weights(w), **self.qkv_weights(w)})
        self.rotary = Rotary.build(config.head_dim, config.rope_theta, config.max_context_len, self.device)

    def make_pools(self, ec: EngineConfig) -> Pools:
        """This rank's pools: its KV heads only."""
        dev = str(self.device)
        kv = MHATokenToKVPool(ec.max_tokens, ec.page_size, self.dtype, head_num=self.kv_heads,
                              head_dim=self.config.head_dim, layer_num=self.config.num_layers, device=dev)
        return Pools(ReqToTokenPool(ec.max_requests, self.config.max_context_len, device=dev),
                     PagedTokenToKVPoolAllocator(ec.max_tokens, ec.page_size), kv)

    def layout_facts(self) -> dict:
        return {"total_kv_heads": self.config.num_kv_heads}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: Pools, all_logits: bool = False) -> torch.Tensor:
        """Logits ``[B, vocab]`` of each request's last new token (``[T, vocab]`` with
        ``all_logits``); writes the new tokens' K/V into ``pools.kv`` first."""
        cfg = self.config
        r2t = pools.req_to_token.req_to_token
        if batch.input_ids.is_cuda:  # the element-wise steps fused, as in the captured steps
            h, delta = self._fused_layers(self.embed[batch.input_ids], self._extend_attention(batch, pools),
                                          batch.after_layer)
            if not all_logits:
                last = batch.last_token_index()
                h, delta = h[last], delta[last]  # [B, hidden] each
            return self._fused_logits(h, delta)
        h = self.embed[batch.input_ids]  # [T, hidden]
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w["attn_norm"], cfg.rms_eps)
            h = h + gqa_attention(x, w["qkv"], w["o"], i, pools.kv, r2t, batch, self.rotary, self.heads,
                                  self.kv_heads, cfg.head_dim, self.tp)
            if batch.after_layer is not None:
                batch.after_layer(i + 1)
            h = self.mlp(h, w)
        return self.logits(h, batch, all_logits)

    @torch.inference_mode()
    def forward_extend(self, inputs: ExtendInputs, pools: Pools) -> torch.Tensor:
        """Logits ``[B, vocab]`` at each request's last token (``inputs.last``) of a prefill step
        of several requests' chunks, with no host synchronisation (the prefill step a CUDA graph
        captures): :meth:`forward` on CUDA with its indices already on the device."""
        return self.extend_logits(inputs, *self.extend_layers(inputs, pools, range(len(self.layers))))

    def extend_layers(self, inputs: Union[ExtendInputs, ForwardBatch], pools: Pools, layers: range,
                      stream: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layers ``layers`` of :meth:`forward_extend` (a captured graph may hold a part of the
        step; on the CPU ``inputs`` is a :class:`ForwardBatch`): the residual stream ``(h, delta)``
        after the last of them. ``stream`` ``[2, T, hidden]`` carries it between parts: read from
        it unless ``layers`` starts at layer 0 (the embeddings), copied into it unless ``layers``
        ends at the last layer."""
        if layers.start == 0 or stream is None:
            h, delta = self.embed[inputs.input_ids], None  # [T, hidden]
        else:
            h, delta = stream[0], stream[1]
        out = stream if stream is not None and layers.stop < len(self.layers) else None
        return self._fused_layers(h, self._extend_attention(inputs, pools), layers=layers, delta=delta, out=out)

    def extend_logits(self, inputs: ExtendInputs, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_extend`'s logits from :meth:`extend_layers`' output after the last layer."""
        return self._fused_logits(h[inputs.last], delta[inputs.last])

    @torch.inference_mode()
    def forward_decode(self, inputs: DecodeInputs, pools: Pools) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one new token per request, with no host synchronisation
        (the decode step a CUDA graph captures): :meth:`forward`'s arithmetic with the
        element-wise steps fused (:mod:`kvtransfer.models.fused`)."""
        r2t = pools.req_to_token.req_to_token

        def attend(i, w, x):
            return gqa_decode_attention(x, w["qkv"], w["o"], i, pools.kv, r2t, inputs, self.rotary, self.heads,
                                        self.kv_heads, self.config.head_dim, self.tp)

        h, delta = self._fused_layers(self.embed[inputs.input_ids], attend)
        return self._fused_logits(h, delta)

    def _extend_attention(self, batch, pools: Pools):
        """The attention block of a prefill step on CUDA (``batch``: a :class:`ForwardBatch` or
        :class:`ExtendInputs`) for :meth:`_fused_layers`."""
        r2t = pools.req_to_token.req_to_token

        def attend(i, w, x):
            return gqa_attention(x, w["qkv"], w["o"], i, pools.kv, r2t, batch, self.rotary, self.heads,
                                 self.kv_heads, self.config.head_dim, self.tp)

        return attend

    def _fused_layers(self, h: torch.Tensor, attend, after_layer=None, layers: Optional[range] = None,
                      delta: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
        """The layers (all, or ``layers``) with fused element-wise steps, from the residual
        stream ``h + delta`` (``[T, hidden]`` each; ``delta`` None: ``h``): ``(h, delta)``, the
        residual stream before its last add (``attend(layer, weights, normed) -> delta`` is the
        attention block, which stores the layer's K/V; then ``after_layer(i + 1)`` if given).
        With ``out`` ``[2, T, hidden]`` the last layer writes ``(h, delta)`` there itself."""
        eps = self.config.rms_eps
        layers = layers if layers is not None else range(len(self.layers))
        for i in layers:
            w = self.layers[i]
            h, x = add_rms_norm(h, delta, w["attn_norm"], eps)
            delta = attend(i, w, x)
            if after_layer is not None:
                after_layer(i + 1)
            h_out, delta_out = (out[0], out[1]) if out is not None and i == layers[-1] else (None, None)
            h, x = add_rms_norm(h, delta, w["ffn_norm"], eps, h_out=h_out)
            delta = self.tp.all_reduce(decode_linear(silu_mul(decode_linear(x, w["gate_up"])), w["down"],
                                                     out=delta_out))
            if delta_out is not None and delta.data_ptr() != delta_out.data_ptr():
                delta = delta_out.copy_(delta)  # a reduction that could not work in place
        return h, delta

    def _fused_logits(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        _, x = add_rms_norm(h, delta, self.norm, self.config.rms_eps)
        return lm_head(x, self.lm_head, self.tp)
