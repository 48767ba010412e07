"""Frozen model and engine configs, and the enums the models are chosen by.

A model config holds the *whole* model's shape; :mod:`kvtransfer.models.parallel` divides it
for one tensor-parallel rank. ``check_tp`` on each config says whether a TP size is possible
and why not, in one line (the ``generate`` command prints it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Tuple

import torch


class ModelName(enum.Enum):
    """The models every ``kvtransfer`` command knows (``--model``), by the name it serves them as."""

    SMOLLM2 = "smollm2"  # the real SmolLM2-135M-Instruct from its GGUF file
    TINY_MLA = "mla-tiny"  # seeded DeepSeek-style MLA model
    TINY_HYBRID = "hybrid-tiny"  # seeded full-attention + Mamba2 hybrid
    SMOLLM2_RANDOM = "smollm2-135m-random"  # SmolLM2-135M's shape, seeded random weights
    LLAMA3_8B = "llama3-8b"  # Llama-3-8B's shape, seeded random weights, context 32,768 (long-prompt benchmarks)
    DEEPSEEK_V2_LITE_MLA = "deepseek-v2-lite-mla"  # DeepSeek-V2-Lite's attention, dense MLP, random weights

    @property
    def names(self) -> tuple:
        """The name, then the other names a command line or a request may use for it."""
        return (self.value, *(alias for alias, m in _MODEL_ALIASES.items() if m == self.value))

    @property
    def random_llama(self) -> bool:
        """A Llama-shaped preset with seeded random weights (timings real, text meaningless)."""
        return self in (ModelName.SMOLLM2_RANDOM, ModelName.LLAMA3_8B)

    @property
    def random_weights(self) -> bool:
        """A preset with real shapes and seeded random weights (timings real, text meaningless)."""
        return self.random_llama or self is ModelName.DEEPSEEK_V2_LITE_MLA

    @classmethod
    def parse(cls, name: str) -> "ModelName":
        """A model by its name or one of its aliases."""
        name = _MODEL_ALIASES.get(name, name)
        for m in cls:
            if m.value == name:
                return m
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(m.value for m in cls)}")


_MODEL_ALIASES = {"smollm2-135m": "smollm2", "tiny-mla": "mla-tiny", "tiny-hybrid": "hybrid-tiny"}


class DType(enum.Enum):
    """Model dtypes the command line accepts."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self) -> torch.dtype:
        return torch.float32 if self is DType.FLOAT32 else torch.bfloat16

    @classmethod
    def parse(cls, name: str) -> "DType":
        for d in cls:
            if d.value == name:
                return d
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(d.value for d in cls)}")


class LayerKind(enum.Enum):
    ATTENTION = "attention"
    MAMBA = "mamba"


def _positive(cfg, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be a positive int, got {v!r}")


def _divides(what: Tuple[Tuple[str, int], ...], tp: int) -> None:
    for name, n in what:
        if n % tp:
            ok = [t for t in range(1, max(v for _, v in what) + 1) if all(v % t == 0 for _, v in what)][:8]
            raise ValueError(f"TP size {tp} does not divide {name}={n}; this model allows TP {', '.join(map(str, ok))}")


def _check_tp_int(tp) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        raise ValueError(f"TP size must be a positive int, got {tp!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-architecture decoder (SmolLM2's shape is read from its GGUF file)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_context_len: int
    tie_embeddings: bool = True

    def __post_init__(self):
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_context_len")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    def check_tp(self, tp: int) -> None:
        """ValueError naming the dimension a TP size cannot split (KV heads are not replicated)."""
        _check_tp_int(tp)
        _divides((("the query heads", self.num_heads), ("the KV heads", self.num_kv_heads),
                  ("the FFN size", self.intermediate_size), ("the vocabulary", self.vocab_size)), tp)


# Real models' shapes for the random-weights presets.
SMOLLM2_135M_SHAPE = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                 num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5,
                                 max_context_len=8192, tie_embeddings=True)
LLAMA3_8B_SHAPE = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_eps=1e-5,
                              max_context_len=32768, tie_embeddings=False)


@dataclass(frozen=True)
class MLAConfig:
    """A DeepSeek-V2-style decoder: multi-head latent attention, dense SwiGLU MLP.

    The cache row per token is ``[kv_lora_rank latent | qk_rope_head_dim rope key]``, the
    same on every rank (the latent is replicated; query heads are split).
    """

    vocab_size: int = 272
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 3
    num_heads: int = 8
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    kv_lora_rank: int = 32
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_context_len: int = 1024
    seed: int = 1234

    def __post_init__(self):
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "max_context_len")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    def check_tp(self, tp: int) -> None:
        _check_tp_int(tp)
        _divides((("the query heads", self.num_heads), ("the FFN size", self.intermediate_size),
                  ("the vocabulary", self.vocab_size)), tp)


# DeepSeek-V2-Lite's attention (16 heads, latent 512, rope 64, nope 128, v 128), hidden size,
# depth and vocabulary; a dense SwiGLU MLP of its first (dense) layer's width stands in for the
# mixture of experts.
DEEPSEEK_V2_LITE_MLA_SHAPE = MLAConfig(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
                                       num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                       kv_lora_rank=512, rope_theta=10000.0, rms_eps=1e-6, max_context_len=8192)


@dataclass(frozen=True)
class HybridConfig:
    """Full-attention layers (GQA, half-split rope) mixed with Mamba2 layers.

    ``layer_kinds`` lists ``LayerKind`` per layer. The Mamba2 mixer has ``mamba_heads`` heads of
    ``mamba_head_dim`` (``intermediate = mamba_heads * mamba_head_dim``), ``n_groups`` groups of
    B/C of width ``state_size``, and a depthwise causal conv of ``conv_kernel`` over x, B, C.
    """

    vocab_size: int = 272
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_kinds: Tuple["LayerKind", ...] = ()
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 16
    mamba_heads: int = 8
    mamba_head_dim: int = 16
    n_groups: int = 4
    state_size: int = 16
    conv_kernel: int = 4
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_context_len: int = 1024
    seed: int = 4321

    def __post_init__(self):
        if not self.layer_kinds:
            kinds = (LayerKind.MAMBA, LayerKind.ATTENTION, LayerKind.MAMBA, LayerKind.ATTENTION)
            object.__setattr__(self, "layer_kinds", kinds)
        if not all(isinstance(k, LayerKind) for k in self.layer_kinds):
            raise TypeError(f"layer_kinds must hold LayerKind values, got {self.layer_kinds!r}")
        if LayerKind.ATTENTION not in self.layer_kinds or LayerKind.MAMBA not in self.layer_kinds:
            raise ValueError(f"a hybrid model needs both layer kinds, got {[k.value for k in self.layer_kinds]}")
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "mamba_heads", "mamba_head_dim", "n_groups", "state_size", "conv_kernel",
                  "max_context_len")
        if self.mamba_heads % self.n_groups:
            raise ValueError(f"mamba_heads={self.mamba_heads} must be a multiple of n_groups={self.n_groups}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def attention_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.ATTENTION)

    @property
    def mamba_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MAMBA)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def check_tp(self, tp: int) -> None:
        _check_tp_int(tp)
        _divides((("the query heads", self.num_heads), ("the KV heads", self.num_kv_heads),
                  ("the Mamba heads", self.mamba_heads), ("the Mamba groups", self.n_groups),
                  ("the FFN size", self.intermediate_size), ("the vocabulary", self.vocab_size)), tp)


@dataclass(frozen=True)
class EngineConfig:
    """Pool sizes and batching limits of one engine (the same on every TP rank).

    ``max_tokens`` token slots of KV (whole pages of ``page_size``), ``max_requests`` rows of
    ``req_to_token`` (and Mamba slots), ``chunk_size`` prompt tokens per prefill step at most.
    ``cuda_graphs``: on CUDA, decode steps and one-chunk prompts replay captured graphs where the
    model supports it (:mod:`kvtransfer.models.runner`); False runs every step through the
    model's general forward. ``overlap``: with graphs, the next decode step is launched before
    the wait for the current one (:mod:`kvtransfer.models.engine`); False waits for each step.
    ``layer_group``: with graphs, prefill steps are captured a second time in parts of this many
    layers, which a layer-wise prefill step replays with its layer callbacks between them
    (:mod:`kvtransfer.models.runner`); 0: layer-wise steps run eagerly.
    """

    max_tokens: int = 2048
    page_size: int = 16
    max_requests: int = 8
    chunk_size: int = 512
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    cuda_graphs: bool = True
    overlap: bool = True
    layer_group: int = 0

    def __post_init__(self):
        _positive(self, "max_tokens", "page_size", "max_requests", "chunk_size")
        if self.max_tokens < self.page_size:
            raise ValueError(f"max_tokens={self.max_tokens} must hold at least one page of {self.page_size}")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if isinstance(self.layer_group, bool) or not isinstance(self.layer_group, int) or self.layer_group < 0:
            raise ValueError(f"layer_group must be 0 (no parts) or a number of layers, got {self.layer_group!r}")
        for name in ("cuda_graphs", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
