"""The OpenAI API's request and response shapes, as nodes and the router serve them.

``POST /v1/completions`` (``prompt``) and ``POST /v1/chat/completions`` (``messages``) with
``max_tokens``, ``temperature`` (0 = greedy), ``seed``, ``stop`` and ``stream`` (server-sent
events ending in ``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk).
Fields this server does not implement (``n`` > 1, ``logprobs``, ...) are refused by name
rather than ignored; unknown fields are ignored, as OpenAI clients send many.

Between the router and the nodes a request also carries ``kvtransfer`` (:class:`Pairing`):
the request id both nodes use, the prefill node's bootstrap address (decode), and whether to
report KV digests. Responses carry a ``kvtransfer`` object with the transfer's figures.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ChatRequest", "CompletionRequest", "Pairing", "ValidationError", "TextStream", "error_body",
           "parse_request", "sse"]

MAX_STOP = 4


class Pairing(BaseModel):
    """What the router adds to a request it sends to a prefill and a decode node."""

    model_config = ConfigDict(extra="forbid")

    rid: str = Field(min_length=1, max_length=128)
    bootstrap: Optional[str] = None  # decode: the prefill node's bootstrap service
    verify: bool = False  # report per-layer KV digests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stop: Optional[Union[str, List[str]]] = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    logprobs: Optional[Any] = None
    top_p: float = 1.0
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever is sampled (benchmarks)
    kvtransfer: Optional[Pairing] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop must be up to {MAX_STOP} non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return None

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v != 1.0:
            raise ValueError("only top_p = 1 is supported")
        return v

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Common):
    prompt: Union[str, List[str]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("prompt must be one string (or a list of exactly one)")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)


def parse_request(kind: str, raw: bytes):
    """A :class:`CompletionRequest` (``kind`` "completion") or :class:`ChatRequest` from a
    body; ``ValueError`` with a readable message for malformed JSON or fields."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    cls = CompletionRequest if kind == "completion" else ChatRequest
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ValueError(f"{where}: {first['msg']}") from None


def error_body(message: str, status: int) -> Dict[str, Any]:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def sse(obj) -> bytes:
    """One server-sent event (``obj`` a dict, or ``"[DONE]"``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class TextStream:
    """Turns a request's token ids into text deltas: holds back an incomplete UTF-8 tail and
    any tail that may start a stop string; cuts the text at the first stop string."""

    def __init__(self, tokenizer, stops: List[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: List[int] = []
        self.text = ""  # emitted so far
        self.stopped = False

    def feed(self, ids) -> str:
        """New text to emit after ``ids``; sets ``stopped`` when a stop string appeared."""
        self.ids.extend(ids)
        full = self.tokenizer.decode(self.ids)
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            full = full[:cut]
        else:
            full = full.rstrip("\ufffd")  # a character whose bytes have not all arrived
            hold = max((k for s in self.stops for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            full = full[:len(full) - hold]
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def flush(self) -> str:
        """The held-back tail once the request ended without a stop string."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta


class Shaper:
    """Builds the OpenAI JSON of one request: the whole response, or its stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self._role_sent = False

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def response(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int, extra=None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice],
               "usage": self.usage(prompt_tokens, completion_tokens)}
        if extra:
            out["kvtransfer"] = extra
        return out

    def chunk(self, text: str, finish: Optional[str] = None, extra=None) -> dict:
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if extra:
            out["kvtransfer"] = extra
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(prompt_tokens, completion_tokens)}
