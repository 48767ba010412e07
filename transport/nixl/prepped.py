"""Prepared NIXL descriptor lists: a direct write as block indices into lists prepared once.

``initialize_xfer`` takes two descriptor lists built for the write and looks every descriptor
up in the registrations (local and the peer's) each time; ``make_prepped_xfer`` takes indices
into lists that ``prep_xfer_dlist`` looked up once, and NIXL merges consecutive indices back
into one descriptor, so a small request's write spends less host time before its post.

A list here is *strided* (NIXL's ``[n, 5]`` form ``(address, granule, device, granule,
blocks)``: one row per region, its ``length // granule`` blocks back to back), so it costs
O(regions) to prepare and hold whatever the region sizes, and indices address any range whose
offset and length are multiples of the granule. The granule of a write is the largest power of
two dividing every offset and length of the batch (at most :data:`MAX_GRANULE`); a list of a
finer granule that already exists serves it too (more indices, merged again by NIXL) while the
write stays within :data:`MAX_INDICES` indices. A write that needs more indices, or reaches
into a region's tail past its last whole block, or that NIXL refused to prepare a list for,
goes the descriptor way (:meth:`transport.nixl.peer.NixlPeer.direct`).

Lists, by (memory kind, granule): one :class:`PreparedLists` of this agent's regions (shared by
every peer) and one per peer snapshot (the regions of the export it connected to, less those
revoked since). Lifetime -- every handle is released, none is left to NIXL's finaliser:

- this agent's lists: when a region is registered (the list lacks it) or deregistered (before
  NIXL lets its registration go, which the list refers to), and at ``close``;
- a peer's lists: when the peer closes or a newer connect replaces it, when a region of its
  owner is revoked (or the owner closes, or a hold's answer names regions gone), before its
  agent's metadata is loaded again or removed, and at the transport's ``close``.

Released lists are prepared again on the next write that needs them. A transfer request holds
copies of its descriptors (NIXL's ``makeXferReq``), so releasing a list never touches requests
in flight.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import numpy as np

from transport.batch import SMALL_BATCH, Region, WriteBatch

__all__ = ["MAX_GRANULE", "MAX_INDICES", "PreparedLists", "prepped_indices", "shape_of"]

MAX_GRANULE = 1 << 16  # bytes: coarser granules add lists without making writes cheaper
MAX_INDICES = 4096  # a write needing more block indices goes the descriptor way
_MAX_BLOCKS = (1 << 31) - 1  # NIXL's indices are C ints


class _List:
    """One prepared list: its NIXL handle and where each region's blocks start in it."""

    def __init__(self, handle, granule: int, start: list, usable: list):
        self.handle = handle
        self.granule = granule
        self.shift = granule.bit_length() - 1
        self.start = start  # [num_ids] index of a region's first block, -1: not in this list
        self.usable = usable  # [num_ids] bytes of a region its whole blocks cover
        self.start_np = np.asarray(start, dtype=np.int64)  # the same for large batches
        self.usable_np = np.asarray(usable, dtype=np.int64)


class PreparedLists:
    """Strided prepared lists of one side's regions, by (memory kind, granule), prepared on
    first use. ``agent`` is this transport's :class:`~transport.nixl.agent.Agent`; ``remote``
    the peer agent's name (None: this agent's own regions); ``regions()`` the regions a list may
    name now."""

    def __init__(self, agent, remote: Optional[str], regions: Callable[[], Mapping[int, Region]]):
        self._agent = agent
        self._remote = remote
        self._regions = regions
        self._lists: dict = {}  # (mem, granule) -> _List, or None: NIXL refused it or too many blocks
        self._finest: dict = {}  # mem -> the finest granule of a usable list

    def finest(self, mem: str) -> Optional[int]:
        """The finest granule of this side's usable lists of memory kind ``mem`` (None: none)."""
        return self._finest.get(mem)

    def get(self, mem: str, granule: int) -> Optional[_List]:
        """The list of ``mem`` regions in blocks of ``granule`` bytes (prepared now if new),
        or None when it cannot be prepared."""
        key = (mem, granule)
        if key not in self._lists:
            lst = self._lists[key] = self._prepare(mem, granule)
            if lst is not None and granule < self._finest.get(mem, granule + 1):
                self._finest[mem] = granule
        return self._lists[key]

    def _prepare(self, mem: str, granule: int) -> Optional[_List]:
        regions = self._regions()
        top = max(regions, default=-1) + 1
        start, usable, rows, total = [-1] * top, [0] * top, [], 0
        for rid in sorted(regions):
            reg = regions[rid]
            blocks = reg.length // granule
            if (reg.device is None) != (mem == "DRAM") or blocks == 0:
                continue
            start[rid], usable[rid] = total, blocks * granule
            rows.append((reg.ptr, granule, reg.device or 0, granule, blocks))
            total += blocks
        if not rows or total > _MAX_BLOCKS:
            return None
        try:
            handle = self._agent.prep_list(self._remote, np.array(rows, dtype=np.uint64), mem)  # [regions, 5]
        except Exception:  # NIXL cannot prepare it (e.g. no backend for this memory): descriptors then
            return None
        return _List(handle, granule, start, usable)

    def release(self) -> None:
        """Release every list (prepared again on next use)."""
        lists, self._lists, self._finest = self._lists, {}, {}
        for lst in lists.values():
            if lst is not None:
                lst.handle.release()

    def __len__(self) -> int:
        return sum(lst is not None for lst in self._lists.values())


def shape_of(batch: WriteBatch) -> tuple:
    """``(granule, nbytes, rows)`` of a non-empty batch: the largest power of two (at most
    :data:`MAX_GRANULE`) dividing every offset and length, the bytes, and (up to
    ``SMALL_BATCH`` entries; else None) its entries as tuples of Python ints, read once."""
    if len(batch) <= SMALL_BATCH:
        rows = list(zip(batch.src_region.tolist(), batch.src_offset.tolist(), batch.dst_region.tolist(),
                        batch.dst_offset.tolist(), batch.length.tolist()))
        bits = nbytes = 0
        for _, o, _, p, n in rows:
            bits |= o | p | n
            nbytes += n
    else:
        rows, nbytes = None, int(batch.length.sum())
        bits = int(np.bitwise_or.reduce(batch.src_offset) | np.bitwise_or.reduce(batch.dst_offset)
                   | np.bitwise_or.reduce(batch.length))
    return min(bits & -bits, MAX_GRANULE), nbytes, rows  # lengths are >= 1: bits is not 0


def prepped_indices(batch: WriteBatch, rows: Optional[list], local: _List, remote: _List):
    """``(local indices, remote indices)`` of a checked, non-empty batch (``rows``: its
    :func:`shape_of` tuples, or None) in two lists of one granule, or None where an entry lies
    outside them (a region not in a list, or the tail of a region past its last whole block)."""
    shift = local.shift
    if rows is not None:
        li, ri = [], []
        lstart, lusable, rstart, rusable = local.start, local.usable, remote.start, remote.usable
        nl, nr = len(lstart), len(rstart)
        for r, o, d, p, n in rows:
            if r >= nl or d >= nr or lstart[r] < 0 or rstart[d] < 0 or o + n > lusable[r] or p + n > rusable[d]:
                return None
            a, b, k = lstart[r] + (o >> shift), rstart[d] + (p >> shift), n >> shift
            if k == 1:
                li.append(a)
                ri.append(b)
            else:
                li.extend(range(a, a + k))
                ri.extend(range(b, b + k))
        return li, ri
    sides = []
    for lst, region, offset in ((local, batch.src_region, batch.src_offset),
                                (remote, batch.dst_region, batch.dst_offset)):
        if int(region.max()) >= lst.start_np.size:
            return None
        start = lst.start_np[region]  # [n]
        if (start < 0).any() or (offset + batch.length > lst.usable_np[region]).any():
            return None
        sides.append(start + (offset >> shift))
    counts = batch.length >> shift  # [n] blocks per entry
    if int(counts.max()) == 1:  # one block each (rows of the granule): the firsts are the indices
        return tuple(first.astype(np.int32) for first in sides)
    before = np.cumsum(counts) - counts  # [n] indices ahead of each entry
    step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(before, counts)  # [k] block within its entry
    return tuple((np.repeat(first, counts) + step).astype(np.int32) for first in sides)
