"""The sending side of the staged mode: one :class:`SenderLane` per remote agent.

A lane owns this side's staging (``slots`` x ``slot_bytes``, registered with NIXL), the
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
``poll_notifications``), on the owner's thread, as for direct writes: :meth:`SenderLane.progress`.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import Optional

import numpy as np

from transport.base import StridedBatch, Transfer, TransferStatus, WriteBatch
from transport.nixl.staged.copy import Staging, make_staging
from transport.nixl.staged.wire import (Chunk, ChunkHeader, Credit, DestinationTable, Hello, StridedChunk,
                                        StridedHeader, Welcome, data_start, encode, registered_entries,
                                        strided_data_start)

__all__ = ["SenderLane", "SenderLanes", "StagedTransfer", "StridedStagedTransfer", "DeferredWrite", "chunk_bounds",
           "strided_bounds", "LaneState"]


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


class _Gathered:
    """A chunk in a local slot, waiting for a slot of the receiver: ``local`` its ``[k, 2]``
    (address, bytes) ranges here, ``remote`` the same on the receiver relative to its slot's start."""

    __slots__ = ("job", "index", "local_slot", "local", "remote", "kind")

    def __init__(self, job: "_StagedJob", index: int, local_slot: int, local: np.ndarray, remote: np.ndarray,
                 kind: type):
        self.job, self.index, self.local_slot = job, index, local_slot
        self.local, self.remote, self.kind = local, remote, kind


class _Job(Transfer):
    """A write queued on a lane; once posted direct, it reports its inner NIXL transfer."""

    def __init__(self, peer, batch, notify: bytes):
        self._peer, self._batch, self._notify = peer, batch, notify
        self.src_region = batch.src_region  # what deregister must not pull (see NixlTransport.deregister)
        self.lane: Optional[SenderLane] = None
        self._inner = None  # a NixlTransfer once posted direct
        self._status, self._error = TransferStatus.PENDING, None
        self.nbytes = batch.nbytes
        self._deadline_s = 0.0  # the lane sets it (submit)
        self._deadline: Optional[float] = None  # set when it starts (a queued job waits for the one before)

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


class DeferredWrite(_Job):
    """A direct write queued behind a staged one to the same agent (order of notifications)."""

    def abort(self) -> None:
        if self._inner is not None:
            self._inner.abort()
        else:
            self.fail("aborted")  # never posted: nothing of it can land


class _StagedJob(_Job):
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

    def fill(self, lane: "SenderLane", slot: int, index: int) -> _Gathered:
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


class StagedTransfer(_StagedJob):
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

    def fill(self, lane: "SenderLane", slot: int, index: int) -> _Gathered:
        a, b = int(self.bounds[index]), int(self.bounds[index + 1])
        length = self.length[a:b]
        rows, nbytes = b - a, int(length.sum())
        at = data_start(rows)
        staging = lane.staging
        mine = staging.slot_ptr(slot)
        wire = False
        if lane.src_device is None:  # host: rows that follow each other in memory form runs
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
        return _Gathered(self, index, slot, local, remote, Chunk)


class StridedStagedTransfer(_StagedJob):
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

    def fill(self, lane: "SenderLane", slot: int, index: int) -> _Gathered:
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
        return _Gathered(self, index, slot, local, remote, StridedChunk)


class _Slot:
    """A chunk in flight in a slot of the receiver (until its Credit); ``local_slot`` until
    NIXL has read it (its request DONE)."""

    __slots__ = ("job", "index", "handle", "local_slot")

    def __init__(self, job: _StagedJob, index: int, handle, local_slot: Optional[int]):
        self.job, self.index, self.handle, self.local_slot = job, index, handle, local_slot


class SenderLane:
    """Staging and job FIFO towards one remote agent (module doc)."""

    def __init__(self, core, name: str, lane_id: int, scratch_ptr: int, src_device: Optional[int],
                 dst_device: Optional[int]):
        self._core = core  # transport.nixl.core.Core: agent, remotes, config, pump(), registered()
        self.name, self.id = name, lane_id
        self.src_device, self.dst_device = src_device, dst_device
        self._scratch_ptr = scratch_ptr
        cfg = core.config.staged
        self.slots, self.slot_bytes = cfg.slots, cfg.slot_bytes_for(dst_device)  # sized by the receiving memory
        self.wire_gather_bytes = cfg.wire_gather_bytes
        self.state = LaneState.NEW
        self.error: Optional[str] = None
        self.staging: Optional[Staging] = None
        self._reg = None  # NIXL registration of the staging
        self.remote_ptr = 0
        self._free = deque(range(self.slots))  # the receiver's slots
        self._free_local = deque(range(self.slots))  # this side's slots
        self._gathered: deque[_Gathered] = deque()  # the head job's chunks in local slots, not posted yet
        self._inflight: dict[int, _Slot] = {}  # receiver's slot -> chunk in flight (until its Credit)
        self._queue: deque[_Job] = deque()  # jobs still to post, in write order
        self._handles: list = []  # (handle, local slot or None) still to release (Hello, credited chunks)
        self._seq = 0
        self.moves = 0  # chunks posted and answered so far (what a waiting write's pauses watch)

    @property
    def in_flight(self) -> bool:
        """Chunks are gathered, or posted and not yet answered."""
        return bool(self._inflight or self._gathered)

    @property
    def busy(self) -> bool:
        """A job has not finished: a new write must queue behind it."""
        return bool(self._queue)

    def matches(self, src_device: Optional[int], dst_device: Optional[int]) -> bool:
        return (src_device, dst_device) == (self.src_device, self.dst_device)

    def submit(self, job: _Job) -> _Job:
        job.lane, job._deadline_s = self, self._core.config.deadline_s(job.nbytes)
        if isinstance(job, _StagedJob):
            self._seq += 1
            job.seq = self._seq
        if self.state is LaneState.LOST:
            job.fail(f"peer {self.name!r} was lost earlier (connect to a new export first): {self.error}")
            return job
        self._queue.append(job)
        self.progress()
        return job

    # -- progress ---------------------------------------------------------------------------

    def progress(self) -> None:
        core = self._core
        if core.agent.closed:
            return
        core.pump()
        if self._queue:
            self._queue[0].start()  # also while the lane opens: a receiver that never answers fails it
        if self.state is LaneState.NEW:
            self._open()
        self._check_handles()
        if self.state is LaneState.READY:
            self._post_ready()
        elif self.state is LaneState.REFUSED:
            while self._queue:  # in order: each posted behind the one before (NIXL keeps them in order)
                job = self._queue.popleft()
                if job.waiting:
                    job.go_direct()

    def _open(self) -> None:
        """Allocate and register this side's staging, send Hello."""
        core, agent = self._core, self._core.agent
        agent.check_open()
        try:
            self.staging = make_staging(self.slots, self.slot_bytes, self.src_device)
            self._reg = agent.register(self.staging.ptr, self.staging.nbytes, self.src_device)
        except Exception as exc:  # no memory for staging: this lane writes direct
            self._refuse(f"local staging of {self.slots * self.slot_bytes} bytes: {type(exc).__name__}: {exc}")
            return
        hello = Hello(self.id, -1 if self.dst_device is None else self.dst_device, self.slots, self.slot_bytes,
                      agent.metadata(), core.registered())
        try:
            handle, _ = agent.post_byte(self.name, self._scratch_ptr, encode(hello))
        except Exception as exc:
            self.lose(f"peer {self.name!r}: could not send the staged Hello: {type(exc).__name__}: {exc}")
            return
        self._handles.append((handle, None))
        self.state = LaneState.OPENING

    def _refuse(self, why: str) -> None:
        self.state, self.error = LaneState.REFUSED, why

    def _post_ready(self) -> None:
        """Gather the head job's chunks into free local slots and post them into free slots of
        the receiver (or post a deferred write); the next job starts when the head has finished.
        A gathered chunk is posted once its copies are done, or at once (waiting for them) when
        nothing more can be gathered meanwhile."""
        while self._queue:
            job = self._queue[0]
            job.start()
            while self._gathered and not self._gathered[0].job.can_post:  # aborted or failed: nothing of it goes
                self._free_local.append(self._gathered.popleft().local_slot)
            if job.finished:
                self._queue.popleft()
            elif isinstance(job, DeferredWrite):
                if job._inner is None:
                    job.go_direct()
                if job._inner.status() is TransferStatus.PENDING:
                    return
            elif self._gathered and self._free and (self.staging.is_ready(self._gathered[0].local_slot)
                                                    or not (job.has_more and self._free_local)):
                if not self._post_chunk(self._gathered.popleft(), self._free.popleft()):
                    return
            elif job.has_more and self._free_local:
                self._gathered.append(job.fill(self, self._free_local.popleft(), job.gathered))
                job.gathered += 1
            else:
                return  # no free slot here or there, or every chunk posted: wait for NIXL and Credits

    def _post_chunk(self, chunk: _Gathered, slot: int) -> bool:
        job = chunk.job
        self.staging.ready(chunk.local_slot)  # its copies are in place before NIXL reads it
        remote = chunk.remote + np.array([self.remote_ptr + slot * self.slot_bytes, 0], dtype=np.int64)
        try:
            handle, state = self._core.agent.post_ranges(self.name, chunk.local, self.src_device, remote,
                                                         self.dst_device,
                                                         encode(job.note(chunk.kind, self, slot, chunk.index)))
        except Exception as exc:
            self._free.appendleft(slot)
            self._free_local.append(chunk.local_slot)
            self.lose(f"peer {self.name!r}: could not post chunk {chunk.index}: {type(exc).__name__}: {exc}")
            return False
        self._inflight[slot] = _Slot(job, chunk.index, handle, chunk.local_slot)
        self.moves += 1
        job.posted += 1
        if state not in ("DONE", "PROC"):
            self.lose(f"peer {self.name!r}: NIXL reported {state} when posting chunk {chunk.index}")
            return False
        # NIXL sends a write's notification from its progress once the data is flushed: drive
        # it now, so the receiver scatters this chunk while the next one is gathered; and read
        # the Credits that came meanwhile (a gather-ahead run must not hold them back)
        self._check_handles()
        if self.state is LaneState.READY:
            self._core.pump()
        return self.state is LaneState.READY

    def _check_handles(self) -> None:
        agent = self._core.agent
        for slot, entry in list(self._inflight.items()):
            if entry.handle is None:
                continue
            try:
                state = agent.state(entry.handle)
            except Exception as exc:  # nixlRemoteDisconnectError and other backend errors
                self.lose(f"peer {self.name!r}: {type(exc).__name__}: {exc}")
                return
            if state == "DONE":  # NIXL has read the local slot: the next chunk may be gathered into it
                agent.release(entry.handle)
                self._free_local.append(entry.local_slot)
                entry.handle = entry.local_slot = None
            elif state != "PROC":
                self.lose(f"peer {self.name!r}: NIXL reported {state}")
                return
        keep = []
        for handle, local_slot in self._handles:
            try:
                state = agent.state(handle)
            except Exception as exc:
                self.lose(f"peer {self.name!r}: {type(exc).__name__}: {exc}")
                return
            if state == "PROC":
                keep.append((handle, local_slot))
            else:
                agent.release(handle)
                if local_slot is not None:
                    self._free_local.append(local_slot)
        self._handles = keep

    # -- messages from the receiver ----------------------------------------------------------

    def on_message(self, msg) -> None:
        if isinstance(msg, Welcome) and self.state is LaneState.OPENING:
            if msg.error:
                self._refuse(f"peer {self.name!r} refused a staging lane: {msg.error}")
                return
            try:  # the receiver's metadata now registers its staging: NIXL updates the agent in place
                registered = registered_entries(msg.registered)
                self._core.agent.load(msg.metadata)
            except Exception as exc:
                self._refuse(f"peer {self.name!r}: its staging metadata was refused: {type(exc).__name__}: {exc}")
                return
            self._core.remotes.loaded_too(self.name, registered)  # its regions the export we hold did not name, too
            self.remote_ptr, self.state = int(msg.ptr), LaneState.READY
        elif isinstance(msg, Credit):
            entry = self._inflight.get(msg.slot)
            if entry is None or entry.job.seq != msg.seq or entry.index != msg.index:
                return  # not a chunk of this lane in flight (a stale answer)
            del self._inflight[msg.slot]
            self.moves += 1
            if entry.handle is not None:  # answered, so flushed: release once NIXL says so
                self._handles.append((entry.handle, entry.local_slot))
            self._free.append(msg.slot)
            entry.job.on_credit(msg.error)

    # -- failure and teardown ------------------------------------------------------------------

    def lose(self, error: str) -> None:
        """FAILED for every job, the remote agent lost (as a direct write's deadline does):
        requests in flight go to the transport's drain list."""
        self.state, self.error = LaneState.LOST, error
        handles = [e.handle for e in self._inflight.values() if e.handle is not None] + [h for h, _ in self._handles]
        self._core.remotes.lose(self.name, error, handles)
        jobs = [e.job for e in self._inflight.values()] + list(self._queue)
        self._inflight.clear()
        self._gathered.clear()
        self._queue.clear()
        self._handles = []
        for job in jobs:
            job.fail(error)

    def close(self) -> None:
        """The transport closes (its agent goes) or a new connect replaces a lost lane."""
        agent = self._core.agent
        for entry in self._inflight.values():
            entry.job.cancel_now()
            if entry.handle is not None:
                agent.release(entry.handle)
        for job in self._queue:
            job.cancel_now()
        for handle, _ in self._handles:
            agent.release(handle)
        self._inflight.clear()
        self._gathered.clear()
        self._queue.clear()
        self._handles = []
        if self._reg is not None:
            agent.deregister(self._reg)
            self._reg = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None


class SenderLanes:
    """The sending lanes of one transport: one per remote agent, found by name or by lane id."""

    def __init__(self, core):
        self._core = core
        self._by_name: dict[str, SenderLane] = {}
        self._by_id: dict[int, SenderLane] = {}
        self._next_id = 0

    def get(self, name: str) -> Optional[SenderLane]:
        return self._by_name.get(name)

    def __len__(self) -> int:
        return len(self._by_name)

    def open(self, name: str, scratch_ptr: int, src_device: Optional[int], dst_device: Optional[int]) -> SenderLane:
        """A new lane to agent ``name`` (whose scratch bytes carry its Hello)."""
        self._next_id += 1
        lane = SenderLane(self._core, name, self._next_id, scratch_ptr, src_device, dst_device)
        self._by_name[name] = lane
        self._by_id[lane.id] = lane
        return lane

    def drop(self, name: str) -> None:
        """Close the lane to ``name``, if any: its jobs fail, its staging goes."""
        lane = self._by_name.pop(name, None)
        if lane is not None:
            del self._by_id[lane.id]
            lane.close()

    def on_message(self, sender: str, msg) -> None:
        """A Welcome or Credit from ``sender``, for the lane it names."""
        lane = self._by_id.get(msg.lane)
        if lane is not None and lane.name == sender:
            lane.on_message(msg)

    def progress(self) -> None:
        """Move every busy lane on."""
        for lane in list(self._by_name.values()):
            if lane.busy:
                lane.progress()

    def stagings(self) -> list[Staging]:
        """The staging memory of every lane that has one (registered with the agent)."""
        return [lane.staging for lane in self._by_name.values() if lane.staging is not None]

    def close(self) -> None:
        for name in list(self._by_name):
            try:
                self.drop(name)
            except Exception:  # keep releasing the rest; the agent's teardown frees it too
                pass
