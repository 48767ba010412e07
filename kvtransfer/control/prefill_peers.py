"""A prefill rank's view of the decode ranks: :class:`DecodePeer` (one that said hello) and
:class:`DecodeRanks` (all of them: hellos, heartbeats, departures and losses).

It holds the decode rank's layout, the transport pair both write through, its buffers there,
its :class:`~kvtransfer.control.session.PeerSession`, and whether this rank writes to it at
all (``senders_for``). Where the transport keeps a write's pair set resident
(``Peer.keeps_pairs``: NVLink's direct path), the pairs of this rank's writes to it are made
resident at its hello, once: they depend on the two layouts only (:meth:`DecodePeer.plan_ahead`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from kvtransfer.batches import BufferRegions, plan_batch
from kvtransfer.control.endpoints import pick_backend
from kvtransfer.control.liveness import wire_of
from kvtransfer.control.session import PeerSession, PeerState, confirm_silent
from kvtransfer.control.wire import DecodeHello, Goodbye, Heartbeat, HelloAck, NotConnected, endpoints_of, process_of
from kvtransfer.layout import LayoutMismatch, RankLayout, StateKind
from kvtransfer.plan import plan_kv_transfer, plan_state_transfer, senders_for
from transport.base import PeerDescriptorError, PeerDraining, StridedBatch, TransferStatus, TransportError

__all__ = ["DecodePeer", "DecodeRanks"]

log = logging.getLogger("kvtransfer.control.prefill")


@dataclass
class DecodePeer:
    """A decode rank that said hello (loop thread only)."""

    hello: DecodeHello
    identity: bytes  # its ROUTER routing id
    layout: RankLayout
    backend: str  # the transport this pair writes through
    src_regions: BufferRegions  # this rank's buffers on that transport
    regions: BufferRegions  # the decode rank's buffers on that transport
    peer: object  # transport Peer
    reads_from_me: bool  # this rank is one of its senders_for(...)
    writes_aux: bool  # this rank is the lowest of its senders: its last notification carries the aux record
    session: PeerSession

    @property
    def key(self) -> tuple:
        return self.hello.key

    def batch(self, plan):
        """The transport batch of ``plan`` to this rank, in the form its transport takes best."""
        return plan_batch(plan, self.src_regions, self.regions, strided=self.peer.takes_strided(plan.num_token_entries))

    def plan_ahead(self, mine: RankLayout) -> int:
        """Make the pair sets of this rank's writes resident in its transport now, where the
        transport keeps them (``Peer.keeps_pairs``). A write's pairs -- which buffer to which,
        offsets, strides, row bytes -- come from the two layouts alone, so a one-token plan (the
        first slot of page 1 on each side; state slot 1) gives the pairs of every request's KV
        write, and of its Mamba state write: the first request then finds them built, as every
        later one does. Returns how many pair sets were made resident (0: the transport keeps
        none, or this rank reads nothing from ``mine``)."""
        if not self.reads_from_me or not self.peer.keeps_pairs():
            return 0
        plans = [plan_kv_transfer(mine, self.layout, [mine.page_size], [self.layout.page_size])]  # page 1, token 0
        if mine.state_kind is StateKind.MAMBA:
            plans.append(plan_state_transfer(mine, self.layout, 1, 1))
        made = 0
        for plan in plans:
            batch = None if plan.empty else self.batch(plan)
            if isinstance(batch, StridedBatch) and batch.num_pairs:  # (NSA's sectioned pages write flat rows)
                self.peer.plan_pairs(batch)
                made += 1
        return made

    def plan_ahead_or_log(self, mine: RankLayout, key) -> int:
        """:meth:`plan_ahead`, its failure logged: it is not the hello's (the first write
        builds the pair sets instead, and raises what is wrong there, for that request)."""
        try:
            return self.plan_ahead(mine)
        except Exception as exc:  # a CUDA or bounds error of the transport: whatever it is, the hello stands
            log.warning("prefill rank %d: the pair sets of the writes to decode rank %s were not made ahead: %s",
                        mine.tp_rank, key, exc)
            return 0


class DecodeRanks:
    """The decode ranks a prefill rank knows, and its ROUTER socket to them (loop thread only).

    A hello is checked (layouts, a transport in common) and answered here; a rank is known by
    its key ``(instance, tp_rank)`` and by its socket's routing id. A hello whose transport
    cannot connect yet (``PeerDraining``: this rank's failed writes to it still run), or whose
    rank's old entry still has writes in flight (below), *waits*, unanswered, and is tried
    again at each :meth:`sweep` until it connects, a newer hello of the rank replaces it, or the
    handshake timeout passes (the decode rank then says hello again on its own). A rank is
    *dropped* when it is lost (silent past the heartbeat timeout, its process
    ended, or its transport peer lost: :meth:`drop_lost`) or says hello again:
    ``on_drop(key, reason)`` fails its requests (their writes are cancelled) and names the
    writes to it still in flight, and its transport peer is closed once none of them is (at
    each turn, :meth:`close_settled`): never waited for here, since a write to a paused rank
    over tcp stays in flight until its deadline, and this rank serves the others meanwhile. A
    socket dropped so is answered ``NotConnected`` (it says hello again if it lives, and the
    new hello connects the transport anew). Both answers tell the decode rank that none of the
    old writes can land (it reuses their pages then), so neither is given while one is still in
    flight: a hello of that rank waits, a message of that socket goes unanswered. A rank that
    says goodbye *leaves*: it is answered once no write to it is in flight."""

    def __init__(self, router, owner, on_drop):
        self._router = router
        self._owner = owner  # the PrefillKVManager: layout, config, endpoints, host, process, incarnation
        self._on_drop = on_drop
        self.peers: dict = {}  # (instance, tp_rank) -> DecodePeer
        self._by_identity: dict = {}  # routing id -> key
        self._dropped: dict = {}  # routing id -> (time, reason, logged): sockets without a hello (NotConnected)
        # (DecodePeer, its writes still in flight, whether it said goodbye): dropped or leaving
        # ranks whose transport peer closes (and goodbye is answered) once those writes ended
        self._closing: list = []
        self._waiting: dict = {}  # key -> (routing id, DecodeHello, since): hellos that cannot be answered yet

    @property
    def _rank(self) -> int:
        return self._owner.layout.tp_rank

    def of_socket(self, identity: bytes):
        """``(key, DecodePeer)`` of a socket: (None, None) without a hello (answered
        NotConnected by the caller), (key, None) for a rank gone meanwhile."""
        key = self._by_identity.get(identity)
        return key, (None if key is None else self.peers.get(key))

    def send(self, key: tuple, msg) -> None:
        peer = self.peers.get(key)
        if peer is not None:
            self.send_to(peer.identity, msg, f"decode rank {key}")

    def send_to(self, identity: bytes, msg, whom: str) -> None:
        try:
            self._router.send_multipart([identity, msg.to_msgpack()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the decode rank is gone: heartbeats will tell
            log.debug("cannot send %s to %s: %s", msg.KIND, whom, exc)

    # -- hellos -----------------------------------------------------------------------
    def hello(self, identity: bytes, hello: DecodeHello) -> None:
        """Check the decode rank's layout and connect to it over the best shared transport; a
        known rank's old entry is dropped first (its requests fail, its transport peer closes
        once their writes ended). Answered with HelloAck (an error says why it was refused),
        or, while the transport cannot connect yet, not yet: the hello waits (class docstring)."""
        self._waiting.pop(hello.key, None)  # a newer hello replaces one still waiting
        self._answer(identity, hello, time.monotonic())

    def _answer(self, identity: bytes, hello: DecodeHello, since: float) -> None:
        """:meth:`hello`, for a hello that came at ``since``."""
        mine = self._owner.layout
        error = ""
        try:
            layout = RankLayout.from_msgpack(hello.layout)
            mine.check_compatible(layout)
            theirs = endpoints_of(hello)
            readers = senders_for(layout, mine.tp_size)
        except (LayoutMismatch, ValueError, TypeError) as exc:
            error = str(exc)
        entry = None
        if not error:
            old = self.peers.pop(hello.key, None)
            if old is not None:  # it restarted, or lost this rank and reconnects: its old requests cannot finish
                self.drop(old, f"decode rank {hello.key} said hello again (restarted or reconnecting)")
            if self._still_closing(key=hello.key):  # the ack tells the decode rank no old write can land
                if hello.key not in self._waiting:
                    log.info("prefill rank %d: the hello of decode rank %s waits for the writes to its old "
                             "entry to end", mine.tp_rank, hello.key)
                self._waiting[hello.key] = (identity, hello, since)
                return
            try:
                connected = self._connect(hello, theirs)
            except PeerDraining as exc:
                if hello.key not in self._waiting:
                    log.info("prefill rank %d: the hello of decode rank %s waits: %s", mine.tp_rank, hello.key, exc)
                self._waiting[hello.key] = (identity, hello, since)
                return
            self._waiting.pop(hello.key, None)
            if isinstance(connected, str):
                error = connected
            else:
                backend, peer, regions = connected
                entry = self.peers[hello.key] = DecodePeer(
                    hello, identity, layout, backend, self._owner.endpoints.regions[backend], regions, peer,
                    reads_from_me=mine.tp_rank in readers, writes_aux=bool(readers) and readers[0] == mine.tp_rank,
                    session=PeerSession.answering(self._owner.config, time.monotonic(), process_of(hello)))
                entry.plan_ahead_or_log(mine, hello.key)
                self._by_identity[identity] = hello.key
                self._dropped.pop(identity, None)
                log.info("prefill rank %d: decode rank %s connected over %s", mine.tp_rank, hello.key, backend)
        if error:
            log.warning("prefill rank %d refused decode rank %s: %s", mine.tp_rank, hello.key, error)
        self.ack(identity, error, entry.backend if entry is not None else "")

    def ack(self, identity: bytes, error: str, backend: str = "") -> None:
        """Answer a hello: ``error`` empty when accepted, ``backend`` what this rank writes through."""
        ack = HelloAck(error=error, incarnation=self._owner.incarnation, process=wire_of(self._owner.process),
                       backend=backend)
        self._router.send_multipart([identity, ack.to_msgpack()], zmq.NOBLOCK)

    def _connect(self, hello: DecodeHello, theirs: dict):
        """``(backend, transport Peer, the decode rank's BufferRegions)`` over the best shared
        transport that connects, else why none did (a str). ``PeerDraining`` when none
        connects and one of them only cannot yet."""
        mine = self._owner.endpoints.transports
        candidates = pick_backend(mine, theirs, same_host=hello.host == self._owner.host)
        if not candidates:
            return f"no transport in common: this side {sorted(mine)}, peer {sorted(theirs)}"
        failures, draining = [], None
        for backend in candidates:
            try:
                regions = BufferRegions.from_wire(theirs[backend].regions)
                return backend, mine[backend].connect(theirs[backend].export), regions
            except PeerDraining as exc:
                draining = draining or PeerDraining(f"{backend}: {exc}")
            except (PeerDescriptorError, TransportError, ValueError) as exc:
                failures.append(f"{backend}: {exc}")
                log.info("prefill rank %d: %s to decode rank %s unusable: %s", self._rank, backend, hello.key, exc)
        if draining is not None:
            raise draining
        return "cannot connect to the decode rank's transport (" + "; ".join(failures) + ")"

    def not_connected(self, identity: bytes, msg) -> None:
        """A message from a socket without a hello: a decode rank dropped as lost (alive after
        all: a loaded machine paused it past the heartbeat timeout) or a stranger. Answered
        with NotConnected, so that a live decode rank fails what it asked of this rank and says
        hello again; logged once per socket. Not while writes to the rank dropped with that
        socket are still in flight: NotConnected tells the decode rank that none can land."""
        if self._still_closing(identity=identity):
            return
        when, reason, logged = self._dropped.get(identity, (time.monotonic(), "", False))
        if not logged:
            log.warning("prefill rank %d: %s from %s; answered not_connected", self._rank, msg.KIND,
                        f"a decode rank it dropped ({reason})" if reason else "a socket without a hello")
            self._dropped[identity] = (when, reason, True)
        self.send_to(identity, NotConnected(incarnation=self._owner.incarnation,
                                            reason=reason or "this prefill rank holds no hello of it"),
                     "a socket without a hello")

    # -- heartbeats, departures, losses ---------------------------------------------------
    def answer_heartbeat(self, peer: DecodePeer, msg: Heartbeat) -> None:
        self._router.send_multipart([peer.identity, Heartbeat(seq=msg.seq, incarnation=self._owner.incarnation)
                                     .to_msgpack()], zmq.NOBLOCK)

    def leave(self, peer: DecodePeer, goodbye: Goodbye) -> None:
        """The rank said ``goodbye``: forgotten now, answered by :meth:`close_settled`."""
        self.peers.pop(peer.key, None)
        writes = self._on_drop(peer.key, f"decode rank {peer.key} said goodbye")
        self._by_identity.pop(peer.identity, None)
        peer.session.enter(PeerState.GONE, time.monotonic())
        self._closing.append((peer, writes, True))

    def _still_closing(self, key=None, identity=None) -> bool:
        """Whether a dropped or leaving rank of ``key`` (or of socket ``identity``) still has
        writes in flight (its transport peer not closed yet)."""
        self.close_settled()
        return any(peer.key == key or peer.identity == identity for peer, _, _ in self._closing)

    def close_settled(self) -> None:
        """Close the transport peer of each dropped or leaving rank whose writes have all ended
        (a leaving one's goodbye is answered then): cancelled writes end once nothing of them
        can land, or at their deadline."""
        keep = []
        for peer, writes, goodbye in self._closing:
            writes = [t for t in writes if t.status() is TransferStatus.PENDING]
            if writes:
                keep.append((peer, writes, goodbye))
                continue
            self._close(peer)
            if goodbye:
                self._router.send_multipart([peer.identity, Goodbye(incarnation=self._owner.incarnation)
                                             .to_msgpack()], zmq.NOBLOCK)
        self._closing = keep

    def drop_silent(self, now: float, read) -> None:
        """Drop the ranks silent past the heartbeat timeout, after ``read()`` has read what came
        meanwhile (a long turn here is this rank's pause, not their silence)."""
        lost = confirm_silent(list(self.peers.values()), lambda p: p.session, now, lambda _: read(),
                              lambda p: self.peers.get(p.key) is p)
        for peer in lost:
            self.peers.pop(peer.key, None)
            self.drop(peer, f"decode rank {peer.key} lost: no heartbeat for "
                            f"{self._owner.config.heartbeat_timeout_s:g} s")

    def sweep(self, now: float, horizon: float) -> None:
        """Drop the ranks silent for two heartbeat intervals whose process has ended (no need to
        wait for the heartbeat timeout: :mod:`kvtransfer.control.liveness`); try the waiting
        hellos again; forget the sockets dropped before ``horizon``."""
        for key, peer in list(self.peers.items()):
            ended = peer.session.process_ended(self._owner.process) if peer.session.suspect(now) else None
            if ended is not None:
                del self.peers[key]
                self.drop(peer, f"decode rank {key} lost: {ended}")
        for key, (identity, hello, since) in list(self._waiting.items()):
            if now - since > self._owner.config.handshake_timeout_s:  # it has given up on this hello by now
                del self._waiting[key]
                log.warning("prefill rank %d: the hello of decode rank %s waited %g s for its transport; "
                            "left unanswered", self._rank, key, self._owner.config.handshake_timeout_s)
            else:
                self._answer(identity, hello, since)
        for identity in [i for i, (when, _, _) in self._dropped.items() if when < horizon]:
            del self._dropped[identity]  # a later message from it is answered all the same

    def drop_lost(self, keys) -> None:
        """Drop the ranks among ``keys`` (those a write failed to) whose transport peer is lost
        (``Peer.lost``: the transport refuses every later write to it until a new connect, which
        the rank's next hello makes). A write that failed without losing the peer (its post was
        refused) fails its request alone."""
        for key in keys:
            peer = self.peers.get(key)
            lost = None if peer is None else peer.peer.lost
            if lost is not None:
                del self.peers[key]
                self.drop(peer, f"decode rank {key} lost by its {peer.backend} transport: {lost}")

    def drop(self, peer: DecodePeer, reason: str) -> None:
        """Drop a rank already taken out of :attr:`peers`: its requests fail, its transport peer
        closes once their writes to it ended (:meth:`close_settled`), and its socket is
        answered NotConnected from now on."""
        log.warning("prefill rank %d: %s", self._rank, reason)
        peer.session.enter(PeerState.LOST, time.monotonic(), reason)
        writes = self._on_drop(peer.key, reason)
        self._by_identity.pop(peer.identity, None)
        self._dropped[peer.identity] = (time.monotonic(), reason, False)
        self._closing.append((peer, writes, False))
        self.close_settled()

    def close(self) -> None:
        """Tell every rank this one closes (they stop asking it at once); close transport peers."""
        for key in list(self.peers):
            self.send(key, Goodbye(incarnation=self._owner.incarnation))
        for peer in [*self.peers.values(), *(entry[0] for entry in self._closing)]:
            self._close(peer)
        self.peers.clear()
        self._closing.clear()

    @staticmethod
    def _close(peer: DecodePeer) -> None:
        try:
            peer.peer.close()
        except TransportError as exc:
            log.debug("closing the transport peer of %s: %s", peer.key, exc)
