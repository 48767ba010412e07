"""The writer's side of revocation, common to the backends: the regions of one owner revoked
from this writer, and the check every write makes against them.

A write's check is a truth test while nothing is revoked, else one vectorised ``np.isin`` over
the batch's destination regions: no message, no system call.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

__all__ = ["Revoked"]


class Revoked:
    """Region ids of one owner that writes may no longer name (revoked, or gone at the hold)."""

    def __init__(self):
        self._ids: set[int] = set()
        self._sorted = np.zeros(0, dtype=np.int64)  # [k] what hit() reads

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __contains__(self, region_id: int) -> bool:
        return region_id in self._ids

    def drop(self, regions: Iterable[int]) -> None:
        self._ids.update(int(r) for r in regions)
        self._sorted = np.asarray(sorted(self._ids), dtype=np.int64)

    def hit(self, dst_region: np.ndarray) -> Optional[int]:
        """The first of ``dst_region`` ([n] ids) that is revoked, else None."""
        if not self._ids or dst_region.size == 0:
            return None
        hit = np.isin(dst_region, self._sorted)  # [n]
        return int(dst_region[int(np.argmax(hit))]) if hit.any() else None

    def check(self, owner: str, dst_region: np.ndarray) -> Optional[str]:
        """Why a write naming ``dst_region`` of ``owner`` is refused (``RegionRevoked``'s
        message), or None."""
        rid = self.hit(dst_region)
        if rid is None:
            return None
        return (f"region {rid} of peer {owner!r} was revoked: its owner deregistered it (connect to a newer "
                "export of the peer; nothing was written)")
