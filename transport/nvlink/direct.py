"""The direct path: the copy stream every write is queued on, and ``write_strided``'s resident
pair plans and slot ring.

The copy stream (:class:`CopyStream`)
-------------------------------------
Every peer of one transport enqueues on the same stream, which first waits for the caller's
current stream (``wait_current_stream``: KV written by the model is complete before it is
read). Tables go up by one raw ``cudaMemcpyAsync`` each (torch's stream contexts cost more
than the copy); a staged write's second table goes to the peer's GPU on the lane's scatter
stream. A CUDA event recorded after the copy marks completion. :meth:`CopyStream.enqueue`
queues a prepared write (:mod:`transport.nvlink.prepare`); :meth:`CopyStream.enqueue_split`
queues a direct write: the slots go up from the pinned ring ahead of the wait for the caller's
stream (they need nothing of the caller's), a raw event orders the copy stream after the
caller's, and one launch reads the resident pair table.

Once per pair set (per peer, :class:`PairCache`)
------------------------------------------------
A KV write is buffer pairs x token slots (``StridedBatch``). The pair part -- which buffer goes
to which, offsets, strides, row bytes -- depends only on the two sides' layouts and is the same
for every request between two ranks; only the slot arrays change. :class:`PairPlan` holds the
``[5 * P]`` pair part of the strided table (:mod:`transport.nvlink.kernel`) on the GPU, its
copy path (the pairs' alignment), the longest row, the bytes per slot, and per side the largest
slot that every pair allows (:func:`slot_limits`): the bounds of all ``P * S`` entries then
reduce to ``0 <= min(slots)`` and ``max(slots) <= limit``, one vectorised pass over the slots. A
plan is found by the pair arrays' bytes (not by the arrays' identity: a read-only array may be
a view of one that changes); the cache is emptied when the local regions change (their sizes
and bases are built into the plan).

Per write (:class:`SlotRing`)
-----------------------------
The ``[2 * S]`` slot part goes into a ring of pinned host memory (where one reduction over it
gives both sides' largest slot for the bounds check) and, by one ``cudaMemcpyAsync`` on the
copy stream, into the same place of a ring on the GPU, which the kernel reads at ``slot_base``
(:func:`~transport.nvlink.kernel.scatter_strided_split`). A span's space is handed out again
once the write that holds it has completed (its event; the host copy ran before the kernel on
the same stream), and a write that finds nothing held starts at 0 again, so writes waited for
one by one stay in memory the cache still holds. The ring is allocated once per transport, at
the first write that uses it; a slot part larger than the ring takes the general path.

A direct write whose slots are byte for byte those of the last direct write, with no span taken
since, reads that write's span again (:meth:`SlotRing.reuse`: one compare, no copy in, no
upload; the span's fence becomes the new write's, later on the same stream). A request written
layer by layer brings the same slots with each layer's pairs: one span serves them all, and the
ring does not fill with copies of the same slots.

The staged engine's writes (:mod:`transport.nvlink.staged`) take the same road: a plan of the
pairs' staged form (:class:`StagedPart`; the pair part with its staging prefixes, ``[6 * P]``,
resident on both GPUs, destinations as mapped under the peer's GPU) is made once per pair set,
and a write brings only its slots, checked the same way, uploaded to the transport's ring for
the gather and to the lane's ring on the peer's GPU, at the same offsets, for the scatter. Only
the chunk cuts are computed per write (O(P + chunks), they depend on the number of slots).

Given the C steps (:mod:`transport.nvlink.native`), the slots' copy in and bounds check, the
upload and the order, the launch and the comparison of a batch's pairs with the last plan's
key are one call each; without them the same steps run here in Python.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from transport.base import RegionSizes, SMALL_BATCH, StridedBatch
from transport.nvlink import ipc, kernel as kern, staged
from transport.nvlink.kernel import empty_for
from transport.nvlink.prepare import PreparedWrite

__all__ = [
    "CopyStream", "PairCache", "PairPlan", "RingSpace", "SlotRing", "StagedPart", "check_slots",
    "pair_key", "slot_limits",
]


# -- the copy stream -------------------------------------------------------------------------------


_CURRENT: list = []  # the function that gives the raw current stream, found at the first call


def _current_stream_handle(device: int) -> int:
    """The raw handle of torch's current stream on ``device``: the private call Triton's launcher
    uses (no Stream object made), else through ``torch.cuda.current_stream``."""
    if not _CURRENT:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _CURRENT.append(raw if raw is not None else lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _CURRENT[0](device)


class CopyStream:
    """A torch stream on ``device`` (created at first use) and the enqueue steps of a write."""

    def __init__(self, api, device: int, wait_current_stream: bool, native=None):
        """``native``: the C steps of :meth:`enqueue_split` (:mod:`transport.nvlink.native`;
        None: ``api``'s calls from Python)."""
        self._api, self.device, self._wait_current, self._native = api, device, wait_current_stream, native
        self._stream = None
        self._order_event = None  # raw event: the caller's stream's point the copy stream waits for
        self._events = api if native is None else native  # what makes and destroys it: the side that records it

    @property
    def stream(self):
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def table_on(self, host, device: int, stream):
        """``host`` copied to ``device`` on ``stream``, into memory allocated for ``stream``
        (:func:`~transport.nvlink.kernel.empty_for`). The pinned ``host`` must outlive the copy: transfers keep it
        until their event completes, failed ones too (buried)."""
        table = empty_for(stream, host.shape, host.dtype, device)
        with ipc.on_device(self._api, device, torch_too=False):
            self._api.memcpy_async(table.data_ptr(), host.data_ptr(), host.numel() * host.element_size(),
                                   stream.cuda_stream)
        return table

    def upload(self, job: PreparedWrite) -> tuple:
        """The job's pinned table on the local GPU (on this stream) and, staged, on the peer's
        (on the scatter stream): the tables :meth:`enqueue` reads."""
        tables = (self.table_on(job.host_table, self.device, self.stream),)
        if job.lane is not None:
            tables += (self.table_on(job.host_table, job.lane.peer, job.lane.scatter_stream),)
        return tables

    def enqueue(self, job: PreparedWrite, tables: tuple):
        """Queue the job's copy; return the CUDA event that marks its completion."""
        import torch

        stream = self.stream
        if self._wait_current:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        lane, launch = job.lane, job.launch
        if lane is None:
            with ipc.on_device(self._api, self.device, torch_too=False):
                launch(tables[0], self.device, stream)
            return self.marker()
        return lane.run(stream, job.bounds, job.offsets,
                        lambda a, b, st, s: launch(tables[0], lane.local, s, a, b, st),
                        lambda a, b, st, s: launch(tables[1], lane.peer, s, a, b, st))

    def marker(self):
        """A CUDA event recorded on this stream now: it completes once every copy queued on the
        stream before it has (a write's completion; alone, that of a write of no bytes)."""
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _caller(self, stream) -> Optional[int]:
        """The raw handle of the caller's current stream, which ``stream`` must wait for (None:
        nothing to wait for, configured off or the same stream); the reused raw event that
        orders them exists once this returns a handle (the device is current)."""
        if not self._wait_current:
            return None
        current = _current_stream_handle(self.device)
        if current == stream.cuda_stream:
            return None
        if self._order_event is None:
            self._order_event = self._events.event_create()
        return current

    def _wait_caller(self, stream) -> None:
        """The copy stream waits for the work queued so far on the caller's current stream (one
        reused raw event: record, wait)."""
        current = self._caller(stream)
        if current is not None:
            self._api.event_record(self._order_event, current)
            self._api.stream_wait_event(stream.cuda_stream, self._order_event)

    def enqueue_split(self, plan: PairPlan, num_slots: int, ring: SlotRing, start: int, num_warps: int,
                      cuts: Optional[tuple] = None, upload: bool = True):
        """Queue the direct write of ``num_slots`` slots staged in ``ring`` at ``start`` over the
        pairs resident in ``plan``: the slots' upload, the wait for the caller's stream, one
        launch, the event. The upload reads only the pinned ring, so it goes ahead of the wait
        and runs while the caller's work does (a write posted behind compute starts its copy
        that much sooner). Returns the event (recorded after the copy); the ring's span is
        fenced with it (or freed once nothing can read it, on an error).

        A staged plan (``plan.staged``) runs its lane's pipeline instead of the one launch,
        over the chunks ``cuts`` (``(bounds, offsets)``, :meth:`PairPlan.cuts`), the slots also
        uploaded to the lane's ring on the peer's GPU; the event is then the lane's, after the
        last scatter. ``upload`` False: the span's slots are on the GPU already, uploaded by an
        earlier write on this stream (:meth:`SlotRing.reuse`; direct writes only)."""
        api, device, stream, native = self._api, self.device, self.stream, self._native
        prev = api.get_device() if native is None else native.current_device()  # one call when the caller drives this GPU
        if prev != device:
            api.set_device(device)
        event = None
        try:
            if not upload and plan.staged is not None:
                raise ValueError("a staged write uploads its slots (the lane's ring has only its own)")
            if native is not None:  # the same two steps, one C call
                caller = self._caller(stream)  # (makes the order event at the first wait)
                native.upload_after(stream.cuda_stream, *ring.addresses(start), 16 * num_slots if upload else 0,
                                    caller, self._order_event)
            else:
                if upload:  # needs nothing of the caller's: ahead of the wait
                    ring.upload(start, 2 * num_slots, stream.cuda_stream)
                self._wait_caller(stream)
            part = plan.staged
            if part is not None:
                upload = (part.lane.peer_slots(ring.space.capacity).data_ptr() + 8 * start, ring.addresses(start)[1],
                          16 * num_slots)
                specs = (part.gather.native_spec(), part.scatter.native_spec()) if native is not None else (None,)
                if None not in specs:  # both launches kept and found equivalent in C: the pipeline in one call
                    event = part.lane.run_native(native, stream, *cuts, *specs, (
                        start, plan.num_pairs, num_slots, plan.launch.block_r, plan.launch.num_programs), upload)
                else:
                    event = part.lane.run(
                        stream, *cuts,
                        lambda a, b, stage, s: part.gather(start, num_slots, s, a, b, stage),
                        lambda a, b, stage, s: part.scatter(start, num_slots, s, a, b, stage), upload=upload)
            else:
                if plan.launcher is not None:  # the launch bound at the plan's making
                    plan.launcher(start, num_slots, stream)
                else:
                    kern.scatter_strided_split(plan.device_table, ring.dev, start, plan.num_pairs, num_slots,
                                               plan.launch, device, num_warps, checked=True, stream=stream)
                event = self.marker()
        finally:
            if event is None:  # part of it may be queued: let the span go only once nothing reads it
                self._drain(plan.staged.lane if plan.staged is not None else None)
            ring.space.hold(start, event)
            if prev != device and prev >= 0:  # -1: no device was current on this thread (native's answer)
                api.set_device(prev)
        return event

    def quiesce(self, job: PreparedWrite) -> None:
        """Wait for everything queued (after a failed enqueue: part of it may be queued, and
        nothing may read the tables once they go)."""
        self._drain(job.lane)

    def _drain(self, lane=None) -> None:
        """Wait for the copy stream and, given one, a staged lane's streams, each whatever the
        other did (a CUDA error here would only repeat the first one)."""
        for sync in (self.synchronize, None if lane is None else lane.synchronize):
            if sync is not None:
                with contextlib.suppress(Exception):
                    sync()

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        """Wait for the stream, release the raw event (idempotent)."""
        self.synchronize()
        if self._order_event is not None:
            with contextlib.suppress(Exception), ipc.on_device(self._api, self.device, torch_too=False):
                self._events.event_destroy(self._order_event)
            self._order_event = None


# -- write_strided's direct path: pair plans and the slot ring -------------------------------------


NO_LIMIT = (1 << 63) - 1  # a side whose pairs all have stride 0 (or no pairs): any slot fits


def _side_limit(sizes: RegionSizes, region: np.ndarray, offset: np.ndarray, stride: np.ndarray,
                length: np.ndarray) -> int:
    """The largest slot ``s`` with ``offset + s * stride + length <= size`` for every pair
    (-1: some pair fits no slot, its region unknown, its range past the region, or a negative
    offset or stride, which ``StridedBatch.of`` refuses and a batch built past it may hold)."""
    if region.size == 0:
        return NO_LIMIT
    room = sizes.of(region) - offset - length  # [P] bytes left after slot 0's range; < 0: none fits
    if (room < 0).any() or (offset < 0).any() or (stride < 0).any():
        return -1
    moving = stride > 0
    if not moving.any():
        return NO_LIMIT
    return int((room[moving] // stride[moving]).min())


def slot_limits(batch: StridedBatch, local: RegionSizes, peer: RegionSizes) -> tuple[int, int]:
    """Per side, the largest source and destination slot that every pair of ``batch`` allows
    in its region (``-1``: some pair allows none; :data:`NO_LIMIT`: any). A batch is in bounds
    iff its slots are non-negative and at most these: the same verdict as
    ``batch.check_bounds(local, peer)``, which names the first bad pair."""
    return (_side_limit(local, batch.src_region, batch.src_offset, batch.src_stride, batch.length),
            _side_limit(peer, batch.dst_region, batch.dst_offset, batch.dst_stride, batch.length))


_INT64 = np.dtype(np.int64)


def pair_key(batch: StridedBatch) -> bytes:
    """The pair part of ``batch`` as one bytes key (the slots left out). The arrays are int64
    (``StridedBatch``'s invariant), so equal keys mean equal pairs; any other dtype is
    converted first."""
    arrays = batch.pairs
    for a in arrays:
        if a.dtype is not _INT64 and a.dtype != _INT64:
            arrays = tuple(np.asarray(x, dtype=np.int64) for x in arrays)
            break
    return b"".join([a.tobytes() for a in arrays])


def check_slots(batch: StridedBatch, src_limit: int, dst_limit: int) -> bool:
    """True when every slot of ``batch`` is in ``[0, limit]`` of its side: one pass per array
    (viewed as unsigned, a negative slot is past any limit, which is below 2**63)."""
    if batch.num_slots == 0:
        return True
    s, d = batch.src_slot, batch.dst_slot
    if s.dtype != np.int64 or d.dtype != np.int64:
        s, d = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
    return bool(src_limit >= 0 and dst_limit >= 0 and int(s.view(np.uint64).max()) <= src_limit
                and int(d.view(np.uint64).max()) <= dst_limit)


@dataclass(frozen=True)
class StagedPart:
    """What a staged plan adds (module doc): the lane, the ``[6 * P]`` pair part on the peer's
    GPU, and the two bound launches -- ``gather`` over the plan's ``device_table`` and the
    transport's ring on the local GPU, ``scatter`` over ``peer_table`` and the lane's ring on
    the peer's (:class:`~transport.nvlink.kernel.SplitLaunch`)."""

    lane: object  # transport.nvlink.staged.StagedLane
    peer_table: object  # int64 tensor [6 * P] on the peer's GPU
    gather: kern.SplitLaunch
    scatter: kern.SplitLaunch


@dataclass(frozen=True)
class PairPlan:
    """One pair set, resident: see the module doc. ``device_table`` is the ``[5 * P]`` pair part
    on the GPU (``host_table``: its pinned source, kept while the plan lives); ``launcher``
    launches the split kernel over it and the transport's ring of slots. A staged plan
    (``staged`` not None) holds the ``[6 * P]`` staged form instead and launches through its
    :class:`StagedPart`."""

    num_pairs: int
    slot_bytes: int  # bytes of one slot over all pairs (sum of length)
    max_len: int  # the longest row
    path: kern.CopyPath
    launch: kern.LaunchPlan  # the tile shape, for any number of slots (kern.plan_shape)
    src_limit: int
    dst_limit: int
    host_table: object  # pinned int64 tensor [5 * P]
    device_table: object  # int64 tensor [5 * P] on the local GPU
    launcher: Optional[kern.SplitLaunch] = None  # the launch over device_table and the ring (None: not bound)
    staged: Optional[StagedPart] = None

    def cuts(self, num_slots: int, config: "staged.StagedConfig") -> tuple[np.ndarray, np.ndarray]:
        """A staged plan's chunks for ``num_slots`` slots (:func:`~transport.nvlink.staged.strided_cuts`)."""
        return staged.strided_cuts(*self._prefix_and_length, num_slots, config.chunk_bytes, config.edge_bytes)

    @functools.cached_property
    def _prefix_and_length(self) -> tuple[list, list]:
        """A staged plan's staging prefixes and row lengths, as Python ints (made once)."""
        table, p = self.host_table.numpy(), self.num_pairs  # [6 * P]
        return table[5 * p: 6 * p].tolist(), table[4 * p: 5 * p].tolist()


class PairCache:
    """Plans by pair set, least recently used out past ``capacity``; emptied when ``generation()``
    (the local regions' identity) changes. ``build(batch)`` makes a plan (or raises)."""

    def __init__(self, capacity: int, generation: Callable[[], object],
                 build: Callable[[StridedBatch], Optional[PairPlan]], native=None):
        """``native``: the C step that compares a batch's pairs with the last plan's key
        without making the batch's (:mod:`transport.nvlink.native`; None: the key is made)."""
        self.capacity = capacity
        self._generation, self._build, self._native = generation, build, native
        self._seen: object = None
        self._plans: OrderedDict[bytes, PairPlan] = OrderedDict()
        self._last: Optional[tuple[bytes, PairPlan]] = None  # the plan found last, and its key
        self.builds = 0  # plans built (tests and benchmarks read it)

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, batch: StridedBatch) -> Optional[PairPlan]:
        """The plan of ``batch``'s pairs (built at the first sight of them), or None when some
        pair fits no slot (nothing cached)."""
        gen = self._generation()
        if gen is not self._seen:
            self.clear()
            self._seen = gen
        last = self._last
        same = None  # the pairs' bytes against the last write's key (None: not compared yet)
        if last is not None and self._native is not None:  # one memcmp, no key made
            same = self._native.same_bytes(last[0], batch.pairs)
            if same:
                return last[1]
        key = pair_key(batch)
        if same is None and last is not None and last[0] == key:  # as above, once the key is made (no hash)
            return last[1]
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        else:
            plan = self._build(batch)
            if plan is None:  # some pair fits no slot: not cached, the caller names the pair
                return None
            self.builds += 1
            self._plans[key] = plan
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        self._last = (key, plan)
        return plan

    def clear(self) -> None:
        self._plans.clear()
        self._last = None


class RingSpace:
    """The bookkeeping of a ring of ``capacity`` elements: spans handed out one after the other,
    each held until its fence has passed.

    ``done(fence)`` says whether a fence has passed (a fence of None has); ``wait(fence)``
    blocks until it has. :meth:`take` returns the start of a free span of ``n`` elements,
    waiting for the oldest fences that still hold it; :meth:`hold` attaches the fence that
    frees it. Spans are taken in order, wrapping to 0 when the rest of the ring is too short.
    :meth:`renew` takes the newest span again for another reader of the same contents, whose
    fence must pass no sooner than the one it replaces."""

    def __init__(self, capacity: int, done: Callable[[object], bool], wait: Callable[[object], None]):
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._done, self._wait = done, wait
        self._head = 0
        self._live: deque[list] = deque()  # [start, end, fence, fence before a renew] in the order taken
        self.waits = 0  # times a take had to wait for a fence (tests read it)

    def fits(self, n: int) -> bool:
        return 0 <= n <= self.capacity

    def take(self, n: int) -> int:
        """The start of ``n`` free elements (``ValueError`` past the capacity). The span is held,
        fenceless, until :meth:`hold` gives its fence."""
        if not self.fits(n):
            raise ValueError(f"a span of {n} elements does not fit a ring of {self.capacity}")
        while self._live and self._live[0][2] is not _TAKEN and self._passed(self._live[0][2]):
            self._live.popleft()
        if not self._live:  # nothing held: back to the start, whose memory the last writes left in cache
            self._head = 0
        start = self._head if self._head + n <= self.capacity else 0
        end = start + n
        for sp in self._live if n else ():
            if not (sp[0] < end and start < sp[1]) or sp[2] is None:
                continue
            if sp[2] is _TAKEN:
                raise RuntimeError("a ring span was taken again before its fence was given (hold() missing)")
            if not self._done(sp[2]):
                self.waits += 1
                self._wait(sp[2])
            sp[2] = None  # passed
        self._head = end
        if n:
            self._live.append([start, end, _TAKEN, None])
        return start

    def renew(self, start: int, end: int) -> bool:
        """Take ``[start, end)`` again, held until :meth:`hold` gives its new fence, when it is
        the newest span and has its fence (False otherwise: some span was taken since, or it
        is taken now). Nothing was written over it since, so its contents are as its last
        taker left them. The new fence replaces the old one: it must pass no sooner (both
        recorded on one stream, the old first); :meth:`hold` with None puts the old one back."""
        if not self._live:
            return False
        sp = self._live[-1]
        if sp[0] != start or sp[1] != end or sp[2] is _TAKEN:
            return False
        sp[2], sp[3] = _TAKEN, sp[2]
        return True

    def hold(self, start: int, fence: object) -> None:
        """Attach ``fence`` to the span taken at ``start`` (None: free it now, or, renewed, give
        it back its fence from before)."""
        for sp in reversed(self._live):
            if sp[0] == start and sp[2] is _TAKEN:
                sp[2], sp[3] = (sp[3] if fence is None else fence), None
                return

    def _passed(self, fence) -> bool:
        return fence is None or self._done(fence)

    @property
    def live(self) -> int:
        """Spans still held."""
        return len(self._live)


_TAKEN = object()  # a span taken and not yet given its fence


def _top(slots: np.ndarray, start: int, end: int) -> int:
    """The largest of ``slots[start:end]`` (non-empty)."""
    if end - start <= SMALL_BATCH:  # Python's max over a list beats a ufunc reduction
        return max(slots[start:end].tolist())
    return int(np.maximum.reduce(slots[start:end]))


def _event_done(event) -> bool:
    try:
        return bool(event.query())
    except Exception:  # a CUDA error: nothing will run any more
        return True


def _event_wait(event) -> None:
    try:
        event.synchronize()
    except Exception:
        pass


class SlotRing:
    """A ring of int64 slots in pinned host memory and, at the same element offsets, on a GPU
    (module doc): :meth:`stage` copies a write's slots in, :meth:`upload` queues their copy to the GPU."""

    def __init__(self, api, device: int, host, dev, native=None):
        """``host``: int64 tensor ``[capacity]`` in pinned memory; ``dev``: the same on GPU
        ``device`` (:meth:`allocate` makes both); ``native``: the C steps
        (:mod:`transport.nvlink.native`; None: numpy's)."""
        if host.numel() != dev.numel():
            raise ValueError(f"host and device rings differ: {host.numel()} and {dev.numel()} elements")
        self._api, self.device, self._native = api, device, native
        self.space = RingSpace(int(host.numel()), _event_done, _event_wait)
        self.host, self.dev = host, dev  # [capacity] int64 each
        self._host_np = host.numpy()
        self._host_u64 = self._host_np.view(np.uint64)
        self._host_ptr, self._dev_ptr = host.data_ptr(), dev.data_ptr()
        self._kept: Optional[tuple[int, int, int, int]] = None  # (start, slots, src limit, dst limit): reuse

    @classmethod
    def allocate(cls, api, device: int, capacity: int, stream, native=None) -> "SlotRing":
        """A ring of ``capacity`` slots: pinned host memory and memory on GPU ``device``, for
        the uploads queued on ``stream`` (the copy stream)."""
        import torch

        host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)  # [capacity]
        dev = empty_for(stream, capacity, torch.int64, device)  # [capacity]
        return cls(api, device, host, dev, native)

    def fits(self, n: int) -> bool:
        return self.space.fits(n)

    def stage(self, src_slot: np.ndarray, dst_slot: np.ndarray, src_limit: int, dst_limit: int) -> tuple[int, bool]:
        """Copy the ``[S]`` source then destination slots into a free span of the host ring;
        return its start and whether every slot lies in ``[0, limit]`` of its side (read as
        unsigned, a negative slot is past any limit): the bounds check and the copy in one
        visit, one reduction over both sides when both are below the smaller limit. The
        caller uploads the span (:meth:`upload`) or frees it (``space.hold(start, None)``).
        The C step does the same in one pass per array (arrays that are not C-contiguous int64
        take numpy's)."""
        n = src_slot.size
        self._kept = None  # a span taken: the kept one is no longer the newest
        start = self.space.take(2 * n)
        if self._native is not None:
            fits = self._native.stage(self._host_ptr + 8 * start, src_slot, dst_slot, src_limit, dst_limit)
            if fits is not None:
                return start, fits
        end = start + 2 * n
        self._host_np[start: start + n] = src_slot
        self._host_np[start + n: end] = dst_slot
        if n == 0:
            return start, True
        slots = self._host_u64  # [capacity] the ring read as unsigned
        if _top(slots, start, end) <= min(src_limit, dst_limit):
            return start, True
        if src_limit == dst_limit:
            return start, False
        return start, _top(slots, start, start + n) <= src_limit and _top(slots, start + n, end) <= dst_limit

    def keep(self, start: int, num_slots: int, src_limit: int, dst_limit: int) -> None:
        """The span at ``start`` holds ``num_slots`` slots per side, checked against these
        limits, uploaded on the copy stream and read by a copy on it whose event fences the
        span: a later write of the same slots may read it again (:meth:`reuse`). Only a write
        on the copy stream keeps its span (a staged write's slots also go to the lane's ring,
        on another stream, where a later fence would not cover them)."""
        self._kept = (start, num_slots, src_limit, dst_limit)

    def reuse(self, src_slot: np.ndarray, dst_slot: np.ndarray, src_limit: int, dst_limit: int) -> Optional[int]:
        """The start of the kept span, taken again (:meth:`RingSpace.renew`), when it holds
        exactly these slots (compared byte for byte: arrays may change in place), checked
        against limits no larger than these, and no span was taken since; else None (the
        caller stages them). A layer-wise request writes the same slots once per layer: one
        span and one upload serve every layer."""
        kept = self._kept
        n = src_slot.size
        if kept is None or kept[1] != n or n == 0 or kept[2] > src_limit or kept[3] > dst_limit:
            return None
        start = kept[0]
        same = None if self._native is None else self._native.same_slots(self._host_ptr + 8 * start, src_slot, dst_slot)
        if same is None:  # no C steps, or arrays C cannot read as int64
            same = bool(np.array_equal(self._host_np[start: start + n], src_slot)
                        and np.array_equal(self._host_np[start + n: start + 2 * n], dst_slot))
        if not same or not self.space.renew(start, start + 2 * n):
            return None
        return start

    def upload(self, start: int, n: int, stream_handle: int) -> None:
        """Queue the copy of ``n`` staged elements at ``start`` to the GPU ring on the raw
        ``stream_handle`` (current device: this ring's). The caller gives the span its fence
        with ``space.hold(start, event)``."""
        dev, host = self.addresses(start)
        self._api.memcpy_async(dev, host, 8 * n, stream_handle)

    def addresses(self, start: int) -> tuple[int, int]:
        """The GPU ring's and the host ring's address of element ``start`` (the same offset in
        both): what an upload of a span copies to and from."""
        return self._dev_ptr + 8 * start, self._host_ptr + 8 * start


def build_plan(batch: StridedBatch, local_sizes: RegionSizes, peer_sizes: RegionSizes,
               src_base: np.ndarray, dst_base: np.ndarray, upload: Callable[[object], object],
               config: kern.KernelConfig, pin: bool = True,
               bind: Optional[Callable[[object, int, kern.LaunchPlan], kern.SplitLaunch]] = None,
               stage: Optional[Callable[[object, object, kern.LaunchPlan], StagedPart]] = None) -> Optional[PairPlan]:
    """The :class:`PairPlan` of ``batch``'s pairs, or None when some pair fits no slot (the
    caller runs the full check, which names it). ``upload(pinned tensor)`` returns it on the
    GPU; ``config``: the kernel's launch shape; ``pin``: the host table in pinned memory (tests
    without CUDA say False); ``bind(device table, num_pairs, launch shape)``: the plan's
    launcher (None: none, writes launch through :func:`~transport.nvlink.kernel.scatter_strided_split`).
    ``stage(pinned table, device table, launch shape)``: a staged plan -- the table in its
    staged form (``dst_base``: the peer's regions as mapped under its GPU), and its
    :class:`StagedPart` (``bind`` is not called)."""
    import torch

    src_limit, dst_limit = slot_limits(batch, local_sizes, peer_sizes)
    if src_limit < 0 or dst_limit < 0:
        return None
    p, staged = batch.num_pairs, stage is not None
    empty = np.zeros(0, dtype=np.int64)
    host = torch.empty(kern.strided_table_size(p, 0, staged), dtype=torch.int64, pin_memory=pin)  # the pair part
    table = kern.build_strided_table(src_base, dst_base, batch.pairs, empty, empty, out=host.numpy(), staged=staged)
    max_len, path = int(batch.length.max()) if p else 1, kern.choose_path(table[: 5 * p])
    shape, device_table = kern.plan_shape(max_len, path, config), upload(host)
    if staged:
        return PairPlan(p, int(batch.length.sum()), max_len, path, shape, src_limit, dst_limit, host, device_table,
                        staged=stage(host, device_table, shape))
    return PairPlan(p, int(batch.length.sum()), max_len, path, shape, src_limit, dst_limit, host, device_table,
                    bind(device_table, p, shape) if bind is not None else None)
