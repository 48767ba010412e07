"""A decode rank's view of the prefill ranks of its DP group: :class:`PrefillPeer` (one of
them) and :class:`PrefillRanks` (their sockets, hellos, heartbeats, goodbyes).

Each prefill rank gets a DEALER socket and a hello (this rank's layout and endpoints); its
:class:`~kvtransfer.control.session.PeerSession` says where the session stands. Saying hello
again -- to a rank that restarted or dropped this one -- opens a fresh socket, so that nothing
of the old session is read as an answer to the new one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from kvtransfer.control.bootstrap import BootstrapError
from kvtransfer.control.liveness import wire_of
from kvtransfer.control.session import PeerSession, PeerState
from kvtransfer.control.wire import (PROTOCOL_VERSION, DecodeHello, Endpoint, Goodbye, RegisterPrefill, VersionMismatch,
                                     WireError, decode, endpoints_of)

__all__ = ["HandshakeError", "PrefillPeer", "PrefillRanks"]

log = logging.getLogger("kvtransfer.control.decode")


class HandshakeError(ConnectionError):
    """A prefill rank refused this decode rank's hello, or never answered it."""


@dataclass
class PrefillPeer:
    """A prefill rank this rank reads from or tells of its requests (loop thread only)."""

    registration: RegisterPrefill
    socket: object
    session: PeerSession
    writer: Optional[Endpoint] = None  # its endpoint on the transport its hello ack says it writes through

    @property
    def rank(self) -> int:
        return self.registration.tp_rank


class PrefillRanks:
    """The prefill ranks of this decode rank's DP group, by TP rank (loop thread, or before the
    loop starts). ``on_socket(peer)`` reads a peer's socket; the event loop calls it."""

    def __init__(self, owner, loop, on_socket: Callable[[PrefillPeer], None]):
        self._owner = owner  # the DecodeKVManager: layout, config, endpoints, instance, host, process
        self._loop = loop
        self._on_socket = on_socket
        self._ctx = zmq.Context()
        self.peers: dict = {}  # prefill tp rank -> PrefillPeer
        self._by_name: dict = {}  # transport name -> prefill tp rank

    def __getitem__(self, rank: int) -> PrefillPeer:
        return self.peers[rank]

    def rank_of(self, transport_name: str) -> Optional[int]:
        """The prefill rank that writes here as ``transport_name``."""
        return self._by_name.get(transport_name)

    def ready(self) -> list:
        return [p for p in self.peers.values() if p.session.state is PeerState.READY]

    def connect(self, reg: RegisterPrefill) -> PrefillPeer:
        """Open a control socket to a prefill rank and say hello (a known rank's old socket is
        closed first)."""
        old = self.peers.get(reg.tp_rank)
        if old is not None:
            self._loop.remove_socket(old.socket)
            old.socket.close()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(reg.control_addr)
        peer = PrefillPeer(reg, sock, PeerSession.calling(self._owner.config, time.monotonic()))
        self.peers[reg.tp_rank] = peer
        for ep in endpoints_of(reg).values():
            self._by_name[ep.name] = reg.tp_rank
        self._loop.add_socket(sock, lambda: self._on_socket(peer))
        me = self._owner
        sock.send(DecodeHello(
            instance=me.instance, dp_rank=me.config.dp_rank, tp_rank=me.layout.tp_rank,
            tp_size=me.layout.tp_size, host=me.host, endpoints=me.endpoints.wire(),
            layout=me.layout.to_msgpack(), incarnation=me.incarnation,
            process=wire_of(me.process)).to_msgpack(), zmq.NOBLOCK)
        return peer

    def await_handshakes(self) -> None:
        """Wait (on the owner's thread) until every prefill rank answered its hello; raise
        HandshakeError naming those that refused, or did not answer within the handshake
        timeout."""
        me = self._owner
        deadline = time.monotonic() + me.config.handshake_timeout_s
        while True:
            states = self._loop.call(lambda: {r: (p.session.state, p.session.error)
                                              for r, p in self.peers.items()}).result()
            refused = {r: e for r, (s, e) in states.items() if s is PeerState.REFUSED}
            if refused:
                raise HandshakeError("; ".join(f"prefill rank {r} refused decode rank {me.layout.tp_rank}: {e}"
                                               for r, e in sorted(refused.items())))
            waiting = sorted(r for r, (s, _) in states.items() if s is not PeerState.READY)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise HandshakeError(f"decode rank {me.layout.tp_rank}: no answer to its hello from prefill ranks "
                                     f"{waiting} within {me.config.handshake_timeout_s:g} s")
            time.sleep(0.005)

    def send(self, peer: PrefillPeer, msg) -> None:
        peer.socket.send(msg.to_msgpack(), zmq.NOBLOCK)

    def broadcast(self, msg) -> None:
        """``msg`` to every ready prefill rank."""
        for peer in self.ready():
            self.send(peer, msg)

    def heartbeats(self, now: float) -> None:
        """Send the heartbeats due (to ready and lost ranks: a lost one that answers is alive)."""
        for peer in self.peers.values():
            beat = peer.session.heartbeat(now, self._owner.incarnation)
            if beat is not None:
                try:
                    self.send(peer, beat)
                except zmq.Again:  # a dead rank's queue is full: nothing to tell it
                    pass

    def gone(self, peer: PrefillPeer) -> Optional[str]:
        """How a prefill rank (suspect, or lost with pages fenced) is known to write nothing
        more here, else None: its process has ended (one host: :mod:`kvtransfer.control.liveness`),
        or the transport it writes here through (its hello ack named it) says that writer let go
        or is lost (:meth:`transport.base.Transport.writer_gone`: across hosts, NIXL's 1-byte
        probe write failing with a disconnect, one every 0.2 s at most)."""
        ended = peer.session.process_ended(self._owner.process)
        if ended is not None:
            return ended
        transport = self._owner.endpoints.transports.get(peer.writer.backend) if peer.writer is not None else None
        why = transport.writer_gone(peer.writer.name) if transport is not None else None
        return f"its {peer.writer.backend} transport {why}" if why is not None else None

    def read(self, peer: PrefillPeer):
        """The messages waiting on ``peer``'s socket (a bounded batch per turn). A frame of
        another protocol version that answers this rank's hello refuses it; other bad frames
        are logged and dropped."""
        me = self._owner.layout.tp_rank
        for _ in range(256):
            try:
                frame = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except WireError as exc:
                if isinstance(exc, VersionMismatch) and peer.session.state is PeerState.CONNECTING:  # the answer
                    peer.session.enter(PeerState.REFUSED, time.monotonic(), f"it speaks control protocol "
                                       f"{exc.version!r}, this rank {PROTOCOL_VERSION}")  # to our hello
                    log.error("prefill rank %d refused decode rank %d: %s", peer.rank, me, peer.session.error)
                else:
                    log.warning("decode rank %d dropped a frame from prefill rank %d: %s", me, peer.rank, exc)
                continue
            peer.session.heard(time.monotonic())
            yield msg

    def restarted(self, bootstrap) -> list:
        """The registrations at the bootstrap service of known ranks that name a new
        incarnation (none when the service does not answer)."""
        try:
            topo = bootstrap.topology(self._owner.config.dp_rank, timeout_s=0.2)
        except BootstrapError as exc:
            log.debug("bootstrap lookup failed: %s", exc)
            return []
        return [reg for reg in topo.rank_infos() if reg.tp_rank in self.peers
                and reg.incarnation != self.peers[reg.tp_rank].registration.incarnation]

    def part(self, on_socket: Callable[[PrefillPeer], None]) -> None:
        """Say goodbye to every ready rank and wait, up to the heartbeat timeout, for each to
        answer (once none of its writes here is in flight: the owner may then deregister its
        memory); ``on_socket`` reads the answers. A rank that does not answer is logged."""
        me = self._owner
        waiting = self.ready()
        for peer in waiting:
            self.send(peer, Goodbye(incarnation=me.incarnation))
        deadline = time.monotonic() + me.config.heartbeat_timeout_s
        while any(p.session.state is PeerState.READY for p in waiting) and time.monotonic() < deadline:
            for peer in waiting:
                if peer.socket.poll(1, zmq.POLLIN):
                    on_socket(peer)
            for transport in me.endpoints.transports.values():  # keeps NIXL progressing while prefill drains
                transport.poll_notifications()
        for peer in self.peers.values():
            if peer.session.state is PeerState.READY:
                log.warning("decode rank %d closes without a goodbye from prefill rank %d (lost?)",
                            me.layout.tp_rank, peer.rank)

    def close(self) -> None:
        """Close every socket (on the loop), then the context (after the loop has stopped: call
        :meth:`term`)."""
        for peer in self.peers.values():
            self._loop.remove_socket(peer.socket)
            peer.socket.close()
        self.peers.clear()

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def term(self) -> None:
        self._ctx.term()
