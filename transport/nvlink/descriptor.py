"""The nvlink backend's export: what a peer needs to map our regions and find our GPU.

An export is :func:`transport.base.pack_descriptor` of the backend ``nvlink`` with, besides the
region table: ``name``, ``host`` (:func:`transport.nvlink.mailbox.host_id`), ``pid``, ``mailbox`` (the
notification socket's name), ``ipc`` (``[region id, 64-byte CUDA IPC handle, offset in the
allocation, allocation bytes]`` per region) and, optionally, ``gpu_uuid``: the UUID of the GPU
holding the regions, by which the peer finds that GPU among its own ordinals (the staged engine
launches kernels there; without it, or when the peer does not see that GPU, it stays off).
"""

from __future__ import annotations

from typing import Optional

from transport.nvlink.ipc import IPC_HANDLE_BYTES
from transport.base import PeerDescriptorError, Region, unpack_descriptor

__all__ = ["BACKEND", "gpu_uuid", "local_ordinal", "parse_descriptor"]

BACKEND = "nvlink"


def gpu_uuid(device: Optional[int]) -> Optional[str]:
    """The UUID of ``device`` (the same GPU has the same UUID in every process), or None."""
    if device is None:
        return None
    try:
        import torch

        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # no CUDA, or a torch without the property: the staged engine stays off
        return None


def local_ordinal(uuid) -> Optional[int]:
    """This process's ordinal of the GPU with ``uuid`` (None when it does not see it)."""
    if not isinstance(uuid, str):
        return None
    import torch

    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    return None


def parse_descriptor(peer_bytes) -> tuple[dict, dict[int, Region], dict[int, tuple[bytes, int, int]]]:
    """Decode an nvlink export: (body, regions by id, ipc by id as (handle, offset, alloc_size))."""
    body, regions = unpack_descriptor(peer_bytes, BACKEND, required=("name", "host", "pid", "mailbox", "ipc"))
    for key, typ in (("name", str), ("host", str), ("pid", int), ("mailbox", str), ("ipc", list)):
        if not isinstance(body[key], typ):
            raise PeerDescriptorError(f"peer descriptor field {key!r} must be {typ.__name__}, got {body[key]!r:.60}")
    host_regions = [rid for rid, r in regions.items() if not r.is_cuda]
    if host_regions:
        raise PeerDescriptorError(f"nvlink peer descriptor lists host regions {host_regions}; only GPU regions are allowed")
    ipc: dict[int, tuple[bytes, int, int]] = {}
    for item in body["ipc"]:
        ok = (
            isinstance(item, list) and len(item) == 4 and isinstance(item[0], int)
            and isinstance(item[1], bytes) and len(item[1]) == IPC_HANDLE_BYTES
            and isinstance(item[2], int) and isinstance(item[3], int) and item[2] >= 0 and item[3] > 0
        )
        if not ok:
            raise PeerDescriptorError(
                f"ipc entry must be [region id, {IPC_HANDLE_BYTES}-byte handle, offset >= 0, "
                f"allocation size > 0], got {item!r:.80}"
            )
        ipc[item[0]] = (item[1], item[2], item[3])
    if set(ipc) != set(regions):
        raise PeerDescriptorError(
            f"ipc entries cover regions {sorted(ipc)}, the region table lists {sorted(regions)}"
        )
    return body, regions, ipc
