"""The OpenAI API through the router and a colocated node, with a real HTTP client: completions,
chat, streaming, errors, /metrics. One cluster of real processes (tiny MLA model, prefill TP 2
pages of 16 -> decode TP 1 pages of 64) serves the whole module."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.serve.http import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S, client_limits
from tests.kvtransfer.serve._cluster import Cluster, chat, sse_events


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("mla-tiny", prefill_tp=2, decode_tp=1, pages=(16, 64))
    yield c
    c.stop()


def _metrics(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_completion_equals_the_colocated_node(cluster):
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    a = httpx.post(f"{cluster.url('router')}/v1/completions", json=body, timeout=120).json()
    b = httpx.post(f"{cluster.url('colocated')}/v1/completions", json=body, timeout=120).json()
    assert a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"] == b["usage"] == {"prompt_tokens": 19, "completion_tokens": 12, "total_tokens": 31}
    kv = a["kvtransfer"]
    assert kv["prefill_node"] == cluster.url("prefill") and kv["decode_node"] == cluster.url("decode")
    assert kv["kv_bytes"] == 19 * 3 * (32 + 8) * 4  # tokens x layers x (latent + rope) x fp32, one decode rank


def test_sampling_with_a_seed_is_the_same_disaggregated(cluster):
    body = {"prompt": "Once upon", "max_tokens": 10, "temperature": 0.9, "seed": 7}
    a = httpx.post(f"{cluster.url('router')}/v1/completions", json=body, timeout=120).json()
    b = httpx.post(f"{cluster.url('colocated')}/v1/completions", json=body, timeout=120).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_chat_with_verified_kv(cluster):
    r = chat(cluster.url("router"), "hello", kvtransfer={"verify": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["kvtransfer"]["verified"] is True and out["kvtransfer"]["layers"] == 3
    assert out["choices"][0]["message"]["content"] == chat(cluster.url("colocated"), "hello").json()[
        "choices"][0]["message"]["content"]


def test_streaming_chat_through_the_router(cluster):
    body = {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster.url('router')}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] is None  # [DONE]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = chat(cluster.url("colocated"), "stream me", max_tokens=6).json()["choices"][0]["message"]["content"]
    assert text == whole
    usage = events[-2]  # include_usage: one last chunk, with no choices, before [DONE]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert [e for e in events[:-1] if e.get("usage")] == [usage]
    figures = [e["kvtransfer"] for e in events[:-1] if "kvtransfer" in e]
    assert len(figures) == 1 and "kvtransfer" in chunks[-1]  # on the last choice chunk
    assert figures[0]["prefill"]["compute_s"] > 0 and figures[0]["kv_bytes"] > 0
    assert figures[0]["decode_node"] == cluster.url("decode")
    assert r.headers["x-kvtransfer-prefill-node"] == cluster.url("prefill")


def test_stop_strings_cut_the_text(cluster):
    base = {"prompt": "abc", "max_tokens": 16, "temperature": 0}
    full = httpx.post(f"{cluster.url('router')}/v1/completions", json=base, timeout=120).json()["choices"][0]["text"]
    stop = full[3:5]
    assert stop and stop not in full[:3]
    cut = httpx.post(f"{cluster.url('router')}/v1/completions", json={**base, "stop": [stop]}, timeout=120).json()
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param, code, words", [
    (b"{not json", None, "invalid_json", "not valid JSON"),
    (b"[1, 2]", None, "invalid_json", "must be a JSON object"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "invalid_value", "greater than or equal to 1"),
    (b'{"prompt": "x", "temperature": 5}', "temperature", "invalid_value", "less than or equal to 2"),
    (b'{"prompt": "x", "max_tokens": 100000}', "max_tokens", "context_length_exceeded", "does not fit"),
    (b'{"max_tokens": 3}', "prompt", "missing_required_parameter", "prompt"),
    (b'{"prompt": "x", "kvtransfer": {"rid": "mine"}}', "kvtransfer", "invalid_request", 'only {"verify": bool, "layerwise": bool}'),
    (b'{"prompt": "x", "kvtransfer": {"layerwise": "yes"}}', "kvtransfer", "invalid_request", '"layerwise": bool'),
])
def test_bad_requests_are_json_errors(cluster, body, param, code, words):
    r = httpx.post(f"{cluster.url('router')}/v1/completions", content=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and "http://" not in err["message"]
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": param, "code": code}


def test_nodes_refuse_what_is_not_theirs(cluster):
    r = chat(cluster.url("decode"), "hi")
    assert r.status_code == 400 and "router" in r.json()["error"]["message"]
    r = chat(cluster.url("colocated"), "hi", kvtransfer={"rid": "x"})
    assert r.status_code == 400 and "colocated" in r.json()["error"]["message"]


def test_health_info_and_models(cluster):
    assert httpx.get(f"{cluster.url('router')}/health").json()["nodes_up"] == {"prefill": 1, "decode": 1}
    info = httpx.get(f"{cluster.url('prefill')}/info").json()
    assert info["role"] == "prefill" and info["tp"] == 2 and info["bootstrap"].endswith(str(cluster.ports["bootstrap"]))
    assert len(info["ranks"]) == 2
    assert httpx.get(f"{cluster.url('router')}/v1/models").json()["data"][0]["id"] == "mla-tiny"


def test_an_idle_connection_outlives_the_old_five_second_keep_alive(cluster):
    """The servers keep an idle connection longer than our clients do (kvtransfer.serve.http):
    after 6 s idle (past uvicorn's and httpx's equal 5 s defaults, whose race fails a request
    with a bare ReadError) the router still holds it and our client sends on the same one."""
    def port(resp) -> int:
        return resp.extensions["network_stream"].get_extra_info("client_addr")[1]

    with httpx.Client(limits=client_limits()) as client:
        first = client.get(f"{cluster.url('router')}/health")
        before = port(first)
        time.sleep(6.0)
        second = client.get(f"{cluster.url('router')}/health")
        after = port(second)
    assert first.status_code == second.status_code == 200
    assert before == after, "the connection was closed while idle"
    assert SERVER_KEEP_ALIVE_S > CLIENT_KEEPALIVE_EXPIRY_S


def test_metrics_count_what_was_sent(cluster):
    router0, decode0 = _metrics(cluster.url("router")), _metrics(cluster.url("decode"))
    prefill0 = _metrics(cluster.url("prefill"))
    outs = [httpx.post(f"{cluster.url('router')}/v1/completions", json={"prompt": f"count {i}", "max_tokens": 4,
                                                                        "temperature": 0}, timeout=120).json()
            for i in range(3)]
    router1, decode1 = _metrics(cluster.url("router")), _metrics(cluster.url("decode"))
    prefill1 = _metrics(cluster.url("prefill"))

    def delta(before, after, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta(router0, router1, "kvtransfer_router_requests_total", outcome="ok") == 3
    moved = sum(o["kvtransfer"]["kv_bytes"] for o in outs)
    assert delta(router0, router1, "kvtransfer_router_kv_bytes_total") == moved
    assert delta(decode0, decode1, "kvtransfer_kv_bytes_total") == moved
    assert delta(decode0, decode1, "kvtransfer_requests_total", outcome="ok") == 3
    assert delta(decode0, decode1, "kvtransfer_generated_tokens_total") == sum(
        o["usage"]["completion_tokens"] for o in outs)  # the first one sampled by prefill, reported by decode
    assert delta(prefill0, prefill1, "kvtransfer_transfer_seconds_count") == 3
    assert delta(decode0, decode1, "kvtransfer_prompt_tokens_total") == sum(o["usage"]["prompt_tokens"] for o in outs)
    assert decode1[("kvtransfer_slots_in_use", ())] == 0
    assert decode1[("kvtransfer_slots_total", ())] > 0
