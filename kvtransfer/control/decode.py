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
event loop: on its thread, or, for ``init()`` while the loop is between turns, on the caller's
thread (the ask leaves without a thread switch; ``EventLoop.call(inline=True)``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Optional

import numpy as np

from kvtransfer.control.aux_records import AuxRecords, unpack_first_token
from kvtransfer.control.base import BaseKVManager, BaseKVReceiver, check_on_change
from kvtransfer.control.bootstrap import BootstrapClient
from kvtransfer.control.config import SWEEP_INTERVAL_S, ControlConfig
from kvtransfer.control.decode_peers import HandshakeError, PrefillPeer, PrefillRanks
from kvtransfer.control.decode_request import DecodeRequest
from kvtransfer.control.endpoints import Endpoints, default_host_id
from kvtransfer.control.event_loop import EventLoop
from kvtransfer.control.liveness import ProcessId
from kvtransfer.control.session import Fences, PeerState, confirm_silent
from kvtransfer.control.state import KVPoll, RequestStatus, RequestTable
from kvtransfer.control.wire import (
    AbortRequest,
    Goodbye,
    Heartbeat,
    HelloAck,
    KVArrived,
    NotConnected,
    Quiesced,
    TransferRequest,
    WireError,
    endpoints_of,
    process_of,
)
from kvtransfer.layout import RankLayout, StateKind
from kvtransfer.plan import senders_for

__all__ = ["DecodeKVManager", "HandshakeError", "KVReceiver"]

log = logging.getLogger("kvtransfer.control.decode")

LOOKUP_INTERVAL_S = 0.5  # how often lost or suspect prefill ranks are looked up at the bootstrap service


class KVReceiver(BaseKVReceiver):
    """One request on this decode rank (see the module docstring)."""

    def __init__(self, manager: "DecodeKVManager", request_id: str):
        self.request_id = request_id
        self.status = RequestStatus(request_id, manager.on_change)
        now = time.monotonic()
        self._req = DecodeRequest(request_id, self.status, tuple(manager.senders), since=now,
                                  deadline=now + manager.config.transfer_timeout_s)
        self._mgr = manager
        self._inited = False

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
        # inline: the ask leaves from this thread when the loop is between turns (no wake-up on the way)
        self._mgr._loop.call(self._mgr._on_init, self._req, arr.tobytes(), prefix_tokens,
                             -1 if state_slot is None else int(state_slot), inline=True)

    def poll(self) -> KVPoll:
        return self.status.state

    @property
    def failure(self) -> Optional[str]:
        return self.status.reason

    @property
    def released(self) -> bool:
        """No byte of this request's writes can still land: its pages may be reused."""
        return self._req.released

    def first_token(self) -> tuple:
        """``(token_id, logprob)`` from the aux record, once Success."""
        has_aux = self._req.has_aux
        if self.status.state is not KVPoll.Success or not has_aux:
            raise ValueError(f"request {self.request_id!r} has no aux record ({self.status.state.name}, "
                             f"{'one' if has_aux else 'none'} arrived)")
        return unpack_first_token(self._mgr._aux.read(self._req.aux_slot))

    def abort(self, reason: str = "aborted by decode") -> None:
        self._mgr._loop.call(self._mgr._fail, self.request_id, reason, True)

    def close(self) -> None:
        """Forget the request (aborting it if it has not ended) and free its aux record."""
        self._mgr._loop.call(self._mgr._close_request, self._req)


class DecodeKVManager(BaseKVManager):
    """The KV manager of one decode rank (see the module docstring).

    Its state, all on the loop thread: the prefill ranks (``_ranks``, sessions and sockets),
    the requests (``_incoming``; ``_held``, those whose ask waits for a sender) and the
    fences of ranks lost to silence (``_fences``)."""

    def __init__(self, layout: RankLayout, transports, kv_infos, state_infos=None, *, bootstrap: str,
                 instance: Optional[str] = None, config: ControlConfig = ControlConfig(),
                 device: Optional[int] = None, host_id: Optional[str] = None,
                 on_change: Optional[Callable[[], None]] = None):
        if not isinstance(layout, RankLayout):
            raise TypeError(f"layout must be a RankLayout, got {type(layout).__name__}")
        self.layout, self.config = layout, config
        self.on_change = check_on_change(on_change)
        self.instance = instance or f"decode-{uuid.uuid4().hex[:12]}"
        self.incarnation = uuid.uuid4().hex
        self.host = host_id or default_host_id()  # this host's identity in hellos
        self.process = ProcessId.mine()
        self._bootstrap = BootstrapClient(bootstrap)
        topo = self._bootstrap.wait_for_topology(config.dp_rank, deadline_s=config.bootstrap_timeout_s)
        self.prefill_tp_size = topo.tp_size
        self.senders = senders_for(layout, topo.tp_size)
        self.endpoints = Endpoints(transports, kv_infos, state_infos, device)
        self._aux = AuxRecords(config.aux_slots)  # plain memory: records arrive on notifications
        self._receivers: RequestTable = RequestTable()
        self._incoming: dict = {}  # request id -> DecodeRequest
        self._held: set = set()  # request ids whose ask waits for a sender (_ask)
        self._next_sweep = 0.0  # when _tick next looks at every request's deadline
        self._fences = Fences()  # prefill tp rank -> a silent rank's failed requests, pages held
        self._last_lookup = 0.0
        self._closing = False  # set by close(): a Goodbye then answers ours
        self._handlers = {HelloAck: self._on_ack, Heartbeat: self._on_heartbeat, NotConnected: self._on_not_connected,
                          AbortRequest: self._on_abort, Goodbye: self._on_goodbye, Quiesced: self._on_quiesced}
        self._loop = EventLoop(f"kvt-decode{layout.tp_rank}", {}, self._tick, fds=self.endpoints.notification_fds())
        self._ranks = PrefillRanks(self, self._loop, self._on_socket)
        for reg in topo.rank_infos():  # every prefill rank: those it does not read from are told too
            self._ranks.connect(reg)
        self._loop.start()
        try:
            self._ranks.await_handshakes()
        except BaseException:
            self.close()
            raise

    # -- the owner's API --------------------------------------------------------------
    def receiver(self, request_id: str) -> KVReceiver:
        """A new request on this rank; raises DuplicateRequest while ``request_id`` is live."""
        receiver = self._receivers.add(request_id, KVReceiver(self, request_id))
        self._loop.call(self._on_new_request, receiver._req, wake=False)  # init() wakes the loop
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
        return self._loop.call(lambda: sorted(p.rank for p in self._ranks.ready())).result(timeout=10)

    def close(self) -> None:
        """Fail what is in flight, close sockets and the thread, deregister (idempotent)."""
        if self._ranks.closed:
            return
        self._loop.close(final=self._shutdown)
        self._ranks.term()
        self.endpoints.release()

    # -- loop thread: messages from prefill ranks -------------------------------------------
    def _on_socket(self, peer: PrefillPeer) -> None:
        for msg in self._ranks.read(peer):
            handler = self._handlers.get(type(msg))
            if handler is None:
                log.warning("decode rank %d dropped an unexpected %s", self.layout.tp_rank, msg.KIND)
            elif handler(peer, msg):
                return  # the socket was replaced

    def _on_ack(self, peer: PrefillPeer, ack: HelloAck) -> bool:
        session = peer.session
        if ack.error:
            session.enter(PeerState.REFUSED, time.monotonic(), ack.error)
            log.error("prefill rank %d refused decode rank %d: %s", peer.rank, self.layout.tp_rank, ack.error)
            return False
        session.enter(PeerState.READY, time.monotonic())
        session.incarnation, session.process = ack.incarnation, process_of(ack)
        peer.writer = endpoints_of(peer.registration).get(ack.backend)
        # the same process replaced its old entry of this rank (requests failed, transport peer
        # closed with drain) before it answered; another one means the old process is gone
        self._settle(peer.rank, "answered a new hello")
        self._ask_held()  # requests that waited for this rank
        return False

    def _on_heartbeat(self, peer: PrefillPeer, msg: Heartbeat) -> bool:
        if peer.session.incarnation and msg.incarnation != peer.session.incarnation:
            self._lose(peer.rank, f"prefill rank {peer.rank} restarted", settled=True)
        elif peer.session.state is PeerState.LOST:  # the rank it timed out is alive: connect anew
            self._reconnect(peer, f"prefill rank {peer.rank}, lost, answered a heartbeat")
            return True
        return False

    def _on_not_connected(self, peer: PrefillPeer, msg: NotConnected) -> bool:
        """The prefill rank dropped this rank (it was silent past the heartbeat timeout: a
        pause, not a death; or a failed write lost the prefill rank's transport peer of it).
        Fail what waits for it and say hello again (the prefill rank connects anew); True if
        the socket was replaced. A new incarnation (a restart at the same address) is left to
        the bootstrap lookup, which knows its new endpoints."""
        rank, session = peer.rank, peer.session
        if self._closing or session.state not in (PeerState.READY, PeerState.LOST):
            return False  # closing, or a hello of this socket is on its way, or refused / gone
        if session.incarnation and msg.incarnation != session.incarnation:
            self._lose(rank, f"prefill rank {rank} restarted", settled=True)
            return False
        # it holds no entry of this rank: it dropped it, failing its requests and closing its
        # transport peer with drain, before it could answer so
        self._lose(rank, f"prefill rank {rank} dropped this rank: {msg.reason}", settled=True)
        self._reconnect(peer, f"prefill rank {rank} had dropped it")
        return True

    def _on_abort(self, peer: PrefillPeer, msg: AbortRequest) -> bool:
        self._fail(msg.request_id, msg.reason, tell_senders=False)
        return False

    def _on_goodbye(self, peer: PrefillPeer, msg: Goodbye) -> bool:
        if self._closing:  # the answer to ours: it can no longer write here
            peer.session.enter(PeerState.GONE, time.monotonic())
        else:  # the prefill rank is closing (its writes ended first): lost until a new incarnation registers
            self._lose(peer.rank, f"prefill rank {peer.rank} closed", settled=True)
        return False

    def _on_quiesced(self, peer: PrefillPeer, msg: Quiesced) -> bool:
        self._fences.discard(peer.rank, msg.request_id)  # said by the rank itself: proof for this request
        req = self._incoming.get(msg.request_id)
        if req is not None:
            req.quiesce(peer.rank)
        return False

    def _reconnect(self, peer: PrefillPeer, why: str) -> None:
        """Say hello again to a live rank that was lost (one side timed the other out): a fresh
        socket, and the prefill rank replaces its old entry of this rank."""
        log.info("decode rank %d: %s; saying hello again", self.layout.tp_rank, why)
        self._ranks.connect(peer.registration)

    # -- loop thread: requests ----------------------------------------------------------
    def _on_new_request(self, req: DecodeRequest) -> None:
        self._incoming[req.request_id] = req

    def _on_init(self, req: DecodeRequest, dst: bytes, prefix: int, state_slot: int) -> None:
        if req.request_id not in self._incoming or req.status.state.final:
            return
        aux = self._aux.alloc()
        if aux is None:
            self._fail(req.request_id, f"all {self.config.aux_slots - 1} aux records are in use", False)
            return
        req.aux_slot = aux
        req.request = (dst, prefix, state_slot)
        self._ask(req)

    def _ask(self, req: DecodeRequest) -> None:
        """Send the request to every prefill rank once the senders are ready (ranks it does
        not read from learn that they have nothing to write); fail it if a sender cannot be."""
        if req.asked or req.request is None or req.status.state.final:
            return
        sessions = [self._ranks[r].session for r in self.senders]
        now = time.monotonic()
        down = [(r, s) for r, s in zip(self.senders, sessions) if s.state in (PeerState.REFUSED, PeerState.GONE)
                or (s.state is PeerState.LOST and now - req.since >= self.config.heartbeat_timeout_s)]
        if down:
            rank, session = down[0]
            why = session.error or f"prefill rank {rank} is {session.state.value}"
            self._fail(req.request_id, why, tell_senders=True)  # the ranks that are up drop it too
            req.quiesce(*self.senders)  # nothing was asked: nothing can land
            return
        if any(s.state is not PeerState.READY or s.suspect(now) for s in sessions):
            self._held.add(req.request_id)  # a sender is (re)connecting, silent or lost but maybe back soon:
            return  # asked once it is ready (_ask_held)
        self._held.discard(req.request_id)
        dst, prefix, state_slot = req.request
        self._ranks.broadcast(TransferRequest(request_id=req.request_id, instance=self.instance,
                                              decode_tp_rank=self.layout.tp_rank, dst_slots=dst,
                                              prefix_tokens=prefix, state_slot=state_slot))
        req.asked = True
        req.status.advance(KVPoll.WaitingForInput)

    def _ask_held(self) -> None:
        """Ask again for the requests held back by :meth:`_ask` (those that end are let go)."""
        for rid in list(self._held):
            req = self._incoming.get(rid)
            if req is None or req.asked or req.status.state.final:
                self._held.discard(rid)
            else:
                self._ask(req)

    def _on_arrived(self, sender: str, payload: bytes) -> None:
        rank = self._ranks.rank_of(sender)
        try:
            note = KVArrived.from_msgpack(payload)
        except WireError as exc:
            log.warning("decode rank %d dropped a notification from %r: %s", self.layout.tp_rank, sender, exc)
            return
        req = self._incoming.get(note.request_id)
        if rank is not None and req is not None:  # else an ended or unknown request: its late note means nothing
            req.arrived(rank, note, self._aux)

    def _fail(self, request_id: str, reason: str, tell_senders: bool) -> None:
        req = self._incoming.get(request_id)
        if req is None or not req.status.fail(reason):
            return
        log.info("request %s failed on decode rank %d: %s", request_id, self.layout.tp_rank, reason)
        if tell_senders:  # asked or not: a prefill rank may hold a sender for it already
            self._ranks.broadcast(AbortRequest(request_id=request_id, reason=reason))
        if not req.asked:
            req.quiesce(*self.senders)
        # a refused or gone sender writes nothing more; a lost one is fenced
        req.quiesce(*(r for r in self.senders if self._ranks[r].session.state is not PeerState.READY
                      and not self._fences.holds(r, request_id)))

    def _close_request(self, req: DecodeRequest) -> None:
        self._fail(req.request_id, "closed by its owner", tell_senders=True)
        known = self._incoming.pop(req.request_id, None) is not None
        self._held.discard(req.request_id)
        if req.aux_slot is not None:
            self._aux.free(req.aux_slot)
            req.aux_slot = None
        self._receivers.pop(req.request_id)
        if known and not req.released:
            log.warning("request %s closed before its senders quiesced: its pages are not safe to reuse yet",
                        req.request_id)

    # -- loop thread: timers, heartbeats, losses ---------------------------------------------
    def _tick(self) -> float:
        for transport in self.endpoints.transports.values():
            for note in transport.poll_notifications():
                self._on_arrived(note.sender, note.payload)
        now = time.monotonic()
        cfg = self.config
        self._ranks.heartbeats(now)
        for rank, peer in list(self._ranks.peers.items()):
            if peer.session.state is PeerState.CONNECTING and now - peer.session.since > cfg.handshake_timeout_s:
                self._lose(rank, f"prefill rank {rank} did not answer its hello within {cfg.handshake_timeout_s:g} s")
        for peer in confirm_silent(list(self._ranks.peers.values()), lambda p: p.session, now,
                                   lambda silent: [self._on_socket(p) for p in silent],
                                   lambda p: self._ranks.peers[p.rank] is p):
            self._lose(peer.rank, f"prefill rank {peer.rank} lost: no answer for {cfg.heartbeat_timeout_s:g} s")
        doubtful = any(p.session.state is PeerState.LOST or p.session.suspect(now) for p in self._ranks.peers.values())
        if doubtful and now - self._last_lookup > LOOKUP_INTERVAL_S:
            self._last_lookup = now
            self._reconnect_restarted()
        if self._held:
            self._ask_held()
        if now >= self._next_sweep:  # deadlines are seconds long: a look every SWEEP_INTERVAL_S, not every turn
            self._next_sweep = now + SWEEP_INTERVAL_S
            self._sweep(now)
        busy = any(not r.status.state.final for r in self._incoming.values())  # stops at the first
        return cfg.loop_pause(busy)

    def _sweep(self, now: float) -> None:
        """Lose the suspect or fenced ranks known to have ended; release the pages of fences
        older than the transfer timeout; fail the requests past their deadline."""
        cfg = self.config
        for rank, peer in list(self._ranks.peers.items()):  # silent, or lost with pages fenced: is it dead?
            if peer.session.suspect(now) or rank in self._fences:
                gone = self._ranks.gone(peer)
                if gone is not None:
                    self._lose(rank, f"prefill rank {rank} lost: {gone}", settled=True)
        for rank in self._fences.older_than(now - cfg.transfer_timeout_s):
            log.warning("decode rank %d: no word from lost prefill rank %d for %g s: the pages of the requests it "
                        "was lost with are released (a prefill rank posts no write past a request's deadline)",
                        self.layout.tp_rank, rank, cfg.transfer_timeout_s)
            self._settle(rank, f"was silent for {cfg.transfer_timeout_s:g} s")
        for rid, req in list(self._incoming.items()):
            if not req.status.state.final and now > req.deadline:
                self._fail(rid, f"not done after {cfg.transfer_timeout_s:g} s (waiting for prefill ranks "
                                f"{req.waiting_for()})", tell_senders=True)

    def _lose(self, rank: int, reason: str, settled: bool = False) -> None:
        """Rank ``rank`` is lost: fail what was asked of it. ``settled``: the loss itself
        proves that none of its writes can still land (it restarted, closed, or dropped this
        rank with drain); otherwise a ready rank's failed requests are fenced (:meth:`_settle`)."""
        session = self._ranks[rank].session
        if session.state is PeerState.LOST:
            if settled:
                self._settle(rank, reason)
            return
        log.warning("decode rank %d: %s", self.layout.tp_rank, reason)
        was_ready = session.state is PeerState.READY
        session.enter(PeerState.LOST, time.monotonic(), reason)
        if rank not in self.senders:
            return  # none of this rank's requests waits for its bytes
        if was_ready and not settled:  # silent, maybe only paused: it may still post writes
            self._fences.add(rank, time.monotonic(), [
                rid for rid, req in self._incoming.items()
                if req.asked and rank not in req.quiesced and req.status.state is not KVPoll.Success])
        for rid, req in list(self._incoming.items()):
            if req.status.state.final:
                if not self._fences.holds(rank, rid):
                    req.quiesce(rank)
            elif req.asked:
                self._fail(rid, reason, tell_senders=True)
            # not asked yet: nothing of it went there; it waits for the rank a while (_ask)
        if settled:
            self._settle(rank, reason)

    def _settle(self, rank: int, why: str) -> None:
        """None of lost rank ``rank``'s writes for its fenced requests can land any more
        (``why``): they count as quiesced by it, and their pages are released."""
        released = 0
        for rid in self._fences.lift(rank):
            req = self._incoming.get(rid)
            if req is not None and rank not in req.quiesced:
                req.quiesce(rank)
                released += 1
        if released:
            log.info("decode rank %d: prefill rank %d %s: %d failed request(s) it was lost with can no longer be "
                     "written, their pages are released", self.layout.tp_rank, rank, why, released)

    def _reconnect_restarted(self) -> None:
        """Look the lost and suspect ranks up at the bootstrap service; a new incarnation
        means the old process is gone (lost now, if it was not yet): connect to the new one."""
        now = time.monotonic()
        for reg in self._ranks.restarted(self._bootstrap):
            session = self._ranks[reg.tp_rank].session
            if session.suspect(now) or session.state is PeerState.LOST:  # the old process is gone
                self._lose(reg.tp_rank, f"prefill rank {reg.tp_rank} restarted (a new process registered)",
                           settled=True)
            if session.state is PeerState.LOST:
                log.info("decode rank %d: prefill rank %d is back (new incarnation); reconnecting",
                         self.layout.tp_rank, reg.tp_rank)
                self._ranks.connect(reg)

    def _shutdown(self) -> None:
        """Fail what is in flight, then make every connected prefill rank forget this rank's
        memory before it is deregistered (:meth:`PrefillRanks.part`)."""
        self._closing = True
        for rid in list(self._incoming):
            self._fail(rid, "the decode manager closed", tell_senders=True)
        self._ranks.part(self._on_socket)
        self._ranks.close()
