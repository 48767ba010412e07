"""Which engine a write takes: the direct kernel, or the staged engine's lane to the peer's GPU.

The staged engine needs the peer's GPU among this process's GPUs (found by UUID at connect),
a lane to it (streams, staging buffers; shared by every peer on that GPU) and the peer's
regions mapped under that GPU. When any of it fails the first time, the engine stays off for
this peer and :attr:`EngineRoute.error` says why; writes then take the kernel. A peer on this
process's own GPU gets a loopback lane only when a write asks for ``NvlinkEngine.STAGED``:
``AUTO`` never stages inside one GPU, where the kernel moves bytes at HBM speed.
"""

from __future__ import annotations

from typing import Callable, Optional

from transport.nvlink import ipc
from transport.nvlink.config import NvlinkConfig, NvlinkEngine, NvlinkUnsupported
from transport.nvlink.mapping import PeerMapping
from transport.nvlink.staged import StagedLane

__all__ = ["EngineRoute"]


class EngineRoute:
    """The engine choice of one peer (:meth:`lane_for`)."""

    def __init__(self, config: NvlinkConfig, name: str, peer_gpu: Optional[int],
                 open_lane: Callable[[int], StagedLane], mapping: PeerMapping, loopback: bool = False):
        """``peer_gpu``: the peer's GPU as numbered here (None: unknown); ``loopback``: it is the
        GPU that runs this process's copies."""
        self._config, self._name, self._peer_gpu = config, name, peer_gpu
        self._open_lane, self._mapping, self._loopback = open_lane, mapping, loopback
        self.error: Optional[str] = None  # why the staged engine is off for this peer

    @property
    def peer_gpu(self) -> Optional[int]:
        return self._peer_gpu

    def lane_for(self, engine: NvlinkEngine, total: int, rows: int, max_len: int) -> Optional[StagedLane]:
        """The staged lane when a batch of ``rows`` rows, ``total`` bytes and rows of at most
        ``max_len`` bytes takes the staged engine under ``engine``, else None (the kernel)."""
        cfg = self._config.staged
        auto_says_no = engine is NvlinkEngine.AUTO and (self._loopback or not cfg.wants(total, rows))
        if (auto_says_no or engine is NvlinkEngine.KERNEL or self._peer_gpu is None
                or self.error is not None or max_len > cfg.chunk_bytes):
            return None
        try:
            lane = self._open_lane(self._peer_gpu)
            self._mapping.bases(self._peer_gpu)  # the scatter kernel writes the peer's regions from there
            return lane
        except (ipc.CudaIpcError, NvlinkUnsupported, RuntimeError) as exc:
            self.error = f"staged engine off for peer {self._name!r}: {exc}"
            return None
