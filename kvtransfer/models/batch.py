"""What one forward step runs: a batch of requests, each extending its sequence by some tokens.

Prefill chunks and decode steps are the same thing here: request ``i`` already has
``prefix_lens[i]`` tokens in the pools and adds ``extend_lens[i]`` (1 for a decode step). The
new tokens of all requests are concatenated in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional, Tuple

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, T = sum(extend_lens)
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: the KV pool slots the new tokens are written to
    req_pool_indices: Tuple[int, ...]  # [B] rows of req_to_token
    prefix_lens: Tuple[int, ...]  # [B] tokens already in the pools
    extend_lens: Tuple[int, ...]  # [B] new tokens this step
    mamba_slots: Optional[Tuple[int, ...]] = None  # [B] Mamba pool slots (hybrid models), host ints
    # called with ``n`` once the K/V of the KV pool's first n layers (its layer_ids, in order) are
    # in the pools (queued on the device's stream on a GPU): those may leave for decode. A model
    # whose every layer holds KV calls it with ``i + 1`` after layer i; a hybrid one after each
    # attention layer (its Mamba state goes with the request's last chunk)
    after_layer: Optional[Callable[[int], None]] = field(default=None, compare=False)

    def __post_init__(self):
        b = len(self.req_pool_indices)
        if len(self.prefix_lens) != b or len(self.extend_lens) != b:
            raise ValueError(
                f"req_pool_indices, prefix_lens, extend_lens must have one entry per request, got "
                f"{b}, {len(self.prefix_lens)}, {len(self.extend_lens)}"
            )
        t = sum(self.extend_lens)
        for name in ("input_ids", "positions", "out_cache_loc"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"{name} must have shape [{t}], got {list(getattr(self, name).shape)}")
        if self.mamba_slots is not None and len(self.mamba_slots) != b:
            raise ValueError(f"mamba_slots must have one entry per request ({b}), got {len(self.mamba_slots)}")
        if any(n <= 0 for n in self.extend_lens):
            raise ValueError(f"every request must extend by >= 1 token, got {list(self.extend_lens)}")

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    def spans(self):
        """Per request ``(i, start, stop)`` of its tokens in the flat ``[T]`` arrays."""
        start = 0
        for i, n in enumerate(self.extend_lens):
            yield i, start, start + n
            start += n

    @cached_property
    def extend_index(self) -> "ExtendIndex":
        """The per-request indices on the batch's device, for the extend-attention kernel
        (built on first use, by one copy, and kept for every layer of the forward)."""
        b = self.batch_size
        host = torch.zeros(3, b + 1, dtype=torch.int32)  # rows: req rows, prefix lens, cu_seqlens
        host[0, :b] = torch.tensor(self.req_pool_indices, dtype=torch.int32)
        host[1, :b] = torch.tensor(self.prefix_lens, dtype=torch.int32)
        host[2, 1:] = torch.tensor(self.extend_lens, dtype=torch.int32).cumsum(0)
        dev = host.to(self.input_ids.device)
        return ExtendIndex(req_rows=dev[0, :b], prefix_lens=dev[1, :b], cu_seqlens=dev[2],
                           max_extend=max(self.extend_lens),
                           max_len=max(p + n for p, n in zip(self.prefix_lens, self.extend_lens)))

    def last_token_index(self) -> torch.Tensor:
        """``[B]`` index of each request's last new token in the flat arrays."""
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)


@dataclass(frozen=True)
class ExtendIndex:
    """A :class:`ForwardBatch`'s request indices on the device
    (:func:`kvtransfer.models.extend_attention.extend_attention` reads them)."""

    req_rows: torch.Tensor  # [B] int32 rows of req_to_token
    prefix_lens: torch.Tensor  # [B] int32 tokens already in the pools
    cu_seqlens: torch.Tensor  # [B + 1] int32: request i's new tokens are [cu[i], cu[i + 1])
    max_extend: int  # the longest chunk (sizes the kernel's grid)
    max_len: int  # the longest prefix + chunk


@dataclass(frozen=True)
class ExtendInputs:
    """A prefill step of several requests' chunks with every index on the device (what a CUDA
    graph reads): the flat token arrays of a :class:`ForwardBatch` (padding tokens after the real
    ones write to the padding slot and belong to no request), its :class:`ExtendIndex`, and
    ``last``, the index of each request's last token, whose logits are returned."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    extend_index: ExtendIndex
    last: torch.Tensor  # [B] int64


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step with every index on the device (what a CUDA graph reads): request ``i``
    adds token ``input_ids[i]`` at ``positions[i]`` and attends over ``seq_lens[i]`` tokens.
    ``splits`` is the attention kernel's split count (fixed per captured batch size)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [B] int64 KV pool slots the new tokens are written to
    req_rows: torch.Tensor  # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [B] int32 = positions + 1
    splits: int = 1
    mamba_slots: Optional[torch.Tensor] = None  # [B] int64 Mamba pool slots (hybrid models; padding: 0)
