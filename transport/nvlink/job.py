"""A prepared write: host work done once, the copy posted any number of times.

In the style of NIXL's prepped transfers (``prep_xfer_dlist`` / ``make_prepped_xfer``):
:meth:`NvlinkPeer.prepare <transport.nvlink.peer.NvlinkPeer.prepare>` checks the batch's
bounds, chooses the engine, builds the table in pinned host memory, plans the launch and, for
the staged engine, cuts the chunks; :meth:`PreparedWrite.post` uploads the tables at its first
call and queues the copy, returning one :class:`~transport.nvlink.transfer.NvlinkTransfer` per
call. ``peer.write(batch)`` is ``prepare``, one ``post`` and ``release``.

Regions are taken as they were at ``prepare``: deregister a local region only once no job
names it. A peer's region it revoked (:mod:`transport.nvlink.holds`) refuses every later post
of a job naming it (``RegionRevoked``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np

from transport.base import StridedBatch, WriteBatch
from transport.nvlink import kernel as kern
from transport.nvlink import staged
from transport.nvlink.config import NvlinkEngine
from transport.nvlink.route import EngineRoute
from transport.nvlink.tables import WriteTables

if TYPE_CHECKING:
    from transport.nvlink.peer import NvlinkPeer
    from transport.nvlink.transfer import NvlinkTransfer

__all__ = ["PreparedWrite"]

# (table on a GPU, device, torch stream, first row, end row, staging side) -> one kernel launch
Launch = Callable[..., None]


class PreparedWrite:
    """One batch ready to post to one peer; see the module docstring.

    ``engine``: the engine it takes (KERNEL or STAGED, never AUTO); ``nbytes``: bytes per post.
    :meth:`post` may be called again and again; :meth:`release` (or leaving a ``with`` block)
    drops the job's tables, transfers in flight keep what they read. Used from the peer's
    owner thread, as the peer is."""

    def __init__(self, peer: "NvlinkPeer", host_table, launch: Launch, nbytes: int, dst_region: np.ndarray,
                 lane: Optional[staged.StagedLane] = None, bounds: Optional[np.ndarray] = None,
                 offsets: Optional[np.ndarray] = None):
        self._peer = peer
        self.dst_region = dst_region  # [n] or [P] the peer's regions it writes (what a post checks against revokes)
        self.host_table = host_table  # pinned int64 tensor: the row table [3 or 4, n] or the strided table
        self.launch = launch
        self.nbytes = nbytes
        self.lane = lane  # the staged engine's lane; None: the direct kernel
        self.bounds = bounds  # staged: chunk k is rows [bounds[k], bounds[k + 1])
        self.offsets = offsets  # staged: staging offset of each bound
        self.device_tables: Optional[tuple] = None  # uploaded at the first post
        self._released = False

    @property
    def engine(self) -> NvlinkEngine:
        return NvlinkEngine.KERNEL if self.lane is None else NvlinkEngine.STAGED

    @property
    def released(self) -> bool:
        return self._released

    def post(self, notify: Optional[bytes] = None) -> "NvlinkTransfer":
        """Queue one copy of the batch; ``notify`` reaches the peer after its bytes (as for
        ``Peer.write``). ``ValueError`` once released, ``TransportClosed`` once the peer closed."""
        return self._peer._post_job(self, notify)

    def release(self) -> None:
        """Drop the tables (idempotent); later :meth:`post` calls raise ``ValueError``."""
        self._released = True
        self.host_table = self.device_tables = self.launch = None

    def __enter__(self) -> "PreparedWrite":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _chunk_starts(config: staged.StagedConfig, total: int) -> np.ndarray:
    return staged.chunk_starts(total, config.chunk_bytes, config.edge_bytes)


def build(peer: "NvlinkPeer", batch: Union[WriteBatch, StridedBatch], engine: NvlinkEngine, tables: WriteTables,
          route: EngineRoute, config) -> PreparedWrite:
    """The host side of a write of ``batch`` (bounds already checked): the engine's lane, the
    table in pinned memory, the launch, the chunks. ``config``: the peer's ``NvlinkConfig``."""
    import torch

    n, warps = len(batch), config.kernel.num_warps
    max_len = int(batch.length.max()) if n else 0
    if isinstance(batch, StridedBatch):
        num_pairs, num_slots = batch.num_pairs, batch.num_slots
        lane = route.lane_for(engine, int(batch.length.sum()) * num_slots, n, max_len) if n else None
        host = torch.empty(kern.strided_table_size(num_pairs, num_slots, lane is not None), dtype=torch.int64,
                           pin_memory=True)
        table = tables.strided_table(batch, out=host.numpy(), checked=True, lane=lane)
        plan = tables.strided_plan(batch, table, staged_launch=lane is not None)

        def launch(table_dev, dev, stream, begin=0, end=None, stage=None):
            kern.scatter_strided(table_dev, num_pairs, num_slots, plan, dev, warps, begin=begin, end=end,
                                 stage=stage, checked=True, stream=stream)

        if lane is None:
            return PreparedWrite(peer, host, launch, batch.nbytes, batch.dst_region)
        bounds, offsets = staged.strided_cuts(table[5 * num_pairs: 6 * num_pairs].tolist(), batch.length.tolist(),
                                              num_slots, config.staged.chunk_bytes, config.staged.edge_bytes)
        return PreparedWrite(peer, host, launch, batch.nbytes, batch.dst_region, lane, bounds, offsets)
    lane = route.lane_for(engine, int(batch.length.sum()), n, max_len) if n else None
    host = torch.empty((3 if lane is None else 4, n), dtype=torch.int64, pin_memory=True)  # [3 or 4, num_rows]
    rows = tables.row_table(batch, out=host.numpy(), checked=True, lane=lane)
    plan = tables.launch_plan(batch, rows, staged_launch=lane is not None)

    def launch(rows_dev, dev, stream, begin=0, end=None, stage=None):
        kern.scatter_rows(rows_dev, plan, dev, warps, begin=begin, end=end, stage=stage, checked=True,
                          stream=stream)

    if lane is None:
        return PreparedWrite(peer, host, launch, batch.nbytes, batch.dst_region)
    total = int(rows[3, -1] + batch.length[-1])
    bounds = staged.row_chunks(rows[3], total, _chunk_starts(config.staged, total))
    return PreparedWrite(peer, host, launch, batch.nbytes, batch.dst_region, lane, bounds,
                         np.append(rows[3], total)[bounds])
