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

Top-k: ``top_ks[i] > 0`` keeps only the logits at least as large as the row's ``top_ks[i]``-th
largest (ties with it are all kept) before the draw; 0 keeps every token. The threshold comes
from :func:`top_k_thresholds`, which the CPU path uses too, so both keep the same tokens.
``top_ks`` is read on the device, so one captured graph serves every mix of values; the
threshold reads a ``torch.topk`` of at most :data:`MAX_TOP_K` values per row. Greedy ignores it
(the argmax is always kept).

The log-probability returned is ``log_softmax(logits)[token]`` of the unfiltered logits at
temperature 1, as on the CPU path.
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
MAX_TOP_K = 1024  # the largest top-k a request may ask for (the width of the per-row topk)

if tl is not None:

    @triton.jit
    def _perturb_kernel(LOGITS, TEMPS, KEYS, THRESH, OUT, V, stride_l, stride_o, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(LOGITS + b * stride_l + offs, mask=ok, other=float("-inf"))
        t = tl.load(TEMPS + b)
        key = tl.load(KEYS + b)
        thresh = tl.load(THRESH + b)
        u = tl.rand(key, offs)
        g = -tl.log(-tl.log(u))
        y = tl.where(t > 0, x / tl.where(t > 0, t, 1.0) + g, x)
        y = tl.where(x < thresh, float("-inf"), y)  # never the argmax: greedy is unchanged
        tl.store(OUT + b * stride_o + offs, y, mask=ok)


def top_k_thresholds(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """``[B]`` fp32: each row's ``top_ks[i]``-th largest logit, ``-inf`` where ``top_ks[i]`` is 0
    (keep everything). ``logits`` ``[B, vocab]``; ``top_ks`` ``[B]`` int64 in ``[0, MAX_TOP_K]``
    (values past the vocabulary keep everything). No host synchronisation."""
    width = min(logits.shape[1], MAX_TOP_K)
    top = torch.topk(logits, width, dim=-1).values  # [B, width], largest first
    kth = top.gather(1, (top_ks.clamp(1, width) - 1)[:, None])[:, 0]  # [B]
    return torch.where((top_ks > 0) & (top_ks < logits.shape[1]), kth, float("-inf")).float()


def sample(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, top_ks: torch.Tensor,
           scratch: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, logprobs [B] fp32)`` from fp32 ``logits`` ``[B, vocab]``,
    ``temperatures`` ``[B]`` fp32, ``keys`` ``[B]`` int64 and ``top_ks`` ``[B]`` int64 (0: no
    limit), all on one device (module docstring; CPU tensors need Triton's interpreter).
    ``scratch`` ``[B, vocab]`` fp32 holds the perturbed logits if given."""
    if triton is None:
        raise RuntimeError("GPU sampling needs the triton package, which is not installed")
    b, vocab = logits.shape
    if (logits.dtype != torch.float32 or temperatures.shape != (b,) or keys.shape != (b,)
            or top_ks.shape != (b,)):
        raise ValueError(f"expected fp32 logits [B, vocab] and [B] temperatures / keys / top_ks, got "
                         f"{logits.dtype} {list(logits.shape)}, {list(temperatures.shape)}, {list(keys.shape)}, "
                         f"{list(top_ks.shape)}")
    if keys.dtype != torch.int64 or top_ks.dtype != torch.int64 or temperatures.dtype != torch.float32:
        raise TypeError(f"keys and top_ks must be int64 and temperatures float32, got {keys.dtype}, "
                        f"{top_ks.dtype}, {temperatures.dtype}")
    logits = logits.contiguous()
    perturbed = torch.empty_like(logits) if scratch is None else scratch
    thresholds = top_k_thresholds(logits, top_ks)  # [B]
    _perturb_kernel[(b, triton.cdiv(vocab, BLOCK_V))](logits, temperatures, keys, thresholds, perturbed, vocab,
                                                    logits.stride(0), perturbed.stride(0), BLOCK=BLOCK_V)
    tokens = perturbed.argmax(dim=-1)  # [B]; argmax(logits) exactly where T == 0
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)  # [B]
    return tokens, logprobs


def draw(logits: torch.Tensor, temperature: float, key: int, top_k: int = 0) -> Tuple[int, float]:
    """``(token, logprob)`` of one request from its fp32 ``logits`` ``[vocab]``: the draw
    :func:`sample` makes for it in a batch (the host waits for it)."""
    dev = logits.device
    tokens, logprobs = sample(logits.float()[None], torch.tensor([float(temperature)], device=dev),
                              torch.tensor([key], dtype=torch.int64, device=dev),
                              torch.tensor([top_k], dtype=torch.int64, device=dev))
    return int(tokens[0]), float(logprobs[0])
