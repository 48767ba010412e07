"""SmolLM2's tokenizer, built from the GGUF metadata: known encodings from the file's own token
table and from transformers' GGUF tokenizer (an independent build of the same data), round trips,
the chat template."""

import os

import pytest

from kvtransfer.models.gguf_llama import field
from tests.kvtransfer.models._support import require_transformers

TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "In 2024, 3.14159 x 12 = 37.699",
    "  two spaces\n\n\ttab and newlines   ",
    "café naïve 日本語 😀",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "I'm sure it's what they'd've done",
]


@pytest.fixture(scope="module")
def table(smollm2_raw):
    reader = smollm2_raw[0]
    return {t: i for i, t in enumerate(field(reader, "tokenizer.ggml.tokens"))}


def test_control_tokens_are_specials(smollm2_raw, smollm2):
    reader, tok = smollm2_raw[0], smollm2[1]
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    control = [tokens[i] for i, t in enumerate(types) if t == 3]
    assert len(control) == 17 and "<|im_start|>" in control and "<|im_end|>" in control
    for name in control:  # each encodes as itself, whole
        assert tok.encode(name) == [tokens.index(name)]
    assert tok.eos_id == tokens.index("<|im_end|>")


def test_known_encodings_from_the_token_table(smollm2, table):
    tok = smollm2[1]
    assert tok.encode("Hello") == [table["Hello"]]
    assert tok.encode(" world") == [table["Ġworld"]]  # byte-level: a leading space is Ġ
    assert tok.encode("Hello world") == [table["Hello"], table["Ġworld"]]  # no prefix space, no BOS
    assert tok.encode("2024") == [table[d] for d in "2024"]  # digits one by one
    assert tok.encode("<|im_start|>user\n") == [table["<|im_start|>"], table["user"], table["Ċ"]]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smollm2, text):
    tok = smollm2[1]
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_encodings_match_transformers(smollm2):
    require_transformers()
    from transformers import AutoTokenizer

    from kvtransfer.models.gguf_llama import smollm2_gguf_path

    path = smollm2_gguf_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = smollm2[1]
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=True), text
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == want


def test_chat_template_is_chatml_from_the_file(smollm2):
    tok = smollm2[1]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
