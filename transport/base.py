"""The transport contract: batched one-sided writes between registered memory regions.

A transport knows nothing of KV caches, layers or heads: it moves byte ranges.

Who calls what
--------------
Each process owns one :class:`Transport` (one per backend). The owner

1. registers the memory it will write from or be written into::

       rid = transport.register(ptr, length, device=None)   # host memory
       rid = transport.register(ptr, length, device=0)      # CUDA ordinal 0

   A region id is a small int, dense from 0, never reused while the transport lives;
2. sends ``transport.export()`` (bytes, msgpack-able) to its peer through the control
   plane, and connects to the peer's bytes with ``peer = transport.connect(peer_bytes)``.
   The export is a snapshot: regions registered later need a new export/connect;
3. writes: ``t = peer.write(batch, notify=b"...")`` where ``batch`` is a
   :class:`WriteBatch` of parallel int64 arrays ``src_region, src_offset, dst_region,
   dst_offset, length`` (local region ids / offsets, the peer's region ids / offsets).
   The batch is validated once, vectorised: every entry must lie inside its registered
   regions or ``ValueError`` names the first bad entry and the region's bounds;
4. observes ``t.status()`` (a :class:`TransferStatus`), blocks with ``t.wait(timeout)``
   or gives up with ``t.abort()``;
5. on the receiving side, polls ``transport.poll_notifications()`` for the payloads of
   transfers that have landed: a notification is delivered only after all bytes of the
   write that carries it are visible in the receiver's memory;
6. closes: ``transport.close()`` (or ``with Transport(...) as t``) releases every peer,
   region and thread. Closing twice is harmless.

Threads
-------
A transport is used from one thread at a time (the owner's event loop). Backends may run
a progress thread of their own; that is configuration of the backend, not of callers.

Errors
------
- ``ValueError`` / ``TypeError``: bad arguments (a batch that is out of bounds, arrays of
  different lengths, an unknown region id, a negative length).
- :class:`PeerDescriptorError` (a ``ValueError``): the peer's export bytes are malformed,
  truncated, of another backend or protocol version.
- :class:`TransferFailed`: raised by ``wait`` when the transfer failed; ``status()`` is
  then ``FAILED`` and ``error`` holds the reason (peer lost, aborted, backend error).
- :class:`TransferTimeout` (a ``TimeoutError``): ``wait`` ran out of time; the transfer
  is still pending and may be waited on again or aborted.
- :class:`TransportClosed`: the transport (or peer) was closed.

Nothing here hangs: a dead peer surfaces as ``FAILED`` within the backend's bounded
peer-loss timeout.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import msgpack
import numpy as np

__all__ = [
    "Region",
    "WriteBatch",
    "TransferStatus",
    "Transfer",
    "Peer",
    "Transport",
    "TransportError",
    "TransportClosed",
    "PeerDescriptorError",
    "TransferFailed",
    "TransferTimeout",
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


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


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
        if rid < 0 or ptr < 0 or length <= 0 or device < -1:
            raise PeerDescriptorError(f"region entry out of range: {item!r}")
        return cls(rid, ptr, length, None if device == -1 else device)


def check_region_args(ptr: int, length: int, device: Optional[int]) -> None:
    """The argument checks every backend's ``register`` shares."""
    if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0:
        raise TypeError(f"ptr must be a positive int address, got {ptr!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
        raise ValueError(f"device must be None (host) or a CUDA ordinal >= 0, got {device!r}")


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
        values = [np.asarray(v) for v in (src_region, src_offset, dst_region, dst_offset, length)]
        sizes = {v.size for v in values if v.ndim != 0}
        n_common = sizes.pop() if len(sizes) == 1 else 1  # scalars broadcast to the arrays' length
        arrays = []
        for name, arr in zip(_BATCH_FIELDS, values):
            if arr.ndim == 0:
                arr = np.full(n_common, arr)
            if arr.ndim != 1:
                raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
            arrays.append(np.ascontiguousarray(arr, dtype=np.int64))
        n = arrays[0].size
        for name, arr in zip(_BATCH_FIELDS, arrays):
            if arr.size != n:
                raise ValueError(f"batch arrays differ in length: src_region has {n}, {name} has {arr.size}")
        for name, arr in zip(_BATCH_FIELDS, arrays):
            if n and arr.min() < 0:
                i = int(np.argmax(arr < 0))
                raise ValueError(f"batch entry {i}: {name} is negative ({arr[i]})")
        if n and arrays[4].min() == 0:
            i = int(np.argmax(arrays[4] == 0))
            raise ValueError(f"batch entry {i}: length is 0")
        return cls(*arrays)

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def check_bounds(self, local: Mapping[int, Region], remote: Mapping[int, Region]) -> None:
        """Raise ``ValueError`` naming the first entry outside its (local or remote) region."""
        _check_side(self.src_region, self.src_offset, self.length, local, "source (local)")
        _check_side(self.dst_region, self.dst_offset, self.length, remote, "destination (peer)")


def _check_side(region, offset, length, table: Mapping[int, Region], side: str) -> None:
    if region.size == 0:
        return
    lo, top = int(region.min()), int(region.max())
    sizes = np.full(top + 1, -1, dtype=np.int64)  # -1: unknown or deregistered id
    for rid, reg in table.items():
        if rid <= top:
            sizes[rid] = reg.length
    ends = offset + length
    # Fast path (a few reductions, no gather): every id in [lo, top] is registered and the
    # furthest end fits the smallest of them. Plans over equal-sized per-layer buffers
    # always take it; 2.6 M entries check in a few ms instead of tens.
    smallest = int(sizes[lo:].min())
    if smallest >= 0 and int(ends.max()) <= smallest:
        return
    known = sizes[region]
    bad = np.flatnonzero(known < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"batch entry {i}: {side} region {int(region[i])} is not registered "
            f"(known ids: {sorted(table)[:16]})"
        )
    over = np.flatnonzero(ends > known)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"batch entry {i}: {side} range [{int(offset[i])}, {int(offset[i] + length[i])}) "
            f"is outside region {int(region[i])} of {int(known[i])} bytes"
        )


class Transfer(abc.ABC):
    """A write in flight. Poll it, wait on it, or abort it."""

    @abc.abstractmethod
    def status(self) -> TransferStatus:
        """Non-blocking. Moves the transfer forward where the backend needs polling."""

    @property
    @abc.abstractmethod
    def error(self) -> Optional[str]:
        """Why the transfer failed, else None."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Cancel if still pending (status becomes FAILED, error 'aborted'); else no-op."""

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until DONE; raise TransferFailed on failure, TransferTimeout after ``timeout`` s."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        sleep = 0.0
        while True:
            st = self.status()
            if st is TransferStatus.DONE:
                return
            if st is TransferStatus.FAILED:
                raise TransferFailed(self.error or "transfer failed")
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(f"transfer still pending after {timeout} s")
            # Spin briefly, then back off to 1 ms so a 2-core machine keeps a core for
            # the backend's progress thread.
            if sleep:
                time.sleep(sleep)
            sleep = min(1e-3, sleep * 2 or 1e-5)


class Peer(abc.ABC):
    """A connected remote transport: the target of writes."""

    name: str
    regions: Mapping[int, Region]

    @abc.abstractmethod
    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> Transfer:
        """Start one batched write; ``notify`` is delivered to the peer after the data."""

    @abc.abstractmethod
    def close(self) -> None:
        """Forget this peer (idempotent). Pending transfers are aborted."""


class Transport(abc.ABC):
    """One process's endpoint of a backend. See the module docstring for the contract."""

    backend: str = "abstract"

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
    def deregister(self, region_id: int) -> None:
        """Forget a region; later writes naming it fail with ValueError."""

    @property
    @abc.abstractmethod
    def regions(self) -> Mapping[int, Region]:
        """The live registered regions by id."""

    @abc.abstractmethod
    def export(self) -> bytes:
        """Bytes for the peer's ``connect``: backend metadata plus the region table."""

    @abc.abstractmethod
    def connect(self, peer_bytes: bytes) -> Peer:
        """Connect to a peer's export. Raises PeerDescriptorError on bad bytes."""

    @abc.abstractmethod
    def poll_notifications(self) -> list[bytes]:
        """Notification payloads delivered since the last call, in arrival order."""

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
