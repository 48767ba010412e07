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
- :class:`PeerDraining` (a ``TransportError``): ``connect`` refused for now: writes of this
  transport to that peer still run in the backend (a lost peer's failed requests, or writes
  that loading its new export would cancel); nothing changed, connect again later.

Nothing here hangs: a dead peer surfaces as ``FAILED`` within the backend's bounded
peer-loss timeout.

What FAILED and abort() guarantee (late bytes)
----------------------------------------------
A destination's bytes may be reused for another write only once no byte of an earlier
write to them can still land:

- ``DONE``: every byte has landed; nothing of the transfer lands later.
- ``abort()`` returns only once the backend no longer runs the transfer (nixl: NIXL reports
  the request no longer in progress), so nothing of it lands after ``abort()`` returns
  (NVLink's returns at once, its copy possibly still queued on the GPU: ``cancel()`` below
  says when it ended). It
  waits at most until the transfer's peer-loss deadline; a peer that does not progress it by
  then is *lost* (below). ``Peer.close()`` aborts its pending transfers the same way.
  ``cancel()`` is the same without the wait: the transfer stays ``PENDING`` until nothing of it
  can land, then ends ``FAILED`` ("aborted") -- for a loop that must serve other requests while
  a stalled peer holds one back.
- ``FAILED`` at the deadline (or from a backend error): the bytes already posted may still
  land (over tcp they sit in socket buffers until the peer reads them). The transport then
  treats that remote transport as lost: writes to it fail at once ("lost earlier") until a
  new ``connect`` to it, which refuses (:class:`PeerDraining`) while the failed requests are
  still running in the backend, so no later write of this transport is overtaken by them.
  ``Peer.lost`` says why a peer is lost so (None while writes to it may go), for a caller
  that connects again instead of failing every later write.
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
one loop and one set of messages (:mod:`transport.revocation`; :mod:`transport.nixl.revoke`
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
import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

# The contract's batch types, errors and export envelope live in their own modules; they are
# named here too, so that ``transport.base`` stays the one place a backend imports them from.
from transport.batch import (ADDRESS_END, MAX_DEVICE, MAX_OFFSET, MAX_REGION_ID, MIN_ADDRESS, SMALL_BATCH,  # noqa: F401
                             Region, RegionSizes, StridedBatch, WriteBatch, check_ranges, check_region_args,
                             check_strided_side)
from transport.envelope import DESCRIPTOR_VERSION, pack_descriptor, unpack_descriptor  # noqa: F401
from transport.errors import (PeerDescriptorError, PeerDraining, RegionRevoked, RevokeTimeout,  # noqa: F401
                              TransferFailed, TransferTimeout, TransportClosed, TransportError)

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
    "PeerDraining",
    "TransferFailed",
    "TransferTimeout",
    "RegionRevoked",
    "RevokeTimeout",
    "pack_descriptor",
    "unpack_descriptor",
]


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


class Transfer(abc.ABC):
    """A write in flight. Poll it, wait on it, or abort it."""

    max_poll_sleep_s: float = 1e-3  # longest sleep between polls in wait(); backends may lower it (0: yield only)
    # wait() polls without sleeping this long first, yielding the CPU between polls: a small
    # write is done in tens to hundreds of microseconds (NIXL over tcp loopback, polled back to
    # back: one 2 KiB row ~20 us, 160 rows ~150 us), and a Linux sleep lasts at least the 50 us
    # timer slack, which made a one-row write take ~150 us through wait()
    spin_s: float = 5e-4

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
        lost (see "What FAILED and abort() guarantee" in the module docstring). NVLink's
        returns at once: its copy, queued on the GPU, may still run (its :meth:`cancel` says
        when it no longer can)."""

    def cancel(self) -> None:
        """:meth:`abort` without waiting, for a caller that serves others meanwhile (a control
        loop): the transfer ends FAILED ("aborted") once no byte of it can still land, and until
        then ``status()`` says PENDING. NIXL's writes (direct and staged) and NVLink's
        implement it; other transfers abort here."""
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
        deadline (None: no deadline). Here: poll back to back (yielding the GIL) for
        ``spin_s``, then back off to ``max_poll_sleep_s`` so a 2-core machine keeps a core
        for the backend's progress thread (0: never sleep, only yield the GIL; a Linux sleep,
        ``time.sleep(0)`` included, lasts at least the 50 us timer slack). The back-off starts again whenever
        :meth:`_progress_mark` changes and never exceeds :meth:`_max_pause`. A backend that
        can sleep until its transfer settles overrides it."""
        sleep, seen, spin_end = 0.0, self._progress_mark(), time.monotonic() + self.spin_s

        def pause(left: Optional[float]) -> None:
            nonlocal sleep, seen
            mark = self._progress_mark()
            if mark != seen:
                sleep, seen = 0.0, mark
            if time.monotonic() < spin_end or not self.max_poll_sleep_s:
                os.sched_yield()  # the GIL goes round; time.sleep(0) would last the timer slack
                return
            if sleep:
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

    @property
    def lost(self) -> Optional[str]:
        """Why the transport refuses every write to this peer until a new ``connect`` to the
        peer's export (a write to it failed in the backend or stalled past its deadline, or its
        connection ended: see "What FAILED and abort() guarantee"), else None. Read without
        blocking. Here: None, never lost."""
        return None

    def takes_strided(self, entries: int) -> bool:
        """Whether :meth:`write_strided` of a factored batch of ``entries`` ranges (``P * S``)
        does at least as well as :meth:`write` of its flat form: NVLink expands it on the
        device; NIXL stages a large one with O(P + S) host work. Where False (here),
        write_strided coalesces on the host, and a caller that can build the flat form directly
        (a plan's merged runs) should hand that to :meth:`write` instead."""
        return False

    def orders_on_device(self) -> bool:
        """Whether a write reads its source in device order: after the work queued on the
        caller's current CUDA stream before the call (NVLink, ``wait_current_stream``). A caller
        may then post a write of bytes a kernel still computes, from a stream that waits for
        that kernel. Where False (here, and NIXL, which reads memory when it moves it), the
        source must be complete when the write is posted."""
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

    def notification_fd(self) -> Optional[int]:
        """A file descriptor that turns readable when :meth:`poll_notifications` may have new
        notifications, and that the call clears: a receiver may sleep in ``select``/``poll`` on
        it, with its other descriptors, instead of calling at short intervals. None (here): the
        backend has none, the receiver polls."""
        return None

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
