"""``kvtransfer router``: the OpenAI API in front of prefill and decode nodes.

    kvtransfer router --prefill http://127.0.0.1:30001 --decode http://127.0.0.1:30002 --port 30000

Each request is paired with a prefill node and a decode node (round robin over the nodes that
answer; ``--prefill`` and ``--decode`` may be given several times) and sent to both with the
same ``kvtransfer`` pairing: a request id, the prefill node's bootstrap address, and, with
``--verify-kv`` or ``"kvtransfer": {"verify": true}`` in the request, a check that the KV the
decode node received equals, layer by layer, what prefill computed. Prefill computes the prompt
and sends its KV to decode through the control plane; decode streams the completion, which the
router passes on (``stream``: server-sent events) with the transfer's figures in a
``kvtransfer`` object.

Failures: a node that fails or dies ends its requests with an HTTP error naming it (502), the
decode side's request is cancelled when prefill fails; a node whose queue is full answers 503
with ``Retry-After`` at once, and the router passes that on (cancelling the other half). Every
node's ``/health`` is asked every ``--health-interval`` s: one that fails or does not answer is
skipped until it answers ``/info`` as ready again, so a restarted node is used again without
restarting anything else; the router's ``/health`` lists the nodes and which are up. A client
that disconnects has both halves cancelled at once (the nodes abort the request), counted as
``aborted``. At start every node must answer
``/info`` within ``--startup-timeout`` s with the right role and one model, else the router
says which did not, in one line, and exits with status 2.
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
from typing import List, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtransfer.serve.http import (ClientGone, UsageError, add_metrics_and_models, client_gone, client_limits,
                                   http_server, port_socket, unless_gone)
from kvtransfer.serve.metrics import RouterMetrics
from kvtransfer.serve.openai_api import error_body, sse

log = logging.getLogger("kvtransfer.serve.router")

NODE_TIMEOUT_S = 600.0  # one request's longest answer from a node
HEALTH_TIMEOUT_S = 10.0  # a node whose /health takes longer is taken for down (a starved machine is slow)


class RouterError(RuntimeError):
    """A node is missing or wrong at start (one line, exit 2)."""


@dataclass
class NodeRef:
    url: str
    role: str
    up: bool = False
    model: str = ""
    bootstrap: Optional[str] = None
    why_down: str = ""
    info: dict = field(default_factory=dict)


class _NodeFailed(Exception):
    def __init__(self, status: int, message: str, retry_after: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    @property
    def outcome(self) -> str:
        """The metrics' outcome of a request that ended so."""
        return "busy" if self.retry_after else "client_error" if self.status < 500 else "failed"

    @property
    def headers(self) -> Optional[dict]:
        return {"Retry-After": self.retry_after} if self.retry_after else None


def _node_error(node: NodeRef, resp_status: int, body: bytes, retry_after: Optional[str] = None) -> _NodeFailed:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace") or f"HTTP {resp_status}"
    if retry_after is not None and resp_status in (429, 503):  # busy: the client may try again
        return _NodeFailed(resp_status, f"{node.role} node {node.url}: {message}", retry_after)
    status = resp_status if resp_status < 500 else 502
    return _NodeFailed(status, f"{node.role} node {node.url}: {message}")


def _lost(node: NodeRef, exc: Exception) -> _NodeFailed:
    node.up, node.why_down = False, f"{type(exc).__name__}: {exc}"
    return _NodeFailed(502, f"{node.role} node {node.url} is unreachable or died during the request "
                            f"({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})")


class Router:
    """The router's nodes, its HTTP client and its round robin (module docstring)."""

    def __init__(self, prefill: List[str], decode: List[str], verify: bool = False,
                 health_interval_s: float = 1.0):
        self.prefill = [NodeRef(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [NodeRef(u.rstrip("/"), "decode") for u in decode]
        self.verify = verify
        self.health_interval_s = health_interval_s
        self.metrics = RouterMetrics()
        self.model = ""
        self.client: Optional[httpx.AsyncClient] = None
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}
        self._watch: Optional[asyncio.Task] = None
        self._tasks: set = set()  # background connects

    @property
    def nodes(self) -> List[NodeRef]:
        return self.prefill + self.decode

    # -- nodes ---------------------------------------------------------------------------
    async def _probe(self, node: NodeRef) -> None:
        """Read the node's /info; raises on no answer, a wrong role or a node not ready."""
        resp = await self.client.get(f"{node.url}/info", timeout=5.0)
        resp.raise_for_status()
        info = resp.json()
        if info.get("role") != node.role:
            raise RouterError(f"{node.url} is a {info.get('role')} node, given as --{node.role}")
        if info.get("state") != "ready":
            raise ConnectionError(f"{node.url} is {info.get('state')}")
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

    async def start(self, timeout_s: float) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(NODE_TIMEOUT_S, connect=5.0),
                                        limits=client_limits(max_connections=1024, max_keepalive_connections=64))
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while True:
                try:
                    await self._probe(node)
                    break
                except RouterError:
                    raise
                except (httpx.HTTPError, ConnectionError, ValueError, KeyError) as exc:
                    if time.monotonic() >= deadline:
                        raise RouterError(f"{node.role} node {node.url} did not answer /info as ready within "
                                          f"{timeout_s:g} s ({type(exc).__name__}: {exc})") from None
                    await asyncio.sleep(0.25)
        models = {n.model for n in self.nodes}
        if len(models) != 1:
            raise RouterError(f"the nodes serve different models: "
                              f"{', '.join(f'{n.url}={n.model}' for n in self.nodes)}")
        self.model = models.pop()
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
                resp = await self.client.get(f"{node.url}/health", timeout=HEALTH_TIMEOUT_S)
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
        why = "; ".join(f"{n.url}: {n.why_down}" for n in nodes)
        raise _NodeFailed(503, f"no {role} node is answering ({why})")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for task in self._tasks:
            task.cancel()
        if self.client is not None:
            await self.client.aclose()

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
    """Where prefill's share of the time to first token went (seconds)."""
    return {k: pre.get(k) for k in ("queue_s", "compute_s", "decode_wait_s", "transfer_s")}


def _check_digests(prefill: Optional[dict], decode: Optional[dict]) -> dict:
    """The verification result; raises _NodeFailed when the KV differs."""
    if not prefill or not decode:
        raise _NodeFailed(502, "KV verification asked for, but a node sent no digests")
    differ = sorted(k for k in set(prefill) | set(decode) if prefill.get(k) != decode.get(k))
    if differ:
        raise _NodeFailed(500, f"the KV decode received differs from what prefill computed in "
                               f"{len(differ)} of {len(prefill)} layers: {', '.join(differ[:8])}")
    return {"verified": True, "layers": len(prefill)}


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvtransfer router", docs_url=None, redoc_url=None)

    def error(message: str, status: int, outcome: str, headers: Optional[dict] = None):
        router.metrics.requests.labels(outcome).inc()
        return JSONResponse(error_body(message, status), status_code=status, headers=headers)

    @app.get("/health")
    async def health():
        up = {role: sum(n.up for n in nodes) for role, nodes in (("prefill", router.prefill), ("decode", router.decode))}
        ok = up["prefill"] > 0 and up["decode"] > 0
        return JSONResponse({"status": "ready" if ok else "degraded", "nodes_up": up,
                             "nodes": [{"url": n.url, "role": n.role, "up": n.up, "why_down": n.why_down}
                                       for n in router.nodes]}, status_code=200 if ok else 503)

    add_metrics_and_models(app, router.metrics, lambda: router.model)

    async def route(request: Request, path: str):
        try:
            return await _route(request, path)
        except Exception:  # a bug answered 500 by the server: counted all the same
            router.metrics.requests.labels("failed").inc()
            raise

    async def _route(request: Request, path: str):
        start = time.monotonic()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(f"the body is not valid JSON: {exc}", 400, "client_error")
        if not isinstance(body, dict):
            return error(f"the body must be a JSON object, got {type(body).__name__}", 400, "client_error")
        ext = body.pop("kvtransfer", None)
        if ext is not None and (not isinstance(ext, dict) or set(ext) - {"verify"}):
            return error('kvtransfer: only {"verify": bool} may be given to the router', 400, "client_error")
        verify = router.verify or bool((ext or {}).get("verify"))
        if body.get("seed") is None:  # prefill samples the first token, decode the rest: one seed for both
            body["seed"] = random.getrandbits(63)
        try:
            p, d = router.pick("prefill"), router.pick("decode")
        except _NodeFailed as f:
            return error(f.message, f.status, "failed",
                         {"Retry-After": str(max(1, round(router.health_interval_s)))})
        rid = uuid.uuid4().hex
        router.metrics.routed.labels(p.url).inc()
        router.metrics.routed.labels(d.url).inc()
        p_body = {**body, "stream": False, "kvtransfer": {"rid": rid, "verify": verify}}
        d_body = {**body, "kvtransfer": {"rid": rid, "bootstrap": p.bootstrap, "verify": verify}}
        prefill = asyncio.ensure_future(router.prefill_part(p, path, p_body))
        if body.get("stream"):
            return await _stream(router, request, path, d, d_body, prefill, verify, start)
        decode = asyncio.ensure_future(router.post(d, path, d_body))
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
            return error(f.message, f.status, f.outcome, f.headers)
        except ClientGone:  # _both cancelled both halves: each node aborts the request
            router.metrics.requests.labels("aborted").inc()
            return Response(status_code=499)
        finally:
            gone.cancel()
        router.metrics.requests.labels("ok").inc()
        router.metrics.kv_bytes.inc(extra.get("kv_bytes", 0))
        router.metrics.transfer_seconds.observe(extra.get("transfer_s", 0.0))
        router.metrics.request_seconds.observe(time.monotonic() - start)
        return out

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


async def _stream(router: Router, request: Request, path: str, node: NodeRef, body: dict,
                  prefill: asyncio.Future, verify: bool, start: float):
    """Open decode's event stream; answer with its status once its first event (or prefill's
    failure) is known, then pass the events on."""
    ctx = router.client.stream("POST", f"{node.url}{path}", json=body)
    opening = asyncio.ensure_future(ctx.__aenter__())
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
        return JSONResponse(error_body(exc.message, exc.status), status_code=exc.status, headers=exc.headers)

    async def events():
        outcome, extra, last = "failed", {}, {}
        try:
            lines = resp.aiter_lines()
            while True:
                line = await unless_gone(_next_line(lines, prefill), gone)
                if line is None:
                    break
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data != "[DONE]":
                    chunk = last = json.loads(data)
                    if "error" in chunk:
                        yield sse(chunk)
                        yield sse("[DONE]")
                        return
                    if "kvtransfer" in chunk:
                        extra = chunk["kvtransfer"]
                        if verify:
                            extra.update(_check_digests((await prefill).get("digests"), extra.get("digests")))
                        extra.pop("digests", None)
                        extra.update(prefill_node=prefill_url, decode_node=node.url)
                        chunk["kvtransfer"] = extra
                    yield sse(chunk)
                    continue
                pre = await prefill  # a prefill failure after decode finished still counts
                yield sse({**{k: last.get(k) for k in ("id", "object", "created", "model")}, "choices": [],
                           "kvtransfer": {"transfer_s": pre.get("transfer_s"), "prefill": _prefill_figures(pre)}})
                yield sse("[DONE]")
                outcome = "ok"
                router.metrics.kv_bytes.inc(extra.get("kv_bytes", 0))
                router.metrics.transfer_seconds.observe(pre.get("transfer_s") or 0.0)
                return
            raise _NodeFailed(502, f"decode node {node.url} closed the stream before [DONE]")
        except _NodeFailed as f:
            yield sse(error_body(f.message, f.status))
            yield sse("[DONE]")
        except httpx.HTTPError as exc:
            f = _lost(node, exc)
            yield sse(error_body(f.message, f.status))
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

    prefill_url = router.prefill[0].url
    for p in router.prefill:
        if p.bootstrap == body["kvtransfer"]["bootstrap"]:
            prefill_url = p.url
    return StreamingResponse(events(), media_type="text/event-stream")


async def _next_line(lines, prefill: asyncio.Future):
    """The next line of decode's stream; raises prefill's failure if it comes first."""
    task = asyncio.ensure_future(lines.__anext__())
    watch = {task} if prefill.done() else {task, prefill}
    try:
        done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client left: the read goes too
        task.cancel()
        raise
    if task not in done:
        if prefill.exception() is not None:
            task.cancel()
            raise prefill.exception()
        await asyncio.wait({task})
    try:
        return task.result()
    except StopAsyncIteration:
        return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtransfer router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill node's URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode node's URL (repeatable)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--verify-kv", action="store_true", help="check every request's KV layer by layer")
    ap.add_argument("--startup-timeout", type=float, default=60.0, help="seconds the nodes may take to answer")
    ap.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks of a down node")
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
    router = Router(args.prefill, args.decode, args.verify_kv, args.health_interval)
    failure: List[str] = []

    async def startup():
        try:
            await router.start(args.startup_timeout)
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
