"""Staging memory of one lane side, and the copies between it and registered memory.

A :class:`Staging` is ``slots`` slots of ``slot_bytes`` (one chunk each: :mod:`~transport.nixl_staged.wire`):

- :class:`HostStaging`: a numpy buffer. ``gather`` copies rows of equal length with ONE
  ``torch.index_select`` per run of equal lengths (the rows' memory seen as a 2-D
  ``[positions, row]`` view of the address window they span, a row index per row), ``scatter``
  with one numpy fancy assignment through the same kind of window (rows as one ``void``
  element each). Both run in C, no Python loop per row (bench/RESULTS.md for their rates).
- :class:`KernelStaging`: a torch buffer on a CUDA device. ``gather`` / ``scatter`` are one
  launch of the NVLink backend's row kernel in its staged modes (:mod:`transport.nvlink.kernel`,
  "Staged copies": ``Stage(GATHER | SCATTER, slot address, 0)`` over a ``[4, rows]`` row
  table), then a stream synchronize, so the bytes are in place before NIXL reads them or the
  notification goes out. ``device="cpu"`` runs the same kernel in Triton's interpreter (tests).

Rows are given as absolute addresses (``[rows]`` int64) and lengths (``[rows]`` int64); the
caller has checked them against its registered regions.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Optional

import numpy as np

from transport.base import check_ranges
from transport.nixl_staged.config import CHUNK_HEADER_BYTES
from transport.nixl_staged.wire import ChunkHeader, ProtocolError, data_start

__all__ = ["Staging", "HostStaging", "KernelStaging", "make_staging"]


def _merged(addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows that follow each other in memory (as they do in the staging) merged into one:
    ``(addr, length)`` of the runs, ``[runs]`` each."""
    start = np.ones(addr.size, dtype=bool)  # [rows] row i starts a run
    start[1:] = addr[1:] != addr[:-1] + length[:-1]
    if start.all():
        return addr, length
    first = np.flatnonzero(start)
    return addr[first], np.add.reduceat(length, first)


def _runs(length: np.ndarray) -> np.ndarray:
    """Bounds ``[0, ..., n]`` of the runs of equal length."""
    return np.concatenate(([0], np.flatnonzero(np.diff(length)) + 1, [length.size])).astype(np.int64)


def _window(addr: np.ndarray, row: int, staged_at: int) -> tuple[int, int, int]:
    """(base, span, element bytes) of the address window holding rows of ``row`` bytes at
    ``addr``; elements of 8 bytes when the rows and their staging address ``staged_at`` allow."""
    elem = 8 if not (int(np.bitwise_or.reduce(addr)) | row | staged_at) & 7 else 1
    base = int(addr.min())
    return base, int(addr.max()) + row - base, elem


def _raw(base: int, span: int):
    return (ctypes.c_char * span).from_address(base)


@contextlib.contextmanager
def _one_torch_thread():
    """torch's CPU ops on this thread only, for the duration: the gather is one of three
    copies in flight (the wire, the receiver's scatter), and torch's intra-op threads spinning
    beside them cost several times what they gain (bench/RESULTS.md)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _where(device: Optional[int]) -> str:
    return "host" if device is None else f"cuda:{device}"


def _check_header(header: ChunkHeader, expect: tuple, k: int) -> None:
    if (header.lane, header.seq, header.index) != tuple(expect):
        raise ProtocolError(f"slot {k} holds chunk {header.index} of write {header.seq} (lane {header.lane}), the "
                            f"notification names chunk {expect[2]} of write {expect[1]} (lane {expect[0]})")


class Staging:
    """``slots`` x ``slot_bytes`` of staging memory at :attr:`ptr` (host: ``device`` None)."""

    ptr: int
    device: Optional[int]

    def __init__(self, slots: int, slot_bytes: int):
        self.slots, self.slot_bytes = slots, slot_bytes

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def slot_ptr(self, k: int) -> int:
        return self.ptr + k * self.slot_bytes

    def adopt(self, *arrays) -> tuple:
        """A write's ``[n]`` arrays (sources, destinations, lengths) in the form this staging's
        copies take (host: as they are); a chunk passes slices of them."""
        return arrays

    def write_head(self, k: int, header: ChunkHeader, dst_offset, dst_region, length) -> None:
        """Header and row table (``[rows]`` each) at the head of slot ``k``."""
        head = np.zeros(data_start(header.rows), dtype=np.uint8)  # [header + table] host bytes
        header.write(head, dst_offset, dst_region, length)
        self._put(k, head)

    def read_head(self, k: int) -> tuple[ChunkHeader, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Header and row table of the chunk in slot ``k`` (ProtocolError for one that does not fit)."""
        header = ChunkHeader.parse(self._get(k, CHUNK_HEADER_BYTES), self.slot_bytes)
        return header, header.table(self._get(k, data_start(header.rows)))

    def land(self, k: int, expect: tuple, table) -> ChunkHeader:
        """Check the chunk in slot ``k`` and scatter it (the receiver's step). ``expect``: the
        (lane, write, chunk) its notification names; ``table``: the receiver's region table
        (``sizes``, ``ptr``, ``dev`` by region id). Every row must lie inside a registered
        region on this staging's memory, else :class:`ProtocolError` / ``ValueError`` naming the
        first bad row, and nothing of the chunk lands."""
        header, (dst_offset, dst_region, length) = self.read_head(k)
        _check_header(header, expect, k)
        bad = (length <= 0) | (dst_offset < 0) | (dst_region < 0)  # [rows]
        if bad.any():
            raise ProtocolError(f"row {int(np.argmax(bad))}: a negative region or offset, or a length <= 0")
        check_ranges(dst_region, dst_offset, length, table.sizes, "destination (this receiver)")
        if int(length.sum()) != header.nbytes:
            raise ProtocolError(f"rows of {int(length.sum())} bytes, the header says {header.nbytes}")
        if not (table.dev[dst_region] == (-1 if self.device is None else self.device)).all():
            raise ProtocolError(f"a row's region is not on the lane's memory ({_where(self.device)})")
        addr = table.ptr[dst_region].astype(np.int64) + dst_offset  # [rows] absolute destinations
        self.scatter(k, data_start(header.rows), addr, length)
        return header

    def gather(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        raise NotImplementedError

    def scatter(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        raise NotImplementedError

    def _put(self, k: int, head: np.ndarray) -> None:
        raise NotImplementedError

    def _get(self, k: int, n: int) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class HostStaging(Staging):
    device = None

    def __init__(self, slots: int, slot_bytes: int):
        super().__init__(slots, slot_bytes)
        self.buf = np.zeros(self.nbytes, dtype=np.uint8)  # [slots * slot_bytes], zeroed: pages exist
        self.ptr = self.buf.ctypes.data

    def _put(self, k: int, head: np.ndarray) -> None:
        at = k * self.slot_bytes
        self.buf[at: at + head.size] = head

    def _get(self, k: int, n: int) -> np.ndarray:
        at = k * self.slot_bytes
        return self.buf[at: at + n]

    def gather(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        out = self.buf[k * self.slot_bytes + at:]
        addr, length = _merged(addr, length)
        bounds = _runs(length)
        with _one_torch_thread():
            self._gather_runs(out, bounds, addr, length)

    @staticmethod
    def _gather_runs(out: np.ndarray, bounds: np.ndarray, addr: np.ndarray, length: np.ndarray) -> None:
        import torch

        for a, b in zip(bounds[:-1], bounds[1:]):
            row = int(length[a])
            base, span, elem = _window(addr[a:b], row, out.ctypes.data)
            dtype = np.int64 if elem == 8 else np.uint8
            src = torch.from_numpy(np.frombuffer(_raw(base, span), dtype=dtype))  # [span / elem]
            rows = src.as_strided(((span - row) // elem + 1, row // elem), (1, 1))  # [positions, row / elem]
            dst = torch.from_numpy(out[: (b - a) * row].view(dtype)).view(b - a, row // elem)  # [n, row / elem]
            torch.index_select(rows, 0, torch.from_numpy((addr[a:b] - base) // elem), out=dst)
            out = out[(b - a) * row:]

    def scatter(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        src = self.buf[k * self.slot_bytes + at:]
        addr, length = _merged(addr, length)
        bounds = _runs(length)
        for a, b in zip(bounds[:-1], bounds[1:]):
            row = int(length[a])
            base, span, elem = _window(addr[a:b], row, 0)
            void = np.dtype((np.void, row))
            dst = np.ndarray(((span - row) // elem + 1,), dtype=void, buffer=_raw(base, span), strides=(elem,))
            dst[(addr[a:b] - base) // elem] = src[: (b - a) * row].view(void)  # [n] rows of `row` bytes
            src = src[(b - a) * row:]


class KernelStaging(Staging):
    """Staging on one CUDA device (or "cpu": Triton's interpreter, tests)."""

    def __init__(self, slots: int, slot_bytes: int, device):
        import torch

        super().__init__(slots, slot_bytes)
        self._torch_device = torch.device(device)
        self.device = self._torch_device.index if self._torch_device.type == "cuda" else None
        self.buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self._torch_device)  # [slots * slot_bytes]
        self.ptr = self.buf.data_ptr()

    def _put(self, k: int, head: np.ndarray) -> None:
        import torch

        at = k * self.slot_bytes
        self.buf[at: at + head.size].copy_(torch.from_numpy(head))  # write_head waits for it

    def _get(self, k: int, n: int) -> np.ndarray:
        at = k * self.slot_bytes
        return self.buf[at: at + n].cpu().numpy()

    def adopt(self, *arrays) -> tuple:
        """``[n]`` int64 arrays of a write (sources, destinations, lengths) as tensors on this
        device, uploaded once per write: a chunk's tables are then slices of them, built here."""
        import torch

        return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self._torch_device) for a in arrays)

    def _tensor(self, a):
        import torch

        return a if isinstance(a, torch.Tensor) else self.adopt(a)[0]

    def write_head(self, k: int, header: ChunkHeader, dst_offset, dst_region, length) -> None:
        """The header from the host, the row table copied here from the write's adopted arrays."""
        import torch

        self._put(k, header.pack())
        n, at = header.rows, k * self.slot_bytes + CHUNK_HEADER_BYTES
        self.buf[at: at + 8 * n].view(torch.int64).copy_(self._tensor(dst_offset))
        self.buf[at + 8 * n: at + 12 * n].view(torch.int32).copy_(self._tensor(dst_region))
        self.buf[at + 12 * n: at + 16 * n].view(torch.int32).copy_(self._tensor(length))
        if self._torch_device.type == "cuda":  # in place before NIXL reads the slot
            torch.cuda.synchronize(self._torch_device)

    def land(self, k: int, expect: tuple, table) -> ChunkHeader:
        """:meth:`Staging.land` with the rows read, checked and made into the kernel's row table
        on the device: the host reads the 64-byte header and a few scalars, never the rows (a
        chunk that fails a check goes through the host path, which names the first bad row)."""
        import torch

        header = ChunkHeader.parse(self._get(k, CHUNK_HEADER_BYTES), self.slot_bytes)
        _check_header(header, expect, k)
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
        self._copy(k, at, self._tensor(addr), self._tensor(length), gather=True)

    def scatter(self, k: int, at: int, addr, length) -> None:
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
        mode at staging address ``stage_at``; return once its bytes are in place."""
        import torch

        from transport.nvlink.kernel import KernelConfig, Stage, StageMode, plan_launch, scatter_rows

        plan = plan_launch(int(rows.shape[1]), longest, path, KernelConfig())
        stage = Stage(StageMode.GATHER if gather else StageMode.SCATTER, stage_at, 0)
        if self._torch_device.type == "cuda":
            with torch.cuda.device(self._torch_device):
                stream = torch.cuda.current_stream()
                scatter_rows(rows, plan, self._torch_device, stage=stage, stream=stream)
                stream.synchronize()  # the bytes are in place before NIXL reads them / the notification
        else:
            scatter_rows(rows, plan, "cpu", stage=stage)


def make_staging(slots: int, slot_bytes: int, device: Optional[int]) -> Staging:
    """Host staging (``device`` None) or staging on CUDA ``device``."""
    if device is None:
        return HostStaging(slots, slot_bytes)
    return KernelStaging(slots, slot_bytes, f"cuda:{device}")
