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

from transport.nixl_staged.wire import ChunkHeader, data_start
from transport.nixl_staged.config import CHUNK_HEADER_BYTES

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

    def _head(self, rows: int) -> np.ndarray:
        return np.zeros(data_start(rows), dtype=np.uint8)  # [header + table] host bytes

    def write_head(self, k: int, header: ChunkHeader, dst_offset, dst_region, length) -> None:
        head = self._head(header.rows)
        header.write(head, dst_offset, dst_region, length)
        self._put(k, head)

    def read_head(self, k: int) -> tuple[ChunkHeader, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Header and row table of the chunk in slot ``k`` (ProtocolError for one that does not fit)."""
        header = ChunkHeader.parse(self._get(k, CHUNK_HEADER_BYTES), self.slot_bytes)
        return header, header.table(self._get(k, data_start(header.rows)))

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
        self.buf[at: at + head.size].copy_(torch.from_numpy(head))
        if self._torch_device.type == "cuda":  # a pageable copy may still be in flight on return
            torch.cuda.synchronize(self._torch_device)

    def _get(self, k: int, n: int) -> np.ndarray:
        at = k * self.slot_bytes
        return self.buf[at: at + n].cpu().numpy()

    def _launch(self, k: int, at: int, addr: np.ndarray, length: np.ndarray, gather: bool) -> None:
        import torch

        from transport.nvlink.kernel import KernelConfig, Stage, StageMode, choose_path, plan_launch, scatter_rows

        n = int(length.size)
        rows = np.zeros((4, n), dtype=np.int64)  # [4, rows]: source, destination, bytes, staging offset
        rows[0 if gather else 1] = addr
        rows[2] = length
        np.cumsum(length[:-1], out=rows[3, 1:])
        stage_at = self.slot_ptr(k) + at
        path = choose_path(np.concatenate([rows.ravel(), [stage_at]]))
        plan = plan_launch(n, int(length.max()), path, KernelConfig())
        table = torch.from_numpy(rows).to(self._torch_device)
        mode = StageMode.GATHER if gather else StageMode.SCATTER
        if self._torch_device.type == "cuda":
            with torch.cuda.device(self._torch_device):
                stream = torch.cuda.current_stream()
                scatter_rows(table, plan, self._torch_device, stage=Stage(mode, stage_at, 0), stream=stream)
                stream.synchronize()  # the bytes are in place before NIXL reads them / the notification
        else:
            scatter_rows(table, plan, "cpu", stage=Stage(mode, stage_at, 0))

    def gather(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        self._launch(k, at, addr, length, gather=True)

    def scatter(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        self._launch(k, at, addr, length, gather=False)


def make_staging(slots: int, slot_bytes: int, device: Optional[int]) -> Staging:
    """Host staging (``device`` None) or staging on CUDA ``device``."""
    if device is None:
        return HostStaging(slots, slot_bytes)
    return KernelStaging(slots, slot_bytes, f"cuda:{device}")
