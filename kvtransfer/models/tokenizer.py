"""Tokenizers: SmolLM2's byte-level BPE built from its GGUF metadata, and a byte tokenizer for
the tiny seeded models.

SmolLM2 (``tokenizer.ggml.model = gpt2``, ``pre = smollm``): the vocabulary
``tokenizer.ggml.tokens`` and merges ``tokenizer.ggml.merges`` make a ``tokenizers`` BPE
model; pre-tokenization splits single digits, then applies the GPT-2 regex, byte-level,
without a prefix space; tokens of type CONTROL (3) are special (never split, kept whole);
no BOS is added (``add_bos_token = false``). The chat template is the file's own
``tokenizer.chat_template`` (ChatML), rendered with Jinja2.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Sequence

CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


class GGUFTokenizer:
    """Byte-level BPE of a GGUF file (module docstring)."""

    def __init__(self, reader):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        from kvtransfer.models.gguf_llama import field

        if isinstance(reader, dict):  # the parts of a cached tokenizer (see parts())
            self._tok = Tokenizer.from_str(reader["tokenizer_json"])
            self.special_ids, self.vocab_size = list(reader["special_ids"]), int(reader["vocab_size"])
            self.eos_id, self.chat_template = int(reader["eos_id"]), reader["chat_template"]
            return
        model = field(reader, "tokenizer.ggml.model")
        pre = field(reader, "tokenizer.ggml.pre")
        if (model, pre) != ("gpt2", "smollm"):
            raise ValueError(f"expected a gpt2/smollm tokenizer, got model={model!r}, pre={pre!r}")
        tokens: List[str] = field(reader, "tokenizer.ggml.tokens")
        types: List[int] = field(reader, "tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        self.special_ids = [i for i, t in enumerate(types) if t == CONTROL_TOKEN_TYPE]
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in self.special_ids])
        self._tok = tok
        self.vocab_size = len(tokens)
        self.eos_id = int(field(reader, "tokenizer.ggml.eos_token_id"))
        self.chat_template: str = field(reader, "tokenizer.chat_template")
        if field(reader, "tokenizer.ggml.add_bos_token"):
            raise ValueError("this tokenizer does not add BOS; the file asks for it (add_bos_token = true)")

    def parts(self) -> dict:
        """Plain data that rebuilds this tokenizer (``GGUFTokenizer(parts)``) without the file."""
        return {"tokenizer_json": self._tok.to_str(), "special_ids": self.special_ids, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "chat_template": self.chat_template}

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (a byte-level token's characters are its
        bytes; specials are ASCII): a text of n bytes is at least n / this many tokens."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> List[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long prompt encoded
        # in a thread of a server leaves its event loop free
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    @property
    def stop_ids(self) -> frozenset:
        return frozenset({self.eos_id})

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The file's Jinja chat template applied to ``[{"role": ..., "content": ...}, ...]``."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt
        )


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; ids from 256 up are specials (id 256 = end of text). For the
    tiny seeded models, whose text is not meant to be read."""

    def __init__(self, vocab_size: int):
        if vocab_size < 257:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 257, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_id = 256

    max_token_bytes = 1

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def stop_ids(self) -> frozenset:
        return frozenset({self.eos_id})

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
