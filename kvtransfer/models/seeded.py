"""Seeded random weights for the tiny models: the same seed gives the same full weights on
every rank (each rank then keeps its shard), in every process."""

from __future__ import annotations

from typing import Dict, Sequence

import torch


class WeightMaker:
    """Draws named tensors from one seeded generator, in call order."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.weights: Dict[str, torch.Tensor] = {}

    def normal(self, name: str, shape: Sequence[int], std: float | None = None) -> None:
        """``N(0, std)``; default std ``1 / sqrt(fan_in)`` (the last dim)."""
        std = shape[-1] ** -0.5 if std is None else std
        self.weights[name] = torch.randn(tuple(shape), generator=self.gen) * std

    def uniform(self, name: str, shape: Sequence[int], low: float, high: float) -> None:
        self.weights[name] = low + (high - low) * torch.rand(tuple(shape), generator=self.gen)

    def ones(self, name: str, n: int) -> None:
        """A norm weight near one (seeded jitter, so a wrong shard shows)."""
        self.weights[name] = 1.0 + 0.1 * torch.randn(n, generator=self.gen)

    def mlp(self, prefix: str, hidden: int, ffn: int) -> None:
        self.ones(f"{prefix}.ffn_norm", hidden)
        self.normal(f"{prefix}.gate", (ffn, hidden))
        self.normal(f"{prefix}.up", (ffn, hidden))
        self.normal(f"{prefix}.down", (hidden, ffn))

    def embeddings(self, vocab: int, hidden: int) -> None:
        self.normal("embed", (vocab, hidden), std=1.0)
        self.ones("norm", hidden)
        self.normal("lm_head", (vocab, hidden))
