"""The HTTP app of a node (:func:`build_app`), the same for every role.

``/health``, ``/info``, ``/metrics``, ``/v1/models``, ``/kvtransfer/connect`` and the two
completion endpoints. A completion request (:class:`_Completion`) is parsed and checked,
becomes its role's command for the ranks (:mod:`kvtransfer.serve.roles`), and is answered from
the ranks' events: at once where the role's first answer ends it (prefill), else as one JSON
body or a stream of OpenAI chunks. A client that goes away, at any point, aborts its request
on the ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtransfer.serve.http import ClientGone, add_error_handlers, add_metrics_and_models, client_gone, read_body
from kvtransfer.serve.roles import error

__all__ = ["build_app"]

RETRY_AFTER_S = 1  # a busy node's Retry-After
_GONE = object()  # put in a request's event queue when its client has left


def _failure(event) -> dict:
    """The HTTP status and error code of a failed request (a rank's death names its node)."""
    if event.client_error:
        return {"status": 400, "code": "invalid_request"}
    if event.busy:
        return {"status": 503, "code": "server_busy"}
    if "node:" in event.reason:
        return {"status": 503, "code": "node_failed"}
    return {"status": 502, "code": "request_failed"}


def _headers_of(event) -> Optional[dict]:
    return {"Retry-After": str(RETRY_AFTER_S)} if event.busy else None


def build_app(node):
    """The FastAPI app of ``node`` (:class:`kvtransfer.serve.node.Node`)."""
    app = FastAPI(title=f"kvtransfer {node.spec.role} node", docs_url=None, redoc_url=None)
    app.router.on_startup.append(node.startup)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        if node.state == "ready":
            return {"status": "ready", "role": node.spec.role, "model": node.model_name}
        return JSONResponse({"status": node.state, "error": node.error}, status_code=503)

    @app.get("/info")
    async def info():
        spec = node.spec
        return {"role": spec.role, "pid": os.getpid(), "model": spec.model, "model_names": node.model_names,
                "tp": spec.tp_size,
                "page_size": spec.page_size, "dtype": spec.dtype, "device": spec.device, "state": node.state,
                "bootstrap": node.role.bootstrap_address(spec), "ranks": [r.layout for r in node.ranks.ready]}

    add_metrics_and_models(app, node.metrics, lambda: [node.model_name])

    @app.post("/kvtransfer/connect")
    async def connect(request: Request):
        """Decode: connect to a prefill node's ranks now ({"bootstrap": "tcp://host:port"}), so
        that its first request does not wait for the handshakes."""
        try:
            bootstrap = json.loads(await request.body())["bootstrap"]
            if not isinstance(bootstrap, str) or not bootstrap.startswith("tcp://"):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return error('the body must be {"bootstrap": "tcp://host:port"}', 400)
        return await node.role.connect(node, bootstrap)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _Completion(node, request, "completion").answer()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _Completion(node, request, "chat").answer()

    return app


class _Failed(Exception):
    def __init__(self, event):
        super().__init__(event.reason)
        self.event = event


class _Completion:
    """One completion request on a node: its command to the ranks, then its reply."""

    def __init__(self, node, request: Request, kind: str):
        self.node, self.request, self.kind = node, request, kind
        self.arrived = time.monotonic()
        self.completion_tokens = 0
        self.first = None  # the first token event, streamed before those from the queue
        self.extra = None  # the role's figures, on the last chunk

    async def answer(self):
        """Parse, submit, and answer (at once, as one JSON body, or as a stream)."""
        node = self.node
        if node.state != "ready":
            return error(f"the {node.spec.role} node is {node.state}{': ' + node.error if node.error else ''}", 503)
        submitted = await self._submit()
        if submitted is not None:
            return submitted
        try:
            reply = await self._first_answer()
        except BaseException:
            self.gone.cancel()
            node.finish(self.rid, False, "aborted")
            raise
        if reply is not None:
            return reply
        return await self._whole() if not self.req.stream else self._stream()

    async def _submit(self) -> Optional[Response]:
        """Check the request and hand its command to the ranks; an error reply, or None."""
        from kvtransfer.models.engine import Sampling
        from kvtransfer.serve.openai_api import ApiError, Shaper, TextStream, check_model, pairing_for, parse_request
        from kvtransfer.serve.prompts import prompt_ids, token_budget

        node, role = self.node, self.node.spec.role
        try:
            req = parse_request(self.kind, await read_body(self.request, node.max_body_bytes))
            check_model(req, node.model_names)
            pairing = pairing_for(role, req)
            ids = await asyncio.get_running_loop().run_in_executor(
                node.tokenizing, prompt_ids, req, node.tokenizer, node.engine_config, node.model_config)
            new_tokens = token_budget(req, ids, role, node.engine_config, node.model_config)
        except ApiError:
            node.metrics.requests.labels("client_error").inc()
            raise
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        self.req, self.ids = req, ids
        self.rid = pairing.rid if pairing else uuid.uuid4().hex
        stop_ids = frozenset() if req.ignore_eos else node.tokenizer.stop_ids
        sampling = Sampling(req.temperature, seed, max(req.top_k, 0))
        cmd = node.role.command(self.rid, ids, new_tokens, stop_ids, sampling, pairing)
        self.shaper = Shaper(self.kind == "chat", node.model_name)
        self.headers = {"x-kvtransfer-rid": self.rid}
        self.text = TextStream(node.tokenizer, req.stop)
        try:
            self.q = await node.submit(self.rid, cmd)
        except KeyError:
            return error(f"request id {self.rid!r} is already in flight here", 409)
        node.metrics.prompt_tokens.inc(len(ids))
        self.gone = asyncio.ensure_future(client_gone(self.request))
        self.gone.add_done_callback(lambda _: self.q.put_nowait(_GONE))  # wakes a wait for the next event
        return None

    async def _first_answer(self) -> Optional[Response]:
        """The ranks' first event: a reply where it ends the request, else None (the token
        events follow)."""
        from kvtransfer.serve import messages as m

        node, rid = self.node, self.rid
        first = await self.q.get()
        if first is _GONE:  # the client left (the router cancels a request whose other half failed)
            node.finish(rid, False, "aborted")
            return Response(status_code=499)
        if isinstance(first, m.RequestFailed):
            self.gone.cancel()
            outcome = "client_error" if first.client_error else "busy" if first.busy else "failed"
            node.finish(rid, True, outcome)
            return error(first.reason, headers=_headers_of(first), **_failure(first))
        reply, self.first, self.extra = node.role.first_answer(node, rid, first)
        if reply is not None:
            self.gone.cancel()
        return reply

    async def _events(self):
        """Token events until the request ends: (delta text, finish reason or None);
        :class:`ClientGone` once the client has left."""
        from kvtransfer.serve import messages as m

        metrics, text = self.node.metrics, self.text
        while True:
            ev = self.first if self.first is not None else await self.q.get()
            self.first = None
            if ev is _GONE or self.gone.done():
                raise ClientGone()
            if isinstance(ev, m.RequestFailed):
                raise _Failed(ev)
            if self.completion_tokens == 0 and ev.token_ids:
                metrics.ttft_seconds.observe(time.monotonic() - self.arrived)
            if ev.queue_s is not None:
                metrics.queue_seconds.observe(ev.queue_s)
            self.completion_tokens += len(ev.token_ids)
            metrics.generated_tokens.inc(len(ev.token_ids))
            delta = text.feed(ev.token_ids)
            if text.stopped:
                yield delta, "stop"
                return
            if ev.finish is not None:
                yield delta + text.flush(), ev.finish
                return
            yield delta, None

    async def _whole(self):
        """The completion as one JSON body."""
        node, rid = self.node, self.rid
        out, finish = [], None
        try:
            async for delta, finish in self._events():
                out.append(delta)
        except _Failed as f:
            node.finish(rid, True, "failed")
            return error(f.event.reason, **_failure(f.event))
        except ClientGone:
            node.finish(rid, False, "aborted")
            return Response(status_code=499)
        finally:
            self.gone.cancel()
        node.finish(rid, finish is not None and not self.text.stopped, "ok")
        return JSONResponse(self.shaper.response("".join(out), finish, len(self.ids), self.completion_tokens,
                                                 self.extra), headers=self.headers)

    def _stream(self) -> StreamingResponse:
        """The completion as server-sent events: a chunk per token event, the usage chunk if
        asked, then ``[DONE]``."""
        from kvtransfer.serve.openai_api import error_body, sse

        node, rid, shaper = self.node, self.rid, self.shaper

        async def chunks():
            ended_ok = False
            try:
                async for delta, finish in self._events():  # a chunk per token event, its
                    # text possibly empty (bytes that end mid-character); the figures ride on the last one
                    yield sse(shaper.chunk(delta, finish, self.extra if finish else None))
                    if finish:
                        ended_ok = not self.text.stopped
                if self.req.include_usage:
                    yield sse(shaper.usage_chunk(len(self.ids), self.completion_tokens))
                yield sse("[DONE]")
                node.finish(rid, ended_ok, "ok")
            except _Failed as f:
                yield sse(error_body(f.event.reason, **_failure(f.event)))
                yield sse("[DONE]")
                node.finish(rid, True, "failed")
            except BaseException as exc:  # the client left (ClientGone, or the server cancelled the stream)
                node.finish(rid, False, "aborted")
                if not isinstance(exc, ClientGone):
                    raise
            finally:
                self.gone.cancel()

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=self.headers)
