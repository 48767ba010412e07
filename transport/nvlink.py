"""The ``nvlink`` backend: GPU-to-GPU writes between two processes of one host.

Data path (push, on the writer)
-------------------------------
- ``register`` exports a CUDA IPC handle for each GPU region (the handle of its allocation's
  base plus the region's offset; see :mod:`transport.cuda_ipc`). All regions of one transport
  live on one GPU, the one whose SMs run the copy kernel.
- ``connect`` opens every peer region's handle while the LOCAL GPU is current and builds the
  pointer tables once: ``src_base[rid]`` (local addresses) and ``dst_base[rid]`` (peer memory
  as mapped here), int64 numpy arrays indexed by region id.
- ``write`` checks the batch's bounds, gathers the row table ``[3, n]`` (source address,
  destination address, bytes; :mod:`transport.nvlink_kernel`) into pinned host memory, copies
  it to the GPU and launches the Triton row-scatter kernel once, on a stream of its own that
  first waits for the caller's current stream (so KV written by the model is complete).
  A CUDA event recorded after the kernel marks completion.
- ``write_strided`` (a :class:`~transport.base.StridedBatch`, buffer pairs x slots) does the
  host work in O(P + S): bounds per pair from the largest slot, a ``[5 * P + 2 * S]`` table
  (pair addresses, strides, lengths; slots) staged pinned and copied once; the strided kernel
  computes each row's addresses on the GPU. Same stream, event and notification path.

Notification channel (the "mailbox", :mod:`transport.mailbox`)
--------------------------------------------------------------
Each transport listens on a Unix stream socket in Linux's abstract namespace (named in its
export; nothing on disk) and each peer keeps one connected socket to it. A notification is
one frame, a 4-byte big-endian length and the payload, sent by the WRITER only after the
transfer's CUDA event has completed, i.e. after the kernel's stores to the peer's memory are
done; the receiver's ``poll_notifications`` reads whole frames without blocking, in the order
they were sent. The same socket detects a dead peer: the receiver never writes to it, so a
readable socket means end-of-file, i.e. the peer process is gone.

Progress and bounded waits
--------------------------
``Transfer.status()`` and a small progress thread (started on the first write) advance each
peer's FIFO of pending transfers: query the event; on completion check the peer is alive,
send the notification (a socket send bounded by ``peer_timeout_s``) and mark DONE. A dead
peer is FAILED at ``write`` (nothing is launched) or at completion; a copy whose event has not
completed after ``transfer_timeout_s`` is FAILED. ``abort`` marks a pending transfer FAILED and
suppresses its notification; the kernel, once launched, still runs to completion.

Measured (two H200s, NV18; ``kvtransfer bench nvlink``): the kernel moves 2 KiB-128 KiB rows
at 364-370 GB/s, 93-94 % of torch's peer copy, and 256 B head slices at 91-93 %; one 4-warp
program per SM saturates the link. For millions of rows ``write()`` is bound by host-side
preparation (~28 ns per row), not by the copy. ``write_strided`` removes that: for the same
2.6 M page-1 rows as 160 pairs x 16,384 slots the strided kernel moves 368 GB/s (the row-table
kernel 370 in the same run), the host prepares in about 0.7 ms, and ``write_strided().wait()``
reaches 354 GB/s = 89.5 % of the peer copy (``write()``: 17 %, bound by the host).

A write is three steps, :meth:`NvlinkPeer.prepare` (bounds against cached region sizes, the
table in pinned memory, the engine and its launch), :meth:`~NvlinkPeer.upload` (one raw
``cudaMemcpyAsync`` per GPU) and :meth:`~NvlinkPeer.enqueue`; benchmarks repeat the last to
time the GPU side alone. A failed or aborted transfer keeps its tables until its copy ends.

The staged engine (:mod:`transport.nvlink_staged`, ``NvlinkPeer.engine``) packs rows on the
local GPU, moves the packed bytes with the copy engine and unpacks them with a kernel this
process launches on the peer GPU: 95-98 % of the peer copy for whole-token rows. Engine
"auto" takes it for batches of 2 GiB and more whose rows average 1 KiB or more.

What this backend refuses (the caller falls back to NIXL)
---------------------------------------------------------
:class:`NvlinkUnsupported` for host memory, a peer on another host or in this process, and a
peer allocation that cannot be opened here (no peer access, another container, no CUDA IPC).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import numpy as np

from transport import cuda_ipc
from transport.mailbox import Inbox, MailboxUnreachable, Outbox, host_id
from transport import nvlink_kernel as kern
from transport import nvlink_staged as staged
from transport.nvlink_progress import Progress
from transport.nvlink_descriptor import BACKEND, gpu_uuid, local_ordinal, parse_descriptor
from transport.base import (
    Peer,
    PeerDescriptorError,
    Region,
    RegionSizes,
    StridedBatch,
    Transfer,
    TransferStatus,
    Transport,
    TransportClosed,
    TransportError,
    WriteBatch,
    check_region_args,
    pack_descriptor,
)

__all__ = ["NvlinkConfig", "NvlinkPeer", "NvlinkTransfer", "NvlinkTransport", "NvlinkUnsupported", "host_id",
           "parse_descriptor"]


class NvlinkUnsupported(TransportError):
    """This backend cannot serve the memory or peer asked for; use the NIXL backend."""


@dataclass(frozen=True)
class NvlinkConfig:
    """Settings of one :class:`NvlinkTransport`.

    peer_timeout_s: bound on sending one notification (a peer that stops reading fails the
        transfer after this long).
    transfer_timeout_s: a copy whose completion event has not fired by then is FAILED.
    ipc_api: "auto" (cuda-python, else ctypes on libcudart), "cuda-python" or "ctypes".
    kernel: launch shape of the copy kernel.
    staged: the staged engine for large batches (:mod:`transport.nvlink_staged`).
    wait_current_stream: the copy stream waits for the caller's current stream first.
    max_notify_bytes: largest notification payload.
    """

    peer_timeout_s: float = 10.0
    transfer_timeout_s: float = 60.0
    ipc_api: str = "auto"
    kernel: kern.KernelConfig = field(default_factory=kern.KernelConfig)
    staged: staged.StagedConfig = field(default_factory=staged.StagedConfig)
    wait_current_stream: bool = True
    max_notify_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("peer_timeout_s", "transfer_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.ipc_api not in cuda_ipc.API_CHOICES:
            raise ValueError(f"ipc_api must be one of {cuda_ipc.API_CHOICES}, got {self.ipc_api!r}")
        if not isinstance(self.kernel, kern.KernelConfig):
            raise TypeError(f"kernel must be a KernelConfig, got {type(self.kernel).__name__}")
        if not isinstance(self.staged, staged.StagedConfig):
            raise TypeError(f"staged must be a StagedConfig, got {type(self.staged).__name__}")
        if not isinstance(self.max_notify_bytes, int) or not 0 < self.max_notify_bytes < 1 << 31:
            raise ValueError(f"max_notify_bytes must be an int in (0, 2**31), got {self.max_notify_bytes!r}")


# -- transfers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedWrite:
    """A write whose host work is done (:meth:`NvlinkPeer.prepare`)."""

    host: object  # pinned int64 tensor: the row table [3 or 4, n] or the strided table
    launch: Callable  # (table on a GPU, device, torch stream, begin=0, end=None, stage=None) -> None
    lane: Optional[staged.StagedLane] = None  # the staged engine's lane, None: the direct kernel
    bounds: Optional[np.ndarray] = None  # staged: chunk k is rows [bounds[k], bounds[k + 1])
    offsets: Optional[np.ndarray] = None  # staged: staging offset of each bound


class NvlinkTransfer(Transfer):
    """One batched write: a CUDA event, an optional notification, a deadline."""

    # A 640 MiB copy takes 1.7 ms on NVLink: even a 50 us sleep (Linux's timer slack) costs a
    # few percent, so wait() polls yielding the GIL, without sleeping; it keeps one core busy
    # while it waits (poll status() from an event loop to avoid that).
    max_poll_sleep_s = 0.0

    def __init__(self, peer: "NvlinkPeer", event, notify: Optional[bytes], keep=(), error: Optional[str] = None):
        self._peer = peer
        self._event = event
        self._notify = notify
        self._keep = keep  # row tables that must outlive the copy
        self._deadline = time.monotonic() + peer._config.transfer_timeout_s
        self._status = TransferStatus.FAILED if error else TransferStatus.PENDING
        self._error = error

    def status(self) -> TransferStatus:
        if self._status is TransferStatus.PENDING:
            self._peer._advance()
        return self._status

    @property
    def error(self) -> Optional[str]:
        return self._error

    def abort(self) -> None:
        with self._peer._lock:
            if self._status is TransferStatus.PENDING:
                self._fail("aborted")

    def _fail(self, why: str) -> None:
        self._status, self._error = TransferStatus.FAILED, why
        self._peer._bury(self._event, self._keep)  # the GPU may still read the tables
        self._keep = ()

    def _done(self) -> None:
        self._status, self._keep = TransferStatus.DONE, ()


class NvlinkPeer(Peer):
    """A connected peer: its regions mapped here, its pointer table, its mailbox."""

    def __init__(self, owner: "NvlinkTransport", name: str, regions: Mapping[int, Region], ipc: dict, mailbox: str,
                 peer_gpu: Optional[int] = None):
        self._owner = owner
        self._config = owner._config
        self.name = name
        self.regions = dict(regions)
        self._sizes = RegionSizes(self.regions)
        self._device = owner._exec_device()
        self._api = owner._api()
        self._ipc = ipc
        self._opened: list[tuple[bytes, int]] = []  # (handle, device it was opened under)
        self._lock = threading.RLock()
        self._pending: deque[NvlinkTransfer] = deque()
        self._graveyard: list = []  # [(event, tables)] of failed transfers whose copy may still run
        self._closed = False
        self._outbox = None
        # The staged engine: the peer's GPU as numbered here (None: unknown or this GPU), its
        # regions as mapped under that GPU (opened at the first staged write), why it is off.
        self._peer_gpu = peer_gpu if peer_gpu != self._device else None
        self._dst_base_staged: Optional[np.ndarray] = None
        self.staged_error: Optional[str] = None
        self.engine = "auto"
        try:
            for rid, (handle, offset, alloc_size) in ipc.items():
                reg = self.regions[rid]
                if offset + reg.length > alloc_size:
                    raise PeerDescriptorError(
                        f"peer region {rid} [{offset}, +{reg.length}) exceeds its allocation of {alloc_size} bytes"
                    )
            self._dst_base = self._open_all(self._device)  # [num_peer_region_ids] addresses
            try:
                self._outbox = Outbox(mailbox, self._config.peer_timeout_s)
            except MailboxUnreachable as exc:
                raise NvlinkUnsupported(str(exc)) from None
        except BaseException:
            self._release()
            raise

    def _open_all(self, device: int) -> np.ndarray:
        """Map every peer region for ``device``'s kernels: its pointer table, by region id."""
        top = max(self.regions) if self.regions else -1
        bases = np.zeros(top + 1, dtype=np.int64)  # [num_peer_region_ids] addresses
        for rid, (handle, offset, _) in self._ipc.items():
            try:
                base = cuda_ipc.open_handle(self._api, handle, device)
            except cuda_ipc.CudaIpcError as exc:
                raise NvlinkUnsupported(
                    f"cannot open peer {self.name!r} region {rid} (peer cuda:{self.regions[rid].device}) "
                    f"on local cuda:{device}: {exc}"
                ) from None
            self._opened.append((handle, device))
            bases[rid] = base + offset
        return bases

    ENGINES = ("auto", "kernel", "staged")

    @property
    def engine(self) -> str:
        """Which engine writes take: "auto" (staged for large batches of long rows, see
        ``StagedConfig.wants``, else the kernel), "kernel" (always the direct push kernel) or
        "staged" (staged whenever possible, whatever the size and setting)."""
        return self._engine

    @engine.setter
    def engine(self, value: str) -> None:
        if value not in self.ENGINES:
            raise ValueError(f"engine must be one of {self.ENGINES}, got {value!r}")
        self._engine = value

    def _lane_for(self, total: int, rows: int, max_len: int) -> Optional[staged.StagedLane]:
        """The staged lane when this batch should take it (module doc of nvlink_staged), else None."""
        cfg = self._config.staged
        auto_says_no = self._engine == "auto" and not cfg.wants(total, rows)
        if (auto_says_no or self._engine == "kernel" or self._peer_gpu is None
                or self.staged_error is not None or max_len > cfg.chunk_bytes):
            return None
        try:
            lane = self._owner._lane(self._peer_gpu)
            if self._dst_base_staged is None:
                self._dst_base_staged = self._open_all(self._peer_gpu)
            return lane
        except (cuda_ipc.CudaIpcError, NvlinkUnsupported, RuntimeError) as exc:
            self.staged_error = f"staged engine off for peer {self.name!r}: {exc}"
            return None

    # -- writes ---------------------------------------------------------------------------
    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> NvlinkTransfer:
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, got {type(batch).__name__}")
        return self._write(batch, notify)

    def write_strided(self, batch: StridedBatch, notify: Optional[bytes] = None) -> NvlinkTransfer:
        """A factored write expanded on the GPU: the host checks bounds in O(P + S), stages the
        ``[5 * P + 2 * S]`` strided table (:mod:`transport.nvlink_kernel`) and launches the
        strided kernel, which computes each row's addresses; completion as for :meth:`write`."""
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        return self._write(batch, notify)

    def _write(self, batch, notify: Optional[bytes]) -> NvlinkTransfer:
        notify = self._check_write(batch, notify)
        if not self._outbox.alive():
            return NvlinkTransfer(self, None, None, error=f"peer {self.name!r} lost (its socket closed)")
        job = self.prepare(batch, checked=True)
        try:
            tables = self.upload(job)
            event = self.enqueue(job, tables)
        except BaseException:
            self._quiesce(job)  # part of it may be queued: nothing may read the tables once they go
            raise
        return self._track(NvlinkTransfer(self, event, notify, keep=(job.host, *tables)))

    def _quiesce(self, job: PreparedWrite) -> None:
        with contextlib.suppress(Exception):  # a CUDA error here would only repeat the first one
            self._owner._stream().synchronize()
            if job.lane is not None:
                job.lane.synchronize()

    # The three steps of a write; benchmarks also call them to time the GPU side alone
    # (prepare and upload once, enqueue again and again).
    def prepare(self, batch, checked: bool = False) -> PreparedWrite:
        """The host side of a write of ``batch`` (a WriteBatch or a StridedBatch): the engine,
        the table in pinned memory, the launch, the chunks. ``checked``: bounds already checked."""
        import torch

        if not checked:
            self._check_bounds(batch)
        n, warps = len(batch), self._config.kernel.num_warps
        max_len = int(batch.length.max()) if n else 0
        if isinstance(batch, StridedBatch):
            num_pairs, num_slots = batch.num_pairs, batch.num_slots
            lane = self._lane_for(int(batch.length.sum()) * num_slots, n, max_len) if n else None
            host = torch.empty(kern.strided_table_size(num_pairs, num_slots, lane is not None), dtype=torch.int64,
                               pin_memory=True)
            table = self.strided_table(batch, out=host.numpy(), checked=True, lane=lane)
            plan = self.strided_plan(batch, table, staged_launch=lane is not None)

            def launch(table_dev, dev, stream, begin=0, end=None, stage=None):
                kern.scatter_strided(table_dev, num_pairs, num_slots, plan, dev, warps, begin=begin, end=end,
                                     stage=stage, checked=True, stream=stream)

            if lane is None:
                return PreparedWrite(host, launch)
            pair_offset = table[5 * num_pairs + 2 * num_slots:]
            total = int(pair_offset[-1] + batch.length[-1] * num_slots)
            bounds = staged.strided_chunks(pair_offset, batch.length, num_slots, self._chunk_starts(total))
            offsets = staged.strided_offsets(pair_offset, batch.length, num_slots, bounds)
            return PreparedWrite(host, launch, lane, bounds, offsets)
        lane = self._lane_for(int(batch.length.sum()), n, max_len) if n else None
        host = torch.empty((3 if lane is None else 4, n), dtype=torch.int64, pin_memory=True)  # [3 or 4, num_rows]
        rows = self.row_table(batch, out=host.numpy(), checked=True, lane=lane)
        plan = self.launch_plan(batch, rows, staged_launch=lane is not None)

        def launch(rows_dev, dev, stream, begin=0, end=None, stage=None):
            kern.scatter_rows(rows_dev, plan, dev, warps, begin=begin, end=end, stage=stage, checked=True,
                              stream=stream)

        if lane is None:
            return PreparedWrite(host, launch)
        total = int(rows[3, -1] + batch.length[-1])
        bounds = staged.row_chunks(rows[3], total, self._chunk_starts(total))
        return PreparedWrite(host, launch, lane, bounds, np.append(rows[3], total)[bounds])

    def _chunk_starts(self, total: int) -> np.ndarray:
        cfg = self._config.staged
        return staged.chunk_starts(total, cfg.chunk_bytes, cfg.edge_bytes)

    def upload(self, job: PreparedWrite) -> tuple:
        """Copy the pinned table to the local GPU (on the copy stream) and, staged, to the
        peer's (on the scatter stream): the tables :meth:`enqueue` reads."""
        tables = (self._table_on(job.host, self._device, self._owner._stream()),)
        if job.lane is not None:
            tables += (self._table_on(job.host, job.lane.peer, job.lane.scatter_stream),)
        return tables

    def _table_on(self, host, device: int, stream):
        """``host`` copied to ``device`` on ``stream`` by one raw ``cudaMemcpyAsync`` (torch's
        stream contexts cost more than the copy). The pinned ``host`` must outlive the copy:
        transfers keep it until their event completes, failed ones too (:meth:`_bury`)."""
        import torch

        table = torch.empty(host.shape, dtype=host.dtype, device=torch.device("cuda", device))
        table.record_stream(stream)  # the allocator reuses it only once the stream is past this point
        with cuda_ipc.on_device(self._api, device, torch_too=False):
            self._api.memcpy_async(table.data_ptr(), host.data_ptr(), host.numel() * host.element_size(),
                                   stream.cuda_stream)
        return table

    def enqueue(self, job: PreparedWrite, tables: tuple):
        """Queue the copy (after the caller's current stream when ``wait_current_stream``);
        return the CUDA event that marks its completion."""
        import torch

        stream = self._owner._stream()
        if self._config.wait_current_stream:
            stream.wait_stream(torch.cuda.current_stream(self._device))
        lane = job.lane
        if lane is None:
            with cuda_ipc.on_device(self._api, self._device, torch_too=False):
                job.launch(tables[0], self._device, stream)
            event = torch.cuda.Event()
            event.record(stream)
            return event
        return lane.run(stream, job.bounds, job.offsets,
                        lambda a, b, st, s: job.launch(tables[0], lane.local, s, a, b, st),
                        lambda a, b, st, s: job.launch(tables[1], lane.peer, s, a, b, st))

    def _check_bounds(self, batch) -> None:
        batch.check_bounds(self._owner._region_sizes(), self._sizes)

    def _check_write(self, batch, notify) -> Optional[bytes]:
        """The checks every write shares: open peer, notification payload, the batch's bounds."""
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is closed")
        if notify is not None:
            if not isinstance(notify, (bytes, bytearray, memoryview)):
                raise TypeError(f"notify must be bytes or None, got {type(notify).__name__}")
            notify = bytes(notify)
            if len(notify) > self._config.max_notify_bytes:
                raise ValueError(f"notify must be at most {self._config.max_notify_bytes} bytes, got {len(notify)}")
        self._check_bounds(batch)
        return notify

    def _track(self, transfer: NvlinkTransfer) -> NvlinkTransfer:
        with self._lock:
            self._pending.append(transfer)
        self._owner._progress.wake()
        return transfer

    def row_table(self, batch: WriteBatch, out: Optional[np.ndarray] = None, checked: bool = False,
                  lane: Optional[staged.StagedLane] = None) -> np.ndarray:
        """The ``[3, n]`` row table (source address, destination address, bytes) this peer
        launches for ``batch`` (see :mod:`transport.nvlink_kernel`); benchmarks time the kernel
        on it. ``checked``: the caller already ran ``batch.check_bounds``. With a ``lane``: the
        staged ``[4, n]`` form, destinations as mapped under the peer's GPU."""
        if not checked:
            self._check_bounds(batch)
        return kern.build_row_table(
            self._owner._src_base, batch.src_region, batch.src_offset,
            self._dst_base if lane is None else self._dst_base_staged, batch.dst_region, batch.dst_offset,
            batch.length, out=out, staged=lane is not None,
        )

    def _kernel_config(self, staged_launch: bool) -> kern.KernelConfig:
        if not staged_launch:
            return self._config.kernel
        return dataclasses.replace(self._config.kernel, max_programs=self._config.staged.max_programs)

    def launch_plan(self, batch: WriteBatch, rows: np.ndarray, staged_launch: bool = False) -> kern.LaunchPlan:
        """Copy path and tile shape for ``batch`` (``rows`` from :meth:`row_table`)."""
        n = len(batch)
        return kern.plan_launch(n, int(batch.length.max()) if n else 1, kern.choose_path(rows),
                                self._kernel_config(staged_launch))

    def strided_table(self, batch: StridedBatch, out: Optional[np.ndarray] = None, checked: bool = False,
                      lane: Optional[staged.StagedLane] = None) -> np.ndarray:
        """The ``[5 * P + 2 * S]`` strided table this peer launches for ``batch`` (see
        :mod:`transport.nvlink_kernel`). ``checked``: the caller already ran ``check_bounds``.
        With a ``lane``: the staged form (``+ P`` offsets), destinations under the peer's GPU."""
        if not checked:
            self._check_bounds(batch)
        pairs = (batch.src_region, batch.src_offset, batch.src_stride, batch.dst_region, batch.dst_offset,
                 batch.dst_stride, batch.length)
        dst_base = self._dst_base if lane is None else self._dst_base_staged
        return kern.build_strided_table(self._owner._src_base, dst_base, pairs, batch.src_slot, batch.dst_slot,
                                        out=out, staged=lane is not None)

    def strided_plan(self, batch: StridedBatch, table: np.ndarray, staged_launch: bool = False) -> kern.LaunchPlan:
        """Copy path (from the pair part alone, O(P)) and tile shape for ``batch``."""
        n = len(batch)
        path = kern.choose_path(table[: 5 * batch.num_pairs])
        return kern.plan_launch(n, int(batch.length.max()) if n else 1, path, self._kernel_config(staged_launch))

    @property
    def device(self) -> int:
        """The local GPU that runs this peer's copies."""
        return self._device

    def _bury(self, event, keep: tuple) -> None:
        """Hold ``keep`` until ``event`` completes (a failed or aborted transfer's tables)."""
        if keep and event is not None:
            with self._lock:
                self._graveyard.append((event, keep))

    def _dig(self) -> None:
        """Release the tables of failed transfers whose copy has finished (or errored)."""
        def running(event) -> bool:
            try:
                return not event.query()
            except Exception:  # a CUDA error: nothing will run any more
                return False

        self._graveyard = [(e, k) for e, k in self._graveyard if running(e)]

    def _advance(self) -> bool:
        """Move the FIFO of pending transfers forward; True while some remain pending."""
        with self._lock:
            if self._graveyard:
                self._dig()
            while self._pending:
                t = self._pending[0]
                if t._status is TransferStatus.PENDING and not self._advance_one(t):
                    return True
                self._pending.popleft()
            return False

    def _advance_one(self, t: NvlinkTransfer) -> bool:
        """Settle ``t`` if its copy finished or timed out; False while it is still running."""
        try:
            finished = t._event.query()
        except Exception as exc:  # a CUDA error surfaces here (illegal address, ...)
            t._fail(f"CUDA error in the copy kernel: {exc}")
            return True
        if not finished:
            if time.monotonic() > t._deadline:
                t._fail(f"copy did not complete within {self._config.transfer_timeout_s} s")
                return True
            return False
        if not self._outbox.alive():
            t._fail(f"peer {self.name!r} lost before the notification could be sent")
            return True
        if t._notify is not None:
            try:
                self._outbox.send(t._notify)
            except OSError as exc:
                t._fail(f"peer {self.name!r} lost while sending the notification: {exc}")
                return True
        t._done()
        return True

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in self._pending:
                if t._status is TransferStatus.PENDING:
                    t._fail("aborted: peer closed")
            self._pending.clear()
        self._release()
        self._owner._forget_peer(self)

    def _release(self) -> None:
        """Wait for copies in flight, then unmap the peer's memory and close the socket."""
        if self._opened:
            self._owner._stream().synchronize()
            self._owner._sync_lanes()
            self._graveyard.clear()
            for handle, device in self._opened:
                try:
                    cuda_ipc.close_handle(self._api, handle, device)
                except cuda_ipc.CudaIpcError:
                    pass  # the mapping is gone with the peer; nothing left to release
            self._opened.clear()
        if self._outbox is not None:
            self._outbox.close()


# -- the transport -----------------------------------------------------------------------


class NvlinkTransport(Transport):
    """GPU regions of this process, exported as CUDA IPC handles; see the module docstring."""

    backend = BACKEND

    def __init__(self, config: Optional[NvlinkConfig] = None, name: Optional[str] = None):
        self._config = config if config is not None else NvlinkConfig()
        if not isinstance(self._config, NvlinkConfig):
            raise TypeError(f"config must be an NvlinkConfig, got {type(self._config).__name__}")
        self.name = name or f"nvlink-{os.getpid()}"
        self._regions: dict[int, Region] = {}
        self._exports: dict[int, cuda_ipc.IpcExport] = {}
        self._next_id = 0
        self._src_base = np.zeros(0, dtype=np.int64)  # [num_region_ids] local addresses
        self._sizes: Optional[RegionSizes] = None  # of self._regions, rebuilt after a change
        self._device: Optional[int] = None
        self._cuda_stream = None
        self._peers: list[NvlinkPeer] = []
        self._lanes: dict[int, staged.StagedLane] = {}  # peer GPU -> staged lane
        self._inbox = Inbox()
        self._progress = Progress(lambda: any([p._advance() for p in list(self._peers)]))
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"transport {self.name!r} is closed")

    def _api(self):
        return cuda_ipc.load_api(self._config.ipc_api)

    def _exec_device(self) -> int:
        if self._device is None:
            raise NvlinkUnsupported("register a GPU region before connecting: the nvlink backend copies with the local GPU")
        return self._device

    def _stream(self):
        import torch

        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device=self._exec_device())
        return self._cuda_stream

    def _lane(self, peer_gpu: int) -> staged.StagedLane:
        if peer_gpu not in self._lanes:
            self._lanes[peer_gpu] = staged.open_lane(self._api(), self._exec_device(), peer_gpu, self._config.staged)
        return self._lanes[peer_gpu]

    def _sync_lanes(self) -> None:
        for lane in self._lanes.values():
            lane.synchronize()

    # -- regions --------------------------------------------------------------------------
    def register(self, ptr: int, length: int, device: Optional[int] = None) -> int:
        self._check_open()
        check_region_args(ptr, length, device)
        if device is None:
            raise NvlinkUnsupported("the nvlink backend moves GPU memory only; register host memory with the nixl backend")
        if self._device is not None and device != self._device:
            raise ValueError(f"all regions of one nvlink transport share a GPU: have cuda:{self._device}, got cuda:{device}")
        try:
            exp = cuda_ipc.export_region(self._api(), ptr, length, device)
        except (cuda_ipc.CudaIpcError, cuda_ipc.CudaIpcUnavailable) as exc:
            raise NvlinkUnsupported(f"cannot export [0x{ptr:x}, +{length}) on cuda:{device} by CUDA IPC: {exc}") from None
        rid = self._next_id
        self._next_id += 1
        self._device = device
        self._regions[rid] = Region(rid, ptr, length, device)
        self._exports[rid] = exp
        if rid >= self._src_base.size:
            self._src_base = np.concatenate([self._src_base, np.zeros(max(16, rid + 1), dtype=np.int64)])
        self._src_base[rid] = ptr
        self._sizes = None
        return rid

    def deregister(self, region_id: int) -> None:
        self._check_open()
        if region_id not in self._regions:
            raise KeyError(f"region {region_id!r} is not registered (known ids: {sorted(self._regions)[:16]})")
        del self._regions[region_id]
        del self._exports[region_id]
        self._src_base[region_id] = 0
        self._sizes = None

    @property
    def regions(self) -> Mapping[int, Region]:
        return dict(self._regions)

    def _region_sizes(self) -> RegionSizes:
        if self._sizes is None:
            self._sizes = RegionSizes(self._regions)
        return self._sizes

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        self._check_open()
        ipc = [[rid, e.handle, e.offset, e.alloc_size] for rid, e in self._exports.items()]
        return pack_descriptor(
            BACKEND, self._regions.values(), name=self.name, host=host_id(), pid=os.getpid(),
            mailbox=self._inbox.name, ipc=ipc, gpu_uuid=gpu_uuid(self._device),
        )

    def connect(self, peer_bytes: bytes) -> NvlinkPeer:
        self._check_open()
        body, regions, ipc = parse_descriptor(peer_bytes)
        if body["host"] != host_id():
            raise NvlinkUnsupported(f"peer {body['name']!r} is on host {body['host']!r}, this process on {host_id()!r}")
        if body["pid"] == os.getpid():
            raise NvlinkUnsupported("the peer is this process: the nvlink backend connects two processes")
        peer_gpu = local_ordinal(body.get("gpu_uuid"))
        peer = NvlinkPeer(self, body["name"], regions, ipc, body["mailbox"], peer_gpu)
        self._peers.append(peer)
        return peer

    def _forget_peer(self, peer: NvlinkPeer) -> None:
        if peer in self._peers:
            self._peers.remove(peer)

    def poll_notifications(self) -> list[bytes]:
        self._check_open()
        return self._inbox.poll()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._progress.stop()
        for peer in list(self._peers):
            peer.close()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._inbox.close()
        self._regions.clear()
        self._exports.clear()
