"""The bootstrap service: where prefill ranks register and decode ranks find them.

Run by prefill rank 0 of a node (:class:`BootstrapService` on a thread) or on its own
(``kvtransfer bootstrap --port 8998``). One ZeroMQ ROUTER socket; every request is one
:mod:`~kvtransfer.control.wire` frame and gets one frame back:

- :class:`~kvtransfer.control.wire.RegisterPrefill` -> ``Registered`` (``error`` empty when
  accepted). A (dp_rank, tp_rank) that registers again replaces its entry (a restarted rank);
  a TP size that contradicts the group's other ranks is refused, naming both.
- ``UnregisterPrefill`` -> ``Registered``: a rank that shuts down leaves (only the
  incarnation that registered can remove its entry).
- ``GetTopology`` -> ``Topology``: the group's registrations so far.
- ``Ping`` -> ``Pong``: liveness.

Frames that fail :func:`~kvtransfer.control.wire.decode` are logged with the reason and
dropped (counted in ``dropped``); the service carries on.

:class:`BootstrapClient` is the other end: each request opens a DEALER socket, sends, waits
at most its timeout and closes it (ZeroMQ connects, reconnects and queues; nothing here
reimplements that). ``register`` retries with exponential backoff while the service comes up.

Threads: the service owns one thread; ``close()`` stops and joins it and closes the socket.
A client is used from one thread at a time.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from typing import Optional

import zmq

from kvtransfer.control.wire import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    GetTopology,
    Message,
    Ping,
    Pong,
    Registered,
    RegisterPrefill,
    Topology,
    UnregisterPrefill,
    VersionMismatch,
    WireError,
    decode,
)

__all__ = ["BootstrapClient", "BootstrapError", "BootstrapService", "BootstrapTimeout"]

log = logging.getLogger("kvtransfer.control.bootstrap")


class BootstrapError(RuntimeError):
    """The service refused a request; the message says why."""


class BootstrapTimeout(BootstrapError, TimeoutError):
    """No answer from the service within the timeout."""


class BootstrapService:
    """The registry of prefill ranks, served on ``tcp://host:port`` (port 0: any free port;
    ``address`` tells which)."""

    POLL_MS = 100  # how often the serving thread looks at its stop flag

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port!r}")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"bootstrap service cannot bind tcp://{host}:{port}: {exc}") from None
        self.address = f"tcp://{host}:{port}"
        self._groups: dict = {}  # dp_rank -> {tp_rank: (RegisterPrefill, frame bytes)}
        self._lock = threading.Lock()
        self.dropped = 0  # frames refused by decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvt-bootstrap", daemon=True)
        self._thread.start()

    # -- what it knows ---------------------------------------------------------------
    def registrations(self, dp_rank: int = 0) -> dict:
        """``{tp_rank: RegisterPrefill}`` of one DP group (a snapshot)."""
        with self._lock:
            return {tp: reg for tp, (reg, _) in self._groups.get(dp_rank, {}).items()}

    # -- serving ---------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(self.POLL_MS):
                continue
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:  # the socket was closed under us: stop
                if not self._stop.is_set():
                    log.error("bootstrap socket failed: %s", exc)
                return
            if len(parts) != 2:
                self._drop(f"{len(parts)} frames instead of an identity and one message")
                continue
            identity, frame = parts
            try:
                reply = self._answer(decode(frame), frame)
            except VersionMismatch as exc:  # answered in this version: the requester fails naming both
                self._drop(str(exc))
                reply = Registered(error=f"the bootstrap service speaks control protocol {PROTOCOL_VERSION}, "
                                         f"not {exc.version!r}")
            except WireError as exc:
                self._drop(str(exc))
                continue
            except Exception:  # a bug answering one frame must not end the service
                log.exception("bootstrap service failed to answer a frame")
                continue
            self._sock.send_multipart([identity, reply.to_msgpack()])

    def _drop(self, why: str) -> None:
        self.dropped += 1
        log.warning("bootstrap service dropped a frame: %s", why)

    def _answer(self, msg: Message, frame: bytes) -> Message:
        handler = {RegisterPrefill: self._register, UnregisterPrefill: self._unregister,
                   GetTopology: self._topology, Ping: self._pong}.get(type(msg))
        if handler is None:
            raise WireError(f"the bootstrap service does not answer {msg.KIND} messages")
        return handler(msg, frame)

    def _unregister(self, msg: UnregisterPrefill, frame: bytes) -> Registered:
        with self._lock:
            group = self._groups.get(msg.dp_rank, {})
            entry = group.get(msg.tp_rank)
            if entry is not None and entry[0].incarnation == msg.incarnation:
                del group[msg.tp_rank]
                log.info("prefill dp %d tp %d unregistered", msg.dp_rank, msg.tp_rank)
        return Registered(error="")

    def _topology(self, msg: GetTopology, frame: bytes) -> Topology:
        with self._lock:
            group = self._groups.get(msg.dp_rank, {})
            ranks = [group[tp][1] for tp in sorted(group)]
            tp_size = next(iter(group.values()))[0].tp_size if group else 0
        return Topology(dp_rank=msg.dp_rank, tp_size=tp_size, ranks=ranks)

    def _pong(self, msg: Ping, frame: bytes) -> Pong:
        with self._lock:
            count = sum(len(g) for g in self._groups.values())
        return Pong(nonce=msg.nonce, registered=count)

    def _register(self, msg: RegisterPrefill, frame: bytes) -> Registered:
        with self._lock:
            group = self._groups.setdefault(msg.dp_rank, {})
            others = {reg.tp_size for tp, (reg, _) in group.items() if tp != msg.tp_rank}
            if others and others != {msg.tp_size}:
                return Registered(error=f"prefill dp {msg.dp_rank} tp_rank {msg.tp_rank} registers tp_size "
                                        f"{msg.tp_size}, the group's other ranks registered {sorted(others)}")
            old = group.get(msg.tp_rank)
            group[msg.tp_rank] = (msg, bytes(frame))
        if old is None:
            log.info("prefill dp %d tp %d/%d registered at %s", msg.dp_rank, msg.tp_rank, msg.tp_size, msg.control_addr)
        elif old[0].incarnation != msg.incarnation:
            log.info("prefill dp %d tp %d re-registered (restarted) at %s", msg.dp_rank, msg.tp_rank, msg.control_addr)
        return Registered(error="")

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread, close the socket (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BootstrapClient:
    """Requests to a bootstrap service at ``address`` (``tcp://host:port``)."""

    def __init__(self, address: str, timeout_s: float = 5.0):
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise ValueError(f"address must be 'tcp://host:port', got {address!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address, self.timeout_s = address, timeout_s
        self._ctx = zmq.Context.instance()

    def request(self, msg: Message, reply_type: type, timeout_s: Optional[float] = None) -> Message:
        """Send ``msg`` and return the reply (of ``reply_type``); :class:`BootstrapTimeout`
        when none arrives in time, :class:`BootstrapError` when the reply is not one."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            sock.connect(self.address)
            sock.send(msg.to_msgpack())
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise BootstrapTimeout(f"no answer to {msg.KIND} from the bootstrap service at {self.address} "
                                       f"within {timeout_s:g} s")
            frame = sock.recv()
        finally:
            sock.close()
        try:
            reply = decode(frame)
        except WireError as exc:
            raise BootstrapError(f"bad answer to {msg.KIND} from {self.address}: {exc}") from None
        if not isinstance(reply, reply_type):
            raise BootstrapError(f"{self.address} answered {msg.KIND} with {reply.KIND}, expected {reply_type.KIND}")
        return reply

    def register(self, msg: RegisterPrefill, deadline_s: float = 60.0) -> None:
        """Register a prefill rank, retrying with backoff (50 ms doubling to 2 s per try)
        while the service comes up; :class:`BootstrapError` if it refuses,
        :class:`BootstrapTimeout` after ``deadline_s``."""
        deadline, wait = time.monotonic() + deadline_s, 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                reply = self.request(msg, Registered, timeout_s=max(0.01, min(wait, left)))
            except BootstrapTimeout:
                if time.monotonic() >= deadline:
                    raise BootstrapTimeout(f"prefill dp {msg.dp_rank} tp {msg.tp_rank}: the bootstrap service at "
                                           f"{self.address} did not answer within {deadline_s:g} s") from None
                wait = min(2.0, wait * 2)
                continue
            if reply.error:
                raise BootstrapError(reply.error)
            return

    def unregister(self, dp_rank: int, tp_rank: int, incarnation: str, timeout_s: float = 1.0) -> None:
        """Leave the registry (best effort: a service that is gone is no error)."""
        try:
            self.request(UnregisterPrefill(dp_rank=dp_rank, tp_rank=tp_rank, incarnation=incarnation), Registered,
                         timeout_s)
        except BootstrapTimeout:
            log.info("bootstrap service at %s did not answer the unregistration", self.address)

    def topology(self, dp_rank: int = 0, timeout_s: Optional[float] = None) -> Topology:
        return self.request(GetTopology(dp_rank=dp_rank), Topology, timeout_s)

    def wait_for_topology(self, dp_rank: int = 0, deadline_s: float = 60.0, every_s: float = 0.1) -> Topology:
        """Poll until every TP rank of the group has registered; BootstrapTimeout naming the
        ranks still missing after ``deadline_s``."""
        deadline = time.monotonic() + deadline_s
        while True:
            left = max(0.01, deadline - time.monotonic())
            try:
                topo = self.topology(dp_rank, timeout_s=min(self.timeout_s, left))
            except BootstrapTimeout:
                topo = None
            if topo is not None and topo.complete:
                return topo
            if time.monotonic() >= deadline:
                if topo is None:
                    raise BootstrapTimeout(f"the bootstrap service at {self.address} did not answer within "
                                           f"{deadline_s:g} s")
                have = sorted(r.tp_rank for r in topo.rank_infos())
                raise BootstrapTimeout(f"prefill dp {dp_rank}: ranks {have} of tp_size {topo.tp_size or '?'} registered "
                                       f"after {deadline_s:g} s")
            time.sleep(every_s)

    def ping(self, timeout_s: Optional[float] = None) -> Pong:
        nonce = time.monotonic_ns() & 0x7FFFFFFF
        pong = self.request(Ping(nonce=nonce), Pong, timeout_s)
        if pong.nonce != nonce:
            raise BootstrapError(f"{self.address} answered ping {nonce} with nonce {pong.nonce}")
        return pong


def main(argv: Optional[list] = None) -> int:
    """``kvtransfer bootstrap``: run the service until interrupted."""
    ap = argparse.ArgumentParser(prog="kvtransfer bootstrap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8998, help="port to bind (default 8998; 0: any free port)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        service = BootstrapService(args.host, args.port)
    except (OSError, ValueError) as exc:
        print(f"kvtransfer bootstrap: {exc}")
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kvtransfer bootstrap: serving on {service.address}", flush=True)
    with service:
        stop.wait()
    print("kvtransfer bootstrap: stopped", flush=True)
    return 0
