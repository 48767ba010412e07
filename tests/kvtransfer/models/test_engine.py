"""The engine over the pools: chunked prefill equals one-shot prefill, requests join and leave a
running batch without changing each other's tokens, attention reads the pool (no private cache),
and every page, row and Mamba slot goes back when requests finish."""

import numpy as np
import pytest
import torch

from kvtransfer.models.config import ModelName
from kvtransfer.models.engine import Engine, FinishReason
from kvtransfer.models.parallel import TPGroup
from tests.kvtransfer.models._support import SMALL, engine_config, tiny_spec

CHUNK_ATOL = 1e-4
PROMPT_A = list(b"chunked prefill over several pages")
PROMPT_B = list(b"a second request")


def _engine(spec, **kw):
    model = spec.build(TPGroup(), torch.float32, "cpu")
    return Engine(model, engine_config(**kw) if kw else SMALL)


def _solo(spec, prompt, n, **kw):
    eng = _engine(spec, **kw)
    req = eng.add(prompt, n, record_logits=True)
    eng.run()
    return req


@pytest.fixture(params=[ModelName.TINY_MLA, ModelName.TINY_HYBRID, ModelName.SMOLLM2])
def spec(request):
    if request.param is ModelName.SMOLLM2:
        return request.getfixturevalue("smollm2")[0]
    return tiny_spec(request.param)


def test_chunked_prefill_equals_one_shot(spec):
    one = _solo(spec, PROMPT_A, 4)
    chunked = _solo(spec, PROMPT_A, 4, chunk_size=5)  # 7 chunks, crossing page edges
    assert chunked.output_ids == one.output_ids
    assert (torch.stack(chunked.logits) - torch.stack(one.logits)).abs().max().item() < CHUNK_ATOL


def test_continuous_batching(spec):
    alone_a, alone_b = _solo(spec, PROMPT_A, 6), _solo(spec, PROMPT_B, 4)
    eng = _engine(spec, chunk_size=8)
    a = eng.add(PROMPT_A, 6, record_logits=True)
    for _ in range(6):  # A's prefill chunks and a first decode step
        eng.step()
    b = eng.add(PROMPT_B, 4, record_logits=True)  # joins while A decodes
    eng.run()
    assert a.output_ids == alone_a.output_ids and b.output_ids == alone_b.output_ids
    assert a.finish is b.finish is FinishReason.LENGTH
    for got, want in ((a, alone_a), (b, alone_b)):
        assert (torch.stack(got.logits) - torch.stack(want.logits)).abs().max().item() < CHUNK_ATOL
    # everything went back to the pools
    pools = eng.pools
    assert pools.allocator.available_size() == pools.allocator.num_pages * SMALL.page_size
    assert pools.req_to_token.available_size() == SMALL.max_requests
    if pools.mamba_pool is not None:
        assert pools.mamba_pool.available_size() == SMALL.max_requests


def test_decode_reads_the_pool():
    """Zeroing a request's cached rows after prefill changes its next logits."""
    spec = tiny_spec(ModelName.TINY_MLA)
    logits = []
    for corrupt in (False, True):
        eng = _engine(spec)
        req = eng.add(PROMPT_A, 2, record_logits=True)
        eng.step()  # prefill
        if corrupt:
            for layer in range(spec.config.num_layers):
                eng.pools.kv.kv_buffer[layer][req.slots[:4]] = 0
        eng.run()
        logits.append(req.logits[1])
    assert not torch.equal(logits[0], logits[1])


def test_too_long_prompt_is_a_value_error():
    eng = _engine(tiny_spec(ModelName.TINY_HYBRID), max_tokens=16)
    with pytest.raises(ValueError, match="does not fit the pool of 16 token slots"):
        eng.add(list(range(14)), 4)


def test_a_prompt_given_as_an_int32_array_runs_as_its_list_does():
    """Nodes hand their ranks prompts as int32 arrays; the engine checks them in one pass and
    refuses arrays that are not 1-D integer ids, or ids outside the vocabulary."""
    spec = tiny_spec(ModelName.TINY_MLA)
    as_list = _solo(spec, PROMPT_A, 4)
    as_array = _solo(spec, np.asarray(PROMPT_A, dtype=np.int32), 4)
    assert as_array.prompt_ids == as_list.prompt_ids and all(type(t) is int for t in as_array.prompt_ids)
    assert as_array.output_ids == as_list.output_ids
    eng = _engine(spec)
    vocab = spec.config.vocab_size
    for bad, why in ((np.asarray(PROMPT_A, dtype=np.float32), "1-D integer array, got float32"),
                     (np.asarray([PROMPT_A[:4]] * 2, dtype=np.int32), r"got int32 of shape \[2, 4\]"),
                     (np.asarray([1, vocab], dtype=np.int32), rf"must lie in \[0, {vocab}\), got \[1, {vocab}\]"),
                     (np.zeros(0, dtype=np.int32), "at least one token")):
        with pytest.raises(ValueError, match=why):
            eng.add(bad, 2)
        with pytest.raises(ValueError, match=why):
            eng.reserve(bad, 2)
    assert not eng.waiting and not eng.reserved


def test_a_hybrid_model_calls_back_after_each_attention_layer_once_its_kv_is_in_the_pool():
    """Layer-wise sending on a hybrid model: per prefill chunk, one call per attention layer,
    counting the KV pool's layers; at the call, that layer's K/V of the chunk are in the pool
    as they stay, and the next attention layer's are not written yet."""
    spec = tiny_spec(ModelName.TINY_HYBRID)
    eng = _engine(spec, chunk_size=8)
    attention = spec.config.attention_layers
    kv, seen = eng.pools.kv, []

    def on_layers(chunks, end):
        for req, n in chunks:
            slots = req.slots[req.kv_committed_len: req.kv_committed_len + n]
            layer = attention[end - 1]
            later = [] if end == len(attention) else [kv.get_key_buffer(attention[end])[slots].clone()]
            seen.append((end, slots, layer, kv.get_key_buffer(layer)[slots].clone(),
                         kv.get_value_buffer(layer)[slots].clone(), later))

    eng.on_layers = on_layers
    eng.add(PROMPT_A, 2, layers_out=True)
    eng.run()
    chunks = -(-len(PROMPT_A) // 8)
    assert [e for e, *_ in seen] == list(range(1, len(attention) + 1)) * chunks
    for end, slots, layer, k, v, later in seen:
        assert k.abs().sum() > 0
        assert torch.equal(k, kv.get_key_buffer(layer)[slots]) and torch.equal(v, kv.get_value_buffer(layer)[slots])
        assert all(not x.any() for x in later)


def test_admission_waits_for_pages():
    """A request whose budget the free pages cannot cover waits until another one finishes."""
    eng = _engine(tiny_spec(ModelName.TINY_MLA), max_tokens=32)  # 8 pages of 4
    a = eng.add(list(range(12)), 8)  # 20 tokens: 5 pages
    b = eng.add(list(range(10)), 2)  # 12 tokens: 3 pages, fits beside a
    c = eng.add(list(range(5)), 3)  # 2 pages: must wait for b
    eng.step()
    assert a in eng.running and b in eng.running and list(eng.waiting) == [c]
    eng.run()
    assert a.finish is b.finish is c.finish is FinishReason.LENGTH


def test_a_request_that_fits_alone_waits_for_held_and_reserved_pages():
    """Pages held for a transfer (prefill) or reserved for one (decode) do not make the engine
    fail: the request that does not fit beside them waits, and runs once they come back."""
    eng = _engine(tiny_spec(ModelName.TINY_MLA), max_tokens=32)  # 8 pages of 4
    free = eng.pools.allocator.available_size()
    held = eng.add(list(range(15)), 1, hold=True)  # 16 tokens: 4 pages, kept after it finishes
    eng.run()
    assert held.finish is FinishReason.LENGTH and eng.held == [held]
    reserved = eng.reserve(list(range(11)), 1)  # 12 tokens: 3 pages
    assert reserved is not None
    late = eng.add(list(range(6)), 2)  # 8 tokens: 2 pages, 1 free
    assert not eng.has_work()
    assert eng.step() == [] and list(eng.waiting) == [late]  # it waits; nothing raises
    eng.release(held)
    assert eng.has_work()
    eng.run()
    assert late.finish is FinishReason.LENGTH
    eng.abort(reserved)
    assert eng.slots_in_use == 0 and eng.pools.allocator.available_size() == free
