"""Shared helpers of the model tests: loading SmolLM2 once, the transformers oracle, engine configs."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtransfer.models.config import EngineConfig

# Small pools and pages so that requests span several pages and prefill runs in several chunks.
SMALL = EngineConfig(max_tokens=512, page_size=4, max_requests=4, chunk_size=512)


def engine_config(**kw) -> EngineConfig:
    base = dict(max_tokens=SMALL.max_tokens, page_size=SMALL.page_size, max_requests=SMALL.max_requests,
                chunk_size=SMALL.chunk_size)
    base.update(kw)
    return EngineConfig(**base)


def require_smollm2() -> str:
    """The GGUF path, or skip with the reason."""
    for module, install in (("gguf", "pip install -e '.[models]'"), ("tokenizers", "pip install -e '.[models]'")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the {module} package is not installed ({install}; ./dev setup does it)")
    from kvtransfer.models.gguf_llama import MissingModelFile, smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except MissingModelFile as e:
        pytest.skip(str(e))


def require_transformers():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers (the test oracle) is not installed (pip install -e '.[test]')")


# GGUF tensor name part -> Hugging Face Llama parameter name
_HF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_llama_from_gguf(raw: dict, config):
    """Hugging Face's LlamaForCausalLM on the dequantized GGUF arrays, with the Q/K rows put back
    in Hugging Face order by transformers' own GGUF tensor processor (not by our code)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hc = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, rms_norm_eps=config.rms_eps, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_context_len, tie_word_embeddings=True,
    )
    hc._attn_implementation = "eager"
    proc = LlamaTensorProcessor(config={"num_attention_heads": config.num_heads,
                                        "num_key_value_heads": config.num_kv_heads})
    state = {}
    for name, w in raw.items():
        w = torch.from_numpy(np.ascontiguousarray(proc.process(w, name).weights))
        if name == "token_embd.weight":
            state["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            state["model.norm.weight"] = w
        else:
            _, layer, kind, _ = name.split(".")
            state[f"model.layers.{layer}.{_HF_NAMES[kind]}.weight"] = w
    with torch.device("meta"):
        model = LlamaForCausalLM(hc)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) != {"lm_head.weight"}:
        raise AssertionError(f"oracle weights: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.model.rotary_emb = LlamaRotaryEmbedding(hc)
    return model.eval()


def tiny_spec(name):
    from kvtransfer.models import registry

    return registry.load(name)[0]


def byte_prompts(*texts: str):
    return tuple(tuple(t.encode()) for t in texts)


@dataclass(frozen=True)
class PoolShapes:
    """Rank job: the rank's pool exports (what the planner sees), then a generation."""

    generate: object  # a kvtransfer.models.jobs.Generate

    def __call__(self, engine):
        pools = engine.pools
        kv_items = pools.kv.get_contiguous_buf_infos()[2]
        state_dims = pools.kv.get_state_dim_per_tensor() if pools.mamba_pool is not None else []
        return kv_items, state_dims, self.generate(engine)


def run_interpreted(module: str, function: str) -> list:
    """Lines printed by ``module.function()`` run in a subprocess under ``TRITON_INTERPRET=1``
    (which must be set before triton is imported, so a test process that imported triton
    compiled cannot switch). Skips without triton."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs the triton package")
    root = pathlib.Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", f"import {module} as m; m.{function}()"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{module}.{function} under the interpreter failed:\n{proc.stderr[-3000:]}")
    return [line.split() for line in proc.stdout.splitlines() if line.strip()]


def paged_pool(page_size, kv_heads, d, dv, lengths, dtype, device, gen):
    """``(k_buf, v_buf, req_to_token, req_rows)``: random K/V pools and a table whose rows (not
    the batch index) hold ``lengths`` tokens each on shuffled pages (so slots are not contiguous)."""
    pages_per = [math.ceil(n / page_size) for n in lengths]
    num_pages = sum(pages_per) + 3  # page 0 and some spare
    rows = num_pages * page_size
    k_buf = torch.randn(rows, kv_heads, d, generator=gen).to(dtype)
    v_buf = torch.randn(rows, kv_heads, dv, generator=gen).to(dtype)
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    max_ctx = max(pages_per) * page_size + 8
    r2t = torch.zeros(len(lengths) + 3, max_ctx, dtype=torch.int32)
    req_rows = torch.randperm(len(lengths) + 2, generator=gen)[: len(lengths)] + 1
    for row, n_pages in zip(req_rows.tolist(), pages_per):
        pages = [order.pop() for _ in range(n_pages)]
        slots = torch.tensor([p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int32)
        r2t[row, : slots.numel()] = slots
    to = dict(device=device)
    return k_buf.to(**to), v_buf.to(**to), r2t.to(**to), req_rows.to(**to)
