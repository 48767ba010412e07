"""A connected remote agent of the ``nixl`` backend: where every write is checked and routed.

:meth:`NixlPeer.write` admits a batch (bounds against both region tables, revoked regions, a
lost agent) and routes it: staged on the lane to that agent (:mod:`transport.nixl.staged`), queued
behind a staged write still posting, or posted direct as one NIXL request (:meth:`NixlPeer.direct`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Mapping, Optional

import numpy as np

from transport.base import Peer, Transfer, TransferStatus
from transport.batch import Region, StridedBatch, WriteBatch
from transport.errors import RegionRevoked, TransportClosed, TransportError
from transport.nixl.prepped import MAX_INDICES, PreparedLists, prepped_indices, shape_of
from transport.nixl.regions import RegionTable
from transport.nixl.staged import wire as staged_wire
from transport.nixl.staged.lane import SenderLane
from transport.nixl.staged.sender import DeferredWrite, LaneState, StagedTransfer, StridedStagedTransfer
from transport.nixl.transfer import NixlTransfer
from transport.registry import RegionRegistry
from transport.revocation import wire as revoke_wire

if TYPE_CHECKING:
    from transport.nixl.core import Core

__all__ = ["NixlPeer"]


class NixlPeer(Peer):
    """A connected remote agent. Writes go to its exported regions."""

    def __init__(self, core: "Core", name: str, regions: Mapping[int, Region], scratch_ptr: int):
        self._core = core
        self.name = name
        self.scratch_ptr = scratch_ptr  # the remote agent's scratch bytes (notification-only writes)
        self.regions = RegionRegistry.frozen(regions)
        self._table = RegionTable(self.regions)
        self._pending: "weakref.WeakSet[Transfer]" = weakref.WeakSet()
        self._closed: Optional[str] = None  # why writes are refused, once closed or replaced
        self.hold_seq = 0  # the Hold sent for this snapshot (transport.nixl.revoke): direct writes wait for its ack
        self.lists = PreparedLists(core.agent, name, self._live_regions)  # its regions' prepared lists

    @property
    def lost(self) -> Optional[str]:
        """Why the remote agent is lost (a write to it failed in NIXL or passed its deadline):
        writes fail at once until a new ``connect``; None while writes may go."""
        return self._core.remotes.lost.get(self.name)

    def takes_strided(self, entries: int) -> bool:
        """With the staged mode on, a batch of at least its ``min_rows`` ranges: :meth:`write_strided`
        stages it with O(P + S) host work (or writes its coalesced form, which has as many entries
        as a plan's own merged runs). A smaller one goes direct, where the plan's flat form costs
        the host least (for a small request the factored form costs more host time than it saves)."""
        staged = self._core.config.staged
        return staged.enabled and entries >= staged.min_rows

    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> NixlTransfer:
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is {self._closed}")
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, got {type(batch).__name__}")
        notif = self._admit(batch, notify)
        return notif if isinstance(notif, NixlTransfer) else self._route(batch, notif)

    def write_strided(self, batch: StridedBatch, notify: Optional[bytes] = None):
        """A factored write (:class:`~transport.base.StridedBatch`). Staged
        (:class:`~transport.nixl.staged.sender.StridedStagedTransfer`, host work O(P + S) per
        write) when ``StagedNixlConfig.wants_strided`` takes it, each side is on one memory and
        its destination table fits the lane's slots (``wire.strided_fits``), unless its sources
        are host memory in runs of ``wire_gather_bytes`` on average (``StridedBatch.source_runs``):
        the flat staged write then has the wire gather the runs, with no local copy, which beats
        the strided write's copy for runs of 32 KiB and more (bench/RESULTS.md).
        Otherwise its coalesced form as :meth:`write` writes it. Bounds (O(P + S)) and revocation
        are checked here either way."""
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is {self._closed}")
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        notif = self._admit(batch, notify)
        if isinstance(notif, NixlTransfer):
            return notif
        core = self._core
        cfg = core.config.staged
        lane = core.lanes.get(self.name)
        if cfg.wants_strided(batch):
            kinds = self._kinds(batch)
            if kinds is not None and kinds[0] is None and batch.nbytes >= cfg.wire_gather_bytes * batch.source_runs():
                kinds = None  # host sources in long runs: the flat staged write lets the wire gather them
            if kinds is not None and (lane is None or (lane.matches(*kinds) and lane.state is not LaneState.REFUSED)):
                slot_bytes = lane.slot_bytes if lane is not None else cfg.slot_bytes_for(kinds[1])
                if staged_wire.strided_fits(batch.num_pairs, batch.num_slots, int(batch.length.max()), slot_bytes):
                    lane = lane or core.lanes.open(self.name, self.scratch_ptr, *kinds)
                    src_addr = core.table().ptr[batch.src_region].astype(np.int64) + batch.src_offset  # [P]
                    return self._queued(lane, StridedStagedTransfer(self, batch, notif, src_addr, lane.slot_bytes))
        return self._route(batch.coalesced(), notif)

    def _admit(self, batch, notify: Optional[bytes]):
        """The checks every write passes before it is routed: ``notify`` (its bytes returned),
        the batch's bounds against both region tables, revoked regions; a FAILED transfer for a
        peer lost earlier."""
        if notify is not None and (not isinstance(notify, (bytes, bytearray)) or not notify):
            raise TypeError(f"notify must be non-empty bytes or None, got {notify!r:.60}")
        core = self._core
        core.agent.check_open()
        core.pump()  # a revoke that came meanwhile applies to this write
        batch.check_bounds(core.table().sizes, self._table.sizes)
        revoked = core.holds.check(self.name, batch.dst_region)
        if revoked is not None:
            raise RegionRevoked(revoked)
        lost = core.remotes.lost.get(self.name)
        if lost is not None:  # a later write must not race bytes of a failed one: connect again first
            return NixlTransfer.finished(core, self.name, TransferStatus.FAILED, f"peer {self.name!r} was lost earlier "
                                         f"(connect to a new export first): {lost}")
        notif = bytes(notify) if notify is not None else b""
        if notif.startswith(staged_wire.MAGIC):
            raise ValueError(f"notify must not start with {staged_wire.MAGIC!r} (reserved for staged writes)")
        if notif.startswith(revoke_wire.MAGIC):
            raise ValueError(f"notify must not start with {revoke_wire.MAGIC!r} (reserved for revocation)")
        return notif

    def _route(self, batch: WriteBatch, notif: bytes):
        """A checked flat batch: staged, queued behind a staged write, or direct."""
        core = self._core
        lane = core.lanes.get(self.name)
        if len(batch) and core.config.staged.wants(batch):
            kinds = self._kinds(batch)
            if kinds is not None and (lane is None or (lane.matches(*kinds) and lane.state is not LaneState.REFUSED)):
                lane = lane or core.lanes.open(self.name, self.scratch_ptr, *kinds)
                src_addr = core.table().ptr[batch.src_region].astype(np.int64) + batch.src_offset  # [n]
                same = bool((batch.length == batch.length[0]).all())
                order = None if same else np.argsort(batch.length, kind="stable")  # equal lengths side by side
                return self._queued(lane, StagedTransfer(self, batch, notif, src_addr, order, lane.slot_bytes))
        if lane is not None and lane.busy:  # behind a staged write still posting: keep the order
            if len(batch) and self._kinds(batch) is None:  # the ValueError now, not when its turn comes
                core.table().descs(batch.src_region, batch.src_offset, batch.length, "source")
                self._table.descs(batch.dst_region, batch.dst_offset, batch.length, "destination")
            return self._queued(lane, DeferredWrite(self, batch, notif))
        return self.direct(batch, notif)

    def _queued(self, lane: SenderLane, job):
        self._pending.add(job)
        return lane.submit(job)

    def _kinds(self, batch) -> Optional[tuple[Optional[int], Optional[int]]]:
        """(source device, destination device) (None: host) when each side of a batch (flat or
        strided: its region arrays) is on one memory, else None."""
        kinds = []
        for table, region in ((self._core.table(), batch.src_region), (self._table, batch.dst_region)):
            dev = table.dev[region]  # [n]
            if not (dev == dev[0]).all():
                return None
            kinds.append(None if dev[0] < 0 else int(dev[0]))
        return kinds[0], kinds[1]

    def direct(self, batch: WriteBatch, notif: bytes) -> NixlTransfer:
        """A checked batch as ONE NIXL request (:mod:`transport.nixl`, "A write"): also the
        staged mode's way for a write it does not stage."""
        core = self._core
        if len(batch) == 0 and not notif:
            return NixlTransfer.finished(core, self.name, TransferStatus.DONE)
        if len(batch):  # the owner must know this transport holds its export before a byte lands
            why = core.holds.wait_ready(self.name, self.hold_seq, core.config.revoke_timeout_s)
            why = why or core.holds.check(self.name, batch.dst_region)  # revoked (also while queued)
            if why is not None:
                return NixlTransfer.finished(core, self.name, TransferStatus.FAILED, why)
        shape = shape_of(batch) if len(batch) else (0, 0, None)  # (granule, bytes, rows), read once
        try:
            if len(batch) == 0:  # notification only: one scratch byte carries it
                handle, state = core.agent.post_byte(self.name, self.scratch_ptr, notif)
            elif (prepped := self._prepped(batch, shape)) is not None:  # indices into lists prepared once
                handle, state = core.agent.post_prepped(*prepped, notif)
            else:
                local, local_mem = core.table().descs(batch.src_region, batch.src_offset, batch.length, "source")
                remote, remote_mem = self._table.descs(batch.dst_region, batch.dst_offset, batch.length,
                                                       "destination")
                handle, state = core.agent.post(self.name, local, local_mem, remote, remote_mem, notif)
        except TransportError as exc:  # the peer is gone or NIXL refused the request
            return NixlTransfer.finished(core, self.name, TransferStatus.FAILED,
                                         f"peer {self.name!r}: could not post: {exc}")
        nbytes = shape[1]
        t = NixlTransfer(core, self.name, handle, nbytes, core.config.deadline_s(nbytes), batch.src_region,
                         batch.dst_region if len(batch) else None)
        if state == "DONE":
            t.finish(TransferStatus.DONE)
        elif state != "PROC":
            t.lose(f"peer {self.name!r}: NIXL reported {state} when posting")
        else:
            self._pending.add(t)
        return t

    def _prepped(self, batch: WriteBatch, shape: tuple) -> Optional[tuple]:
        """``(local list, local indices, remote list, remote indices)`` of a checked, non-empty
        batch (``shape``: its :func:`~transport.nixl.prepped.shape_of`) through prepared lists
        (:mod:`transport.nixl.prepped`), or None: descriptors."""
        if self._closed:  # a write queued before this snapshot closed: no list is prepared for it any more
            return None
        core = self._core
        local_mem = core.table().mem_of(int(batch.src_region[0]))
        remote_mem = self._table.mem_of(int(batch.dst_region[0]))
        granule, nbytes, rows = shape
        finest = self.lists.finest(remote_mem)  # a list that exists serves a multiple of its granule
        if finest is not None and finest <= granule and nbytes // finest <= MAX_INDICES:
            granule = finest
        if nbytes // granule > MAX_INDICES:
            return None
        local = core.lists.get(local_mem, granule)
        remote = self.lists.get(remote_mem, granule) if local is not None else None
        if remote is None:
            return None
        indices = prepped_indices(batch, rows, local, remote)
        return None if indices is None else (local, indices[0], remote, indices[1])

    def _live_regions(self) -> Mapping[int, Region]:
        """The regions of this snapshot a prepared list may name: not revoked since."""
        holds = self._core.holds
        return {rid: reg for rid, reg in self.regions.items()
                if holds.check(self.name, np.array([rid], dtype=np.int64)) is None}

    def close(self) -> None:
        self._close(drain=True)

    def pending(self) -> list:
        """The writes through this peer not yet known to have ended (direct, and queued on a lane)."""
        return list(self._pending)

    def close_now(self) -> None:
        """Close without waiting: pending transfers fail at once (the transport closes)."""
        self._close(drain=False)

    def _close(self, drain: bool) -> None:
        """Pending transfers are aborted (``drain``: waiting as :meth:`NixlTransfer.abort` does)."""
        if self._closed == "closed":
            return
        self._closed = "closed"
        for t in list(self._pending):
            t.abort() if drain else t.cancel_now()
        self._pending = weakref.WeakSet()
        self.lists.release()
        self._core.forget_peer(self)

    def retire(self) -> None:
        """A newer export of the same agent was connected: refuse new writes, let pending ones finish."""
        if not self._closed:
            self._closed = "closed (replaced by a newer connect to the same agent)"
        self.lists.release()
