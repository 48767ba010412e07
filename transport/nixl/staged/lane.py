"""The sending side of the staged mode: one :class:`SenderLane` per remote agent.

A lane owns this side's staging (``slots`` x ``slot_bytes``, registered with NIXL), the
receiver's staging address (from its :class:`~transport.nixl.staged.wire.Welcome`) and a FIFO
of jobs (:mod:`~transport.nixl.staged.sender`), the writes to that agent in the order ``write``
was called. It opens with a Hello, gathers the head job's chunks into free local slots, posts
each into a free slot of the receiver, frees slots as NIXL reads them and Credits come back,
and starts the next job once the head has finished. A receiver on this host may share its
slots (:mod:`~transport.nixl.staged.shared`): the lane then maps them in place of its own,
gathers each chunk into the receiver's free slot it goes to and posts its notification alone.
Progress happens in the owner's calls, on the owner's thread (:meth:`SenderLane.progress`).
:class:`SenderLanes` finds a transport's lanes by remote agent and by lane id.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

import numpy as np

from transport.base import TransferStatus
from transport.nixl.staged.copy import Staging, make_staging
from transport.nixl.staged.shared import SharedHostStaging, host_key
from transport.nixl.staged.sender import DeferredWrite, LaneState, Gathered, Job, StagedJob
from transport.nixl.staged.wire import Credit, Hello, Welcome, encode, registered_entries

__all__ = ["SenderLane", "SenderLanes"]

NOTE_SPIN_S = 3e-4  # shared slots: how long a chunk's post is driven for its notification to leave


class _Slot:
    """A chunk in flight in a slot of the receiver (until its Credit); ``local_slot`` until
    NIXL has read it (its request DONE)."""

    __slots__ = ("job", "index", "handle", "local_slot")

    def __init__(self, job: StagedJob, index: int, handle, local_slot: Optional[int]):
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
        self._reg = None  # NIXL registration of the staging (None once it is the receiver's, shared)
        self.shared = False  # the staging is the receiver's slots, mapped here: chunks go as notifications alone
        self.remote_ptr = 0
        self._free = deque(range(self.slots))  # the receiver's slots
        self._free_local = deque(range(self.slots))  # this side's slots
        self._gathered: deque[Gathered] = deque()  # the head job's chunks in local slots, not posted yet
        self._inflight: dict[int, _Slot] = {}  # receiver's slot -> chunk in flight (until its Credit)
        self._queue: deque[Job] = deque()  # jobs still to post, in write order
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

    def submit(self, job: Job) -> Job:
        job.queued_on(self, self._core.config.deadline_s(job.nbytes))
        if isinstance(job, StagedJob):
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
        share = core.config.staged.shared_slots and self.src_device is None and self.dst_device is None
        hello = Hello(self.id, -1 if self.dst_device is None else self.dst_device, self.slots, self.slot_bytes,
                      agent.metadata(), core.registered(), host_key() if share else "")
        try:
            handle, state = agent.post_byte(self.name, self._scratch_ptr, encode(hello))
        except Exception as exc:
            self.lose(f"peer {self.name!r}: could not send the staged Hello: {type(exc).__name__}: {exc}")
            return
        self._handles.append((handle, None))
        if state.startswith("ERR"):
            self.lose(f"peer {self.name!r}: NIXL reported {state} when sending the staged Hello")
            return
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
                if job.inner is None:
                    job.go_direct()
                if job.inner.status() is TransferStatus.PENDING:
                    return
            elif self._gathered and (self.shared or self._free) and (
                    self.staging.is_ready(self._gathered[0].local_slot) or not (job.has_more and self._free_local)):
                chunk = self._gathered.popleft()  # shared: gathered into the receiver's slot, which it names
                if not self._post_chunk(chunk, chunk.local_slot if self.shared else self._free.popleft()):
                    return
            elif job.has_more and self._free_local:
                self._gathered.append(job.fill(self, self._free_local.popleft(), job.gathered))
                job.gathered += 1
            else:
                return  # no free slot here or there, or every chunk posted: wait for NIXL and Credits

    def _post_chunk(self, chunk: Gathered, slot: int) -> bool:
        """Post ``chunk`` into the receiver's ``slot``: a NIXL write of the local slot carrying
        its notification, or (shared) the notification alone, the rows being in that slot."""
        job = chunk.job
        agent = self._core.agent
        self.staging.ready(chunk.local_slot)  # its copies are in place before NIXL reads it
        note = encode(job.note(chunk.kind, self, slot, chunk.index))
        try:
            if self.shared:
                handle, state = agent.post_byte(self.name, self._scratch_ptr, note)
            else:
                remote = chunk.remote + np.array([self.remote_ptr + slot * self.slot_bytes, 0], dtype=np.int64)
                handle, state = agent.post_ranges(self.name, chunk.local, self.src_device, remote, self.dst_device,
                                                  note)
        except Exception as exc:
            self._free.appendleft(slot)
            if not self.shared:  # shared: the local slot is that one
                self._free_local.append(chunk.local_slot)
            self.lose(f"peer {self.name!r}: could not post chunk {chunk.index}: {type(exc).__name__}: {exc}")
            return False
        self._inflight[slot] = _Slot(job, chunk.index, handle, None if self.shared else chunk.local_slot)
        self.moves += 1
        job.posted += 1
        if state not in ("DONE", "PROC"):
            self.lose(f"peer {self.name!r}: NIXL reported {state} when posting chunk {chunk.index}")
            return False
        # NIXL sends a write's notification from its progress once the data is flushed: drive
        # it now, so the receiver scatters this chunk while the next one is gathered; and read
        # the Credits that came meanwhile (a gather-ahead run must not hold them back)
        if self.shared:  # one byte: its flush is a round trip; the note must not wait for the next gather
            until = time.monotonic() + NOTE_SPIN_S
            while state == "PROC" and time.monotonic() < until:
                try:
                    state = agent.state(handle)
                except Exception:
                    break  # _check_handles says why
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
                if entry.local_slot is not None:
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
            if msg.shared:
                self._share(msg.shared)
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

    def _share(self, owner) -> None:
        """Map the receiver's slots (its memfd ``owner``: ``(pid, fd)``) and gather into them
        from now on; this side's own staging goes. Where they cannot be mapped, NIXL writes
        this side's slots into them as before."""
        try:
            pid, fd = owner
            staging = SharedHostStaging(self.slots, self.slot_bytes, (pid, fd))
        except (OSError, ValueError, TypeError):
            return
        own, self.staging = self.staging, staging
        self._core.agent.deregister(self._reg)
        self._reg = None
        own.close()
        self.shared = True
        self._free_local = self._free  # a chunk is gathered into the receiver's free slot it goes to

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
        """The staging memory of every lane that has one registered with the agent (not a
        receiver's shared slots)."""
        return [lane.staging for lane in self._by_name.values() if lane.staging is not None and not lane.shared]

    def close(self) -> None:
        for name in list(self._by_name):
            try:
                self.drop(name)
            except Exception:  # keep releasing the rest; the agent's teardown frees it too
                pass
