"""The common envelope of every backend's ``export()`` bytes: backend, version, region table, extras."""

from __future__ import annotations

from typing import Iterable

import msgpack

from transport.batch import Region
from transport.errors import PeerDescriptorError

__all__ = ["DESCRIPTOR_VERSION", "pack_descriptor", "unpack_descriptor"]


DESCRIPTOR_VERSION = 1


def pack_descriptor(backend: str, regions: Iterable[Region], **fields) -> bytes:
    """The common envelope of ``export()`` bytes: backend, version, region table, extras."""
    body = {"backend": backend, "version": DESCRIPTOR_VERSION, "regions": [r.to_wire() for r in regions]}
    body.update(fields)
    return msgpack.packb(body, use_bin_type=True)


def unpack_descriptor(data: bytes, backend: str, required: Iterable[str] = ()) -> tuple[dict, dict[int, Region]]:
    """Decode and check an export envelope; return (body, regions by id)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PeerDescriptorError(f"peer descriptor must be bytes, got {type(data).__name__}")
    try:
        body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad input
        raise PeerDescriptorError(f"peer descriptor is not valid msgpack ({len(data)} bytes): {exc}") from None
    if not isinstance(body, dict):
        raise PeerDescriptorError(f"peer descriptor must be a map, got {type(body).__name__}")
    if body.get("backend") != backend:
        raise PeerDescriptorError(f"peer descriptor is for backend {body.get('backend')!r}, expected {backend!r}")
    if body.get("version") != DESCRIPTOR_VERSION:
        raise PeerDescriptorError(
            f"peer descriptor version {body.get('version')!r}, expected {DESCRIPTOR_VERSION}"
        )
    missing = [k for k in ("regions", *required) if k not in body]
    if missing:
        raise PeerDescriptorError(f"peer descriptor lacks fields {missing}")
    if not isinstance(body["regions"], list):
        raise PeerDescriptorError("peer descriptor 'regions' must be a list")
    regions = {}
    for item in body["regions"]:
        reg = Region.from_wire(item)
        if reg.region_id in regions:
            raise PeerDescriptorError(f"peer descriptor repeats region id {reg.region_id}")
        regions[reg.region_id] = reg
    return body, regions
