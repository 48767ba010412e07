"""TP 1 against TP N (float32): same tokens, logits within TP_ATOL (only the order of the
all-reduce sums differs), and each rank's pools hold exactly its shard."""

import pytest

from kvtransfer.models import launch
from kvtransfer.models.config import ModelName
from kvtransfer.models.jobs import Generate
from tests.kvtransfer.models._support import SMALL, PoolShapes, byte_prompts, tiny_spec

TP_ATOL = 1e-4
NEW = 6


def _compare(spec, tp, prompts):
    job = PoolShapes(Generate(prompts, NEW, record_logits=True))
    items1, dims1, one = launch.run(spec, 1, SMALL, job)
    items, dims, many = launch.run(spec, tp, SMALL, job, threads=1)
    assert many.output_ids == one.output_ids
    for a, b in zip(one.logits, many.logits):
        assert (a - b).abs().max().item() < TP_ATOL
    return items1, dims1, items, dims


@pytest.mark.parametrize("tp", [4])  # TP 2 splits the same way; the hybrid test runs both
def test_tiny_mla_tp(tp):
    items1, _, items, _ = _compare(tiny_spec(ModelName.TINY_MLA), tp, byte_prompts("hello there", "abc"))
    assert items == items1  # the latent is replicated: every rank holds whole rows


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_hybrid_tp(tp):
    items1, dims1, items, dims = _compare(tiny_spec(ModelName.TINY_HYBRID), tp, byte_prompts("hello there", "abc"))
    assert items == [i // tp for i in items1]  # K/V heads split
    assert dims == [d // tp for d in dims1]  # conv channels and SSM heads split


def test_smollm2_tp3(smollm2):
    spec, tok = smollm2
    prompts = (tuple(tok.encode("The capital of France is")), tuple(tok.encode("1, 2, 3, 4,")))
    items1, _, items, _ = _compare(spec, 3, prompts)
    assert items == [i // 3 for i in items1]  # one of the three KV heads per rank
