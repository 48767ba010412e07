"""The prefill side of the control plane: :class:`PrefillKVManager` and :class:`KVSender`.

One manager per prefill rank. At start it registers its pools' buffers with its transports
(``nixl``, and ``nvlink`` beside it for CUDA pools), binds its control socket (a ZeroMQ
ROUTER), and registers with the bootstrap service. Decode ranks then introduce themselves
(``DecodeHello``: layout, one endpoint per transport: export and buffer map); the manager
checks the layouts (a mismatch is refused, naming the field and both values) and connects
over the best transport both sides have: ``nvlink`` when both offer it on one host and CUDA
IPC works, else ``nixl``. Where the transport keeps a pair set's part of a write resident
(NVLink's direct path), the pairs of this rank's writes to that decode rank are made resident
then, once: they depend on the two layouts only (:meth:`_DecodePeer.plan_ahead`).

Per request, the engine calls ``sender = manager.sender(request_id)`` and then
``sender.send(slots, last=...)`` once per chunk of a chunked prefill: ``slots`` are this
rank's token slots of the chunk's tokens, in order; the last chunk also carries the Mamba
state slot and the aux record (the first output token, :func:`~kvtransfer.control.common.
pack_first_token`). Each decode rank of the request sends a ``TransferRequest`` (its
destination slots, the prefix it already holds, its state slot); chunks queued
before every expected decode rank has asked wait for it. Tokens decode already holds are not
sent. Every write carries a ``KVArrived`` notification; the last write to each decode rank
carries the number of writes, so decode knows when it has everything.

KV on a GPU: ``send()`` may come as soon as the chunk's KV is queued on the caller's current
CUDA stream (not necessarily computed yet): it records an event there, and the chunk's writes
are posted once that event has completed (at once when it has already: an engine that
synchronised first pays one event record and query).

``sender.poll()`` gives the :class:`~kvtransfer.control.state.KVPoll`: Bootstrapping (not
every decode rank has asked yet: an engine that computes only what decode has room for waits
for the next state before it takes the request), WaitingForInput (all have, no chunk sent yet),
Transferring, Success (every write of the last chunk is done) or Failed
(``sender.failure`` says why: a write failed, the decode rank was lost or aborted, the
transfer timeout passed). A failed request's writes are aborted; once none is in flight the
manager sends ``Quiesced`` so decode may reuse the pages. No chunk is posted past the request's
deadline, ``transfer_timeout_s`` after every decode rank asked (a decode rank that lost this one
lets the pages go by then); before that a request may wait for decode's ask as long as its owner
keeps it, unless no decode rank is connected here at all: then it fails after
``handshake_timeout_s`` (a request that no decode node will ask for).

A decode rank that sends no heartbeat for ``heartbeat_timeout_s`` is dropped (its requests
fail; what came on the socket meanwhile is read first); so is one silent for two heartbeat
intervals whose process has ended (on one host: named in its hello,
:mod:`kvtransfer.control.liveness`). If it was only paused, its next message
is answered ``NotConnected`` and it says hello again; a hello from a known rank replaces the old
entry (its requests fail, its transport peer is closed with drain) before it is acknowledged.

Threads: every transport call and socket operation happens in a turn of the manager's event
loop, one at a time: on its thread, or, for ``send()`` while the loop is between turns, on the
caller's thread (no thread switch on the way to the post; ``EventLoop.call(inline=True)``);
``sender()``, ``send()``, ``poll()`` and ``abort()`` may be called from any thread.
``close()`` leaves the bootstrap registry, fails what is in flight, closes peers, sockets and
the thread, and deregisters.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import zmq

from kvtransfer.batches import BufferRegions, plan_batch, write_batch
from kvtransfer.control.bootstrap import BootstrapClient
from kvtransfer.control.common import (AUX_RECORD_BYTES, SWEEP_INTERVAL_S, ControlConfig, Endpoints, EventLoop,
                                      default_host_id, pick_backend)
from kvtransfer.control.liveness import ProcessId, ended, wire_of
from kvtransfer.control.state import KVPoll, RequestStatus, RequestTable
from kvtransfer.control.wire import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeHello,
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
from kvtransfer.layout import LayoutMismatch, RankLayout, StateKind
from kvtransfer.plan import plan_kv_transfer, plan_state_transfer, senders_for
from transport.base import PeerDescriptorError, StridedBatch, TransferStatus, TransportError

__all__ = ["KVSender", "PrefillKVManager"]

log = logging.getLogger("kvtransfer.control.prefill")


def _slots(name: str, slots) -> np.ndarray:
    arr = np.asarray(slots)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D array of ints, got {arr.dtype} of shape {list(arr.shape)}")
    return np.array(arr, dtype=np.int64)


class KVSender:
    """One request on this prefill rank (see the module docstring)."""

    def __init__(self, manager: "PrefillKVManager", request_id: str):
        self.request_id = request_id
        self.status = RequestStatus(request_id)
        self._mgr = manager
        self._last_sent = False
        self._kicked = False  # the loop was woken since this request was made (making it does not wake it)

    def poll(self) -> KVPoll:
        if not self._kicked:  # the manager learns of this request at its next turn: make that now
            self._kicked = True
            self._mgr._loop.wake()
        return self.status.state

    @property
    def failure(self) -> Optional[str]:
        return self.status.reason

    def send(self, slots, *, last: bool = False, state_slot: Optional[int] = None,
             aux: Optional[bytes] = None) -> None:
        """Queue one chunk: this rank's token slots of the request's next tokens. The last
        chunk (``last=True``) also sends the Mamba state (``state_slot``, required when the
        model has state) and ``aux`` (at most ``AUX_RECORD_BYTES``). KV on a GPU may still be
        computing on the caller's current stream: the writes wait for it (module doc)."""
        if self._last_sent:
            raise ValueError(f"request {self.request_id!r}: send() after the last chunk")
        arr = _slots("slots", slots)
        if last and self._mgr.layout.state_kind is StateKind.MAMBA:
            if not isinstance(state_slot, (int, np.integer)) or isinstance(state_slot, bool) or state_slot <= 0:
                raise ValueError(f"request {self.request_id!r}: the last chunk of a model with Mamba state needs "
                                 f"its state_slot (an int > 0), got {state_slot!r}")
        if aux is not None and (not isinstance(aux, (bytes, bytearray)) or len(aux) > AUX_RECORD_BYTES):
            raise ValueError(f"aux must be at most {AUX_RECORD_BYTES} bytes, got {aux!r:.40}")
        self._last_sent, self._kicked = last, True
        chunk = _Chunk(arr, last, state_slot, aux, self._mgr._stream_mark())
        # inline: posted from this thread when the loop is between turns (no wake-up on the way)
        self._mgr._loop.call(self._mgr._on_send, self, chunk, inline=True)

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._mgr._loop.call(self._mgr._fail, self.request_id, reason)


@dataclass(frozen=True)
class _Chunk:
    slots: np.ndarray  # [n] this rank's token slots
    last: bool
    state_slot: Optional[int]
    aux: Optional[bytes]
    computed: object = None  # CUDA event recorded after the chunk's KV on the sender's stream (None: host KV)


@dataclass
class _DecodePeer:
    """A decode rank that said hello (loop thread only)."""

    hello: DecodeHello
    identity: bytes
    layout: RankLayout
    backend: str  # the transport this pair writes through
    src_regions: BufferRegions  # this rank's buffers on that transport
    regions: BufferRegions  # the decode rank's buffers on that transport
    peer: object  # transport Peer
    reads_from_me: bool  # this rank is one of its senders_for(...)
    writes_aux: bool  # this rank is the lowest of its senders: its last notification carries the aux record
    last_seen: float
    process: Optional[ProcessId] = None  # the process its hello named (None: it could not)

    def batch(self, plan):
        """The transport batch of ``plan`` to this rank, in the form its transport takes best."""
        return plan_batch(plan, self.src_regions, self.regions, strided=self.peer.takes_strided(plan.num_token_entries))

    def plan_ahead(self, mine: RankLayout) -> int:
        """Make the pair sets of this rank's writes resident in its transport now, where the
        transport keeps them (``plan_pairs``: NVLink's direct path). A write's pairs -- which
        buffer to which, offsets, strides, row bytes -- come from the two layouts alone, so a
        one-token plan (the first slot of page 1 on each side; state slot 1) gives the pairs of
        every request's KV write, and of its Mamba state write: the first request then finds
        them built, as every later one does. Returns how many pair sets were made resident (0:
        the transport keeps none, or this rank reads nothing from ``mine``)."""
        plan_pairs = getattr(self.peer, "plan_pairs", None)
        if plan_pairs is None or not self.reads_from_me:
            return 0
        plans = [plan_kv_transfer(mine, self.layout, [mine.page_size], [self.layout.page_size])]  # page 1, token 0
        if mine.state_kind is StateKind.MAMBA:
            plans.append(plan_state_transfer(mine, self.layout, 1, 1))
        made = 0
        for plan in plans:
            batch = None if plan.empty else self.batch(plan)
            if isinstance(batch, StridedBatch) and batch.num_pairs:  # (NSA's sectioned pages write flat rows)
                plan_pairs(batch)
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


@dataclass
class _Outgoing:
    """A request's progress on this rank (loop thread only)."""

    sender: KVSender
    since: float  # when sender() made it
    deadline: float = float("inf")  # set once every decode rank asked
    instance: Optional[str] = None
    expected: frozenset = frozenset()  # decode keys that will ask: every rank of the instance
    dests: dict = field(default_factory=dict)  # decode key -> (TransferRequest, dst slots [m])
    chunks: list = field(default_factory=list)  # queued until every decode rank has asked
    tokens_sent: int = 0
    writes: dict = field(default_factory=dict)  # decode key -> writes posted
    inflight: list = field(default_factory=list)  # [(Transfer, decode key)]
    last_posted: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.expected) and set(self.dests) == self.expected


class PrefillKVManager:
    """The KV manager of one prefill rank (see the module docstring)."""

    def __init__(self, layout: RankLayout, transports, kv_infos, state_infos=None, *,
                 bootstrap: str, config: ControlConfig = ControlConfig(), device: Optional[int] = None,
                 host_id: Optional[str] = None):
        if not isinstance(layout, RankLayout):
            raise TypeError(f"layout must be a RankLayout, got {type(layout).__name__}")
        self.layout, self.config = layout, config
        self.incarnation = uuid.uuid4().hex
        self.endpoints = Endpoints(transports, kv_infos, state_infos, device)
        self._device = device  # the pools' GPU (None: host memory)
        self._host = host_id or default_host_id()
        self._process = ProcessId.mine()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            port = config.port or self._router.bind_to_random_port(f"tcp://{config.host}")
            if config.port:
                self._router.bind(f"tcp://{config.host}:{port}")
        except zmq.ZMQError as exc:
            self.endpoints.release()
            raise OSError(f"prefill rank {layout.tp_rank}: cannot bind tcp://{config.host}:{config.port}: {exc}") from None
        self.control_addr = f"tcp://{config.host}:{port}"
        self._senders: RequestTable = RequestTable()
        self._outgoing: dict = {}  # request id -> _Outgoing
        self._moving: set = set()  # request ids with writes in flight, or posted or failed since the last turn
        self._computing: set = set()  # request ids whose next chunk waits for the engine's stream (_flush)
        self._next_sweep = 0.0  # when _tick next looks at every request (deadlines, forgotten ids)
        self._early: dict = {}  # request id -> [(time, key, TransferRequest)] that came before sender()
        self._aborted_early: dict = {}  # request id -> (time, reason): aborts that came before sender()
        self._failed: dict = {}  # request id -> (time, reason): failed; a late ask is told so
        self._decode: dict = {}  # (instance, tp_rank) -> _DecodePeer
        self._by_identity: dict = {}  # routing id -> decode key
        self._dropped: dict = {}  # routing id -> (time, reason, logged): sockets without a hello (NotConnected)
        self._leaving: dict = {}  # decode key -> _DecodePeer that said goodbye, until no write to it is in flight
        self._loop = EventLoop(f"kvt-prefill{layout.tp_rank}", {self._router: self._on_router}, self._tick)
        self._bootstrap = BootstrapClient(bootstrap)
        try:
            self._bootstrap.register(RegisterPrefill(
                dp_rank=config.dp_rank, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
                control_addr=self.control_addr, host=self._host, endpoints=self.endpoints.wire(),
                layout=layout.to_msgpack(), incarnation=self.incarnation), deadline_s=config.bootstrap_timeout_s)
        except BaseException:
            self._router.close()
            self._ctx.term()
            self.endpoints.release()
            raise
        self._loop.start()

    # -- the owner's API --------------------------------------------------------------
    def sender(self, request_id: str) -> KVSender:
        """A new request on this rank; raises DuplicateRequest while ``request_id`` is live."""
        sender = self._senders.add(request_id, KVSender(self, request_id))
        self._loop.call(self._on_new_sender, sender, wake=False)  # its first poll() or send() wakes the loop
        return sender

    def decode_peers(self) -> list:
        """The decode ranks connected now, as (instance, tp_rank)."""
        return self._loop.call(lambda: sorted(self._decode)).result(timeout=10)

    def decode_backends(self) -> dict:
        """``{(instance, tp_rank): backend}``: the transport each connected decode rank gets."""
        return self._loop.call(lambda: {k: p.backend for k, p in self._decode.items()}).result(timeout=10)

    @property
    def num_requests(self) -> int:
        """Requests not yet ended and released."""
        return len(self._senders)

    def close(self) -> None:
        """Fail what is in flight, close peers, sockets and the thread, deregister (idempotent)."""
        if self._router.closed:
            return
        self._bootstrap.unregister(self.config.dp_rank, self.layout.tp_rank, self.incarnation)
        self._loop.close(final=self._shutdown)
        self._router.close()
        self._ctx.term()
        self.endpoints.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- loop thread: requests ----------------------------------------------------------
    def _on_new_sender(self, sender: KVSender) -> None:
        self._failed.pop(sender.request_id, None)  # an id used again after a failure
        out = _Outgoing(sender, since=time.monotonic())
        self._outgoing[sender.request_id] = out
        aborted = self._aborted_early.pop(sender.request_id, None)
        if aborted is not None:
            self._fail(sender.request_id, aborted[1])
            return
        for _, key, req in self._early.pop(sender.request_id, []):
            self._attach(out, key, req)

    def _on_send(self, sender: KVSender, chunk: _Chunk) -> None:
        out = self._outgoing.get(sender.request_id)
        if out is None or sender.status.state.final:
            return  # failed (and forgotten) meanwhile: nothing to send
        out.chunks.append(chunk)
        self._flush(out)

    def _attach(self, out: _Outgoing, key: tuple, req: TransferRequest) -> None:
        peer = self._decode.get(key)
        if peer is None:
            self._fail(out.sender.request_id, f"decode rank {key} asked without a hello")
            return
        if out.instance is None:
            out.instance = req.instance
            out.expected = self._askers_of(req.instance)
        elif out.instance != req.instance:
            self._fail(out.sender.request_id, f"decode instances {out.instance!r} and {req.instance!r} both asked")
            return
        if len(req.dst_slots) % 8:
            self._fail(out.sender.request_id, f"decode rank {key}: dst_slots of {len(req.dst_slots)} bytes is not "
                                              "int64 slots")
            return
        out.dests[key] = (req, np.frombuffer(req.dst_slots, dtype="<i8").astype(np.int64))
        if out.ready:
            out.deadline = time.monotonic() + self.config.transfer_timeout_s
            out.sender.status.advance(KVPoll.WaitingForInput)
            self._flush(out)

    def _askers_of(self, instance: str) -> frozenset:
        """Every decode rank of ``instance``: each asks every prefill rank of the group (a
        rank it does not read from too, so that no prefill rank waits for nothing)."""
        peer = next((p for k, p in self._decode.items() if k[0] == instance), None)
        return frozenset() if peer is None else frozenset((instance, d) for d in range(peer.layout.tp_size))

    def _flush(self, out: _Outgoing) -> None:
        """Post the queued chunks, in order, once every decode rank asked and while each one's
        KV is computed (a chunk whose event has not completed waits; each turn looks again)."""
        rid = out.sender.request_id
        self._computing.discard(rid)
        if not out.ready or out.sender.status.state.final:
            return
        if out.chunks and time.monotonic() > out.deadline:  # the decode rank may have let its pages go
            self._fail(rid, f"not done after {self.config.transfer_timeout_s:g} s: its deadline passed before "
                            f"a chunk was posted")
            return
        try:
            while out.chunks:
                if not self._computed(out, out.chunks[0]):
                    return
                self._post_chunk(out, out.chunks.pop(0))
        except (ValueError, TypeError, TransportError) as exc:  # bad slots, a peer gone, a closed transport
            self._fail(rid, f"cannot write: {exc}")

    def _computed(self, out: _Outgoing, chunk: _Chunk) -> bool:
        """Whether the chunk's KV is complete; if not, the request waits in ``_computing``
        (failed when the engine's stream did: its KV never comes)."""
        try:
            if chunk.computed is None or chunk.computed.query():
                return True
        except RuntimeError as exc:  # a CUDA error on the engine's stream
            self._fail(out.sender.request_id, f"the engine's stream failed before a chunk's KV was computed: {exc}")
            return False
        self._computing.add(out.sender.request_id)
        return False

    def _stream_mark(self):
        """The caller's current CUDA stream as of now, for a chunk's KV on the GPU (a recorded
        event; None for host pools)."""
        if self._device is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _post_chunk(self, out: _Outgoing, chunk: _Chunk) -> None:
        rid = out.sender.request_id
        first, out.tokens_sent = out.tokens_sent, out.tokens_sent + chunk.slots.size
        for key in sorted(out.dests):
            req, dst_all = out.dests[key]
            peer = self._decode[key]
            if not peer.reads_from_me:  # it asked so that this rank does not wait; nothing to write
                continue
            skip = min(chunk.slots.size, max(0, req.prefix_tokens - first))  # tokens decode already holds
            src = chunk.slots[skip:]
            start = first + skip - req.prefix_tokens
            dst = dst_all[start:start + src.size]
            if dst.size != src.size:
                raise ValueError(f"decode rank {key} reserved {dst_all.size} slots after a prefix of "
                                 f"{req.prefix_tokens}, prefill sends token {first + chunk.slots.size}")
            writes = [("kv", peer.batch(plan_kv_transfer(self.layout, peer.layout, src, dst)))]
            if self.layout.state_kind is StateKind.NSA_INDEX:
                writes.append(("state", peer.batch(plan_state_transfer(self.layout, peer.layout, src, dst))))
            if chunk.last:
                if out.tokens_sent != req.prefix_tokens + dst_all.size:
                    raise ValueError(f"the request has {out.tokens_sent} tokens, decode rank {key} expects "
                                     f"{req.prefix_tokens} held + {dst_all.size} sent")
                writes += self._state_writes(peer, req, chunk)
            for i, (part, batch) in enumerate(writes):
                seq = out.writes.get(key, 0)
                out.writes[key] = seq + 1
                final = chunk.last and i == len(writes) - 1
                aux = chunk.aux if final and peer.writes_aux and chunk.aux is not None else b""
                note = KVArrived(request_id=rid, part=part, seq=seq, total=seq + 1 if final else 0,
                                 aux=bytes(aux)).to_msgpack()
                out.inflight.append((write_batch(peer.peer, batch, note), key))
        out.last_posted |= chunk.last
        self._moving.add(rid)
        out.sender.status.advance(KVPoll.Transferring)

    def _state_writes(self, peer: _DecodePeer, req: TransferRequest, chunk: _Chunk) -> list:
        """The Mamba state write that goes with the last chunk to one decode rank."""
        if self.layout.state_kind is not StateKind.MAMBA or req.state_slot <= 0:
            return []
        plan = plan_state_transfer(self.layout, peer.layout, int(chunk.state_slot), req.state_slot)
        return [] if plan.empty else [("state", peer.batch(plan))]

    def _fail(self, request_id: str, reason: str) -> None:
        """Fail a request: abort its writes; tell its decode ranks (Quiesced follows once no
        write is in flight)."""
        out = self._outgoing.get(request_id)
        if out is None:
            return
        if out.sender.status.fail(reason):
            self._moving.add(request_id)  # the loop finishes it once none of its writes is in flight
            log.info("request %s failed on prefill rank %d: %s", request_id, self.layout.tp_rank, reason)
            self._failed[request_id] = (time.monotonic(), reason)  # a decode rank that asks later is told
            for transfer, _ in out.inflight:  # they stay in flight until nothing of them can land:
                transfer.cancel()  # Quiesced waits for that, and the loop goes on serving meanwhile
            for key in out.dests:
                self._send(key, AbortRequest(request_id=request_id, reason=f"prefill rank {self.layout.tp_rank}: "
                                                                           f"{reason}"))

    def _send(self, key: tuple, msg) -> None:
        peer = self._decode.get(key)
        if peer is not None:
            try:
                self._router.send_multipart([peer.identity, msg.to_msgpack()], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the decode rank is gone: heartbeats will tell
                log.debug("cannot send %s to decode rank %s: %s", msg.KIND, key, exc)

    # -- loop thread: control messages ----------------------------------------------------
    def _on_router(self) -> None:
        for _ in range(256):  # a bounded batch per turn: transfers get polled in between
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                log.warning("prefill rank %d dropped a message of %d frames", self.layout.tp_rank, len(parts))
                continue
            identity, frame = parts
            try:
                msg = decode(frame)
            except WireError as exc:
                log.warning("prefill rank %d dropped a frame: %s", self.layout.tp_rank, exc)
                if isinstance(exc, VersionMismatch) and exc.kind == DecodeHello.KIND:  # refused in this version
                    self._ack(identity, f"this prefill rank speaks control protocol {PROTOCOL_VERSION}, not "
                                        f"{exc.version!r}")
                continue
            if isinstance(msg, DecodeHello):
                self._on_hello(identity, msg)
                continue
            key = self._by_identity.get(identity)
            if key is None:
                self._not_connected(identity, msg)
                continue
            peer = self._decode.get(key)
            if peer is None:  # said goodbye or was dropped meanwhile
                log.debug("prefill rank %d dropped %s from a departed decode rank", self.layout.tp_rank, msg.KIND)
                continue
            peer.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                self._router.send_multipart([identity, Heartbeat(seq=msg.seq, incarnation=self.incarnation)
                                             .to_msgpack()], zmq.NOBLOCK)
            elif isinstance(msg, TransferRequest):
                self._on_request(key, msg)
            elif isinstance(msg, AbortRequest):
                self._on_abort(key, msg)
            elif isinstance(msg, Goodbye):
                self._decode.pop(key)
                self._fail_requests_of(key, f"decode rank {key} said goodbye")
                self._by_identity.pop(identity, None)
                self._leaving[key] = peer
            else:
                log.warning("prefill rank %d dropped an unexpected %s", self.layout.tp_rank, msg.KIND)

    def _not_connected(self, identity: bytes, msg) -> None:
        """A message from a socket without a hello: a decode rank dropped as lost (alive after
        all: a loaded machine paused it past the heartbeat timeout) or a stranger. Answered
        with NotConnected, so that a live decode rank fails what it asked of this rank and says
        hello again; logged once per socket."""
        when, reason, logged = self._dropped.get(identity, (time.monotonic(), "", False))
        if not logged:
            log.warning("prefill rank %d: %s from %s; answered not_connected", self.layout.tp_rank, msg.KIND,
                        f"a decode rank it dropped ({reason})" if reason else "a socket without a hello")
            self._dropped[identity] = (when, reason, True)
        try:
            self._router.send_multipart([identity, NotConnected(
                incarnation=self.incarnation, reason=reason or "this prefill rank holds no hello of it").to_msgpack()],
                zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("prefill rank %d cannot answer not_connected: %s", self.layout.tp_rank, exc)

    def _on_hello(self, identity: bytes, hello: DecodeHello) -> None:
        error = ""
        try:
            layout = RankLayout.from_msgpack(hello.layout)
            self.layout.check_compatible(layout)
            theirs = endpoints_of(hello)
            readers = senders_for(layout, self.layout.tp_size)
        except (LayoutMismatch, ValueError, TypeError) as exc:
            error = str(exc)
        if not error:
            old = self._decode.pop(hello.key, None)
            if old is not None:  # it restarted, or lost this rank and reconnects: its old requests cannot finish
                self._drop_peer(old, f"decode rank {hello.key} said hello again (restarted or reconnecting)")
            connected = self._connect(hello, theirs)
            if isinstance(connected, str):
                error = connected
            else:
                backend, peer, regions = connected
                entry = self._decode[hello.key] = _DecodePeer(
                    hello, identity, layout, backend, self.endpoints.regions[backend], regions, peer,
                    reads_from_me=self.layout.tp_rank in readers,
                    writes_aux=bool(readers) and readers[0] == self.layout.tp_rank, last_seen=time.monotonic(),
                    process=process_of(hello))
                entry.plan_ahead_or_log(self.layout, hello.key)
                self._by_identity[identity] = hello.key
                self._dropped.pop(identity, None)
                log.info("prefill rank %d: decode rank %s connected over %s", self.layout.tp_rank, hello.key, backend)
        if error:
            log.warning("prefill rank %d refused decode rank %s: %s", self.layout.tp_rank, hello.key, error)
        entry = self._decode.get(hello.key) if not error else None
        self._ack(identity, error, entry.backend if entry is not None else "")

    def _ack(self, identity: bytes, error: str, backend: str = "") -> None:
        """Answer a hello: ``error`` empty when accepted, ``backend`` what this rank writes through."""
        ack = HelloAck(error=error, incarnation=self.incarnation, process=wire_of(self._process), backend=backend)
        self._router.send_multipart([identity, ack.to_msgpack()], zmq.NOBLOCK)

    def _connect(self, hello: DecodeHello, theirs: dict):
        """``(backend, transport Peer, the decode rank's BufferRegions)`` over the best shared
        transport that connects, else why none did (a str)."""
        mine = self.endpoints.transports
        candidates = pick_backend(mine, theirs, same_host=hello.host == self._host)
        if not candidates:
            return f"no transport in common: this side {sorted(mine)}, peer {sorted(theirs)}"
        failures = []
        for backend in candidates:
            try:
                regions = BufferRegions.from_wire(theirs[backend].regions)
                return backend, mine[backend].connect(theirs[backend].export), regions
            except (PeerDescriptorError, TransportError, ValueError) as exc:
                failures.append(f"{backend}: {exc}")
                log.info("prefill rank %d: %s to decode rank %s unusable: %s", self.layout.tp_rank, backend,
                         hello.key, exc)
        return "cannot connect to the decode rank's transport (" + "; ".join(failures) + ")"

    def _on_request(self, key: tuple, req: TransferRequest) -> None:
        out = self._outgoing.get(req.request_id)
        failed = self._failed.get(req.request_id)
        if failed is not None and (out is None or key not in out.dests):  # it failed before that decode
            self._send(key, AbortRequest(request_id=req.request_id,  # rank asked: nothing of it went there
                                         reason=f"prefill rank {self.layout.tp_rank}: {failed[1]}"))
            self._send(key, Quiesced(request_id=req.request_id))
        elif out is not None:
            self._attach(out, key, req)
        elif req.request_id in self._aborted_early:
            self._send(key, Quiesced(request_id=req.request_id))
        else:
            self._early.setdefault(req.request_id, []).append((time.monotonic(), key, req))

    def _on_abort(self, key: tuple, msg: AbortRequest) -> None:
        reason = f"aborted by decode rank {key}: {msg.reason}"
        if msg.request_id in self._outgoing:
            self._fail(msg.request_id, reason)
            out = self._outgoing[msg.request_id]
            if key not in out.dests:  # it asked for nothing yet: nothing of ours can land there
                self._send(key, Quiesced(request_id=msg.request_id))
        else:  # before sender(): remember, and nothing can be in flight
            self._early.pop(msg.request_id, None)
            self._aborted_early[msg.request_id] = (time.monotonic(), reason)
            self._send(key, Quiesced(request_id=msg.request_id))

    # -- loop thread: timers and transfers --------------------------------------------------
    def _tick(self) -> float:
        for transport in self.endpoints.transports.values():  # nothing is written here, but a holder
            transport.poll_notifications()  # of decode exports answers their revokes only while called
        now = time.monotonic()
        # both sets name requests in _outgoing only: _finish takes an id out of every one
        for rid in list(self._computing):  # chunks waiting for the engine's stream
            self._flush(self._outgoing[rid])
        busy = bool(self._computing)
        for rid in list(self._moving):  # the others wait for an ask or a chunk: nothing to poll
            out = self._outgoing[rid]
            busy |= self._advance(out)
            state = out.sender.status.state
            if state is KVPoll.Success or (state is KVPoll.Failed and not out.inflight):
                self._finish(rid, out)
            elif not out.inflight:
                self._moving.discard(rid)
        if now >= self._next_sweep:  # timeouts are seconds long: every request looked at every SWEEP_INTERVAL_S
            self._next_sweep = now + SWEEP_INTERVAL_S
            self._sweep(now)
        for key, peer in list(self._leaving.items()):
            if not any(k == key for rid in self._moving for _, k in self._outgoing[rid].inflight):
                del self._leaving[key]
                self._close_peer(peer)
                self._router.send_multipart([peer.identity, Goodbye(incarnation=self.incarnation).to_msgpack()],
                                            zmq.NOBLOCK)
        lost = [p for p in self._decode.values() if now - p.last_seen > self.config.heartbeat_timeout_s]
        if lost:  # read what came meanwhile first: a long turn here is this rank's pause, not their silence
            self._on_router()
            lost = [p for p in lost if self._decode.get(p.hello.key) is p
                    and now - p.last_seen > self.config.heartbeat_timeout_s]
        for peer in lost:
            self._decode.pop(peer.hello.key, None)
            self._drop_peer(peer, f"decode rank {peer.hello.key} lost: no heartbeat for "
                                  f"{self.config.heartbeat_timeout_s:g} s")
        return self.config.loop_pause(busy)

    def _sweep(self, now: float) -> None:
        """Fail the requests past their deadline; forget the ids nobody claimed in time; drop the
        decode ranks silent for two heartbeat intervals whose process has ended (no need to wait
        for the heartbeat timeout: :mod:`kvtransfer.control.liveness`)."""
        for key, peer in list(self._decode.items()):
            if now - peer.last_seen > 2 * self.config.heartbeat_interval_s and ended(peer.process, self._process):
                del self._decode[key]
                self._drop_peer(peer, f"decode rank {key} lost: its process (pid {peer.process.pid}) has exited")
        for rid, out in list(self._outgoing.items()):
            if out.sender.status.state.final:
                continue
            if now > out.deadline:
                self._fail(rid, f"not done after {self.config.transfer_timeout_s:g} s ({self._describe(out)})")
            elif not self._decode and not out.dests and now - out.since > self.config.handshake_timeout_s:
                self._fail(rid, f"no decode node is connected to this prefill node (none for "
                                f"{self.config.handshake_timeout_s:g} s): send requests through the router, "
                                f"which pairs each with a decode node")
        horizon = now - self.config.transfer_timeout_s
        for rid in [r for r, asks in self._early.items() if asks[0][0] < horizon]:
            del self._early[rid]
        for table in (self._aborted_early, self._failed):
            for rid in [r for r, (when, _) in table.items() if when < horizon]:
                del table[rid]
        for identity in [i for i, (when, _, _) in self._dropped.items() if when < horizon]:
            del self._dropped[identity]  # a later message from it is answered all the same

    def _advance(self, out: _Outgoing) -> bool:
        """Poll the request's writes; True while some are in flight."""
        still = []
        for transfer, key in out.inflight:
            status = transfer.status()
            if status is TransferStatus.PENDING:
                still.append((transfer, key))
                continue
            if status is TransferStatus.FAILED:
                self._fail(out.sender.request_id, f"write to decode rank {key} failed: {transfer.error}")
        out.inflight = still
        if out.last_posted and not still:
            out.sender.status.advance(KVPoll.Success)
        return bool(still)

    def _finish(self, rid: str, out: _Outgoing) -> None:
        """Forget an ended request; a failed one tells its decode ranks nothing is in flight."""
        if out.sender.status.state is KVPoll.Failed:
            for key in out.dests:
                self._send(key, Quiesced(request_id=rid))
        del self._outgoing[rid]
        self._moving.discard(rid)
        self._computing.discard(rid)
        self._senders.pop(rid)

    def _describe(self, out: _Outgoing) -> str:
        if not out.ready:
            missing = sorted(out.expected - set(out.dests)) if out.expected else "every decode rank"
            return f"waiting for the destination from {missing}"
        if out.chunks:
            return f"{out.tokens_sent} tokens sent, the next chunk's KV not computed yet"
        if not out.last_posted:
            return f"{out.tokens_sent} tokens sent, waiting for the last chunk"
        return f"{len(out.inflight)} writes in flight"

    def _drop_peer(self, peer: _DecodePeer, reason: str) -> None:
        log.warning("prefill rank %d: %s", self.layout.tp_rank, reason)
        self._fail_requests_of(peer.hello.key, reason)
        self._by_identity.pop(peer.identity, None)
        self._dropped[peer.identity] = (time.monotonic(), reason, False)
        self._close_peer(peer)

    def _fail_requests_of(self, key: tuple, reason: str) -> None:
        for rid, out in list(self._outgoing.items()):
            if key in out.dests or key in out.expected:
                self._fail(rid, reason)

    def _close_peer(self, peer: _DecodePeer) -> None:
        try:
            peer.peer.close()
        except TransportError as exc:
            log.debug("closing the transport peer of %s: %s", peer.hello.key, exc)

    def _shutdown(self) -> None:
        for rid in list(self._outgoing):
            self._fail(rid, "the prefill manager closed")
        deadline = time.monotonic() + 5.0
        while any(out.inflight for out in self._outgoing.values()) and time.monotonic() < deadline:
            for out in self._outgoing.values():
                self._advance(out)
            time.sleep(0.001)
        for rid, out in list(self._outgoing.items()):
            self._finish(rid, out)
        for key in list(self._decode):  # decode ranks stop asking a closed rank at once
            self._send(key, Goodbye(incarnation=self.incarnation))
        for peer in [*self._decode.values(), *self._leaving.values()]:
            self._close_peer(peer)
        self._decode.clear()
        self._leaving.clear()
