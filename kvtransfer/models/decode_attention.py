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
        BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
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
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query token per request over its cached K/V (module docstring for the
    layouts). ``splits`` (a power of two, e.g. :func:`num_splits`) is fixed per launch shape;
    the sequence lengths are read on the device. ``out`` ``[B, H, DV]`` is written if given."""
    if triton is None:
        raise RuntimeError("paged decode attention needs the triton package, which is not installed")
    b, h, d = _check(q, k_buf, v_buf, req_to_token, req_rows, seq_lens, splits)
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
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    block_n = 64 if max(block_d, block_dv) <= 128 else 32
    _split_kernel[(b, kvh, splits)](
        q, k_buf, v_buf, req_to_token, req_rows, seq_lens, part, lse,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), float(scale),
        SPLITS=splits, GROUP=group, BLOCK_G=max(16, next_pow2(group)), D=d, BLOCK_D=block_d,
        DV=dv, BLOCK_DV=block_dv, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    _merge_kernel[(b, h)](part, lse, out, out.stride(0), out.stride(1), h,
                             SPLITS=splits, BLOCK_S=max(2, splits), DV=dv, BLOCK_DV=block_dv, num_warps=4)
    return out


def _check(q, k_buf, v_buf, req_to_token, req_rows, seq_lens, splits) -> Tuple[int, int, int]:
    check_tensor("q", q, shape=[None, None, None])
    b, h, d = q.shape
    check_tensor("k_buf", k_buf, shape=[None, None, d], dtype=q.dtype, device=q.device)
    check_tensor("v_buf", v_buf, shape=[k_buf.shape[0], k_buf.shape[1], None], dtype=q.dtype, device=q.device)
    if h % k_buf.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({k_buf.shape[1]})")
    check_tensor("req_to_token", req_to_token, shape=[None, None], dtype=torch.int32, device=q.device)
    check_tensor("req_rows", req_rows, shape=[b], device=q.device)
    check_tensor("seq_lens", seq_lens, shape=[b], dtype=torch.int32, device=q.device)
    if req_rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"req_rows must be int32 or int64, got {req_rows.dtype}")
    if q.stride(2) != 1 or k_buf.stride(2) != 1 or v_buf.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("q, k_buf, v_buf and req_to_token must be contiguous in their last dim")
    if not isinstance(splits, int) or isinstance(splits, bool) or splits <= 0 or splits & (splits - 1):
        raise ValueError(f"splits must be a positive power of two, got {splits!r}")
    return b, h, d
