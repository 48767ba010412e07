"""The staged engine of the nvlink backend: large batches through the copy engine.

Why
---
Copies issued by a GPU's multiprocessors into a peer GPU stop a few percent short of what the
copy engine moves over the same NVLinks, whatever issues them (stores from the writer, TMA bulk
copies, loads from the reader); the copy engine, in turn, pays about a microsecond per copy, so
it cannot move small rows itself. So the rows are packed first and the packed bytes cross the
link in big copies. (Figures: bench/RESULTS.md, "Staged engine: why and when".)

How
---
The batch is cut into chunks of whole rows. For each chunk:

1. *gather* (the row kernel of :mod:`transport.nvlink.kernel`, on the local GPU, the writer's
   copy stream): the chunk's rows, back to back, into local staging buffer ``k``;
2. *copy* (``cudaMemcpyAsync`` on a second local stream, i.e. the copy engine): local staging
   buffer ``k`` into peer staging buffer ``k``, one contiguous copy at the link's rate;
3. *scatter* (the same kernel on the PEER GPU, launched by this process on a stream of its own
   there): peer staging buffer ``k`` into the rows' destinations.

``buffers`` staging buffers alternate on each side; CUDA events order the reuse (a gather into
buffer ``k`` waits for the copy that last read it, a copy into peer buffer ``k`` for the scatter
that last read that), and the host enqueues every chunk at once without waiting. The kernels
move bytes through HBM several times faster than the link, so the copy engine runs back to
back and the kernels hide behind it; what is left is the first gather and the last scatter,
which is why chunks start at ``edge_bytes`` (16 MiB), double up to ``chunk_bytes`` (128 MiB)
and halve again at the end (:func:`chunk_starts`). Completion is one event on the peer-GPU
stream after the last scatter.

The host must stay ahead of the copy engine, which moves a 128 MiB chunk in a few hundred
microseconds. Torch's stream contexts and events and Triton's ``kernel[grid]`` cost about that
much host time per chunk, so :class:`StagedLane` enqueues with raw CUDA calls and relaunches the
kernels directly (:mod:`transport.nvlink.launch`), at a third of it.

A row's place in the staging stream is its offset among all rows of the batch
(:mod:`transport.nvlink.kernel`, "Staged copies"); :func:`row_chunks` / :func:`strided_cuts`
cut the batch at the last row that starts at or before each chunk start, so a chunk holds less
than its share plus one row.

Costs, and when AUTO takes it
-------------------------------
- This process creates a CUDA context on the peer GPU (some hundred MB there) and holds
  ``buffers`` staging buffers of ``chunk_bytes`` on each of the two GPUs (defaults: 2 x 128 MiB
  each), per pair of GPUs, shared by every peer on that GPU. ``StagedConfig(enabled=False)``
  keeps a deployment on the direct kernel when that memory matters more than the last few
  percent.
- The peer's IPC handles are opened a second time, under the peer GPU: a mapping opened under
  one GPU faults when another GPU's kernels use it, and one handle opens under both GPUs.
- Each write costs more host time than a direct one (the chunk cuts, per chunk three
  enqueues and their events; a row-table write also builds and uploads a table to each GPU,
  where a strided one finds its pairs resident, :mod:`transport.nvlink.direct`): end to end
  it beats the direct kernel only for large batches, hence ``min_bytes`` 2 GiB.
- Short rows gather and scatter slowly (256 B head slices stay faster on the direct kernel),
  hence ``min_row_bytes``.

Measured throughput of both engines: ``kvtransfer bench nvlink`` (bench/RESULTS.md).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from transport.nvlink import ipc
from transport.nvlink.kernel import Stage, StageMode, empty_for

__all__ = ["StagedConfig", "StagedLane", "chunk_sizes", "chunk_starts", "row_chunks", "strided_cuts"]


MAX_BUFFERS = 16  # staging buffers per GPU that native.c's pipeline takes (its MAX_BUFFERS)


@dataclass(frozen=True)
class StagedConfig:
    """Settings of the staged engine (module doc).

    enabled: ``NvlinkEngine.AUTO`` uses it for batches of ``min_bytes`` and more whose rows
        average ``min_row_bytes`` or more; ``NvlinkEngine.STAGED`` always does.
    min_bytes: batches of at least this many bytes go staged (smaller ones fill and drain the
        pipeline for too long: the direct kernel is faster there).
    min_row_bytes: average bytes per row for AUTO (short rows, such as 256 B head slices,
        gather and scatter slowly: the direct kernel is faster there).
    chunk_bytes: bytes per copy-engine copy in the middle of a batch (rows longer than this go
        direct); also the size of each staging buffer.
    edge_bytes: size of the first and last chunk; chunks double from it up to ``chunk_bytes``
        and halve back towards the end, so the pipeline fills and drains quickly.
    buffers: staging buffers per GPU, >= 2 so that gather, copy and scatter overlap (and at
        most :data:`MAX_BUFFERS`).
    max_programs: programs of each gather / scatter launch (grid stride; 0: one per tile).
    """

    enabled: bool = True
    min_bytes: int = 2 << 30
    min_row_bytes: int = 1024
    chunk_bytes: int = 128 << 20
    edge_bytes: int = 16 << 20
    buffers: int = 2
    max_programs: int = 264

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, got {self.enabled!r}")
        for name, low in (("min_bytes", 0), ("min_row_bytes", 0), ("chunk_bytes", 1 << 16), ("edge_bytes", 1 << 16),
                          ("buffers", 2), ("max_programs", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.buffers > MAX_BUFFERS:
            raise ValueError(f"buffers must be at most {MAX_BUFFERS} (the C pipeline's), got {self.buffers}")

    def wants(self, total: int, rows: int) -> bool:
        """Whether ``NvlinkEngine.AUTO`` stages a batch of ``rows`` rows and ``total`` bytes."""
        return self.enabled and total >= self.min_bytes and total >= self.min_row_bytes * rows


def chunk_sizes(total: int, chunk_bytes: int, edge_bytes: int) -> list[int]:
    """Sizes of the chunks of a ``total``-byte stream, in order (Python ints; ``[]`` for 0
    bytes). Sizes double from ``edge_bytes`` towards ``chunk_bytes`` at the front and halve back
    at the end (as long as the middle keeps at least the next size); the middle is split evenly
    into chunks of at most ``chunk_bytes``. No chunk is above ``chunk_bytes`` or below
    ``min(edge_bytes, chunk_bytes // 2, total)``."""
    ramp, acc, size = [], 0, min(edge_bytes, chunk_bytes)
    while size < chunk_bytes and 2 * (acc + size) + min(2 * size, chunk_bytes) <= total:
        ramp.append(size)
        acc += size
        size *= 2
    middle = total - 2 * acc
    parts = -(-middle // chunk_bytes)
    mid = [middle // parts + (1 if i < middle % parts else 0) for i in range(parts)]
    return ramp + mid + ramp[::-1]


def chunk_starts(total: int, chunk_bytes: int, edge_bytes: int) -> np.ndarray:
    """Byte offsets where the chunks of a ``total``-byte stream start (``[num_chunks]``, first
    0; :func:`chunk_sizes`)."""
    sizes = np.asarray(chunk_sizes(total, chunk_bytes, edge_bytes), dtype=np.int64)
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(sizes)[:-1]])


def row_chunks(offsets: np.ndarray, total: int, starts: np.ndarray) -> np.ndarray:
    """Chunk boundaries (row indices ``[0, ..., n]``) of ``n`` rows whose staging offsets are
    ``offsets`` (``[n]`` ascending, ``offsets[0] == 0``) and whose bytes sum to ``total``: chunk
    ``k`` starts at the last row that starts at or before ``starts[k]`` (:func:`chunk_starts`)."""
    n = int(offsets.size)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    first = np.searchsorted(offsets, starts, side="right") - 1
    return np.unique(np.append(first, n)).astype(np.int64)


def strided_cuts(prefix: Sequence[int], length: Sequence[int], num_slots: int, chunk_bytes: int,
                 edge_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of a factored batch of ``num_slots`` slots whose pairs have rows of
    ``length`` bytes and staging prefixes ``prefix`` (``P`` Python ints each, lengths > 0; the
    staged strided table's sixth section): ``(bounds, offsets)``, chunk ``k`` being rows
    ``[bounds[k], bounds[k + 1])`` from staging offset ``offsets[k]`` (``offsets[-1]``: the
    batch's bytes), cut at :func:`chunk_starts`. Plain Python, a bisection of the pairs per
    chunk: the dozen numpy calls of the same cut took tens of microseconds of each write."""
    n = num_slots
    if not length or n == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    total = (prefix[-1] + length[-1]) * n
    bounds, offsets, start = [], [], 0
    for size in chunk_sizes(total, chunk_bytes, edge_bytes):
        p = bisect.bisect_right(prefix, start // n) - 1  # the last pair whose first row starts at or before start
        s = min((start - prefix[p] * n) // length[p], n - 1)
        row = p * n + s  # the last row that starts at or before start
        if not bounds or row > bounds[-1]:
            bounds.append(row)
            offsets.append(prefix[p] * n + s * length[p])
        start += size
    bounds.append(len(length) * n)
    offsets.append(total)
    return np.asarray(bounds, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


Launch = Callable[[int, int, Stage, object], None]  # (first row, end row, staging side, torch stream) -> a launch


class StagedLane:
    """Streams, staging buffers and events for staged copies from the local GPU to one peer
    GPU; shared by every peer on that GPU, one pipeline at a time (a lock).

    The pipeline is enqueued with raw CUDA calls (``cudaSetDevice``, ``cudaEventRecord``,
    ``cudaStreamWaitEvent``, ``cudaMemcpyAsync`` through :mod:`transport.nvlink.ipc`) and kernels
    relaunched without Triton's JIT (:mod:`transport.nvlink.launch`), so that the host enqueues a
    chunk faster than the copy engine moves it (bench/RESULTS.md)."""

    def __init__(self, api, local: int, peer: int, config: StagedConfig):
        import torch

        self._api, self.local, self.peer, self._config = api, local, peer, config
        self._lock = threading.Lock()
        self._copy = torch.cuda.Stream(device=local)
        self.scatter_stream = torch.cuda.Stream(device=peer)
        n = config.buffers
        with ipc.on_device(api, local):
            if peer != local:
                api.enable_peer_access(peer)  # the copy engine writes the peer's staging buffers
            self._gathered = [api.event_create() for _ in range(n)]  # recorded on the gather stream
            self._copied = [api.event_create() for _ in range(n)]  # recorded on the copy stream
        with ipc.on_device(api, peer):
            self._scattered = [api.event_create() for _ in range(n)]  # recorded on the scatter stream
        self._raw_events = tuple(api.raw(e) for e in self._gathered + self._copied + self._scattered)  # for C
        self._bufs: list = []  # [(local staging tensor, peer staging tensor)]
        self._addresses: tuple = ()  # the staging buffers' addresses: the local ones, then the peer's
        self._next = 0
        self._peer_slots = None  # int64 tensor on the peer GPU: the transport's ring of slots, mirrored there
        self.native_runs = 0  # pipelines enqueued by one call of C (tests and benchmarks read it)

    def peer_slots(self, capacity: int):
        """The ring of ``capacity`` int64 slots on the peer's GPU that staged writes' scatters
        read (made at the first call, for the scatter stream): a write's slots go there at the
        offsets they take in the transport's ring (:mod:`transport.nvlink.direct`)."""
        import torch

        if self._peer_slots is None:
            self._peer_slots = empty_for(self.scatter_stream, capacity, torch.int64, self.peer)  # [capacity]
        elif self._peer_slots.numel() != capacity:
            raise ValueError(f"the lane's ring of slots has {self._peer_slots.numel()} elements, asked for {capacity}")
        return self._peer_slots

    @property
    def buffer_bytes(self) -> int:
        return int(self._bufs[0][0].numel()) if self._bufs else 0

    def _ensure(self, nbytes: int) -> None:
        """Staging buffers of at least ``nbytes`` on both GPUs (grown only after the old ones idle)."""
        import torch

        if self.buffer_bytes >= nbytes:
            return
        self.synchronize()
        for device in (self.local, self.peer):  # a reused block may still be written by work queued there
            torch.cuda.current_stream(device).synchronize()
        size = -(-max(nbytes, self._config.chunk_bytes) // (2 << 20)) * (2 << 20)
        self._bufs, self._addresses = [], ()  # drop the old buffers before allocating the new ones
        self._bufs = [
            (torch.empty(size, dtype=torch.uint8, device=f"cuda:{self.local}"),
             torch.empty(size, dtype=torch.uint8, device=f"cuda:{self.peer}"))
            for _ in range(self._config.buffers)
        ]
        self._addresses = tuple(b[0].data_ptr() for b in self._bufs) + tuple(b[1].data_ptr() for b in self._bufs)

    def run(self, gather_stream, bounds: np.ndarray, bound_offsets: np.ndarray, gather: Launch, scatter: Launch,
            upload: Optional[tuple[int, int, int]] = None):
        """Enqueue the pipeline for chunks ``[bounds[k], bounds[k + 1])`` whose staging offsets
        start at ``bound_offsets[k]``; ``gather`` runs with the local GPU current on
        ``gather_stream`` (a torch stream), ``scatter`` with the peer GPU current on
        :attr:`scatter_stream`. ``upload``: ``(peer GPU address, host address, bytes)`` copied
        on the scatter stream before the first scatter (a write's slots, :meth:`peer_slots`).
        Returns a torch event recorded on the peer GPU after the last scatter."""
        import torch

        api = self._api
        sizes = np.diff(bound_offsets)  # [num_chunks] bytes per chunk
        g, c, s = gather_stream.cuda_stream, self._copy.cuda_stream, self.scatter_stream.cuda_stream
        with self._lock:
            self._ensure(int(sizes.max()) if sizes.size else 0)
            addresses, n = self._addresses, len(self._bufs)
            with ipc.on_device(api, self.local, torch_too=False):
                if upload is not None:
                    api.set_device(self.peer)
                    api.memcpy_async(upload[0], upload[1], upload[2], s)
                for k in range(sizes.size):
                    a, b, origin, nbytes = int(bounds[k]), int(bounds[k + 1]), int(bound_offsets[k]), int(sizes[k])
                    slot = self._next % n
                    self._next += 1
                    mine, theirs = addresses[slot], addresses[n + slot]
                    api.set_device(self.local)
                    api.stream_wait_event(g, self._copied[slot])  # the copy that last read mine is done
                    gather(a, b, Stage(StageMode.GATHER, mine, origin), gather_stream)
                    api.event_record(self._gathered[slot], g)
                    api.stream_wait_event(c, self._gathered[slot])
                    api.stream_wait_event(c, self._scattered[slot])  # the scatter that last read theirs is done
                    api.memcpy_async(theirs, mine, nbytes, c)
                    api.event_record(self._copied[slot], c)
                    api.set_device(self.peer)
                    api.stream_wait_event(s, self._copied[slot])
                    scatter(a, b, Stage(StageMode.SCATTER, theirs, origin), self.scatter_stream)
                    api.event_record(self._scattered[slot], s)
            done = torch.cuda.Event()
            done.record(self.scatter_stream)
        return done

    def run_native(self, native, gather_stream, bounds: np.ndarray, bound_offsets: np.ndarray, gather: tuple,
                   scatter: tuple, ints: tuple, upload: tuple[int, int, int]):
        """:meth:`run` in one call of C (``native.pipeline``, :mod:`transport.nvlink.native`):
        the same steps per chunk, the launches given as ``native.pipeline`` takes them
        (:meth:`~transport.nvlink.kernel.SplitLaunch.native_spec`) with ``ints`` = ``(slot
        base, pairs, slots, rows per tile, programs)``; ``bounds`` and ``bound_offsets`` int64
        arrays. Returns a torch event recorded on the peer GPU after the last scatter."""
        import torch

        with self._lock:
            self._ensure(int(np.diff(bound_offsets).max()) if bound_offsets.size > 1 else 0)
            streams = (gather_stream.cuda_stream, self._copy.cuda_stream, self.scatter_stream.cuda_stream)
            self._next = native.pipeline(self.local, self.peer, streams, self._raw_events, self._addresses, self._next,
                                         gather, scatter, ints, bounds, bound_offsets, upload)
            self.native_runs += 1
            done = torch.cuda.Event()
            done.record(self.scatter_stream)
        return done

    def synchronize(self) -> None:
        """Wait for every copy and scatter enqueued so far."""
        self._copy.synchronize()
        self.scatter_stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        self._bufs, self._addresses, self._peer_slots = [], (), None
        for device, events in ((self.local, self._gathered + self._copied), (self.peer, self._scattered)):
            with ipc.on_device(self._api, device):
                for event in events:
                    self._api.event_destroy(event)
        self._gathered, self._copied, self._scattered, self._raw_events = [], [], [], ()


def open_lane(api, local: int, peer: int, config: StagedConfig) -> StagedLane:
    """A lane, or :class:`ipc.CudaIpcError` when the two GPUs cannot reach each other. A
    loopback lane (``peer == local``) runs the same pipeline inside one GPU: gather, a copy
    between two staging buffers of that GPU, scatter (what one GPU can test and time of it)."""
    return StagedLane(api, local, peer, config)
