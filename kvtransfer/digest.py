"""Per-layer checksums of one request's KV and state that do not depend on tensor parallelism.

A prefill node at TP 3 and a decode node at TP 1 hold the same request in different shapes:
each prefill rank a third of the heads, the decode rank all of them. To check that the bytes
decode received are, bit for bit, those prefill computed, every rank hashes its own share cut
into the *units* the layout shards by (a KV head, a Mamba conv channel or group block, an SSM
head; the whole row when replicated), each keyed by where the unit starts in the unsharded row::

    parts = [rank_digests(layout_r, kv_infos_r, state_infos_r, slots, state_slot) for each rank r]
    layers = layer_digests(parts)          # {"kv.3": hex, "state.0": hex, ...}

Both sides' ``layer_digests`` are equal exactly when (up to BLAKE2b collisions) every unit's
bytes over the request's tokens, in token order, are equal. Replicated units (MLA latent rows,
heads replicated when TP exceeds them) are hashed by each replica, and the replicas must agree.

A unit digest reads ``tokens x unit bytes``; a request of ``n`` tokens costs about one pass over
its KV on each rank (the pools' memory, host or CUDA, read through its exported pointers).
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from kvtransfer.layout import RankLayout

__all__ = ["DigestMismatch", "layer_digests", "rank_digests"]


class DigestMismatch(ValueError):
    """Two replicas of one unit hold different bytes."""


class _CudaBytes:
    """A raw CUDA pointer as a uint8 array torch can wrap (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _rows(ptr: int, nbytes: int, device: Optional[int], offsets: np.ndarray, width: int) -> np.ndarray:
    """``[len(offsets), width]`` bytes read from ``ptr + offsets[i]`` (host or CUDA memory)."""
    if device is None:
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return buf[offsets[:, None] + np.arange(width)]
    import torch

    buf = torch.as_tensor(_CudaBytes(ptr, nbytes), device=f"cuda:{device}")
    idx = torch.as_tensor(offsets[:, None] + np.arange(width), device=buf.device)
    return buf[idx].cpu().numpy()


def _part_digests(part: str, layer_ids, specs, infos, page_size: int, slots: np.ndarray,
                  layout: RankLayout, device: Optional[int], out: dict) -> None:
    ptrs, lens, _ = infos
    for spec in specs:
        pieces = spec.pieces(layout.tp_rank, layout.tp_size)
        offsets = (slots // page_size) * spec.page_bytes + spec.section_start + (slots % page_size) * spec.row_bytes
        for pos, layer in enumerate(layer_ids):
            buf = spec.export_index * len(layer_ids) + pos
            rows = _rows(ptrs[buf], lens[buf], device, offsets, spec.row_bytes)  # [tokens, row bytes]
            for (logical, length, physical, _), (_, channels) in zip(pieces, spec.groups):
                unit = channels * spec.unit_bytes
                for k in range(0, length, unit):
                    key = (part, layer, spec.name, logical + k)
                    out[key] = hashlib.blake2b(np.ascontiguousarray(rows[:, physical + k:physical + k + unit]),
                                               digest_size=16).digest()


def rank_digests(layout: RankLayout, kv_infos, state_infos, slots: Sequence[int],
                 state_slot: Optional[int] = None, device: Optional[int] = None) -> Dict[tuple, bytes]:
    """This rank's unit digests of the request at token ``slots`` (and Mamba ``state_slot``):
    ``{(part, layer, tensor, offset in the full row): digest}``. ``kv_infos`` / ``state_infos``
    are the pools' exports (``get_contiguous_buf_infos()`` / ``get_state_buf_infos()``),
    ``device`` the CUDA ordinal of the pools (None: host memory)."""
    slots = np.asarray(slots, dtype=np.int64)
    out: Dict[tuple, bytes] = {}
    _part_digests("kv", layout.layer_ids, layout.kv_tensors, kv_infos, layout.page_size, slots, layout, device, out)
    if layout.is_hybrid:
        if state_slot is None:
            raise ValueError("this layout has Mamba state: state_slot is required")
        _part_digests("state", layout.state_layer_ids, layout.state_tensors, state_infos, 1,
                      np.array([state_slot], dtype=np.int64), layout, device, out)
    return out


def layer_digests(parts: Iterable[Dict[tuple, bytes]]) -> Dict[str, str]:
    """Every rank's :func:`rank_digests` joined into one hex digest per layer and part
    (``"kv.<layer>"``, ``"state.<layer>"``); :class:`DigestMismatch` when replicas differ."""
    units: Dict[tuple, bytes] = {}
    for part in parts:
        for key, digest in part.items():
            if units.setdefault(key, digest) != digest:
                raise DigestMismatch(f"replicas of {key[0]} layer {key[1]} {key[2]} at byte {key[3]} differ")
    layers: Dict[str, "hashlib._Hash"] = {}
    for (part, layer, name, offset) in sorted(units):
        h = layers.setdefault(f"{part}.{layer}", hashlib.blake2b(digest_size=16))
        h.update(f"{name}@{offset}:".encode() + units[(part, layer, name, offset)])
    return {k: h.hexdigest() for k, h in layers.items()}
