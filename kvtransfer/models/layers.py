"""Building blocks shared by the models: RMSNorm, rotary embedding, the SwiGLU MLP, the LM head.

All functions are pure tensor code (no ``nn.Module``, no autograd): the models hold their
already-sharded weights as plain tensors and run under ``torch.inference_mode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtransfer.models.parallel import TPGroup


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back (as Hugging Face's Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True)
class Rotary:
    """Half-split ("neox"/Hugging Face) rotary embedding: the first and second halves of a head
    are the two coordinates of each rotated pair. ``cos``/``sin``: ``[max_pos, dim // 2]`` fp32."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, dim: int, theta: float, max_pos: int, device) -> "Rotary":
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim / 2]
        freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [max_pos, dim / 2]
        return cls(cos=freqs.cos().to(device), sin=freqs.sin().to(device))

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[tokens, heads, dim]`` at ``positions`` ``[tokens]``."""
        cos = self.cos[positions][:, None, :].to(x.dtype)  # [tokens, 1, dim / 2]
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # [tokens, heads, dim / 2] each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``down(silu(gate x) * up x)``; ``gate_up`` ``[2 * ffn / tp, hidden]`` (gate rows first),
    ``down`` ``[hidden, ffn / tp]``; the partial sums are all-reduced."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [tokens, ffn / tp] each
    return tp.all_reduce(F.linear(F.silu(gate) * up, down))


def lm_head(h: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Float32 logits ``[tokens, vocab]`` from ``h`` ``[tokens, hidden]`` and this rank's vocab
    shard ``weight`` ``[vocab / tp, hidden]``."""
    return tp.all_gather_last(F.linear(h, weight)).float()
