"""Settings of the NIXL backend's staged mode: :class:`StagedNixlConfig` and its rule."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagedNixlConfig", "CHUNK_HEADER_BYTES", "ROW_TABLE_BYTES"]

CHUNK_HEADER_BYTES = 64  # a chunk's header in its staging slot (transport.nixl_staged.wire)
ROW_TABLE_BYTES = 16  # per row in a chunk: destination offset (int64), region (int32), length (int32)


@dataclass(frozen=True)
class StagedNixlConfig:
    """When and how a NIXL write goes staged (:mod:`transport.nixl_staged`).

    enabled: writes may go staged at all (False: every write is direct, as before).
    min_rows: a batch of fewer ranges goes direct (a few ranges cost NIXL little; the staged
        mode pays a handshake once per peer and a round trip per slot).
    max_row_bytes: a batch with a range longer than this goes direct (NIXL moves 16 KiB
        ranges at about the rate this host gathers and scatters them: bench/RESULTS.md).
    slot_bytes: bytes of one staging slot: a chunk (header, row table, gathered rows) per
        slot; the rows of a batch are cut into chunks that fit.
    slots: staging slots per lane (>= 2, so that gather, wire and scatter overlap).
    wire_gather_bytes: host memory: a chunk whose source runs (rows that follow each other in
        memory and in the chunk) average at least this many bytes is not copied into the
        staging first: its write carries a descriptor per run (NIXL moves 8 KiB ranges about as
        fast as this host copies them into staging and writes that: bench/RESULTS.md).
    max_lanes: lanes a receiver keeps (one per sending transport); a Hello past them is refused
        and that sender writes direct.

    Memory: a lane holds ``slots * slot_bytes`` registered bytes on EACH side (defaults:
    4 x 4 MiB = 16 MiB), allocated once, at the first staged write to a peer, on the memory
    kind of that write (host, or the CUDA device of its regions). A receiver grants lanes of
    at most its own ``slots * slot_bytes`` and keeps at most ``max_lanes`` of them (defaults:
    16 MiB x 32 = 512 MiB at worst); a lane lives until its sender opens a new one (after a
    loss) or the receiving transport closes.
    """

    enabled: bool = True
    min_rows: int = 1024
    max_row_bytes: int = 16 << 10
    slot_bytes: int = 4 << 20
    slots: int = 4
    wire_gather_bytes: int = 8 << 10
    max_lanes: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, got {self.enabled!r}")
        for name, low in (("min_rows", 1), ("max_row_bytes", 1), ("slot_bytes", 1 << 16), ("slots", 2),
                          ("wire_gather_bytes", 1), ("max_lanes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.slot_bytes < self.row_room(self.max_row_bytes):
            raise ValueError(f"slot_bytes {self.slot_bytes} cannot hold one row of max_row_bytes "
                             f"{self.max_row_bytes} (needs {self.row_room(self.max_row_bytes)})")

    @staticmethod
    def row_room(length: int) -> int:
        """Slot bytes one chunk of a single ``length``-byte row needs (header, table, data)."""
        return CHUNK_HEADER_BYTES + ROW_TABLE_BYTES + 64 + length

    @property
    def lane_bytes(self) -> int:
        """Registered staging bytes of one lane on each side."""
        return self.slots * self.slot_bytes

    def wants(self, batch) -> bool:
        """Whether a :class:`~transport.base.WriteBatch` goes staged: at least ``min_rows``
        ranges, none longer than ``max_row_bytes`` (the transport also needs each side's ranges
        on one memory)."""
        length = batch.length  # [n]
        return self.enabled and length.size >= self.min_rows and int(length.max()) <= self.max_row_bytes
