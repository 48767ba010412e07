"""Seeded random weights for the tiny models: the same seed gives the same full weights on
every rank (each rank then keeps its shard), in every process."""

from __future__ import annotations

from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

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


class RandomWeights(Mapping):
    """Seeded random weights made where they are used: ``shapes`` names each tensor's shape
    (norm weights, 1-D, are ones with a little jitter; matrices, the embedding too,
    ``N(0, 1 / fan_in)``, so tied logits stay of order one). Picklable and small until
    :meth:`on` binds a device and dtype; then each read draws its tensor there, from a
    generator seeded by ``seed`` and the name's index, so a model of billions of parameters is
    made on the GPU in milliseconds and every process on the same kind of device draws the same
    tensors (a CPU and a GPU generator draw different numbers)."""

    def __init__(self, shapes: Dict[str, Tuple[int, ...]], seed: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.shapes, self.seed, self.device, self.dtype = dict(shapes), seed, torch.device(device), dtype
        self._index = {name: i for i, name in enumerate(self.shapes)}

    def on(self, device, dtype: Optional[torch.dtype] = None) -> "RandomWeights":
        return RandomWeights(self.shapes, self.seed, device, dtype or self.dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        gen = torch.Generator(self.device).manual_seed(self.seed * 100_003 + self._index[name])
        t = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
        if len(shape) == 1:
            return t.mul_(0.1).add_(1.0)
        return t.mul_(shape[-1] ** -0.5)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def llama_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """Tensor shapes of a Llama model (the layout :mod:`kvtransfer.models.llama` reads)."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (h,), p + "ffn_norm": (h,), p + "q": (cfg.num_heads * d, h),
                       p + "k": (cfg.num_kv_heads * d, h), p + "v": (cfg.num_kv_heads * d, h),
                       p + "o": (h, cfg.num_heads * d), p + "gate": (cfg.intermediate_size, h),
                       p + "up": (cfg.intermediate_size, h), p + "down": (h, cfg.intermediate_size)})
    return shapes


def mla_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """Tensor shapes of an MLA model (the layout :mod:`kvtransfer.models.tiny_mla` reads)."""
    h, n, f = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
    nope, rope, rank, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    shapes = {"embed": (cfg.vocab_size, h), "norm": (h,), "lm_head": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm": (h,), p + "q": (n * (nope + rope), h), p + "kv_a": (rank + rope, h),
                       p + "kv_norm": (rank,), p + "kv_b": (n * (nope + vd), rank), p + "o": (h, n * vd),
                       p + "ffn_norm": (h,), p + "gate": (f, h), p + "up": (f, h), p + "down": (h, f)})
    return shapes
