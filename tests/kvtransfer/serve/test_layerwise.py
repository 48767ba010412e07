"""``kvtransfer serve --role prefill --layerwise N``: each prefill chunk's KV leaves every N layers
of its forward, and decode gets what it would have got whole: real nodes, NIXL over loopback. A
request may ask for its KV after the prompt instead (``"kvtransfer": {"layerwise": false}``). A
hybrid model sends its attention layers' KV so, and its Mamba state after the last layer."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.kvtransfer.serve._cluster import Cluster, chat, sse_events

LONG = "Once upon a time, in a kingdom by the sea, there lived a cartographer who drew maps of " * 3


@pytest.fixture(scope="module", params=["mla-tiny", "hybrid-tiny"])
def cluster(request):
    # prefill at TP 2 in chunks of 16 tokens: several prefill steps per prompt, each streaming its
    # layers one by one from both ranks
    c = Cluster(request.param, prefill_tp=2, decode_tp=1, pages=(16, 64), node_args=("--layerwise", "1",
                                                                                      "--chunk-size", "16"))
    yield c
    c.stop()


def _layers(model: str) -> int:
    from kvtransfer.models import registry

    return registry.load_config(registry.parse_name(model)).num_layers


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("prompt", ["Hi", LONG])
def test_completions_equal_the_colocated_node_with_verified_kv(cluster, prompt, layerwise):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0,
            "kvtransfer": {"verify": True, "layerwise": layerwise}}
    a = httpx.post(f"{cluster.url('router')}/v1/completions", json=body, timeout=120)
    assert a.status_code == 200, a.text
    b = httpx.post(f"{cluster.url('colocated')}/v1/completions", json={**body, "kvtransfer": None}, timeout=120)
    out = a.json()
    assert out["kvtransfer"]["verified"] is True and out["kvtransfer"]["layers"] == _layers(cluster.model)
    assert out["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert out["usage"]["prompt_tokens"] > (16 if prompt == LONG else 0)
    # the nodes stamp, on the clock of this host, the first token sampled, the last writes posted
    # and the KV landed on decode
    kv = out["kvtransfer"]
    assert kv["prefill"]["sampled_at"] < kv["prefill"]["posted_at"] < kv["landed_at"] < time.monotonic()


def test_streamed_chat_through_the_router(cluster):
    with httpx.stream("POST", f"{cluster.url('router')}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": LONG}], "max_tokens": 6, "stream": True,
                            "temperature": 0}) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] is None  # [DONE]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text == chat(cluster.url("colocated"), LONG, max_tokens=6).json()["choices"][0]["message"]["content"]
