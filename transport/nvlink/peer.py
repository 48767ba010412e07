"""A connected nvlink peer: the facade over its parts.

:class:`NvlinkPeer` owns, per peer: the mapping of the peer's regions
(:mod:`~transport.nvlink.mapping`), the engine choice (:mod:`~transport.nvlink.route`), the
tables (:mod:`~transport.nvlink.tables`), the outbox to the peer's mailbox, the FIFO of pending
transfers (:mod:`~transport.nvlink.pending`) and its hold of the peer's export
(:mod:`~transport.nvlink.holds`: the regions the peer revoked). Writes go through a prepared
write (:mod:`~transport.nvlink.job`) on the transport's copy stream
(:mod:`~transport.nvlink.stream`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, Union

from transport.base import Peer, Region, RegionSizes, StridedBatch, TransportClosed, WriteBatch
from transport.nvlink import job as jobs
from transport.nvlink.config import NvlinkEngine, NvlinkUnsupported, check_engine
from transport.nvlink.holds import Hold
from transport.nvlink.job import PreparedWrite
from transport.nvlink.mailbox import MailboxUnreachable, Outbox
from transport.nvlink.mapping import PeerMapping
from transport.nvlink.pending import PendingQueue
from transport.nvlink.route import EngineRoute
from transport.nvlink.tables import WriteTables
from transport.nvlink.transfer import NvlinkTransfer
from transport.registry import RegionRegistry
from transport.revocation import wire as revoke_wire

if TYPE_CHECKING:
    from transport.nvlink.transport import NvlinkTransport

__all__ = ["NvlinkPeer"]


class NvlinkPeer(Peer):
    """A connected peer: its regions mapped here, its tables, its mailbox, its pending writes.

    ``tables`` (:class:`~transport.nvlink.tables.WriteTables`) gives the row and strided
    tables and launch plans this peer launches, for callers that time or inspect the kernel."""

    expands_strided = True  # write_strided builds its row tables on the GPU

    def __init__(self, owner: "NvlinkTransport", name: str, regions: Mapping[int, Region],
                 handles: Mapping[int, tuple[bytes, int, int]], mailbox: str, peer_gpu: Optional[int] = None):
        self._owner = owner
        self._config = owner.config
        self.name = name
        self.regions = RegionRegistry.frozen(regions)
        self._copy = owner._copy_stream()  # NvlinkUnsupported before the first GPU region
        self._mapping = PeerMapping(owner._api(), name, self.regions, handles)
        self._queue = PendingQueue(name, None, self._config.transfer_timeout_s)
        self._hold: Optional[Hold] = None
        self._closed = False
        try:
            self._mapping.bases(self._copy.device)
            try:
                self._queue.outbox = Outbox(mailbox, self._config.peer_timeout_s, sender=owner.name,
                                            regions=self.regions)
            except MailboxUnreachable as exc:
                raise NvlinkUnsupported(str(exc)) from None
        except BaseException:
            self._release()
            raise
        device = self._copy.device
        self.tables = WriteTables(owner._registry, RegionSizes(self.regions), self._mapping, device, self._config)
        self._route = EngineRoute(self._config, name, peer_gpu if peer_gpu != device else None, owner._lane,
                                  self._mapping)
        self._hold = Hold(name, self._queue, self._mapping)
        owner._mailbox.add(self._hold)  # its thread reads the peer's answer to the Hello, and revokes

    @property
    def device(self) -> int:
        """The local GPU that runs this peer's copies."""
        return self._copy.device

    @property
    def staged_error(self) -> Optional[str]:
        """Why the staged engine is off for this peer (None: not off, or not tried yet)."""
        return self._route.error

    # -- writes ---------------------------------------------------------------------------
    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> NvlinkTransfer:
        """A row-table write: the host gathers the ``[3, n]`` row table (source address,
        destination address, bytes) and the kernel copies the rows."""
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch, got {type(batch).__name__}")
        return self._write(batch, notify)

    def write_strided(self, batch: StridedBatch, notify: Optional[bytes] = None) -> NvlinkTransfer:
        """A factored write expanded on the GPU: the host checks bounds in O(P + S), stages the
        ``[5 * P + 2 * S]`` strided table (:mod:`transport.nvlink.kernel`) and launches the
        strided kernel, which computes each row's addresses; completion as for :meth:`write`."""
        if not isinstance(batch, StridedBatch):
            raise TypeError(f"batch must be a StridedBatch, got {type(batch).__name__}")
        return self._write(batch, notify)

    def _write(self, batch, notify: Optional[bytes]) -> NvlinkTransfer:
        notify = self._check_notify(notify)
        self.tables.check_bounds(batch)
        if not self._queue.outbox.alive():
            return self._lost()
        job = self.prepare(batch, checked=True)
        try:
            return self._post(job, notify)
        finally:
            job.release()

    def prepare(self, batch: Union[WriteBatch, StridedBatch], engine: Optional[NvlinkEngine] = None, *,
                checked: bool = False) -> PreparedWrite:
        """A :class:`~transport.nvlink.job.PreparedWrite` of ``batch`` (a WriteBatch or a
        StridedBatch) to post once or many times: bounds checked (``checked``: the caller
        already did), the engine chosen (``engine`` overrides the config's for this job), the
        table built in pinned memory, the launch planned."""
        self._check_open()
        if not isinstance(batch, (WriteBatch, StridedBatch)):
            raise TypeError(f"batch must be a WriteBatch or a StridedBatch, got {type(batch).__name__}")
        engine = self._config.engine if engine is None else check_engine(engine)
        if not checked:
            self.tables.check_bounds(batch)
        return jobs.build(self, batch, engine, self.tables, self._route, self._config)

    def _post_job(self, job: PreparedWrite, notify: Optional[bytes]) -> NvlinkTransfer:
        """:meth:`PreparedWrite.post`: the checks of a write, then :meth:`_post`."""
        notify = self._check_notify(notify)
        if job.released:
            raise ValueError("the prepared write was released; prepare the batch again")
        if not self._queue.outbox.alive():
            return self._lost()
        return self._post(job, notify)

    def _post(self, job: PreparedWrite, notify: Optional[bytes]) -> NvlinkTransfer:
        """Once the peer acknowledged this hold: refuse a job naming a revoked region
        (``RegionRevoked``), else upload its tables (first post only), queue the copy and track
        the transfer -- under the hold's lock, so that a revoke's snapshot of the copies in
        flight holds every copy that could still reach a region it revokes."""
        hold = self._hold
        if not hold.acked:
            why = hold.wait_ready(self._config.revoke_timeout_s)
            if why is not None:
                return NvlinkTransfer(self._queue, None, None, error=why)
        with hold.lock:
            hold.refuse(job.dst_region)
            try:
                if job.device_tables is None:
                    job.device_tables = self._copy.upload(job)
                event = self._copy.enqueue(job, job.device_tables)
            except BaseException:
                self._copy.quiesce(job)  # part of it may be queued: nothing may read the tables once they go
                raise
            transfer = self._queue.track(NvlinkTransfer(self._queue, event, notify,
                                                        keep=(job.host_table, *job.device_tables)))
        self._owner._progress.wake()
        return transfer

    def _lost(self) -> NvlinkTransfer:
        return NvlinkTransfer(self._queue, None, None, error=f"peer {self.name!r} lost (its socket closed)")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"peer {self.name!r} is closed")

    def _check_notify(self, notify) -> Optional[bytes]:
        """An open peer and a valid notification payload (bytes, at most ``max_notify_bytes``)."""
        self._check_open()
        if notify is None:
            return None
        if not isinstance(notify, (bytes, bytearray, memoryview)):
            raise TypeError(f"notify must be bytes or None, got {type(notify).__name__}")
        notify = bytes(notify)
        if len(notify) > self._config.max_notify_bytes:
            raise ValueError(f"notify must be at most {self._config.max_notify_bytes} bytes, got {len(notify)}")
        if notify.startswith(revoke_wire.MAGIC):
            raise ValueError(f"notify must not start with {revoke_wire.MAGIC!r} (reserved for revocation)")
        return notify

    def _advance(self) -> bool:
        return self._queue.advance()

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.abort_all("aborted: peer closed")
        self._release()
        self._owner._forget_peer(self)

    def _release(self) -> None:
        """Wait for copies in flight, then unmap the peer's memory and end the connection (the
        peer forgets this hold when it reads the end)."""
        if self._mapping.opened:
            self._copy.synchronize()
            self._owner._sync_lanes()
            self._queue.forget_buried()
            self._mapping.close()
        if self._hold is not None:
            self._owner._mailbox.remove(self._hold)  # its thread closes the socket
        elif self._queue.outbox is not None:
            self._queue.outbox.close()
