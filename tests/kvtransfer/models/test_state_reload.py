"""A request's KV (and Mamba state) saved after prefill and loaded by another process, into other
slots, continues to bit-identical logits: the hand-off a prefill -> decode transfer performs."""

import pytest
import torch

from kvtransfer.models import launch
from kvtransfer.models.config import ModelName
from kvtransfer.models.jobs import ContinueFromState, PrefillAndExport
from tests.kvtransfer.models._support import SMALL, tiny_spec

NEW = 5


def _check(spec, prompt):
    state, ref = launch.run(spec, 1, SMALL, PrefillAndExport(tuple(prompt), NEW))
    assert len(state.token_ids) == len(prompt) + 1  # the prompt and the token sampled at prefill
    job = ContinueFromState(state, NEW, offset_pages=3)
    out = launch.run(spec, 1, SMALL, job, threads=torch.get_num_threads(), spawn=True)
    assert out.output_ids == ref.output_ids
    assert torch.equal(out.logits[0], ref.logits[0][1:])  # every decode step, bit for bit


@pytest.mark.parametrize("name", [ModelName.TINY_MLA, ModelName.TINY_HYBRID])
def test_tiny_models_continue_bit_identically(name):
    _check(tiny_spec(name), list(b"the state moves between processes"))


def test_smollm2_continues_bit_identically(smollm2):
    spec, tok = smollm2
    _check(spec, tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a color."}])))
