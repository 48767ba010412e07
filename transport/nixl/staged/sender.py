"""The sending side of the staged mode: the writes a lane carries (its jobs).

A lane (:class:`~transport.nixl.staged.lane.SenderLane`, one per remote agent) owns this side's staging (``slots`` x ``slot_bytes``, registered with NIXL), the
receiver's staging address (from its :class:`~transport.nixl.staged.wire.Welcome`) and a FIFO
of jobs, the writes to that agent in the order ``write`` was called:

- :class:`StagedTransfer`: rows cut into chunks (:func:`chunk_bounds`); a free local slot
  takes the next chunk: gather (:mod:`~transport.nixl.staged.copy`), header and row table;
  once a slot of the receiver is free too, ONE NIXL write of the local slot into it carrying
  a :class:`~transport.nixl.staged.wire.Chunk` notification. The local slot is free again as
  soon as NIXL has read it (the write's request is DONE), the receiver's slot when its Credit
  says it scattered it, so the next chunks are gathered while the receiver still scatters
  (on a GPU: queued on the staging's stream, waited for by an event only when their write is
  posted). The transfer is DONE when every chunk is credited (the receiver delivered
  ``notify`` before it sent the last Credit).
- :class:`StridedStagedTransfer`: a strided write (``P`` buffer pairs x ``S`` slots, rows
  pair-major) the same way, with host work O(P + S) per write: chunks are row ranges cut in
  O(P + chunks) (:func:`strided_bounds`), each gathered in one step per pair part (host) or
  one kernel launch (CUDA) from the write's strided table (uploaded once), its slot headed by
  the write's destination table (packed, and on a GPU uploaded, once per write), posted as
  :class:`~transport.nixl.staged.wire.StridedChunk`.
- :class:`DeferredWrite`: a direct write issued while a staged one is still in the FIFO; it is
  posted when its turn comes.

A job starts only once the one before it has finished (DONE or FAILED): the receiver has then
queued the earlier write's notification, so one sender's notifications arrive in the order
its writes were issued, whichever way each went.

Progress happens in the owner's calls (``status``/``wait``/``abort`` of any job,
``poll_notifications``), on the owner's thread, as for direct writes:
:meth:`~transport.nixl.staged.lane.SenderLane.progress`.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Optional

import numpy as np

from transport.base import Transfer, TransferStatus
from transport.batch import StridedBatch, WriteBatch
from transport.nixl.staged.copy import Staging
from transport.nixl.staged.wire import (Chunk, ChunkHeader, DestinationTable, StridedChunk, StridedHeader,
                                        data_start, strided_data_start)

if TYPE_CHECKING:
    from transport.nixl.staged.lane import SenderLane

__all__ = ["DeferredWrite", "Gathered", "Job", "LaneState", "StagedJob", "StagedTransfer", "StridedStagedTransfer",
           "chunk_bounds", "strided_bounds"]


IN_FLIGHT_POLL_S = 1e-4  # longest pause of a staged write's wait() while its lane has chunks in flight


class LaneState(enum.Enum):
    NEW = "new"  # nothing sent yet
    OPENING = "opening"  # Hello sent, no Welcome yet
    READY = "ready"  # the receiver's staging is known: chunks flow
    REFUSED = "refused"  # the receiver refused a lane: every job goes direct
    LOST = "lost"  # a job failed at its deadline or in the backend: the agent is lost


def chunk_bounds(length: np.ndarray, slot_bytes: int) -> np.ndarray:
    """Row bounds ``[0, ..., n]`` of chunks that each fit one slot (header, 16-byte table rows,
    64-byte alignment, data); lengths must be at most what ``StagedNixlConfig`` allows."""
    cost = np.cumsum(length + 16)  # [n] table row + data, summed
    cap = slot_bytes - 128  # header 64, alignment at most 63
    bounds, start = [0], 0
    while start < length.size:
        base = int(cost[start - 1]) if start else 0
        end = max(int(np.searchsorted(cost, base + cap, side="right")), start + 1)
        bounds.append(end)
        start = end
    return np.asarray(bounds, dtype=np.int64)


def strided_bounds(length: np.ndarray, slots: int, room: int) -> np.ndarray:
    """Row bounds ``[0, ..., P * S]`` of the chunks of a ``P`` x ``slots`` write (rows pair-major,
    pair ``p``'s of ``length[p]`` bytes) that each carry at most ``room`` bytes of rows; one step
    per pair and per chunk. Every length must fit ``room``."""
    bounds, row, used = [0], 0, 0
    for n in length.tolist():
        if n > room:
            raise ValueError(f"a row of {n} bytes does not fit a chunk of {room} bytes")
        left = slots
        while left:
            fit = (room - used) // n
            if fit == 0:  # this chunk is full
                bounds.append(row)
                used = 0
                continue
            take = min(fit, left)
            row, left, used = row + take, left - take, used + take * n
    if bounds[-1] != row:
        bounds.append(row)
    return np.asarray(bounds, dtype=np.int64)


class Gathered:
    """A chunk in a local slot, waiting for a slot of the receiver: ``local`` its ``[k, 2]``
    (address, bytes) ranges here, ``remote`` the same on the receiver relative to its slot's start."""

    __slots__ = ("job", "index", "local_slot", "local", "remote", "kind")

    def __init__(self, job: "StagedJob", index: int, local_slot: int, local: np.ndarray, remote: np.ndarray,
                 kind: type):
        self.job, self.index, self.local_slot = job, index, local_slot
        self.local, self.remote, self.kind = local, remote, kind


class Job(Transfer):
    """A write queued on a lane; once posted direct, it reports its inner NIXL transfer."""

    def __init__(self, peer, batch, notify: bytes):
        self._peer, self._batch, self._notify = peer, batch, notify
        self.src_region = batch.src_region  # what deregister must not pull (see NixlTransport.deregister)
        self.lane: Optional["SenderLane"] = None
        self._inner = None  # a NixlTransfer once posted direct
        self._status, self._error = TransferStatus.PENDING, None
        self.nbytes = batch.nbytes
        self._deadline_s = 0.0  # the lane sets it (submit)
        self._deadline: Optional[float] = None  # set when it starts (a queued job waits for the one before)

    def queued_on(self, lane: "SenderLane", deadline_s: float) -> None:
        """``lane`` carries it; ``deadline_s``: how long it may run once it starts."""
        self.lane, self._deadline_s = lane, deadline_s

    @property
    def inner(self):
        """The direct NIXL transfer once it was posted direct, else None."""
        return self._inner

    def start(self) -> None:
        """It is the lane's head job now: its peer-loss deadline runs from here."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self._deadline_s

    @property
    def error(self) -> Optional[str]:
        return self._inner.error if self._inner is not None else self._error

    def go_direct(self) -> None:
        batch = self._batch if isinstance(self._batch, WriteBatch) else self._batch.coalesced()
        self._inner = self._peer.direct(batch, self._notify)

    def fail(self, error: str) -> None:
        if self._inner is None and self._status is TransferStatus.PENDING:
            self._status, self._error = TransferStatus.FAILED, error

    def status(self) -> TransferStatus:
        if self._inner is not None:
            return self._inner.status()
        if self._status is TransferStatus.PENDING:
            self.lane.progress()
        if self._inner is not None:
            return self._inner.status()
        late = self._deadline is not None and time.monotonic() > self._deadline
        if self._status is TransferStatus.PENDING and late:
            self.lane.lose(f"peer {self._peer.name!r}: {self.nbytes} bytes not done after {self._deadline_s:.1f} s "
                           "(peer lost or stalled)")
        return self._status

    # wait()'s pauses start again from the shortest whenever the lane moved (a chunk posted or
    # answered) and last at most IN_FLIGHT_POLL_S while chunks are in flight: a chunk's
    # notification leaves only from this side's progress and the next chunk goes only once a
    # Credit is read, so a pause that grew while the lane waited would hold up every chunk
    # after it (a 5 GiB write is 80 of them).
    def _progress_mark(self):
        return None if self.lane is None else self.lane.moves

    def _max_pause(self) -> float:
        return IN_FLIGHT_POLL_S if self.lane is not None and self.lane.in_flight else self.max_poll_sleep_s

    def cancel_now(self) -> None:
        """The transport is closing: fail now (its lane releases what is in flight)."""
        if self._inner is not None:
            self._inner.cancel_now()
        self.fail("transport closed")

    @property
    def waiting(self) -> bool:
        """Still needs the lane (queued, or chunks to post)."""
        return self._inner is None and self._status is TransferStatus.PENDING

    @property
    def finished(self) -> bool:
        """DONE or FAILED (a deferred write once its NIXL request is)."""
        if self._inner is not None:
            return self._inner.ended
        return self._status is not TransferStatus.PENDING


class DeferredWrite(Job):
    """A direct write queued behind a staged one to the same agent (order of notifications)."""

    def abort(self) -> None:
        if self._inner is not None:
            self._inner.abort()
        else:
            self.fail("aborted")  # never posted: nothing of it can land

    def cancel(self) -> None:
        if self._inner is not None:
            self._inner.cancel()
        else:
            self.fail("aborted")


class StagedJob(Job):
    """A write through the lane's staging (module doc): its chunks ``bounds``, what is posted and
    answered; a kind of staged write fills a slot with its next chunk (:meth:`fill`)."""

    bounds: np.ndarray  # [num_chunks + 1] row bounds of the chunks

    def __init__(self, peer, batch, notify: bytes):
        super().__init__(peer, batch, notify)
        self.seq = 0
        self.gathered = 0  # chunks put in a local slot
        self.posted = 0  # chunks posted
        self.credited = 0  # chunks the receiver answered
        self.aborting = False

    def fill(self, lane: "SenderLane", slot: int, index: int) -> Gathered:
        """Chunk ``index`` into local ``slot`` of ``lane``'s staging (copies that may still be
        queued: ``lane.staging.ready(slot)`` before NIXL reads it)."""
        raise NotImplementedError

    def note(self, kind: type, lane: "SenderLane", slot: int, index: int) -> Chunk:
        """The notification of chunk ``index`` in the receiver's ``slot`` (the write's ``notify`` on the last)."""
        last = index + 1 == self.num_chunks
        return kind(lane.id, self.seq, index, self.num_chunks, slot, self._notify if last and self._notify else None)

    @property
    def num_chunks(self) -> int:
        return int(self.bounds.size - 1)

    @property
    def can_post(self) -> bool:
        """Its chunks may still go (it is neither finished nor aborting)."""
        return self.waiting and not self.aborting

    @property
    def has_more(self) -> bool:
        """Chunks are left to gather."""
        return self.can_post and self.gathered < self.num_chunks

    def on_credit(self, error: str) -> None:
        self.credited += 1
        if error:
            self.aborting = True  # post nothing more; what is in flight may still land (FAILED)
            self.fail(f"peer {self._peer.name!r} refused chunk {self.credited - 1}: {error}")
        elif self.credited == self.num_chunks and self._status is TransferStatus.PENDING and not self.aborting:
            self._status = TransferStatus.DONE

    def status(self) -> TransferStatus:
        status = super().status()
        if status is TransferStatus.PENDING and self._inner is None and self.aborting and self.credited >= self.posted:
            self.fail("aborted")  # cancelled, and every chunk posted is answered: nothing more lands
            return self._status
        return status

    def cancel(self) -> None:
        """:meth:`abort` without waiting, for a loop that serves others meanwhile: nothing more
        is posted, and the write ends FAILED ("aborted") once the receiver has answered every
        chunk posted; at the deadline the receiver is lost. ``status()`` moves it on."""
        if self._inner is not None:
            self._inner.cancel()
        elif self._status is TransferStatus.PENDING:
            self.aborting = True
            self.status()

    def abort(self) -> None:
        """Post nothing more, then wait until the receiver answered every chunk posted (it
        scatters a chunk before it answers): then nothing of this write lands later. At most
        until the deadline; a receiver that does not answer by then is lost."""
        if self._inner is not None:
            self._inner.abort()
            return
        if self._status is not TransferStatus.PENDING:
            return
        self.aborting = True
        sleep = 0.0
        while self.credited < self.posted and self.lane.state is not LaneState.LOST:
            self.lane.progress()
            if time.monotonic() > self._deadline:
                self.lane.lose(f"aborted; peer {self._peer.name!r} did not answer within {self._deadline_s:.1f} s "
                               "(peer lost or stalled)")
                break
            time.sleep(sleep)
            sleep = min(self.max_poll_sleep_s, sleep * 2 or 1e-5)
        self.fail("aborted")
        if self._status is TransferStatus.DONE:  # the last answer came meanwhile: it did land
            self._status, self._error = TransferStatus.FAILED, "aborted"


class StagedTransfer(StagedJob):
    """A flat batch (one row per range) through the lane's staging (module doc)."""

    def __init__(self, peer, batch, notify: bytes, src_addr: np.ndarray, order: Optional[np.ndarray],
                 slot_bytes: int):
        super().__init__(peer, batch, notify)
        pick = (lambda a: a) if order is None else (lambda a: a[order])
        self.src_addr = pick(src_addr)  # [n] absolute source addresses, in staging order
        self.dst_region = pick(batch.dst_region)  # [n]
        self.dst_offset = pick(batch.dst_offset)  # [n]
        self.length = pick(batch.length)  # [n]
        self._run_start: Optional[np.ndarray] = None
        self._adopted: Optional[tuple] = None
        self.bounds = chunk_bounds(self.length, slot_bytes)  # [num_chunks + 1]

    @property
    def run_start(self) -> np.ndarray:
        """``[n]`` row i starts a source run (it does not continue row i - 1 in memory)."""
        if self._run_start is None:
            self._run_start = np.ones(self.length.size, dtype=bool)
            self._run_start[1:] = self.src_addr[1:] != self.src_addr[:-1] + self.length[:-1]
        return self._run_start

    def adopted(self, staging: Staging) -> tuple:
        """(sources, destination offsets, destination regions, lengths) as ``staging`` copies
        them (on a GPU: uploaded once per write)."""
        if self._adopted is None:
            self._adopted = staging.adopt(self.src_addr, self.dst_offset, self.dst_region, self.length)
        return self._adopted

    def fill(self, lane: "SenderLane", slot: int, index: int) -> Gathered:
        a, b = int(self.bounds[index]), int(self.bounds[index + 1])
        length = self.length[a:b]
        rows, nbytes = b - a, int(length.sum())
        at = data_start(rows)
        staging = lane.staging
        mine = staging.slot_ptr(slot)
        wire = False
        if lane.src_device is None and not lane.shared:  # host slots NIXL writes: rows that follow each other form runs
            starts = np.flatnonzero(self.run_start[a:b])  # [runs] first row of each run (row a: always)
            if starts.size == 0 or starts[0] != 0:
                starts = np.concatenate(([0], starts))
            wire = nbytes >= lane.wire_gather_bytes * starts.size
        if wire:
            # long source runs: the wire gathers them (a descriptor per run), no local copy
            offs = np.zeros(rows, dtype=np.int64)  # [rows] staging offsets
            np.cumsum(length[:-1], out=offs[1:])
            run_bytes = np.diff(np.append(offs[starts], nbytes))  # [runs]
            local = np.stack([np.append(mine, self.src_addr[a + starts]), np.append(at, run_bytes)], axis=1)
            remote = np.stack([np.append(0, at + offs[starts]), np.append(at, run_bytes)], axis=1)
        else:
            src, _, _, ln = (x[a:b] for x in self.adopted(staging))
            staging.gather(slot, at, src, ln)
            local = np.array([[mine, at + nbytes]], dtype=np.int64)  # [1, (address, bytes)]
            remote = np.array([[0, at + nbytes]], dtype=np.int64)
        _, dst_offset, dst_region, ln = (x[a:b] for x in self.adopted(staging))
        staging.write_head(slot, ChunkHeader(lane.id, self.seq, index, rows, nbytes), dst_offset, dst_region, ln)
        return Gathered(self, index, slot, local, remote, Chunk)


class StridedStagedTransfer(StagedJob):
    """A :class:`~transport.base.StridedBatch` through the lane's staging (module doc): rows
    ``p * S + s`` pair-major, a chunk a row range. ``src_addr``: ``[P]`` absolute source address
    of each pair's slot 0 (the batch's bounds already checked)."""

    def __init__(self, peer, batch: StridedBatch, notify: bytes, src_addr: np.ndarray, slot_bytes: int):
        super().__init__(peer, batch, notify)
        p, n = batch.num_pairs, batch.num_slots
        self.shape = (p, n)
        self.src = (src_addr, batch.src_stride, batch.length, batch.src_slot)  # [P] x 3, [S]
        self.dest = DestinationTable(batch.dst_region, batch.dst_offset, batch.dst_stride, batch.length,
                                     batch.dst_slot)
        self.at = strided_data_start(p, n)  # where a chunk's rows start in its slot
        self.bounds = strided_bounds(batch.length, n, slot_bytes - self.at)  # [num_chunks + 1], O(P + chunks)
        self._rows = None  # the source rows as the lane's staging copies them (its table uploaded once)
        self._head = None  # the destination table's bytes (uploaded once on a GPU)

    def fill(self, lane: "SenderLane", slot: int, index: int) -> Gathered:
        staging = lane.staging
        if self._rows is None:  # once per write
            self._rows = staging.strided_rows(*self.src)
            self._head = staging.strided_table(self.dest.pack())
        a, b = int(self.bounds[index]), int(self.bounds[index + 1])
        nbytes = self._rows.offset_of(b) - self._rows.offset_of(a)
        header = StridedHeader(lane.id, self.seq, index, self.num_chunks, a, b, nbytes, *self.shape)
        staging.stage_strided(slot, self.at, self._rows, a, b, header, self._head)  # queued: ready(slot) waits
        size = self.at + nbytes
        local = np.array([[staging.slot_ptr(slot), size]], dtype=np.int64)  # [1, (address, bytes)]
        remote = np.array([[0, size]], dtype=np.int64)
        return Gathered(self, index, slot, local, remote, StridedChunk)
