"""What a write names: registered regions, batches of byte ranges, and their bounds checks.

A :class:`WriteBatch` is parallel int64 arrays, one entry per range; a :class:`StridedBatch`
is its factored form (buffer pairs x slots). Both are validated once at the boundary: lengths
and signs when built, bounds against the registered regions of both sides (:class:`RegionSizes`)
in each backend's write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from transport.errors import PeerDescriptorError

__all__ = ["ADDRESS_END", "MAX_DEVICE", "MAX_OFFSET", "MAX_REGION_ID", "MIN_ADDRESS", "SMALL_BATCH", "Region",
           "RegionSizes", "StridedBatch", "WriteBatch", "check_ranges", "check_region_args", "check_strided_side"]


@dataclass(frozen=True)
class Region:
    """One registered memory range. ``device`` is None for host memory, else a CUDA ordinal."""

    region_id: int
    ptr: int
    length: int
    device: Optional[int] = None

    @property
    def is_cuda(self) -> bool:
        return self.device is not None

    def to_wire(self) -> list:
        return [self.region_id, self.ptr, self.length, -1 if self.device is None else self.device]

    @classmethod
    def from_wire(cls, item) -> "Region":
        if not isinstance(item, (list, tuple)) or len(item) != 4 or not all(isinstance(x, int) for x in item):
            raise PeerDescriptorError(f"region entry must be 4 ints [id, ptr, length, device], got {item!r}")
        rid, ptr, length, device = item
        if not 0 <= rid < MAX_REGION_ID or ptr < 0 or length <= 0 or device < -1 or device >= MAX_DEVICE:
            raise PeerDescriptorError(
                f"region entry out of range: {item!r} (id in [0, {MAX_REGION_ID}), ptr >= 0, length > 0, "
                f"device in [-1, {MAX_DEVICE}))"
            )
        if ptr + length > ADDRESS_END:
            raise PeerDescriptorError(f"region entry {item!r} ends past the 64-bit address space")
        return cls(rid, ptr, length, None if device == -1 else device)


def check_region_args(ptr: int, length: int, device: Optional[int]) -> None:
    """The argument checks every backend's ``register`` shares."""
    if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0:
        raise TypeError(f"ptr must be a positive int address, got {ptr!r}")
    if ptr < MIN_ADDRESS:
        raise ValueError(f"ptr {ptr:#x} lies in the first {MIN_ADDRESS} bytes, which no allocation uses")
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if length > MAX_OFFSET or ptr + length > ADDRESS_END:
        raise ValueError(f"[{ptr:#x}, +{length}) does not fit a 64-bit address space "
                         f"(length at most {MAX_OFFSET}, end at most {ADDRESS_END:#x})")
    if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
        raise ValueError(f"device must be None (host) or a CUDA ordinal >= 0, got {device!r}")


# What is read from a peer (exports) or held in int64 arrays is bounded, so that no check can
# wrap around and no peer's claim makes this side allocate: region ids index dense tables
# (RegionSizes, a backend's pointer arrays: 8 bytes per id up to the largest id), offsets and
# lengths are int64.
MAX_REGION_ID = 1 << 20  # ids per transport over its lifetime (ids are never reused)
MAX_DEVICE = 1 << 16
MAX_OFFSET = (1 << 63) - 1  # int64
MIN_ADDRESS = 4096  # the null page: a pointer below it is a bug (an offset, a length), never memory
ADDRESS_END = 1 << 64

_BATCH_FIELDS = ("src_region", "src_offset", "dst_region", "dst_offset", "length")


@dataclass(frozen=True)
class WriteBatch:
    """Parallel int64 arrays, one entry per byte range to write.

    Build with :meth:`of`, which converts and checks lengths and signs (a scalar stands for
    the same value in every entry); bounds are checked
    against registered regions by :meth:`check_bounds` (each backend calls it once per write).
    """

    src_region: np.ndarray  # [n] local region ids
    src_offset: np.ndarray  # [n] byte offsets inside the local regions
    dst_region: np.ndarray  # [n] the peer's region ids
    dst_offset: np.ndarray  # [n] byte offsets inside the peer's regions
    length: np.ndarray  # [n] bytes

    @classmethod
    def of(cls, src_region, src_offset, dst_region, dst_offset, length) -> "WriteBatch":
        arrays = _int64_arrays(_BATCH_FIELDS, (src_region, src_offset, dst_region, dst_offset, length), "entry")
        return cls(*arrays)

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def check_bounds(self, local: Mapping[int, Region], remote: Mapping[int, Region]) -> None:
        """Raise ``ValueError`` naming the first entry outside its (local or remote) region
        (either table may also be a :class:`RegionSizes`)."""
        _check_side(self.src_region, self.src_offset, self.length, local, "source (local)")
        _check_side(self.dst_region, self.dst_offset, self.length, remote, "destination (peer)")


def _int64_arrays(names, values, what: str) -> list:
    """Parallel 1-D int64 arrays, non-negative, the last (a length) positive; a scalar stands
    for the same value in every entry. ``what`` names an index in messages ("entry", "pair")."""
    values = [np.asarray(v) for v in values]
    sizes = {v.size for v in values if v.ndim != 0}
    n_common = sizes.pop() if len(sizes) == 1 else 1  # scalars broadcast to the arrays' length
    arrays = []
    for name, arr in zip(names, values):
        if arr.ndim == 0:
            arr = np.full(n_common, arr)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            if arr.dtype != object or not all(isinstance(x, int) and not isinstance(x, bool) for x in arr.flat):
                raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
            # Python ints past int64 (numpy keeps them as objects): no wrap-around below
        if arr.size and (arr.dtype == object or arr.dtype == np.uint64) and arr.max() > MAX_OFFSET:
            i = int(np.argmax(arr > MAX_OFFSET))
            raise ValueError(f"batch {what} {i}: {name} {int(arr[i])} does not fit int64 (at most {MAX_OFFSET})")
        arrays.append(np.ascontiguousarray(arr, dtype=np.int64))
    n = arrays[0].size
    for name, arr in zip(names, arrays):
        if arr.size != n:
            raise ValueError(f"batch arrays differ in length: {names[0]} has {n}, {name} has {arr.size}")
    for name, arr in zip(names, arrays):
        if n and arr.min() < 0:
            i = int(np.argmax(arr < 0))
            raise ValueError(f"batch {what} {i}: {name} is negative ({arr[i]})")
    if names[-1] == "length" and n and arrays[-1].min() == 0:
        i = int(np.argmax(arrays[-1] == 0))
        raise ValueError(f"batch {what} {i}: length is 0")
    return arrays


class RegionSizes:
    """The byte size of each region id of a region table (``-1``: not registered), built once
    so that a bounds check costs no Python loop over the regions. Backends keep one per side
    and rebuild it when their regions change; ``check_bounds`` accepts it wherever it accepts
    a ``Mapping[int, Region]``."""

    def __init__(self, table: Mapping[int, Region]):
        top = max(table) if table else -1
        self.sizes = np.full(top + 1, -1, dtype=np.int64)  # [max id + 1] bytes
        for rid, reg in table.items():
            self.sizes[rid] = reg.length
        self.listed = self.sizes.tolist()  # the same as Python ints: what a small batch is checked against
        self.ids = sorted(table)

    def of(self, region: np.ndarray) -> np.ndarray:
        """``[n]`` sizes of the ids ``region`` (``-1`` for an id not registered, however large)."""
        if region.size and int(region.max()) < self.sizes.size:
            return self.sizes[region]
        known = np.full(region.size, -1, dtype=np.int64)
        inside = region < self.sizes.size
        known[inside] = self.sizes[region[inside]]
        return known


def check_ranges(region, offset, length, table, side: str) -> None:
    """``ValueError`` naming the first range ``[offset, offset + length)`` (``[n]`` int64 each)
    outside its region of ``table`` (regions by id, or a :class:`RegionSizes`); ``side`` names
    whose regions they are. What a receiver checks ranges a peer names with (the NIXL staged mode)."""
    _check_side(region, offset, length, table, side)


def check_strided_side(region, offset, stride, length, slot, table, side: str, overflow=ValueError) -> None:
    """One side of a factored batch (``[P]`` region, offset, stride, length; ``[S]`` slots,
    not empty) inside the regions of ``table``, in O(P + S): per pair, the end of its furthest
    slot's range ``offset + max(slot) * stride + length`` (every other slot's lies between).
    ``ValueError`` naming the first bad pair; ``overflow`` (a ValueError type) for an end past
    int64 addresses. What :meth:`StridedBatch.check_bounds` checks per side, and what a
    receiver checks a peer's destination table with (the NIXL staged mode)."""
    top = int(slot.max())
    reach = offset + length + stride.astype(np.float64) * top  # [P]; float: no wrap-around
    if reach.max() >= 2.0**62:
        i = int(np.argmax(reach >= 2.0**62))
        raise overflow(f"batch pair {i}: {side} offset {int(offset[i])} + slot {top} x stride {int(stride[i])} "
                       "overflows int64 addresses")
    _check_side(region, offset, stride * top + length, table, side, "pair")


SMALL_BATCH = 32  # up to this many entries, per-entry Python beats numpy's fixed cost per call (~2 µs vs ~20)


def _check_side(region, offset, length, table, side: str, what: str = "entry") -> None:
    if region.size == 0:
        return
    if not isinstance(table, RegionSizes):
        table = RegionSizes(table)
    if region.size <= SMALL_BATCH:  # a small request's batch: the same checks, in Python ints (no wrap)
        sizes, rows = table.listed, list(zip(region.tolist(), offset.tolist(), length.tolist()))
        for i, (r, _, _) in enumerate(rows):
            if r >= len(sizes) or sizes[r] < 0:
                _unregistered(what, i, side, r, table)
        for i, (r, o, n) in enumerate(rows):
            if o > sizes[r] - n:
                _outside(what, i, side, r, o, n, sizes[r])
        return
    lo, top = int(region.min()), int(region.max())
    # ``offset + length <= size`` is checked as ``offset <= size - length``: offsets and lengths
    # are non-negative int64 (lengths >= 1), so the subtraction cannot wrap where the sum could.
    # Fast path (a few reductions, no gather): every id in [lo, top] is registered and the
    # furthest end fits the smallest of them. Plans over equal-sized per-layer buffers
    # always take it; 2.6 M entries check in a few ms instead of tens.
    if top < table.sizes.size:
        smallest = int(table.sizes[lo: top + 1].min())
        if smallest >= 0 and bool(np.all(offset <= smallest - length)):
            return
    known = table.of(region)  # [n] bytes, -1: unknown or deregistered id
    bad = np.flatnonzero(known < 0)
    if bad.size:
        i = int(bad[0])
        _unregistered(what, i, side, int(region[i]), table)
    over = np.flatnonzero(offset > known - length)
    if over.size:
        i = int(over[0])
        _outside(what, i, side, int(region[i]), int(offset[i]), int(length[i]), int(known[i]))


def _unregistered(what: str, i: int, side: str, region: int, table: RegionSizes) -> None:
    raise ValueError(f"batch {what} {i}: {side} region {region} is not registered (known ids: {table.ids[:16]})")


def _outside(what: str, i: int, side: str, region: int, offset: int, length: int, size: int) -> None:
    raise ValueError(f"batch {what} {i}: {side} range [{offset}, {offset + length}) is outside region {region} "
                     f"of {size} bytes")


_PAIR_FIELDS = ("src_region", "src_offset", "src_stride", "dst_region", "dst_offset", "dst_stride", "length")
_SLOT_FIELDS = ("src_slot", "dst_slot")


@dataclass(frozen=True)
class StridedBatch:
    """A factored batch: buffer pairs x slots, ``P * S`` byte ranges.

    Entry ``(p, s)`` copies ``length[p]`` bytes from byte
    ``src_offset[p] + src_slot[s] * src_stride[p]`` of local region ``src_region[p]`` to byte
    ``dst_offset[p] + dst_slot[s] * dst_stride[p]`` of the peer's region ``dst_region[p]``.
    A KV transfer is one: a pair per (layer, K/V, byte range of a token row), a slot per token.
    Build with :meth:`of`; :meth:`expand` gives the flat :class:`WriteBatch` (pair-major:
    entry ``p * S + s``), :meth:`check_bounds` checks every entry in O(P + S).
    """

    src_region: np.ndarray  # [P] local region ids
    src_offset: np.ndarray  # [P] bytes from the local region's start to slot 0's range
    src_stride: np.ndarray  # [P] bytes between consecutive source slots
    dst_region: np.ndarray  # [P] the peer's region ids
    dst_offset: np.ndarray  # [P] bytes from the peer region's start to slot 0's range
    dst_stride: np.ndarray  # [P] bytes between consecutive destination slots
    length: np.ndarray  # [P] bytes per entry
    src_slot: np.ndarray  # [S] source slot of each entry column
    dst_slot: np.ndarray  # [S] destination slot of each entry column

    @classmethod
    def of(cls, src_region, src_offset, src_stride, dst_region, dst_offset, dst_stride, length,
           src_slot, dst_slot) -> "StridedBatch":
        """Convert to int64 and check: pair arrays of one length ``P``, slot arrays of one
        length ``S`` (a scalar stands for the same value in every pair or slot), nothing
        negative, lengths > 0."""
        pairs = _int64_arrays(_PAIR_FIELDS, (src_region, src_offset, src_stride, dst_region, dst_offset,
                                             dst_stride, length), "pair")
        slots = _int64_arrays(_SLOT_FIELDS, (src_slot, dst_slot), "slot")
        return cls(*pairs, *slots)

    @property
    def num_pairs(self) -> int:
        return int(self.length.size)

    @property
    def num_slots(self) -> int:
        return int(self.src_slot.size)

    def __len__(self) -> int:
        return self.num_pairs * self.num_slots

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) * self.num_slots

    def check_bounds(self, local: Mapping[int, Region], remote: Mapping[int, Region]) -> None:
        """Raise ``ValueError`` naming the first pair whose furthest slot leaves its region.

        O(P + S): per side, the largest slot; per pair, the end ``offset + max_slot * stride +
        length`` (every other slot's range lies between the offset and that end)."""
        if len(self) == 0:
            return
        check_strided_side(self.src_region, self.src_offset, self.src_stride, self.length, self.src_slot, local,
                           "source (local)")
        check_strided_side(self.dst_region, self.dst_offset, self.dst_stride, self.length, self.dst_slot, remote,
                           "destination (peer)")

    def expand(self) -> WriteBatch:
        """The flat form: one entry per (pair, slot), pair-major (entry ``p * S + s``)."""
        n = self.num_slots

        def offsets(offset, stride, slot):  # [P, S] -> [P * S]
            out = np.multiply(stride[:, None], slot[None, :])
            out += offset[:, None]
            return out.ravel()

        return WriteBatch(
            np.repeat(self.src_region, n), offsets(self.src_offset, self.src_stride, self.src_slot),
            np.repeat(self.dst_region, n), offsets(self.dst_offset, self.dst_stride, self.dst_slot),
            np.repeat(self.length, n),
        )

    def coalesced(self) -> WriteBatch:
        """The same bytes as :meth:`expand` in as few entries as possible: for a pair whose
        entry is a whole slot on both sides (``length == src_stride == dst_stride``), slots
        that advance by one on both sides form one entry (a run); other pairs keep one entry
        per slot. What a backend that posts each range (NIXL) writes: a KV plan with equal TP
        and contiguous pages becomes one range per (buffer, run) instead of per token."""
        whole, starts = self._slot_runs()
        if starts is None:
            return self.expand()
        runs = np.diff(np.append(starts, self.num_slots))  # [R] slots per run
        merged = self._subset(whole, self.src_slot[starts], self.dst_slot[starts]).expand()
        merged = WriteBatch(merged.src_region, merged.src_offset, merged.dst_region, merged.dst_offset,
                            (self.length[whole][:, None] * runs[None, :]).ravel())
        if whole.all():
            return merged
        rest = self._subset(~whole, self.src_slot, self.dst_slot).expand()
        return WriteBatch(*(np.concatenate([getattr(merged, f), getattr(rest, f)]) for f in _BATCH_FIELDS))

    def coalesced_shape(self) -> tuple[int, int]:
        """``(entries, longest entry in bytes)`` of :meth:`coalesced`, in O(P + S) without
        building it (what a backend decides a route by)."""
        n = self.num_slots
        if len(self) == 0:
            return 0, 0
        whole, starts = self._slot_runs()
        runs, longest_run = (n, 1) if starts is None else (int(starts.size), int(np.diff(np.append(starts, n)).max()))
        merged, rest = self.length[whole], self.length[~whole]
        longest = max(int(merged.max()) * longest_run if merged.size else 0, int(rest.max()) if rest.size else 0)
        return int(merged.size) * runs + int(rest.size) * n, longest

    def _slot_runs(self) -> tuple:
        """``(whole, starts)`` of :meth:`coalesced`: ``[P]`` pairs whose entry is a whole slot on
        both sides, and ``[R]`` the first slot of each run of slots that advance by one on both
        sides (None when nothing merges: no whole pair, or no such step)."""
        whole = (self.length == self.src_stride) & (self.length == self.dst_stride)  # [P]
        if self.num_slots < 2 or not whole.any():
            return whole, None
        step = (np.diff(self.src_slot) == 1) & (np.diff(self.dst_slot) == 1)  # [S-1] slot s+1 continues s
        if not step.any():
            return whole, None
        return whole, np.flatnonzero(np.concatenate(([True], ~step)))

    def source_runs(self) -> int:
        """Runs of entries (in :meth:`expand`'s pair-major order) whose sources follow each other
        in memory: a pair whose stride is its length runs over consecutive source slots; O(P + S)."""
        n = self.num_slots
        if len(self) == 0:
            return 0
        breaks = int(np.count_nonzero(np.diff(self.src_slot) != 1))  # slot s+1 does not follow s
        follow = int(np.count_nonzero(self.src_stride == self.length))  # [P] pairs whose rows touch
        return follow * (breaks + 1) + (self.num_pairs - follow) * n

    @property
    def pairs(self) -> tuple:
        """The seven ``[P]`` pair arrays in constructor order (``src_region`` .. ``length``):
        ``StridedBatch(*batch.pairs, src_slot, dst_slot)`` is the same pairs over other slots."""
        return (self.src_region, self.src_offset, self.src_stride, self.dst_region, self.dst_offset, self.dst_stride,
                self.length)  # _PAIR_FIELDS, written out: a write's pair lookup reads it (a generator costs ~8x)

    def _subset(self, keep: np.ndarray, src_slot: np.ndarray, dst_slot: np.ndarray) -> "StridedBatch":
        """The pairs where ``keep`` ([P] bool) holds, over the given slots."""
        return StridedBatch(*(a[keep] for a in self.pairs), src_slot, dst_slot)
