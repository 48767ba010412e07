"""Staging on a CUDA device: copies as launches of the NVLink backend's row kernels.

See :mod:`~transport.nixl.staged.copy` for what a staging is and how its copies are ordered
(a slot's event, :meth:`~transport.nixl.staged.copy.Staging.ready` / ``is_ready``).
"""

from __future__ import annotations

import contextlib

import numpy as np

from transport.nixl.staged.config import CHUNK_HEADER_BYTES
from transport.nixl.staged.copy import Staging, StridedRows, check_header
from transport.nixl.staged.wire import STRIDED_HEADER_BYTES, ChunkHeader, StridedHeader, data_start

__all__ = ["KernelStaging"]


class KernelStaging(Staging):
    """Staging on one CUDA device (or "cpu": Triton's interpreter, tests)."""

    def __init__(self, slots: int, slot_bytes: int, device):
        import torch

        super().__init__(slots, slot_bytes)
        self._torch_device = torch.device(device)
        self.device = self._torch_device.index if self._torch_device.type == "cuda" else None
        # the copies run on a stream of their own, synchronized alone (never the whole device);
        # the buffer is allocated for it (a block of another stream could still be written there)
        self._stream = torch.cuda.Stream(self._torch_device) if self._torch_device.type == "cuda" else None
        with self._on_stream():
            self.buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self._torch_device)  # [slots * slot_bytes]
        self.ready()  # zeroed before a peer can write into it
        self.ptr = self.buf.data_ptr()
        self._events: list = [None] * slots  # [slots] event after the copies last queued for each slot
        # a slot's header goes from pinned memory: a copy from pageable memory would wait for the stream
        self._heads = (torch.empty((slots, STRIDED_HEADER_BYTES), dtype=torch.uint8, pin_memory=True)
                       if self._stream is not None else None)  # [slots, header bytes]

    @contextlib.contextmanager
    def _on_stream(self):
        """This device and the strided copies' stream current (a no-op on the CPU)."""
        if self._stream is None:
            yield
            return
        import torch

        with torch.cuda.device(self._torch_device), torch.cuda.stream(self._stream):
            yield

    def _put(self, k: int, head, at: int = 0) -> None:
        """``head`` (host bytes, or a tensor on this device) into slot ``k`` from ``at``, queued on
        the current stream (what waits for the slot's copies waits for it). Host bytes of a
        header go through slot ``k``'s pinned buffer, free again: the slot's earlier copies were
        waited for before NIXL read it."""
        import torch

        at += k * self.slot_bytes
        if isinstance(head, np.ndarray) and self._heads is not None and head.size <= self._heads.shape[1]:
            pinned = self._heads[k, : head.size]
            pinned.numpy()[:] = head
            self.buf[at: at + head.size].copy_(pinned, non_blocking=True)
            return
        src = torch.from_numpy(head) if isinstance(head, np.ndarray) else head
        self.buf[at: at + src.numel()].copy_(src)

    # -- strided writes ------------------------------------------------------------------------

    def strided_rows(self, addr, stride, length, slot) -> StridedRows:
        """:meth:`Staging.strided_rows` with the kernel's strided table (``[6 P + 2 S]``, the
        same rows on both of its sides, so one table serves the gather and the scatter) uploaded
        on this staging's stream, once per write. A sender's stream first waits for the work
        already queued on the caller's current stream (what produced the source bytes)."""
        rows = StridedRows(addr, stride, length, slot)
        p, n = rows.pairs, rows.slots
        table = np.empty(6 * p + 2 * n, dtype=np.int64)  # [6 P + 2 S] (transport.nvlink.kernel, "Staged copies")
        table[: 5 * p].reshape(5, p)[:] = (addr, stride, addr, stride, length)
        table[5 * p: 6 * p] = rows.pair_offset // max(n, 1)  # [P] staging prefix: bytes of one slot before p
        table[6 * p: 6 * p + n] = slot
        table[6 * p + n:] = slot
        rows.bits = int(np.bitwise_or.reduce(table[: 5 * p])) | int(np.bitwise_or.reduce(rows.pair_offset))
        (rows.table,) = self._upload(table)
        return rows

    def strided_table(self, table: np.ndarray):
        """The destination table's bytes on this device, uploaded once per write."""
        import torch

        with self._on_stream():
            return torch.from_numpy(table).to(self._torch_device)

    def write_strided_head(self, k: int, header: StridedHeader, table) -> None:
        """Header (from the host) and table (a device copy) into slot ``k``, on the stream:
        :meth:`ready` before NIXL reads the slot."""
        with self._on_stream():
            super().write_strided_head(k, header, table)

    def queued(self, k: int) -> None:
        """An event on the stream after what is queued so far, for slot ``k`` (one per slot, reused)."""
        if self._stream is not None:
            import torch

            if self._events[k] is None:
                self._events[k] = torch.cuda.Event()
            self._events[k].record(self._stream)

    def is_ready(self, k: int) -> bool:
        event = self._events[k]
        return event is None or event.query()

    def ready(self, k: Optional[int] = None) -> None:
        """Wait until what was queued for slot ``k`` (None: for every slot) is in place: this
        staging's stream only, never the whole device."""
        if self._stream is None:
            return
        if k is None:
            self._stream.synchronize()
        elif self._events[k] is not None:
            self._events[k].synchronize()

    def stage_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int, header: StridedHeader,
                      table) -> None:
        """:meth:`Staging.stage_strided` inside one stream context (entering it costs about
        as much as the launch)."""
        with self._on_stream():
            self._launch_strided(k, at, rows, begin, end, gather=True)
            Staging.write_strided_head(self, k, header, table)
            self.queued(k)

    def gather_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int) -> None:
        """One launch, queued on the stream (the sender calls :meth:`ready` before its post)."""
        with self._on_stream():
            self._launch_strided(k, at, rows, begin, end, gather=True)

    def scatter_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int) -> None:
        """One launch, queued on the stream (the receiver marks it :meth:`queued` and answers
        once :meth:`is_ready`)."""
        with self._on_stream():
            self._launch_strided(k, at, rows, begin, end, gather=False)

    def _launch_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int, gather: bool) -> None:
        """The strided kernel between rows ``[begin, end)`` and slot ``k`` from ``at``, on the
        stream (the caller made it current)."""
        from transport.nvlink.kernel import CopyPath, KernelConfig, Stage, StageMode, plan_launch, scatter_strided

        stage_at = self.slot_ptr(k) + at
        bits = rows.bits | stage_at  # off(r) - off(begin) shares the pair offsets' and lengths' alignment
        path = CopyPath.VEC16 if not bits & 15 else CopyPath.VEC8 if not bits & 7 else CopyPath.BYTES
        plan = plan_launch(end - begin, int(rows.length.max()), path, KernelConfig())
        stage = Stage(StageMode.GATHER if gather else StageMode.SCATTER, stage_at, rows.offset_of(begin))
        scatter_strided(rows.table, rows.pairs, rows.slots, plan, self._torch_device, begin=begin, end=end,
                        stage=stage, checked=True, stream=self._stream)

    def _get(self, k: int, n: int) -> np.ndarray:
        at = k * self.slot_bytes
        return self.buf[at: at + n].cpu().numpy()

    def adopt(self, *arrays) -> tuple:
        """``[n]`` int64 arrays of a write (sources, destinations, lengths) as tensors on this
        device, uploaded once per write on the stream: a chunk's tables are then slices of
        them, built here. A sender's stream first waits for the work already queued on the
        caller's current stream (what produced the source bytes)."""
        return self._upload(*arrays)

    def _upload(self, *arrays) -> tuple:
        """int64 host arrays as tensors on this device, uploaded on the stream once it waited
        for the work already queued on the caller's current stream (what produced a sender's
        source bytes)."""
        import torch

        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._torch_device))
        with self._on_stream():
            return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self._torch_device)
                         for a in arrays)

    def _tensor(self, a):
        import torch

        return a if isinstance(a, torch.Tensor) else self.adopt(a)[0]

    def write_head(self, k: int, header: ChunkHeader, dst_offset, dst_region, length) -> None:
        """The header from the host, the row table copied here from the write's adopted arrays,
        on the stream, :meth:`queued` for slot ``k`` with the gather before them (never a
        device-wide synchronize: the serving engine's own streams run on)."""
        import torch

        with self._on_stream():
            self._put(k, header.pack())
            n, at = header.rows, k * self.slot_bytes + CHUNK_HEADER_BYTES
            self.buf[at: at + 8 * n].view(torch.int64).copy_(self._tensor(dst_offset))
            self.buf[at + 8 * n: at + 12 * n].view(torch.int32).copy_(self._tensor(dst_region))
            self.buf[at + 12 * n: at + 16 * n].view(torch.int32).copy_(self._tensor(length))
            self.queued(k)

    def land(self, k: int, expect: tuple, table) -> ChunkHeader:
        """:meth:`Staging.land` with the rows read, checked and made into the kernel's row table
        on the device: the host reads the 64-byte header and a few scalars, never the rows (a
        chunk that fails a check goes through the host path, which names the first bad row)."""
        with self._on_stream():
            return self._land(k, expect, table)

    def _land(self, k: int, expect: tuple, table) -> ChunkHeader:
        import torch

        header = ChunkHeader.parse(self._get(k, CHUNK_HEADER_BYTES), self.slot_bytes)
        check_header(header, expect, k)
        sizes, ptr, dev = self._region_tables(table)  # [ids] each, on the device
        if sizes.numel() == 0:
            return super().land(k, expect, table)
        n, at = header.rows, k * self.slot_bytes + CHUNK_HEADER_BYTES
        offset = self.buf[at: at + 8 * n].view(torch.int64)  # [rows]
        region = self.buf[at + 8 * n: at + 12 * n].view(torch.int32).long()  # [rows]
        length = self.buf[at + 12 * n: at + 16 * n].view(torch.int32).long()  # [rows]
        r = region.clamp(0, sizes.numel() - 1)  # [rows] ids to index with (bad ones are refused below)
        size = sizes[r]
        bad = (region != r) | (size < 0) | (offset < 0) | (length <= 0) | (offset > size - length)  # [rows]
        bad |= dev[r] != (-1 if self.device is None else self.device)
        addr = ptr[r] + offset  # [rows] absolute destinations
        if not self._copy(k, data_start(n), addr, length, gather=False,
                          land_if=lambda: (bad.any().long(), length.sum() - header.nbytes)):
            return super().land(k, expect, table)  # names the first bad row (or the byte count) and raises
        return header

    def gather(self, k: int, at: int, addr, length) -> None:
        """Queued on the stream (:meth:`write_head` then marks the slot's copies :meth:`queued`)."""
        with self._on_stream():
            self._copy(k, at, self._tensor(addr), self._tensor(length), gather=True)

    def scatter(self, k: int, at: int, addr, length) -> None:
        """Queued on the stream, as :meth:`scatter_strided`."""
        with self._on_stream():
            self._copy(k, at, self._tensor(addr), self._tensor(length), gather=False)

    def _copy(self, k: int, at: int, addr, length, gather: bool, land_if=None) -> bool:
        """The row kernel between the rows at ``addr`` (``[n]`` int64 here) and slot ``k`` from
        ``at``: its row table, copy path and launch shape made here, one host read of the
        scalars. ``land_if``: more scalars that must all be 0 for the copy to run (else False)."""
        import torch

        from transport.nvlink.kernel import CopyPath

        staged = torch.cumsum(length, 0) - length  # [n] staging offsets
        bits = addr | length | staged
        scalars = [length.max(), (bits & 15).any().long(), (bits & 7).any().long(), *(land_if() if land_if else ())]
        longest, odd16, odd8, *refuse = torch.stack(scalars).tolist()
        if any(refuse):
            return False
        stage_at = self.slot_ptr(k) + at
        path = (CopyPath.VEC16 if not odd16 and stage_at % 16 == 0 else
                CopyPath.VEC8 if not odd8 and stage_at % 8 == 0 else CopyPath.BYTES)
        zeros = torch.zeros_like(addr)
        rows = torch.stack([addr, zeros, length, staged] if gather else [zeros, addr, length, staged])  # [4, n]
        self._run(rows, int(longest), path, stage_at, gather)
        return True

    def _region_tables(self, table) -> tuple:
        """The region table's sizes, pointers and devices as int64 tensors here (cached per table:
        the transport builds a new one when its regions change)."""
        import torch

        if getattr(self, "_tables_of", None) is not table:
            arrays = (table.sizes.sizes, table.ptr.astype(np.int64), table.dev)
            self._tables = tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self._torch_device)
                                 for a in arrays)
            self._tables_of = table
        return self._tables

    def _run(self, rows, longest: int, path, stage_at: int, gather: bool) -> None:
        """Launch the row kernel over ``rows`` (``[4, n]`` int64 here) in its gather or scatter
        mode at staging address ``stage_at``, on the stream (the caller made it current); both
        are waited for through the slot's event (:meth:`queued`, :meth:`ready`)."""
        from transport.nvlink.kernel import KernelConfig, Stage, StageMode, plan_launch, scatter_rows

        plan = plan_launch(int(rows.shape[1]), longest, path, KernelConfig())
        stage = Stage(StageMode.GATHER if gather else StageMode.SCATTER, stage_at, 0)
        if self._stream is None:
            scatter_rows(rows, plan, "cpu", stage=stage)
            return
        scatter_rows(rows, plan, self._torch_device, stage=stage, stream=self._stream)
