"""The official ``openai`` SDK as the client of the router and of a colocated node: the plain
streaming loop, ``include_usage``, chat and completions, streaming and not, the request shapes
OpenAI clients send, and every refusal in OpenAI's error shape (status, ``param``, ``code``).
One cluster of real processes (tiny MLA model, prefill TP 1 pages of 16 -> decode TP 1 pages of
64, pools of :data:`POOL` slots, so that a request's default ``max_tokens`` is short) serves the
module."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvtransfer.serve.http import DEFAULT_MAX_BODY_BYTES
from tests.kvtransfer.serve._cluster import Cluster

POOL = 128  # token slots on every node: whole pages of 16 and of 64
MODEL = "mla-tiny"
TARGETS = ("router", "colocated")  # the two servers a client talks to


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(MODEL, prefill_tp=1, decode_tp=1, pages=(16, 64), node_args=("--pool-tokens", str(POOL)))
    yield c
    c.stop()


def _client(cluster, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url(name)}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content="Say something", model=MODEL, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


@pytest.mark.parametrize("target", TARGETS)
def test_the_plain_streaming_loop_reads_every_chunk(cluster, target):
    client = _client(cluster, target)
    whole = _chat(client, max_tokens=8).choices[0].message.content
    text = ""
    for chunk in _chat(client, max_tokens=8, stream=True):
        text += chunk.choices[0].delta.content or ""  # an IndexError if a chunk had no choices
    assert text == whole


@pytest.mark.parametrize("target", TARGETS)
def test_include_usage_ends_the_stream_with_one_usage_chunk(cluster, target):
    chunks = list(_chat(_client(cluster, target), max_tokens=6, stream=True, stream_options={"include_usage": True}))
    *choices, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + 6
    assert all(len(c.choices) == 1 and c.usage is None for c in choices)
    assert choices[-1].choices[0].finish_reason == "length"
    figures = [c.model_extra.get("kvtransfer") for c in chunks]
    if target == "router":  # the transfer's figures: an extra field of the last choice chunk
        assert figures[:-2] == [None] * (len(chunks) - 2) and figures[-1] is None
        assert figures[-2]["kv_bytes"] > 0 and figures[-2]["prefill"]["compute_s"] > 0
    else:
        assert figures == [None] * len(chunks)


def test_completions_disaggregated_equal_colocated_streaming_or_not(cluster):
    def complete(target, **kw):
        return _client(cluster, target).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7,
                                                          temperature=0, **kw)

    whole = complete("colocated")
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 7
    assert complete("router").choices[0].text == whole.choices[0].text
    for target in TARGETS:
        stream = list(complete(target, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in stream[:-1]) == whole.choices[0].text
        assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 7


@pytest.mark.parametrize("target", TARGETS)
def test_without_max_tokens_a_request_may_fill_the_pool(cluster, target):
    """vLLM's default: what the context and the pool leave after the prompt (not 16)."""
    out = _chat(_client(cluster, target), extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == POOL


@pytest.mark.parametrize("target", TARGETS)
def test_the_shapes_openai_clients_send_are_read(cluster, target):
    client = _client(cluster, target)

    def answer(messages, **kw):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **kw).choices[
            0].message.content

    plain = answer([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one\ntwo"}], seed=5)
    # text parts joined by newlines, developer as system, null for the optional fields (temperature
    # null: the default, 1, sampled with the same seed)
    assert answer([{"role": "developer", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
                  temperature=None, n=None, top_p=None, stop=None, presence_penalty=None, seed=5) == plain
    history = [{"role": "user", "content": "Add 2 and 2"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    assert isinstance(answer(history, temperature=0), str)
    assert _chat(client, max_tokens=2, model="tiny-mla").model == MODEL  # an alias names the same model


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kw, param, code", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"top_p": 0.5}, "top_p", "unsupported_parameter"),
    ({"presence_penalty": 1.0}, "presence_penalty", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"max_tokens": POOL}, "max_tokens", "context_length_exceeded"),
])
def test_what_is_not_served_is_refused_by_name(cluster, target, kw, param, code):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as caught:
        _client(cluster, target).chat.completions.create(**body)
    err = caught.value
    assert err.status_code == 400 and err.param == param and err.code == code and err.type == "invalid_request_error"
    assert err.message.startswith("Error code: 400 - ") and "http://" not in err.message


@pytest.mark.parametrize("target", TARGETS)
def test_an_unknown_model_is_404_model_not_found(cluster, target):
    with pytest.raises(openai.NotFoundError) as caught:
        _client(cluster, target).chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


@pytest.mark.parametrize("target", ("router", "prefill", "decode", "colocated"))
def test_models_lists_the_served_model(cluster, target):
    assert [m.id for m in _client(cluster, target).models.list()] == [MODEL]


def test_router_info_names_the_model_and_the_nodes(cluster):
    info = httpx.get(f"{cluster.url('router')}/info").json()
    assert info["role"] == "router" and info["model"] == MODEL and "tiny-mla" in info["model_names"]
    assert info["max_body_bytes"] == DEFAULT_MAX_BODY_BYTES
    assert {(n["role"], n["url"], n["up"]) for n in info["nodes"]} == {
        ("prefill", cluster.url("prefill"), True), ("decode", cluster.url("decode"), True)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nothing", 404, "not_found"),
    ("POST", "/health", 405, "method_not_allowed"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
])
def test_unknown_paths_and_methods_answer_in_openai_shape(cluster, target, method, path, status, code):
    r = httpx.request(method, f"{cluster.url(target)}{path}")
    assert r.status_code == status
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": None, "code": code}}
    assert path in r.json()["error"]["message"]


@pytest.mark.parametrize("target", TARGETS)
def test_a_body_past_the_limit_is_413(cluster, target):
    body = b'{"prompt": "' + b"a" * DEFAULT_MAX_BODY_BYTES + b'"}'
    r = httpx.post(f"{cluster.url(target)}/v1/completions", content=body, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{cluster.url(target)}/health").status_code == 200


@pytest.mark.parametrize("target", TARGETS)
def test_a_lone_surrogate_is_400_invalid_unicode(cluster, target):
    body = b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}'
    r = httpx.post(f"{cluster.url(target)}/v1/chat/completions", content=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_unicode"
    assert err["param"] == "messages[0].content"


def test_a_request_both_nodes_refuse_leaves_no_unretrieved_task_on_the_router(cluster):
    """A prompt too long for the pools passes the router's checks and both nodes refuse it."""
    for _ in range(3):
        r = httpx.post(f"{cluster.url('router')}/v1/completions", json={"prompt": "x" * (2 * POOL)}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert _chat(_client(cluster, "router"), max_tokens=2).choices  # a later request runs the loop on
    log = open(cluster.servers["router"].log_path).read()
    assert "never retrieved" not in log and "Traceback" not in log
