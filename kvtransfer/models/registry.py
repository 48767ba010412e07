"""The models by name: how to read each one's config, weights and tokenizer, and build a rank.

:func:`load_config` is cheap for the tiny models and reads only GGUF metadata for SmolLM2, so a
bad TP size is reported before any weight is dequantized. :func:`load_spec` returns a
:class:`ModelSpec`: picklable (full float32 weights, which ``torch.multiprocessing`` hands to
rank processes through shared memory) — each rank's :meth:`ModelSpec.build` keeps its shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Tuple, Union

import torch

from kvtransfer.models.config import HybridConfig, LlamaConfig, MLAConfig, ModelName
from kvtransfer.models.parallel import TPGroup

AnyConfig = Union[LlamaConfig, MLAConfig, HybridConfig]


@dataclass(frozen=True)
class ModelSpec:
    """Everything a rank needs to build its shard of a model."""

    name: ModelName
    config: AnyConfig
    weights: Dict[str, torch.Tensor] = field(repr=False)  # full, float32, CPU
    load_s: float = 0.0  # seconds spent reading / making the weights

    def build(self, tp: TPGroup, dtype: torch.dtype, device):
        if self.name is ModelName.SMOLLM2:
            from kvtransfer.models.llama import LlamaModel as cls
        elif self.name is ModelName.TINY_MLA:
            from kvtransfer.models.tiny_mla import TinyMLAModel as cls
        else:
            from kvtransfer.models.tiny_hybrid import TinyHybridModel as cls
        return cls(self.config, self.weights, tp, dtype, device)


def _tiny(name: ModelName) -> AnyConfig:
    return MLAConfig() if name is ModelName.TINY_MLA else HybridConfig()


def load_config(name: ModelName) -> AnyConfig:
    if name is ModelName.SMOLLM2:
        from kvtransfer.models import gguf_llama

        return gguf_llama.read_config(gguf_llama.open_gguf(gguf_llama.smollm2_gguf_path()))
    return _tiny(name)


def load(name: ModelName) -> Tuple[ModelSpec, object]:
    """(spec, tokenizer) of a model; ``spec.load_s`` counts opening the file (unless
    :func:`load_config` opened it already), dequantizing and building the tokenizer."""
    start = time.perf_counter()
    if name is ModelName.SMOLLM2:
        from kvtransfer.models import gguf_llama
        from kvtransfer.models.tokenizer import GGUFTokenizer

        reader = gguf_llama.open_gguf(gguf_llama.smollm2_gguf_path())
        config = gguf_llama.read_config(reader)
        weights = gguf_llama.to_llama_weights(gguf_llama.dequantize_all(reader), config)
        tokenizer = GGUFTokenizer(reader)
    else:
        from kvtransfer.models.tokenizer import ByteTokenizer

        config = _tiny(name)
        if name is ModelName.TINY_MLA:
            from kvtransfer.models.tiny_mla import seeded_weights
        else:
            from kvtransfer.models.tiny_hybrid import seeded_weights
        weights = seeded_weights(config)
        tokenizer = ByteTokenizer(config.vocab_size)
    return ModelSpec(name, config, weights, time.perf_counter() - start), tokenizer
