"""The OpenAI API's request and response shapes, as nodes and the router serve them.

``POST /v1/completions`` (``prompt``) and ``POST /v1/chat/completions`` (``messages``) with
``max_tokens`` (or ``max_completion_tokens``; left out: what the context and the pool leave after
the prompt, as vLLM does), ``temperature`` (0 = greedy), ``seed``, ``top_k`` (vLLM's extension;
0 or -1: no limit), ``stop`` and ``stream`` (server-sent events ending in ``data: [DONE]``;
``stream_options.include_usage`` adds one last chunk with ``choices: []`` and ``usage``).

What OpenAI clients send is taken as they mean it: ``null`` for an optional field is the field
left out; chat content is a string or a list of text parts; the roles are ``system``,
``developer`` (a system message), ``user``, ``assistant`` (its content may be null) and
``tool``; unknown fields are ignored, as clients send many. Features this server does not
implement (:data:`UNSUPPORTED`: ``tools``, ``response_format`` other than text, ``logprobs``,
``n`` > 1, ...) are refused by name (400), never ignored. A ``model`` the server does not serve
is a 404 with code ``model_not_found``.

Errors (:class:`ApiError`) have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``: ``code`` a string, ``param`` the field at fault (``messages[0].content``) or null.

Between the router and the nodes a request also carries ``kvtransfer`` (:class:`Pairing`):
the request id both nodes use, the prefill node's bootstrap address (decode), and whether to
report KV digests. Responses carry the transfer's figures in a ``kvtransfer`` object where
OpenAI clients ignore it: on the response (non-streaming), on the stream's last choice chunk.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Pairing", "TextStream", "UNSUPPORTED", "check_model",
           "error_body", "load_body", "pairing_for", "parse_request", "sse", "validate"]

MAX_STOP = 4

# the code of an error that names none of its own, by HTTP status
_STATUS_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 409: "conflict",
                 413: "request_too_large", 429: "rate_limit_exceeded", 499: "client_closed_request",
                 500: "internal_error", 502: "bad_gateway", 503: "unavailable", 504: "timeout"}


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None,
               **extra) -> Dict[str, Any]:
    """OpenAI's error shape; ``extra`` adds fields of this server's own (clients ignore them)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = code or _STATUS_CODES.get(status, "invalid_request" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **extra}}


class ApiError(Exception):
    """A request refused or not served: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 **extra):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.extra = status, message, param, code, extra

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code, **self.extra)


def _one_of(*fine) -> Callable[[Any], bool]:
    """Whether a value is one of ``fine``, of the same JSON type (``true`` is not ``1``)."""
    return lambda v: any(v == f and type(v) is type(f) for f in fine)


# field -> (whether a value is one this server serves, what it does not serve); refused by name
UNSUPPORTED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "n": (_one_of(1), "only n = 1 is supported"),
    "best_of": (_one_of(1), "only best_of = 1 is supported"),
    "logprobs": (_one_of(False, 0), "logprobs are not supported"),
    "top_logprobs": (_one_of(0), "logprobs are not supported"),
    "top_p": (_one_of(1, 1.0), "only top_p = 1 is supported"),
    "echo": (_one_of(False), "echo is not supported"),
    "suffix": (_one_of(""), "suffix is not supported"),
    "tools": (_one_of([]), "tools (function calling) are not supported"),
    "functions": (_one_of([]), "functions (function calling) are not supported"),
    "tool_choice": (_one_of("none", "auto"), "tools (function calling) are not supported"),
    "function_call": (_one_of("none", "auto"), "functions (function calling) are not supported"),
    "response_format": (_one_of({"type": "text"}), "only text responses are supported (no JSON mode or schema)"),
    "logit_bias": (_one_of({}), "logit_bias is not supported"),
    "presence_penalty": (_one_of(0, 0.0), "presence_penalty is not supported"),
    "frequency_penalty": (_one_of(0, 0.0), "frequency_penalty is not supported"),
    "modalities": (_one_of(["text"]), "only the text modality is supported"),
    "audio": (_one_of(), "audio output is not supported"),
    "prediction": (_one_of(), "predicted outputs are not supported"),
}

_SURROGATE = re.compile("[\ud800-\udfff]")


def load_body(raw: bytes) -> Dict[str, Any]:
    """A request body as a dict; :class:`ApiError` (400) for JSON that is malformed, not an
    object, or holds text that is not Unicode (a lone surrogate such as ``"\\ud800"``)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    where = _lone_surrogate(body)
    if where is not None:
        raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate, which is not valid Unicode",
                       param=where, code="invalid_unicode")
    return body


def _lone_surrogate(body: dict) -> Optional[str]:
    """The path (``messages[0].content``) of the first string or key with a lone surrogate."""
    stack: List[Tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                here = f"{path}.{k}" if path else k
                if _SURROGATE.search(k):
                    return here
                stack.append((here, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _refuse(what: str, code: str = "invalid_value") -> PydanticCustomError:
    return PydanticCustomError(code, "{what}", {"what": what})


class Pairing(BaseModel):
    """What the router adds to a request it sends to a prefill and a decode node."""

    model_config = ConfigDict(extra="forbid")

    rid: str = Field(min_length=1, max_length=128)
    bootstrap: Optional[str] = None  # decode: the prefill node's bootstrap service
    verify: bool = False  # report per-layer KV digests
    layerwise: Optional[bool] = None  # prefill: False sends the KV after the prompt on a --layerwise node


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    top_k: int = Field(default=0, ge=-1, le=1024)  # vLLM's extension; -1 or 0: no limit (models.sampler.MAX_TOP_K)
    stop: List[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever is sampled (benchmarks)
    kvtransfer: Optional[Pairing] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise _refuse(f"must be a string or a list of up to {MAX_STOP} non-empty strings")
        return stops

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        if not isinstance(v, str):
            raise _refuse("must be one string (or a list of exactly one; token ids are not supported)")
        if not v:
            raise _refuse("must not be empty")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, tool_calls: the template has no use for them

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[str] = Field(default=None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v, info: ValidationInfo):
        """A string, the text parts joined by newlines, or None (an assistant's, only)."""
        if v is None:
            role = info.data.get("role", "assistant")
            if role != "assistant":
                raise _refuse(f"required for role {role!r}", "missing_required_parameter")
            return None
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise _refuse(f"must be a string or a list of text parts, got {type(v).__name__}")
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise _refuse(f"part {i} is of type {kind!r}; only text parts are supported",
                              "unsupported_parameter")
            if not isinstance(part.get("text"), str):
                raise _refuse(f"part {i} needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)

    def for_template(self) -> Dict[str, str]:
        """The message as the chat template takes it (``developer`` is the system role)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}


class ChatRequest(_Common):
    messages: List[Message] = Field(min_length=1)


def validate(kind: str, body: Dict[str, Any]):
    """A :class:`CompletionRequest` (``kind`` "completion") or :class:`ChatRequest` from a
    body :func:`load_body` read; :class:`ApiError` (400) naming the field at fault."""
    body = {k: v for k, v in body.items() if v is not None}  # null: the field left out
    for name, (serves, what) in UNSUPPORTED.items():
        if name in body and not serves(body[name]):
            raise ApiError(400, f"{name}: {what}, got {json.dumps(body[name])[:80]}", param=name,
                           code="unsupported_parameter")
    cls = CompletionRequest if kind == "completion" else ChatRequest
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or None
        code = first["type"] if first["type"] in ("missing_required_parameter", "unsupported_parameter") else (
            "missing_required_parameter" if first["type"] == "missing" else "invalid_value")
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param or 'body'}: {message}", param=param, code=code) from None


def parse_request(kind: str, raw: bytes):
    """:func:`validate` of :func:`load_body`."""
    return validate(kind, load_body(raw))


def pairing_for(role: str, req) -> Optional[Pairing]:
    """The request's pairing, as a node of ``role`` needs it; :class:`ApiError` (400) otherwise."""
    pairing = req.kvtransfer
    if role == "colocated" and pairing is not None:
        raise ApiError(400, "a colocated node serves plain OpenAI requests (no kvtransfer field)", "kvtransfer")
    if role != "colocated" and pairing is None:
        raise ApiError(400, f"a {role} node serves requests the router pairs (kvtransfer.rid): send yours to the "
                            f"router", "kvtransfer")
    if role == "decode" and not pairing.bootstrap:
        raise ApiError(400, "a decode request needs kvtransfer.bootstrap (the prefill node's bootstrap service)",
                       "kvtransfer.bootstrap")
    return pairing


def check_model(req, names: Sequence[str]) -> None:
    """:class:`ApiError` (404 ``model_not_found``) unless the request names no model or one of
    ``names`` (the served model's name, then its aliases)."""
    if req.model is not None and req.model not in names:
        raise ApiError(404, f"the model {req.model!r} does not exist here; this server serves {names[0]!r}",
                       param="model", code="model_not_found")


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
