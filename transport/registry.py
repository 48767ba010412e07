"""The registered regions of one transport, shared by every backend.

A backend's ``register`` checks its arguments (:meth:`RegionRegistry.check`), registers the
memory with its own machinery (a NIXL memory registration, a CUDA IPC export), then records
it here (:meth:`RegionRegistry.add`) with that registration as the region's *handle*; its
``deregister`` takes the handle back with :meth:`RegionRegistry.remove` and releases it.

What the contract (:mod:`transport.base`) promises lives here once:

- ids are small ints, dense from 0, never reused while the registry lives, below
  :data:`~transport.base.MAX_REGION_ID`;
- ``regions`` is a read-only, live view (:attr:`RegionRegistry.view`);
- an unknown id raises ``ValueError`` naming the live ids;
- tables derived from the regions (the :class:`~transport.base.RegionSizes` that bounds checks
  read, a backend's pointer arrays) are built once and rebuilt after a change
  (:meth:`RegionRegistry.derived`), so a write never loops over the regions.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, TypeVar

from transport.batch import MAX_REGION_ID, Region, RegionSizes, check_region_args
from transport.errors import TransportError

__all__ = ["RegionRegistry"]

T = TypeVar("T")


class RegionRegistry:
    """Region id -> :class:`Region` (and the backend's handle of it), with cached derived tables."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._handles: dict[int, Any] = {}
        self._next_id = 0
        self._derived: dict[Callable, Any] = {}  # build function -> its table of the current regions
        self.view: Mapping[int, Region] = MappingProxyType(self._regions)  # read-only, live

    check = staticmethod(check_region_args)

    @staticmethod
    def frozen(regions: Mapping[int, Region]) -> Mapping[int, Region]:
        """A read-only copy of a region table (a peer's, from its export)."""
        return MappingProxyType(dict(regions))

    def check_free(self, ptr: int, length: int, device: Optional[int]) -> None:
        """:meth:`check`, and ``ValueError`` when ``[ptr, ptr + length)`` overlaps a live region
        of the same memory (host, or the same CUDA device): one byte has one region id, so a
        region deregistered while another still covers its bytes cannot happen by accident.
        Backends call it before registering with their own machinery."""
        check_region_args(ptr, length, device)
        for reg in self._regions.values():
            if reg.device == device and ptr < reg.ptr + reg.length and reg.ptr < ptr + length:
                where = "host" if device is None else f"cuda:{device}"
                raise ValueError(f"[{ptr:#x}, +{length}) on {where} overlaps region {reg.region_id} "
                                 f"[{reg.ptr:#x}, +{reg.length}); register each byte range once")

    def add(self, ptr: int, length: int, device: Optional[int], handle: Any = None) -> Region:
        """Record a region under the next id (arguments checked again)."""
        self.check_free(ptr, length, device)
        rid = self._next_id
        if rid >= MAX_REGION_ID:  # peers refuse larger ids (they size tables by the largest id)
            raise TransportError(f"region ids exhausted: {MAX_REGION_ID} registrations in this transport's "
                                 "lifetime (ids are never reused); use a new transport")
        self._next_id += 1
        self._regions[rid] = Region(rid, ptr, length, device)
        self._handles[rid] = handle
        self._derived.clear()
        return self._regions[rid]

    def remove(self, region_id: int) -> Any:
        """Forget ``region_id``; return its handle. ``ValueError`` for an id not registered."""
        self.get(region_id)
        del self._regions[region_id]
        self._derived.clear()
        return self._handles.pop(region_id)

    def get(self, region_id: int) -> Region:
        """The region ``region_id``, or ``ValueError`` naming the live ids."""
        reg = self._regions.get(region_id) if isinstance(region_id, int) else None
        if reg is None:
            raise ValueError(f"region {region_id!r} is not registered (live ids: {sorted(self._regions)[:16]})")
        return reg

    def handle(self, region_id: int) -> Any:
        self.get(region_id)
        return self._handles[region_id]

    def derived(self, build: Callable[[Mapping[int, Region]], T]) -> T:
        """``build(view)``, cached until the regions change (one cache entry per ``build``)."""
        table = self._derived.get(build)
        if table is None:
            table = self._derived[build] = build(self.view)
        return table

    @property
    def sizes(self) -> RegionSizes:
        """The regions' :class:`RegionSizes` (what ``check_bounds`` reads), rebuilt on change."""
        return self.derived(RegionSizes)

    def items(self) -> Iterator[tuple[Region, Any]]:
        """(region, handle) pairs, by id."""
        return ((self._regions[rid], self._handles[rid]) for rid in sorted(self._regions))

    def __len__(self) -> int:
        return len(self._regions)

    def clear(self) -> None:
        """Forget every region (their handles are the caller's to release first)."""
        self._regions.clear()
        self._handles.clear()
        self._derived.clear()
