"""The random-weights presets: real shapes, seeded weights drawn where the model is built."""

import pickle

import pytest
import torch

from kvtransfer.models import launch, registry
from kvtransfer.models.config import LlamaConfig, ModelName
from kvtransfer.models.jobs import Generate
from kvtransfer.models.registry import ModelSpec
from kvtransfer.models.seeded import RandomWeights, llama_shapes
from tests.kvtransfer.models._support import SMALL

SMALL_LLAMA = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_eps=1e-5, max_context_len=256,
                          tie_embeddings=False)


@pytest.mark.parametrize("name, layers, params", [
    (ModelName.SMOLLM2_RANDOM, 30, 134_515_008),
    (ModelName.LLAMA3_8B, 32, 8_030_261_248),
    (ModelName.DEEPSEEK_V2_LITE_MLA, 27, None),
])
def test_presets_have_their_models_shapes(name, layers, params):
    spec, tokenizer = registry.load(name)
    assert spec.config == registry.load_config(name) and spec.config.num_layers == layers
    assert isinstance(spec.weights, RandomWeights) and tokenizer.vocab_size == spec.config.vocab_size
    if params is not None:  # the published parameter counts
        assert sum(torch.Size(s).numel() for s in spec.weights.shapes.values()) == params


def test_random_weights_are_seeded_per_name_and_pickle_small():
    w = RandomWeights(llama_shapes(SMALL_LLAMA), seed=5)
    again = pickle.loads(pickle.dumps(w))
    assert len(pickle.dumps(w)) < 10_000
    assert torch.equal(w["layers.1.q"], again["layers.1.q"])
    assert not torch.equal(w["layers.1.gate"], w["layers.1.up"])
    assert w["embed"].shape == (300, 32) and w.on("cpu", torch.bfloat16)["norm"].dtype == torch.bfloat16


def test_a_random_llama_generates_the_same_tokens_in_every_run():
    spec = ModelSpec(ModelName.SMOLLM2_RANDOM, SMALL_LLAMA, RandomWeights(llama_shapes(SMALL_LLAMA), seed=3))
    job = Generate(((1, 2, 3, 4),), 5)
    first, second = launch.run(spec, 1, SMALL, job), launch.run(spec, 1, SMALL, job)
    assert first.output_ids == second.output_ids and len(first.output_ids[0]) == 5
