"""Paged decode attention in Triton, reading K and V from the pool in place.

One new query token per request attends over the request's cached tokens. The request's row
of ``req_to_token`` maps each token position to its pool slot, so the kernel walks that row
(``BLOCK_N`` positions at a time) and loads the K/V rows at those slots: any page size (1, 16,
64, ...) reads the same way, and no request's KV is gathered into a contiguous tensor.

Layouts (``B`` requests, ``H`` query heads, ``KVH`` KV heads with ``H % KVH == 0``):

- ``q`` ``[B, H, D]``; ``k_buf`` ``[rows, KVH, D]``; ``v_buf`` ``[rows, KVH, DV]`` (a pool
  layer's buffers); ``req_to_token`` ``[R, max_context]`` int32.
- ``req_rows`` ``[B]`` int (the requests' rows), ``seq_lens`` ``[B]`` int32 (tokens to attend,
  the new one's K/V included). Both live on the device and are only read by the kernels, so a
  launch has a fixed grid for a batch size and can be captured in a CUDA graph.
- returns ``[B, H, DV]`` in ``q``'s dtype.

MLA (absorbed weights): ``k_buf`` is the pool's latent rows ``[rows, 1, rank + rope]``, ``v_buf``
their first ``rank`` columns (a view, ``[rows, 1, rank]``), ``q`` each head's query moved into
the latent space (``[B, H, rank + rope]``) and ``rope_dim`` the rope columns, whose products are
taken as a second tile (so a 512 + 64 row is not padded to 1024).

Split-KV ("flash decoding"): program ``(b, kv_head, split)`` handles the query heads of one KV
head (GQA: the ``H / KVH`` heads share each K/V load, padded to a tile of 16 rows for
``tl.dot``) over one slice of the sequence, and writes a partial output with its log-sum-exp;
a second kernel merges the splits. Splits that fall past a short sequence write an empty
partial (log-sum-exp ``-inf``).

CPU tensors run the same kernels in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
in the environment before triton is first imported (the kernels call triton's own jitted
helpers, which are jitted at that import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from pools._checks import check_tensor

try:  # triton is optional (not installed on every platform)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

SM_TARGET = 264  # programs to aim for per launch (two per SM of an H100/H200)
MAX_SPLITS = 32


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if tl is not None:

    @triton.jit
    def _split_kernel(
        Q, K, V, R2T, ROWS, LENS, PART, LSE,
        stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_r2t,
        scale,
        SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, DPE: tl.constexpr, BLOCK_DPE: tl.constexpr, DV: tl.constexpr,
        BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(ROWS + b).to(tl.int64)
        length = tl.load(LENS + b)
        per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, length)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
        g_ok = offs_g < GROUP
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr, mask=g_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_G, BLOCK_D]
        if DPE > 0:  # the rope part of each head, columns D .. D + DPE
            offs_pe = tl.arange(0, BLOCK_DPE)
            q_pe = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + D + offs_pe[None, :],
                           mask=g_ok[:, None] & (offs_pe[None, :] < DPE), other=0.0)  # [BLOCK_G, BLOCK_DPE]

        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
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
            s = tl.where(n_ok[None, :], s * scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
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

        has = l > 0
        out = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        # PART [B, H, SPLITS, DV] fp32, LSE [B, H, SPLITS] fp32 (contiguous)
        part_ptr = PART + ((b * (GROUP * tl.num_programs(1)) + heads[:, None]) * SPLITS + split) * DV + offs_dv[None, :]
        tl.store(part_ptr, out, mask=g_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE + (b * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(PART, LSE, O, stride_ob, stride_oh, H,
                      SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_dv = tl.arange(0, BLOCK_DV)
        s_ok = offs_s < SPLITS
        base = b * H + h
        lse = tl.load(LSE + base * SPLITS + offs_s, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
        top = tl.max(lse, 0)
        w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - top), 0.0)
        part = tl.load(PART + (base * SPLITS + offs_s[:, None]) * DV + offs_dv[None, :],
                       mask=s_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_S, BLOCK_DV]
        out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(O + b * stride_ob + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=offs_dv < DV)


def num_splits(batch: int, kv_heads: int, max_len: int, block_n: int = 64) -> int:
    """Splits per sequence so that a launch has about ``SM_TARGET`` programs, no more than
    the longest sequence has blocks (a power of two, at most ``MAX_SPLITS``)."""
    want = max(1, SM_TARGET // max(1, batch * kv_heads))
    blocks = max(1, -(-max_len // block_n))
    return min(next_pow2(want), next_pow2(blocks), MAX_SPLITS)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_rows: torch.Tensor, seq_lens: torch.Tensor, scale: float, splits: int,
                     out: Optional[torch.Tensor] = None, rope_dim: int = 0) -> torch.Tensor:
    """Attention of one query token per request over its cached K/V (module docstring for the
    layouts; ``rope_dim`` for MLA's latent rows). ``splits`` (a power of two, e.g.
    :func:`num_splits`) is fixed per launch shape; the sequence lengths are read on the device.
    ``out`` ``[B, H, DV]`` is written if given."""
    if triton is None:
        raise RuntimeError("paged decode attention needs the triton package, which is not installed")
    b, h, d = check_paged(q, k_buf, v_buf, req_to_token, req_rows, rope_dim)
    check_tensor("req_rows", req_rows, shape=[b])
    check_tensor("seq_lens", seq_lens, shape=[b], dtype=torch.int32, device=q.device)
    if not isinstance(splits, int) or isinstance(splits, bool) or splits <= 0 or splits & (splits - 1):
        raise ValueError(f"splits must be a positive power of two, got {splits!r}")
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    group = h // kvh
    if out is None:
        out = q.new_empty(b, h, dv)  # [B, H, DV]
    else:
        check_tensor("out", out, shape=[b, h, dv], dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part = torch.empty(b, h, splits, dv, dtype=torch.float32, device=q.device)  # [B, H, SPLITS, DV]
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)  # [B, H, SPLITS]
    t = Tiles.of(d - rope_dim, rope_dim, dv)
    _split_kernel[(b, kvh, splits)](
        q, k_buf, v_buf, req_to_token, req_rows, seq_lens, part, lse,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), float(scale),
        SPLITS=splits, GROUP=group, BLOCK_G=max(16, next_pow2(group)), D=d - rope_dim, BLOCK_D=t.block_d,
        DPE=rope_dim, BLOCK_DPE=t.block_dpe, DV=dv, BLOCK_DV=t.block_dv, BLOCK_N=t.block_n,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )
    _merge_kernel[(b, h)](part, lse, out, out.stride(0), out.stride(1), h,
                             SPLITS=splits, BLOCK_S=max(2, splits), DV=dv, BLOCK_DV=t.block_dv, num_warps=4)
    return out


@dataclass(frozen=True)
class Tiles:
    """Tile widths of the paged-attention kernels for head parts of ``d`` (main), ``dpe`` (rope,
    0 for none) and ``dv`` (value) columns: powers of two of at least 16 (``tl.dot``'s least), and
    fewer keys per step for wide heads."""

    block_d: int
    block_dpe: int
    block_dv: int
    block_n: int

    @classmethod
    def of(cls, d: int, dpe: int, dv: int) -> "Tiles":
        block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
        widest = max(block_d, block_dv)
        return cls(block_d, max(16, next_pow2(dpe)), block_dv, 64 if widest <= 128 else 32 if widest <= 256 else 16)


def check_paged(q, k_buf, v_buf, req_to_token, req_rows, rope_dim: int) -> Tuple[int, int, int]:
    """``(rows of q, H, D)`` after checking the arguments the paged-attention kernels share:
    ``q`` ``[*, H, D]``, ``k_buf`` ``[rows, KVH, D]`` (``D`` counts the ``rope_dim`` rope columns),
    ``v_buf`` ``[rows, KVH, DV]`` of ``q``'s dtype and device, ``req_to_token`` int32, ``req_rows``
    ``[B]`` int32 or int64, every last dim contiguous."""
    check_tensor("q", q, shape=[None, None, None])
    _, h, d = q.shape
    check_tensor("k_buf", k_buf, shape=[None, None, d], dtype=q.dtype, device=q.device)
    check_tensor("v_buf", v_buf, shape=[k_buf.shape[0], k_buf.shape[1], None], dtype=q.dtype, device=q.device)
    if h % k_buf.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({k_buf.shape[1]})")
    check_tensor("req_to_token", req_to_token, shape=[None, None], dtype=torch.int32, device=q.device)
    check_tensor("req_rows", req_rows, shape=[None], device=q.device)
    if req_rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"req_rows must be int32 or int64, got {req_rows.dtype}")
    if q.stride(2) != 1 or k_buf.stride(2) != 1 or v_buf.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("q, k_buf, v_buf and req_to_token must be contiguous in their last dim")
    if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or not 0 <= rope_dim < d:
        raise ValueError(f"rope_dim must be an int in [0, {d}), got {rope_dim!r}")
    return q.shape[0], h, d
