"""The staged mode's messages and the layout of a chunk in its staging slot.

Messages ride NIXL notifications (a write's ``notify`` or ``send_notif``). Each is one frozen
dataclass, encoded as :data:`MAGIC` + msgpack ``[kind, [fields...]]``; a payload that does not
start with :data:`MAGIC` is an owner's notification and passes through untouched (so owners
may not send payloads that start with it: ``NixlPeer.write`` refuses them).

A chunk in a staging slot (``[slot_bytes]``, written by one NIXL write)::

    [0, 64)                       header: b"KVTSTG01", lane, seq, index, rows, nbytes (<8s5q, zero padded)
    [64, 64 + 8 * rows)           destination offsets   # [rows] int64
    [.., + 4 * rows)              destination regions   # [rows] int32
    [.., + 4 * rows)              lengths               # [rows] int32
    [data_start(rows), + nbytes)  the rows' bytes, back to back, data_start 64-byte aligned

A chunk of a strided write (``NixlPeer.write_strided``: ``P`` buffer pairs x ``S`` slots, rows
pair-major, row ``r = p * S + s``) is self-contained: every chunk of the write carries the
write's whole destination table (the receiver reads and checks it once per write)::

    [0, 128)                      header: b"KVTSTR01", lane, seq, index, chunks, begin, end, nbytes,
                                  pairs, slots (<8s9q, zero padded): rows [begin, end) of the write
    [128, + 32 * P)               destination pairs   # [4, P] int64: region, offset, stride, length
    [.., + 8 * S)                 destination slots   # [S] int64
    [strided_data_start(P, S), + nbytes)  rows begin..end-1, back to back, 64-byte aligned start

Row ``r``'s bytes sit at ``off(r) - off(begin)`` in the data, ``off(p * S + s) =
sum(length[:p]) * S + s * length[p]`` (the NVLink kernel's staging offsets,
:mod:`transport.nvlink.kernel`, "Staged copies").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from transport import notif_frames as frames
from transport.batch import check_strided_side
from transport.nixl.staged.config import CHUNK_HEADER_BYTES, ROW_TABLE_BYTES

__all__ = ["MAGIC", "Hello", "Welcome", "Chunk", "StridedChunk", "Credit", "encode", "decode", "ChunkHeader", "data_start",
           "ProtocolError", "StridedHeader", "DestinationTable", "strided_data_start", "strided_fits",
           "STRIDED_HEADER_BYTES", "registered_entries"]

MAGIC = b"\x00kvt-staged\x01"
_HEADER = struct.Struct("<8s5q")
_HEADER_MAGIC = b"KVTSTG01"
_STRIDED = struct.Struct("<8s9q")
_STRIDED_MAGIC = b"KVTSTR01"
STRIDED_HEADER_BYTES = 128
MAX_TABLE_ENTRIES = 1 << 28  # pairs or slots a strided header may claim (a slot bounds them far below)


class ProtocolError(ValueError):
    """A staged message or chunk that cannot be trusted (what was expected, what arrived)."""


@dataclass(frozen=True)
class Hello:
    """Sender -> receiver: open lane ``lane`` of ``slots`` x ``slot_bytes`` on the receiver's
    ``device`` (-1: host); ``metadata`` lets the receiver answer (its NIXL agent metadata);
    ``registered``: what that metadata registers (:func:`registered_entries`); ``host``: the
    sender's :func:`~transport.nixl.staged.shared.host_key` when it would share the receiver's
    host slots ("": it would not)."""

    lane: int
    device: int
    slots: int
    slot_bytes: int
    metadata: bytes
    registered: tuple = ()
    host: str = ""


@dataclass(frozen=True)
class Welcome:
    """Receiver -> sender: lane ``lane``'s staging region at ``ptr`` (``slots`` x ``slot_bytes``)
    and the receiver's metadata that registers it, with what that metadata registers
    (``registered``, :func:`registered_entries`); or ``error`` (the sender writes direct).
    ``shared``: ``(pid, fd)`` of the memfd holding the staging, for a sender on this host
    (:mod:`~transport.nixl.staged.shared`; empty: not shared)."""

    lane: int
    ptr: int
    metadata: bytes
    error: str = ""
    registered: tuple = ()
    shared: tuple = ()


def registered_entries(registered) -> list[tuple[int, int, int, int]]:
    """A Hello's or Welcome's ``registered``: ``(region id, address, length, device)`` of each
    range the NIXL metadata it carries registers (region id -1: a staging lane's memory; device
    -1: host), which the loading side records as given to NIXL for that agent (NIXL keeps every
    entry it was given: ``transport.nixl``, stale entries). :class:`ProtocolError` for a
    malformed list."""
    out = []
    try:
        for entry in registered:
            rid, ptr, length, device = entry
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in entry) or ptr <= 0 or length <= 0:
                raise ValueError(f"entry {entry!r:.80}")
            out.append((rid, ptr, length, device))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"a list of registered ranges that does not decode: {exc}") from None
    return out


@dataclass(frozen=True)
class Chunk:
    """Sender -> receiver, carried by the chunk's write: slot ``slot`` holds chunk ``index`` of
    the ``chunks`` of write ``seq``; ``notify`` (on the last chunk, if any) goes to the owner
    once every chunk of the write is scattered (whatever order the chunks arrive in)."""

    lane: int
    seq: int
    index: int
    chunks: int
    slot: int
    notify: Optional[bytes]


@dataclass(frozen=True)
class StridedChunk(Chunk):
    """:class:`Chunk` of a strided write: the slot holds a strided chunk (header
    :class:`StridedHeader`, the write's :class:`DestinationTable`, rows)."""


@dataclass(frozen=True)
class Credit:
    """Receiver -> sender: slot ``slot`` (chunk ``index`` of ``seq``) is scattered and free;
    ``error``: the chunk was refused (nothing of it landed)."""

    lane: int
    seq: int
    index: int
    slot: int
    error: str = ""


Message = Union[Hello, Welcome, Chunk, StridedChunk, Credit]
_KINDS = (Hello, Welcome, Chunk, Credit, StridedChunk)


def encode(msg: Message) -> bytes:
    return frames.encode(MAGIC, _KINDS, msg)


def decode(payload: bytes) -> Optional[Message]:
    """The message in ``payload``, None for an owner's notification; :class:`ProtocolError`
    for a staged payload that does not decode."""
    return frames.decode(MAGIC, _KINDS, payload, ProtocolError, "staged message")


def data_start(rows: int) -> int:
    """Offset of the rows' bytes in a chunk of ``rows`` rows."""
    return -(-(CHUNK_HEADER_BYTES + ROW_TABLE_BYTES * rows) // 64) * 64


@dataclass(frozen=True)
class ChunkHeader:
    lane: int
    seq: int
    index: int
    rows: int
    nbytes: int

    def pack(self) -> np.ndarray:
        """The ``[64]`` uint8 header."""
        head = np.zeros(CHUNK_HEADER_BYTES, dtype=np.uint8)
        _HEADER.pack_into(head, 0, _HEADER_MAGIC, self.lane, self.seq, self.index, self.rows, self.nbytes)
        return head

    def write(self, slot: np.ndarray, dst_offset: np.ndarray, dst_region: np.ndarray, length: np.ndarray) -> None:
        """Header and row table into the head of ``slot`` (a ``[slot_bytes]`` uint8 host view)."""
        n = self.rows
        slot[:CHUNK_HEADER_BYTES] = self.pack()
        at = CHUNK_HEADER_BYTES
        slot[at: at + 8 * n].view(np.int64)[:] = dst_offset
        slot[at + 8 * n: at + 12 * n].view(np.int32)[:] = dst_region
        slot[at + 12 * n: at + 16 * n].view(np.int32)[:] = length

    @classmethod
    def parse(cls, head: np.ndarray, slot_bytes: int) -> "ChunkHeader":
        """The header in the first 64 bytes of ``head``; :class:`ProtocolError` when it is not a
        chunk header or its chunk does not fit a ``slot_bytes`` slot."""
        magic, lane, seq, index, rows, nbytes = _HEADER.unpack_from(head, 0)
        if magic != _HEADER_MAGIC:
            raise ProtocolError(f"staging slot starts with {magic!r}, expected {_HEADER_MAGIC!r}")
        if rows <= 0 or nbytes <= 0 or data_start(rows) + nbytes > slot_bytes:
            raise ProtocolError(f"chunk of {rows} rows and {nbytes} bytes does not fit a {slot_bytes}-byte slot")
        return cls(lane, seq, index, rows, nbytes)

    def table(self, head: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The row table ``(dst_offset, dst_region, length)`` (``[rows]`` int64 copies) from
        ``head``, the slot's first :func:`data_start` bytes."""
        at, n = CHUNK_HEADER_BYTES, self.rows
        return (head[at: at + 8 * n].view(np.int64).astype(np.int64),
                head[at + 8 * n: at + 12 * n].view(np.int32).astype(np.int64),
                head[at + 12 * n: at + 16 * n].view(np.int32).astype(np.int64))


def strided_data_start(pairs: int, slots: int) -> int:
    """Offset of the rows' bytes in a strided chunk of a ``pairs`` x ``slots`` write."""
    return -(-(STRIDED_HEADER_BYTES + 32 * pairs + 8 * slots) // 64) * 64


def strided_fits(pairs: int, slots: int, longest: int, slot_bytes: int) -> bool:
    """Whether a ``pairs`` x ``slots`` write goes through ``slot_bytes`` slots: its head
    (header and destination table) takes at most a quarter of a slot (the rest carries rows),
    and a slot holds the head and one row of ``longest`` bytes."""
    head = strided_data_start(pairs, slots)
    return 4 * head <= slot_bytes and head + longest <= slot_bytes


def _peek(head: np.ndarray, fmt: struct.Struct, what: str) -> tuple:
    if head.size < fmt.size:
        raise ProtocolError(f"{what} of {head.size} bytes, expected at least {fmt.size}")
    return fmt.unpack_from(head, 0)


def is_strided(head: np.ndarray) -> bool:
    """Whether the slot starting with ``head`` (its first 8 bytes at least) holds a strided chunk."""
    return bytes(head[:8]) == _STRIDED_MAGIC


@dataclass(frozen=True)
class StridedHeader:
    """The header of a strided chunk (module doc): rows ``[begin, end)`` of write ``seq``
    (``pairs`` x ``slots``), ``nbytes`` bytes of them; chunk ``index`` of ``chunks``."""

    lane: int
    seq: int
    index: int
    chunks: int
    begin: int
    end: int
    nbytes: int
    pairs: int
    slots: int

    @property
    def data_start(self) -> int:
        return strided_data_start(self.pairs, self.slots)

    def pack(self) -> np.ndarray:
        """The ``[128]`` uint8 header."""
        head = np.zeros(STRIDED_HEADER_BYTES, dtype=np.uint8)
        _STRIDED.pack_into(head, 0, _STRIDED_MAGIC, self.lane, self.seq, self.index, self.chunks, self.begin,
                           self.end, self.nbytes, self.pairs, self.slots)
        return head

    @classmethod
    def parse(cls, head: np.ndarray, slot_bytes: int) -> "StridedHeader":
        """The header in the first 128 bytes of ``head``; :class:`ProtocolError` when it is not a
        strided header, its numbers are inconsistent, or its chunk does not fit a slot."""
        magic, *values = _peek(head, _STRIDED, "strided chunk header")
        if magic != _STRIDED_MAGIC:
            raise ProtocolError(f"staging slot starts with {magic!r}, expected {_STRIDED_MAGIC!r}")
        h = cls(*values)
        if not (0 < h.pairs <= MAX_TABLE_ENTRIES and 0 < h.slots <= MAX_TABLE_ENTRIES):
            raise ProtocolError(f"a strided write of {h.pairs} pairs x {h.slots} slots")
        if not 0 <= h.index < h.chunks or not 0 <= h.begin < h.end <= h.pairs * h.slots:
            raise ProtocolError(f"chunk {h.index} of {h.chunks} holding rows [{h.begin}, {h.end}) of a "
                                f"{h.pairs} x {h.slots} write")
        if h.nbytes <= 0 or h.data_start + h.nbytes > slot_bytes:
            raise ProtocolError(f"strided chunk of {h.pairs} pairs x {h.slots} slots and {h.nbytes} bytes "
                                f"does not fit a {slot_bytes}-byte slot")
        return h

    def same_write(self, other: "StridedHeader") -> bool:
        """Whether ``other`` names the same write (lane, seq, shape, chunk count)."""
        return (self.lane, self.seq, self.chunks, self.pairs, self.slots) == (
            other.lane, other.seq, other.chunks, other.pairs, other.slots)


@dataclass(frozen=True, eq=False)
class DestinationTable:
    """The destination side of a strided write, as its chunks carry it (module doc)."""

    region: np.ndarray  # [P] the receiver's region ids
    offset: np.ndarray  # [P] bytes from the region's start to slot 0's row
    stride: np.ndarray  # [P] bytes between slots
    length: np.ndarray  # [P] bytes per row
    slot: np.ndarray  # [S] destination slot of each column

    @property
    def pairs(self) -> int:
        return int(self.length.size)

    @property
    def slots(self) -> int:
        return int(self.slot.size)

    def pack(self) -> np.ndarray:
        """The ``[32 * P + 8 * S]`` uint8 bytes that follow the header."""
        out = np.empty(4 * self.pairs + self.slots, dtype=np.int64)  # [4 P + S]
        out[: 4 * self.pairs].reshape(4, self.pairs)[:] = (self.region, self.offset, self.stride, self.length)
        out[4 * self.pairs:] = self.slot
        return out.view(np.uint8)

    @classmethod
    def parse(cls, head: np.ndarray, header: StridedHeader) -> "DestinationTable":
        """The table from ``head`` (at least the slot's first ``header.data_start`` bytes), as
        int64 copies; :class:`ProtocolError` for negative numbers, lengths <= 0, or rows
        ``[begin, end)`` whose bytes are not the header's count. Regions are checked by the
        receiver (:meth:`check`)."""
        p, n = header.pairs, header.slots
        if head.size < STRIDED_HEADER_BYTES + 32 * p + 8 * n:
            raise ProtocolError(f"strided chunk head of {head.size} bytes, its table needs "
                                f"{STRIDED_HEADER_BYTES + 32 * p + 8 * n}")
        body = head[STRIDED_HEADER_BYTES: STRIDED_HEADER_BYTES + 32 * p + 8 * n].view(np.int64).copy()
        pairs = body[: 4 * p].reshape(4, p)  # [4, P]
        t = cls(pairs[0], pairs[1], pairs[2], pairs[3], body[4 * p:])
        if (body < 0).any():
            raise ProtocolError("a strided chunk's destination table holds a negative region, offset, stride "
                                "or slot")
        if not (t.length > 0).all():
            raise ProtocolError(f"pair {int(np.argmax(t.length <= 0))} of a strided chunk's destination table "
                                "has length 0")
        want = t.bytes_between(header.begin, header.end)
        if want != header.nbytes:
            raise ProtocolError(f"rows [{header.begin}, {header.end}) hold {want} bytes, the header says "
                                f"{header.nbytes}")
        return t

    def offset_of(self, row: int) -> int:
        """``off(row)`` (module doc); ``row`` in ``[0, P * S]``."""
        p, s = divmod(int(row), self.slots)
        before = sum(self.length[:p].tolist()) * self.slots  # Python ints: no wrap-around for a hostile table
        return before if p == self.pairs else before + s * int(self.length[p])

    def bytes_between(self, begin: int, end: int) -> int:
        return self.offset_of(end) - self.offset_of(begin)

    def check(self, table, device) -> None:
        """Every row of the write inside a region of ``table`` (the receiver's region table:
        ``sizes``, ``dev`` by id) on ``device`` (None: host), in O(P + S): per pair, the end of
        its furthest slot ``offset + max(slot) * stride + length``. ``ValueError`` (from the
        bounds check, naming the first bad pair) or :class:`ProtocolError`."""
        check_strided_side(self.region, self.offset, self.stride, self.length, self.slot, table.sizes,
                           "destination (this receiver)", overflow=ProtocolError)
        if not (table.dev[self.region] == (-1 if device is None else device)).all():
            raise ProtocolError(f"a destination pair's region is not on the lane's memory "
                                f"({'host' if device is None else f'cuda:{device}'})")
