"""The prefill side of the control plane: :class:`PrefillKVManager` and :class:`KVSender`.

One manager per prefill rank. At start it registers its pools' buffers with its transports
(``nixl``, and ``nvlink`` beside it for CUDA pools), binds its control socket (a ZeroMQ
ROUTER), and registers with the bootstrap service. Decode ranks then introduce themselves
(``DecodeHello``: layout, one endpoint per transport: export and buffer map); the manager
checks the layouts (a mismatch is refused, naming the field and both values) and connects
over the best transport both sides have: ``nvlink`` when both offer it on one host and CUDA
IPC works, else ``nixl``. Where the transport keeps a pair set's part of a write resident
(NVLink's direct path), the pairs of this rank's writes to that decode rank are made resident
then, once: they depend on the two layouts only (:mod:`kvtransfer.control.prefill_peers`).

Per request, the engine calls ``sender = manager.sender(request_id)`` and then
``sender.send(slots, last=...)`` once per chunk of a chunked prefill: ``slots`` are this
rank's token slots of the chunk's tokens, in order; the last chunk also carries the Mamba
state slot and the aux record (the first output token, :func:`~kvtransfer.control.aux_records.
pack_first_token`). Each decode rank of the request sends a ``TransferRequest`` (its
destination slots, the prefix it already holds, its state slot); chunks queued
before every expected decode rank has asked wait for it. Tokens decode already holds are not
sent. Every write carries a ``KVArrived`` notification; the last write to each decode rank
carries the number of writes, so decode knows when it has everything.

Layer by layer: ``sender.send(slots, layers=(first, end))`` sends only the KV of the layers at
positions ``first .. end - 1`` of the layout's layer order (:meth:`TransferPlan.select` of the
chunk's plan), so a chunk's KV may leave while its later layers still compute. A chunk sent so
goes in consecutive groups from position 0 to the last layer, each with the chunk's slots; the
group that ends at the last layer also carries what a whole chunk does after its KV (the NSA
index, and for the last chunk the Mamba state and the aux record).

KV on a GPU: ``send()`` may come as soon as the chunk's KV is queued on the caller's current
CUDA stream (not necessarily computed yet): it records an event there (not for a chunk of no
tokens, which reads nothing, unless it is the last one with Mamba state). Where every decode rank
of the request is reached through a transport that reads in device order (NVLink:
``Peer.orders_on_device``), the chunk's writes are posted at once, from a stream of the
manager's that waits for that event: their copies start on the GPU when the KV is computed,
with no host poll in between (a layer group sent from the forward leaves as soon as its layers
end). Through the others (NIXL, which reads memory when it moves it), the writes are posted
once the event has completed, which the manager's turns look at (at once when it has already:
an engine that synchronised first pays one event record and query).

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
:mod:`kvtransfer.control.liveness`), and one a write to which failed in a way that lost its
transport peer (``Peer.lost``: NIXL's status check failed or the write passed its deadline; the
transport then refuses every write to it until a new connect). If it was only paused, or is
alive after all, its next message is answered ``NotConnected`` and it says hello again; a hello
from a known rank replaces the old entry (its requests fail, its transport peer is closed with
drain) before it is acknowledged, and a hello whose transport cannot connect yet (the failed
writes still run in the backend) is answered once it can.

Threads: every transport call and socket operation happens in a turn of the manager's event
loop, one at a time: on its thread, or, for ``send()`` while the loop is between turns, on the
caller's thread (no thread switch on the way to the post; ``EventLoop.call(inline=True)``);
``sender()``, ``send()``, ``poll()`` and ``abort()`` may be called from any thread.
``close()`` leaves the bootstrap registry, fails what is in flight, closes peers, sockets and
the thread, and deregisters.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Callable, Optional

import numpy as np
import zmq

from kvtransfer.control.aux_records import AUX_RECORD_BYTES
from kvtransfer.control.base import BaseKVManager, BaseKVSender, check_on_change
from kvtransfer.control.bootstrap import BootstrapClient
from kvtransfer.control.config import SWEEP_INTERVAL_S, ControlConfig
from kvtransfer.control.endpoints import Endpoints, default_host_id
from kvtransfer.control.event_loop import EventLoop
from kvtransfer.control.liveness import ProcessId
from kvtransfer.control.prefill_peers import DecodePeer, DecodeRanks
from kvtransfer.control.prefill_request import Chunk, PrefillRequest
from kvtransfer.control.state import KVPoll, RequestStatus, RequestTable
from kvtransfer.control.wire import (
    PROTOCOL_VERSION,
    AbortRequest,
    DecodeHello,
    Goodbye,
    Heartbeat,
    Quiesced,
    RegisterPrefill,
    TransferRequest,
    VersionMismatch,
    WireError,
    decode,
)
from kvtransfer.layout import RankLayout, StateKind
from transport.base import TransportError

__all__ = ["KVSender", "PrefillKVManager"]

log = logging.getLogger("kvtransfer.control.prefill")


def _slots(name: str, slots) -> np.ndarray:
    arr = np.asarray(slots)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D array of ints, got {arr.dtype} of shape {list(arr.shape)}")
    return np.array(arr, dtype=np.int64)


def next_layer_group(request_id: str, group: tuple, layers: Optional[tuple], tokens: int, num_layers: int,
                     last: bool) -> tuple:
    """Check one ``send()``'s ``layers`` against where the chunk being sent layer by layer
    stands (``group``: the next layer position and the chunk's tokens; ``(0, 0)`` between
    chunks); the group after it. ValueError naming what is wrong."""
    at, chunk_tokens = group
    if layers is None:
        if at:
            raise ValueError(f"request {request_id!r}: layers {at}..{num_layers - 1} of the chunk are not sent yet")
        return 0, 0
    if (not isinstance(layers, tuple) or len(layers) != 2
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in layers)):
        raise ValueError(f"request {request_id!r}: layers must be (first, end) layer positions, got {layers!r}")
    first, end = int(layers[0]), int(layers[1])
    if not 0 <= first < end <= num_layers:
        raise ValueError(f"request {request_id!r}: layers ({first}, {end}) outside the {num_layers} layers")
    if first != at:
        raise ValueError(f"request {request_id!r}: layers ({first}, {end}) sent when layer {at} of the chunk "
                         f"comes next")
    if at and tokens != chunk_tokens:
        raise ValueError(f"request {request_id!r}: layers ({first}, {end}) of a chunk of {chunk_tokens} tokens "
                         f"sent with {tokens} slots")
    if last and end != num_layers:
        raise ValueError(f"request {request_id!r}: the last chunk ends with its layer {num_layers - 1}, "
                         f"not with layers ({first}, {end})")
    return (0, 0) if end == num_layers else (end, tokens)


class KVSender(BaseKVSender):
    """One request on this prefill rank (see the module docstring)."""

    def __init__(self, manager: "PrefillKVManager", request_id: str):
        self.request_id = request_id
        self.status = RequestStatus(request_id, manager.on_change)
        self._mgr = manager
        self._last_sent = False
        self._kicked = False  # the loop was woken since this request was made (making it does not wake it)
        self._group = (0, 0)  # (next layer position, tokens) of a chunk sent layer by layer; (0, 0) between chunks

    def poll(self) -> KVPoll:
        if not self._kicked:  # the manager learns of this request at its next turn: make that now
            self._kicked = True
            self._mgr._loop.wake()
        return self.status.state

    @property
    def failure(self) -> Optional[str]:
        return self.status.reason

    def send(self, slots, *, last: bool = False, state_slot: Optional[int] = None,
             aux: Optional[bytes] = None, layers: Optional[tuple] = None) -> None:
        """Queue one chunk: this rank's token slots of the request's next tokens. The last
        chunk (``last=True``) also sends the Mamba state (``state_slot``, required when the
        model has state) and ``aux`` (at most ``AUX_RECORD_BYTES``). KV on a GPU may still be
        computing on the caller's current stream: the writes wait for it (module doc).
        ``layers=(first, end)``: only those layer positions of the chunk (module doc, "Layer
        by layer"); ``last`` then goes with the group that ends at the last layer."""
        if self._last_sent:
            raise ValueError(f"request {self.request_id!r}: send() after the last chunk")
        arr = _slots("slots", slots)
        self._group = next_layer_group(self.request_id, self._group, layers, arr.size,
                                       len(self._mgr.layout.layer_ids), last)
        mamba = last and self._mgr.layout.state_kind is StateKind.MAMBA  # the last chunk writes the state
        if mamba:
            if not isinstance(state_slot, (int, np.integer)) or isinstance(state_slot, bool) or state_slot <= 0:
                raise ValueError(f"request {self.request_id!r}: the last chunk of a model with Mamba state needs "
                                 f"its state_slot (an int > 0), got {state_slot!r}")
        if aux is not None and (not isinstance(aux, (bytes, bytearray)) or len(aux) > AUX_RECORD_BYTES):
            raise ValueError(f"aux must be at most {AUX_RECORD_BYTES} bytes, got {aux!r:.40}")
        self._last_sent, self._kicked = last, True
        # what the writes read may still be computing (a chunk of no tokens without state reads nothing)
        computed = self._mgr._stream_mark() if arr.size or mamba else None
        chunk = Chunk(arr, last, state_slot, aux, computed, layers)
        # inline: posted from this thread when the loop is between turns (no wake-up on the way)
        self._mgr._loop.call(self._mgr._on_send, self, chunk, inline=True)

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._mgr._loop.call(self._mgr._fail, self.request_id, reason)


class PrefillKVManager(BaseKVManager):
    """The KV manager of one prefill rank (see the module docstring).

    Its state, all on the loop thread: the decode ranks (``_ranks``), the
    requests (``_outgoing`` and the two working sets ``_moving`` / ``_computing`` that its
    tick polls), and what came for an id before or after its sender lived (``_early``,
    ``_aborted_early``, ``_failed``)."""

    def __init__(self, layout: RankLayout, transports, kv_infos, state_infos=None, *,
                 bootstrap: str, config: ControlConfig = ControlConfig(), device: Optional[int] = None,
                 host_id: Optional[str] = None, on_change: Optional[Callable[[], None]] = None):
        if not isinstance(layout, RankLayout):
            raise TypeError(f"layout must be a RankLayout, got {type(layout).__name__}")
        self.layout, self.config = layout, config
        self.on_change = check_on_change(on_change)
        self.incarnation = uuid.uuid4().hex
        self.endpoints = Endpoints(transports, kv_infos, state_infos, device)
        self._device = device  # the pools' GPU (None: host memory)
        self._post_stream = None  # where writes of KV still computing are posted from (_ready)
        self.host = host_id or default_host_id()  # this host's identity in registrations
        self.process = ProcessId.mine()
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
        self._outgoing: dict = {}  # request id -> PrefillRequest
        self._moving: set = set()  # request ids with writes in flight, or posted or failed since the last turn
        self._computing: set = set()  # request ids whose next chunk waits for the engine's stream (_flush)
        self._next_sweep = 0.0  # when _tick next looks at every request (deadlines, forgotten ids)
        self._early: dict = {}  # request id -> [(time, key, TransferRequest)] that came before sender()
        self._aborted_early: dict = {}  # request id -> (time, reason): aborts that came before sender()
        self._failed: dict = {}  # request id -> (time, reason): failed; a late ask is told so
        self._ranks = DecodeRanks(self._router, self, on_drop=self._fail_requests_of)
        self._decode = self._ranks.peers  # (instance, tp_rank) -> DecodePeer
        self._handlers = {Heartbeat: self._ranks.answer_heartbeat, TransferRequest: self._on_request,
                          AbortRequest: self._on_abort, Goodbye: self._ranks.leave}  # a connected rank's messages
        self._loop = EventLoop(f"kvt-prefill{layout.tp_rank}", {self._router: self._on_router}, self._tick,
                               fds=self.endpoints.notification_fds())
        self._bootstrap = BootstrapClient(bootstrap)
        try:
            self._bootstrap.register(RegisterPrefill(
                dp_rank=config.dp_rank, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
                control_addr=self.control_addr, host=self.host, endpoints=self.endpoints.wire(),
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

    # -- loop thread: requests ----------------------------------------------------------
    def _on_new_sender(self, sender: KVSender) -> None:
        rid = sender.request_id
        self._failed.pop(rid, None)  # an id used again after a failure
        out = self._outgoing[rid] = PrefillRequest(rid, sender.status, since=time.monotonic())
        aborted = self._aborted_early.pop(rid, None)
        if aborted is not None:
            self._fail(rid, aborted[1])
            return
        for _, key, req in self._early.pop(rid, []):
            self._attach(out, key, req)

    def _on_send(self, sender: KVSender, chunk: Chunk) -> None:
        out = self._outgoing.get(sender.request_id)
        if out is None or sender.status.state.final:
            return  # failed (and forgotten) meanwhile: nothing to send
        out.chunks.append(chunk)
        self._flush(out)

    def _attach(self, out: PrefillRequest, key: tuple, req: TransferRequest) -> None:
        if key not in self._decode:
            self._fail(out.request_id, f"decode rank {key} asked without a hello")
            return
        error = out.attach(key, req, self._askers_of, time.monotonic(), self.config.transfer_timeout_s)
        if error:
            self._fail(out.request_id, error)
        elif out.ready:
            self._flush(out)

    def _askers_of(self, instance: str) -> frozenset:
        """Every decode rank of ``instance``: each asks every prefill rank of the group (a
        rank it does not read from too, so that no prefill rank waits for nothing)."""
        peer = next((p for k, p in self._decode.items() if k[0] == instance), None)
        return frozenset() if peer is None else frozenset((instance, d) for d in range(peer.layout.tp_size))

    def _flush(self, out: PrefillRequest) -> None:
        """Post the queued chunks, in order, once every decode rank asked and while each one's
        KV is computed (a chunk whose event has not completed waits; each turn looks again)."""
        rid = out.request_id
        self._computing.discard(rid)
        if not out.ready or out.status.state.final:
            return
        if out.chunks and time.monotonic() > out.deadline:  # the decode rank may have let its pages go
            self._fail(rid, f"not done after {self.config.transfer_timeout_s:g} s: its deadline passed before "
                            f"a chunk was posted")
            return
        try:
            while out.chunks:
                where = self._ready(out, out.chunks[0])
                if where is None:
                    return
                chunk = out.chunks.pop(0)
                with where:
                    out.post(chunk, self.layout, self._decode)
                self._moving.add(rid)
        except (ValueError, TypeError, TransportError) as exc:  # bad slots, a peer gone, a closed transport
            self._fail(rid, f"cannot write: {exc}")

    def _ready(self, out: PrefillRequest, chunk: Chunk):
        """The context the chunk's writes may be posted in now, else None. Its KV complete: as
        it is. Still computing, every transport it goes through reading in device order
        (``Peer.orders_on_device``: NVLink): this manager's post stream, made to wait for the
        chunk's event, so the copies start on the GPU as soon as the KV is computed, with no
        host poll between. Else the request waits in ``_computing`` (failed when the engine's
        stream did: its KV never comes)."""
        try:
            if chunk.computed is None or chunk.computed.query():
                return contextlib.nullcontext()
        except RuntimeError as exc:  # a CUDA error on the engine's stream
            self._fail(out.request_id, f"the engine's stream failed before a chunk's KV was computed: {exc}")
            return None
        peers = (self._decode.get(key) for key in out.dests)
        if all(p.peer.orders_on_device() for p in peers if p is not None and p.reads_from_me):
            import torch

            if self._post_stream is None:
                self._post_stream = torch.cuda.Stream(self._device)
            self._post_stream.wait_event(chunk.computed)
            return torch.cuda.stream(self._post_stream)
        self._computing.add(out.request_id)
        return None

    def _stream_mark(self):
        """The caller's current CUDA stream as of now, for a chunk's KV on the GPU (a recorded
        event; None for host pools)."""
        if self._device is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _fail(self, request_id: str, reason: str) -> None:
        """Fail a request: abort its writes; tell its decode ranks (Quiesced follows once no
        write is in flight)."""
        out = self._outgoing.get(request_id)
        if out is None or not out.fail(reason):
            return
        self._moving.add(request_id)  # the loop finishes it once none of its writes is in flight
        log.info("request %s failed on prefill rank %d: %s", request_id, self.layout.tp_rank, reason)
        self._failed[request_id] = (time.monotonic(), reason)  # a decode rank that asks later is told
        for key in out.dests:
            self._ranks.send(key, AbortRequest(request_id=request_id, reason=f"prefill rank {self.layout.tp_rank}: "
                                                                       f"{reason}"))

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
                    self._ranks.ack(identity, f"this prefill rank speaks control protocol {PROTOCOL_VERSION}, not "
                                        f"{exc.version!r}")
                continue
            if isinstance(msg, DecodeHello):  # the one message a socket without a hello may send
                self._ranks.hello(identity, msg)
                continue
            key, peer = self._ranks.of_socket(identity)
            if key is None:
                self._ranks.not_connected(identity, msg)
                continue
            if peer is None:  # said goodbye or was dropped meanwhile
                log.debug("prefill rank %d dropped %s from a departed decode rank", self.layout.tp_rank, msg.KIND)
                continue
            peer.session.heard(time.monotonic())
            handler = self._handlers.get(type(msg))
            if handler is None:
                log.warning("prefill rank %d dropped an unexpected %s", self.layout.tp_rank, msg.KIND)
            else:
                handler(peer, msg)

    def _on_request(self, peer: DecodePeer, req: TransferRequest) -> None:
        key = peer.key
        out = self._outgoing.get(req.request_id)
        failed = self._failed.get(req.request_id)
        if failed is not None and (out is None or key not in out.dests):  # it failed before that decode
            self._ranks.send(key, AbortRequest(request_id=req.request_id,  # rank asked: nothing of it went there
                                         reason=f"prefill rank {self.layout.tp_rank}: {failed[1]}"))
            self._ranks.send(key, Quiesced(request_id=req.request_id))
        elif out is not None:
            self._attach(out, key, req)
        elif req.request_id in self._aborted_early:
            self._ranks.send(key, Quiesced(request_id=req.request_id))
        else:
            self._early.setdefault(req.request_id, []).append((time.monotonic(), key, req))

    def _on_abort(self, peer: DecodePeer, msg: AbortRequest) -> None:
        key = peer.key
        reason = f"aborted by decode rank {key}: {msg.reason}"
        if msg.request_id in self._outgoing:
            self._fail(msg.request_id, reason)
            out = self._outgoing[msg.request_id]
            if key not in out.dests:  # it asked for nothing yet: nothing of ours can land there
                self._ranks.send(key, Quiesced(request_id=msg.request_id))
        else:  # before sender(): remember, and nothing can be in flight
            self._early.pop(msg.request_id, None)
            self._aborted_early[msg.request_id] = (time.monotonic(), reason)
            self._ranks.send(key, Quiesced(request_id=msg.request_id))

    # -- loop thread: timers and transfers --------------------------------------------------
    def _tick(self) -> float:
        for transport in self.endpoints.transports.values():  # nothing is written here, but a holder
            transport.poll_notifications()  # of decode exports answers their revokes only while called
        now = time.monotonic()
        # both sets name requests in _outgoing only: _finish takes an id out of every one
        for rid in list(self._computing):  # chunks waiting for the engine's stream
            self._flush(self._outgoing[rid])
        busy = bool(self._computing)
        failed_to: set = set()  # decode ranks a write to failed in this turn
        for rid in list(self._moving):  # the others wait for an ask or a chunk: nothing to poll
            out = self._outgoing[rid]
            busy |= out.poll_writes(lambda key, error: self._write_failed(rid, key, error, failed_to))
            state = out.status.state
            if state is KVPoll.Success or (state is KVPoll.Failed and not out.inflight):
                self._finish(rid, out)
            elif not out.inflight:
                self._moving.discard(rid)
        if failed_to:  # those whose transport peer is lost are dropped, to be connected anew
            self._ranks.drop_lost(failed_to)
        if now >= self._next_sweep:  # timeouts are seconds long: every request looked at every SWEEP_INTERVAL_S
            self._next_sweep = now + SWEEP_INTERVAL_S
            self._sweep(now)
        self._ranks.close_settled()
        self._ranks.drop_silent(now, self._on_router)
        return self.config.loop_pause(busy)

    def _write_failed(self, rid: str, key: tuple, error: str, failed_to: set) -> None:
        """A write of request ``rid`` to decode rank ``key`` failed: the request fails, and the
        rank is noted in ``failed_to`` (the turn then drops it if its transport peer is lost)."""
        failed_to.add(key)
        self._fail(rid, f"write to decode rank {key} failed: {error}")

    def _sweep(self, now: float) -> None:
        """Fail the requests past their deadline; forget the ids nobody claimed in time; drop the
        decode ranks known to have ended (:meth:`DecodeRanks.sweep`)."""
        horizon = now - self.config.transfer_timeout_s
        self._ranks.sweep(now, horizon)
        for rid, out in list(self._outgoing.items()):
            if out.status.state.final:
                continue
            if now > out.deadline:
                self._fail(rid, f"not done after {self.config.transfer_timeout_s:g} s ({out.describe()})")
            elif not self._decode and not out.dests and now - out.since > self.config.handshake_timeout_s:
                self._fail(rid, f"no decode node is connected to this prefill node (none for "
                                f"{self.config.handshake_timeout_s:g} s): send requests through the router, "
                                f"which pairs each with a decode node")
        for rid in [r for r, asks in self._early.items() if asks[0][0] < horizon]:
            del self._early[rid]
        for table in (self._aborted_early, self._failed):
            for rid in [r for r, (when, _) in table.items() if when < horizon]:
                del table[rid]

    def _finish(self, rid: str, out: PrefillRequest) -> None:
        """Forget an ended request; a failed one tells its decode ranks nothing is in flight."""
        if out.status.state is KVPoll.Failed:
            for key in out.dests:
                self._ranks.send(key, Quiesced(request_id=rid))
        del self._outgoing[rid]
        self._moving.discard(rid)
        self._computing.discard(rid)
        self._senders.pop(rid)

    def _fail_requests_of(self, key: tuple, reason: str) -> list:
        """Fail the requests that decode rank ``key`` takes part in (a dropped or leaving rank):
        the writes to it still in flight (cancelled), which its transport peer outlives."""
        writes = []
        for rid, out in list(self._outgoing.items()):
            if key in out.dests or key in out.expected:
                self._fail(rid, reason)
            writes += [transfer for transfer, k in out.inflight if k == key]
        return writes

    def _shutdown(self) -> None:
        for rid in list(self._outgoing):
            self._fail(rid, "the prefill manager closed")
        deadline = time.monotonic() + 5.0
        while any(out.inflight for out in self._outgoing.values()) and time.monotonic() < deadline:
            for rid, out in self._outgoing.items():
                out.poll_writes(lambda key, error: None)  # failed already: only their end is awaited
            time.sleep(0.001)
        for rid, out in list(self._outgoing.items()):
            self._finish(rid, out)
        self._ranks.close()
