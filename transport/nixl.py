"""The ``nixl`` backend: UCX one-sided writes through NVIDIA NIXL.

One :class:`NixlTransport` owns one NIXL agent (one UCX context). Host regions register as
NIXL ``DRAM``, CUDA regions as ``VRAM`` with their device ordinal. ``export()`` is the common
envelope of :func:`transport.base.pack_descriptor` with two extra fields::

    {"backend": "nixl", "version": 1,
     "regions": [[id, ptr, length, device], ...],   # device -1: host
     "agent": "<agent name>",                       # NIXL agent name, unique per process
     "scratch": <address>,                          # 64 host bytes for notification-only writes
     "metadata": b"..."}                            # nixl_agent.get_agent_metadata()

A write is ONE NIXL transfer request: the batch's five parallel arrays become two ``[n, 3]``
uint64 descriptor arrays ``(address, length, device)`` (no Python loop per entry) handed to
``initialize_xfer``, or block indices into prepared lists (below). The notification rides on
that request, and NIXL's UCX backend sends it only after the request's data is flushed to the
target, so a delivered notification means its bytes have landed.

Staged writes (:mod:`transport.nixl_staged`, ``NixlConfig.staged``): a batch of many small
ranges (``StagedNixlConfig.wants``) is gathered into a registered staging lane and written as
one NIXL write per slot; the receiver scatters it in ``poll_notifications()`` before it hands
the write's notification over. ``NixlPeer.write_strided`` stages a factored batch
(``StridedBatch``, P buffer pairs x S slots) the same way with O(P + S) host work per write
(``StagedNixlConfig.wants_strided``), else writes its coalesced form; with the staged mode on
the peer takes a large plan's factored form (``takes_strided``), and kvtransfer hands it that. Every
other batch is the one request described here.

Descriptor strategy: a direct write whose offsets and lengths share a power-of-two granule,
within ``nixl_prepped.MAX_INDICES`` blocks of it, is made from block indices into strided lists
prepared once per (memory kind, granule) -- one for this agent's regions, one per peer snapshot
(``prep_xfer_dlist`` / ``make_prepped_xfer``; :mod:`transport.nixl_prepped`, with when each
list is released); NIXL merges consecutive blocks back into one descriptor. Any other batch
(large writes of many blocks) is two descriptor arrays built from numpy as above and
``initialize_xfer``: for those the lists save nothing measurable (~2 % of a 1 GiB write's time
on loopback, inside the run-to-run noise; figures: bench/RESULTS.md).

Progress thread (default OFF; figures from ``kvtransfer bench transport``: bench/RESULTS.md).
On two cores the progress thread competes with the pollers for a core and costs 1.5-4x. With
sm in UCX_TLS, one host's writes go through cma and finish inside the post. Without the
thread, progress happens inside calls into the transport: the writer's
``Transfer.status()``/``wait()`` and the receiver's ``poll_notifications()``. Over tcp the
receiver must poll regularly (with it polling every 200 ms, writes took 200 ms); turn the thread
on (``NixlConfig(progress_thread=True)``) for a receiver that does not poll.

Notifications: ``poll_notifications()`` returns a :class:`~transport.base.Notification` per
payload, its ``sender`` the writing agent's name (the ``agent`` of its export, its
``NixlTransport.name``); each sender's in arrival order, different senders' not ordered
against each other.

Connecting again to a newer export of an already connected agent reloads its metadata in
place: the old :class:`NixlPeer` refuses new writes (TransportClosed) but its pending writes
complete. Deregister a region only once no pending transfer uses it. In place means added to:
NIXL keeps an entry for every region of the agent it was ever given and looks a range up in the
entry at or just before its address, so once the agent deregistered a region that overlaps one
its newer export names (its memory reused, or the same range registered again), that entry could
refuse writes into the new region (``NIXL_ERR_NOT_FOUND``) or resolve them to the old
registration. The entries of an agent are what its exports named and what the metadata of its
staged Hello or Welcome registered (its regions then and its lanes' staging memory, listed in
the message: ``wire.registered_entries``). Such an export is loaded afresh instead
(:func:`_stale_overlap`): the agent's metadata, its staged lane and its endpoint are dropped
first -- refused with a TransportError while a write of this transport to it is in flight --
and one more endpoint is opened (see Connections).

Revocation (:mod:`transport.nixl_revoke`): ``connect`` tells the owner of the export that this
transport holds it (a direct write waits for the owner's acknowledgement), and ``deregister``
revokes a region from every holder that can address it, waiting for their acknowledgement or
their loss (at most ``NixlConfig.revoke_timeout_s``) before it releases it; a later write to a
revoked region raises ``RegionRevoked``. Protocol and timeouts: that package's docstring.

Connections: ``NixlPeer.close()`` refuses further writes through that peer but keeps the remote
agent loaded in NIXL, idle, and a later ``connect`` to the same agent reuses its endpoint. NIXL
cannot release a live peer's endpoint: ``remove_remote_agent`` (``invalidateRemoteMD``) drops
NIXL's connection, but over tcp each side's UCP worker keeps the endpoint the wire-up created,
so the socket stays open on both sides (measured: +1 open socket per connect/remove cycle in the
writer and in the receiver, also when the receiver loads and removes the writer's metadata too)
until a worker is destroyed (``NixlTransport.close``) or the other process exits. So connections
are bounded by the distinct live agents a transport has connected to; an agent whose transfer
failed in the backend (peer lost) is removed from NIXL when its peer closes.

Aborts and failures (the contract's "late bytes"): releasing an active NIXL request does not
stop bytes UCX already has (measured over tcp: ~3.7 MB of an aborted 32 MiB write landed after
the release returned, once the stopped receiver ran again). So ``abort()`` polls the request
until NIXL no longer reports it in progress, then releases it; a request that fails at its
deadline is kept (not released) in a per-agent drain list and the agent is marked lost: writes
to it fail at once, and ``connect`` to it refuses until the drain list is empty, then tears the
old endpoint down and loads the agent afresh.

Peer loss: when the peer process dies, UCX reports ``NIXL_ERR_REMOTE_DISCONNECT`` from the
status check (within milliseconds of SIGKILL over tcp, bench/RESULTS.md). A peer that is alive but stalled
(SIGSTOP) leaves the request pending forever, so each transfer carries its own deadline,
``peer_loss_timeout_s + nbytes / min_throughput``: past it, ``status()`` releases the request
(cancelling it) and reports FAILED.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from transport._nixl_import import load_nixl_api
from transport.base import (
    Notification,
    Peer,
    PeerDescriptorError,
    Region,
    RegionRevoked,
    RegionSizes,
    SMALL_BATCH,
    StridedBatch,
    Transfer,
    TransferStatus,
    Transport,
    TransportClosed,
    TransportError,
    WriteBatch,
    pack_descriptor,
    unpack_descriptor,
)
from transport.nixl_prepped import MAX_INDICES, PreparedLists, prepped_indices, shape_of
from transport.nixl_revoke import Holders, Holds
from transport.revocation import wire as revoke_wire
from transport.nixl_staged import wire as staged_wire
from transport.nixl_staged.config import StagedNixlConfig
from transport.nixl_staged.receiver import ReceiverLanes
from transport.nixl_staged.sender import DeferredWrite, LaneState, SenderLane, StagedTransfer, StridedStagedTransfer
from transport.registry import RegionRegistry

__all__ = ["NixlConfig", "NixlTransport", "NixlPeer", "NixlTransfer"]

BACKEND = "nixl"
_SCRATCH_BYTES = 64
# how long one pump keeps reading NIXL's notifications while staged scatters run (so the next
# chunks are handled meanwhile) before it only waits for those scatters and returns: a bound on
# how long a poll holds its caller beyond the scatters themselves
_READ_WHILE_SCATTERING_S = 1e-3


@dataclass(frozen=True)
class NixlConfig:
    """Configuration of one NIXL agent.

    agent_name: unique name of this process's agent; None picks ``kvt-<host>-<pid>-<random>``.
    progress_thread: run NIXL's progress thread (see the module docstring for the measurement).
    backends: NIXL backend plugins to create; writes use only these.
    num_threads: UCX backend worker threads (0: NIXL's default).
    peer_loss_timeout_s: a transfer still pending this long past the time its bytes need at
        ``min_throughput_gbps`` is failed as "peer lost or stalled".
    min_throughput_gbps: slowest throughput (GB/s) still considered alive.
    staged: when a write goes through staging (many small ranges), and the staging's size
        (:mod:`transport.nixl_staged`); this side's ``max_lanes`` / lane size also bound what
        it grants senders.
    revoke_timeout_s: how long ``deregister`` waits for the peers that hold an export naming
        the region to acknowledge its revocation (or be found dead) before it refuses
        (``RevokeTimeout``), and how long a first direct write waits for the owner to record
        this transport's hold (:mod:`transport.nixl_revoke`).
    """

    agent_name: Optional[str] = None
    progress_thread: bool = False
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    peer_loss_timeout_s: float = 10.0
    min_throughput_gbps: float = 0.1
    staged: StagedNixlConfig = field(default_factory=StagedNixlConfig)
    revoke_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.agent_name is not None and (not isinstance(self.agent_name, str) or not self.agent_name):
            raise ValueError(f"agent_name must be a non-empty str or None, got {self.agent_name!r}")
        if not isinstance(self.backends, tuple) or not self.backends or not all(
            isinstance(b, str) and b for b in self.backends
        ):
            raise ValueError(f"backends must be a non-empty tuple of names, got {self.backends!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"num_threads must be an int >= 0, got {self.num_threads!r}")
        if not self.peer_loss_timeout_s > 0:
            raise ValueError(f"peer_loss_timeout_s must be > 0, got {self.peer_loss_timeout_s!r}")
        if not self.min_throughput_gbps > 0:
            raise ValueError(f"min_throughput_gbps must be > 0, got {self.min_throughput_gbps!r}")
        if not self.revoke_timeout_s > 0:
            raise ValueError(f"revoke_timeout_s must be > 0, got {self.revoke_timeout_s!r}")
        if not isinstance(self.staged, StagedNixlConfig):
            raise TypeError(f"staged must be a StagedNixlConfig, got {type(self.staged).__name__}")

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` may stay pending before it counts as lost."""
        return self.peer_loss_timeout_s + nbytes / (self.min_throughput_gbps * 1e9)


_LIVE_NAMES: set[str] = set()  # agent names of this process's open transports


def _ucx_tls_hint() -> str:
    """Why an agent may not start: UCX_TLS without tcp (NIXL's UCX backend connects the agent
    to itself at start, which needs tcp on one host too)."""
    tls = os.environ.get("UCX_TLS")
    if tls is None or "tcp" in tls.split(",") or tls.startswith("^") or "all" in tls.split(","):
        return ""
    return f" -- UCX_TLS={tls!r} lacks tcp: keep tcp in UCX_TLS, also on one host (e.g. tcp,self,sm)"


def _default_agent_name() -> str:
    return f"kvt-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class _RegionTable:
    """Region id -> pointer / device arrays for vectorised descriptor building.

    ``ptr[id]`` is the base address, ``dev[id]`` the CUDA ordinal or -1 for host. Ids are
    dense from 0; a deregistered id keeps a stale entry, but batches are bounds-checked
    against the live regions (``sizes``) before the table is indexed.
    """

    def __init__(self, regions: Mapping[int, Region]):
        self.sizes = RegionSizes(regions)  # what check_bounds reads: no loop over regions per write
        top = max(regions, default=-1) + 1
        self.ptr = np.zeros(top, dtype=np.uint64)  # [num_ids]
        self.dev = np.full(top, -1, dtype=np.int64)  # [num_ids]
        for rid, reg in regions.items():
            self.ptr[rid] = reg.ptr
            self.dev[rid] = -1 if reg.device is None else reg.device
        self.listed = (self.ptr.tolist(), self.dev.tolist())  # the same as Python ints, for small batches

    def mem_of(self, region_id: int) -> str:
        """NIXL's memory type of region ``region_id`` (a checked id)."""
        return "DRAM" if self.listed[1][region_id] < 0 else "VRAM"

    def descs(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray, side: str) -> tuple[np.ndarray, str]:
        """Return the ``[n, 3]`` uint64 (address, length, device) array and its NIXL memory type."""
        if 0 < region.size <= SMALL_BATCH:  # a small request's batch: Python ints beat numpy's cost per call
            ptr, devs = self.listed
            rows = [(ptr[r] + o, n, devs[r]) for r, o, n in zip(region.tolist(), offset.tolist(), length.tolist())]
            cuda = [d >= 0 for _, _, d in rows]
            if any(cuda) and not all(cuda):
                self._mixed(region, cuda.index(not cuda[0]), side)
            out = np.array([(a, n, max(d, 0)) for a, n, d in rows], dtype=np.uint64).reshape(-1, 3)
            return out, "VRAM" if cuda and cuda[0] else "DRAM"
        dev = self.dev[region]  # [n]
        cuda = dev >= 0
        if cuda.all():
            mem = "VRAM"
        elif not cuda.any():
            mem = "DRAM"
        else:
            self._mixed(region, int(np.argmax(cuda != cuda[0])), side)
        out = np.empty((region.size, 3), dtype=np.uint64)  # [n, (addr, len, dev)]
        out[:, 0] = self.ptr[region] + offset.astype(np.uint64)
        out[:, 1] = length
        out[:, 2] = np.maximum(dev, 0)
        return out, mem

    @staticmethod
    def _mixed(region: np.ndarray, i: int, side: str) -> None:
        raise ValueError(f"batch mixes host and CUDA {side} regions (entry 0: region {int(region[0])}, entry {i}: "
                         f"region {int(region[i])}); split it into one batch per memory kind")


class NixlTransfer(Transfer):
    """One NIXL transfer request. Progress and peer-loss detection happen in ``status()``."""

    def __init__(self, peer: "NixlPeer", handle, nbytes: int, deadline_s: float, src_region=None,
                 dst_region=None):
        self._peer = peer
        self._src_region = src_region  # [n] the batch's local region ids (what deregister must not pull)
        self._dst_region = dst_region  # [n] the peer's region ids (what a revoke of them waits for)
        self._handle = handle  # nixl_xfer_handle, None once released
        self._status = TransferStatus.PENDING
        self._error: Optional[str] = None
        self._deadline_s = deadline_s
        self._deadline = time.monotonic() + deadline_s
        self._cancelled = False  # cancel() asked: FAILED ("aborted") once NIXL no longer runs it
        self.nbytes = nbytes

    @classmethod
    def finished(cls, peer: "NixlPeer", status: TransferStatus, error: Optional[str] = None) -> "NixlTransfer":
        t = cls(peer, None, 0, 0.0)
        t._status, t._error = status, error
        return t

    @property
    def error(self) -> Optional[str]:
        return self._error

    def status(self) -> TransferStatus:
        if self._status is not TransferStatus.PENDING:
            return self._status
        agent = self._peer._transport._agent_or_none()
        if agent is None:
            self._finish(TransferStatus.FAILED, "transport closed")
            return self._status
        self._peer._transport._service()  # revokes are answered while the owner waits on transfers
        if self._status is not TransferStatus.PENDING:
            return self._status
        aborted = "aborted; " if self._cancelled else ""
        try:
            state = agent.check_xfer_state(self._handle)
        except Exception as exc:  # nixlRemoteDisconnectError and other backend errors
            self._lose(f"{aborted}peer {self._peer.name!r}: {type(exc).__name__}: {exc}")
            return self._status
        if self._cancelled and state != "PROC":
            self._finish(TransferStatus.FAILED, "aborted")
        elif state == "DONE":
            self._finish(TransferStatus.DONE)
        elif state != "PROC":
            self._finish(TransferStatus.FAILED, f"peer {self._peer.name!r}: NIXL reported {state}")
        elif time.monotonic() > self._deadline:
            self._lose(f"{aborted}peer {self._peer.name!r}: {self.nbytes} bytes not done after {self._deadline_s:.1f} s "
                       "(peer lost or stalled)")
        return self._status

    def cancel(self) -> None:
        """:meth:`abort` without waiting: the transfer stays PENDING until NIXL no longer runs
        it (no byte of it can land after that), then ends FAILED ("aborted"); at its deadline
        the peer is lost, as for abort. ``status()`` moves it on."""
        if self._status is TransferStatus.PENDING:
            self._cancelled = True
            self.status()

    def abort(self) -> None:
        """Cancel if still pending, and return only once no byte of it can still land: NIXL's
        cancel (releasing an active request) does not stop bytes already handed to UCX (over
        tcp, megabytes of an aborted write landed after it), so abort waits until NIXL reports
        the request no longer in progress, at most until the transfer's deadline. A peer that
        does not progress it by then is lost: see the module docstring."""
        self.cancel()
        sleep = 0.0
        while self.status() is TransferStatus.PENDING:
            time.sleep(sleep)
            sleep = min(self.max_poll_sleep_s, sleep * 2 or 1e-5)

    def _cancel(self) -> None:
        """Fail and release now, without waiting (the transport is closing: its agent goes)."""
        if self._status is TransferStatus.PENDING:
            self._finish(TransferStatus.FAILED, "transport closed")

    def _lose(self, error: str) -> None:
        """FAILED, and the remote agent is lost: this transport refuses further writes to it
        until a new ``connect`` to it, which waits until NIXL no longer progresses this request
        (its bytes may still land until then: releasing it does not stop them)."""
        transport = self._peer._transport
        transport._lost.setdefault(self._peer.name, error)
        self._status, self._error = TransferStatus.FAILED, error
        handle, self._handle = self._handle, None
        if handle is not None:
            transport._draining.setdefault(self._peer.name, []).append(handle)
        transport._holds.answer()

    def _finish(self, status: TransferStatus, error: Optional[str] = None) -> None:
        """Enter a terminal state and release the NIXL request (cancelling it if still active)."""
        self._status, self._error = status, error
        handle, self._handle = self._handle, None
        if handle is not None:
            self._peer._transport._release_handle(handle)
            self._peer._transport._holds.answer()  # a revoke may have waited for this write


class NixlPeer(Peer):
    """A connected remote agent. Writes go to its exported regions."""

    def __init__(self, transport: "NixlTransport", name: str, regions: Mapping[int, Region], scratch_ptr: int):
        self._transport = transport
        self.name = name
        self._scratch_ptr = scratch_ptr
        self.regions = RegionRegistry.frozen(regions)
        self._table = _RegionTable(self.regions)
        self._pending: "weakref.WeakSet[NixlTransfer]" = weakref.WeakSet()
        self._closed: Optional[str] = None  # why writes are refused, once closed or replaced
        self._hold_seq = 0  # the Hold sent for this snapshot (transport.nixl_revoke): direct writes wait for its ack
        self._prepared = PreparedLists(transport._agent_checked, name, self._live_regions,
                                       list(transport.config.backends))  # transport.nixl_prepped

    def takes_strided(self, entries: int) -> bool:
        """With the staged mode on, a batch of at least its ``min_rows`` ranges: :meth:`write_strided`
        stages it with O(P + S) host work (or writes its coalesced form, which has as many entries
        as a plan's own merged runs). A smaller one goes direct, where the plan's flat form costs
        the host least (a small request's write through the factored form took twice as long)."""
        staged = self._transport.config.staged
        return staged.enabled and entries >= staged.min_rows

    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> NixlTransfer:
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is {self._closed}")
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, got {type(batch).__name__}")
        notif = self._admit(batch, notify)
        return notif if isinstance(notif, NixlTransfer) else self._route(batch, notif)

    def write_strided(self, batch: StridedBatch, notify: Optional[bytes] = None):
        """A factored write (:class:`~transport.base.StridedBatch`). Staged
        (:class:`~transport.nixl_staged.sender.StridedStagedTransfer`, host work O(P + S) per
        write) when ``StagedNixlConfig.wants_strided`` takes it, each side is on one memory and
        its destination table fits the lane's slots (``wire.strided_fits``), unless its sources
        are host memory in runs of ``wire_gather_bytes`` on average (``StridedBatch.source_runs``):
        the flat staged write then has the wire gather the runs, with no local copy, which beats
        the strided write's copy for runs of 32 KiB and more (bench/RESULTS.md).
        Otherwise its coalesced form as :meth:`write` writes it. Bounds (O(P + S)) and revocation
        are checked here either way."""
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is {self._closed}")
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        notif = self._admit(batch, notify)
        if isinstance(notif, NixlTransfer):
            return notif
        transport = self._transport
        cfg = transport.config.staged
        lane = transport._lanes.get(self.name)
        if cfg.wants_strided(batch):
            kinds = self._kinds(batch)
            if kinds is not None and kinds[0] is None and batch.nbytes >= cfg.wire_gather_bytes * batch.source_runs():
                kinds = None  # host sources in long runs: the flat staged write lets the wire gather them
            if kinds is not None and (lane is None or (lane.matches(*kinds) and lane.state is not LaneState.REFUSED)):
                slot_bytes = lane.slot_bytes if lane is not None else cfg.slot_bytes_for(kinds[1])
                if staged_wire.strided_fits(batch.num_pairs, batch.num_slots, int(batch.length.max()), slot_bytes):
                    lane = lane or transport._open_lane(self, *kinds)
                    src_addr = transport._table().ptr[batch.src_region].astype(np.int64) + batch.src_offset  # [P]
                    return self._queued(lane, StridedStagedTransfer(self, batch, notif, src_addr, lane.slot_bytes))
        return self._route(batch.coalesced(), notif)

    def _admit(self, batch, notify: Optional[bytes]):
        """The checks every write passes before it is routed: ``notify`` (its bytes returned),
        the batch's bounds against both region tables, revoked regions; a FAILED transfer for a
        peer lost earlier."""
        if notify is not None and (not isinstance(notify, (bytes, bytearray)) or not notify):
            raise TypeError(f"notify must be non-empty bytes or None, got {notify!r:.60}")
        transport = self._transport
        transport._agent_checked()
        transport._pump()  # a revoke that came meanwhile applies to this write
        batch.check_bounds(transport._table().sizes, self._table.sizes)
        revoked = transport._holds.check(self.name, batch.dst_region)
        if revoked is not None:
            raise RegionRevoked(revoked)
        lost = transport._lost.get(self.name)
        if lost is not None:  # a later write must not race bytes of a failed one: connect again first
            return NixlTransfer.finished(self, TransferStatus.FAILED, f"peer {self.name!r} was lost earlier "
                                         f"(connect to a new export first): {lost}")
        notif = bytes(notify) if notify is not None else b""
        if notif.startswith(staged_wire.MAGIC):
            raise ValueError(f"notify must not start with {staged_wire.MAGIC!r} (reserved for staged writes)")
        if notif.startswith(revoke_wire.MAGIC):
            raise ValueError(f"notify must not start with {revoke_wire.MAGIC!r} (reserved for revocation)")
        return notif

    def _route(self, batch: WriteBatch, notif: bytes):
        """A checked flat batch: staged, queued behind a staged write, or direct."""
        transport = self._transport
        lane = transport._lanes.get(self.name)
        if len(batch) and transport.config.staged.wants(batch):
            kinds = self._kinds(batch)
            if kinds is not None and (lane is None or (lane.matches(*kinds) and lane.state is not LaneState.REFUSED)):
                lane = lane or transport._open_lane(self, *kinds)
                src_addr = transport._table().ptr[batch.src_region].astype(np.int64) + batch.src_offset  # [n]
                same = bool((batch.length == batch.length[0]).all())
                order = None if same else np.argsort(batch.length, kind="stable")  # equal lengths side by side
                return self._queued(lane, StagedTransfer(self, batch, notif, src_addr, order, lane.slot_bytes))
        if lane is not None and lane.busy:  # behind a staged write still posting: keep the order
            if len(batch) and self._kinds(batch) is None:  # the ValueError now, not when its turn comes
                transport._table().descs(batch.src_region, batch.src_offset, batch.length, "source")
                self._table.descs(batch.dst_region, batch.dst_offset, batch.length, "destination")
            return self._queued(lane, DeferredWrite(self, batch, notif))
        return self._direct(batch, notif)

    def _queued(self, lane: SenderLane, job):
        self._pending.add(job)
        return lane.submit(job)

    def _kinds(self, batch) -> Optional[tuple[Optional[int], Optional[int]]]:
        """(source device, destination device) (None: host) when each side of a batch (flat or
        strided: its region arrays) is on one memory, else None."""
        kinds = []
        for table, region in ((self._transport._table(), batch.src_region), (self._table, batch.dst_region)):
            dev = table.dev[region]  # [n]
            if not (dev == dev[0]).all():
                return None
            kinds.append(None if dev[0] < 0 else int(dev[0]))
        return kinds[0], kinds[1]

    def _direct(self, batch: WriteBatch, notif: bytes) -> NixlTransfer:
        """The batch as ONE NIXL request (module doc)."""
        transport = self._transport
        if len(batch) == 0 and not notif:
            return NixlTransfer.finished(self, TransferStatus.DONE)
        if len(batch):  # the owner must know this transport holds its export before a byte lands
            why = transport._holds.wait_ready(self.name, self._hold_seq, transport.config.revoke_timeout_s)
            why = why or transport._holds.check(self.name, batch.dst_region)  # revoked (also while queued)
            if why is not None:
                return NixlTransfer.finished(self, TransferStatus.FAILED, why)
        try:
            if len(batch) == 0:  # notification only: one scratch byte carries it (see _SCRATCH_BYTES)
                handle, state = transport._post_notify(self.name, self._scratch_ptr, notif)
            elif (prepped := self._prepped(batch)) is not None:  # indices into lists prepared once
                handle, state = transport._post_prepped(self.name, *prepped, notif)
            else:
                local, local_mem = transport._table().descs(batch.src_region, batch.src_offset, batch.length, "source")
                remote, remote_mem = self._table.descs(batch.dst_region, batch.dst_offset, batch.length,
                                                       "destination")
                handle, state = transport._post(self.name, local, local_mem, remote, remote_mem, notif)
        except TransportError as exc:  # the peer is gone or NIXL refused the request
            return NixlTransfer.finished(
                self, TransferStatus.FAILED, f"peer {self.name!r}: could not post: {exc}")
        nbytes = batch.nbytes
        t = NixlTransfer(self, handle, nbytes, transport.config.deadline_s(nbytes), batch.src_region,
                         batch.dst_region if len(batch) else None)
        if state == "DONE":
            t._finish(TransferStatus.DONE)
        elif state != "PROC":
            t._finish(TransferStatus.FAILED, f"peer {self.name!r}: NIXL reported {state} when posting")
        else:
            self._pending.add(t)
        return t

    def _prepped(self, batch: WriteBatch) -> Optional[tuple]:
        """``(local list, local indices, remote list, remote indices)`` of a checked, non-empty
        batch through prepared lists (:mod:`transport.nixl_prepped`), or None: descriptors."""
        if self._closed:  # a write queued before this snapshot closed: no list is prepared for it any more
            return None
        transport = self._transport
        local_mem = transport._table().mem_of(int(batch.src_region[0]))
        remote_mem = self._table.mem_of(int(batch.dst_region[0]))
        granule, nbytes, rows = shape_of(batch)
        finest = self._prepared.finest(remote_mem)  # a list that exists serves a multiple of its granule
        if finest is not None and finest <= granule and nbytes // finest <= MAX_INDICES:
            granule = finest
        if nbytes // granule > MAX_INDICES:
            return None
        local = transport._prepared.get(local_mem, granule)
        remote = self._prepared.get(remote_mem, granule) if local is not None else None
        if remote is None:
            return None
        indices = prepped_indices(batch, rows, local, remote)
        return None if indices is None else (local, indices[0], remote, indices[1])

    def _live_regions(self) -> Mapping[int, Region]:
        """The regions of this snapshot a prepared list may name: not revoked since."""
        holds = self._transport._holds
        return {rid: reg for rid, reg in self.regions.items()
                if holds.check(self.name, np.array([rid], dtype=np.int64)) is None}

    def close(self) -> None:
        self._close(drain=True)

    def _close(self, drain: bool) -> None:
        """Pending transfers are aborted (``drain``: waiting as :meth:`NixlTransfer.abort` does)."""
        if self._closed == "closed":
            return
        self._closed = "closed"
        for t in list(self._pending):
            t.abort() if drain else t._cancel()
        self._pending = weakref.WeakSet()
        self._prepared.release()
        self._transport._forget_peer(self)

    def _retire(self) -> None:
        """A newer export of the same agent was connected: refuse new writes, let pending ones finish."""
        if not self._closed:
            self._closed = "closed (replaced by a newer connect to the same agent)"
        self._prepared.release()


def _descs(regions: Mapping[int, Region]) -> set:
    """``(region id, ptr, length, device)`` of each region (device -1: host memory)."""
    return {(rid, r.ptr, r.length, -1 if r.device is None else r.device) for rid, r in regions.items()}


_STAGING = -1  # the region id of a staged lane's memory among what an agent's metadata registers


def _stale_overlap(loaded, regions: Mapping[int, Region]) -> bool:
    """Whether an entry NIXL holds for a remote agent (``loaded``: what :func:`_descs` gave for
    each export loaded in place, and what its staged Hello or Welcome listed) belongs to a region
    the agent's newer export (``regions``) no longer names -- deregistered, registered again, or
    a lane's staging memory -- and overlaps a region it names (module doc: such an export is
    loaded afresh)."""
    current = _descs(regions)
    stale = [d for d in loaded if d not in current]
    if not stale or not current:
        return False
    _, ptr, length, dev = (np.array(col, dtype=np.int64) for col in zip(*current))  # [R] each
    end = ptr + length
    return any(bool(((dev == d) & (ptr < p + n) & (p < end)).any()) for _, p, n, d in stale)


class NixlTransport(Transport):
    """One process's NIXL agent. See :mod:`transport.base` for the contract.

    ``name``: the agent's name (``NixlConfig.agent_name`` or a unique default); its export
    carries it as ``agent``, and peers' notifications from it name it as sender."""

    backend = BACKEND

    def __init__(self, config: Optional[NixlConfig] = None):
        if config is None:
            config = NixlConfig()
        if not isinstance(config, NixlConfig):
            raise TypeError(f"config must be a NixlConfig, got {type(config).__name__}")
        self.config = config
        self.name = config.agent_name or _default_agent_name()
        self._agent = None
        if self.name in _LIVE_NAMES:
            raise TransportError(f"NIXL agent name {self.name!r} is taken by a live NixlTransport of this process; "
                                 "agent names must be unique (pick another NixlConfig.agent_name, or None)")
        api = load_nixl_api()
        try:
            self._agent = api.nixl_agent(
                self.name,
                api.nixl_agent_config(
                    enable_prog_thread=config.progress_thread,
                    enable_listen_thread=False,
                    num_threads=config.num_threads,
                    backends=list(config.backends),
                ),
            )
        except Exception as exc:
            raise TransportError(f"NIXL agent {self.name!r} could not start: {type(exc).__name__}: {exc}"
                                 f"{_ucx_tls_hint()}") from exc
        missing = [b for b in config.backends if b not in self._agent.backends]
        if missing:
            plugins = self._agent.get_plugin_list()
            self._agent = None
            raise TransportError(f"NIXL backends {missing} could not be created (plugins found: {plugins})"
                                 f"{_ucx_tls_hint()}")
        _LIVE_NAMES.add(self.name)
        self._registry = RegionRegistry()  # handles: the nixlRegDList of each region
        self._peers: dict[str, NixlPeer] = {}  # the current peer per remote agent name
        self._idle: set[str] = set()  # remote agents still loaded in NIXL whose peer closed (see _forget_peer)
        self._lost: dict[str, str] = {}  # remote agent -> why it is lost (a transfer failed or stalled)
        self._draining: dict[str, list] = {}  # remote agent -> handles of its failed requests NIXL may still run
        self._loaded: dict[str, set] = {}  # remote agent -> (region id, ptr, length, device) NIXL was given for it
        self._retired: "weakref.WeakSet[NixlPeer]" = weakref.WeakSet()  # replaced snapshots
        # Host bytes that notification-only writes copy between the two agents: NIXL's
        # standalone notification (genNotif) has no completion to wait on, and over tcp it
        # stays queued until something drives progress; a one-byte write has a real status.
        self._scratch = np.zeros(_SCRATCH_BYTES, dtype=np.uint8)  # [_SCRATCH_BYTES]
        self._scratch_reg = self._agent.register_memory(
            np.array([[self._scratch.ctypes.data, _SCRATCH_BYTES, 0]], dtype=np.uint64), "DRAM",
            backends=list(config.backends),
        )
        self._stuck: list = []  # xfer handles whose release failed; retried on close
        self._notes: list[Notification] = []  # the owner's notifications read by _pump, not yet polled
        self._lanes: dict[str, SenderLane] = {}  # staged lane per remote agent (transport.nixl_staged)
        self._lane_ids: dict[int, SenderLane] = {}
        self._next_lane = 0
        self._receiver = ReceiverLanes(self)  # lanes senders opened here
        self._holds = Holds(self)  # exports of others this transport holds (transport.nixl_revoke)
        self._holders = Holders(self)  # who holds this transport's export
        self._pumping = False
        self._last_pump = 0.0
        self._prepared = PreparedLists(self._agent_checked, None, lambda: self._registry.view,
                                       list(config.backends))  # this agent's regions (transport.nixl_prepped)

    # -- regions --------------------------------------------------------------------------

    def register(self, ptr: int, length: int, device: Optional[int] = None) -> int:
        agent = self._agent_checked()
        self._registry.check_free(ptr, length, device)
        mem = "DRAM" if device is None else "VRAM"
        descs = np.array([[ptr, length, 0 if device is None else device]], dtype=np.uint64)  # [1, 3]
        try:
            reg = agent.register_memory(descs, mem, backends=list(self.config.backends))
        except Exception as exc:
            raise TransportError(
                f"NIXL could not register {mem} [{ptr:#x}, +{length}) device {device}: {type(exc).__name__}: {exc}"
            ) from exc
        region_id = self._registry.add(ptr, length, device, handle=reg).region_id
        self._prepared.release()  # the lists lack the new region: prepared again on next use
        return region_id

    def deregister(self, region_id: int, force: bool = False) -> None:
        """Forget a region once no peer can write into it: it is revoked from every peer that
        holds an export naming it, waiting for their acknowledgement or loss (at most
        ``config.revoke_timeout_s``; :class:`~transport.base.RevokeTimeout` naming the silent
        ones, the region still registered, unless ``force``). See :mod:`transport.nixl_revoke`."""
        self._agent_checked()
        self._registry.get(region_id)
        busy = [t for peer in [*self._retired, *self._peers.values()] for t in list(peer._pending)
                if t.status() is TransferStatus.PENDING and t._src_region is not None
                and bool((t._src_region == region_id).any())]
        if busy:  # UCX would read freed memory and blame the peer (REMOTE_DISCONNECT)
            peers = sorted({t._peer.name for t in busy})
            raise TransportError(f"region {region_id} is the source of {len(busy)} transfer(s) still pending "
                                 f"(to {peers}); wait for or abort them before deregistering it")
        self._holders.revoke(region_id, self.config.revoke_timeout_s, force)
        self._release_region(region_id)

    def _release_region(self, region_id: int) -> None:
        self._prepared.release()  # they refer to the registration NIXL is about to let go
        reg = self._registry.remove(region_id)
        self._agent_checked().deregister_memory(reg, backends=list(self.config.backends))

    @property
    def regions(self) -> Mapping[int, Region]:
        return self._registry.view

    def _table(self) -> _RegionTable:
        return self._registry.derived(_RegionTable)

    # -- peers ----------------------------------------------------------------------------

    def export(self) -> bytes:
        agent = self._agent_checked()
        return pack_descriptor(
            BACKEND,
            self._registry.view.values(),
            agent=self.name,
            scratch=self._scratch.ctypes.data,
            metadata=bytes(agent.get_agent_metadata()),
        )

    def connect(self, peer_bytes: bytes) -> NixlPeer:
        agent = self._agent_checked()
        body, regions = unpack_descriptor(peer_bytes, BACKEND, required=("agent", "metadata", "scratch"))
        name, metadata, scratch = body["agent"], body["metadata"], body["scratch"]
        if not isinstance(scratch, int) or isinstance(scratch, bool) or scratch <= 0:
            raise PeerDescriptorError(f"peer descriptor 'scratch' must be a positive address, got {scratch!r:.60}")
        if not isinstance(name, str) or not name:
            raise PeerDescriptorError(f"peer descriptor 'agent' must be a non-empty str, got {name!r:.60}")
        if not isinstance(metadata, bytes) or not metadata:
            raise PeerDescriptorError(f"peer descriptor 'metadata' must be non-empty bytes, got {metadata!r:.60}")
        if name in self._lost:  # a new connect after a loss: its failed requests are done, then a fresh endpoint
            left = self._drain(name)
            if left:
                raise TransportError(f"peer {name!r} still has {left} failed request(s) in flight (it stalled); "
                                     "connect again once it progresses or dies")
            del self._lost[name]
            if name not in self._peers:
                self._idle.discard(name)
            self._remove_remote(name)  # its requests are done: a fresh lane (and Hello) with the fresh endpoint
        if name == self.name:
            if metadata == bytes(agent.get_agent_metadata()):
                raise PeerDescriptorError(f"peer descriptor is this transport's own export (agent {name!r})")
            raise PeerDescriptorError(f"peer agent {name!r} has this transport's name: agent names must be unique "
                                      "(NixlConfig.agent_name)")
        if _stale_overlap(self._loaded.get(name, ()), regions):
            self._unload(name)  # NIXL could resolve writes to the stale entries: load afresh
        self._release_prepared(name)  # lists of the metadata loaded now (again): prepared afresh
        try:  # NIXL updates an agent it already knows in place: pending writes keep going
            loaded = agent.add_remote_agent(metadata)
        except Exception as exc:
            raise PeerDescriptorError(
                f"NIXL rejected the metadata of peer {name!r} ({len(metadata)} bytes): {type(exc).__name__}: {exc}"
            ) from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            if loaded not in self._peers and loaded not in self._idle:
                self._remove_remote(loaded)
            raise PeerDescriptorError(f"peer descriptor names agent {name!r} but its metadata is of {loaded!r}")
        old = self._peers.get(name)
        if old is not None:  # a newer export of the same agent replaces the old snapshot
            old._retire()
            self._retired.add(old)
        self._loaded.setdefault(name, set()).update(_descs(regions))
        peer = NixlPeer(self, name, regions, scratch)
        self._peers[name] = peer
        self._idle.discard(name)
        peer._hold_seq = self._holds.hold(name, regions)
        return peer

    def poll_notifications(self) -> list[Notification]:
        self._pump()
        for lane in list(self._lanes.values()):  # staged writes of this side move on too
            if lane.busy:
                lane.progress()
        out, self._notes = self._notes, []
        return out

    def writer_gone(self, name: str) -> Optional[str]:
        """See :meth:`Transport.writer_gone`: a Release read from ``name``, or a 1-byte probe
        write into its scratch that failed with a disconnect (its process died; a probe every
        ``PROBE_INTERVAL_S`` while it holds)."""
        self._agent_checked()
        return self._holders.gone(name)

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        if self._agent is None:
            return
        try:  # goodbyes already received (an owner's Closed, a holder's Release): none goes back to them
            self._pump()
        except Exception:
            pass
        for peer in [*self._retired, *self._peers.values()]:
            peer._close(drain=False)  # the agent goes: nothing of it can land after that
        for step in (self._holds.close, self._holders.revoke_all):  # tell owners and holders; wait for none
            try:
                step()
            except Exception:
                pass
        for name in list(self._lanes):
            try:
                self._drop_lane(name)
            except Exception:
                pass
        self._receiver.close()
        self._prepared.release()
        for rid in list(self._registry.view):
            try:
                self._release_region(rid)  # holders were told (revoke_all): see transport.nixl_revoke, 4.
            except Exception:  # keep releasing the rest; the agent's teardown frees it too
                pass
        try:
            self._agent.deregister_memory(self._scratch_reg, backends=list(self.config.backends))
        except Exception:
            pass
        self._stuck.extend(h for handles in self._draining.values() for h in handles)
        self._draining.clear()
        for handle in self._stuck:
            try:
                handle.release()
            except Exception:
                pass
        self._stuck.clear()
        self._agent = None  # the NIXL agent (and its UCX context, progress thread) goes with it
        _LIVE_NAMES.discard(self.name)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _agent_or_none(self):
        return self._agent

    def _agent_checked(self):
        if self._agent is None:
            raise TransportClosed(f"NIXL transport {self.name!r} is closed")
        return self._agent

    def _release_handle(self, handle) -> None:
        """Release (cancel if active) a transfer request; keep it for a later retry if NIXL refuses."""
        try:
            handle.release()
        except Exception:
            self._stuck.append(handle)

    def _post(self, name: str, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
              notif: bytes) -> tuple:
        """Post one NIXL write request of ``[n, 3]`` descriptor arrays; (handle, state), or
        TransportError naming NIXL's refusal (the handle released)."""
        return self._submit(lambda agent: agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, remote_mem), name, notif,
            backends=list(self.config.backends)))

    def _post_prepped(self, name: str, local, local_indices, remote, remote_indices, notif: bytes) -> tuple:
        """Post one NIXL write request made from indices into prepared lists
        (:mod:`transport.nixl_prepped`; ``name`` is ``remote``'s agent); as :meth:`_post`."""
        return self._submit(lambda agent: agent.make_prepped_xfer(
            "WRITE", local.handle, local_indices, remote.handle, remote_indices, notif,
            backends=list(self.config.backends)))

    def _submit(self, make) -> tuple:
        """``make(agent)``'s request, posted: (handle, state), or TransportError (the handle released)."""
        agent = self._agent_checked()
        handle = None
        try:
            handle = make(agent)
            return handle, agent.transfer(handle)
        except Exception as exc:
            if handle is not None:
                self._release_handle(handle)
            raise TransportError(f"{type(exc).__name__}: {exc}") from None

    def _post_notify(self, name: str, scratch_ptr: int, notif: bytes) -> tuple:
        """A notification alone: one scratch byte carries it (see _SCRATCH_BYTES)."""
        local = np.array([[self._scratch.ctypes.data, 1, 0]], dtype=np.uint64)  # [1, 3]
        remote = np.array([[scratch_ptr, 1, 0]], dtype=np.uint64)  # [1, 3]
        return self._post(name, local, "DRAM", remote, "DRAM", notif)

    def _post_slot(self, name: str, local: np.ndarray, local_dev: Optional[int], remote: np.ndarray,
                   remote_dev: Optional[int], notif: bytes) -> tuple:
        """One write of a staged chunk (:mod:`transport.nixl_staged.sender`): ``[k, 2]`` int64
        (address, bytes) ranges on each side, on one memory each."""
        descs = []
        for ranges, dev in ((local, local_dev), (remote, remote_dev)):
            out = np.empty((ranges.shape[0], 3), dtype=np.uint64)  # [k, (address, bytes, device)]
            out[:, :2] = ranges
            out[:, 2] = dev or 0
            descs.append(out)
        return self._post(name, descs[0], "DRAM" if local_dev is None else "VRAM", descs[1],
                          "DRAM" if remote_dev is None else "VRAM", notif)

    def _register_raw(self, ptr: int, length: int, device: Optional[int]):
        """Register memory that is no region (staging): NIXL's handle, for :meth:`_deregister_raw`."""
        descs = np.array([[ptr, length, 0 if device is None else device]], dtype=np.uint64)  # [1, 3]
        return self._agent_checked().register_memory(descs, "DRAM" if device is None else "VRAM",
                                                     backends=list(self.config.backends))

    def _deregister_raw(self, reg) -> None:
        if self._agent is not None:
            self._agent.deregister_memory(reg, backends=list(self.config.backends))

    def _open_lane(self, peer: NixlPeer, src_device: Optional[int], dst_device: Optional[int]) -> SenderLane:
        self._next_lane += 1
        lane = SenderLane(self, peer.name, self._next_lane, peer._scratch_ptr, src_device, dst_device)
        self._lanes[peer.name] = lane
        self._lane_ids[lane.id] = lane
        return lane

    def _drop_lane(self, name: str) -> None:
        lane = self._lanes.pop(name, None)
        if lane is not None:
            del self._lane_ids[lane.id]
            lane.close()

    def _service(self) -> None:
        """:meth:`_pump` at most once a millisecond (what a transfer's ``status()`` calls)."""
        if time.monotonic() - self._last_pump >= 1e-3:
            self._pump()

    def _pump(self) -> None:
        """Read NIXL's notifications: revoke messages go to the holds / holders
        (:mod:`transport.nixl_revoke`), staged messages to the lanes (a receiver scatters here),
        the owner's are queued for :meth:`poll_notifications`, each sender's in order; then
        answer the revokes whose writes have finished. While scatters of staged chunks are in
        flight, NIXL's notifications are read again for up to ``_READ_WHILE_SCATTERING_S`` (the
        next chunks are handled while the GPU scatters), else the oldest scatter is waited for;
        it returns once every staged answer went out (:mod:`transport.nixl_staged.receiver`).
        Not re-entered (a revoke answer checks transfers, whose ``status()`` pumps)."""
        agent = self._agent_checked()
        if self._pumping:
            return
        self._pumping = True
        receiver = self._receiver
        try:
            self._last_pump = time.monotonic()
            read_until = self._last_pump + _READ_WHILE_SCATTERING_S
            reading = True
            while True:
                notes = agent.get_new_notifs() if reading else {}
                for sender, msgs in notes.items():
                    sender = sender.decode() if isinstance(sender, bytes) else str(sender)
                    for raw in msgs:
                        self._take(sender, bytes(raw))
                receiver.answer()
                if not receiver.in_flight:
                    break
                reading = time.monotonic() < read_until
                if not notes or not reading:
                    receiver.wait_oldest()
            self._holds.answer()
        finally:
            self._pumping = False

    def _take(self, sender: str, raw: bytes) -> None:
        """One notification from ``sender`` (see :meth:`_pump`)."""
        try:
            control = revoke_wire.decode(raw)
        except revoke_wire.ProtocolError:
            return  # a revoke message that does not decode carries nothing to act on
        if isinstance(control, (revoke_wire.Hold, revoke_wire.RevokeAck, revoke_wire.Release)):
            self._holders.handle(sender, control)
            return
        if control is not None:
            self._holds.handle(sender, control)
            if isinstance(control, (revoke_wire.Revoke, revoke_wire.Closed)) or (
                    isinstance(control, revoke_wire.HoldAck) and control.gone):
                self._release_prepared(sender)  # they name regions of it that are revoked now
            return
        try:
            msg = staged_wire.decode(raw)
        except staged_wire.ProtocolError:
            return  # a staged message that does not decode carries nothing to deliver
        if msg is None:
            self._receiver.deliver(sender, raw)
        elif isinstance(msg, (staged_wire.Hello, staged_wire.Chunk)):
            self._receiver.handle(sender, msg)
        else:
            lane = self._lane_ids.get(msg.lane)
            if lane is not None and lane.name == sender:
                lane.on_message(msg)

    def _drain(self, name: str) -> int:
        """Release the failed requests of ``name`` that NIXL no longer progresses; return how
        many it still does."""
        left = []
        for handle in self._draining.pop(name, []):
            try:
                busy = self._agent.check_xfer_state(handle) == "PROC"
            except Exception:  # the peer died: nothing more of it lands
                busy = False
            if busy:
                left.append(handle)
            else:
                self._release_handle(handle)
        if left:
            self._draining[name] = left
        return len(left)

    def _release_prepared(self, name: str) -> None:
        """Release the prepared lists of every snapshot of the remote agent ``name``."""
        for peer in self._snapshots(name):
            peer._prepared.release()

    def _registered(self) -> list[list[int]]:
        """What this agent's metadata registers, as a peer that loads it from a staged Hello or
        Welcome records it (:meth:`_loaded_too`): each region as ``_descs`` gives it and each
        staged lane's memory (region id ``_STAGING``); the scratch byte lives as long as the agent."""
        stagings = [lane.staging for lane in self._lanes.values() if lane.staging is not None]
        stagings += self._receiver.stagings()
        return [list(d) for d in _descs(self._registry.view)] + [
            [_STAGING, s.ptr, s.nbytes, -1 if s.device is None else s.device] for s in stagings]

    def _loaded_too(self, name: str, registered) -> None:
        """Record ``registered`` (``wire.registered_entries``) as given to NIXL for agent ``name``:
        metadata a staged Hello or Welcome brought names regions no export of it did, and the
        stale-entry check (:func:`_stale_overlap`) must see them."""
        self._loaded.setdefault(name, set()).update(registered)

    def _unload(self, name: str) -> None:
        """Drop the remote agent ``name`` from NIXL (its lane, its metadata, its endpoint) so
        that its next export loads afresh; refused while a write of ours to it is in flight
        (dropping the endpoint would cancel it)."""
        direct = sum(t.status() is TransferStatus.PENDING for p in self._snapshots(name) for t in list(p._pending))
        staged = name in self._lanes and self._lanes[name].busy
        if direct or staged:
            raise TransportError(
                f"peer {name!r} deregistered regions that overlap ones its new export names, so NIXL must load "
                f"that export afresh, which would cancel this transport's writes in flight to it ({direct} direct"
                f"{', and staged ones' if staged else ''}): connect again once they end")
        self._remove_remote(name)

    def _remove_remote(self, name: str) -> None:
        """Forget the remote agent ``name`` in NIXL, and its lane (whose lists name its regions)."""
        if self._agent is None:
            return
        self._drop_lane(name)
        self._loaded.pop(name, None)
        self._release_prepared(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already invalidated (e.g. after a disconnect)
            pass

    def _forget_peer(self, peer: NixlPeer) -> None:
        """The current peer of a remote agent closed (a retired snapshot leaves it alone).

        A lost agent (a transfer failed in the backend) is removed from NIXL. A live one stays
        loaded, idle, and a later ``connect`` to it reuses its endpoint: NIXL's
        ``remove_remote_agent`` forgets the metadata but not the UCX connection (over tcp each
        side's UCP worker keeps the endpoint the wire-up created, one socket per connect on both
        sides until a worker is destroyed or the peer process exits), so removing and loading
        again would leak a socket per cycle on both sides."""
        if self._peers.get(peer.name) is not peer:
            return
        del self._peers[peer.name]
        self._holds.release(peer.name)  # the owner stops counting this transport (if nothing is pending)
        if peer.name in self._lost and not self._drain(peer.name):
            del self._lost[peer.name]
            self._remove_remote(peer.name)
        elif peer.name in self._lost:
            self._idle.add(peer.name)  # failed requests still run: the next connect drains first
        else:
            self._idle.add(peer.name)

    def _snapshots(self, name: str) -> list:
        """Every peer (current and retired snapshots) of the remote agent ``name``."""
        return [p for p in [*self._retired, *self._peers.values()] if p.name == name]
