"""Staging memory of one lane side, and the copies between it and registered memory.

A :class:`Staging` is ``slots`` slots of ``slot_bytes`` (one chunk each:
:mod:`~transport.nixl.staged.wire`):

- :class:`HostStaging`: a numpy buffer. ``gather`` copies rows of equal length with ONE
  ``torch.index_select`` per run of equal lengths (the rows' memory seen as a 2-D
  ``[positions, row]`` view of the address window they span, a row index per row), ``scatter``
  with one numpy fancy assignment through the same kind of window (rows as one ``void``
  element each). Both run in C, no Python loop per row (bench/RESULTS.md for their rates).
- :class:`~transport.nixl.staged.kernel.KernelStaging`: a torch buffer on a CUDA device.
  ``gather`` / ``scatter`` are one launch of the NVLink backend's row kernel in its staged
  modes (:mod:`transport.nvlink.kernel`, "Staged copies": ``Stage(GATHER | SCATTER, slot address, 0)`` over a ``[4, rows]`` row
  table), queued on the staging's own stream: the sender waits for a slot's copies (its event,
  :meth:`Staging.ready`) before NIXL reads it, the receiver marks a scatter :meth:`Staging.queued`
  and answers (Credit, notification) once :meth:`Staging.is_ready` says its bytes are in place,
  handling the next chunk meanwhile (:mod:`~transport.nixl.staged.receiver`). ``device="cpu"``
  runs the same kernel in Triton's interpreter (tests).

Rows are given as absolute addresses (``[rows]`` int64) and lengths (``[rows]`` int64); the
caller has checked them against its registered regions.

Strided writes (:mod:`~transport.nixl.staged.wire`, "strided chunk") name one side of their rows
as a :class:`StridedRows`: per pair the address of slot 0, the stride and the row length
(``[P]`` each), per column the slot (``[S]``); row ``p * S + s`` is ``length[p]`` bytes at
``addr[p] + slot[s] * stride[p]``, and sits in the staging at its offset ``off(r)`` (pair-major,
back to back). ``gather_strided`` / ``scatter_strided`` copy rows ``[begin, end)`` of it:

- host: a range of few slots per pair (at most :data:`FLAT_SLOTS` on average: a small
  request's, or a TP change's head slices) as flat rows, through the same one-step copies as
  ``gather`` / ``scatter``; else one vectorised copy per pair part in the range (the rows of
  one pair are one strided ``[positions, row]`` view of the memory they span, indexed by
  slot): O(pairs) Python steps;
- CUDA: ONE launch of the NVLink strided kernel in its staged mode (``scatter_strided`` with
  ``Stage(GATHER | SCATTER, slot address, off(begin))``) over the write's strided table,
  uploaded once per write, on this staging's stream; a slot's event (not the device) is waited
  for before NIXL reads the slot or the notification goes out.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Optional

import numpy as np

from transport.batch import check_ranges
from transport.nixl.staged.config import CHUNK_HEADER_BYTES
from transport.nixl.staged.wire import (STRIDED_HEADER_BYTES, ChunkHeader, DestinationTable, ProtocolError,
                                        StridedHeader, data_start)

__all__ = ["Staging", "HostStaging", "StridedRows", "Landed", "check_header", "make_staging"]

# Up to this many slots per pair, a host copy of strided rows expands them to flat rows (a few
# numpy passes over the rows) and copies them in one step per row length; past it, one view per
# pair (tens of microseconds of Python and torch calls each) costs less than the expansion.
FLAT_SLOTS = 1024


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


def check_header(header: ChunkHeader, expect: tuple, k: int) -> None:
    if (header.lane, header.seq, header.index) != tuple(expect):
        raise ProtocolError(f"slot {k} holds chunk {header.index} of write {header.seq} (lane {header.lane}), the "
                            f"notification names chunk {expect[2]} of write {expect[1]} (lane {expect[0]})")


class StridedRows:
    """One side of a strided write's rows (module doc), as numpy arrays on the host; a
    :class:`~transport.nixl.staged.kernel.KernelStaging` adds its device table (``table``) and copy path bits (``bits``)."""

    def __init__(self, addr: np.ndarray, stride: np.ndarray, length: np.ndarray, slot: np.ndarray):
        self.addr, self.stride, self.length, self.slot = addr, stride, length, slot  # [P] x 3, [S]
        self.pairs, self.slots = int(length.size), int(slot.size)
        self.pair_offset = np.zeros(self.pairs, dtype=np.int64)  # [P] off(p * S)
        np.cumsum(length[:-1] * self.slots, out=self.pair_offset[1:])
        self.table = None  # the device table (kernel staging)
        self.bits = 0  # OR of every address, stride, length and pair offset (the kernel staging's copy path)

    def offset_of(self, row: int) -> int:
        """``off(row)``, the staging offset of row ``row`` in ``[0, P * S]``."""
        p, s = divmod(int(row), self.slots)
        if p == self.pairs:
            return int(self.pair_offset[-1] + self.length[-1] * self.slots)
        return int(self.pair_offset[p]) + s * int(self.length[p])

    def few_slots(self, begin: int, end: int) -> bool:
        """Rows ``[begin, end)`` hold at most :data:`FLAT_SLOTS` slots per pair on average: a
        host copy then takes them as flat rows (:meth:`flat`), one step for the whole range,
        rather than one per pair part."""
        pairs = (end - 1) // self.slots - begin // self.slots + 1
        return end - begin <= FLAT_SLOTS * pairs

    def flat(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """``(addr, length)`` of rows ``[begin, end)`` (``[end - begin]`` each), in staging order."""
        pair, slot = np.divmod(np.arange(begin, end, dtype=np.int64), self.slots)  # [rows] each
        return self.addr[pair] + self.slot[slot] * self.stride[pair], self.length[pair]

    def parts(self, begin: int, end: int):
        """``(pair, first slot, end slot, staging offset from off(begin))`` of each pair part of rows
        ``[begin, end)``: one step per pair in the range."""
        origin = self.offset_of(begin)
        for p in range(begin // self.slots, (end - 1) // self.slots + 1):
            s0 = max(begin - p * self.slots, 0)
            s1 = min(end - p * self.slots, self.slots)
            yield p, s0, s1, int(self.pair_offset[p]) + s0 * int(self.length[p]) - origin


class Landed:
    """What a receiver keeps of a strided write after its first chunk (the header that brought
    the table, the rows as this staging copies them, and the region table they were checked
    against), so later chunks read only their header while the receiver's regions stay as
    they were."""

    def __init__(self, header: StridedHeader, rows: StridedRows, regions):
        self.header, self.rows, self.regions = header, rows, regions


def _pair_view(base: int, stride: int, row: int, positions: int, elem: int):
    """``[positions, row / elem]`` torch view of rows of ``row`` bytes every ``stride`` bytes from ``base``."""
    import torch

    span = (positions - 1) * stride + row
    dtype = np.int64 if elem == 8 else np.uint8
    flat = torch.from_numpy(np.frombuffer(_raw(base, span), dtype=dtype))  # [span / elem]
    return flat.as_strided((positions, row // elem), (stride // elem, 1))


class Staging:
    """``slots`` x ``slot_bytes`` of staging memory at :attr:`ptr` (host: ``device`` None)."""

    ptr: int
    device: Optional[int]
    shared: tuple = ()  # how a sender on this host maps this memory (a Welcome's ``shared``); empty: it cannot

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
        check_header(header, expect, k)
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

    # -- strided writes (module doc) -------------------------------------------------------------

    def strided_rows(self, addr, stride, length, slot) -> StridedRows:
        """A strided write's side (``[P]`` x 3, ``[S]`` int64) as this staging copies it (host:
        as it is; CUDA: its table uploaded, once per write)."""
        return StridedRows(addr, stride, length, slot)

    def strided_table(self, table: np.ndarray):
        """A strided write's destination table bytes (``[32 P + 8 S]`` uint8, what every chunk
        carries) as :meth:`write_strided_head` takes them (uploaded once per write on a GPU)."""
        return table

    def write_strided_head(self, k: int, header: StridedHeader, table) -> None:
        """Header and destination table (from :meth:`strided_table`) at the head of slot ``k``."""
        self._put(k, header.pack())
        self._put(k, table, STRIDED_HEADER_BYTES)

    def land_strided(self, k: int, expect: tuple, chunks: int, table,
                     known: Optional[Landed]) -> tuple[StridedHeader, Landed]:
        """Check the strided chunk in slot ``k`` and scatter it (the receiver's step). ``expect``:
        the (lane, write, chunk) its notification names, ``chunks`` the write's chunk count it
        names; ``table``: the receiver's region table
        (``sizes``, ``ptr``, ``dev`` by id); ``known``: what the write's earlier chunk left (None:
        this is its first chunk here). The destination table is read and checked only when
        ``known`` is not of this write, or the receiver's regions changed since it was checked
        (``table`` is another object: a region deregistered mid-write is not written): every
        pair inside a registered region on this staging's memory for its furthest slot, else
        :class:`ProtocolError` / ``ValueError`` and nothing of the chunk lands. Returns the
        header and what later chunks of the write reuse."""
        header = StridedHeader.parse(self._get(k, STRIDED_HEADER_BYTES), self.slot_bytes)
        check_header(header, expect, k)
        if header.chunks != chunks:
            raise ProtocolError(f"slot {k} holds a chunk of a {header.chunks}-chunk write, the notification says "
                                f"{chunks} chunks")
        if known is None or not known.header.same_write(header) or known.regions is not table:
            dest = DestinationTable.parse(self._get(k, header.data_start), header)
            dest.check(table, self.device)
            addr = table.ptr[dest.region].astype(np.int64) + dest.offset  # [P] slot 0 of each pair
            known = Landed(header, self.strided_rows(addr, dest.stride, dest.length, dest.slot), table)
        else:
            nbytes = known.rows.offset_of(header.end) - known.rows.offset_of(header.begin)
            if nbytes != header.nbytes:
                raise ProtocolError(f"rows [{header.begin}, {header.end}) hold {nbytes} bytes, the header says "
                                    f"{header.nbytes}")
        self.scatter_strided(k, header.data_start, known.rows, header.begin, header.end)
        return header, known

    def gather_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int) -> None:
        """Rows ``[begin, end)`` of ``rows`` into slot ``k`` from byte ``at``, back to back (may
        be queued: :meth:`queued` then :meth:`ready` before the slot is read)."""
        raise NotImplementedError

    def stage_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int, header: StridedHeader,
                      table) -> None:
        """A strided chunk into slot ``k`` (the sender's step): rows ``[begin, end)`` of ``rows``
        from byte ``at``, the header and the destination table at its head, all of it
        :meth:`queued` for ``k``."""
        self.gather_strided(k, at, rows, begin, end)
        self.write_strided_head(k, header, table)
        self.queued(k)

    def queued(self, k: int) -> None:
        """What was queued for slot ``k`` so far (its gather, its head) is what :meth:`is_ready`
        and :meth:`ready` of ``k`` wait for (host: the copies are already done)."""

    def is_ready(self, k: int) -> bool:
        """The copies :meth:`queued` for slot ``k`` are in place (never blocks)."""
        return True

    def ready(self, k: Optional[int] = None) -> None:
        """Return once the copies :meth:`queued` for slot ``k`` (None: every copy queued into
        the slots) are in place (host: they already are)."""

    def scatter_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int) -> None:
        """Slot ``k``'s bytes from ``at`` out to rows ``[begin, end)`` of ``rows`` (may be queued:
        :meth:`queued` then :meth:`is_ready` / :meth:`ready` before the bytes are read)."""
        raise NotImplementedError

    def gather(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        raise NotImplementedError

    def scatter(self, k: int, at: int, addr: np.ndarray, length: np.ndarray) -> None:
        raise NotImplementedError

    def _put(self, k: int, head, at: int = 0) -> None:
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

    def _put(self, k: int, head: np.ndarray, at: int = 0) -> None:
        at += k * self.slot_bytes
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


    def gather_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int) -> None:
        import torch

        if rows.few_slots(begin, end):
            self.gather(k, at, *rows.flat(begin, end))
            return
        out = self.buf[k * self.slot_bytes + at:]
        with _one_torch_thread():
            for p, s0, s1, o in rows.parts(begin, end):
                row, stride, slot = int(rows.length[p]), int(rows.stride[p]), rows.slot[s0:s1]
                low = int(slot.min())
                base = int(rows.addr[p]) + low * stride
                elem = 8 if not (base | stride | row | (out.ctypes.data + o)) & 7 else 1
                src = _pair_view(base, stride, row, int(slot.max()) - low + 1, elem)  # [positions, row / elem]
                dst = out[o: o + (s1 - s0) * row].view(np.int64 if elem == 8 else np.uint8)
                torch.index_select(src, 0, torch.from_numpy(slot - low), out=torch.from_numpy(dst).view(s1 - s0, -1))

    def scatter_strided(self, k: int, at: int, rows: StridedRows, begin: int, end: int) -> None:
        if rows.few_slots(begin, end):
            self.scatter(k, at, *rows.flat(begin, end))
            return
        src = self.buf[k * self.slot_bytes + at:]
        for p, s0, s1, o in rows.parts(begin, end):
            row, stride, slot = int(rows.length[p]), int(rows.stride[p]), rows.slot[s0:s1]
            low = int(slot.min())
            positions = int(slot.max()) - low + 1
            base = int(rows.addr[p]) + low * stride
            void = np.dtype((np.void, row))
            dst = np.ndarray((positions,), dtype=void, buffer=_raw(base, (positions - 1) * stride + row),
                             strides=(stride,))  # [positions] rows of `row` bytes
            dst[slot - low] = src[o: o + (s1 - s0) * row].view(void)


def make_staging(slots: int, slot_bytes: int, device: Optional[int]) -> Staging:
    """Host staging (``device`` None) or staging on CUDA ``device``."""
    if device is None:
        return HostStaging(slots, slot_bytes)
    from transport.nixl.staged.kernel import KernelStaging  # imports torch and Triton

    return KernelStaging(slots, slot_bytes, f"cuda:{device}")
