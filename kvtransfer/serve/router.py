"""``kvtransfer router``: the OpenAI API in front of prefill and decode nodes.

    kvtransfer router --prefill http://127.0.0.1:30001 --decode http://127.0.0.1:30002 --port 30000

Each request is paired with a prefill node and a decode node (round robin over the nodes that
answer; ``--prefill`` and ``--decode`` may be given several times) and sent to both with the
same ``kvtransfer`` pairing: a request id, the prefill node's bootstrap address, and, with
``--verify-kv`` or ``"kvtransfer": {"verify": true}`` in the request, a check that the KV the
decode node received equals, layer by layer, what prefill computed; ``"layerwise": false`` has
a prefill node started with ``--layerwise`` send this request's KV after the prompt instead of
layer by layer. Prefill computes the prompt
and sends its KV to decode through the control plane; decode streams the completion, which the
router passes on (``stream``: server-sent events) with the transfer's figures in a
``kvtransfer`` object.

Responses are OpenAI's (:mod:`kvtransfer.serve.openai_api`); the router checks a request
before it sends it on (a bad one is a 400 naming the field, a model no node serves a 404) and
adds the transfer's figures where OpenAI clients ignore them: a ``kvtransfer`` object on the
response or on the stream's last choice chunk, and ``x-kvtransfer-*`` headers (the request id
and the two nodes). ``GET /info`` says what the router serves and which nodes are up.

Failures: a node that fails or dies ends its requests with an HTTP error (502) whose ``node``
field names it, the decode side's request is cancelled when prefill fails; a node whose queue is
full answers 503 with ``Retry-After`` at once, and the router passes that on (cancelling the
other half). Every node's ``/health`` is asked every ``--health-interval`` s: one that fails or
does not answer is skipped until it answers ``/info`` as ready again, so a restarted node is used
again without restarting anything else; the router's ``/health`` lists the nodes and which are
up. A client that disconnects has both halves cancelled at once (the nodes abort the request),
counted as ``aborted``.

Start: the router serves at once with the nodes that answer ``/info`` as ready, logs each one
that does not, and adds it when it comes up. A node of the wrong role, or nodes that serve
different models, are a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtransfer._args import HelpFormatter, description, positive_int
from kvtransfer.serve.http import (DEFAULT_MAX_BODY_BYTES, ClientGone, UsageError, add_error_handlers,
                                   add_metrics_and_models, client_gone, client_limits, http_server, port_socket,
                                   read_body, unless_gone)
from kvtransfer.serve.metrics import RouterMetrics
from kvtransfer.serve.openai_api import ApiError, check_model, load_body, sse, validate

log = logging.getLogger("kvtransfer.serve.router")

NODE_TIMEOUT_S = 600.0  # one request's longest answer from a node
CLIENT_EXTENSION = ("verify", "layerwise")  # what a client may set in a request's "kvtransfer" object
HEALTH_TIMEOUT_S = 10.0  # a node whose /health takes longer is taken for down (a starved machine is slow)


class RouterError(RuntimeError):
    """A node is wrong at start: its role, or a model other than the other nodes' (one line, exit 2)."""


@dataclass
class NodeRef:
    url: str
    role: str
    up: bool = False
    model: str = ""
    bootstrap: Optional[str] = None
    why_down: str = ""
    info: dict = field(default_factory=dict)


class _NodeFailed(ApiError):
    """A request a node refused (its status, message, param and code passed on), found busy
    (429/503 with ``Retry-After``, passed on) or failed (502, the node named in the ``node``
    field, never in the message)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[str] = None, **extra):
        super().__init__(status, message, param, code, **extra)
        self.retry_after = retry_after

    @property
    def outcome(self) -> str:
        """The metrics' outcome of a request that ended so."""
        return "busy" if self.retry_after else "client_error" if self.status < 500 else "failed"

    @property
    def headers(self) -> Optional[dict]:
        return {"Retry-After": self.retry_after} if self.retry_after else None


def _node_error(node: NodeRef, resp_status: int, body: bytes, retry_after: Optional[str] = None) -> _NodeFailed:
    try:
        err = json.loads(body)["error"]
        message, param, code = str(err["message"]), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError):
        message, param, code = body[:200].decode(errors="replace") or f"HTTP {resp_status}", None, None
    if retry_after is not None and resp_status in (429, 503):  # busy: the client may try again
        return _NodeFailed(resp_status, f"the {node.role} node is busy: {message}", code="server_busy",
                           retry_after=retry_after, node=node.url)
    if resp_status < 500:
        return _NodeFailed(resp_status, message, param, code if isinstance(code, str) else None)
    return _NodeFailed(502, f"the {node.role} node failed: {message}", code="node_failed", node=node.url)


def _lost(node: NodeRef, exc: Exception) -> _NodeFailed:
    node.up, node.why_down = False, f"{type(exc).__name__}: {exc}"
    return _NodeFailed(502, f"the {node.role} node is unreachable or died during the request "
                            f"({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})", code="node_lost",
                       node=node.url)


def _retrieve(task: asyncio.Future) -> None:
    """Marks a task's failure as seen: a request whose prefill and decode both fail answers
    with the first failure, and asyncio would log the other as never retrieved."""
    if not task.cancelled():
        task.exception()


class Router:
    """The router's nodes, its HTTP client and its round robin (module docstring)."""

    def __init__(self, prefill: List[str], decode: List[str], verify: bool = False,
                 health_interval_s: float = 1.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.prefill = [NodeRef(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [NodeRef(u.rstrip("/"), "decode") for u in decode]
        self.verify = verify
        self.health_interval_s = health_interval_s
        self.max_body_bytes = max_body_bytes
        self.metrics = RouterMetrics()
        self.model = ""  # the served model, from the first node that answers
        self.model_names: tuple = ()  # its name and aliases, as a request's "model" may give them
        self.client: Optional[httpx.AsyncClient] = None  # requests to the nodes
        self.health_client: Optional[httpx.AsyncClient] = None  # /info and /health (start)
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}
        self._watch: Optional[asyncio.Task] = None
        self._tasks: set = set()  # background connects

    @property
    def nodes(self) -> List[NodeRef]:
        return self.prefill + self.decode

    # -- nodes ---------------------------------------------------------------------------
    async def _probe(self, node: NodeRef) -> None:
        """Read the node's /info; raises on no answer, a wrong role or a node not ready."""
        resp = await self.health_client.get(f"{node.url}/info", timeout=5.0)
        resp.raise_for_status()
        info = resp.json()
        if info.get("role") != node.role:
            raise RouterError(f"{node.url} is a {info.get('role')} node, given as --{node.role}")
        if info.get("state") != "ready":
            raise ConnectionError(f"{node.url} is {info.get('state')}")
        if self.model and info["model"] != self.model:
            raise RouterError(f"{node.url} serves {info['model']}, the other nodes {self.model}")
        self.model = self.model or info["model"]
        self.model_names = self.model_names or tuple(info.get("model_names") or (self.model,))
        node.info, node.model, node.bootstrap = info, info["model"], info.get("bootstrap")
        node.up, node.why_down = True, ""
        if node.role == "prefill":  # decode nodes connect now, not on this node's first request
            for d in self.decode:
                if d.up:
                    self._connect_later(d, node)
        else:
            for p in self.prefill:
                if p.up and p.bootstrap:
                    self._connect_later(node, p)

    def _connect_later(self, decode: NodeRef, prefill: NodeRef) -> None:
        async def connect():
            try:
                resp = await self.client.post(f"{decode.url}/kvtransfer/connect", json={"bootstrap": prefill.bootstrap},
                                              timeout=120.0)
                if resp.status_code != 200:
                    log.warning("decode node %s could not connect to prefill node %s: %s", decode.url, prefill.url,
                                resp.text[:200])
            except httpx.HTTPError as exc:
                log.warning("decode node %s: connect to %s: %s", decode.url, prefill.url, exc)
        self._tasks.add(task := asyncio.ensure_future(connect()))
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Ask every node's /info once, at the same time; serve with those that answer as ready
        and log each that does not (the watch adds it once it answers). RouterError for a node
        of the wrong role or nodes of different models."""
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(NODE_TIMEOUT_S, connect=5.0),
                                        limits=client_limits(max_connections=1024, max_keepalive_connections=64))
        # /info and /health go through a client of their own: one connection per node, kept
        # alive by the checks, so a check never waits for, takes or opens a request's connection
        n = len(self.nodes)
        self.health_client = httpx.AsyncClient(timeout=httpx.Timeout(HEALTH_TIMEOUT_S, connect=5.0),
                                               limits=client_limits(max_connections=n, max_keepalive_connections=n))
        answers = await asyncio.gather(*(self._probe(n) for n in self.nodes), return_exceptions=True)
        for node, answer in zip(self.nodes, answers):
            if isinstance(answer, RouterError):
                raise answer
            if isinstance(answer, BaseException):
                node.why_down = f"{type(answer).__name__}: {answer}"
                log.warning("%s node %s is not ready (%s); it gets requests once it is", node.role, node.url,
                            node.why_down)
        up = [f"{n.role} node {n.url}" for n in self.nodes if n.up]
        if up:
            log.info("serving %s with %s", self.model, ", ".join(up))
        else:
            log.info("no node is ready yet: serving once a prefill and a decode node are")
        self._update_gauges()
        self._watch = asyncio.ensure_future(self._watch_nodes())

    async def _watch_nodes(self) -> None:
        """Every period, every node is checked at once: one that is up must answer /health with
        200 (else it is taken down), one that is down gets its /info asked again (a restarted
        node comes back)."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(node) for node in self.nodes))
            self._update_gauges()

    async def _check(self, node: NodeRef) -> None:
        if node.up:
            try:
                resp = await self.health_client.get(f"{node.url}/health")  # the client's HEALTH_TIMEOUT_S
                if resp.status_code == 200:
                    return
                why = f"/health answered {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                why = f"/health: {type(exc).__name__}: {exc}"
            node.up, node.why_down = False, why
            log.warning("%s node %s is down (%s)", node.role, node.url, why)
            return
        try:
            await self._probe(node)
            log.info("%s node %s is back", node.role, node.url)
        except Exception as exc:  # noqa: BLE001 - still down, keep the reason
            node.why_down = f"{type(exc).__name__}: {exc}"

    def _update_gauges(self) -> None:
        for role, nodes in (("prefill", self.prefill), ("decode", self.decode)):
            self.metrics.nodes_up.labels(role).set(sum(n.up for n in nodes))

    def pick(self, role: str) -> NodeRef:
        nodes = self.prefill if role == "prefill" else self.decode
        for _ in range(len(nodes)):
            node = nodes[next(self._turn[role]) % len(nodes)]
            if node.up:
                return node
        raise _NodeFailed(503, f"no {role} node is answering", code="no_node_available",
                          nodes={n.url: n.why_down for n in nodes})

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for task in self._tasks:
            task.cancel()
        for client in (self.client, self.health_client):
            if client is not None:
                await client.aclose()

    # -- one request ---------------------------------------------------------------------
    async def post(self, node: NodeRef, path: str, body: dict) -> dict:
        """A node's JSON answer; _NodeFailed naming the node when it fails or cannot be reached."""
        try:
            resp = await self.client.post(f"{node.url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise _lost(node, exc) from None
        if resp.status_code != 200:
            raise _node_error(node, resp.status_code, resp.content, resp.headers.get("retry-after"))
        return resp.json()

    async def prefill_part(self, node: NodeRef, path: str, body: dict) -> dict:
        return (await self.post(node, path, body))["kvtransfer"]


def _prefill_figures(pre: dict) -> dict:
    """Where prefill's share of the time to first token went (seconds), and when (its host's
    monotonic clock) the first token was sampled and the post of the last writes began."""
    return {k: pre.get(k) for k in ("queue_s", "compute_s", "decode_wait_s", "transfer_s", "sampled_at", "posted_at")}


def _check_digests(prefill: Optional[dict], decode: Optional[dict]) -> dict:
    """The verification result; raises _NodeFailed when the KV differs."""
    if not prefill or not decode:
        raise _NodeFailed(502, "KV verification asked for, but a node sent no digests", code="verification_failed")
    differ = sorted(k for k in set(prefill) | set(decode) if prefill.get(k) != decode.get(k))
    if differ:
        raise _NodeFailed(500, f"the KV decode received differs from what prefill computed in "
                               f"{len(differ)} of {len(prefill)} layers: {', '.join(differ[:8])}",
                          code="verification_failed")
    return {"verified": True, "layers": len(prefill)}


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvtransfer router", docs_url=None, redoc_url=None)
    add_error_handlers(app)

    def error(exc: ApiError, outcome: str, headers: Optional[dict] = None):
        router.metrics.requests.labels(outcome).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health():
        up = {role: sum(n.up for n in nodes) for role, nodes in (("prefill", router.prefill), ("decode", router.decode))}
        ok = up["prefill"] > 0 and up["decode"] > 0
        return JSONResponse({"status": "ready" if ok else "degraded", "nodes_up": up,
                             "nodes": [{"url": n.url, "role": n.role, "up": n.up, "why_down": n.why_down}
                                       for n in router.nodes]}, status_code=200 if ok else 503)

    add_metrics_and_models(app, router.metrics, lambda: [router.model] if router.model else [])

    @app.get("/info")
    async def info():
        return {"role": "router", "pid": os.getpid(), "model": router.model, "model_names": router.model_names,
                "verify_kv": router.verify, "max_body_bytes": router.max_body_bytes,
                "nodes": [{"url": n.url, "role": n.role, "up": n.up, "why_down": n.why_down,
                           **{k: n.info.get(k) for k in ("tp", "page_size", "dtype", "device")}}
                          for n in router.nodes]}

    async def route(request: Request, path: str):
        try:
            return await _route(request, path)
        except Exception:  # a bug answered 500 by the server: counted all the same
            router.metrics.requests.labels("failed").inc()
            raise

    async def _route(request: Request, path: str):
        start = time.monotonic()
        try:  # the request is checked here, once, before either node sees it
            body = load_body(await read_body(request, router.max_body_bytes))
            ext = body.pop("kvtransfer", None)
            if ext is not None and (not isinstance(ext, dict) or set(ext) - set(CLIENT_EXTENSION)
                                    or not all(isinstance(v, bool) for v in ext.values())):
                raise ApiError(400, 'kvtransfer: only {"verify": bool, "layerwise": bool} may be given to the router',
                               "kvtransfer")
            req = validate("chat" if path.endswith("chat/completions") else "completion", body)
            if router.model_names:
                check_model(req, router.model_names)
        except ApiError as exc:
            return error(exc, "client_error")
        verify = router.verify or bool((ext or {}).get("verify"))
        if body.get("seed") is None:  # prefill samples the first token, decode the rest: one seed for both
            body["seed"] = random.getrandbits(63)
        try:
            p, d = router.pick("prefill"), router.pick("decode")
        except _NodeFailed as f:
            f.retry_after = str(max(1, round(router.health_interval_s)))
            return error(f, "failed", f.headers)
        rid = uuid.uuid4().hex
        router.metrics.routed.labels(p.url).inc()
        router.metrics.routed.labels(d.url).inc()
        layerwise = {"layerwise": ext["layerwise"]} if ext and "layerwise" in ext else {}
        p_body = {**body, "stream": False, "kvtransfer": {"rid": rid, "verify": verify, **layerwise}}
        d_body = {**body, "kvtransfer": {"rid": rid, "bootstrap": p.bootstrap, "verify": verify}}
        headers = {"x-kvtransfer-rid": rid, "x-kvtransfer-prefill-node": p.url, "x-kvtransfer-decode-node": d.url}
        # decode's half goes out first: prefill computes nothing before decode has reserved pages
        ctx = router.client.stream("POST", f"{d.url}{path}", json=d_body) if req.stream else None
        decode = asyncio.ensure_future(ctx.__aenter__() if ctx is not None else router.post(d, path, d_body))
        prefill = asyncio.ensure_future(router.prefill_part(p, path, p_body))
        prefill.add_done_callback(_retrieve)
        if req.stream:
            return await _stream(router, request, d, ctx, decode, prefill, verify, start, headers)
        decode.add_done_callback(_retrieve)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            out = await unless_gone(_both(prefill, decode), gone)
            extra = out.get("kvtransfer") or {}
            pre = prefill.result()
            if verify:
                extra.update(_check_digests(pre.get("digests"), extra.get("digests")))
            extra.pop("digests", None)
            extra.update(prefill_node=p.url, decode_node=d.url, transfer_s=pre.get("transfer_s"),
                         prefill=_prefill_figures(pre))
            out["kvtransfer"] = extra
        except _NodeFailed as f:
            return error(f, f.outcome, f.headers)
        except ClientGone:  # _both cancelled both halves: each node aborts the request
            router.metrics.requests.labels("aborted").inc()
            return Response(status_code=499)
        finally:
            gone.cancel()
        router.metrics.requests.labels("ok").inc()
        router.metrics.kv_bytes.inc(extra.get("kv_bytes", 0))
        router.metrics.transfer_seconds.observe(extra.get("transfer_s", 0.0))
        router.metrics.request_seconds.observe(time.monotonic() - start)
        return JSONResponse(out, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(request, "/v1/chat/completions")

    return app


async def _both(prefill: asyncio.Future, decode: asyncio.Future) -> dict:
    """Decode's answer once prefill has answered too; the first failure of either wins (and
    cancels the other, which ends the request on that node)."""
    pending = {prefill, decode}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the node's failure
        return decode.result()
    finally:
        for task in pending:
            task.cancel()


async def _stream(router: Router, request: Request, node: NodeRef, ctx, opening: asyncio.Future,
                  prefill: asyncio.Future, verify: bool, start: float, headers: dict):
    """Decode's event stream (``ctx``, being opened by ``opening``): answer with its status once
    its first event (or prefill's failure) is known, then pass the events on."""
    gone = asyncio.ensure_future(client_gone(request))
    try:
        done, _ = await asyncio.wait({opening, prefill, gone}, return_when=asyncio.FIRST_COMPLETED)
        if prefill in done and prefill.exception() is not None:
            raise prefill.exception()
        try:
            resp = await unless_gone(asyncio.shield(opening), gone)
        except httpx.HTTPError as exc:
            raise _lost(node, exc) from None
        if resp.status_code != 200:
            raise _node_error(node, resp.status_code, await resp.aread(), resp.headers.get("retry-after"))
    except (_NodeFailed, ClientGone) as exc:
        opening.cancel()
        prefill.cancel()
        gone.cancel()
        if opening.done() and not opening.cancelled() and opening.exception() is None:
            await ctx.__aexit__(None, None, None)
        if isinstance(exc, ClientGone):  # before decode's first event: both halves cancelled
            router.metrics.requests.labels("aborted").inc()
            return Response(status_code=499)
        router.metrics.requests.labels(exc.outcome).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def events():
        outcome, extra = "failed", {}
        try:
            reads, tail = resp.aiter_text(), ""
            while True:
                text = await _next_read(reads, prefill, gone)
                if text is None:
                    break
                # token events pass on as they came, those of one read in one write: a router
                # behind its decode node catches up by reads, not by events
                datas, tail = _whole_events(tail, text)
                plain = []
                for data in datas:
                    if data != "[DONE]" and '"error"' not in data and '"kvtransfer"' not in data:
                        plain.append(f"data: {data}\n\n")
                        continue
                    if plain:
                        yield "".join(plain).encode()
                        plain = []
                    if data == "[DONE]":
                        pre = await prefill  # a prefill failure after decode finished still counts
                        yield sse("[DONE]")
                        outcome = "ok"
                        router.metrics.kv_bytes.inc(extra.get("kv_bytes", 0))
                        router.metrics.transfer_seconds.observe(pre.get("transfer_s") or 0.0)
                        return
                    chunk = json.loads(data)  # perhaps a failure, or the last chunk's figures
                    if "error" in chunk:
                        yield sse(chunk)
                        yield sse("[DONE]")
                        return
                    if "kvtransfer" in chunk:  # decode's figures, on its last choice chunk: add prefill's
                        pre, extra = await prefill, chunk["kvtransfer"]
                        if verify:
                            extra.update(_check_digests(pre.get("digests"), extra.get("digests")))
                        extra.pop("digests", None)
                        extra.update(prefill_node=prefill_url, decode_node=node.url, transfer_s=pre.get("transfer_s"),
                                     prefill=_prefill_figures(pre))
                    yield sse(chunk)
                if plain:
                    yield "".join(plain).encode()
            raise _NodeFailed(502, "the decode node closed the stream before [DONE]", code="node_failed",
                              node=node.url)
        except _NodeFailed as f:
            yield sse(f.body())
            yield sse("[DONE]")
        except httpx.HTTPError as exc:
            yield sse(_lost(node, exc).body())
            yield sse("[DONE]")
        except BaseException as exc:  # the client left (ClientGone, or the server cancelled the stream)
            outcome = "aborted"
            if not isinstance(exc, ClientGone):
                raise
        finally:
            gone.cancel()
            prefill.cancel()
            await ctx.__aexit__(None, None, None)
            router.metrics.requests.labels(outcome).inc()
            router.metrics.request_seconds.observe(time.monotonic() - start)

    prefill_url = headers["x-kvtransfer-prefill-node"]
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _whole_events(tail: str, text: str) -> Tuple[List[str], str]:
    """The data of the events that ``tail + text`` completes (decode's node writes one ``data:``
    line per event), and the part of the next one that waits for the rest."""
    ready, _, tail = (tail + text).rpartition("\n\n")
    events = ready.split("\n\n") if ready else []
    return [e[len("data: "):] for e in events if e.startswith("data: ")], tail


async def _next_read(reads, prefill: asyncio.Future, gone: asyncio.Future):
    """The next read of decode's stream (None at its end), in one wait that also ends with
    prefill's failure (raised) or the client's leaving (:class:`ClientGone`), whichever comes
    first."""
    task = asyncio.ensure_future(reads.__anext__())
    watch = {task, gone} if prefill.done() else {task, gone, prefill}
    try:
        done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server ended the stream: the read goes too
        task.cancel()
        raise
    if task not in done:
        if gone.done():
            task.cancel()
            raise ClientGone()
        if prefill.exception() is not None:
            task.cancel()
            raise prefill.exception()
        await asyncio.wait({task})
    try:
        return task.result()
    except StopAsyncIteration:
        return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtransfer router", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill node's URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode node's URL (repeatable)")
    ap.add_argument("--port", type=int, required=True, help="HTTP port")
    ap.add_argument("--host", default="127.0.0.1", help="address HTTP binds")
    ap.add_argument("--verify-kv", action="store_true", help="check every request's KV layer by layer")
    ap.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks of a down node")
    ap.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                    help="a request body past this is refused (413)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("KVT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        for url in args.prefill + args.decode:
            if not url.startswith(("http://", "https://")):
                raise UsageError(f"node URL {url!r} must start with http:// or https://")
        sock = port_socket(args.host, args.port, "port")
    except UsageError as exc:
        print(f"kvtransfer router: error: {exc}", file=sys.stderr)
        return 2
    router = Router(args.prefill, args.decode, args.verify_kv, args.health_interval, args.max_body_bytes)
    failure: List[str] = []

    async def startup():
        try:
            await router.start()
        except RouterError as exc:
            failure.append(str(exc))
            server.should_exit = True

    app = build_app(router)
    app.router.on_startup.append(startup)
    app.router.on_shutdown.append(router.close)
    server = http_server(app)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        print(f"kvtransfer router: error: {failure[0]}", file=sys.stderr)
        return 2
    return 0
