"""What the nodes and the router share over HTTP: the uvicorn server, its listening socket,
the ``/metrics`` and ``/v1/models`` routes, and the keep-alive rule of their clients.

Keep-alive: a server closes a connection idle for :data:`SERVER_KEEP_ALIVE_S`; our clients
(the router towards the nodes, the demo, ``bench serve``) drop theirs after
:data:`CLIENT_KEEPALIVE_EXPIRY_S`, well before. With equal times (uvicorn's and httpx's
defaults are both 5 s) a client can send a request on a connection the server is closing at
that moment, and the request fails with a bare ``ReadError``; a starved machine widens that
window."""

from __future__ import annotations

import random
import socket
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import Response

from kvtransfer.serve.metrics import CONTENT_TYPE_LATEST

__all__ = ["CLIENT_KEEPALIVE_EXPIRY_S", "SERVER_KEEP_ALIVE_S", "ClientGone", "UsageError", "add_metrics_and_models",
           "client_gone", "client_limits", "free_port", "http_server", "port_socket", "unless_gone"]

SERVER_KEEP_ALIVE_S = 75  # a node or the router closes an HTTP connection idle this long
CLIENT_KEEPALIVE_EXPIRY_S = 15.0  # our clients drop an idle connection this soon (module doc)


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
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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


def add_metrics_and_models(app: FastAPI, metrics, model: Callable[[], str]) -> None:
    """``GET /metrics`` (``metrics.text()``, Prometheus text) and ``GET /v1/models``."""

    @app.get("/metrics")
    async def _metrics():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [{"id": model(), "object": "model", "owned_by": "kvtransfer"}]}


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
