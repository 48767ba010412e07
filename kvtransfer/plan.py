"""Transfer planning: which bytes of which prefill rank go where on which decode rank.

Pure functions, no I/O. Inputs are two :class:`~kvtransfer.layout.RankLayout` (one prefill
rank, one decode rank) and a request's slots; the output is a frozen :class:`TransferPlan`.

Who writes what
---------------
Each byte of a decode rank's row is written by exactly one prefill rank. Where the data is
replicated over ``k`` prefill ranks (MLA/NSA latent rows: ``k = P``; GQA heads when prefill
TP ``P`` exceeds the KV heads ``H``: ``k = P // H``, the ``k`` ranks holding a head are
consecutive), decode rank ``d`` reads from the holder whose rank is ``d mod k`` within its
block of ``k``, so decode ranks spread over the replicas. Cases:

- prefill TP == decode TP: rank ``r`` -> rank ``r``, whole rows.
- prefill TP < decode TP (MHA): each decode rank takes a head range of one prefill rank's row.
- prefill TP > decode TP (MHA): a decode row is assembled from several prefill ranks.
- TP > heads on either side: heads replicated, rank ``r`` holds head ``r // (T // H)``
  (every cut follows ``kvtransfer.layout.shard_units``, the one sharding rule).
- MLA / NSA: whole latent rows from one prefill rank (spread as above).
- Mamba conv state: each sub-block of ``conv_shard_groups`` is cut on its own, so a decode
  row is one piece per sub-block (Mamba2 groups replicated when TP > n_groups are read from
  one replica, as heads are); temporal state: a head range.
- Page sizes may differ: KV rows are addressed per token slot, so pages do not matter (NSA's
  index_k pages are split into sections: runs stop at page boundaries of either side).

The plan is factored: a buffer-pair table (src buffer, dst buffer, byte range inside a slot
row) times a slot-run table (src slot, dst slot, run length) whose runs are maximal: two
tokens share a run wherever both sides are contiguous. :meth:`TransferPlan.flatten` expands
it into the five arrays a transport writes.

API (the contract)
------------------
- ``RankLayout`` (``kvtransfer.layout``, re-exported here): one rank's pools;
  ``RankLayout.from_pools(kv_pool, state_pool=None, *, tp_rank, tp_size, total_kv_heads=None,
  conv_shard_groups=None)``, ``to_msgpack()`` / ``from_msgpack()``, ``check_compatible(peer)``
  (raises :class:`LayoutMismatch` naming the field and both values).
- ``senders_for(decode, prefill_tp_size) -> list[int]``: the prefill ranks writing into a
  decode rank (KV and state).
- ``plan_kv_transfer(src, dst, src_slots, dst_slots) -> TransferPlan``: one (prefill rank,
  decode rank) pair, token slots of the request on each side; buffers numbered as in
  ``get_contiguous_buf_infos()``.
- ``plan_state_transfer(src, dst, src_slot, dst_slot) -> TransferPlan``: Mamba state (int
  slots) or NSA index_k (token slots); buffers numbered as in ``get_state_buf_infos()``.
- ``TransferPlan.flatten() -> (src_buf, src_offset, dst_buf, dst_offset, length)`` int64
  arrays, offsets in bytes from each buffer's start; map buffer numbers to transport region
  ids and the arrays are a ``transport.base.WriteBatch``.
- ``TransferPlan.strided()``: the same bytes as pairs x token slots (a
  ``transport.base.StridedBatch``, for backends that expand on the device), or None for
  sectioned pages.

Per-pair work (compatibility check, the buffer-pair table) is cached per layout pair, so a
request costs only its slot runs: numpy, no Python loop per token or slot.
"""

from __future__ import annotations

import enum
import functools
import threading
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from kvtransfer.layout import (
    LayoutMismatch,
    KVKind,
    RankLayout,
    ShardRule,
    StateKind,
    TensorSpec,
)

__all__ = [
    "BufferSet",
    "LayoutMismatch",
    "KVKind",
    "RankLayout",
    "ShardRule",
    "StateKind",
    "TensorSpec",
    "TransferPlan",
    "plan_kv_transfer",
    "plan_state_transfer",
    "senders_for",
]

_I64 = np.int64
_PAIR_FIELDS = ("src_buf", "src_base", "src_row", "src_page", "dst_buf", "dst_base", "dst_row", "dst_page", "length")


class BufferSet(enum.Enum):
    """Which export a plan's buffer numbers index."""

    KV = "kv"  # get_contiguous_buf_infos()
    STATE = "state"  # get_state_buf_infos() (MambaPool: its get_contiguous_buf_infos())


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Byte ranges one prefill rank writes into one decode rank, factored.

    Buffer-pair table, ``[B]`` each: ``src_buf``/``dst_buf`` (buffer numbers in export order),
    per side ``*_base`` (bytes from a slot's row start, section offset included), ``*_row``
    (bytes per slot inside a page) and ``*_page`` (bytes per page; ``== *_row`` with page size 1),
    and ``length`` (bytes of the range inside the row).
    Slot-run table, ``[R]`` each: ``run_src``/``run_dst`` (first slot), ``run_len`` (slots).
    Slot ``s`` of a pair's side is at ``(s // page_size) * page + (s % page_size) * row + base``;
    ``src_page_size``/``dst_page_size`` are 1 except for sectioned pages (NSA index_k).
    """

    buffers: BufferSet
    src_buf: np.ndarray  # [B]
    src_base: np.ndarray  # [B]
    src_row: np.ndarray  # [B]
    src_page: np.ndarray  # [B]
    dst_buf: np.ndarray  # [B]
    dst_base: np.ndarray  # [B]
    dst_row: np.ndarray  # [B]
    dst_page: np.ndarray  # [B]
    length: np.ndarray  # [B]
    run_src: np.ndarray  # [R]
    run_dst: np.ndarray  # [R]
    run_len: np.ndarray  # [R]
    src_page_size: int = 1
    dst_page_size: int = 1
    sectioned: bool = False  # pages split into sections (NSA index_k): runs stop at page starts

    # -- sizes -----------------------------------------------------------------------
    @property
    def num_pairs(self) -> int:
        return int(self.src_buf.size)

    @property
    def num_runs(self) -> int:
        return int(self.run_src.size)

    @functools.cached_property
    def num_tokens(self) -> int:
        return int(self.run_len.sum())

    @property
    def empty(self) -> bool:
        return self.num_pairs == 0 or self.num_runs == 0

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) * self.num_tokens

    @property
    def _whole(self) -> np.ndarray:
        """[B] True where the range is the whole row on both sides: a run is one range."""
        return (self.length == self.src_row) & (self.length == self.dst_row)

    @property
    def num_token_entries(self) -> int:
        """Entries without coalescing: one per (buffer pair, slot), what a per-token planner emits."""
        return self.num_pairs * self.num_tokens

    @property
    def num_entries(self) -> int:
        """Entries :meth:`flatten` returns (an upper bound for sectioned pages, which merge)."""
        whole = int(np.count_nonzero(self._whole))
        return whole * self.num_runs + (self.num_pairs - whole) * self.num_tokens

    def select(self, keep) -> "TransferPlan":
        """The plan restricted to the buffer pairs where ``keep`` ([B] bool) is True, e.g.
        one layer for layer-by-layer sending:
        ``plan.select(plan.src_buf % len(layout.layer_ids) == layer_position)``."""
        keep = np.asarray(keep)
        if keep.dtype != bool or keep.shape != self.src_buf.shape:
            raise ValueError(f"keep must be a bool array of shape {list(self.src_buf.shape)}, "
                             f"got {keep.dtype} {list(keep.shape)}")
        return replace(self, **{name: getattr(self, name)[keep] for name in _PAIR_FIELDS})

    # -- expansion -------------------------------------------------------------------
    def flatten(self):
        """``(src_buf, src_offset, dst_buf, dst_offset, length)``, int64, one entry per range.

        Offsets are bytes from the start of each buffer. Ordered pair-major (whole-row pairs
        first). Ranges that touch on both sides are merged: runs are maximal, and a partial
        row never touches the next slot's, so only sectioned pages (NSA index_k: a page's
        data section ends where its scale section starts) need a merge pass, done here
        (those entries come sorted by src buffer and offset).
        """
        if self.empty:
            return tuple(np.zeros(0, _I64) for _ in range(5))
        if not self.sectioned and self.num_pairs * self.run_len.size <= SMALL_REQUEST:
            return self._flatten_small()
        whole = self._whole
        parts = []
        if whole.all():  # one entry per (pair, run): every pair (full rows, as at equal TP)
            parts.append(self._expand(None, self.run_src, self.run_dst, self.run_len))
        else:
            if whole.any():  # one entry per (pair, run)
                parts.append(self._expand(whole, self.run_src, self.run_dst, self.run_len))
            tok_src, tok_dst = _expand_runs(self.run_src, self.run_dst, self.run_len)  # one per (pair, token)
            parts.append(self._expand(~whole, tok_src, tok_dst, None))
        out = [np.concatenate([p[i] for p in parts]) for i in range(5)] if len(parts) > 1 else list(parts[0])
        if self.sectioned:  # few entries (one per page and section): sort them
            order = np.lexsort((out[1], out[0]))  # by (src buffer, src offset): touching ranges adjacent
            out = _merge_touching(*(a[order] for a in out))
        return tuple(out)

    def _flatten_small(self):
        """:meth:`flatten` of a small plan without sectioned pages, in Python ints (numpy's cost
        per call would dominate): the same entries in the same order."""
        src_buf, src_base, src_row, src_page, dst_buf, dst_base, dst_row, dst_page, length = (
            getattr(self, name).tolist() for name in _PAIR_FIELDS)
        runs = list(zip(self.run_src.tolist(), self.run_dst.tolist(), self.run_len.tolist()))
        tokens = None
        out = ([], [], [], [], [])
        sps, dps = self.src_page_size, self.dst_page_size
        whole = [n == a == b for n, a, b in zip(length, src_row, dst_row)]
        order = [b for b in range(len(length)) if whole[b]] + [b for b in range(len(length)) if not whole[b]]
        for b in order:  # whole-row pairs first, as _expand's parts
            if whole[b]:  # one entry per run
                slots = runs
            else:  # one entry per token
                if tokens is None:
                    tokens = [(s + i, d + i, 1) for s, d, k in runs for i in range(k)]
                slots = tokens
            sb, sbase, srow, spage, db, dbase, drow, dpage, n = (src_buf[b], src_base[b], src_row[b], src_page[b],
                                                                 dst_buf[b], dst_base[b], dst_row[b], dst_page[b],
                                                                 length[b])
            for s, d, k in slots:
                out[0].append(sb)
                out[1].append((s // sps) * spage + (s % sps) * srow + sbase)
                out[2].append(db)
                out[3].append((d // dps) * dpage + (d % dps) * drow + dbase)
                out[4].append(n * k)
        return tuple(np.array(a, dtype=_I64) for a in out)

    def strided(self):
        """The plan as buffer pairs x token slots (``transport.base.StridedBatch``'s fields):
        ``(src_buf, src_offset, src_stride, dst_buf, dst_offset, dst_stride, length, src_slot,
        dst_slot)``, int64; pair arrays ``[B]``, slot arrays ``[N]`` (the runs expanded,
        O(tokens)). Entry (pair b, token t) is ``length[b]`` bytes at ``offset[b] + slot[t] *
        stride[b]`` on each side. Map buffer numbers to region ids and
        ``StridedBatch.of(*arrays)`` writes the same bytes as :meth:`flatten` (unmerged: one
        entry per pair and token). None when a slot's address is not ``slot * stride``
        (sectioned pages larger than one slot: NSA index_k)."""
        if self.src_page_size != 1 or self.dst_page_size != 1:
            return None
        tok_src, tok_dst = _expand_runs(self.run_src, self.run_dst, self.run_len)  # [N] each
        # page size 1: a slot's row starts at slot * page (page == row unless sectioned)
        return (self.src_buf, self.src_base, self.src_page, self.dst_buf, self.dst_base, self.dst_page,
                self.length, tok_src, tok_dst)

    def _expand(self, sel, src_slots, dst_slots, run_len):
        """Entries of the pairs ``sel`` selects (None: every pair) x the given slots."""
        def pick(a):  # [b] the selected pairs' column
            return a if sel is None else a[sel]

        def addr(slots, base, row, page, ps):  # [b, n], built in place (the arrays are large)
            s = slots[None, :]
            if ps == 1:
                out = np.multiply(s, pick(page)[:, None])
            else:
                out = np.multiply(s // ps, pick(page)[:, None])
                out += (s % ps) * pick(row)[:, None]
            out += pick(base)[:, None]
            return out

        n = src_slots.size
        so = addr(src_slots, self.src_base, self.src_row, self.src_page, self.src_page_size)  # [b, n]
        do = addr(dst_slots, self.dst_base, self.dst_row, self.dst_page, self.dst_page_size)  # [b, n]
        if run_len is None:  # [b * n]: a pair's length for each of its tokens, or of its runs
            ln = np.repeat(pick(self.length), n)
        else:
            ln = np.multiply(pick(self.length)[:, None], run_len[None, :]).ravel()
        sb = np.repeat(pick(self.src_buf), n)
        db = np.repeat(pick(self.dst_buf), n)
        return sb, so.ravel(), db, do.ravel(), ln


def _expand_runs(run_src, run_dst, run_len):
    """Per-token slots of the runs: ``[N]`` src slots and ``[N]`` dst slots."""
    starts = np.cumsum(run_len) - run_len  # [R] token index of each run's first token
    step = np.arange(int(run_len.sum()), dtype=_I64) - np.repeat(starts, run_len)
    return np.repeat(run_src, run_len) + step, np.repeat(run_dst, run_len) + step


def _merge_touching(sb, so, db, do, ln):
    """Merge neighbouring entries that touch on both sides (same buffers, end == next start)."""
    if sb.size < 2:
        return [sb, so, db, do, ln]
    joins = (sb[1:] == sb[:-1]) & (db[1:] == db[:-1]) & (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    return [sb[first], so[first], db[first], do[first], np.add.reduceat(ln, first)]


# -- who owns which bytes --------------------------------------------------------------
def _segments(spec: TensorSpec, src_rank: int, src_tp: int, dst_rank: int, dst_tp: int) -> list:
    """``[(src_offset, dst_offset, length)]`` inside a slot row: the bytes ``dst_rank`` reads
    from ``src_rank``. A piece the prefill side replicates over ``k`` ranks is read from the
    replica with ``src_rank % k == dst_rank % k``. Touching pieces merged."""
    out = []
    for d_log, d_len, d_phys, _ in spec.pieces(dst_rank, dst_tp):
        for s_log, s_len, s_phys, k in spec.pieces(src_rank, src_tp):
            lo, hi = max(d_log, s_log), min(d_log + d_len, s_log + s_len)
            if lo < hi and src_rank % k == dst_rank % k:
                out.append((s_phys + lo - s_log, d_phys + lo - d_log, hi - lo))
    out.sort(key=lambda seg: seg[1])
    merged = []
    for seg in out:
        if merged and merged[-1][0] + merged[-1][2] == seg[0] and merged[-1][1] + merged[-1][2] == seg[1]:
            last = merged.pop()
            seg = (last[0], last[1], last[2] + seg[2])
        merged.append(seg)
    return merged


def senders_for(decode: RankLayout, prefill_tp_size: int) -> list:
    """The prefill ranks that write into ``decode`` (KV and state), ascending."""
    if not isinstance(decode, RankLayout):
        raise TypeError(f"decode must be a RankLayout, got {type(decode).__name__}")
    if not isinstance(prefill_tp_size, int) or prefill_tp_size <= 0:
        raise ValueError(f"prefill_tp_size must be a positive int, got {prefill_tp_size!r}")
    specs = decode.kv_tensors + decode.state_tensors
    for spec in specs:
        spec.local_channels(prefill_tp_size)  # raises when prefill TP cannot cut it
    return [
        s for s in range(prefill_tp_size)
        if any(_segments(spec, s, prefill_tp_size, decode.tp_rank, decode.tp_size) for spec in specs)
    ]


# -- the buffer-pair table (per pair of layouts; cached) ---------------------------------
# One row per (tensor kind or section, segment of its row): which export it indexes, then per
# side where the segment starts in a slot's row and how that side steps through slots and pages.
_SEGMENT = np.dtype([
    ("export", _I64),  # export_index of the tensor kind (buffer = export * num_layers + layer)
    ("src_base", _I64), ("src_row", _I64), ("src_page", _I64),
    ("dst_base", _I64), ("dst_row", _I64), ("dst_page", _I64),
    ("length", _I64),
])


@functools.lru_cache(maxsize=512)
def _pair_table(src: RankLayout, dst: RankLayout, part: BufferSet) -> dict:
    """The buffer-pair columns of :class:`TransferPlan` (``src_buf`` .. ``length``, ``[B]``
    each, read-only) for every plan between these two layouts."""
    src.check_compatible(dst)
    if part is BufferSet.KV:
        s_specs, d_specs, num_layers = src.kv_tensors, dst.kv_tensors, len(src.layer_ids)
    else:
        s_specs, d_specs, num_layers = src.state_tensors, dst.state_tensors, len(src.state_layer_ids)
    sectioned = src.state_kind is StateKind.NSA_INDEX and part is BufferSet.STATE
    segments = []  # in (spec position, segment) order
    for s_spec, d_spec in zip(s_specs, d_specs):
        for s_off, d_off, length in _segments(s_spec, src.tp_rank, src.tp_size, dst.tp_rank, dst.tp_size):
            segments.append((s_spec.export_index,
                             s_spec.section_start + s_off, s_spec.row_bytes,
                             s_spec.page_bytes if sectioned else s_spec.row_bytes,
                             d_spec.section_start + d_off, d_spec.row_bytes,
                             d_spec.page_bytes if sectioned else d_spec.row_bytes,
                             length))
    table = np.array(segments, dtype=_SEGMENT)  # [specs]
    # every layer: order (export, layer, spec position, segment), so a buffer's pairs are neighbours
    layer = np.arange(num_layers, dtype=_I64)
    buf = (table["export"][None, :] * num_layers + layer[:, None]).ravel()  # [layers * specs]
    order = np.argsort(buf, kind="stable")
    per_layer = np.broadcast_to(table[None, :], (num_layers, table.size)).ravel()[order]  # [B]
    out = {"src_buf": buf[order], "dst_buf": buf[order]}
    for name in _SEGMENT.names[1:]:
        out[name] = np.ascontiguousarray(per_layer[name])
    for arr in out.values():
        arr.flags.writeable = False
    return out


# -- slot runs ---------------------------------------------------------------------------
def _slots(name: str, slots, lo: int, hi: int):
    """``(int64 array, owned)``: ``owned`` is False when it is the caller's memory."""
    arr = np.asarray(slots)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":  # signed or unsigned integers (not bool)
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    out = arr.astype(_I64, copy=False)
    if out.size:
        if out.size <= SMALL_REQUEST:
            values = out.tolist()
            a, b = min(values), max(values)
        else:
            a, b = int(out.min()), int(out.max())
        if a < lo or b >= hi:
            raise ValueError(f"{name} must lie in [{lo}, {hi}) (page 0 is padding), got values in [{a}, {b}]")
    return out, out is not slots and out.flags.owndata


SMALL_REQUEST = 64  # up to this many tokens, slots are checked and cut into runs in Python ints:
# a few numpy calls cost more than the whole loop (~2 µs each on a small VM)

# The hot path reuses per-thread work arrays: a fresh multi-MB array per request costs a page
# fault per 4 KiB touched (milliseconds on a VM); a reused one does not. Nothing read from
# them escapes into a plan.
_SCRATCH = threading.local()


def _scratch(name: str, size: int, dtype, fill=None) -> np.ndarray:
    """Per-thread work array ``name`` of ``size`` elements (set to ``fill`` unless None)."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = np.empty(max(size, 1 << 16), dtype=dtype)
        setattr(_SCRATCH, name, buf)
    out = buf[:size]
    if fill is not None:
        out.fill(fill)
    return out


def _dense(span: int, n: int) -> bool:
    """Whether a table indexed by slot (``span`` entries) is worth it for ``n`` keys: scratch is
    sized from the request, never from the pool's slot count (a peer's layout may claim 2**32)."""
    return span <= max(1 << 16, 16 * n)


def _check_distinct(name: str, slots: np.ndarray) -> None:
    if slots.size < 2:
        return
    if slots.size <= 256:  # a small request: a set beats the table's few array passes
        distinct = len(set(slots.tolist()))
    else:
        lo = int(slots.min())
        span = int(slots.max()) - lo + 1
        if _dense(span, slots.size):
            seen = _scratch("seen", span, np.bool_, False)
            seen[slots - lo] = True
            distinct = int(np.count_nonzero(seen))
        else:  # sparse slots: sort instead of a table
            ordered = np.sort(slots)
            distinct = 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1]))
    if distinct != slots.size:
        raise ValueError(f"{name} must be distinct: {slots.size} slots, {distinct} distinct")


def _steps(a: np.ndarray, name: str) -> np.ndarray:
    """[n-1] bool (scratch): where ``a`` does not advance by exactly one."""
    diff = _scratch("diff", a.size - 1, _I64)
    np.subtract(a[1:], a[:-1], out=diff)
    return np.not_equal(diff, 1, out=_scratch(name, a.size - 1, np.bool_))


def _runs(src: np.ndarray, dst: np.ndarray, src_ps: int, dst_ps: int, sectioned: bool):
    """Maximal runs where both sides advance by one slot; with sectioned pages a run also
    stops at every page start of either side (page size 1: every slot)."""
    n = src.size
    if n == 0:
        return np.zeros(0, _I64), np.zeros(0, _I64), np.zeros(0, _I64)
    if n <= SMALL_REQUEST:
        return _runs_small(src, dst, src_ps, dst_ps, sectioned)
    brk = np.logical_or(_steps(src, "brk_src"), _steps(dst, "brk_dst"), out=_scratch("brk", n - 1, np.bool_))
    if sectioned:
        brk |= (src[1:] % src_ps == 0) | (dst[1:] % dst_ps == 0)
    nbrk = int(np.count_nonzero(brk))
    if nbrk == n - 1:  # no two tokens share a run (random slots): the slots are the runs
        run_src, run_dst, run_len = src, dst, np.ones(n, dtype=_I64)
    else:
        starts = np.empty(nbrk + 1, dtype=_I64)
        starts[0] = 0
        starts[1:] = np.flatnonzero(brk) + 1
        run_len = np.empty_like(starts)
        run_len[:-1] = starts[1:] - starts[:-1]
        run_len[-1] = n - starts[-1]
        run_src, run_dst = src[starts], dst[starts]
    if not sectioned and run_src.size > 1:
        run_src, run_dst, run_len = _chain(run_src, run_dst, run_len)
    return run_src, run_dst, run_len


def _runs_small(src: np.ndarray, dst: np.ndarray, src_ps: int, dst_ps: int, sectioned: bool):
    """:func:`_runs` for a few tokens, in Python ints (numpy's cost per call would dominate)."""
    s, d = src.tolist(), dst.tolist()
    n = len(s)
    starts = [0] + [i for i in range(1, n) if s[i] != s[i - 1] + 1 or d[i] != d[i - 1] + 1
                    or (sectioned and (s[i] % src_ps == 0 or d[i] % dst_ps == 0))]
    if len(starts) == n:  # no two tokens share a run: the slots are the runs
        run_src, run_dst, run_len = src, dst, np.ones(n, dtype=_I64)
    else:
        ends = starts[1:] + [n]
        run_src = np.array([s[i] for i in starts], dtype=_I64)
        run_dst = np.array([d[i] for i in starts], dtype=_I64)
        run_len = np.array([e - b for b, e in zip(starts, ends)], dtype=_I64)
    firsts = [s[i] for i in starts]
    if sectioned or all(a < b for a, b in zip(firsts, firsts[1:])):  # increasing: nothing to chain
        return run_src, run_dst, run_len
    return _chain(run_src, run_dst, run_len)


def _chain(run_src, run_dst, run_len):
    """Merge runs that continue each other on both sides but are not neighbours in request
    order (slots [5, 3, 4] -> [10, 8, 9] is one run 3..5 -> 8..10)."""
    r = run_src.size
    up = np.greater(run_src[1:], run_src[:-1], out=_scratch("up", r - 1, np.bool_))
    if up.all():  # increasing src: only neighbours can touch, and they were merged
        return run_src, run_dst, run_len
    end = np.add(run_src, run_len, out=_scratch("end", r, _I64))
    want = np.add(run_dst, run_len, out=_scratch("want", r, _I64))  # a continuation starts there on dst
    starting = _RunStarts(run_src, int(end.max()))  # src slot -> index of the (last) run starting there
    found = starting.lookup(end, run_dst)  # [r] dst slot of the run starting at each run's end, else -1
    if not np.equal(found, want, out=_scratch("link", r, np.bool_)).any():
        return run_src, run_dst, run_len
    # rare: some run continues in another one. Link them and follow each chain to its end.
    link = _scratch("link", r, np.bool_)
    ok = np.flatnonzero(link)
    succ = starting.lookup(end[ok])
    keep = run_dst[succ] == want[ok]  # duplicated src slots: the table may name another run
    keep &= np.bincount(succ, minlength=r)[succ] == 1  # and keep 1-to-1 links only
    ok, succ = ok[keep], succ[keep]
    has_pred = np.zeros(r, dtype=bool)
    has_pred[succ] = True
    tail = np.arange(r, dtype=_I64)
    tail[ok] = succ
    while True:  # pointer jumping: src grows along a chain, so chains end
        nxt = tail[tail]
        if np.array_equal(nxt, tail):
            break
        tail = nxt
    head = np.flatnonzero(~has_pred)
    return run_src[head], run_dst[head], end[tail[head]] - run_src[head]


class _RunStarts:
    """Which run starts at a src slot: a scratch table indexed by slot when the slots are dense
    (sized from the request's own slots), else a sorted search. Where several runs start at
    one slot (duplicated src slots) the last one wins, as a table assignment would."""

    def __init__(self, run_src: np.ndarray, top: int):
        self.lo = int(run_src.min())
        if _dense(top - self.lo + 1, run_src.size):
            self.table = _scratch("table", top - self.lo + 1, _I64, -1)
            self.table[run_src - self.lo] = np.arange(run_src.size, dtype=_I64)
            self.order = None
        else:
            self.order = np.argsort(run_src, kind="stable")  # [r]
            self.keys = run_src[self.order]  # [r] sorted

    def lookup(self, slots: np.ndarray, values: Optional[np.ndarray] = None) -> np.ndarray:
        """``[n]``: for each slot, the index of the run starting there (or ``values`` of it),
        ``-1`` where none starts."""
        if self.order is None:
            pos = slots - self.lo
            inside = (pos >= 0) & (pos < self.table.size)
            idx = np.full(slots.size, -1, dtype=_I64)
            idx[inside] = self.table[pos[inside]]
        else:
            at = np.searchsorted(self.keys, slots, side="right") - 1  # the last key <= slot
            hit = (at >= 0) & (self.keys[np.maximum(at, 0)] == slots)
            idx = np.where(hit, self.order[np.maximum(at, 0)], -1)
        if values is None:
            return idx
        return np.where(idx >= 0, values[idx], -1)


@dataclass(frozen=True)
class _Side:
    """One side's slots: a request's slots lie in ``[slots_lo, slots_hi)`` (below ``slots_lo``
    is the padding page); ``page_size`` is the page size of the addresses (1 unless pages are
    split into sections, NSA index_k)."""

    slots_lo: int
    slots_hi: int
    page_size: int = 1

    @classmethod
    def kv(cls, layout: RankLayout) -> "_Side":
        return cls(layout.page_size, layout.num_slots)

    @classmethod
    def mamba(cls, layout: RankLayout) -> "_Side":
        return cls(1, layout.state_num_slots)

    @classmethod
    def nsa_index(cls, layout: RankLayout) -> "_Side":
        return cls(layout.state_page_size, layout.state_num_slots, layout.state_page_size)


def _build(part: BufferSet, src: RankLayout, dst: RankLayout, src_slots, dst_slots, src_side: _Side,
           dst_side: _Side, sectioned: bool = False) -> TransferPlan:
    table = _pair_table(src, dst, part)  # cached per pair (a layout's hash is computed once)
    s, s_owned = _slots("src_slots", src_slots, src_side.slots_lo, src_side.slots_hi)
    d, d_owned = _slots("dst_slots", dst_slots, dst_side.slots_lo, dst_side.slots_hi)
    if s.size != d.size:
        raise ValueError(f"src_slots and dst_slots must have equal length, got {s.size} and {d.size}")
    _check_distinct("dst_slots", d)
    run_src, run_dst, run_len = _runs(s, d, src_side.page_size, dst_side.page_size, sectioned)
    if run_src is s and not s_owned:  # the plan keeps its runs: never the caller's array
        run_src = run_src.copy()
    if run_dst is d and not d_owned:
        run_dst = run_dst.copy()
    for arr in (run_src, run_dst, run_len):
        arr.flags.writeable = False  # plans are frozen, tables included
    return TransferPlan(part, **table, run_src=run_src, run_dst=run_dst, run_len=run_len,
                        src_page_size=src_side.page_size, dst_page_size=dst_side.page_size, sectioned=sectioned)


def plan_kv_transfer(src: RankLayout, dst: RankLayout, src_slots, dst_slots) -> TransferPlan:
    """The KV bytes prefill rank ``src`` writes into decode rank ``dst`` for one request.

    ``src_slots``/``dst_slots``: the request's token slots on each side (equal length, int;
    page 0 is padding and refused; dst slots distinct). Buffers are numbered as in
    ``get_contiguous_buf_infos()``. Raises :class:`LayoutMismatch` when the layouts cannot
    exchange data. Empty plan when the pair exchanges nothing.
    """
    _check_layouts(src, dst)
    return _build(BufferSet.KV, src, dst, src_slots, dst_slots, _Side.kv(src), _Side.kv(dst))


def plan_state_transfer(src: RankLayout, dst: RankLayout, src_slot, dst_slot) -> TransferPlan:
    """The state bytes prefill rank ``src`` writes into decode rank ``dst``.

    Mamba (hybrid pools): ``src_slot``/``dst_slot`` are the request's state slot on each side
    (ints; slot 0 is padding). NSA: they are the request's token slots (arrays, as for
    :func:`plan_kv_transfer`), since index_k is paged like the KV. Buffers are numbered as in
    ``get_state_buf_infos()``.
    """
    _check_layouts(src, dst)
    if src.state_kind is StateKind.NONE:
        raise ValueError("plan_state_transfer needs layouts with state (Mamba or NSA), got state kind none")
    if src.state_kind is StateKind.MAMBA:
        for name, v in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"{name} of a Mamba state must be an int, got {type(v).__name__}")
        return _build(BufferSet.STATE, src, dst, [src_slot], [dst_slot], _Side.mamba(src), _Side.mamba(dst))
    return _build(BufferSet.STATE, src, dst, src_slot, dst_slot, _Side.nsa_index(src), _Side.nsa_index(dst),
                  sectioned=True)


def _check_layouts(src, dst) -> None:
    for name, v in (("src", src), ("dst", dst)):
        if not isinstance(v, RankLayout):
            raise TypeError(f"{name} must be a RankLayout, got {type(v).__name__}")
