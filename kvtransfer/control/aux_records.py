"""Decode's aux records: one small host record per request in flight, written by the
notification that completes the request (the first output token and its logprob).

:class:`AuxRecords` hands out fixed-size records of one host buffer; prefill packs the first
token with :func:`pack_first_token`, decode reads it with :func:`unpack_first_token`.
"""

from __future__ import annotations

import struct
import threading
from typing import Optional

import numpy as np

__all__ = ["AUX_RECORD_BYTES", "AuxRecords", "pack_first_token", "unpack_first_token"]

AUX_RECORD_BYTES = 16  # one aux record: first output token id (int64) and its logprob (float64)
_FIRST_TOKEN = struct.Struct("<qd")


def pack_first_token(token_id: int, logprob: float) -> bytes:
    """The aux record prefill sends with a request's last chunk."""
    return _FIRST_TOKEN.pack(int(token_id), float(logprob))


def unpack_first_token(record: bytes) -> tuple:
    """``(token_id, logprob)`` from an aux record."""
    return _FIRST_TOKEN.unpack(bytes(record[:_FIRST_TOKEN.size]))


class AuxRecords:
    """``num_slots`` records of ``record_bytes`` in host memory; slot 0 is never handed out."""

    def __init__(self, num_slots: int, record_bytes: int = AUX_RECORD_BYTES):
        self.record_bytes = record_bytes
        self.buffer = np.zeros(num_slots * record_bytes, dtype=np.uint8)  # [num_slots * record_bytes]
        self._free = list(range(num_slots - 1, 0, -1))
        self._lock = threading.Lock()

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._free)

    def alloc(self) -> Optional[int]:
        """A free slot, or None when all are taken."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        with self._lock:
            if not 0 < slot < self.buffer.size // self.record_bytes or slot in self._free:
                raise ValueError(f"aux slot {slot} is not an allocated slot")
            self._free.append(slot)

    def read(self, slot: int) -> bytes:
        start = slot * self.record_bytes
        return self.buffer[start:start + self.record_bytes].tobytes()

    def write(self, slot: int, record: bytes) -> None:
        if len(record) > self.record_bytes:
            raise ValueError(f"an aux record holds at most {self.record_bytes} bytes, got {len(record)}")
        start = slot * self.record_bytes
        self.buffer[start:start + self.record_bytes] = 0
        self.buffer[start:start + len(record)] = np.frombuffer(record, dtype=np.uint8)
