"""The public class of the ``nixl`` backend: :class:`NixlTransport`, the contract on one agent.

It owns one :class:`~transport.nixl.core.Core` and does what the contract asks of a transport:
registers and deregisters regions (revoking them from holders first), exports and connects,
hands over notifications, closes. Writes are :class:`~transport.nixl.peer.NixlPeer`'s.
"""

from __future__ import annotations

from typing import Mapping, Optional

from transport.base import Notification, TransferStatus, Transport
from transport.batch import Region
from transport.envelope import pack_descriptor, unpack_descriptor
from transport.errors import PeerDescriptorError, PeerDraining, TransportError
from transport.nixl.config import NixlConfig
from transport.nixl.core import Core
from transport.nixl.peer import NixlPeer
from transport.nixl.regions import descs, stale_overlap

__all__ = ["BACKEND", "NixlTransport"]

BACKEND = "nixl"


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
        self._core: Optional[Core] = None
        self._core = Core(config)
        self.name = self._core.agent.name

    @property
    def config(self) -> NixlConfig:
        return self._core.config

    @config.setter
    def config(self, config: NixlConfig) -> None:
        """A new configuration; its deadlines and timeouts apply to later writes and calls."""
        if not isinstance(config, NixlConfig):
            raise TypeError(f"config must be a NixlConfig, got {type(config).__name__}")
        self._core.config = config

    # -- regions --------------------------------------------------------------------------

    def register(self, ptr: int, length: int, device: Optional[int] = None) -> int:
        core = self._core
        core.agent.check_open()
        core.registry.check_free(ptr, length, device)
        reg = core.agent.register(ptr, length, device)
        region_id = core.registry.add(ptr, length, device, handle=reg).region_id
        core.lists.release()  # the lists lack the new region: prepared again on next use
        return region_id

    def deregister(self, region_id: int, force: bool = False) -> None:
        """Forget a region once no peer can write into it: it is revoked from every peer that
        holds an export naming it, waiting for their acknowledgement or loss (at most
        ``config.revoke_timeout_s``; :class:`~transport.base.RevokeTimeout` naming the silent
        ones, the region still registered, unless ``force``). See :mod:`transport.nixl.revoke`."""
        core = self._core
        core.agent.check_open()
        core.registry.get(region_id)
        busy = [t for t in core.remotes.pending() if t.status() is TransferStatus.PENDING
                and t.src_region is not None and bool((t.src_region == region_id).any())]
        if busy:  # UCX would read freed memory and blame the peer (REMOTE_DISCONNECT)
            peers = sorted({t.name for t in busy})
            raise TransportError(f"region {region_id} is the source of {len(busy)} transfer(s) still pending "
                                 f"(to {peers}); wait for or abort them before deregistering it")
        core.holders.revoke(region_id, self.config.revoke_timeout_s, force)
        self._release_region(region_id)

    def _release_region(self, region_id: int) -> None:
        core = self._core
        core.agent.check_open()
        core.lists.release()  # they refer to the registration NIXL is about to let go
        core.agent.deregister(core.registry.remove(region_id))

    @property
    def regions(self) -> Mapping[int, Region]:
        return self._core.registry.view

    # -- peers ----------------------------------------------------------------------------

    def export(self) -> bytes:
        agent = self._core.agent
        return pack_descriptor(BACKEND, self._core.registry.view.values(), agent=self.name,
                               scratch=agent.scratch_ptr, metadata=agent.metadata())

    def connect(self, peer_bytes: bytes) -> NixlPeer:
        core = self._core
        agent, remotes = core.agent, core.remotes
        agent.check_open()
        body, regions = unpack_descriptor(peer_bytes, BACKEND, required=("agent", "metadata", "scratch"))
        name, metadata, scratch = body["agent"], body["metadata"], body["scratch"]
        if not isinstance(scratch, int) or isinstance(scratch, bool) or scratch <= 0:
            raise PeerDescriptorError(f"peer descriptor 'scratch' must be a positive address, got {scratch!r:.60}")
        if not isinstance(name, str) or not name:
            raise PeerDescriptorError(f"peer descriptor 'agent' must be a non-empty str, got {name!r:.60}")
        if not isinstance(metadata, bytes) or not metadata:
            raise PeerDescriptorError(f"peer descriptor 'metadata' must be non-empty bytes, got {metadata!r:.60}")
        if name in remotes.lost:  # a new connect after a loss: its failed requests are done, then a fresh endpoint
            left = remotes.drain(name)
            if left:
                raise PeerDraining(f"peer {name!r} still has {left} failed request(s) in flight (it stalled); "
                                   "connect again once it progresses or dies")
            del remotes.lost[name]
            if name not in remotes.current:
                remotes.idle.discard(name)
            core.remove_remote(name)  # its requests are done: a fresh lane (and Hello) with the fresh endpoint
        if name == self.name:
            if metadata == agent.metadata():
                raise PeerDescriptorError(f"peer descriptor is this transport's own export (agent {name!r})")
            raise PeerDescriptorError(f"peer agent {name!r} has this transport's name: agent names must be unique "
                                      "(NixlConfig.agent_name)")
        if stale_overlap(remotes.loaded.get(name, ()), regions):
            self._unload(name)  # NIXL could resolve writes to the stale entries: load afresh
        core.release_lists(name)  # lists of the metadata loaded now (again): prepared afresh
        try:  # NIXL updates an agent it already knows in place: pending writes keep going
            loaded = agent.load(metadata)
        except Exception as exc:
            raise PeerDescriptorError(
                f"NIXL rejected the metadata of peer {name!r} ({len(metadata)} bytes): {type(exc).__name__}: {exc}"
            ) from None
        if loaded != name:
            if loaded not in remotes.current and loaded not in remotes.idle:
                core.remove_remote(loaded)
            raise PeerDescriptorError(f"peer descriptor names agent {name!r} but its metadata is of {loaded!r}")
        old = remotes.current.get(name)
        if old is not None:  # a newer export of the same agent replaces the old snapshot
            old.retire()
            remotes.retired.add(old)
        remotes.loaded_too(name, descs(regions))
        peer = NixlPeer(core, name, regions, scratch)
        remotes.current[name] = peer
        remotes.idle.discard(name)
        peer.hold_seq = core.holds.hold(name, regions)
        return peer

    def _unload(self, name: str) -> None:
        """Drop the remote agent ``name`` from NIXL (its lane, its metadata, its endpoint) so
        that its next export loads afresh; refused while a write of ours to it is in flight
        (dropping the endpoint would cancel it)."""
        core = self._core
        direct = sum(t.status() is TransferStatus.PENDING for t in core.remotes.pending(name))
        lane = core.lanes.get(name)
        staged = lane is not None and lane.busy
        if direct or staged:
            raise PeerDraining(
                f"peer {name!r} deregistered regions that overlap ones its new export names, so NIXL must load "
                f"that export afresh, which would cancel this transport's writes in flight to it ({direct} direct"
                f"{', and staged ones' if staged else ''}): connect again once they end")
        core.remove_remote(name)

    def poll_notifications(self) -> list[Notification]:
        core = self._core
        core.pump()
        core.lanes.progress()  # staged writes of this side move on too
        out, core.notes[:] = list(core.notes), []
        return out

    def writer_gone(self, name: str) -> Optional[str]:
        """See :meth:`Transport.writer_gone`: a Release read from ``name``, or a 1-byte probe
        write into its scratch that failed with a disconnect (its process died; a probe every
        ``PROBE_INTERVAL_S`` while it holds)."""
        self._core.agent.check_open()
        return self._core.holders.gone(name)

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        core = self._core
        if core is None or core.agent.closed:
            return
        try:  # goodbyes already received (an owner's Closed, a holder's Release): none goes back to them
            core.pump()
        except Exception:
            pass
        for peer in core.remotes.peers():
            peer.close_now()  # the agent goes: nothing of it can land after that
        for step in (core.holds.close, core.holders.revoke_all):  # tell owners and holders; wait for none
            try:
                step()
            except Exception:
                pass
        core.lanes.close()
        core.receiver.close()
        core.lists.release()
        for rid in list(core.registry.view):
            try:
                self._release_region(rid)  # holders were told (revoke_all): see transport.nixl.revoke, 4.
            except Exception:  # keep releasing the rest; the agent's teardown frees it too
                pass
        core.agent.close(core.remotes.take_draining())  # the NIXL agent (its UCX context, progress thread) goes

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
