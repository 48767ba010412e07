"""The models by name: how to read each one's config, weights and tokenizer, and build a rank.

:func:`load_config` is cheap for the tiny models and reads only GGUF metadata for SmolLM2, so a
bad TP size is reported before any weight is dequantized. :func:`load` returns a
:class:`ModelSpec`: picklable (full float32 weights, which ``torch.multiprocessing`` hands to
rank processes through shared memory) — each rank's :meth:`ModelSpec.build` keeps its shard.

SmolLM2's GGUF file costs ~12 s to parse and dequantize on a small CPU; the first :func:`load`
keeps the result (float32 weights, tokenizer, config: ~540 MB) in ``$KVT_CACHE_DIR`` (default
``~/.cache/kvtransfer``), keyed by the file's size and time, and later loads map it in well
under a second. A cache that cannot be written is skipped with a log line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Tuple, Union

import torch

from kvtransfer.models.config import (DEEPSEEK_V2_LITE_MLA_SHAPE, LLAMA3_8B_SHAPE, SMOLLM2_135M_SHAPE, HybridConfig,
                                      LlamaConfig, MLAConfig, ModelName)
from kvtransfer.models.parallel import TPGroup

AnyConfig = Union[LlamaConfig, MLAConfig, HybridConfig]

log = logging.getLogger("kvtransfer.models")

RANDOM_SHAPES = {ModelName.SMOLLM2_RANDOM: SMOLLM2_135M_SHAPE, ModelName.LLAMA3_8B: LLAMA3_8B_SHAPE,
                 ModelName.DEEPSEEK_V2_LITE_MLA: DEEPSEEK_V2_LITE_MLA_SHAPE}
RANDOM_SEED = 2024


def parse_name(name: str) -> ModelName:
    """A model by its name or alias (:meth:`ModelName.parse`)."""
    return ModelName.parse(name)


@dataclass(frozen=True)
class ModelSpec:
    """Everything a rank needs to build its shard of a model."""

    name: ModelName
    config: AnyConfig
    weights: Dict[str, torch.Tensor] = field(repr=False)  # full, float32, CPU (or RandomWeights)
    load_s: float = 0.0  # seconds spent reading / making the weights

    def build(self, tp: TPGroup, dtype: torch.dtype, device):
        from kvtransfer.models.seeded import RandomWeights

        weights = self.weights
        if isinstance(weights, RandomWeights):
            weights = weights.on(device, dtype)
        if self.name is ModelName.SMOLLM2 or self.name.random_llama:
            from kvtransfer.models.llama import LlamaModel as cls
        elif self.name in (ModelName.TINY_MLA, ModelName.DEEPSEEK_V2_LITE_MLA):
            from kvtransfer.models.tiny_mla import TinyMLAModel as cls
        else:
            from kvtransfer.models.tiny_hybrid import TinyHybridModel as cls
        return cls(self.config, weights, tp, dtype, device)


def _tiny(name: ModelName) -> AnyConfig:
    return MLAConfig() if name is ModelName.TINY_MLA else HybridConfig()


def load_config(name: ModelName) -> AnyConfig:
    if name in RANDOM_SHAPES:
        return RANDOM_SHAPES[name]
    if name is ModelName.SMOLLM2:
        from kvtransfer.models import gguf_llama

        path = gguf_llama.smollm2_gguf_path()
        meta_path = os.path.join(_cache_dir(path), "meta.json")
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                return LlamaConfig(**json.load(f)["config"])
        return gguf_llama.read_config(gguf_llama.open_gguf(path))
    return _tiny(name)


def _cache_dir(path: str) -> str:
    st = os.stat(path)
    root = os.environ.get("KVT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvtransfer")
    return os.path.join(root, f"{os.path.basename(path)}-{st.st_size}-{int(st.st_mtime)}")


def _load_smollm2():
    """(config, weights, tokenizer), from the cache when it holds them (module docstring)."""
    from kvtransfer.models import gguf_llama
    from kvtransfer.models.tokenizer import GGUFTokenizer

    path = gguf_llama.smollm2_gguf_path()
    cache = _cache_dir(path)
    meta_path, weights_path = os.path.join(cache, "meta.json"), os.path.join(cache, "weights.pt")
    if os.path.isfile(meta_path) and os.path.isfile(weights_path):
        with open(meta_path) as f:
            meta = json.load(f)
        weights = torch.load(weights_path, mmap=True, weights_only=True)
        return LlamaConfig(**meta["config"]), weights, GGUFTokenizer(meta["tokenizer"])
    reader = gguf_llama.open_gguf(path)
    config = gguf_llama.read_config(reader)
    weights = gguf_llama.to_llama_weights(gguf_llama.dequantize_all(reader), config)
    tokenizer = GGUFTokenizer(reader)
    try:
        os.makedirs(cache, exist_ok=True)
        tmp = f"{weights_path}.{os.getpid()}.tmp"
        torch.save(weights, tmp)
        os.replace(tmp, weights_path)  # the weights first: meta.json marks a complete entry
        with open(f"{meta_path}.{os.getpid()}.tmp", "w") as f:
            json.dump({"config": dataclasses.asdict(config), "tokenizer": tokenizer.parts()}, f)
        os.replace(f"{meta_path}.{os.getpid()}.tmp", meta_path)
    except OSError as exc:
        log.info("not caching the dequantized SmolLM2 weights in %s: %s", cache, exc)
    return config, weights, tokenizer


def load(name: ModelName) -> Tuple[ModelSpec, object]:
    """(spec, tokenizer) of a model; ``spec.load_s`` counts opening the file (unless
    :func:`load_config` opened it already), dequantizing and building the tokenizer, or
    reading them from the cache."""
    start = time.perf_counter()
    if name is ModelName.SMOLLM2:
        config, weights, tokenizer = _load_smollm2()
    elif name in RANDOM_SHAPES:
        from kvtransfer.models.seeded import RandomWeights, llama_shapes, mla_shapes
        from kvtransfer.models.tokenizer import ByteTokenizer

        config = RANDOM_SHAPES[name]
        shapes = mla_shapes(config) if name is ModelName.DEEPSEEK_V2_LITE_MLA else llama_shapes(config)
        weights = RandomWeights(shapes, RANDOM_SEED)
        tokenizer = ByteTokenizer(config.vocab_size)
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
