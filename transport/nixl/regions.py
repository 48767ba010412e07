"""Region tables of the ``nixl`` backend: descriptors built from numpy, and the entries NIXL
holds for a remote agent."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from transport.batch import SMALL_BATCH, Region, RegionSizes

__all__ = ["RegionTable", "STAGING", "descs", "stale_overlap"]


class RegionTable:
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


def descs(regions: Mapping[int, Region]) -> set:
    """``(region id, ptr, length, device)`` of each region (device -1: host memory)."""
    return {(rid, r.ptr, r.length, -1 if r.device is None else r.device) for rid, r in regions.items()}


STAGING = -1  # the region id of a staged lane's memory among what an agent's metadata registers


def stale_overlap(loaded, regions: Mapping[int, Region]) -> bool:
    """Whether an entry NIXL holds for a remote agent (``loaded``: what :func:`descs` gave for
    each export loaded in place, and what its staged Hello or Welcome listed) belongs to a region
    the agent's newer export (``regions``) no longer names -- deregistered, registered again, or
    a lane's staging memory -- and overlaps a region it names: such an export is loaded afresh
    (:mod:`transport.nixl`, "Connecting again")."""
    current = descs(regions)
    stale = [d for d in loaded if d not in current]
    if not stale or not current:
        return False
    _, ptr, length, dev = (np.array(col, dtype=np.int64) for col in zip(*current))  # [R] each
    end = ptr + length
    return any(bool(((dev == d) & (ptr < p + n) & (p < end)).any()) for _, p, n, d in stale)
