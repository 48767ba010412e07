"""The nvlink transport: this process's GPU regions, exported as CUDA IPC handles.

All regions of one transport live on one GPU, the one whose SMs run the copy kernel.
``register`` exports a CUDA IPC handle for each region (its allocation's handle plus the
region's offset, :mod:`transport.nvlink.ipc`); ``connect`` maps a peer's export into an
:class:`~transport.nvlink.peer.NvlinkPeer`; ``poll_notifications`` reads the mailbox;
``deregister`` revokes the region from the peers that hold it first
(:mod:`transport.nvlink.holders`), whose mailbox threads answer (:mod:`transport.nvlink.holds`).
"""

from __future__ import annotations

import os
import uuid
from typing import Mapping, Optional

from transport.base import Notification, Region, Transport, TransportClosed, pack_descriptor
from transport.nvlink import ipc
from transport.nvlink import lander
from transport.nvlink import native
from transport.nvlink import staged
from transport.nvlink.config import NvlinkConfig, NvlinkUnsupported
from transport.nvlink.descriptor import BACKEND, gpu_uuid, local_ordinal, parse_descriptor
from transport.nvlink.fastpath import SlotRing
from transport.nvlink.holders import MailboxHolders
from transport.nvlink.holds import MailboxThread
from transport.nvlink.mailbox import Inbox, host_id
from transport.nvlink.peer import NvlinkPeer
from transport.nvlink.progress import Progress
from transport.nvlink.stream import CopyStream
from transport.registry import RegionRegistry

__all__ = ["NvlinkTransport"]

_UNSET = object()


class NvlinkTransport(Transport):
    """GPU regions of this process, exported as CUDA IPC handles; see :mod:`transport.nvlink`.

    ``name``: this transport's name (default ``nvlink-<pid>-<random>``, unique per
    transport); its export carries it, and its notifications reach peers with it as sender."""

    backend = BACKEND

    def __init__(self, config: Optional[NvlinkConfig] = None, name: Optional[str] = None):
        self.config = config if config is not None else NvlinkConfig()
        if not isinstance(self.config, NvlinkConfig):
            raise TypeError(f"config must be an NvlinkConfig, got {type(self.config).__name__}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        self.name = name or f"nvlink-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._registry = RegionRegistry()  # handles: ipc.IpcExport per region
        self._device: Optional[int] = None
        self._copy: Optional[CopyStream] = None
        self._peers: list[NvlinkPeer] = []
        self._lanes: dict[int, staged.StagedLane] = {}  # peer GPU -> staged lane
        self._ring: Optional[SlotRing] = None  # slots of the direct path, made at its first write
        self._native = _UNSET  # the direct path's C steps, or None (_native_steps)
        self._holders = MailboxHolders(self._registry, lambda: self._inbox.read())  # who holds our export
        self._inbox = Inbox(self._holders)
        self._mailbox = MailboxThread()  # reads what the owners of the exports we hold send our peers
        self._progress = Progress(lambda: any([p._advance() for p in list(self._peers)]), self._oldest_event)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"transport {self.name!r} is closed")

    def _api(self):
        return ipc.load_api(self.config.ipc_api)

    def _copy_stream(self) -> CopyStream:
        """The copy stream on this transport's GPU (:class:`NvlinkUnsupported` before a region)."""
        if self._device is None:
            raise NvlinkUnsupported("register a GPU region before connecting: the nvlink backend copies with the local GPU")
        if self._copy is None:
            self._copy = CopyStream(self._api(), self._device, self.config.wait_current_stream, self._native_steps())
        return self._copy

    def _native_steps(self):
        """The direct path's C steps (:mod:`transport.nvlink.native`), loaded at the first
        call; None when configured off or unavailable (:attr:`native_unavailable` says why)."""
        if self._native is _UNSET:
            self._native = native.load() if self.config.native else None
            if self._native is not None:
                lander.ask_spin(self._native, self.config.lander_spin_us * 1000)
        return self._native

    @property
    def native_unavailable(self) -> Optional[str]:
        """Why the direct path runs its host steps in Python (None: in C, or not decided yet)."""
        if self._native is _UNSET or self._native is not None:
            return None
        return "configured off (NvlinkConfig.native=False)" if not self.config.native else native.why_unavailable()

    def _lane(self, peer_gpu: int) -> staged.StagedLane:
        if peer_gpu not in self._lanes:
            self._lanes[peer_gpu] = staged.open_lane(self._api(), self._copy_stream().device, peer_gpu,
                                                     self.config.staged)
        return self._lanes[peer_gpu]

    def _slot_ring(self) -> Optional[SlotRing]:
        """The ring of slots of the direct path (None: configured off), shared by every peer:
        all of them enqueue on the one copy stream."""
        if self._ring is None and self.config.slot_ring_bytes:
            copy = self._copy_stream()
            self._ring = SlotRing.allocate(self._api(), copy.device, self.config.slot_ring_bytes // 8, copy.stream,
                                           self._native_steps())
        return self._ring

    def _sync_lanes(self) -> None:
        for lane in self._lanes.values():
            lane.synchronize()

    # -- regions --------------------------------------------------------------------------
    def register(self, ptr: int, length: int, device: Optional[int] = None) -> int:
        self._check_open()
        self._registry.check_free(ptr, length, device)
        if device is None:
            raise NvlinkUnsupported("the nvlink backend moves GPU memory only; register host memory with the nixl backend")
        if self._device is not None and device != self._device:
            raise ValueError(f"all regions of one nvlink transport share a GPU: have cuda:{self._device}, got cuda:{device}")
        try:
            exp = ipc.export_region(self._api(), ptr, length, device)
        except (ipc.CudaIpcError, ipc.CudaIpcUnavailable) as exc:
            raise NvlinkUnsupported(f"cannot export [0x{ptr:x}, +{length}) on cuda:{device} by CUDA IPC: {exc}") from None
        self._device = device
        return self._registry.add(ptr, length, device, handle=exp).region_id

    def deregister(self, region_id: int, force: bool = False) -> None:
        """Forget a region once no peer can write into it: it is revoked from every peer that
        holds an export naming it, waiting for their acknowledgement or the end of their
        connection (at most ``config.revoke_timeout_s``; :class:`~transport.base.RevokeTimeout`
        naming the silent ones, the region still registered, unless ``force``). See
        "Deregistering exported memory" in :mod:`transport.nvlink`."""
        self._check_open()
        self._registry.get(region_id)
        self._holders.revoke(region_id, self.config.revoke_timeout_s, force)
        self._registry.remove(region_id)  # an IPC export holds nothing to release

    @property
    def regions(self) -> Mapping[int, Region]:
        return self._registry.view

    # -- peers ----------------------------------------------------------------------------
    def export(self) -> bytes:
        self._check_open()
        handles = [[reg.region_id, exp.handle, exp.offset, exp.alloc_size] for reg, exp in self._registry.items()]
        return pack_descriptor(
            BACKEND, self._registry.view.values(), name=self.name, host=host_id(), pid=os.getpid(),
            mailbox=self._inbox.name, ipc=handles, gpu_uuid=gpu_uuid(self._device),
        )

    def connect(self, peer_bytes: bytes) -> NvlinkPeer:
        self._check_open()
        body, regions, handles = parse_descriptor(peer_bytes)
        if body["host"] != host_id():
            raise NvlinkUnsupported(f"peer {body['name']!r} is on host {body['host']!r}, this process on {host_id()!r}")
        if body["pid"] == os.getpid():
            raise NvlinkUnsupported("the peer is this process: the nvlink backend connects two processes")
        peer_gpu = local_ordinal(body.get("gpu_uuid"))
        peer = NvlinkPeer(self, body["name"], regions, handles, body["mailbox"], peer_gpu)
        self._peers.append(peer)
        return peer

    def _oldest_event(self):
        """The event of the oldest pending transfer of some peer (None: none pending); the
        progress thread waits on it."""
        for peer in list(self._peers):
            event = peer._queue.oldest_event()
            if event is not None:
                return event
        return None

    def _forget_peer(self, peer: NvlinkPeer) -> None:
        if peer in self._peers:
            self._peers.remove(peer)

    def poll_notifications(self) -> list[Notification]:
        self._check_open()
        return self._inbox.poll()

    def writer_gone(self, name: str) -> Optional[str]:
        """See :meth:`Transport.writer_gone`: every mailbox connection of ``name`` ended (it
        closed those peers, or its process is gone), as the inbox read it."""
        self._check_open()
        return self._holders.gone(name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._progress.stop()
        for peer in list(self._peers):
            peer.close()
        self._mailbox.stop()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        if self._copy is not None:
            self._copy.close()  # nothing reads the ring once it goes
        self._ring = None
        self._inbox.close()
        self._registry.clear()
