"""The host side of a write before it is posted: which engine it takes (:class:`EngineRoute`),
its tables (:class:`WriteTables`) and the prepared write (:class:`PreparedWrite`).

Engine
------
The staged engine needs the peer's GPU among this process's GPUs (found by UUID at connect), a
lane to it (streams, staging buffers; shared by every peer on that GPU) and the peer's regions
mapped under that GPU. When any of it fails the first time, the engine stays off for this peer
and :attr:`EngineRoute.error` says why; writes then take the kernel. A peer on this process's
own GPU gets a loopback lane only when a write asks for ``NvlinkEngine.STAGED``: ``AUTO`` never
stages inside one GPU, where the kernel moves bytes at HBM speed.

Tables
------
Bounds against both sides' regions, row and strided tables, launch plans (layouts in
:mod:`transport.nvlink.kernel`). Addresses come from two pointer tables indexed by region id:
the local regions' bases (from the transport's registry, rebuilt when it changes) and the
peer's as mapped here (:class:`~transport.nvlink.ipc.PeerMapping`; for the staged engine, as
mapped under the peer's GPU, whose scatter kernel writes them).

Prepared writes
---------------
In the style of NIXL's prepped transfers (``prep_xfer_dlist`` / ``make_prepped_xfer``):
:meth:`NvlinkPeer.prepare <transport.nvlink.transport.NvlinkPeer.prepare>` checks the batch's
bounds, and :func:`build` chooses the engine, builds the table in pinned host memory, plans the
launch and, for the staged engine, cuts the chunks; :meth:`PreparedWrite.post` uploads the
tables at its first call and queues the copy, returning one
:class:`~transport.nvlink.completion.NvlinkTransfer` per call. ``peer.write(batch)`` is
``prepare``, one ``post`` and ``release``. Regions are taken as they were at ``prepare``:
deregister a local region only once no job names it. A peer's region it revoked
(:mod:`transport.nvlink.revoke`) refuses every later post of a job naming it (``RegionRevoked``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Union

import numpy as np

from transport.base import Region, RegionSizes, StridedBatch, WriteBatch
from transport.nvlink import ipc, kernel as kern, staged
from transport.nvlink.completion import NvlinkTransfer
from transport.nvlink.config import NvlinkConfig, NvlinkEngine
from transport.nvlink.ipc import NvlinkUnsupported, PeerMapping
from transport.nvlink.staged import StagedLane
from transport.registry import RegionRegistry

__all__ = ["EngineRoute", "PreparedWrite", "WriteTables", "base_table"]


# -- the engine ------------------------------------------------------------------------------------


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


# -- tables ----------------------------------------------------------------------------------------


def base_table(regions: Mapping[int, Region]) -> np.ndarray:
    """``[max id + 1]`` int64: each region's base address by id (0: not registered)."""
    table = np.zeros(max(regions, default=-1) + 1, dtype=np.int64)
    for rid, reg in regions.items():
        table[rid] = reg.ptr
    return table


class WriteTables:
    """Bounds, tables and launch plans of one peer's writes (the local side from ``local``)."""

    def __init__(self, local: RegionRegistry, peer_sizes: RegionSizes, mapping: PeerMapping, device: int,
                 config: NvlinkConfig):
        self._local, self._peer_sizes, self._mapping = local, peer_sizes, mapping
        self._device, self._config = device, config

    def _dst_base(self, lane: Optional[StagedLane]) -> np.ndarray:
        return self._mapping.bases(self._device if lane is None else lane.peer)

    def check_bounds(self, batch) -> None:
        """``ValueError`` naming the first entry (pair) of ``batch`` outside its regions."""
        batch.check_bounds(self._local.sizes, self._peer_sizes)

    def row_table(self, batch: WriteBatch, out: Optional[np.ndarray] = None, checked: bool = False,
                  lane: Optional[StagedLane] = None) -> np.ndarray:
        """The ``[3, n]`` row table (source address, destination address, bytes) launched for
        ``batch``. ``checked``: the caller already ran :meth:`check_bounds`. With a ``lane``:
        the staged ``[4, n]`` form, destinations as mapped under the peer's GPU."""
        if not checked:
            self.check_bounds(batch)
        return kern.build_row_table(
            self._local.derived(base_table), batch.src_region, batch.src_offset,
            self._dst_base(lane), batch.dst_region, batch.dst_offset, batch.length, out=out, staged=lane is not None,
        )

    def strided_table(self, batch: StridedBatch, out: Optional[np.ndarray] = None, checked: bool = False,
                      lane: Optional[StagedLane] = None) -> np.ndarray:
        """The ``[5 * P + 2 * S]`` strided table launched for ``batch``. ``checked``: the caller
        already ran :meth:`check_bounds`. With a ``lane``: the staged form (``+ P`` offsets),
        destinations under the peer's GPU."""
        if not checked:
            self.check_bounds(batch)
        pairs = (batch.src_region, batch.src_offset, batch.src_stride, batch.dst_region, batch.dst_offset,
                 batch.dst_stride, batch.length)
        return kern.build_strided_table(self._local.derived(base_table), self._dst_base(lane), pairs,
                                        batch.src_slot, batch.dst_slot, out=out, staged=lane is not None)

    def kernel_config(self, staged_launch: bool) -> kern.KernelConfig:
        """The launch settings: the config's, with the staged engine's ``max_programs`` for its launches."""
        if not staged_launch:
            return self._config.kernel
        return dataclasses.replace(self._config.kernel, max_programs=self._config.staged.max_programs)

    def launch_plan(self, batch: WriteBatch, rows: np.ndarray, staged_launch: bool = False) -> kern.LaunchPlan:
        """Copy path and tile shape for ``batch`` (``rows`` from :meth:`row_table`)."""
        n = len(batch)
        return kern.plan_launch(n, int(batch.length.max()) if n else 1, kern.choose_path(rows),
                                self.kernel_config(staged_launch))

    def strided_plan(self, batch: StridedBatch, table: np.ndarray, staged_launch: bool = False) -> kern.LaunchPlan:
        """Copy path (from the pair part alone, O(P)) and tile shape for ``batch``."""
        n = len(batch)
        path = kern.choose_path(table[: 5 * batch.num_pairs])
        return kern.plan_launch(n, int(batch.length.max()) if n else 1, path, self.kernel_config(staged_launch))


# -- prepared writes -------------------------------------------------------------------------------


# (table on a GPU, device, torch stream, first row, end row, staging side) -> one kernel launch
Launch = Callable[..., None]
# (prepared write, notification) -> the transfer: the peer's checks, then the copy queued and tracked
Post = Callable[["PreparedWrite", Optional[bytes]], NvlinkTransfer]


class PreparedWrite:
    """One batch ready to post to one peer; see the module docstring.

    ``engine``: the engine it takes (KERNEL or STAGED, never AUTO); ``nbytes``: bytes per post.
    :meth:`post` may be called again and again; :meth:`release` (or leaving a ``with`` block)
    drops the job's tables, transfers in flight keep what they read. Used from the peer's
    owner thread, as the peer is."""

    def __init__(self, post: Post, host_table, launch: Launch, nbytes: int, dst_region: np.ndarray,
                 lane: Optional[staged.StagedLane] = None, bounds: Optional[np.ndarray] = None,
                 offsets: Optional[np.ndarray] = None):
        self._post = post  # the peer's post of a prepared write
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

    def post(self, notify: Optional[bytes] = None) -> NvlinkTransfer:
        """Queue one copy of the batch; ``notify`` reaches the peer after its bytes (as for
        ``Peer.write``). ``ValueError`` once released, ``TransportClosed`` once the peer closed."""
        return self._post(self, notify)

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


def build(post: Post, batch: Union[WriteBatch, StridedBatch], engine: NvlinkEngine, tables: WriteTables,
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
            return PreparedWrite(post, host, launch, batch.nbytes, batch.dst_region)
        bounds, offsets = staged.strided_cuts(table[5 * num_pairs: 6 * num_pairs].tolist(), batch.length.tolist(),
                                              num_slots, config.staged.chunk_bytes, config.staged.edge_bytes)
        return PreparedWrite(post, host, launch, batch.nbytes, batch.dst_region, lane, bounds, offsets)
    lane = route.lane_for(engine, int(batch.length.sum()), n, max_len) if n else None
    host = torch.empty((3 if lane is None else 4, n), dtype=torch.int64, pin_memory=True)  # [3 or 4, num_rows]
    rows = tables.row_table(batch, out=host.numpy(), checked=True, lane=lane)
    plan = tables.launch_plan(batch, rows, staged_launch=lane is not None)

    def launch(rows_dev, dev, stream, begin=0, end=None, stage=None):
        kern.scatter_rows(rows_dev, plan, dev, warps, begin=begin, end=end, stage=stage, checked=True,
                          stream=stream)

    if lane is None:
        return PreparedWrite(post, host, launch, batch.nbytes, batch.dst_region)
    total = int(rows[3, -1] + batch.length[-1])
    bounds = staged.row_chunks(rows[3], total, _chunk_starts(config.staged, total))
    return PreparedWrite(post, host, launch, batch.nbytes, batch.dst_region, lane, bounds,
                         np.append(rows[3], total)[bounds])
