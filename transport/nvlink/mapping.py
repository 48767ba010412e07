"""A peer's regions mapped into this process: CUDA IPC handles opened under a local GPU.

A mapping opened under one GPU faults when another GPU's kernels use it, so the peer's
handles are opened once per GPU that launches on them: the local GPU (the direct kernel) and,
for the staged engine, the peer's GPU (its scatter kernel runs there, launched by this
process). Each opening gives a pointer table ``[num peer region ids]`` int64 (region base as
mapped under that GPU; 0 for ids the peer did not export), which the row and strided tables
index by region id.

A revoked region (:mod:`transport.nvlink.holds`) is unmapped by :meth:`PeerMapping.drop` and
skipped by later openings; its table entries become 0. The mailbox thread drops while the
writer's thread may open the mapping under another GPU: both take the mapping's lock.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

import numpy as np

from transport.base import PeerDescriptorError, Region
from transport.nvlink import ipc
from transport.nvlink.config import NvlinkUnsupported

__all__ = ["PeerMapping"]


class PeerMapping:
    """The peer's regions, opened per local GPU on demand; :meth:`close` unmaps them all."""

    def __init__(self, api, name: str, regions: Mapping[int, Region], handles: Mapping[int, tuple[bytes, int, int]]):
        """``handles``: region id -> (IPC handle, offset in the allocation, allocation bytes)."""
        for rid, (_, offset, alloc_size) in handles.items():
            reg = regions[rid]
            if offset + reg.length > alloc_size:
                raise PeerDescriptorError(
                    f"peer region {rid} [{offset}, +{reg.length}) exceeds its allocation of {alloc_size} bytes"
                )
        self._api, self._name, self._regions, self._handles = api, name, regions, dict(handles)
        self._bases: dict[int, np.ndarray] = {}  # GPU -> [num peer region ids] addresses
        self._opened: list[tuple[int, bytes, int]] = []  # (region id, handle, GPU it was opened under)
        self._dropped: set[int] = set()  # revoked region ids: unmapped, never opened again
        self._lock = threading.Lock()

    def is_open(self, device: int) -> bool:
        return device in self._bases

    def bases(self, device: int) -> np.ndarray:
        """The pointer table of the peer's regions as mapped for ``device``'s kernels (opened at
        the first call). :class:`NvlinkUnsupported` when a handle cannot be opened there."""
        table = self._bases.get(device)
        if table is not None:
            return table
        with self._lock:
            table = self._bases.get(device)
            return table if table is not None else self._open(device)

    def _open(self, device: int) -> np.ndarray:
        top = max(self._regions) if self._regions else -1
        table = np.zeros(top + 1, dtype=np.int64)  # [num peer region ids] addresses
        for rid, (handle, offset, _) in self._handles.items():
            if rid in self._dropped:
                continue
            try:
                base = ipc.open_handle(self._api, handle, device)
            except ipc.CudaIpcError as exc:
                raise NvlinkUnsupported(
                    f"cannot open peer {self._name!r} region {rid} (peer cuda:{self._regions[rid].device}) "
                    f"on local cuda:{device}: {exc}"
                ) from None
            self._opened.append((rid, handle, device))
            table[rid] = base + offset
        self._bases[device] = table
        return table

    @property
    def opened(self) -> bool:
        return bool(self._opened)

    def drop(self, regions: Iterable[int]) -> None:
        """Unmap ``regions`` (revoked: the caller waited for the copies that use them) under
        every GPU; later openings skip them."""
        regions = set(regions)
        with self._lock:
            self._dropped |= regions
            self._close([o for o in self._opened if o[0] in regions])
            for table in self._bases.values():
                table[[r for r in regions if r < table.size]] = 0

    def close(self) -> None:
        """Unmap every opened handle (the caller first waits for the copies that use them)."""
        with self._lock:
            self._close(list(self._opened))
            self._bases.clear()

    def _close(self, opened: list) -> None:
        for entry in opened:
            self._opened.remove(entry)
            _, handle, device = entry
            try:
                ipc.close_handle(self._api, handle, device)
            except ipc.CudaIpcError:
                pass  # the mapping is gone with the peer; nothing left to release
