"""What the nodes and the router share over HTTP: the uvicorn server, its listening socket,
the ``/metrics`` and ``/v1/models`` routes, errors in OpenAI's shape (an unknown path or method
too), the request body limit, and the keep-alive rule of their clients.

Body limit: a request body longer than ``--max-body-bytes`` (:data:`DEFAULT_MAX_BODY_BYTES`)
is a 413 as soon as its ``Content-Length`` says so (or its chunks pass the limit), before any
of it is parsed.

Keep-alive: a server closes a connection idle for :data:`SERVER_KEEP_ALIVE_S`; our clients
(the router towards the nodes, the demo, ``bench serve``) drop theirs after
:data:`CLIENT_KEEPALIVE_EXPIRY_S`, well before. With equal times (uvicorn's and httpx's
defaults are both 5 s) a client can send a request on a connection the server is closing at
that moment, and the request fails with a bare ``ReadError``; a starved machine widens that
window."""

from __future__ import annotations

import random
import socket
import time
from typing import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kvtransfer.serve.metrics import CONTENT_TYPE_LATEST
from kvtransfer.serve.openai_api import ApiError, error_body

__all__ = ["CLIENT_KEEPALIVE_EXPIRY_S", "DEFAULT_MAX_BODY_BYTES", "SERVER_KEEP_ALIVE_S", "ClientGone", "UsageError",
           "add_error_handlers", "add_metrics_and_models", "client_gone", "client_limits", "free_port", "http_server",
           "port_socket", "read_body", "unless_gone"]

SERVER_KEEP_ALIVE_S = 75  # a node or the router closes an HTTP connection idle this long
CLIENT_KEEPALIVE_EXPIRY_S = 15.0  # our clients drop an idle connection this soon (module doc)
DEFAULT_MAX_BODY_BYTES = 8 << 20  # --max-body-bytes: a request body past this is a 413 (module doc)


def client_limits(**limits):
    """``httpx.Limits`` for a client of the nodes or the router: ``limits`` (connection counts)
    and the keep-alive expiry of the module doc."""
    import httpx

    return httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S, **limits)


class UsageError(ValueError):
    """Bad command-line input: one line, exit status 2."""


def port_socket(host: str, port: int, what: str) -> socket.socket:
    """A bound listening socket, or UsageError naming the port."""
    if not 0 < port < 65536:
        raise UsageError(f"{what} {port} is not a TCP port (1..65535)")
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of a socket that names it,
    # and without it a stream's first chunk after its headers waits for the client's delayed ACK
    # (Nagle: ~40 ms on Linux)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"{what} {host}:{port} is not free: {exc.strerror}") from None
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range: the ports the servers will bind later
    cannot be taken meanwhile by the random binds of their own ranks (ZeroMQ, UCX, gloo)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, first_ephemeral - 12000), first_ephemeral)
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # the range is crowded: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def add_metrics_and_models(app: FastAPI, metrics, models: Callable[[], Sequence[str]]) -> None:
    """``GET /metrics`` (``metrics.text()``, Prometheus text) and ``GET /v1/models`` (the names
    ``models()`` gives: the served model, or none while it is not known)."""
    created = int(time.time())

    @app.get("/metrics")
    async def _metrics():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvtransfer"}
                                           for name in models()]}


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: an :class:`ApiError` raised by a route, an unknown path
    (404) or method (405), and an exception no route caught (500)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"{where}: no such endpoint here"
        elif exc.status_code == 405:
            message = f"{where}: the endpoint takes {(exc.headers or {}).get('Allow', 'other methods')}"
        else:
            message = f"{where}: {exc.detail}"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)  # uvicorn logs the traceback
    async def _internal(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error ({type(exc).__name__})", 500), status_code=500)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; :class:`ApiError` 413 once it is known to pass ``limit`` bytes."""
    def too_large() -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                             f"(--max-body-bytes)", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def http_server(app):
    """A uvicorn server whose SIGINT / SIGTERM stop it gracefully and then return to the caller
    (uvicorn itself re-raises the signal after shutdown, which would kill the process before
    the node stopped its ranks)."""
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                 timeout_keep_alive=SERVER_KEEP_ALIVE_S))


class ClientGone(Exception):
    """The client of the request being answered disconnected."""


async def client_gone(request) -> None:
    """Returns once the client of ``request`` has disconnected. Start it after the body has been
    read: the next ASGI message is then the disconnect (the server also sends one once the
    response is complete: cancel this before answering)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(aw, gone):
    """``aw``'s result; :class:`ClientGone` (``aw`` cancelled) as soon as the ``gone`` task (a
    :func:`client_gone`) is done first."""
    import asyncio

    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()
