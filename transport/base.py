"""The transport contract: batched one-sided writes between registered memory regions.

A transport knows nothing of KV caches, layers or heads: it moves byte ranges.

Who calls what
--------------
Each process owns one :class:`Transport` (one per backend). The owner

1. registers the memory it will write from or be written into::

       rid = transport.register(ptr, length, device=None)   # host memory
       rid = transport.register(ptr, length, device=0)      # CUDA ordinal 0

   A region id is a small int, dense from 0, never reused while the transport lives (at most
   :data:`MAX_REGION_ID` registrations per transport: ``TransportError`` past them; a peer's
   export naming a larger id is a :class:`PeerDescriptorError`);
   ``transport.deregister(rid)`` forgets one (``ValueError`` for an id not registered),
   after revoking it from every peer that can still write into it (see "Deregistering
   written-to memory" below: every backend waits for them, :class:`RevokeTimeout`).
   ``register`` refuses (``ValueError``) a range that overlaps a live region of the same
   memory (host or one CUDA device): each byte has one region id, so registering the same
   buffer twice is a caller's bug, not a second handle. It also refuses pointers in the null
   page and ranges past the 64-bit address space; it cannot tell a dangling pointer from a
   live one (the backend's registration may fail on it, ``TransportError``). The memory stays
   the caller's: keep it alive until ``deregister``. The nixl backend refuses
   (``TransportError``) to deregister a region that is the source of a transfer still
   pending: wait for it or abort it first;
   ``transport.regions`` is a read-only view of the live regions by id;
2. sends ``transport.export()`` (bytes, msgpack-able) to its peer through the control
   plane, and connects to the peer's bytes with ``peer = transport.connect(peer_bytes)``.
   The export is a snapshot: regions registered later need a new export/connect. It carries
   the transport's :attr:`Transport.name`, which the connected :class:`Peer` reports as
   ``peer.name`` and the peer's notifications as their ``sender``;
3. writes: ``t = peer.write(batch, notify=b"...")`` where ``batch`` is a
   :class:`WriteBatch` of parallel int64 arrays ``src_region, src_offset, dst_region,
   dst_offset, length`` (local region ids / offsets, the peer's region ids / offsets).
   The batch is validated once, vectorised: every entry must lie inside its registered
   regions or ``ValueError`` names the first bad entry and the region's bounds;
   Factored batches (a KV plan is buffer pairs x token slots) go through
   ``t = peer.write_strided(batch, notify=b"...")`` with a :class:`StridedBatch`: per-pair
   arrays ``[P]`` (regions, offsets, strides, length) and per-slot arrays ``[S]``; entry
   ``(p, s)`` writes ``length[p]`` bytes from ``src_offset[p] + src_slot[s] * src_stride[p]``
   to ``dst_offset[p] + dst_slot[s] * dst_stride[p]``. Bounds are checked in O(P + S). The
   default (every backend) writes ``batch.coalesced()``, the flat :class:`WriteBatch` with
   touching whole-slot runs merged, with the same semantics as ``write``; a backend may
   override it to expand on the device;
4. observes ``t.status()`` (a :class:`TransferStatus`), blocks with ``t.wait(timeout)``
   or gives up with ``t.abort()``;
5. on the receiving side, polls ``transport.poll_notifications()`` for the
   :class:`Notification` of each transfer that has landed: ``sender`` (the writing
   transport's name, as its export carries it) and ``payload`` (the ``notify`` bytes). A
   notification is delivered only after all bytes of the write that carries it are visible
   in the receiver's memory; one sender's notifications arrive in the order it posted them,
   different senders' are not ordered against each other;
6. closes: ``transport.close()`` (or ``with Transport(...) as t``) releases every peer,
   region and thread. Closing twice is harmless.

Threads
-------
A transport is used from one thread at a time (the owner's event loop). Backends may run
a progress thread of their own; that is configuration of the backend, not of callers.

Errors
------
- ``ValueError`` / ``TypeError``: bad arguments (a batch that is out of bounds, arrays of
  different lengths, an unknown region id -- in a batch or in ``deregister`` --, a negative
  length).
- :class:`PeerDescriptorError` (a ``ValueError``): the peer's export bytes are malformed,
  truncated, of another backend or protocol version.
- :class:`TransferFailed`: raised by ``wait`` when the transfer failed; ``status()`` is
  then ``FAILED`` and ``error`` holds the reason (peer lost, aborted, backend error).
- :class:`TransferTimeout` (a ``TimeoutError``): ``wait`` ran out of time; the transfer
  is still pending and may be waited on again or aborted.
- :class:`TransportClosed`: the transport (or peer) was closed.
- :class:`RegionRevoked` (a ``TransportError`` and a ``ValueError``): a write names a region
  its owner has since deregistered (revoked from this peer); nothing was written.
- :class:`RevokeTimeout` (a ``TransportError``): ``deregister`` could not revoke the region
  from a peer in time; the region stays registered.

Nothing here hangs: a dead peer surfaces as ``FAILED`` within the backend's bounded
peer-loss timeout.

What FAILED and abort() guarantee (late bytes)
----------------------------------------------
A destination's bytes may be reused for another write only once no byte of an earlier
write to them can still land:

- ``DONE``: every byte has landed; nothing of the transfer lands later.
- ``abort()`` returns only once the backend no longer runs the transfer (nixl: NIXL reports
  the request no longer in progress), so nothing of it lands after ``abort()`` returns. It
  waits at most until the transfer's peer-loss deadline; a peer that does not progress it by
  then is *lost* (below). ``Peer.close()`` aborts its pending transfers the same way.
  ``cancel()`` is the same without the wait: the transfer stays ``PENDING`` until nothing of it
  can land, then ends ``FAILED`` ("aborted") -- for a loop that must serve other requests while
  a stalled peer holds one back.
- ``FAILED`` at the deadline (or from a backend error): the bytes already posted may still
  land (over tcp they sit in socket buffers until the peer reads them). The transport then
  treats that remote transport as lost: writes to it fail at once ("lost earlier") until a
  new ``connect`` to it, which refuses (``TransportError``) while the failed requests are
  still running in the backend, so no later write of this transport is overtaken by them.
  The *receiver* must still treat the destination of a failed transfer as written-to until
  the writer says otherwise or is known dead (the control plane's job).

Deregistering written-to memory (stale exports, revocation)
-----------------------------------------------------------
A one-sided write cannot be refused by its target: a writer holding an export that names a
region writes into that memory even after the owner deregistered and freed it (UCX's loopback
transports do not check registrations there: crash or heap corruption in the owner; an nvlink
peer's kernel stores go through the CUDA IPC mapping it opened: another tensor's bytes
overwritten, or memory CUDA calls undefined). So deregistering a region that a connected peer
can still address must first revoke it from that peer. Every backend does this itself, with
one loop and one set of messages (:mod:`transport.revocation`; :mod:`transport.nixl_revoke`
over NIXL notifications, :mod:`transport.nvlink` over its mailbox connections):

- ``connect`` tells the export's owner that this transport *holds* it; a write is posted only
  once the owner has recorded the hold (nixl: a direct write; its staged writes are scattered
  by the owner, who checks its live regions), and the owner's answer names the regions of that
  export it no longer has, so the owner knows every transport that can write into its memory
  before a byte of it can land, and a writer connecting with an export older than a
  deregister cannot write the region (``RegionRevoked``);
- ``deregister(rid)`` sends each holder that can address ``rid`` a revoke and waits until
  every one of them acknowledged it (the holder drops the region, so a later write naming it
  raises :class:`RegionRevoked` at once, and answers only once none of its writes into it is
  in flight; nvlink also unmaps it) or is known dead (nixl: its connection reported closed;
  nvlink: its mailbox connection ended), at most the backend's ``revoke_timeout_s``
  (``NixlConfig``, ``NvlinkConfig``); only then is the region deregistered, and the caller may
  free the memory when ``deregister`` returns;
- a holder that neither answers nor is known dead by then cannot be proven harmless:
  ``deregister`` raises :class:`RevokeTimeout` naming it, and the region stays registered
  (keep the memory; deregister again later). ``deregister(rid, force=True)`` releases it
  anyway: the caller then accepts that the silent holder may still write into the memory.
  A holder that left a revoke unanswered is not waited for again until it answers anything;
- ``Peer.close()`` (nixl: once no write to that owner is pending) and ``close()`` tell the
  owner to forget this transport; ``close()`` of an owner tells holders its regions are gone
  but waits for nobody: deregister memory explicitly before ``close()`` when peers may still
  write, or keep it alive until they are gone;
- ``writer_gone(name)`` says what the owner knows of one holder: that it let go or is known
  dead (nixl: a probe write into it, sent here at most every 0.2 s, failed with a disconnect),
  or nothing (None) -- what the control plane asks before it reuses pages a silent writer was
  writing into.

When each side answers: a nixl holder only inside its own calls into its transport (``write``,
a transfer's ``status``/``wait``, ``poll_notifications``, ``connect``, ``Peer.close``): a
process that holds an export and stays idle must call ``poll_notifications()`` now and then (as
a receiver does anyway), or close the peer, else its owner's ``deregister`` waits for it until
the timeout. An nvlink holder answers from its transport's mailbox thread, whatever its caller
does. In both, the owner records holds in ``poll_notifications()`` (and ``deregister``): a
writer's first write after a ``connect`` waits (at most the same timeout) for that.

The control plane also says goodbye before a decode rank deregisters (``Goodbye``, answered
once no write of the prefill rank to it is in flight, after the prefill rank closed its peer).
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import msgpack
import numpy as np

__all__ = [
    "Notification",
    "Region",
    "RegionSizes",
    "WriteBatch",
    "StridedBatch",
    "TransferStatus",
    "Transfer",
    "Peer",
    "Transport",
    "TransportError",
    "TransportClosed",
    "PeerDescriptorError",
    "TransferFailed",
    "TransferTimeout",
    "RegionRevoked",
    "RevokeTimeout",
    "pack_descriptor",
    "unpack_descriptor",
]


class TransportError(RuntimeError):
    """Base class of transport failures that are not bad arguments."""


class TransportClosed(TransportError):
    """The transport or peer was closed before the call."""


class PeerDescriptorError(ValueError):
    """The peer's export bytes cannot be used (malformed, truncated, wrong backend/version)."""


class TransferFailed(TransportError):
    """A transfer ended in ``FAILED``; the message says why."""


class TransferTimeout(TransportError, TimeoutError):
    """``Transfer.wait`` ran out of time; the transfer is still pending."""


class RegionRevoked(TransportError, ValueError):
    """A write names a region of the peer that its owner revoked (deregistered): nothing was
    written. A ``ValueError`` too, as for any region id that is not (or no longer) registered."""


class RevokeTimeout(TransportError, TimeoutError):
    """``deregister`` could not revoke a region from every peer that can write into it (one
    neither acknowledged nor is known dead): the region stays registered."""


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Notification:
    """One delivered notification: who wrote it and the ``notify`` bytes of its transfer.

    ``sender`` is the sending transport's :attr:`Transport.name`, the name its export carries
    (and the receiver's ``Peer.name`` for it, if it connected back), so a receiver that serves
    many peers can match a payload to the peer it came from."""

    sender: str
    payload: bytes


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


class Transfer(abc.ABC):
    """A write in flight. Poll it, wait on it, or abort it."""

    max_poll_sleep_s: float = 1e-3  # longest sleep between polls in wait(); backends may lower it (0: yield only)

    @abc.abstractmethod
    def status(self) -> TransferStatus:
        """Non-blocking. Moves the transfer forward where the backend needs polling."""

    @property
    @abc.abstractmethod
    def error(self) -> Optional[str]:
        """Why the transfer failed, else None."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Cancel if still pending (status becomes FAILED, error starting 'aborted'); else
        no-op. Returns once no byte of the transfer can still land, or once its peer counts as
        lost (see "What FAILED and abort() guarantee" in the module docstring)."""

    def cancel(self) -> None:
        """:meth:`abort` without waiting, for a caller that serves others meanwhile (a control
        loop): the transfer ends FAILED ("aborted") once no byte of it can still land, and until
        then ``status()`` says PENDING. NIXL's direct writes implement it; other transfers
        (staged NIXL, whose abort waits for the receiver's answers, and NVLink) abort here."""
        self.abort()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until DONE; raise TransferFailed on failure, TransferTimeout after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = self._pauses()
        while True:
            st = self.status()
            if st is TransferStatus.DONE:
                return
            if st is TransferStatus.FAILED:
                raise TransferFailed(self.error or "transfer failed")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TransferTimeout(f"transfer still pending after {timeout} s")
            pause(left)

    def _pauses(self) -> Callable[[Optional[float]], None]:
        """How one :meth:`wait` pauses between polls: a function of the seconds left to its
        deadline (None: no deadline). Here: spin briefly, then back off to
        ``max_poll_sleep_s`` so a 2-core machine keeps a core for the backend's progress
        thread (0: never sleep, only yield the GIL; a Linux sleep lasts at least the 50 us
        timer slack). The back-off starts again whenever :meth:`_progress_mark` changes and
        never exceeds :meth:`_max_pause`. A backend that can sleep until its transfer settles
        overrides it."""
        sleep, seen = 0.0, self._progress_mark()

        def pause(left: Optional[float]) -> None:
            nonlocal sleep, seen
            mark = self._progress_mark()
            if mark != seen:
                sleep, seen = 0.0, mark
            if sleep or not self.max_poll_sleep_s:
                time.sleep(sleep)
            sleep = min(self._max_pause(), self.max_poll_sleep_s, sleep * 2 or 1e-5)

        return pause

    def _progress_mark(self):
        """What :meth:`wait` watches for progress (a transfer that moves in steps: its back-off
        starts again when this changes). Here nothing: the back-off only grows."""
        return None

    def _max_pause(self) -> float:
        """The longest pause between polls now (here ``max_poll_sleep_s``)."""
        return self.max_poll_sleep_s


class Peer(abc.ABC):
    """A connected remote transport: the target of writes.

    ``name``: the remote transport's :attr:`Transport.name`, from its export (the ``sender``
    of the notifications it writes here, if it connects back); ``regions``: the remote regions
    of that export by id, read-only."""

    name: str
    regions: Mapping[int, Region]

    def takes_strided(self, entries: int) -> bool:
        """Whether :meth:`write_strided` of a factored batch of ``entries`` ranges (``P * S``)
        does at least as well as :meth:`write` of its flat form: NVLink expands it on the
        device; NIXL stages a large one with O(P + S) host work. Where False (here),
        write_strided coalesces on the host, and a caller that can build the flat form directly
        (a plan's merged runs) should hand that to :meth:`write` instead."""
        return False

    def keeps_pairs(self) -> bool:
        """Whether :meth:`plan_pairs` makes a strided batch's pair set resident (NVLink's
        direct path keeps it on the device), so that a caller may hand over the pair sets of
        its writes ahead, at handshake, and the first write finds them built. True where a
        backend overrides :meth:`plan_pairs`."""
        return type(self).plan_pairs is not Peer.plan_pairs

    def plan_pairs(self, batch: StridedBatch) -> None:
        """Make ``batch``'s pair set resident now; the slots are not looked at. Here: nothing
        is kept (:meth:`keeps_pairs` is False)."""

    @abc.abstractmethod
    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> Transfer:
        """Start one batched write; ``notify`` is delivered to the peer after the data."""

    def write_strided(self, batch: StridedBatch, notify: Optional[bytes] = None) -> Transfer:
        """Start one factored write (see :class:`StridedBatch`); ``notify`` as for :meth:`write`.

        The default writes ``batch.coalesced()`` (whose bounds ``write`` checks, naming flat
        entries); backends that can expand on the device override it."""
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        return self.write(batch.coalesced(), notify)

    @abc.abstractmethod
    def close(self) -> None:
        """Forget this peer (idempotent). Pending transfers are aborted. A backend may keep
        its connection to the remote transport for a later ``connect`` to it (NIXL does, see
        :mod:`transport.nixl`): connect/close cycles to one remote transport must not grow
        this process's or the remote's resources."""


class Transport(abc.ABC):
    """One process's endpoint of a backend. See the module docstring for the contract.

    ``name``: this endpoint's name, unique per transport (backends default to one built from
    host, process and a random part); its export carries it, peers connected to that export
    report it as ``Peer.name`` and receivers as :attr:`Notification.sender`."""

    backend: str = "abstract"
    name: str

    @abc.abstractmethod
    def register(self, ptr: int, length: int, device: Optional[int] = None) -> int:
        """Register ``[ptr, ptr+length)`` on host (device None) or CUDA ``device``; return its id."""

    def register_tensor(self, tensor) -> int:
        """Register a contiguous torch tensor's storage range."""
        if not tensor.is_contiguous():
            raise ValueError(f"tensor must be contiguous, got strides {tuple(tensor.stride())}")
        device = tensor.device.index if tensor.device.type == "cuda" else None
        if tensor.device.type == "cuda" and device is None:
            raise ValueError("CUDA tensor without a device index")
        return self.register(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device)

    @abc.abstractmethod
    def deregister(self, region_id: int, force: bool = False) -> None:
        """Forget a region; later writes naming it fail with ValueError (``RegionRevoked`` from
        a peer that held it), and so does ``deregister`` of an id that is not registered. Peers
        that can still write into it let go first: it is revoked from them, waiting for each
        one's acknowledgement or loss (``RevokeTimeout``, the region kept, unless ``force``;
        module docstring, "Deregistering written-to memory")."""

    @property
    @abc.abstractmethod
    def regions(self) -> Mapping[int, Region]:
        """The live registered regions by id (a read-only view)."""

    @abc.abstractmethod
    def export(self) -> bytes:
        """Bytes for the peer's ``connect``: backend metadata plus the region table."""

    @abc.abstractmethod
    def connect(self, peer_bytes: bytes) -> Peer:
        """Connect to a peer's export. Raises PeerDescriptorError on bad bytes."""

    @abc.abstractmethod
    def poll_notifications(self) -> list[Notification]:
        """Notifications delivered since the last call (see :class:`Notification`); each
        sender's in the order it posted them."""

    def writer_gone(self, name: str) -> Optional[str]:
        """Why no write of the transport named ``name`` (a peer connected to this one's export)
        can land here any more -- it let go of the export, or it is known dead -- else None (it
        may still write, or nothing is known of it). What revocation knows of its holders
        (``transport.revocation``), asked for one of them: it does not block, and a backend may
        start a liveness probe here and answer on a later call. Here: None."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release peers, regions and threads (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


DESCRIPTOR_VERSION = 1


def pack_descriptor(backend: str, regions: Iterable[Region], **fields) -> bytes:
    """The common envelope of ``export()`` bytes: backend, version, region table, extras."""
    body = {"backend": backend, "version": DESCRIPTOR_VERSION, "regions": [r.to_wire() for r in regions]}
    body.update(fields)
    return msgpack.packb(body, use_bin_type=True)


def unpack_descriptor(data: bytes, backend: str, required: Iterable[str] = ()) -> tuple[dict, dict[int, Region]]:
    """Decode and check an export envelope; return (body, regions by id)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PeerDescriptorError(f"peer descriptor must be bytes, got {type(data).__name__}")
    try:
        body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad input
        raise PeerDescriptorError(f"peer descriptor is not valid msgpack ({len(data)} bytes): {exc}") from None
    if not isinstance(body, dict):
        raise PeerDescriptorError(f"peer descriptor must be a map, got {type(body).__name__}")
    if body.get("backend") != backend:
        raise PeerDescriptorError(f"peer descriptor is for backend {body.get('backend')!r}, expected {backend!r}")
    if body.get("version") != DESCRIPTOR_VERSION:
        raise PeerDescriptorError(
            f"peer descriptor version {body.get('version')!r}, expected {DESCRIPTOR_VERSION}"
        )
    missing = [k for k in ("regions", *required) if k not in body]
    if missing:
        raise PeerDescriptorError(f"peer descriptor lacks fields {missing}")
    if not isinstance(body["regions"], list):
        raise PeerDescriptorError("peer descriptor 'regions' must be a list")
    regions = {}
    for item in body["regions"]:
        reg = Region.from_wire(item)
        if reg.region_id in regions:
            raise PeerDescriptorError(f"peer descriptor repeats region id {reg.region_id}")
        regions[reg.region_id] = reg
    return body, regions
