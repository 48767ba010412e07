"""The nvlink transport and its connected peers.

:class:`NvlinkTransport`: this process's GPU regions, exported as CUDA IPC handles. All regions
of one transport live on one GPU, the one whose SMs run the copy kernel. ``register`` exports a
CUDA IPC handle for each region (its allocation's handle plus the region's offset,
:mod:`transport.nvlink.ipc`); ``connect`` maps a peer's export into an :class:`NvlinkPeer`;
``poll_notifications`` reads the mailbox; ``deregister`` revokes the region from the peers that
hold it first (:mod:`transport.nvlink.revoke`). It owns what its peers share: the copy stream
and the slot ring (:mod:`transport.nvlink.direct`), the staged lanes, the C steps where they
load, the progress thread and the mailbox thread.

:class:`NvlinkPeer`: one connected peer, the facade over its parts: the mapping of the peer's
regions (:mod:`~transport.nvlink.ipc`), the engine choice and tables
(:mod:`~transport.nvlink.prepare`), the outbox to the peer's mailbox, the FIFO of pending
transfers (:mod:`~transport.nvlink.completion`) and its hold of the peer's export
(:mod:`~transport.nvlink.revoke`: the regions the peer revoked). Its write methods are where a
write's steps are called in order (the package docstring follows one write through).
"""

from __future__ import annotations

import os
import uuid
from typing import Mapping, Optional, Union

import numpy as np

from transport.base import (
    Notification, Peer, Region, RegionSizes, StridedBatch, Transport, TransportClosed, WriteBatch, pack_descriptor)
from transport.nvlink import ipc, native, staged
from transport.nvlink.completion import NvlinkTransfer, PendingQueue, Progress
from transport.nvlink.config import NvlinkConfig, NvlinkEngine, check_engine
from transport.nvlink.direct import CopyStream, PairCache, SlotRing, StagedPart, build_plan
from transport.nvlink.ipc import BACKEND, NvlinkUnsupported, PeerMapping, gpu_uuid, local_ordinal, parse_descriptor
from transport.nvlink.kernel import SplitLaunch, StageMode
from transport.nvlink.landed import Lander, ask_spin
from transport.nvlink.mailbox import Inbox, MailboxUnreachable, Outbox, host_id
from transport.nvlink.prepare import EngineRoute, PreparedWrite, WriteTables, base_table, build
from transport.nvlink.revoke import Hold, MailboxHolders, MailboxThread
from transport.registry import RegionRegistry
from transport.revocation import wire as revoke_wire

__all__ = ["NvlinkPeer", "NvlinkTransport"]


# -- the transport ---------------------------------------------------------------------------------


_UNSET = object()


class NvlinkTransport(Transport):
    """GPU regions of this process, exported as CUDA IPC handles; see :mod:`transport.nvlink`.

    ``name``: this transport's name (default ``nvlink-<pid>-<random>``, unique per
    transport); its export carries it, and its notifications reach peers with it as sender."""

    backend = BACKEND

    def __init__(self, config: Optional[NvlinkConfig] = None, name: Optional[str] = None):
        self.config = config if config is not None else NvlinkConfig()
        if not isinstance(self.config, NvlinkConfig):
            raise TypeError(f"config must be an NvlinkConfig, got {type(self.config).__name__}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        self.name = name or f"nvlink-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._registry = RegionRegistry()  # handles: ipc.IpcExport per region
        self._device: Optional[int] = None
        self._copy: Optional[CopyStream] = None
        self._peers: list[NvlinkPeer] = []
        self._lanes: dict[int, staged.StagedLane] = {}  # peer GPU -> staged lane
        self._ring: Optional[SlotRing] = None  # slots of the direct path, made at its first write
        self._native = _UNSET  # the direct path's C steps, or None (_native_steps)
        self._holders = MailboxHolders(self._registry, lambda: self._inbox.read())  # who holds our export
        self._inbox = Inbox(self._holders)
        self._mailbox = MailboxThread()  # reads what the owners of the exports we hold send our peers
        self._progress = Progress(lambda: any([p._advance() for p in list(self._peers)]), self._oldest_event)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"transport {self.name!r} is closed")

    def _api(self):
        return ipc.load_api(self.config.ipc_api)

    def _copy_stream(self) -> CopyStream:
        """The copy stream on this transport's GPU (:class:`NvlinkUnsupported` before a region)."""
        if self._device is None:
            raise NvlinkUnsupported("register a GPU region before connecting: the nvlink backend copies with the local GPU")
        if self._copy is None:
            self._copy = CopyStream(self._api(), self._device, self.config.wait_current_stream, self._native_steps())
        return self._copy

    def _native_steps(self):
        """The direct path's C steps (:mod:`transport.nvlink.native`), loaded at the first
        call; None when configured off or unavailable (:attr:`native_unavailable` says why)."""
        if self._native is _UNSET:
            self._native = native.load() if self.config.native else None
            if self._native is not None:
                ask_spin(self._native, self.config.lander_spin_us * 1000)
        return self._native

    @property
    def native_unavailable(self) -> Optional[str]:
        """Why the direct path runs its host steps in Python (None: in C, or not decided yet)."""
        if self._native is _UNSET or self._native is not None:
            return None
        return "configured off (NvlinkConfig.native=False)" if not self.config.native else native.why_unavailable()

    def _lane(self, peer_gpu: int) -> staged.StagedLane:
        if peer_gpu not in self._lanes:
            self._lanes[peer_gpu] = staged.open_lane(self._api(), self._copy_stream().device, peer_gpu,
                                                     self.config.staged)
        return self._lanes[peer_gpu]

    def _slot_ring(self) -> Optional[SlotRing]:
        """The ring of slots of the direct path (None: configured off), shared by every peer:
        all of them enqueue on the one copy stream."""
        if self._ring is None and self.config.slot_ring_bytes:
            copy = self._copy_stream()
            self._ring = SlotRing.allocate(self._api(), copy.device, self.config.slot_ring_bytes // 8, copy.stream,
                                           self._native_steps())
        return self._ring

    def _sync_lanes(self) -> None:
        for lane in self._lanes.values():
            lane.synchronize()

    # -- regions --------------------------------------------------------------------------
    def register(self, ptr: int, length: int, device: Optional[int] = None) -> int:
        self._check_open()
        self._registry.check_free(ptr, length, device)
        if device is None:
            raise NvlinkUnsupported("the nvlink backend moves GPU memory only; register host memory with the nixl backend")
        if self._device is not None and device != self._device:
            raise ValueError(f"all regions of one nvlink transport share a GPU: have cuda:{self._device}, got cuda:{device}")
        try:
            exp = ipc.export_region(self._api(), ptr, length, device)
        except (ipc.CudaIpcError, ipc.CudaIpcUnavailable) as exc:
            raise NvlinkUnsupported(f"cannot export [0x{ptr:x}, +{length}) on cuda:{device} by CUDA IPC: {exc}") from None
        self._device = device
        return self._registry.add(ptr, length, device, handle=exp).region_id

    def deregister(self, region_id: int, force: bool = False) -> None:
        """Forget a region once no peer can write into it: it is revoked from every peer that
        holds an export naming it, waiting for their acknowledgement or the end of their
        connection (at most ``config.revoke_timeout_s``; :class:`~transport.base.RevokeTimeout`
        naming the silent ones, the region still registered, unless ``force``). See
        "Deregistering exported memory" in :mod:`transport.nvlink`."""
        self._check_open()
        self._registry.get(region_id)
        self._holders.revoke(region_id, self.config.revoke_timeout_s, force)
        self._registry.remove(region_id)  # an IPC export holds nothing to release

    @property
    def regions(self) -> Mapping[int, Region]:
        return self._registry.view

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        self._check_open()
        handles = [[reg.region_id, exp.handle, exp.offset, exp.alloc_size] for reg, exp in self._registry.items()]
        return pack_descriptor(
            BACKEND, self._registry.view.values(), name=self.name, host=host_id(), pid=os.getpid(),
            mailbox=self._inbox.name, ipc=handles, gpu_uuid=gpu_uuid(self._device),
        )

    def connect(self, peer_bytes: bytes) -> NvlinkPeer:
        self._check_open()
        body, regions, handles = parse_descriptor(peer_bytes)
        if body["host"] != host_id():
            raise NvlinkUnsupported(f"peer {body['name']!r} is on host {body['host']!r}, this process on {host_id()!r}")
        if body["pid"] == os.getpid():
            raise NvlinkUnsupported("the peer is this process: the nvlink backend connects two processes")
        peer_gpu = local_ordinal(body.get("gpu_uuid"))
        peer = NvlinkPeer(self, body["name"], regions, handles, body["mailbox"], peer_gpu)
        self._peers.append(peer)
        return peer

    def _oldest_event(self):
        """The event of the oldest pending transfer of some peer (None: none pending); the
        progress thread waits on it."""
        for peer in list(self._peers):
            event = peer._queue.oldest_event()
            if event is not None:
                return event
        return None

    def _forget_peer(self, peer: NvlinkPeer) -> None:
        if peer in self._peers:
            self._peers.remove(peer)

    def poll_notifications(self) -> list[Notification]:
        self._check_open()
        return self._inbox.poll()

    def notification_fd(self) -> Optional[int]:
        """See :meth:`Transport.notification_fd`: the inbox's bell, which each writer rings
        as its landed word moves (:mod:`transport.nvlink.mailbox`, "The doorbell")."""
        self._check_open()
        return self._inbox.bell

    def writer_gone(self, name: str) -> Optional[str]:
        """See :meth:`Transport.writer_gone`: every mailbox connection of ``name`` ended (it
        closed those peers, or its process is gone), as the inbox read it."""
        self._check_open()
        return self._holders.gone(name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._progress.stop()
        for peer in list(self._peers):
            peer.close()
        self._mailbox.stop()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        if self._copy is not None:
            self._copy.close()  # nothing reads the ring once it goes
        self._ring = None
        self._inbox.close()
        self._registry.clear()


# -- a connected peer ------------------------------------------------------------------------------


class NvlinkPeer(Peer):
    """A connected peer: its regions mapped here, its tables, its mailbox, its pending writes.

    ``tables`` (:class:`~transport.nvlink.prepare.WriteTables`) gives the row and strided
    tables and launch plans this peer launches, for callers that time or inspect the kernel."""

    def takes_strided(self, entries: int) -> bool:
        return True  # write_strided builds its row tables on the GPU

    def orders_on_device(self) -> bool:
        return self._config.wait_current_stream  # every write's copy stream waits for the caller's stream

    def __init__(self, owner: "NvlinkTransport", name: str, regions: Mapping[int, Region],
                 handles: Mapping[int, tuple[bytes, int, int]], mailbox: str, peer_gpu: Optional[int] = None):
        self._owner = owner
        self._config = owner.config
        self.name = name
        self.regions = RegionRegistry.frozen(regions)
        self._copy = owner._copy_stream()  # NvlinkUnsupported before the first GPU region
        self._mapping = PeerMapping(owner._api(), name, self.regions, handles)
        self._queue = PendingQueue(name, None, self._config.transfer_timeout_s)
        self._hold: Optional[Hold] = None
        self._closed = False
        # pair sets resident on the GPU (the direct path of write_strided), rebuilt when the local regions change
        self.pair_plans = PairCache(self._config.pair_plans, lambda: owner._registry.sizes, self._build_pairs,
                                    owner._native_steps())
        # the same pair sets in the staged engine's form, for the staged writes' direct path
        self.staged_plans = PairCache(self._config.pair_plans, lambda: owner._registry.sizes,
                                      self._build_staged_pairs, owner._native_steps())
        try:
            self._mapping.bases(self._copy.device)
            try:
                self._queue.outbox = Outbox(mailbox, self._config.peer_timeout_s, sender=owner.name,
                                            regions=self.regions)
            except MailboxUnreachable as exc:
                raise NvlinkUnsupported(str(exc)) from None
            steps = owner._native_steps()
            if steps is not None:  # the landed word stored from C, without the GIL
                self._queue.outbox.land_with(lambda word: Lander(steps, word, self._copy.device))
        except BaseException:
            self._release()
            raise
        device = self._copy.device
        self._peer_sizes = RegionSizes(self.regions)
        self.tables = WriteTables(owner._registry, self._peer_sizes, self._mapping, device, self._config)
        self._route = EngineRoute(self._config, name, peer_gpu, owner._lane, self._mapping,
                                  loopback=peer_gpu == device)
        self._hold = Hold(name, self._queue, self._mapping)
        owner._mailbox.add(self._hold)  # its thread reads the peer's answer to the Hello, and revokes

    @property
    def lost(self) -> Optional[str]:
        """Why writes to the peer fail at once until a new ``connect``: its mailbox connection
        ended (the peer closed it, or a notification could not be sent); None while it holds."""
        outbox = self._queue.outbox
        return None if outbox is None or outbox.alive() else f"peer {self.name!r} lost (its socket closed)"

    @property
    def device(self) -> int:
        """The local GPU that runs this peer's copies."""
        return self._copy.device

    @property
    def staged_error(self) -> Optional[str]:
        """Why the staged engine is off for this peer (None: not off, or not tried yet)."""
        return self._route.error

    # -- writes ---------------------------------------------------------------------------
    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> NvlinkTransfer:
        """A row-table write: the host gathers the ``[3, n]`` row table (source address,
        destination address, bytes) and the kernel copies the rows."""
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, got {type(batch).__name__}")
        return self._write(batch, notify)

    def write_strided(self, batch: StridedBatch, notify: Optional[bytes] = None, *,
                      engine: Optional[NvlinkEngine] = None) -> NvlinkTransfer:
        """A factored write expanded on the GPU by the strided kernel, which computes each row's
        addresses. It takes the direct path (:mod:`transport.nvlink.direct`): the pair part
        resident on the GPU since this pair set's first write, the slots checked in one pass
        against the pairs' slot limits and uploaded from a ring, one launch -- or, when it takes
        the staged engine (``STAGED``, or ``AUTO`` past the staged engine's sizes), its pipeline
        over the pairs' staged form, resident on both GPUs. Slots past the ring (or no ring)
        take the general path: the host checks bounds in O(P + S) and stages the whole strided
        table (:mod:`transport.nvlink.kernel`). Completion as for :meth:`write`. ``engine``
        overrides the config's for this write."""
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        notify = self._check_notify(notify)
        engine = self._config.engine if engine is None else check_engine(engine)
        direct = self._write_direct(batch, notify, engine)
        return direct if direct is not None else self._write(batch, notify, engine)

    def _write_direct(self, batch: StridedBatch, notify: Optional[bytes],
                      engine: NvlinkEngine) -> Optional[NvlinkTransfer]:
        """The direct path of ``batch`` (with either engine), or None when it takes the general
        one (no ring, slots past the ring, an empty batch)."""
        src_slot = batch.src_slot
        num_slots = src_slot.size
        if num_slots == 0 or batch.length.size == 0:
            return None
        ring = self._owner._slot_ring()
        if ring is None or not ring.fits(2 * num_slots):
            return None
        plan = self.pair_plans.get(batch)
        if plan is None:
            self.tables.check_bounds(batch)  # names the first pair that fits no slot
            raise ValueError("batch out of bounds")  # not reached: the two checks agree
        cuts = None
        if engine is not NvlinkEngine.KERNEL and self._route.lane_for(
                engine, plan.slot_bytes * num_slots, plan.num_pairs * num_slots, plan.max_len) is not None:
            plan = self.staged_plans.get(batch)  # the same pairs, so the same limits: never None here
            cuts = plan.cuts(num_slots, self._config.staged)
        hold = self._hold
        if not hold.acked:
            why = hold.wait_ready(self._config.revoke_timeout_s)
            if why is not None:
                return NvlinkTransfer(self._queue, None, None, error=why)
        with hold.lock:  # as _post: a revoke's snapshot holds every copy that could reach a region it revokes
            hold.refuse(batch.dst_region)
            start = None if cuts is not None else ring.reuse(src_slot, batch.dst_slot, plan.src_limit, plan.dst_limit)
            fresh = start is None  # else the last direct write's slots, the same, still on the GPU
            if fresh:
                start, fits = ring.stage(src_slot, batch.dst_slot, plan.src_limit, plan.dst_limit)  # bounds in the copy
                if not fits:
                    ring.space.hold(start, None)
                    self._refuse_slots(batch, plan)
            if not self._queue.outbox.alive():
                ring.space.hold(start, None)
                return self._lost()
            event = self._copy.enqueue_split(plan, num_slots, ring, start, self._config.kernel.num_warps, cuts,
                                             upload=fresh)
            if cuts is None:  # a direct write: the next one with these slots reads them where they are
                ring.keep(start, num_slots, plan.src_limit, plan.dst_limit)
            transfer = self._queue.track(NvlinkTransfer(self._queue, event, notify, keep=(plan,)))
        return self._posted(transfer)

    def plan_pairs(self, batch: StridedBatch) -> None:
        """Make ``batch``'s pair set resident now (at handshake, once both layouts are known),
        so that its first ``write_strided`` finds it; the slots are not looked at.
        ``ValueError`` naming a pair that fits no slot of its regions."""
        self._check_open()
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        if batch.num_pairs and self.pair_plans.get(batch) is None:
            zero = np.zeros(1, dtype=np.int64)
            self.tables.check_bounds(StridedBatch(*batch.pairs, zero, zero))
            raise ValueError("batch out of bounds")  # not reached

    def _refuse_slots(self, batch: StridedBatch, plan) -> None:
        """``ValueError`` for slots past the pairs' limits: the full check's message, which
        names the first pair out of bounds, or (negative slots, which it does not look at) one
        naming the side."""
        self.tables.check_bounds(batch)
        for side, slots, limit in (("source", batch.src_slot, plan.src_limit),
                                   ("destination", batch.dst_slot, plan.dst_limit)):
            if slots.size and (int(slots.min()) < 0 or int(slots.max()) > limit):
                raise ValueError(f"batch {side} slots must lie in [0, {limit}] (every pair's region), "
                                 f"got [{int(slots.min())}, {int(slots.max())}]")
        raise ValueError("batch out of bounds")  # not reached

    def _build_pairs(self, batch: StridedBatch):
        """A :class:`~transport.nvlink.direct.PairPlan` of ``batch``'s pairs (None: some pair
        fits no slot), its table uploaded on the copy stream, its launch bound over the ring."""
        ring, device, num_warps = self._owner._slot_ring(), self.device, self._config.kernel.num_warps
        return build_plan(batch, self._owner._registry.sizes, self._peer_sizes,
                          self._owner._registry.derived(base_table), self._mapping.bases(device),
                          lambda host: self._copy.table_on(host, device, self._copy.stream), self._config.kernel,
                          bind=None if ring is None else lambda table, num_pairs, shape: SplitLaunch(
                              table, ring.dev, num_pairs, shape, device, num_warps, self._owner._native_steps()))

    def _build_staged_pairs(self, batch: StridedBatch):
        """The staged form of :meth:`_build_pairs` for this peer's lane (open: a write took it):
        the ``[6 * P]`` table with destinations under the peer's GPU, on both GPUs, a gather
        launch over the transport's ring and a scatter launch over the lane's."""
        ring, lane, device = self._owner._slot_ring(), self._owner._lane(self._route.peer_gpu), self.device
        num_warps, native, copy = self._config.kernel.num_warps, self._owner._native_steps(), self._copy

        def stage(host, table, shape) -> StagedPart:
            peer_table = copy.table_on(host, lane.peer, lane.scatter_stream)
            slots = lane.peer_slots(ring.space.capacity)
            return StagedPart(lane, peer_table,
                              SplitLaunch(table, ring.dev, batch.num_pairs, shape, device, num_warps, native,
                                          StageMode.GATHER),
                              SplitLaunch(peer_table, slots, batch.num_pairs, shape, lane.peer, num_warps, native,
                                          StageMode.SCATTER))

        return build_plan(batch, self._owner._registry.sizes, self._peer_sizes,
                          self._owner._registry.derived(base_table), self._mapping.bases(lane.peer),
                          lambda host: copy.table_on(host, device, copy.stream), self.tables.kernel_config(True),
                          stage=stage)

    def _write(self, batch, notify: Optional[bytes], engine: Optional[NvlinkEngine] = None) -> NvlinkTransfer:
        notify = self._check_notify(notify)  # idempotent: bytes stay bytes
        self.tables.check_bounds(batch)
        if not self._queue.outbox.alive():
            return self._lost()
        if batch.nbytes == 0:
            return self._write_nothing(notify)
        job = self.prepare(batch, engine, checked=True)
        try:
            return self._post(job, notify)
        finally:
            job.release()

    def prepare(self, batch: Union[WriteBatch, StridedBatch], engine: Optional[NvlinkEngine] = None, *,
                checked: bool = False) -> PreparedWrite:
        """A :class:`~transport.nvlink.prepare.PreparedWrite` of ``batch`` (a WriteBatch or a
        StridedBatch) to post once or many times: bounds checked (``checked``: the caller
        already did), the engine chosen (``engine`` overrides the config's for this job), the
        table built in pinned memory, the launch planned."""
        self._check_open()
        if not isinstance(batch, (WriteBatch, StridedBatch)):
            raise TypeError(f"batch must be a WriteBatch or a StridedBatch, got {type(batch).__name__}")
        engine = self._config.engine if engine is None else check_engine(engine)
        if not checked:
            self.tables.check_bounds(batch)
        return build(self._post_job, batch, engine, self.tables, self._route, self._config)

    def _post_job(self, job: PreparedWrite, notify: Optional[bytes]) -> NvlinkTransfer:
        """:meth:`PreparedWrite.post`: the checks of a write, then :meth:`_post`."""
        notify = self._check_notify(notify)
        if job.released:
            raise ValueError("the prepared write was released; prepare the batch again")
        if not self._queue.outbox.alive():
            return self._lost()
        return self._post(job, notify)

    def _post(self, job: PreparedWrite, notify: Optional[bytes]) -> NvlinkTransfer:
        """Once the peer acknowledged this hold: refuse a job naming a revoked region
        (``RegionRevoked``), else upload its tables (first post only), queue the copy and track
        the transfer -- under the hold's lock, so that a revoke's snapshot of the copies in
        flight holds every copy that could still reach a region it revokes."""
        hold = self._hold
        if not hold.acked:
            why = hold.wait_ready(self._config.revoke_timeout_s)
            if why is not None:
                return NvlinkTransfer(self._queue, None, None, error=why)
        with hold.lock:
            hold.refuse(job.dst_region)
            try:
                if job.device_tables is None:
                    job.device_tables = self._copy.upload(job)
                event = self._copy.enqueue(job, job.device_tables)
            except BaseException:
                self._copy.quiesce(job)  # part of it may be queued: nothing may read the tables once they go
                raise
            transfer = self._queue.track(NvlinkTransfer(self._queue, event, notify,
                                                        keep=(job.host_table, *job.device_tables)))
        return self._posted(transfer)

    def _write_nothing(self, notify: Optional[bytes]) -> NvlinkTransfer:
        """A batch of no bytes: its notification alone, released in posting order after this
        peer's earlier writes. No table, no launch: an event recorded on the copy stream is its
        copy (a write that carries a request's last notification costs what the event does)."""
        return self._posted(self._queue.track(NvlinkTransfer(self._queue, self._copy.marker(), notify)))

    def _posted(self, transfer: NvlinkTransfer) -> NvlinkTransfer:
        """A write just tracked: the first look at the FIFO now, from the caller's thread -- its
        notification announced before the call returns (it travels while the copy runs, and a
        caller that keeps the GIL afterwards cannot hold it up), the transfer settled at once if
        its copy has already ended (a short one) -- and the progress thread woken for what is
        still pending."""
        if self._queue.advance():
            self._owner._progress.wake()
        return transfer

    def _lost(self) -> NvlinkTransfer:
        """A write refused at once: the mailbox connection ended (:attr:`lost`)."""
        return NvlinkTransfer(self._queue, None, None, error=self.lost)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is closed")

    def _check_notify(self, notify) -> Optional[bytes]:
        """An open peer and a valid notification payload (bytes, at most ``max_notify_bytes``)."""
        self._check_open()
        if notify is None:
            return None
        if not isinstance(notify, (bytes, bytearray, memoryview)):
            raise TypeError(f"notify must be bytes or None, got {type(notify).__name__}")
        notify = bytes(notify)
        if len(notify) > self._config.max_notify_bytes:
            raise ValueError(f"notify must be at most {self._config.max_notify_bytes} bytes, got {len(notify)}")
        if notify.startswith(revoke_wire.MAGIC):
            raise ValueError(f"notify must not start with {revoke_wire.MAGIC!r} (reserved for revocation)")
        return notify

    def _advance(self) -> bool:
        return self._queue.advance()

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.abort_all("aborted: peer closed")
        self._release()
        self._owner._forget_peer(self)

    def _release(self) -> None:
        """Wait for copies in flight, then unmap the peer's memory and end the connection (the
        peer forgets this hold when it reads the end)."""
        self.pair_plans.clear()
        self.staged_plans.clear()
        if self._mapping.opened:
            self._copy.synchronize()
            self._owner._sync_lanes()
            self._queue.forget_buried()
            self._mapping.close()
        if self._hold is not None:
            self._owner._mailbox.remove(self._hold)  # its thread closes the socket
        elif self._queue.outbox is not None:
            self._queue.outbox.close()
