"""The decode side of the control plane: :class:`DecodeKVManager` and :class:`KVReceiver`.

One manager per decode rank. At start it registers its pools' buffers with its transports
(``nixl``; ``nvlink`` beside it for CUDA pools: each prefill rank picks one), asks the
bootstrap service for the prefill ranks of its DP group, and says hello to each of them; a
refused hello (layouts that cannot exchange data) raises :class:`HandshakeError` with the
prefill rank's reason. It reads from the ranks
``senders_for`` names; the others are told of each request too, so that none waits for it.

Per request, the engine reserves the pages, then::

    receiver = manager.receiver(request_id)
    receiver.init(dst_slots, prefix_tokens=k, state_slot=s)   # tells every sender where to write
    ... receiver.poll() until KVPoll.Success (or Failed: receiver.failure says why)
    token_id, logprob = receiver.first_token()
    receiver.close()                                          # forget it, free its aux record

``dst_slots`` are the slots of the tokens after the first ``prefix_tokens`` (which this rank
already holds). Success means every expected sender's KV, state and aux writes have landed
(each write's notification counted; the last one says how many there are).

Page reuse: a request that failed or was aborted may still have writes in flight on
prefill ranks. ``receiver.released`` turns True once every sender has said ``Quiesced``, or
was lost in a way that proves it writes nothing more: reuse the request's pages only then. A
rank lost to silence may be only paused, so the requests it was lost with are *fenced*: released
once it answers a new hello (it drops its old entry of this rank with drain before it
acknowledges), answers ``NotConnected`` (it dropped it so already), restarts or says goodbye, is
seen to have ended (on one host: its process, named in its hello ack, is gone from ``/proc``,
:mod:`kvtransfer.control.liveness`; on any host: the transport it writes here through, named
in its hello ack, says that writer let go or is lost, ``Transport.writer_gone``), or after
``transfer_timeout_s`` without any of these (a prefill rank posts no chunk past a request's
deadline).

Failures: a prefill rank that stops answering heartbeats for ``heartbeat_timeout_s`` fails
every request that expects it, and is reconnected once the bootstrap service lists a new
incarnation of it (a restarted rank). A new request that needs a lost rank waits up to
``heartbeat_timeout_s`` for it to come back (a restarted node can be serving again before
this rank has looked it up) and then fails naming it; a request not done after ``transfer_timeout_s`` fails
and is aborted on its senders. A rank silent for two heartbeat intervals is *suspect*: no
request is asked of it meanwhile, and the bootstrap service is asked whether it restarted,
so a rank that was killed and came back is reconnected without waiting for the timeout; a
suspect rank seen to have ended (as for a fence, above) is lost at once, its requests settled.
A lost rank is still sent heartbeats: one that answers was alive after all (one side's loop
was paused past the timeout), and this rank says hello to it again; so it does when a prefill
rank answers ``NotConnected`` (it dropped this rank as lost). Silence is counted from the first
unanswered heartbeat, not from the last message, and what came during a long turn is read
before a rank is called lost: a pause of this rank's own loop is not the peer's silence (the
prefill manager likewise reads its socket before it drops a decode rank).

Threads: as for the prefill manager, every transport and socket call happens in a turn of the
event loop (here always on its thread).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import zmq

from kvtransfer.control.bootstrap import BootstrapClient, BootstrapError
from kvtransfer.control.common import (SWEEP_INTERVAL_S, AuxRecords, ControlConfig, Endpoints, EventLoop,
                                      default_host_id, unpack_first_token)
from kvtransfer.control.liveness import ProcessId, ended, wire_of
from kvtransfer.control.state import KVPoll, RequestStatus, RequestTable
from kvtransfer.control.wire import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeHello,
    Endpoint,
    Goodbye,
    Heartbeat,
    HelloAck,
    KVArrived,
    NotConnected,
    Quiesced,
    RegisterPrefill,
    TransferRequest,
    VersionMismatch,
    WireError,
    decode,
    endpoints_of,
    process_of,
)
from kvtransfer.layout import RankLayout, StateKind
from kvtransfer.plan import senders_for

__all__ = ["DecodeKVManager", "HandshakeError", "KVReceiver"]

log = logging.getLogger("kvtransfer.control.decode")

LOOKUP_INTERVAL_S = 0.5  # how often lost or suspect prefill ranks are looked up at the bootstrap service


class HandshakeError(ConnectionError):
    """A prefill rank refused this decode rank's hello, or never answered it."""


class KVReceiver:
    """One request on this decode rank (see the module docstring)."""

    def __init__(self, manager: "DecodeKVManager", request_id: str):
        self.request_id = request_id
        self.status = RequestStatus(request_id)
        self._mgr = manager
        self._aux_slot: Optional[int] = None
        self._released = False
        self._inited = False
        self._has_aux = False

    def init(self, dst_slots, *, prefix_tokens: int = 0, state_slot: Optional[int] = None) -> None:
        """Tell every sender where this request's bytes go (see the module docstring)."""
        if self._inited:
            raise ValueError(f"request {self.request_id!r}: init() called twice")
        layout = self._mgr.layout
        arr = np.asarray(dst_slots)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"dst_slots must be a 1-D array of ints, got {arr.dtype} of shape {list(arr.shape)}")
        arr = arr.astype("<i8")
        if arr.size and (arr.min() <= 0 or arr.max() >= layout.num_slots):
            raise ValueError(f"dst_slots must lie in [1, {layout.num_slots}) (slot 0 is padding), got values in "
                             f"[{arr.min()}, {arr.max()}]")
        if not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be an int >= 0, got {prefix_tokens!r}")
        if layout.state_kind is StateKind.MAMBA:
            if not isinstance(state_slot, int) or not 0 < state_slot < layout.state_num_slots:
                raise ValueError(f"this model has Mamba state: state_slot must be an int in [1, "
                                 f"{layout.state_num_slots}), got {state_slot!r}")
        self._inited = True
        self._mgr._loop.call(self._mgr._on_init, self, arr.tobytes(), prefix_tokens,
                             -1 if state_slot is None else int(state_slot))

    def poll(self) -> KVPoll:
        return self.status.state

    @property
    def failure(self) -> Optional[str]:
        return self.status.reason

    @property
    def released(self) -> bool:
        """No byte of this request's writes can still land: its pages may be reused."""
        return self._released

    def first_token(self) -> tuple:
        """``(token_id, logprob)`` from the aux record, once Success."""
        if self.status.state is not KVPoll.Success or not self._has_aux:
            raise ValueError(f"request {self.request_id!r} has no aux record ({self.status.state.name}, "
                             f"{'one' if self._has_aux else 'none'} arrived)")
        return unpack_first_token(self._mgr._aux.read(self._aux_slot))

    def abort(self, reason: str = "aborted by decode") -> None:
        self._mgr._loop.call(self._mgr._fail, self.request_id, reason, True)

    def close(self) -> None:
        """Forget the request (aborting it if it has not ended) and free its aux record."""
        self._mgr._loop.call(self._mgr._close_receiver, self)


class _PeerState(enum.Enum):
    CONNECTING = "connecting"  # hello sent, no answer yet
    READY = "ready"
    REFUSED = "refused"  # the hello was refused: error says why
    LOST = "lost"  # no heartbeat answer in time; waiting for a new incarnation
    GONE = "gone"  # said goodbye and was answered: it can no longer write here


@dataclass
class _PrefillPeer:
    """A prefill rank this rank reads from (loop thread only)."""

    registration: RegisterPrefill
    socket: object
    state: _PeerState
    since: float  # when the state was entered
    unanswered_since: Optional[float] = None  # when the first heartbeat not followed by any message went
    incarnation: str = ""  # the one its hello ack named
    process: Optional[ProcessId] = None  # the process its hello ack named (None: it could not)
    writer: Optional[Endpoint] = None  # its endpoint on the transport its hello ack says it writes through
    error: str = ""
    heartbeat_seq: int = 0
    last_heartbeat: float = 0.0


@dataclass
class _Fence:
    """Failed requests of a prefill rank lost by its silence: their pages wait for proof that
    none of its writes for them can still land (loop thread only)."""

    since: float
    requests: set = field(default_factory=set)


@dataclass
class _Incoming:
    """A request's progress on this rank (loop thread only)."""

    receiver: KVReceiver
    since: float  # when the engine made it
    deadline: float
    counts: dict = field(default_factory=dict)  # prefill rank -> writes landed
    totals: dict = field(default_factory=dict)  # prefill rank -> writes it made (from its last one)
    quiesced: set = field(default_factory=set)  # prefill ranks with nothing in flight for it
    asked: bool = False
    request: Optional[tuple] = None  # (dst_slots bytes, prefix_tokens, state_slot) until asked


class DecodeKVManager:
    """The KV manager of one decode rank (see the module docstring)."""

    def __init__(self, layout: RankLayout, transports, kv_infos, state_infos=None, *, bootstrap: str,
                 instance: Optional[str] = None, config: ControlConfig = ControlConfig(),
                 device: Optional[int] = None, host_id: Optional[str] = None):
        if not isinstance(layout, RankLayout):
            raise TypeError(f"layout must be a RankLayout, got {type(layout).__name__}")
        self.layout, self.config = layout, config
        self.instance = instance or f"decode-{uuid.uuid4().hex[:12]}"
        self.incarnation = uuid.uuid4().hex
        self._host = host_id or default_host_id()
        self._process = ProcessId.mine()
        self._bootstrap = BootstrapClient(bootstrap)
        topo = self._bootstrap.wait_for_topology(config.dp_rank, deadline_s=config.bootstrap_timeout_s)
        self.prefill_tp_size = topo.tp_size
        self.senders = senders_for(layout, topo.tp_size)
        self.endpoints = Endpoints(transports, kv_infos, state_infos, device)
        self._aux = AuxRecords(config.aux_slots)  # plain memory: records arrive on notifications
        self._ctx = zmq.Context()
        self._receivers: RequestTable = RequestTable()
        self._incoming: dict = {}  # request id -> _Incoming
        self._held: set = set()  # request ids whose ask waits for a sender (_ask)
        self._next_sweep = 0.0  # when _tick next looks at every request's deadline
        self._peers: dict = {}  # prefill tp rank -> _PrefillPeer
        self._by_name: dict = {}  # transport name -> prefill tp rank
        self._fences: dict = {}  # prefill tp rank -> _Fence: a silent rank's failed requests, pages held
        self._last_lookup = 0.0
        self._closing = False  # set by close(): a Goodbye then answers ours
        self._loop = EventLoop(f"kvt-decode{layout.tp_rank}", {}, self._tick)
        for reg in topo.rank_infos():  # every prefill rank: those it does not read from are told too
            self._connect(reg)
        self._loop.start()
        try:
            self._await_handshakes()
        except BaseException:
            self.close()
            raise

    # -- the owner's API --------------------------------------------------------------
    def receiver(self, request_id: str) -> KVReceiver:
        """A new request on this rank; raises DuplicateRequest while ``request_id`` is live."""
        receiver = self._receivers.add(request_id, KVReceiver(self, request_id))
        self._loop.call(self._on_new_receiver, receiver, wake=False)  # init() wakes the loop
        return receiver

    @property
    def aux_available(self) -> int:
        """Aux records not in use (all but slot 0 when idle)."""
        return self._aux.available

    @property
    def num_requests(self) -> int:
        return len(self._receivers)

    def ready_senders(self) -> list:
        """The prefill ranks whose handshake holds now (a lost rank leaves the list until it
        is back)."""
        return self._loop.call(lambda: sorted(r for r, p in self._peers.items() if p.state is _PeerState.READY)) \
            .result(timeout=10)

    def close(self) -> None:
        """Fail what is in flight, close sockets and the thread, deregister (idempotent)."""
        if self._ctx.closed:
            return
        self._loop.close(final=self._shutdown)
        self._ctx.term()
        self.endpoints.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- handshakes -----------------------------------------------------------------------
    def _connect(self, reg: RegisterPrefill) -> None:
        """Open a control socket to a prefill rank and say hello (loop thread, or before start)."""
        old = self._peers.get(reg.tp_rank)
        if old is not None:
            self._loop.remove_socket(old.socket)
            old.socket.close()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(reg.control_addr)
        now = time.monotonic()
        peer = _PrefillPeer(reg, sock, _PeerState.CONNECTING, since=now)
        self._peers[reg.tp_rank] = peer
        for ep in endpoints_of(reg).values():
            self._by_name[ep.name] = reg.tp_rank
        self._loop.add_socket(sock, lambda: self._on_socket(peer))
        sock.send(DecodeHello(
            instance=self.instance, dp_rank=self.config.dp_rank, tp_rank=self.layout.tp_rank,
            tp_size=self.layout.tp_size, host=self._host, endpoints=self.endpoints.wire(),
            layout=self.layout.to_msgpack(), incarnation=self.incarnation,
            process=wire_of(self._process)).to_msgpack(), zmq.NOBLOCK)

    def _await_handshakes(self) -> None:
        deadline = time.monotonic() + self.config.handshake_timeout_s
        while True:
            states = self._loop.call(lambda: {r: (p.state, p.error) for r, p in self._peers.items()}).result()
            refused = {r: e for r, (s, e) in states.items() if s is _PeerState.REFUSED}
            if refused:
                raise HandshakeError("; ".join(f"prefill rank {r} refused decode rank {self.layout.tp_rank}: {e}"
                                               for r, e in sorted(refused.items())))
            waiting = sorted(r for r, (s, _) in states.items() if s is not _PeerState.READY)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise HandshakeError(f"decode rank {self.layout.tp_rank}: no answer to its hello from prefill ranks "
                                     f"{waiting} within {self.config.handshake_timeout_s:g} s")
            time.sleep(0.005)

    def _on_socket(self, peer: _PrefillPeer) -> None:
        rank = peer.registration.tp_rank
        for _ in range(256):
            try:
                frame = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except WireError as exc:
                if isinstance(exc, VersionMismatch) and peer.state is _PeerState.CONNECTING:  # the answer to our hello
                    peer.state, peer.error = _PeerState.REFUSED, f"it speaks control protocol {exc.version!r}, " \
                                                                 f"this rank {PROTOCOL_VERSION}"
                    log.error("prefill rank %d refused decode rank %d: %s", rank, self.layout.tp_rank, peer.error)
                    continue
                log.warning("decode rank %d dropped a frame from prefill rank %d: %s", self.layout.tp_rank, rank, exc)
                continue
            peer.unanswered_since = None
            if isinstance(msg, HelloAck):
                self._on_ack(peer, msg)
            elif isinstance(msg, Heartbeat):
                if peer.incarnation and msg.incarnation != peer.incarnation:
                    self._lose(rank, f"prefill rank {rank} restarted", settled=True)
                elif peer.state is _PeerState.LOST:  # the rank it timed out is alive: connect anew
                    self._reconnect(peer, f"prefill rank {rank}, lost, answered a heartbeat")
                    return  # the socket was replaced
            elif isinstance(msg, NotConnected):
                if self._on_not_connected(peer, msg):
                    return  # the socket was replaced
            elif isinstance(msg, AbortRequest):
                self._fail(msg.request_id, msg.reason, tell_senders=False)
            elif isinstance(msg, Goodbye):
                if self._closing:  # the answer to ours: it can no longer write here
                    peer.state = _PeerState.GONE
                else:  # the prefill rank is closing (its writes ended first): lost until a new incarnation registers
                    self._lose(rank, f"prefill rank {rank} closed", settled=True)
            elif isinstance(msg, Quiesced):
                fence = self._fences.get(rank)
                if fence is not None:  # said by the rank itself: proof for this request
                    fence.requests.discard(msg.request_id)
                inc = self._incoming.get(msg.request_id)
                if inc is not None:
                    inc.quiesced.add(rank)
                    self._maybe_release(inc)
            else:
                log.warning("decode rank %d dropped an unexpected %s", self.layout.tp_rank, msg.KIND)

    def _on_not_connected(self, peer: _PrefillPeer, msg: NotConnected) -> bool:
        """The prefill rank dropped this rank (it was silent past the heartbeat timeout: a
        pause, not a death). Fail what waits for it and say hello again; True if the socket
        was replaced. A new incarnation (a restart at the same address) is left to the
        bootstrap lookup, which knows its new endpoints."""
        rank = peer.registration.tp_rank
        if self._closing or peer.state not in (_PeerState.READY, _PeerState.LOST):
            return False  # closing, or a hello of this socket is on its way, or refused / gone
        if peer.incarnation and msg.incarnation != peer.incarnation:
            self._lose(rank, f"prefill rank {rank} restarted", settled=True)
            return False
        # it holds no entry of this rank: it dropped it, failing its requests and closing its
        # transport peer with drain, before it could answer so
        self._lose(rank, f"prefill rank {rank} dropped this rank: {msg.reason}", settled=True)
        self._reconnect(peer, f"prefill rank {rank} had dropped it")
        return True

    def _reconnect(self, peer: _PrefillPeer, why: str) -> None:
        """Say hello again to a live rank that was lost (one side timed the other out): a fresh
        socket, and the prefill rank replaces its old entry of this rank."""
        log.info("decode rank %d: %s; saying hello again", self.layout.tp_rank, why)
        self._connect(peer.registration)

    def _on_ack(self, peer: _PrefillPeer, ack: HelloAck) -> None:
        if ack.error:
            peer.state, peer.error = _PeerState.REFUSED, ack.error
            log.error("prefill rank %d refused decode rank %d: %s", peer.registration.tp_rank, self.layout.tp_rank,
                      ack.error)
            return
        peer.state, peer.incarnation, peer.since = _PeerState.READY, ack.incarnation, time.monotonic()
        peer.process, peer.writer = process_of(ack), endpoints_of(peer.registration).get(ack.backend)
        # the same process replaced its old entry of this rank (requests failed, transport peer
        # closed with drain) before it answered; another one means the old process is gone
        self._settle(peer.registration.tp_rank, "answered a new hello")
        self._ask_held()  # requests that waited for this rank

    # -- requests -------------------------------------------------------------------------
    def _on_new_receiver(self, receiver: KVReceiver) -> None:
        now = time.monotonic()
        self._incoming[receiver.request_id] = _Incoming(receiver, now, now + self.config.transfer_timeout_s)

    def _on_init(self, receiver: KVReceiver, dst: bytes, prefix: int, state_slot: int) -> None:
        inc = self._incoming.get(receiver.request_id)
        if inc is None or receiver.status.state.final:
            return
        aux = self._aux.alloc()
        if aux is None:
            self._fail(receiver.request_id, f"all {self.config.aux_slots - 1} aux records are in use", False)
            return
        receiver._aux_slot = aux
        inc.request = (dst, prefix, state_slot)
        self._ask(inc)

    def _ask(self, inc: _Incoming) -> None:
        """Send the request to every prefill rank once the senders are ready (ranks it does
        not read from learn that they have nothing to write); fail it if a sender cannot be."""
        if inc.asked or inc.request is None or inc.receiver.status.state.final:
            return
        peers = [self._peers[r] for r in self.senders]
        now = time.monotonic()
        down = [p for p in peers if p.state in (_PeerState.REFUSED, _PeerState.GONE)
                or (p.state is _PeerState.LOST and now - inc.since >= self.config.heartbeat_timeout_s)]
        if down:
            p = down[0]
            why = p.error or f"prefill rank {p.registration.tp_rank} is {p.state.value}"
            self._fail(inc.receiver.request_id, why, tell_senders=True)  # the ranks that are up drop it too
            inc.quiesced.update(self.senders)  # nothing was asked: nothing can land
            self._maybe_release(inc)
            return
        rid = inc.receiver.request_id
        if any(p.state is not _PeerState.READY or self._suspect(p, now) for p in peers):
            self._held.add(rid)  # a sender is (re)connecting, silent or lost but maybe back soon:
            return  # asked once it is ready (_ask_held)
        self._held.discard(rid)
        dst, prefix, state_slot = inc.request
        for p in self._peers.values():
            if p.state is not _PeerState.READY:
                continue
            p.socket.send(TransferRequest(request_id=rid, instance=self.instance, decode_tp_rank=self.layout.tp_rank,
                                          dst_slots=dst, prefix_tokens=prefix, state_slot=state_slot)
                          .to_msgpack(), zmq.NOBLOCK)
        inc.asked = True
        inc.receiver.status.advance(KVPoll.WaitingForInput)

    def _ask_held(self) -> None:
        """Ask again for the requests held back by :meth:`_ask` (those that end are let go)."""
        for rid in list(self._held):
            inc = self._incoming.get(rid)
            if inc is None or inc.asked or inc.receiver.status.state.final:
                self._held.discard(rid)
            else:
                self._ask(inc)

    def _on_arrived(self, sender: str, payload: bytes) -> None:
        rank = self._by_name.get(sender)
        try:
            note = KVArrived.from_msgpack(payload)
        except WireError as exc:
            log.warning("decode rank %d dropped a notification from %r: %s", self.layout.tp_rank, sender, exc)
            return
        inc = self._incoming.get(note.request_id)
        if rank is None or inc is None or inc.receiver.status.state.final:
            return  # an ended or unknown request: its late notification means nothing now
        inc.counts[rank] = inc.counts.get(rank, 0) + 1
        if note.total:
            inc.totals[rank] = note.total
        if note.aux and inc.receiver._aux_slot is not None:
            self._aux.write(inc.receiver._aux_slot, note.aux)
            inc.receiver._has_aux = True
        inc.receiver.status.advance(KVPoll.Transferring)
        if all(inc.totals.get(r) is not None and inc.counts.get(r, 0) >= inc.totals[r] for r in self.senders):
            if inc.receiver.status.advance(KVPoll.Success):
                inc.receiver._released = True

    def _fail(self, request_id: str, reason: str, tell_senders: bool) -> None:
        inc = self._incoming.get(request_id)
        if inc is None or not inc.receiver.status.fail(reason):
            return
        log.info("request %s failed on decode rank %d: %s", request_id, self.layout.tp_rank, reason)
        if tell_senders:  # asked or not: a prefill rank may hold a sender for it already
            for peer in self._peers.values():
                if peer.state is _PeerState.READY:
                    peer.socket.send(AbortRequest(request_id=request_id, reason=reason).to_msgpack(), zmq.NOBLOCK)
        if not inc.asked:
            inc.quiesced.update(self.senders)
        for r in self.senders:  # a refused or gone sender writes nothing more; a lost one is fenced
            if self._peers[r].state is not _PeerState.READY and not self._fenced(r, request_id):
                inc.quiesced.add(r)
        self._maybe_release(inc)

    def _maybe_release(self, inc: _Incoming) -> None:
        if inc.receiver.status.state is KVPoll.Failed and inc.quiesced >= set(self.senders):
            inc.receiver._released = True

    def _close_receiver(self, receiver: KVReceiver) -> None:
        self._fail(receiver.request_id, "closed by its owner", tell_senders=True)
        inc = self._incoming.pop(receiver.request_id, None)
        self._held.discard(receiver.request_id)
        if receiver._aux_slot is not None:
            self._aux.free(receiver._aux_slot)
            receiver._aux_slot = None
        self._receivers.pop(receiver.request_id)
        if inc is not None and not receiver.released:
            log.warning("request %s closed before its senders quiesced: its pages are not safe to reuse yet",
                        receiver.request_id)

    # -- timers, heartbeats, notifications ---------------------------------------------------
    def _tick(self) -> float:
        for transport in self.endpoints.transports.values():
            for note in transport.poll_notifications():
                self._on_arrived(note.sender, note.payload)
        now = time.monotonic()
        cfg = self.config
        silent = []
        for rank, peer in self._peers.items():
            if peer.state in (_PeerState.READY, _PeerState.LOST):  # a lost rank is asked too: it may be alive
                if now - peer.last_heartbeat >= cfg.heartbeat_interval_s:
                    peer.heartbeat_seq += 1
                    peer.last_heartbeat = now
                    try:
                        peer.socket.send(Heartbeat(seq=peer.heartbeat_seq, incarnation=self.incarnation)
                                         .to_msgpack(), zmq.NOBLOCK)
                    except zmq.Again:  # a dead rank's queue is full: nothing to tell it
                        pass
                    if peer.unanswered_since is None:
                        peer.unanswered_since = now
            if peer.state is _PeerState.READY:
                if self._silent(peer, now) > cfg.heartbeat_timeout_s:
                    silent.append(peer)
            elif peer.state is _PeerState.CONNECTING and now - peer.since > cfg.handshake_timeout_s:
                self._lose(rank, f"prefill rank {rank} did not answer its hello within {cfg.handshake_timeout_s:g} s")
        for peer in silent:  # read what came meanwhile first: a long turn here is this rank's pause
            self._on_socket(peer)
            rank = peer.registration.tp_rank
            if self._peers[rank] is peer and peer.state is _PeerState.READY \
                    and self._silent(peer, now) > cfg.heartbeat_timeout_s:
                self._lose(rank, f"prefill rank {rank} lost: no answer for {cfg.heartbeat_timeout_s:g} s")
        doubtful = any(p.state is _PeerState.LOST or self._suspect(p, now) for p in self._peers.values())
        if doubtful and now - self._last_lookup > LOOKUP_INTERVAL_S:
            self._last_lookup = now
            self._reconnect_restarted()
        if self._held:
            self._ask_held()
        if now >= self._next_sweep:  # deadlines are seconds long: a look every SWEEP_INTERVAL_S, not every turn
            self._next_sweep = now + SWEEP_INTERVAL_S
            for rank, peer in list(self._peers.items()):  # silent, or lost with pages fenced: is it dead?
                if self._suspect(peer, now) or rank in self._fences:
                    gone = self._gone(peer)
                    if gone is not None:
                        self._lose(rank, f"prefill rank {rank} lost: {gone}", settled=True)
            for rank, fence in list(self._fences.items()):
                if now - fence.since > cfg.transfer_timeout_s:
                    log.warning("decode rank %d: no word from lost prefill rank %d for %g s: the pages of the "
                                "requests it was lost with are released (a prefill rank posts no write past a "
                                "request's deadline)", self.layout.tp_rank, rank, cfg.transfer_timeout_s)
                    self._settle(rank, f"was silent for {cfg.transfer_timeout_s:g} s")
            for rid, inc in list(self._incoming.items()):
                if not inc.receiver.status.state.final and now > inc.deadline:
                    waiting = [r for r in self.senders if inc.counts.get(r, 0) < inc.totals.get(r, 1 << 62)]
                    self._fail(rid, f"not done after {cfg.transfer_timeout_s:g} s (waiting for prefill ranks "
                                    f"{waiting})", tell_senders=True)
        busy = any(not i.receiver.status.state.final for i in self._incoming.values())  # stops at the first
        return cfg.loop_pause(busy)

    def _lose(self, rank: int, reason: str, settled: bool = False) -> None:
        """Rank ``rank`` is lost: fail what was asked of it. ``settled``: the loss itself
        proves that none of its writes can still land (it restarted, closed, or dropped this
        rank with drain); otherwise a ready rank's failed requests are fenced (:meth:`_settle`)."""
        peer = self._peers[rank]
        if peer.state is _PeerState.LOST:
            if settled:
                self._settle(rank, reason)
            return
        log.warning("decode rank %d: %s", self.layout.tp_rank, reason)
        was_ready = peer.state is _PeerState.READY
        peer.state, peer.error, peer.since = _PeerState.LOST, reason, time.monotonic()
        if rank not in self.senders:
            return  # none of this rank's requests waits for its bytes
        if was_ready and not settled:  # silent, maybe only paused: it may still post writes
            fence = self._fences.setdefault(rank, _Fence(time.monotonic()))
            fence.requests.update(rid for rid, inc in self._incoming.items() if inc.asked and rank not in inc.quiesced
                                  and inc.receiver.status.state is not KVPoll.Success)
        for rid, inc in list(self._incoming.items()):
            if inc.receiver.status.state.final:
                if not self._fenced(rank, rid):
                    inc.quiesced.add(rank)
                    self._maybe_release(inc)
            elif inc.asked:
                self._fail(rid, reason, tell_senders=True)
            # not asked yet: nothing of it went there; it waits for the rank a while (_ask)
        if settled:
            self._settle(rank, reason)

    def _fenced(self, rank: int, request_id: str) -> bool:
        fence = self._fences.get(rank)
        return fence is not None and request_id in fence.requests

    def _settle(self, rank: int, why: str) -> None:
        """None of lost rank ``rank``'s writes for its fenced requests can land any more
        (``why``): they count as quiesced by it, and their pages are released."""
        fence = self._fences.pop(rank, None)
        if fence is None:
            return
        released = 0
        for rid in fence.requests:
            inc = self._incoming.get(rid)
            if inc is not None and rank not in inc.quiesced:
                inc.quiesced.add(rank)
                self._maybe_release(inc)
                released += 1
        if released:
            log.info("decode rank %d: prefill rank %d %s: %d failed request(s) it was lost with can no longer be "
                     "written, their pages are released", self.layout.tp_rank, rank, why, released)

    def _gone(self, peer: _PrefillPeer) -> Optional[str]:
        """How a prefill rank (suspect, or lost with pages fenced) is known to write nothing
        more here, else None: its process has ended (one host: :mod:`kvtransfer.control.liveness`),
        or the transport it writes here through (its hello ack named it) says that writer let go
        or is lost (:meth:`transport.base.Transport.writer_gone`: across hosts, NIXL's 1-byte
        probe write failing with a disconnect, one every 0.2 s at most)."""
        if ended(peer.process, self._process):
            return f"its process (pid {peer.process.pid}) has exited"
        transport = self.endpoints.transports.get(peer.writer.backend) if peer.writer is not None else None
        why = transport.writer_gone(peer.writer.name) if transport is not None else None
        return f"its {peer.writer.backend} transport {why}" if why is not None else None

    def _suspect(self, peer: _PrefillPeer, now: float) -> bool:
        """A ready rank silent for two heartbeat intervals (not lost yet)."""
        return peer.state is _PeerState.READY and self._silent(peer, now) > 2 * self.config.heartbeat_interval_s

    @staticmethod
    def _silent(peer: _PrefillPeer, now: float) -> float:
        """How long the rank has left a heartbeat unanswered. Counted from the heartbeat, not
        from its last message: a rank answers heartbeats, so while this rank's own loop was
        paused (a loaded machine) and sent none, its silence is not the peer's."""
        return 0.0 if peer.unanswered_since is None else now - peer.unanswered_since

    def _reconnect_restarted(self) -> None:
        """Look the lost and suspect ranks up at the bootstrap service; a new incarnation
        means the old process is gone (lost now, if it was not yet): connect to the new one."""
        try:
            topo = self._bootstrap.topology(self.config.dp_rank, timeout_s=0.2)
        except BootstrapError as exc:
            log.debug("bootstrap lookup failed: %s", exc)
            return
        now = time.monotonic()
        for reg in topo.rank_infos():
            peer = self._peers.get(reg.tp_rank)
            if peer is None or reg.incarnation == peer.registration.incarnation:
                continue
            if self._suspect(peer, now) or peer.state is _PeerState.LOST:  # the old process is gone
                self._lose(reg.tp_rank, f"prefill rank {reg.tp_rank} restarted (a new process registered)",
                           settled=True)
            if peer.state is _PeerState.LOST:
                log.info("decode rank %d: prefill rank %d is back (new incarnation); reconnecting",
                         self.layout.tp_rank, reg.tp_rank)
                self._connect(reg)

    def _shutdown(self) -> None:
        """Fail what is in flight, then make every connected prefill rank forget this rank's
        memory before it is deregistered (Goodbye, answered once none of its writes here is
        in flight); a rank that does not answer within the heartbeat timeout is lost."""
        self._closing = True
        for rid in list(self._incoming):
            self._fail(rid, "the decode manager closed", tell_senders=True)
        waiting = [p for p in self._peers.values() if p.state is _PeerState.READY]
        for peer in waiting:
            peer.socket.send(Goodbye(incarnation=self.incarnation).to_msgpack(), zmq.NOBLOCK)
        deadline = time.monotonic() + self.config.heartbeat_timeout_s
        while any(p.state is _PeerState.READY for p in waiting) and time.monotonic() < deadline:
            for peer in waiting:
                if peer.socket.poll(1, zmq.POLLIN):
                    self._on_socket(peer)
            for transport in self.endpoints.transports.values():  # keeps NIXL progressing while prefill drains
                transport.poll_notifications()
        for peer in self._peers.values():
            if peer.state is _PeerState.READY:
                log.warning("decode rank %d closes without a goodbye from prefill rank %d (lost?)",
                            self.layout.tp_rank, peer.registration.tp_rank)
            self._loop.remove_socket(peer.socket)
            peer.socket.close()
        self._peers.clear()
