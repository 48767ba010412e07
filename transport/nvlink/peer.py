"""A connected nvlink peer: the facade over its parts.

:class:`NvlinkPeer` owns, per peer: the mapping of the peer's regions
(:mod:`~transport.nvlink.mapping`), the engine choice (:mod:`~transport.nvlink.route`), the
tables (:mod:`~transport.nvlink.tables`), the outbox to the peer's mailbox, the FIFO of pending
transfers (:mod:`~transport.nvlink.pending`) and its hold of the peer's export
(:mod:`~transport.nvlink.holds`: the regions the peer revoked). Writes go through a prepared
write (:mod:`~transport.nvlink.job`) on the transport's copy stream
(:mod:`~transport.nvlink.stream`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, Union

import numpy as np

from transport.base import Peer, Region, RegionSizes, StridedBatch, TransportClosed, WriteBatch
from transport.nvlink import job as jobs
from transport.nvlink.config import NvlinkEngine, NvlinkUnsupported, check_engine
from transport.nvlink.fastpath import PairCache, StagedPart, build_plan
from transport.nvlink.holds import Hold
from transport.nvlink.job import PreparedWrite
from transport.nvlink.kernel import SplitLaunch, StageMode
from transport.nvlink.lander import Lander
from transport.nvlink.mailbox import MailboxUnreachable, Outbox
from transport.nvlink.mapping import PeerMapping
from transport.nvlink.pending import PendingQueue
from transport.nvlink.route import EngineRoute
from transport.nvlink.tables import WriteTables, base_table
from transport.nvlink.transfer import NvlinkTransfer
from transport.registry import RegionRegistry
from transport.revocation import wire as revoke_wire

if TYPE_CHECKING:
    from transport.nvlink.transport import NvlinkTransport


__all__ = ["NvlinkPeer"]


class NvlinkPeer(Peer):
    """A connected peer: its regions mapped here, its tables, its mailbox, its pending writes.

    ``tables`` (:class:`~transport.nvlink.tables.WriteTables`) gives the row and strided
    tables and launch plans this peer launches, for callers that time or inspect the kernel."""

    def takes_strided(self, entries: int) -> bool:
        return True  # write_strided builds its row tables on the GPU

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
        addresses. It takes the direct path (:mod:`transport.nvlink.fastpath`): the pair part
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
        """A :class:`~transport.nvlink.fastpath.PairPlan` of ``batch``'s pairs (None: some pair
        fits no slot), its table uploaded on the copy stream, its launch bound over the ring."""
        ring, device, num_warps = self._owner._slot_ring(), self.device, self._config.kernel.num_warps
        return build_plan(batch, self._owner._registry.sizes, self._peer_sizes,
                          self._owner._registry.derived(base_table), self._mapping.bases(device),
                          lambda host: self._copy._table_on(host, device, self._copy.stream), self._config.kernel,
                          bind=None if ring is None else lambda table, num_pairs, shape: SplitLaunch(
                              table, ring.dev, num_pairs, shape, device, num_warps, self._owner._native_steps()))

    def _build_staged_pairs(self, batch: StridedBatch):
        """The staged form of :meth:`_build_pairs` for this peer's lane (open: a write took it):
        the ``[6 * P]`` table with destinations under the peer's GPU, on both GPUs, a gather
        launch over the transport's ring and a scatter launch over the lane's."""
        ring, lane, device = self._owner._slot_ring(), self._owner._lane(self._route.peer_gpu), self.device
        num_warps, native, copy = self._config.kernel.num_warps, self._owner._native_steps(), self._copy

        def stage(host, table, shape) -> StagedPart:
            peer_table = copy._table_on(host, lane.peer, lane.scatter_stream)
            slots = lane.peer_slots(ring.space.capacity)
            return StagedPart(lane, peer_table,
                              SplitLaunch(table, ring.dev, batch.num_pairs, shape, device, num_warps, native,
                                          StageMode.GATHER),
                              SplitLaunch(peer_table, slots, batch.num_pairs, shape, lane.peer, num_warps, native,
                                          StageMode.SCATTER))

        return build_plan(batch, self._owner._registry.sizes, self._peer_sizes,
                          self._owner._registry.derived(base_table), self._mapping.bases(lane.peer),
                          lambda host: copy._table_on(host, device, copy.stream), self.tables.kernel_config(True),
                          stage=stage)

    def _write(self, batch, notify: Optional[bytes], engine: Optional[NvlinkEngine] = None) -> NvlinkTransfer:
        notify = self._check_notify(notify)  # idempotent: bytes stay bytes
        self.tables.check_bounds(batch)
        if not self._queue.outbox.alive():
            return self._lost()
        job = self.prepare(batch, engine, checked=True)
        try:
            return self._post(job, notify)
        finally:
            job.release()

    def prepare(self, batch: Union[WriteBatch, StridedBatch], engine: Optional[NvlinkEngine] = None, *,
                checked: bool = False) -> PreparedWrite:
        """A :class:`~transport.nvlink.job.PreparedWrite` of ``batch`` (a WriteBatch or a
        StridedBatch) to post once or many times: bounds checked (``checked``: the caller
        already did), the engine chosen (``engine`` overrides the config's for this job), the
        table built in pinned memory, the launch planned."""
        self._check_open()
        if not isinstance(batch, (WriteBatch, StridedBatch)):
            raise TypeError(f"batch must be a WriteBatch or a StridedBatch, got {type(batch).__name__}")
        engine = self._config.engine if engine is None else check_engine(engine)
        if not checked:
            self.tables.check_bounds(batch)
        return jobs.build(self, batch, engine, self.tables, self._route, self._config)

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
        return NvlinkTransfer(self._queue, None, None, error=f"peer {self.name!r} lost (its socket closed)")

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
