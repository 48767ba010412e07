"""Paged attention over the pools: each request's keys and values are read through its
``req_to_token`` row, so prefill chunks and decode steps read exactly what earlier steps (or a
prefill node, over the transport) wrote into the pool.

Two paths: :func:`gqa_attention` (any batch of chunks, each after a cached prefix: on CUDA one
kernel rotates Q/K and writes K/V into the pool, and the Triton kernel of
:mod:`kvtransfer.models.extend_attention` reads the pool in place for all of them in one launch;
on the CPU, per request, its K/V gathered from the pool) and :func:`gqa_decode_attention` (one
token per request; the Triton kernel of :mod:`kvtransfer.models.decode_attention` reads the pool
in place). On CUDA both take every index on the device (a :class:`ForwardBatch` copies its
:class:`~kvtransfer.models.batch.ExtendIndex` there once per forward), so the captured steps of
:mod:`kvtransfer.models.runner` run them.
"""

from __future__ import annotations

from typing import Callable, Tuple, Union

import torch
import torch.nn.functional as F

from kvtransfer.models.batch import DecodeInputs, ExtendInputs, ForwardBatch
from kvtransfer.models.decode_attention import decode_attention
from kvtransfer.models.extend_attention import extend_attention
from kvtransfer.models.fused import decode_linear, rope_into_pool
from kvtransfer.models.layers import Rotary
from kvtransfer.models.parallel import TPGroup

# slots [S] -> (keys [S, kv_heads, head_dim], values [S, kv_heads, v_head_dim])
Gather = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def request_slots(req_to_token: torch.Tensor, row: int, length: int) -> torch.Tensor:
    """``[length]`` int64 pool slots of a request's first ``length`` tokens."""
    return req_to_token[row, :length].to(torch.int64)


def causal_mask(prefix: int, n: int, device) -> torch.Tensor:
    """``[n, prefix + n]`` bool: new token ``i`` sees every key up to position ``prefix + i``."""
    rows = torch.arange(n, device=device)[:, None] + prefix
    cols = torch.arange(prefix + n, device=device)[None, :]
    return cols <= rows


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` per head: ``q`` ``[heads, n, d]``, ``k`` ``[heads, S, d]``,
    ``v`` ``[heads, S, dv]``, ``mask`` ``[n, S]`` bool or None -> ``[heads, n, dv]``.

    The CPU path: ``scaled_dot_product_attention``'s CPU kernel costs ~5 ms per call for a
    single decode token (torch 2.13), so the three steps run here (softmax in fp32). CUDA tensors
    go through ``scaled_dot_product_attention`` in :func:`paged_attention`.
    """
    scores = torch.matmul(q, k.transpose(1, 2)).float() * scale  # [heads, n, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def paged_attention(q: torch.Tensor, gather: Gather, req_to_token: torch.Tensor, batch: ForwardBatch,
                    scale: float, v_head_dim: int) -> torch.Tensor:
    """Attention of the batch's new tokens over their requests' cached keys and values.

    ``q`` ``[T, heads, head_dim]``; ``gather(slots)`` reads a request's K/V from the pool (which
    already holds the new tokens'); ``heads`` is a multiple of ``kv_heads`` (grouped-query
    attention). Returns ``[T, heads, v_head_dim]``.
    """
    heads = q.shape[1]
    out = q.new_empty(q.shape[0], heads, v_head_dim)  # [T, heads, v_head_dim]
    for i, start, stop in batch.spans():
        prefix, n = batch.prefix_lens[i], stop - start
        k, v = gather(request_slots(req_to_token, batch.req_pool_indices[i], prefix + n))
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, S, head_dim], [kv_heads, S, v_head_dim]
        qi = q[start:stop].transpose(0, 1)  # [heads, n, head_dim]
        if q.is_cuda:  # fused kernels: GQA without copies, a causal flag instead of a mask from 0
            mask = None if n == 1 or prefix == 0 else causal_mask(prefix, n, q.device)
            o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                               is_causal=n > 1 and prefix == 0, enable_gqa=heads != k.shape[0])
        else:
            if heads != k.shape[0]:
                k = k.repeat_interleave(heads // k.shape[0], dim=0)  # [heads, S, head_dim]
                v = v.repeat_interleave(heads // v.shape[0], dim=0)
            mask = None if n == 1 else causal_mask(prefix, n, q.device)
            o = attend(qi, k.to(q.dtype), v.to(q.dtype), mask, scale)  # [heads, n, v_head_dim]
        out[start:stop] = o.transpose(0, 1)  # o: [heads, n, v_head_dim]
    return out


def gqa_attention(x: torch.Tensor, qkv_w: torch.Tensor, o_w: torch.Tensor, layer_id: int, kv_pool,
                  req_to_token: torch.Tensor, batch: Union[ForwardBatch, ExtendInputs], rotary: Rotary, heads: int,
                  kv_heads: int, head_dim: int, tp: TPGroup) -> torch.Tensor:
    """A Llama-style attention block over an MHA(-like) pool; returns the all-reduced output.
    ``batch`` is an :class:`ExtendInputs` only on CUDA (a captured prefill step).

    ``x`` ``[T, hidden]`` (normed); ``qkv_w`` ``[(heads + 2 * kv_heads) * head_dim, hidden]``
    (this rank's heads); ``o_w`` ``[hidden, heads * head_dim]``. The new tokens' K/V go into
    ``kv_pool`` at ``batch.out_cache_loc`` before attention reads them back.
    """
    t, d = x.shape[0], head_dim
    qkv = F.linear(x, qkv_w)  # [T, (heads + 2 * kv_heads) * head_dim]
    k_buf, v_buf = kv_pool.get_kv_buffer(layer_id)  # [rows, kv_heads, head_dim] each
    if x.is_cuda:  # one kernel rotates Q/K and writes K/V into the pool, one reads the pool in place
        q = rope_into_pool(qkv, batch.positions, batch.out_cache_loc, rotary.cos, rotary.sin, k_buf, v_buf, heads,
                           kv_heads, d)  # [T, heads, head_dim]
        ix = batch.extend_index
        o = extend_attention(q, k_buf, v_buf, req_to_token, ix.req_rows, ix.prefix_lens, ix.cu_seqlens, ix.max_extend,
                             d ** -0.5)  # [T, heads, head_dim]
    else:
        q_end, k_end = heads * d, (heads + kv_heads) * d
        q = rotary.apply(qkv[:, :q_end].view(t, heads, d), batch.positions)  # [T, heads, head_dim]
        k = rotary.apply(qkv[:, q_end:k_end].view(t, kv_heads, d), batch.positions)  # [T, kv_heads, head_dim]
        kv_pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, qkv[:, k_end:].view(t, kv_heads, d))

        def gather(slots):
            return k_buf[slots], v_buf[slots]

        o = paged_attention(q, gather, req_to_token, batch, d ** -0.5, d)  # [T, heads, head_dim]
    return tp.all_reduce(F.linear(o.reshape(t, heads * d), o_w))


def gqa_decode_attention(x: torch.Tensor, qkv_w: torch.Tensor, o_w: torch.Tensor, layer_id: int, kv_pool,
                         req_to_token: torch.Tensor, inputs: DecodeInputs, rotary: Rotary, heads: int,
                         kv_heads: int, head_dim: int, tp: TPGroup) -> torch.Tensor:
    """:func:`gqa_attention` for one new token per request, every index on the device: one
    kernel rotates Q/K and writes K/V into the pool, the Triton decode kernel reads the pool in
    place (capturable in a CUDA graph)."""
    b, d = x.shape[0], head_dim
    k_buf, v_buf = kv_pool.get_kv_buffer(layer_id)  # [rows, kv_heads, head_dim] each
    q = rope_into_pool(decode_linear(x, qkv_w), inputs.positions, inputs.out_cache_loc, rotary.cos, rotary.sin, k_buf,
                       v_buf, heads, kv_heads, d)  # [B, heads, head_dim]
    o = decode_attention(q, k_buf, v_buf, req_to_token, inputs.req_rows, inputs.seq_lens, d ** -0.5,
                         inputs.splits)  # [B, heads, head_dim]
    return tp.all_reduce(decode_linear(o.reshape(b, heads * d), o_w))
