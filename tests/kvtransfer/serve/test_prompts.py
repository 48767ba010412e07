"""A request's token ids and budget on a node (kvtransfer.serve.prompts), in process: the tiny
MLA model's config and byte tokenizer, a pool of :data:`POOL` slots."""

from __future__ import annotations

import pytest

from kvtransfer.models.config import EngineConfig, MLAConfig
from kvtransfer.models.tokenizer import ByteTokenizer
from kvtransfer.serve.openai_api import ApiError, validate
from kvtransfer.serve.prompts import prompt_ids, token_budget

POOL = 64
EC = EngineConfig(max_tokens=POOL, page_size=16)
CONFIG = MLAConfig()


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the texts it encodes."""

    def __init__(self):
        super().__init__(CONFIG.vocab_size)
        self.encoded = 0

    def encode(self, text):
        self.encoded += 1
        return super().encode(text)


def _chat(content, **fields):
    return validate("chat", {"messages": [{"role": "user", "content": content}], **fields})


def test_text_parts_make_the_same_prompt_as_the_joined_string():
    tok = CountingTokenizer()
    parts = _chat([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])
    assert prompt_ids(parts, tok, EC, CONFIG).tolist() == prompt_ids(_chat("one\ntwo"), tok, EC, CONFIG).tolist()
    developer = validate("chat", {"messages": [{"role": "developer", "content": "be brief"},
                                               {"role": "user", "content": "hi"}]})
    system = validate("chat", {"messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hi"}]})
    assert prompt_ids(developer, tok, EC, CONFIG).tolist() == prompt_ids(system, tok, EC, CONFIG).tolist()


def test_a_prompt_too_long_on_its_bytes_is_refused_before_it_is_encoded():
    tok = CountingTokenizer()
    req = validate("completion", {"prompt": "x" * (POOL * tok.max_token_bytes + 1)})
    with pytest.raises(ApiError, match=f"bytes make at least {POOL + 1} tokens, more than the {POOL}") as caught:
        prompt_ids(req, tok, EC, CONFIG)
    assert tok.encoded == 0
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "prompt", "context_length_exceeded")


def test_without_max_tokens_the_budget_is_what_the_pool_leaves():
    tok = CountingTokenizer()
    req = _chat("hello")
    ids = prompt_ids(req, tok, EC, CONFIG)
    assert token_budget(req, ids, "decode", EC, CONFIG) == POOL - len(ids)
    assert token_budget(_chat("hello", max_tokens=3), ids, "decode", EC, CONFIG) == 3
    assert token_budget(_chat("hello", max_completion_tokens=5), ids, "colocated", EC, CONFIG) == 5


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_a_budget_past_the_pool_names_max_tokens(role):
    req = _chat("hello", max_tokens=POOL)
    ids = prompt_ids(req, CountingTokenizer(), EC, CONFIG)
    with pytest.raises(ApiError, match="does not fit the pool") as caught:
        token_budget(req, ids, role, EC, CONFIG)
    assert (caught.value.param, caught.value.code) == ("max_tokens", "context_length_exceeded")
    assert token_budget(req, ids, "prefill", EC, CONFIG) == POOL  # prefill computes the prompt and one token


def test_a_prompt_that_fills_the_pool_names_the_messages():
    req, ids = _chat("x"), list(range(POOL))
    with pytest.raises(ApiError) as caught:
        token_budget(req, ids, "decode", EC, CONFIG)
    assert (caught.value.param, caught.value.code) == ("messages", "context_length_exceeded")
