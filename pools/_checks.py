"""Argument checks shared by every pool: one helper, one message style (expected vs got)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def layer_id_of(layer) -> int:
    """A ``layer`` argument is an int or anything with an int ``layer_id``."""
    layer_id = layer if isinstance(layer, int) else getattr(layer, "layer_id", None)
    if not isinstance(layer_id, int) or isinstance(layer_id, bool):
        raise TypeError(f"layer must be an int or have an int layer_id, got {type(layer).__name__}")
    return layer_id


def check_tensor(
    name: str,
    t,
    *,
    shape: Optional[Sequence[Optional[int]]] = None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> None:
    """Raise TypeError/ValueError when ``t`` is not a tensor of the expected shape/dtype/device.

    ``shape`` entries of None match any size.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(e is None or e == s for e, s in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def check_indices(name: str, idx, upper: int, device=None) -> torch.Tensor:
    """Integer index tensor with every value in [0, upper); returns it as int64 on ``device``."""
    if not isinstance(idx, torch.Tensor):
        idx = torch.as_tensor(idx)
    if idx.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise TypeError(f"{name} must be an integer tensor, got dtype {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(idx.shape)}")
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= upper:
            raise ValueError(f"{name} must lie in [0, {upper}), got values in [{lo}, {hi}]")
    idx = idx.to(torch.int64)
    return idx if device is None else idx.to(device)


def tensor_bytes(t) -> int:
    """Bytes held by a tensor or a (nested) list of tensors."""
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return t.numel() * t.element_size()
