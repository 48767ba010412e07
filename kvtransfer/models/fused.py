"""Fused Triton kernels of the decode step: a step of a small model is bound by how many kernels
it launches, so the element-wise work between the matmuls runs as one kernel each.

- :func:`add_rms_norm`: ``h + delta`` and RMSNorm of the sum (as :func:`layers.rms_norm`: the
  mean of squares in float32, the normalised row cast to the model dtype, then times the weight).
  ``h`` ``[T, hidden]``, ``delta`` ``[T, hidden]`` or None, ``weight`` ``[hidden]``.
- :func:`rope_into_pool`: from the fused projection ``qkv`` ``[T, (heads + 2 * kv_heads) * D]``,
  the half-split rotary embedding of Q and K at ``positions`` ``[T]`` (``cos``/``sin``
  ``[max_pos, D / 2]`` fp32, :class:`layers.Rotary`'s tables); returns rotated Q
  ``[T, heads, D]`` and writes rotated K and V into the pool's ``k_buf``/``v_buf``
  ``[rows, kv_heads, D]`` at ``out_cache_loc`` ``[T]``.
- :func:`silu_mul`: ``silu(gate) * up`` of ``gate_up`` ``[T, 2 * ffn]`` (gate columns first).
- :func:`small_linear`: ``x @ w.T`` for ``x`` ``[M, K]`` with ``M <= GEMV_MAX_ROWS`` and
  ``w`` ``[N, K]``, a matrix-vector kernel for the few rows of a small decode batch
  (:func:`decode_linear` chooses it or cuBLAS).

Each reads its indices on the device: all are capturable in CUDA graphs. CPU tensors run them
in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before triton is first imported.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kvtransfer.models.decode_attention import next_pow2
from pools._checks import check_tensor

try:  # triton is optional (not installed on every platform)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None


if tl is not None:

    @triton.jit
    def _add_rms_norm_kernel(H, DELTA, W, H_OUT, X_OUT, N, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        h = tl.load(H + t * N + offs, mask=ok, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(DELTA + t * N + offs, mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
            tl.store(H_OUT + t * N + offs, h, mask=ok)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
        y = (hf * rstd).to(h.dtype).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(X_OUT + t * N + offs, (w * y).to(X_OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kernel(QKV, POS, LOC, COS, SIN, Q_OUT, K_BUF, V_BUF, stride_qkv, stride_kr, stride_vr,
                     HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        pos = tl.load(POS + t).to(tl.int64)
        src = QKV + t * stride_qkv + head * D
        if head < HEADS + KV_HEADS:
            cos = tl.load(COS + pos * HALF + offs)
            sin = tl.load(SIN + pos * HALF + offs)
            x1 = tl.load(src + offs).to(tl.float32)
            x2 = tl.load(src + HALF + offs).to(tl.float32)
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            if head < HEADS:
                dst = Q_OUT + (t * HEADS + head) * D
            else:
                loc = tl.load(LOC + t).to(tl.int64)
                dst = K_BUF + loc * stride_kr + (head - HEADS) * D
            tl.store(dst + offs, o1.to(dst.dtype.element_ty))
            tl.store(dst + HALF + offs, o2.to(dst.dtype.element_ty))
        else:
            loc = tl.load(LOC + t).to(tl.int64)
            dst = V_BUF + loc * stride_vr + (head - HEADS - KV_HEADS) * D
            tl.store(dst + offs, tl.load(src + offs))
            tl.store(dst + HALF + offs, tl.load(src + HALF + offs))

    @triton.jit
    def _silu_mul_kernel(GU, OUT, F, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < F
        g = tl.load(GU + t * 2 * F + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + t * 2 * F + F + offs, mask=ok, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
        tl.store(OUT + t * F + offs, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=ok)


    @triton.jit
    def _gemv_kernel(X, W, Y, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        for m in tl.static_range(M):
            acc = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + offs_k < K
                w = tl.load(W + offs_n[:, None].to(tl.int64) * K + k0 + offs_k[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(X + m * K + k0 + offs_k, mask=k_ok, other=0.0)
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
            tl.store(Y + m * N + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


GEMV_MAX_ROWS = 4  # the most rows small_linear takes
# Decode batches up to this size go through small_linear in decode_linear: on one H100
# (bench/probes/small_linear.py, bf16, weights read from memory) one row of SmolLM2's four
# matmuls took 2.8-3.8 us against cuBLAS's 3.3-5.1 us, and Llama-3-8B's 19.0 / 42.6 us against
# 20.7 / 43.4 us; from two rows on cuBLAS is faster (the kernel reads the weights once per row).
DECODE_GEMV_ROWS = 1


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the fused decode kernels need the triton package, which is not installed")


def add_rms_norm(h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                 h_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta) * weight)`` (``h`` itself when ``delta`` is None);
    the sum is written into ``h_out`` when given (contiguous, ``h``'s shape; not ``h`` or
    ``delta``)."""
    _need_triton()
    t, n = h.shape
    check_tensor("weight", weight, shape=[n], device=h.device)
    if delta is not None:
        check_tensor("delta", delta, shape=[t, n], dtype=h.dtype, device=h.device)
    h = h.contiguous()
    if h_out is not None:
        _check_out("h_out", h_out, [t, n], h)
        if delta is None:
            h_out.copy_(h)
            h = h_out
    else:
        h_out = torch.empty_like(h) if delta is not None else h
    x = torch.empty_like(h)
    if t:
        _add_rms_norm_kernel[(t,)](h, h if delta is None else delta.contiguous(), weight, h_out, x, n, float(eps),
                                   HAS_DELTA=delta is not None, BLOCK=next_pow2(n), num_warps=4)
    return h_out, x


def rope_into_pool(qkv: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, heads: int, kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """Rotated Q ``[T, heads, head_dim]``; rotated K and V written into the pool (module docstring)."""
    _need_triton()
    t = qkv.shape[0]
    half = head_dim // 2
    if head_dim % 2 or half & (half - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    check_tensor("qkv", qkv, shape=[t, (heads + 2 * kv_heads) * head_dim])
    for name, idx in (("positions", positions), ("out_cache_loc", out_cache_loc)):
        check_tensor(name, idx, shape=[t], device=qkv.device)
    check_tensor("cos", cos, shape=[None, half], dtype=torch.float32, device=qkv.device)
    check_tensor("sin", sin, shape=list(cos.shape), dtype=torch.float32, device=qkv.device)
    for name, buf in (("k_buf", k_buf), ("v_buf", v_buf)):
        check_tensor(name, buf, shape=[None, kv_heads, head_dim], dtype=qkv.dtype, device=qkv.device)
        if buf.stride(2) != 1 or buf.stride(1) != head_dim:
            raise ValueError(f"{name} rows must be contiguous, got strides {buf.stride()}")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv must be contiguous in its last dim, got strides {qkv.stride()}")
    q = qkv.new_empty(t, heads, head_dim)  # [T, heads, head_dim]
    if t:
        _rope_kernel[(t, heads + 2 * kv_heads)](qkv, positions, out_cache_loc, cos, sin, q, k_buf, v_buf,
                                                qkv.stride(0), k_buf.stride(0), v_buf.stride(0), HEADS=heads,
                                                KV_HEADS=kv_heads, D=head_dim, HALF=half, num_warps=1)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, ffn]`` of ``gate_up`` ``[T, 2 * ffn]``."""
    _need_triton()
    t, two_f = gate_up.shape
    if two_f % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {two_f}")
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(t, two_f // 2)
    block = 1024
    if t:
        _silu_mul_kernel[(t, triton.cdiv(two_f // 2, block))](gate_up, out, two_f // 2, BLOCK=block, num_warps=4)
    return out


def small_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 4, block_k: int = 512,
                 num_warps: int = 1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T`` ``[M, N]`` for ``x`` ``[M, K]`` (``M <= GEMV_MAX_ROWS``), ``w`` ``[N, K]``
    contiguous: one program per ``block_n`` output columns, fp32 accumulation (the default
    tiling is the probe's fastest for one row)."""
    _need_triton()
    m, k = x.shape
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"small_linear takes 1..{GEMV_MAX_ROWS} rows, got {m}")
    check_tensor("w", w, shape=[None, k], dtype=x.dtype, device=x.device)
    if not w.is_contiguous():
        raise ValueError("w must be contiguous")
    x = x.contiguous()
    if out is not None:
        _check_out("out", out, [m, w.shape[0]], x)
    y = x.new_empty(m, w.shape[0]) if out is None else out
    _gemv_kernel[(triton.cdiv(w.shape[0], block_n),)](x, w, y, w.shape[0], k, M=m, BLOCK_N=block_n,
                                                      BLOCK_K=block_k, num_warps=num_warps)
    return y


def decode_linear(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w)``, through :func:`small_linear` for the few rows of a small decode batch;
    into ``out`` when given (contiguous ``[M, N]``, not ``x``)."""
    if x.is_cuda and x.shape[0] <= DECODE_GEMV_ROWS and w.is_contiguous():
        return small_linear(x, w, out=out)
    if out is None:
        return F.linear(x, w)
    _check_out("out", out, [x.shape[0], w.shape[0]], x)
    return torch.mm(x, w.t(), out=out)  # the product F.linear computes without a bias


def _check_out(name: str, out: torch.Tensor, shape: list, like: torch.Tensor) -> None:
    """``out`` must be a contiguous ``shape`` tensor of ``like``'s dtype and device."""
    check_tensor(name, out, shape=shape, dtype=like.dtype, device=like.device)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
