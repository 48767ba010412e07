"""Disaggregated serving under load and with clients that leave, through the router, with real
nodes (mla-tiny, byte tokens: a prompt of n bytes is n tokens).

The pools are small: a request fits each node alone, two do not (the premise is checked from the
requests' own token counts). Requests then wait for pages on decode, prefill waits for decode's
destination, and nothing deadlocks, fails or exits. Past ``--max-queue`` a request is refused at
once with 503 and ``Retry-After``. A client that hangs up -- not streaming, or streaming before
or after its first token -- has its request aborted on both nodes: their slots come back (only
once no byte of it can land), and every server counts it as aborted.

Where a test needs a request to be somewhere (waiting, half-way through its tokens) it freezes
the ranks of a node (SIGSTOP) rather than racing them."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest

from kvtransfer.demo import Server
from kvtransfer.serve.http import free_port
from tests._stop import stop
from tests.kvtransfer.serve._cluster import Cluster, idle, metric, ranks_of, wait_ready, wait_until

POOL = 1024  # token slots per node (mla-tiny's context is 1024 too)
MAX_QUEUE = 4
PROMPT = "x" * 600  # 600 tokens: with 8 new ones, one request fits each pool, two do not
NEW_TOKENS = 8
LONG = 1000  # new tokens of the requests that are cancelled half-way (a 10-token prompt)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("mla-tiny", colocated=False,
                node_args=["--pool-tokens", str(POOL), "--max-queue", str(MAX_QUEUE),
                           "--heartbeat-timeout", "120"])  # frozen ranks are paused, not lost
    try:
        yield c
    finally:
        c.stop()


@contextmanager
def frozen(server: Server):
    """The server's rank processes stopped (its HTTP process answers on)."""
    ranks = ranks_of(server)
    for pid in ranks:
        stop(pid)
    try:
        yield
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)


def outcomes(url: str, prefix: str = "kvtransfer_requests_total") -> dict:
    return {o: metric(url, prefix, outcome=o) for o in ("ok", "busy", "failed", "aborted")}


def router_outcomes(c: Cluster) -> dict:
    return outcomes(c.url("router"), "kvtransfer_router_requests_total")


def completion(c: Cluster, **extra) -> httpx.Response:
    body = {"model": c.model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}
    return httpx.post(f"{c.url('router')}/v1/completions", json=body, timeout=300.0)


def raw_request(url: str, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A request sent on a socket of our own, so that the test decides when the client hangs up."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    s = socket.create_connection((parts.hostname, parts.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def both_idle(c: Cluster) -> None:
    for name in ("prefill", "decode"):
        wait_until(lambda: idle(c.url(name)), f"the {name} node holds no slot and queues nothing")


def test_concurrent_requests_that_fit_only_alone_all_complete(cluster):
    """More requests than the pools hold at once, through the official SDK: every one completes
    (each waits for pages instead of holding KV the other side cannot take)."""
    from openai import OpenAI

    c = cluster
    client = OpenAI(base_url=f"{c.url('router')}/v1", api_key="none", max_retries=0, timeout=300.0)
    before = router_outcomes(c)

    def one(i: int):
        return client.completions.create(model=c.model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(MAX_QUEUE) as pool:
        answers = list(pool.map(one, range(MAX_QUEUE)))
    need = answers[0].usage.prompt_tokens + NEW_TOKENS
    assert need <= POOL < 2 * need  # the premise: one fits alone, two do not
    assert all(a.usage.completion_tokens == NEW_TOKENS for a in answers)
    assert all(s.proc.poll() is None for s in c.servers.values())
    both_idle(c)
    after = router_outcomes(c)
    assert after["ok"] - before["ok"] == MAX_QUEUE and after["failed"] == before["failed"]
    assert metric(c.url("decode"), "kvtransfer_queue_seconds_count") >= MAX_QUEUE


def test_past_the_queue_bound_a_request_is_refused_at_once(cluster):
    """With prefill's ranks frozen nothing completes: one request holds decode's pages, MAX_QUEUE
    wait, and the next is answered 503 with Retry-After while they all still wait."""
    c = cluster
    before = router_outcomes(c)
    results: dict = {}
    threads = []
    with frozen(c.servers["prefill"]):
        for i in range(MAX_QUEUE + 1):  # the first is reserved, MAX_QUEUE more wait
            t = threading.Thread(target=lambda i=i: results.update({i: completion(c)}))
            t.start()
            threads.append(t)
            wait_until(lambda: metric(c.url("decode"), "kvtransfer_requests_waiting") == i + 1,
                       f"{i + 1} requests on the decode node")
        refused = [completion(c), completion(c, stream=True)]
        assert not results  # the others still wait: prefill cannot have run
        for r in refused:
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert "--max-queue" in r.json()["error"]["message"]
    for t in threads:
        t.join(300)
    assert [results[i].status_code for i in sorted(results)] == [200] * (MAX_QUEUE + 1)
    both_idle(c)
    after = router_outcomes(c)
    assert after["busy"] - before["busy"] == 2 and after["ok"] - before["ok"] == MAX_QUEUE + 1
    assert metric(c.url("decode"), "kvtransfer_requests_total", outcome="busy") >= 1


def _hang_up_while_decoding(c: Cluster, stream: bool) -> None:
    """A request of LONG new tokens; the client leaves once some tokens were made, with decode's
    ranks frozen meanwhile so that the request cannot finish first."""
    before_router, before_decode = router_outcomes(c), outcomes(c.url("decode"))
    generated = metric(c.url("decode"), "kvtransfer_generated_tokens_total")
    body = {"model": c.model, "prompt": "y" * 10, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    s = raw_request(c.url("router"), body)
    try:
        if stream:  # read up to the first token's chunk
            seen = b""
            while b'"text"' not in seen:
                seen += s.recv(4096)
        else:
            wait_until(lambda: metric(c.url("decode"), "kvtransfer_generated_tokens_total") > generated,
                       "the decode node generating")
        with frozen(c.servers["decode"]):
            s.close()
            wait_until(lambda: router_outcomes(c)["aborted"] > before_router["aborted"], "the router's abort")
            wait_until(lambda: outcomes(c.url("decode"))["aborted"] > before_decode["aborted"],
                       "the decode node's abort")
    finally:
        s.close()
    both_idle(c)
    made = metric(c.url("decode"), "kvtransfer_generated_tokens_total") - generated
    assert 0 < made < LONG  # it ended early: aborted, not run to its length
    after = router_outcomes(c)
    assert after["failed"] == before_router["failed"] and after["ok"] == before_router["ok"]


def test_a_client_that_hangs_up_without_streaming_is_aborted(cluster):
    _hang_up_while_decoding(cluster, stream=False)


def test_a_stream_closed_after_its_first_token_is_aborted(cluster):
    _hang_up_while_decoding(cluster, stream=True)


def test_a_stream_closed_before_its_first_token_is_aborted_on_both_nodes(cluster):
    """Prefill's ranks frozen: decode has reserved pages, prefill has not computed. The client
    leaves: both nodes abort; decode keeps the pages until prefill says nothing can land
    (fenced), then both nodes are idle."""
    c = cluster
    before_router = router_outcomes(c)
    before = {n: outcomes(c.url(n)) for n in ("prefill", "decode")}
    with frozen(c.servers["prefill"]):
        s = raw_request(c.url("router"), {"model": c.model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                          "stream": True})
        wait_until(lambda: metric(c.url("decode"), "kvtransfer_slots_in_use") > 0, "decode's reservation")
        s.close()
        wait_until(lambda: router_outcomes(c)["aborted"] > before_router["aborted"], "the router's abort")
        for n in ("prefill", "decode"):
            wait_until(lambda: outcomes(c.url(n))["aborted"] > before[n]["aborted"], f"the {n} node's abort")
        # no prefill rank has said that nothing of it is in flight: the pages stay fenced
        assert metric(c.url("decode"), "kvtransfer_slots_in_use") > 0
    both_idle(c)
    assert router_outcomes(c)["failed"] == before_router["failed"]
    assert completion(c).status_code == 200  # and the nodes serve on


def test_the_router_takes_down_a_node_whose_health_fails(cluster):
    """No request needed: the periodic /health probe sees the prefill node go, and the router's
    /health says which node is down."""
    c = cluster
    os.killpg(c.servers["prefill"].proc.pid, signal.SIGKILL)
    c.servers["prefill"].proc.wait(30)

    def prefill_down():
        return httpx.get(f"{c.url('router')}/health").json()["nodes_up"]["prefill"] == 0

    wait_until(prefill_down, "the router's /health to show the prefill node down")
    health = httpx.get(f"{c.url('router')}/health")
    assert health.status_code == 503
    nodes = {n["role"]: n for n in health.json()["nodes"]}
    assert nodes["prefill"]["up"] is False and nodes["prefill"]["why_down"]
    assert nodes["decode"]["up"] is True


def test_a_prefill_node_without_a_decode_node_fails_its_request_fast(tmp_path):
    """A paired request sent straight to a prefill node that no decode node is connected to
    fails after --connect-timeout, saying so (not after the transfer timeout)."""
    port, boot = free_port(), free_port()
    node = Server("prefill node", ["serve", "--role", "prefill", "--model", "mla-tiny", "--port", str(port),
                                   "--bootstrap-port", str(boot), "--device", "cpu", "--threads", "1",
                                   "--connect-timeout", "1", "--transfer-timeout", "600"], str(tmp_path), port)
    try:
        wait_ready([node])
        r = httpx.post(f"{node.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                                            "kvtransfer": {"rid": "lonely"}}, timeout=300.0)
        assert r.status_code == 502, r.text
        assert "no decode node is connected to this prefill node" in r.json()["error"]["message"]
        wait_until(lambda: idle(node.url), "the prefill node holds and queues nothing")
    finally:
        node.stop()
