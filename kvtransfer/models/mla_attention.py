"""Multi-head latent attention over the MLA pool's rows in place, in the absorbed-weight form.

The pool keeps one row per token, ``[rank latent c | rope k_pe]``. Head ``h``'s key and value
are ``k_h = [W_kb[h] c | k_pe]`` and ``v_h = W_vb[h] c``, so

    score_h = q_nope_h . (W_kb[h] c) + q_pe_h . k_pe = [W_kb[h]^T q_nope_h | q_pe_h] . [c | k_pe]
    out_h   = sum_s p_s W_vb[h] c_s              = W_vb[h] (sum_s p_s c_s)

Each head's query is moved into the latent space once per token (``[T, H, rank + rope]``), the
paged kernels attend over the rows themselves (one KV head shared by every query head, the
value being the row's first ``rank`` columns) and the latent output is moved back with
``W_vb``: no cached token is decompressed and no request's rows are gathered.

Layouts: ``q_nope`` ``[T, H, nope]``, ``q_pe`` ``[T, H, rope]`` (rotated), ``w_kb``
``[H, nope, rank]``, ``w_vb`` ``[H, v_head_dim, rank]`` (``kv_b``'s rows per head),
``rows`` ``[slots, 1, rank + rope]`` (a pool layer's buffer); returns ``[T, H, v_head_dim]``.
"""

from __future__ import annotations

import torch

from kvtransfer.models.batch import ExtendIndex
from kvtransfer.models.decode_attention import decode_attention, num_splits
from kvtransfer.models.extend_attention import extend_attention


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kb: torch.Tensor, w_vb: torch.Tensor,
                  rows: torch.Tensor, req_to_token: torch.Tensor, index: ExtendIndex, scale: float) -> torch.Tensor:
    """Attention of a batch's new tokens (their rows already in the pool) over their requests'
    rows (module docstring): the split-KV decode kernel when every request adds one token, the
    extend kernel otherwise."""
    rank, rope = w_kb.shape[2], q_pe.shape[2]
    if rows.shape[2] != rank + rope:
        raise ValueError(f"rows must hold rank + rope = {rank} + {rope} columns, got {list(rows.shape)}")
    q = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_kb), q_pe), dim=-1).to(rows.dtype)  # [T, H, rank + rope]
    latent = rows[:, :, :rank]  # [slots, 1, rank], the values
    if index.max_extend == 1:
        seq_lens = index.prefix_lens + 1  # [B] int32
        splits = num_splits(q.shape[0], 1, index.max_len)
        o = decode_attention(q, rows, latent, req_to_token, index.req_rows, seq_lens, scale, splits, rope_dim=rope)
    else:
        o = extend_attention(q, rows, latent, req_to_token, index.req_rows, index.prefix_lens, index.cu_seqlens,
                             index.max_extend, scale, rope_dim=rope)
    return torch.einsum("thr,hvr->thv", o.to(w_vb.dtype), w_vb)  # o: [T, H, rank]
