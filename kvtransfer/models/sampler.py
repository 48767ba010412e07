"""Sampling on the GPU for a whole decode batch, with no host synchronisation.

Per request ``i``: temperature ``temperatures[i]`` and a key ``keys[i]`` (the engine passes
``(seed * 1_000_003 + position) % 2**63``, the same key :class:`~kvtransfer.models.engine.Sampling`
seeds its generator with). Temperature 0 is greedy: exactly ``argmax(logits)`` (the first index
of the maximum). Above 0 the token is the Gumbel-max draw ``argmax(logits / T + g)``, with
``g = -log(-log(u))`` and ``u`` uniform from Philox keyed by ``(keys[i], vocab index)``: a draw
from ``softmax(logits / T)`` that depends only on the key, the logits and the temperature (not
on the batch a request happens to be in). It is a different draw than the CPU path's
``torch.multinomial``; every GPU node draws the same one, so a request sampled on one GPU node
continues the same way on another.

The log-probability returned is ``log_softmax(logits)[token]``, as on the CPU path.
"""

from __future__ import annotations

from typing import Tuple

import torch

try:  # triton is optional (not installed on every platform)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

BLOCK_V = 1024

if tl is not None:

    @triton.jit
    def _perturb_kernel(LOGITS, TEMPS, KEYS, OUT, V, stride_l, stride_o, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(LOGITS + b * stride_l + offs, mask=ok, other=float("-inf"))
        t = tl.load(TEMPS + b)
        key = tl.load(KEYS + b)
        u = tl.rand(key, offs)
        g = -tl.log(-tl.log(u))
        y = tl.where(t > 0, x / tl.where(t > 0, t, 1.0) + g, x)
        tl.store(OUT + b * stride_o + offs, y, mask=ok)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
           scratch: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, logprobs [B] fp32)`` from fp32 ``logits`` ``[B, vocab]`` on CUDA,
    ``temperatures`` ``[B]`` fp32 and ``keys`` ``[B]`` int64 (module docstring). ``scratch``
    ``[B, vocab]`` fp32 holds the perturbed logits if given."""
    if triton is None:
        raise RuntimeError("GPU sampling needs the triton package, which is not installed")
    b, vocab = logits.shape
    if logits.dtype != torch.float32 or temperatures.shape != (b,) or keys.shape != (b,):
        raise ValueError(f"expected fp32 logits [B, vocab] and [B] temperatures / keys, got {logits.dtype} "
                         f"{list(logits.shape)}, {list(temperatures.shape)}, {list(keys.shape)}")
    if keys.dtype != torch.int64 or temperatures.dtype != torch.float32:
        raise TypeError(f"keys must be int64 and temperatures float32, got {keys.dtype}, {temperatures.dtype}")
    logits = logits.contiguous()
    perturbed = torch.empty_like(logits) if scratch is None else scratch
    _perturb_kernel[(b, triton.cdiv(vocab, BLOCK_V))](logits, temperatures, keys, perturbed, vocab,
                                                    logits.stride(0), perturbed.stride(0), BLOCK=BLOCK_V)
    tokens = perturbed.argmax(dim=-1)  # [B]; argmax(logits) exactly where T == 0
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)  # [B]
    return tokens, logprobs


def draw(logits: torch.Tensor, temperature: float, key: int) -> Tuple[int, float]:
    """``(token, logprob)`` of one request from its fp32 ``logits`` ``[vocab]`` on CUDA: the
    draw :func:`sample` makes for it in a batch (the host waits for it)."""
    dev = logits.device
    tokens, logprobs = sample(logits.float()[None], torch.tensor([float(temperature)], device=dev),
                              torch.tensor([key], dtype=torch.int64, device=dev))
    return int(tokens[0]), float(logprobs[0])
