"""Settings of the NIXL backend's staged mode: :class:`StagedNixlConfig` and its rule."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagedNixlConfig", "CHUNK_HEADER_BYTES", "ROW_TABLE_BYTES"]

CHUNK_HEADER_BYTES = 64  # a chunk's header in its staging slot (transport.nixl.staged.wire)
ROW_TABLE_BYTES = 16  # per row in a chunk: destination offset (int64), region (int32), length (int32)


@dataclass(frozen=True)
class StagedNixlConfig:
    """When and how a NIXL write goes staged (:mod:`transport.nixl.staged`).

    enabled: writes may go staged at all (False: every write is direct).
    min_rows: a batch of fewer ranges goes direct (a few ranges cost NIXL little; the staged
        mode pays a handshake once per peer and a round trip per slot).
    max_row_bytes: a batch with a range longer than this goes direct (NIXL moves 16 KiB
        ranges about as fast as the staged mode gathers and scatters them: bench/RESULTS.md).
    slot_bytes: bytes of one staging slot of a lane whose receiving side is host memory: a
        chunk (header, row table or destination table, gathered rows) per slot; the rows of a
        batch are cut into chunks that fit.
    cuda_slot_bytes: the same for a lane whose receiving side is CUDA memory. Each chunk costs
        the sender a fixed amount of host time (its gather's launch, header and table, the
        NIXL write: a few tenths of a millisecond), which must stay below the chunk's time on
        the wire, so GPU lanes take large slots (bench/RESULTS.md compares slot sizes).
    slots: staging slots per lane (>= 2, so that gather, wire and scatter overlap).
    wire_gather_bytes: host memory: a chunk whose source runs (rows that follow each other in
        memory and in the chunk) average at least this many bytes is not copied into the
        staging first: its write carries a descriptor per run. NIXL moves 32 KiB ranges faster
        than a local gather plus one write of the slot, and 16 KiB ones slower, so runs of
        16 KiB (the CPU demo's) are gathered locally (bench/RESULTS.md).
    max_lanes: host lanes a receiver keeps (one per sending transport); a Hello past them is
        refused and that sender writes direct.
    max_cuda_lanes: the same for lanes on CUDA memory (counted apart: GPU memory is scarcer).
    shared_slots: a host -> host lane between two processes of one host shares the receiver's
        slots (:mod:`~transport.nixl.staged.shared`): the sender gathers into them and NIXL
        carries the chunks' notifications alone, one copy of every byte fewer. Both sides
        must allow it; where the sender cannot map them, NIXL writes the slots.

    Memory: a lane holds ``slots`` x its slot size registered bytes on EACH side, allocated once,
    at the first staged write to a peer, on the memory kind of that write (host, or the CUDA
    device of its regions): host-receiving lanes ``slots * slot_bytes`` (defaults 4 x 4 MiB =
    16 MiB), CUDA-receiving lanes ``slots * cuda_slot_bytes`` (defaults 4 x 128 MiB = 512 MiB on
    the sending side's memory and on the receiving GPU). The slot size follows the receiving
    side's memory, so a CUDA -> host lane stages 4 MiB slots and a host -> CUDA lane holds
    512 MiB of host memory on the sender. A receiver grants host lanes of at most
    ``slots * slot_bytes`` and keeps at most ``max_lanes`` of them (defaults: 16 MiB x 32 =
    512 MiB of host memory at worst), CUDA lanes of at most ``slots * cuda_slot_bytes`` and at
    most ``max_cuda_lanes`` of them (defaults: 512 MiB x 8 = 4 GiB per GPU at worst, e.g. eight
    prefill ranks writing one decode rank); a lane lives until its sender opens a new one (after
    a loss) or the receiving transport closes.

    Strided writes (``NixlPeer.write_strided``, :meth:`wants_strided`): go staged when the flat
    form they stand for (``StridedBatch.coalesced()``) would, and when the write's destination
    table (``32 * P + 8 * S`` bytes, carried by every chunk) takes at most a quarter of a slot.
    """

    enabled: bool = True
    min_rows: int = 1024
    max_row_bytes: int = 16 << 10
    slot_bytes: int = 4 << 20
    cuda_slot_bytes: int = 128 << 20
    slots: int = 4
    wire_gather_bytes: int = 32 << 10
    max_lanes: int = 32
    max_cuda_lanes: int = 8
    shared_slots: bool = True

    def __post_init__(self) -> None:
        for name in ("enabled", "shared_slots"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, low in (("min_rows", 1), ("max_row_bytes", 1), ("slot_bytes", 1 << 16),
                          ("cuda_slot_bytes", 1 << 16), ("slots", 2), ("wire_gather_bytes", 1), ("max_lanes", 1),
                          ("max_cuda_lanes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        for name in ("slot_bytes", "cuda_slot_bytes"):
            if getattr(self, name) < self.row_room(self.max_row_bytes):
                raise ValueError(f"{name} {getattr(self, name)} cannot hold one row of max_row_bytes "
                                 f"{self.max_row_bytes} (needs {self.row_room(self.max_row_bytes)})")

    @staticmethod
    def row_room(length: int) -> int:
        """Slot bytes one chunk of a single ``length``-byte row needs (header, table, data)."""
        return CHUNK_HEADER_BYTES + ROW_TABLE_BYTES + 64 + length

    @property
    def lane_bytes(self) -> int:
        """Registered staging bytes of one host-receiving lane on each side."""
        return self.slots * self.slot_bytes

    def slot_bytes_for(self, device) -> int:
        """The slot size of a lane whose receiving side is on ``device`` (None: host)."""
        return self.slot_bytes if device is None else self.cuda_slot_bytes

    def lanes_for(self, device) -> int:
        """How many lanes on ``device`` (None: host) a receiver keeps."""
        return self.max_lanes if device is None else self.max_cuda_lanes

    def wants(self, batch) -> bool:
        """Whether a :class:`~transport.base.WriteBatch` goes staged: at least ``min_rows``
        ranges, none longer than ``max_row_bytes`` (the transport also needs each side's ranges
        on one memory)."""
        length = batch.length  # [n]
        return self.enabled and length.size >= self.min_rows and int(length.max()) <= self.max_row_bytes

    def wants_strided(self, batch) -> bool:
        """Whether a :class:`~transport.base.StridedBatch` goes staged: its coalesced form (the
        flat batch it would otherwise be written as) would, by :meth:`wants`; O(P + S), the flat
        form is not built (the sender also needs its destination table to fit a slot:
        :func:`~transport.nixl.staged.wire.strided_fits`)."""
        if not self.enabled or len(batch) == 0:
            return False
        rows, longest = batch.coalesced_shape()
        return rows >= self.min_rows and longest <= self.max_row_bytes
