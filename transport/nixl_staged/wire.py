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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from transport import notif_frames as frames
from transport.nixl_staged.config import CHUNK_HEADER_BYTES, ROW_TABLE_BYTES

__all__ = ["MAGIC", "Hello", "Welcome", "Chunk", "Credit", "encode", "decode", "ChunkHeader", "data_start",
           "ProtocolError"]

MAGIC = b"\x00kvt-staged\x01"
_HEADER = struct.Struct("<8s5q")
_HEADER_MAGIC = b"KVTSTG01"


class ProtocolError(ValueError):
    """A staged message or chunk that cannot be trusted (what was expected, what arrived)."""


@dataclass(frozen=True)
class Hello:
    """Sender -> receiver: open lane ``lane`` of ``slots`` x ``slot_bytes`` on the receiver's
    ``device`` (-1: host); ``metadata`` lets the receiver answer (its NIXL agent metadata)."""

    lane: int
    device: int
    slots: int
    slot_bytes: int
    metadata: bytes


@dataclass(frozen=True)
class Welcome:
    """Receiver -> sender: lane ``lane``'s staging region at ``ptr`` (``slots`` x ``slot_bytes``)
    and the receiver's metadata that registers it; or ``error`` (the sender writes direct)."""

    lane: int
    ptr: int
    metadata: bytes
    error: str = ""


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
class Credit:
    """Receiver -> sender: slot ``slot`` (chunk ``index`` of ``seq``) is scattered and free;
    ``error``: the chunk was refused (nothing of it landed)."""

    lane: int
    seq: int
    index: int
    slot: int
    error: str = ""


Message = Union[Hello, Welcome, Chunk, Credit]
_KINDS = (Hello, Welcome, Chunk, Credit)


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
