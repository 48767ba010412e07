"""Paged extend (prefill) attention in Triton, reading K and V from the pool in place.

Each request of a batch adds a chunk of new tokens after a cached prefix; the new tokens' K/V
are already written into the pool (the models write before they attend). New token ``i`` of
request ``b`` sits at position ``prefix_lens[b] + i`` and attends to every position up to its
own: the cached prefix and, causally, the chunk itself. The kernel reads all of them through
the request's row of ``req_to_token`` (which maps a position to its pool slot, so any page size
reads the same way); no request's KV is gathered into a contiguous tensor. The chunks of
several requests, of any lengths, run in one launch as packed tokens.

Layouts (``B`` requests, ``T`` new tokens in all, ``H`` query heads, ``KVH`` KV heads with
``H % KVH == 0``):

- ``q`` ``[T, H, D]``, request ``b``'s tokens at ``cu_seqlens[b]:cu_seqlens[b + 1]``;
  ``k_buf`` ``[rows, KVH, D]``; ``v_buf`` ``[rows, KVH, DV]`` (a pool layer's buffers);
  ``req_to_token`` ``[R, max_context]`` int32.
- ``req_rows`` ``[B]`` int32/int64 (the requests' rows), ``prefix_lens`` ``[B]`` int32,
  ``cu_seqlens`` ``[B + 1]`` int32 (0, then the running sum of the chunk lengths), all on the
  device; ``max_extend`` (the longest chunk, a host int) sizes the grid.
- returns ``[T, H, DV]`` in ``q``'s dtype.

MLA's latent rows read as in :mod:`kvtransfer.models.decode_attention` (``rope_dim``).

Program ``(b, m, h)`` takes ``BLOCK_M`` new tokens of request ``b`` for query head ``h``, walks
positions ``0 .. prefix + (last of its tokens)`` ``BLOCK_N`` at a time with an online softmax in
fp32, and masks keys past each token's own position. Programs past a short chunk return at once.

CPU tensors run the same kernel in Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is first imported).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvtransfer.models.decode_attention import Tiles, check_paged, next_pow2
from pools._checks import check_tensor

try:  # triton is optional (not installed on every platform)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None


if tl is not None:

    @triton.jit
    def _extend_kernel(
        Q, K, V, R2T, ROWS, PREFIX, CU, O,
        stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_r2t, stride_ot, stride_oh,
        scale,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DPE: tl.constexpr, BLOCK_DPE: tl.constexpr,
        DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        m_block = tl.program_id(1)
        h = tl.program_id(2)
        start = tl.load(CU + b)
        n = tl.load(CU + b + 1) - start
        if m_block * BLOCK_M < n:
            prefix = tl.load(PREFIX + b)
            row = tl.load(ROWS + b).to(tl.int64)
            kvh = h // GROUP
            offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token index in the chunk
            offs_d = tl.arange(0, BLOCK_D)
            offs_dv = tl.arange(0, BLOCK_DV)
            offs_n = tl.arange(0, BLOCK_N)
            m_ok = offs_m < n
            tokens = (start + offs_m).to(tl.int64)
            q = tl.load(Q + tokens[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_M, BLOCK_D]
            if DPE > 0:  # the rope part of each head, columns D .. D + DPE
                offs_pe = tl.arange(0, BLOCK_DPE)
                q_pe = tl.load(Q + tokens[:, None] * stride_qt + h * stride_qh + D + offs_pe[None, :],
                               mask=m_ok[:, None] & (offs_pe[None, :] < DPE), other=0.0)  # [BLOCK_M, BLOCK_DPE]
            q_pos = prefix + offs_m  # [BLOCK_M] positions of the queries
            hi = prefix + tl.minimum((m_block + 1) * BLOCK_M, n)  # keys past the block's last query: none

            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for lo in range(0, hi, BLOCK_N):  # position 0 is in the first block: every row's m is finite after it
                pos = lo + offs_n  # [BLOCK_N]
                n_ok = pos < hi
                slots = tl.load(R2T + row * stride_r2t + pos, mask=n_ok, other=0).to(tl.int64)  # [BLOCK_N]
                k = tl.load(K + slots[:, None] * stride_kr + kvh * stride_kh + offs_d[None, :],
                            mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_N, BLOCK_D]
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                if DPE > 0:
                    k_pe = tl.load(K + slots[:, None] * stride_kr + kvh * stride_kh + D + offs_pe[None, :],
                                   mask=n_ok[:, None] & (offs_pe[None, :] < DPE), other=0.0)  # [BLOCK_N, BLOCK_DPE]
                    if IEEE:
                        s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
                    else:
                        s += tl.dot(q_pe, tl.trans(k_pe))
                seen = n_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N] causal
                s = tl.where(seen, s * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                l = l * alpha + tl.sum(p, 1)
                v = tl.load(V + slots[:, None] * stride_vr + kvh * stride_vh + offs_dv[None, :],
                            mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            out = acc / l[:, None]
            tl.store(O + tokens[:, None] * stride_ot + h * stride_oh + offs_dv[None, :], out.to(O.dtype.element_ty),
                     mask=m_ok[:, None] & (offs_dv[None, :] < DV))


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_rows: torch.Tensor, prefix_lens: torch.Tensor, cu_seqlens: torch.Tensor, max_extend: int,
                     scale: float, out: Optional[torch.Tensor] = None, rope_dim: int = 0) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix and themselves
    (module docstring for the layouts; ``rope_dim`` for MLA's latent rows, as in
    :func:`kvtransfer.models.decode_attention.decode_attention`). ``out`` ``[T, H, DV]`` is
    written if given."""
    if triton is None:
        raise RuntimeError("paged extend attention needs the triton package, which is not installed")
    t, h, d = check_paged(q, k_buf, v_buf, req_to_token, req_rows, rope_dim)
    b = req_rows.shape[0]
    check_tensor("prefix_lens", prefix_lens, shape=[b], dtype=torch.int32, device=q.device)
    check_tensor("cu_seqlens", cu_seqlens, shape=[b + 1], dtype=torch.int32, device=q.device)
    if not isinstance(max_extend, int) or isinstance(max_extend, bool) or max_extend < 0:
        raise ValueError(f"max_extend must be an int >= 0, got {max_extend!r}")
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    if out is None:
        out = q.new_empty(t, h, dv)  # [T, H, DV]
    else:
        check_tensor("out", out, shape=[t, h, dv], dtype=q.dtype, device=q.device)
    if b == 0 or t == 0 or max_extend == 0:
        return out
    tiles = Tiles.of(d - rope_dim, rope_dim, dv)
    block_m = min(tiles.block_n, max(16, next_pow2(max_extend)))
    _extend_kernel[(b, triton.cdiv(max_extend, block_m), h)](
        q, k_buf, v_buf, req_to_token, req_rows, prefix_lens, cu_seqlens, out,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1), float(scale),
        GROUP=h // kvh, D=d - rope_dim, BLOCK_D=tiles.block_d, DPE=rope_dim, BLOCK_DPE=tiles.block_dpe, DV=dv,
        BLOCK_DV=tiles.block_dv, BLOCK_M=block_m, BLOCK_N=tiles.block_n, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out
