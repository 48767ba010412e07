"""The cases of ``kvtransfer bench transfer``: one request, planned two ways, and its expected bytes.

A :class:`Pools` is the memory of one (model, TP pair): the byte size of every buffer of prefill
rank 0 (source) and decode rank 0 (destination), KV buffers first, then state buffers, sized for
the longest prompt of the run so that every page size and prompt length reuses them.

A :class:`Case` is one request on those pools (prompt length, page size, random or contiguous
pages). It carries

- the planner's way: ``plan_kv_transfer`` (+ ``plan_state_transfer``) and ``plan_batch``, the
  batches kvtransfer writes (:meth:`Case.planned`);
- the peers' way: one descriptor per page of each buffer, or per token and head slice when the
  two sides' rows differ (TP change), as SGLang's and vLLM's NIXL paths issue them
  (:meth:`Case.peer_batch`), built from :meth:`ModelShape.row_slices`, not from the plan;
- the expected destination: every destination buffer as it must look after the write
  (:meth:`Case.expected`), also from ``row_slices``.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from kvtransfer.batches import BufferRegions, plan_batch
from kvtransfer.benchmarks._models import ModelShape
from kvtransfer.plan import KVKind, plan_kv_transfer, plan_state_transfer
from transport.base import WriteBatch

__all__ = ["Case", "Pools", "SLOT_ALIGN", "STATE_SLOTS"]

SLOT_ALIGN = 64  # pools hold a multiple of every page size (1, 16, 64): one pool serves them all
STATE_SLOTS = 4  # state rows per state buffer (slot 0 is padding); the request takes slot 2


@dataclass(frozen=True)
class Pools:
    """Buffer sizes of both sides for one model and TP pair (prefill rank 0 -> decode rank 0)."""

    shape: ModelShape
    prefill_tp: int
    decode_tp: int
    num_slots: int  # token rows of every KV buffer, a multiple of SLOT_ALIGN; slots below SLOT_ALIGN unused

    @classmethod
    def for_tokens(cls, shape: ModelShape, prefill_tp: int, decode_tp: int, max_tokens: int,
                   pool_factor: float) -> "Pools":
        """Pools with room for ``pool_factor`` times the longest request, plus the padding page."""
        slots = -(-int(max_tokens * pool_factor) // SLOT_ALIGN) * SLOT_ALIGN
        return cls(shape, prefill_tp, decode_tp, max(slots, max_tokens) + SLOT_ALIGN)

    def rows(self, tp: int) -> tuple:
        """``(kv row bytes, [state row bytes per state tensor])`` of a rank of ``tp``."""
        return self.shape.kv_rows(tp), self.shape.state_rows(tp)

    def sizes(self, side: str) -> tuple:
        """``(kv sizes, state sizes)``: bytes of each buffer in export order on ``side``."""
        kv_row, state_rows = self.rows(self.prefill_tp if side == "src" else self.decode_tp)
        per_layer = 2 if self.shape.kind is KVKind.MHA else 1  # K and V, or one latent buffer
        kv = [self.num_slots * kv_row] * (per_layer * len(self.shape.layer_ids))
        m = self.shape.mamba
        state = [] if m is None else [STATE_SLOTS * r for r in state_rows for _ in m.layer_ids]
        return kv, state

    def layouts(self, page_size: int) -> tuple:
        src = self.shape.layout(0, self.prefill_tp, page_size, self.num_slots, STATE_SLOTS)
        dst = self.shape.layout(0, self.decode_tp, page_size, self.num_slots, STATE_SLOTS)
        return src, dst


@dataclass(frozen=True)
class Case:
    pools: Pools
    tokens: int
    page_size: int
    slots: str  # "random" or "contiguous" pages
    src_pages: np.ndarray  # [tokens / page_size] pages of the request on the prefill side
    dst_pages: np.ndarray  # [tokens / page_size] on the decode side

    @classmethod
    def make(cls, pools: Pools, tokens: int, page_size: int, slots: str, rng: np.random.Generator) -> "Case":
        if tokens % page_size:
            raise ValueError(f"prompt length {tokens} is not a whole number of pages of {page_size}")
        n, first = tokens // page_size, SLOT_ALIGN // page_size  # pages below SLOT_ALIGN: padding
        num_pages = pools.num_slots // page_size
        if slots == "random":
            src = rng.choice(np.arange(first, num_pages), n, replace=False)
            dst = rng.choice(np.arange(first, num_pages), n, replace=False)
        else:
            src = np.arange(first, first + n)
            dst = np.arange(num_pages - n, num_pages)  # contiguous, elsewhere in the pool
        return cls(pools, tokens, page_size, slots, src.astype(np.int64), dst.astype(np.int64))

    @property
    def name(self) -> str:
        p = self.pools
        return (f"{p.shape.name} {self.tokens} tok page {self.page_size} TP {p.prefill_tp}->{p.decode_tp} "
                f"{self.slots}")

    def token_slots(self, pages: np.ndarray) -> np.ndarray:
        """[tokens] slots of the request's pages, in order."""
        return (pages[:, None] * self.page_size + np.arange(self.page_size)[None, :]).ravel()

    # -- the planner's way ---------------------------------------------------------------
    def plans(self) -> list:
        """The transfer plans of the pair (KV, then state for a hybrid model)."""
        src, dst = self.pools.layouts(self.page_size)
        plans = [plan_kv_transfer(src, dst, self.token_slots(self.src_pages), self.token_slots(self.dst_pages))]
        if self.pools.shape.mamba is not None:
            plans.append(plan_state_transfer(src, dst, 2, 2))
        return plans

    def planned(self, src: BufferRegions, dst: BufferRegions) -> list:
        """What kvtransfer writes: each plan's :func:`~kvtransfer.batches.plan_batch`."""
        return [plan_batch(plan, src, dst) for plan in self.plans()]

    # -- the peers' way ------------------------------------------------------------------
    def peer_batch(self, src: BufferRegions, dst: BufferRegions) -> WriteBatch:
        """One descriptor per page of each buffer when whole rows move (same TP), else one per
        token and row slice; state: one per state row slice. Built from the model's numbers."""
        pools, ps = self.pools, self.page_size
        kv_slices, state_slices = pools.shape.row_slices(pools.prefill_tp, pools.decode_tp)
        (s_row, s_state), (d_row, d_state) = pools.rows(pools.prefill_tp), pools.rows(pools.decode_tp)
        parts = []
        for sl in kv_slices:
            if sl.length == s_row == d_row:  # whole rows: a page is one range on both sides
                s_off, d_off, length = self.src_pages * ps * s_row, self.dst_pages * ps * d_row, ps * s_row
            else:  # a slice of every token's row
                s_off = self.token_slots(self.src_pages) * s_row + sl.src_offset
                d_off = self.token_slots(self.dst_pages) * d_row + sl.dst_offset
                length = sl.length
            parts.append((src.kv, s_off, dst.kv, d_off, length))
        m = pools.shape.mamba
        if m is not None:
            per = len(m.layer_ids)
            for t, slices in enumerate(state_slices):
                ids = slice(t * per, (t + 1) * per)
                for sl in slices:
                    parts.append((src.state[ids], np.array([2 * s_state[t] + sl.src_offset]), dst.state[ids],
                                  np.array([2 * d_state[t] + sl.dst_offset]), sl.length))
        cols = [[], [], [], [], []]
        for s_ids, s_off, d_ids, d_off, length in parts:  # buffer-major: every buffer's ranges together
            n = s_off.size
            cols[0].append(np.repeat(s_ids, n))
            cols[1].append(np.tile(s_off, s_ids.size))
            cols[2].append(np.repeat(d_ids, n))
            cols[3].append(np.tile(d_off, d_ids.size))
            cols[4].append(np.full(n * s_ids.size, length, dtype=np.int64))
        return WriteBatch.of(*(np.concatenate(c) for c in cols))

    # -- the expected destination ----------------------------------------------------------
    def expected(self, src_bufs: list, fill: int, index: int):
        """Destination buffer ``index`` (KV buffers, then state buffers) after the write, as a
        uint8 torch tensor on the source buffers' device: ``fill`` everywhere but the request's
        rows, which hold the source rows' slices. ``src_bufs``: the source buffers (uint8
        tensors) in the same order."""
        import torch

        pools = self.pools
        kv_sizes, state_sizes = pools.sizes("dst")
        kv_slices, state_slices = pools.shape.row_slices(pools.prefill_tp, pools.decode_tp)
        (s_row, s_state), (d_row, d_state) = pools.rows(pools.prefill_tp), pools.rows(pools.decode_tp)
        device = src_bufs[index].device
        if index < len(kv_sizes):
            size, s_w, d_w, slices = kv_sizes[index], s_row, d_row, kv_slices
            s_slots, d_slots = self.token_slots(self.src_pages), self.token_slots(self.dst_pages)
        else:
            i = index - len(kv_sizes)
            t = i // len(pools.shape.mamba.layer_ids)  # state tensor kind: conv, temporal
            size, s_w, d_w, slices = state_sizes[i], s_state[t], d_state[t], state_slices[t]
            s_slots = d_slots = np.array([2])
        out = torch.full((size,), fill, dtype=torch.uint8, device=device)
        src = src_bufs[index].view(-1, s_w)  # [slots, src row]
        dst = out.view(-1, d_w)  # [slots, dst row]
        s_idx, d_idx = torch.from_numpy(s_slots).to(device), torch.from_numpy(d_slots).to(device)
        for sl in slices:
            dst[d_idx, sl.dst_offset:sl.dst_offset + sl.length] = src[s_idx, sl.src_offset:sl.src_offset + sl.length]
        return out

    def expected_bytes(self) -> int:
        """Bytes the pair moves, from the model's numbers."""
        pools = self.pools
        kv_slices, state_slices = pools.shape.row_slices(pools.prefill_tp, pools.decode_tp)
        kv_count = len(pools.sizes("dst")[0])
        total = kv_count * self.tokens * sum(s.length for s in kv_slices)
        m = pools.shape.mamba
        if m is not None:
            total += len(m.layer_ids) * sum(s.length for slices in state_slices for s in slices)
        return total


def batch_bytes(batches) -> int:
    return sum(b.nbytes for b in batches)


def batch_entries(batches) -> int:
    """Descriptors a backend that posts ranges (NIXL) issues: a StridedBatch's coalesced form."""
    total = 0
    for b in batches:
        total += len(b.coalesced()) if hasattr(b, "coalesced") else len(b)
    return total
