"""SmolLM2-135M-Instruct from its GGUF file against Hugging Face transformers' Llama built from
the same dequantized arrays (transformers undoes llama.cpp's Q/K row permutation itself).

Tolerance: float32 logits agree within ATOL (measured: ~6e-5 on logits of magnitude ~40; the
differences are summation order in matmuls and attention).
"""

from collections import Counter

import pytest
import torch

from kvtransfer.models import gguf_llama, launch
from kvtransfer.models.config import ModelName
from kvtransfer.models.jobs import Generate
from kvtransfer.models.registry import ModelSpec
from tests.kvtransfer.models._support import SMALL, hf_llama_from_gguf, require_transformers

ATOL = 2e-3
QUESTION = "What is the capital of France?"


def test_file_facts(smollm2_raw):
    reader, config, raw = smollm2_raw
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0 and abs(config.rms_eps - 1e-5) < 1e-9
    assert config.vocab_size == 49152 and config.tie_embeddings and "output.weight" not in raw
    kinds = Counter(t.tensor_type.name for t in reader.tensors)
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert all(a.flags.writeable and a.dtype.name == "float32" for a in raw.values())
    assert gguf_llama.field(reader, "tokenizer.ggml.add_bos_token") is False


@pytest.fixture(scope="module")
def oracle(smollm2_raw):
    require_transformers()
    _, config, raw = smollm2_raw
    return hf_llama_from_gguf(raw, config)


def _run(spec, prompt, n):
    return launch.run(spec, 1, SMALL, Generate((tuple(prompt),), n, record_logits=True))


def _oracle_logits(oracle, prompt, output):
    """Teacher-forced logits at the positions our engine sampled from."""
    seq = torch.tensor([list(prompt) + list(output[:-1])])
    with torch.no_grad():
        return oracle(seq).logits[0, len(prompt) - 1 :].float()  # [len(output), vocab]


def test_logits_and_greedy_chat_match_transformers(smollm2, oracle):
    spec, tok = smollm2
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    out = _run(spec, prompt, 8)
    ours, ref = out.logits[0], _oracle_logits(oracle, prompt, out.output_ids[0])
    # the prefill position and seven decode steps (K/V read back from the pool)
    assert (ours - ref).abs().max().item() < ATOL
    assert out.output_ids[0] == ref.argmax(-1).tolist()  # greedy tokens are the oracle's
    assert tok.decode(out.output_ids[0]).startswith("The capital of France is Paris")


def test_gguf_rope_order_is_undone(smollm2_raw, oracle):
    """Keeping llama.cpp's interleaved Q/K rows under half-split rope is wrong, and visibly so."""
    _, config, raw = smollm2_raw
    weights = gguf_llama.to_llama_weights(raw, config)
    for name, w in raw.items():
        if ".attn_q." in name or ".attn_k." in name:
            _, layer, kind, _ = name.split(".")
            weights[f"layers.{layer}.{kind[-1]}"] = torch.from_numpy(w)
    prompt = list(range(100, 116))
    out = _run(ModelSpec(ModelName.SMOLLM2, config, weights), prompt, 1)
    assert (out.logits[0] - _oracle_logits(oracle, prompt, out.output_ids[0])).abs().max().item() > 1.0


def test_permutation_round_trip():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3).numpy()
    # llama.cpp's converter: w.reshape(heads, 2, half, ...).swapaxes(1, 2)
    permuted = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    assert (gguf_llama.unpermute_rope_rows(permuted, 2) == w).all()
