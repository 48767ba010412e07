"""Request pools: a request's row of token slots, and (hybrid models) its Mamba state slot.

Requests
--------
The pools take any request object with these plain attributes (SGLang's ``Req`` has them;
a small dataclass will do):

- ``req_pool_idx: Optional[int]`` — this pool's row; None until ``alloc`` sets it, reset to
  None by ``free``. A request that arrives at ``alloc`` with a row keeps it (chunked prefill);
- ``is_chunked: int`` and ``kv_committed_len: int`` — read only for such a reusing request:
  one of them must be > 0 (missing attributes count as 0);
- hybrid pool only: ``mamba_pool_idx`` (None, or a 0-D int64 tensor: the Mamba slot, set by
  ``alloc`` unless already set, e.g. by a radix cache hit; reset by ``free_mamba_cache``);
  with ``enable_mamba_extra_buffer`` also ``mamba_ping_pong_track_buffer`` (None or a 1-D
  int64 tensor of track slots) and ``mamba_next_track_idx: int``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import List, Optional, Sequence

import torch

from pools.describe import Export, TransferLayout
from pools.mamba import MambaPool, MambaSpeculativeState, MambaState, MambaStateParams

logger = logging.getLogger(__name__)


class ReqToTokenPool:
    """Maps a request (row) to its token slot indices in the KV pool.

    ``req_to_token``: ``[size + 1, max_context_len]`` int32 on ``device``. Row 0 is the padding
    row that padded (CUDA-graph) batches point at; rows ``1..size`` are handed out from the
    front of a FIFO free list and returned to its back. ``enable_memory_saver`` is accepted and
    ignored (no memory saver here).
    """

    def __init__(self, size: int, max_context_len: int, device: str = "cpu", enable_memory_saver: bool = False):
        for name, value in (("size", size), ("max_context_len", max_context_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.size = size
        self._alloc_size = size + 1
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((self._alloc_size, max_context_len), dtype=torch.int32, device=device)
        self._reset_rows()

    def write(self, indices, values) -> None:
        """``req_to_token[indices] = values`` (any torch indexing expression)."""
        self.req_to_token[indices] = values

    def available_size(self) -> int:
        return len(self.free_slots)

    def _check_reusing(self, reqs: Sequence) -> List[int]:
        """Positions of requests that already hold a row; ValueError if one may not reuse it."""
        reusing = [i for i, r in enumerate(reqs) if r.req_pool_idx is not None]
        rows = [reqs[i].req_pool_idx for i in reusing]
        for i, row in zip(reusing, rows):
            if not (getattr(reqs[i], "is_chunked", 0) > 0 or getattr(reqs[i], "kv_committed_len", 0) > 0):
                raise ValueError(f"request {i} reuses row {row} but is neither chunked nor has committed KV")
            if not isinstance(row, int) or not 1 <= row <= self.size or row not in self._in_use:
                raise ValueError(f"request {i} reuses row {row!r}, which is not an allocated row of this pool")
        if len(set(rows)) != len(rows):
            raise ValueError(f"requests of one batch reuse the same row: {rows}")
        return reusing

    def alloc(self, reqs: Sequence) -> Optional[List[int]]:
        """Give every request without a row a fresh one; return all their rows in order, or
        None (nothing changed) when too few rows are free."""
        need = len(reqs) - len(self._check_reusing(reqs))
        if need > len(self.free_slots):
            return None
        fresh = iter(self.free_slots[:need])
        self.free_slots = self.free_slots[need:]
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = next(fresh)
                self._in_use.add(r.req_pool_idx)
        return [r.req_pool_idx for r in reqs]

    def free(self, req) -> None:
        """Return ``req``'s row and set ``req.req_pool_idx`` to None (ValueError on a double free)."""
        row = req.req_pool_idx
        if row is None:
            raise ValueError("double free: request has no req_pool_idx")
        if row not in self._in_use:
            raise ValueError(f"double free or foreign row: row {row!r} is not allocated")
        self._in_use.remove(row)
        self.free_slots.append(row)
        req.req_pool_idx = None

    def clear(self) -> None:
        """All rows free again (requests still holding a row are not touched)."""
        self._reset_rows()

    def _reset_rows(self) -> None:
        self.free_slots = list(range(1, self._alloc_size))
        self._in_use = set()


class HybridReqToTokenPool(ReqToTokenPool):
    """:class:`ReqToTokenPool` plus a :class:`MambaPool` slot per request.

    - ``req_index_to_mamba_index_mapping``: ``[size + 1]`` int32, row -> Mamba slot;
    - with ``enable_mamba_extra_buffer``: ``req_index_to_mamba_ping_pong_track_buffer_mapping``
      ``[size + 1, P]`` int32, row -> P track slots, P = 2 with the overlap scheduler (ping-pong:
      one slot is written while the other is read) else 1.

    A request's existing ``mamba_pool_idx`` / track buffer is trusted as the caller's (e.g. a
    radix-cache hit). ``alloc`` takes the Mamba slots it needs or, when the Mamba pool cannot supply them all,
    returns None and changes nothing (the seed asserted there).
    ``mamba2_layer_cache(layer_id)`` first calls a registered counter's
    ``wait_until(layer_id - start_layer)``. The state exports are the Mamba pool's
    (``get_state_buf_infos`` = ``MambaPool.get_contiguous_buf_infos``).
    """

    def __init__(
        self,
        *,
        size: int,
        mamba_size: int,
        mamba_spec_state_size: int,
        max_context_len: int,
        device: str = "cpu",
        enable_memory_saver: bool = False,
        cache_params: MambaStateParams,
        mamba_layer_ids: Optional[Sequence[int]] = None,
        enable_mamba_extra_buffer: bool = False,
        speculative_num_draft_tokens: Optional[int] = None,
        enable_overlap_schedule: bool = True,
        start_layer: Optional[int] = None,
    ):
        super().__init__(size=size, max_context_len=max_context_len, device=device)
        self.mamba_ping_pong_track_buffer_size = 2 if enable_overlap_schedule else 1
        self.enable_mamba_extra_buffer = bool(enable_mamba_extra_buffer)
        self.enable_memory_saver = enable_memory_saver
        self.start_layer = start_layer if start_layer is not None else 0
        self.layer_transfer_counter = None
        self.mamba_pool = MambaPool(
            size=mamba_size,
            spec_state_size=mamba_spec_state_size,
            cache_params=cache_params,
            mamba_layer_ids=mamba_layer_ids,
            device=device,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
        )
        self.mamba_map = self.mamba_pool.mamba_map
        rows = self.req_to_token.shape[0]
        self.req_index_to_mamba_index_mapping = torch.zeros(rows, dtype=torch.int32, device=device)
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros(
                (rows, self.mamba_ping_pong_track_buffer_size), dtype=torch.int32, device=device
            )

    def register_layer_transfer_counter(self, layer_transfer_counter) -> None:
        if not callable(getattr(layer_transfer_counter, "wait_until", None)):
            raise TypeError("layer_transfer_counter must have a wait_until(layer_id) method")
        self.layer_transfer_counter = layer_transfer_counter

    def alloc(self, reqs: Sequence) -> Optional[List[int]]:
        """Rows as :meth:`ReqToTokenPool.alloc`, plus a Mamba slot for each request without
        one (and P track slots for each without a track buffer). None if either pool is short."""
        mamba_need = sum(r.mamba_pool_idx is None for r in reqs)
        if self.enable_mamba_extra_buffer:
            mamba_need += self.mamba_ping_pong_track_buffer_size * sum(
                r.mamba_ping_pong_track_buffer is None for r in reqs
            )
        if mamba_need > self.mamba_pool.available_size():
            self._check_reusing(reqs)  # bad input is an error even when the pool is short
            return None
        rows = super().alloc(reqs)
        if rows is None:
            return None
        for r in reqs:
            if r.mamba_pool_idx is None:
                r.mamba_pool_idx = self.mamba_pool.alloc(1)[0]
            if self.enable_mamba_extra_buffer and r.mamba_ping_pong_track_buffer is None:
                r.mamba_ping_pong_track_buffer = self.mamba_pool.alloc(self.mamba_ping_pong_track_buffer_size)
                r.mamba_next_track_idx = 0
        if rows:
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            mamba = torch.stack([torch.as_tensor(r.mamba_pool_idx, device=self.device) for r in reqs])
            self.req_index_to_mamba_index_mapping[index] = mamba.to(torch.int32)
            if self.enable_mamba_extra_buffer:
                track = torch.stack([torch.as_tensor(r.mamba_ping_pong_track_buffer, device=self.device) for r in reqs])
                self.req_index_to_mamba_ping_pong_track_buffer_mapping[index] = track.to(torch.int32)
        return rows

    def get_mamba_indices(self, req_indices: torch.Tensor) -> torch.Tensor:
        return self.req_index_to_mamba_index_mapping[req_indices]

    def mamba2_layer_cache(self, layer_id: int) -> MambaState:
        """Mamba layer ``layer_id``'s state (global id; KeyError for a non-mamba layer)."""
        self.mamba_pool.layer_idx(layer_id)  # KeyError first, then wait
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self.mamba_pool.mamba2_layer_cache(layer_id)

    def get_speculative_mamba2_params_all_layers(self) -> MambaSpeculativeState:
        return self.mamba_pool.get_speculative_mamba2_params_all_layers()

    def get_state_buf_infos(self):
        return self.mamba_pool.get_contiguous_buf_infos()

    def get_state_dim_per_tensor(self) -> List[int]:
        return self.mamba_pool.get_state_dim_per_tensor()

    def transfer_layout(self) -> TransferLayout:
        """The Mamba pool's state, exported here by ``get_state_buf_infos``."""
        return TransferLayout(state=replace(self.mamba_pool.transfer_layout().state, export=Export.STATE))

    def get_mamba_ping_pong_other_idx(self, mamba_next_track_idx: int) -> int:
        """The track slot not being written: ``1 - idx`` with two buffers, ``idx`` with one."""
        if mamba_next_track_idx not in range(self.mamba_ping_pong_track_buffer_size):
            raise ValueError(
                f"mamba_next_track_idx must be in [0, {self.mamba_ping_pong_track_buffer_size}), "
                f"got {mamba_next_track_idx!r}"
            )
        return 1 - mamba_next_track_idx if self.mamba_ping_pong_track_buffer_size == 2 else mamba_next_track_idx

    def free_mamba_cache(self, req, mamba_ping_pong_track_buffer_to_keep: Optional[int] = None) -> None:
        """Free ``req``'s Mamba slot (``req.mamba_pool_idx`` becomes None) and, with the extra
        buffer, its track slots as recorded for its row, except the one at position
        ``mamba_ping_pong_track_buffer_to_keep`` (0 or 1; only 0 with a single track slot).
        ``req.mamba_ping_pong_track_buffer`` is left to the caller, as in the seed."""
        if req.mamba_pool_idx is None:
            raise ValueError("double free: request has no mamba_pool_idx")
        track = None
        if self.enable_mamba_extra_buffer:
            if req.req_pool_idx is None:
                raise ValueError("free_mamba_cache needs the request's req_pool_idx to find its track slots")
            keep = mamba_ping_pong_track_buffer_to_keep
            size = self.mamba_ping_pong_track_buffer_size
            if keep is not None and keep not in range(size):
                raise ValueError(f"mamba_ping_pong_track_buffer_to_keep must be in [0, {size}) or None, got {keep!r}")
            track = self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.req_pool_idx]  # [P]
            if keep is not None:
                track = track[[i for i in range(size) if i != keep]]
        slots = torch.as_tensor(req.mamba_pool_idx).reshape(1)
        if track is not None:
            slots = torch.cat((slots.to(track.device), track.to(torch.int64)))
        self.mamba_pool.free(slots)  # one call: all of it is freed or (ValueError) none
        req.mamba_pool_idx = None

    def clear(self) -> None:
        logger.info("Reset HybridReqToTokenPool")
        super().clear()
        self.mamba_pool.clear()
        self.req_index_to_mamba_index_mapping.zero_()
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping.zero_()
