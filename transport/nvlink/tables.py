"""The tables one peer launches: bounds against both sides' regions, row and strided tables,
launch plans (layouts in :mod:`transport.nvlink.kernel`).

Addresses come from two pointer tables indexed by region id: the local regions' bases (from
the transport's registry, rebuilt when it changes) and the peer's as mapped here
(:class:`~transport.nvlink.mapping.PeerMapping`; for the staged engine, as mapped under the
peer's GPU, whose scatter kernel writes them).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import numpy as np

from transport.base import Region, RegionSizes, StridedBatch, WriteBatch
from transport.nvlink import kernel as kern
from transport.nvlink.config import NvlinkConfig
from transport.nvlink.mapping import PeerMapping
from transport.nvlink.staged import StagedLane
from transport.registry import RegionRegistry

__all__ = ["WriteTables", "base_table"]


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
