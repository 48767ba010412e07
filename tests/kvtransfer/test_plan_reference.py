"""The reference the planner tests compare against (helpers only; the tests import it).

Full unsharded data for a random request is sharded the way each side's TP would shard it
(written here from the TP rules, independently of ``kvtransfer.layout``), laid out in plain
numpy byte buffers at each side's slots, and every (prefill rank, decode rank) plan is run as a
plain byte copy. Each decode rank must then equal its expected shard, every byte of the
request's rows written exactly once and nothing else written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtransfer.plan import plan_kv_transfer, plan_state_transfer, senders_for


@dataclass(frozen=True)
class Ref:
    """One exported tensor kind as the reference sees it: a full row of ``units`` channels of
    ``unit_bytes``, cut by ``rule`` ("heads", "groups", "replicated"); ``groups`` lists the
    sub-blocks (an int: channels split evenly; ``(units, size)``: blocks of ``size`` channels,
    replicated when TP > units)."""

    units: int
    unit_bytes: int
    rule: str
    groups: tuple = ()


def held_units(t: Ref, rank: int, tp: int) -> np.ndarray:
    """Unit indices of the full row that ``rank`` holds, in its physical order."""
    if t.rule == "replicated":
        return np.arange(t.units)
    if t.rule == "heads":
        h = t.units
        if tp <= h:
            n = h // tp
            return np.arange(rank * n, (rank + 1) * n)
        return np.array([rank // (tp // h)])  # heads replicated when TP > heads
    out, start = [], 0
    for g in t.groups:  # every sub-block cut on its own: an int is channels, a pair (units, size)
        n, size = (g, 1) if isinstance(g, int) else g
        units = np.arange(rank * n // tp, (rank + 1) * n // tp) if tp <= n else np.array([rank // (tp // n)])
        out.append(start + (units[:, None] * size + np.arange(size)).ravel())
        start += n * size
    return np.concatenate(out)


def alloc_slots(rng, n: int, page_size: int, num_pages: int, mode: str = "random") -> np.ndarray:
    """Token slots of an ``n``-token request: whole pages (page 0 is padding), tokens in order."""
    need = -(-n // page_size)
    if mode == "contiguous":
        pages = np.arange(1, need + 1)
    else:
        pages = rng.choice(np.arange(1, num_pages), need, replace=False)
    return (pages[:, None] * page_size + np.arange(page_size)).ravel()[:n]


def byte_index(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """All byte positions of the ranges ``[start, start + length)``, concatenated."""
    first = np.cumsum(length) - length
    return np.repeat(start - first, length) + np.arange(int(length.sum()))


class Memory:
    """One rank's buffers (in export order) as one flat uint8 array plus per-buffer bases."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.base = np.cumsum(self.sizes) - self.sizes
        self.flat = np.zeros(int(self.sizes.sum()), dtype=np.uint8)
        self.count = np.zeros(self.flat.size, dtype=np.int32)

    def view(self, i: int) -> np.ndarray:
        return self.flat[self.base[i]: self.base[i] + self.sizes[i]]


def apply(plan, src: Memory, dst: Memory) -> None:
    """Run a plan as a byte copy, checking bounds and that no two entries touch on both sides."""
    sb, so, db, do, ln = plan.flatten()
    for a in (sb, so, db, do, ln):
        assert a.dtype == np.int64 and a.ndim == 1 and a.size == sb.size
    if sb.size == 0:
        return
    assert (ln > 0).all()
    assert (so + ln <= src.sizes[sb]).all() and (do + ln <= dst.sizes[db]).all()
    order = np.lexsort((so, sb))  # touching entries would be neighbours in src order
    a, b = order[:-1], order[1:]
    touch = (sb[a] == sb[b]) & (db[a] == db[b]) & (so[a] + ln[a] == so[b]) & (do[a] + ln[a] == do[b])
    assert not touch.any(), "flatten left touching ranges unmerged"
    s_idx = byte_index(src.base[sb] + so, ln)
    d_idx = byte_index(dst.base[db] + do, ln)
    dst.flat[d_idx] = src.flat[s_idx]
    np.add.at(dst.count, d_idx, 1)


def place(mem: Memory, i: int, rows: np.ndarray, slots: np.ndarray, page_size=1, page_bytes=None, section=0):
    """Write ``rows`` [n, row_bytes] at ``slots`` of buffer ``i``; sectioned pages as NSA's."""
    row = rows.shape[1]
    if page_bytes is None:
        starts = slots * row
    else:
        starts = (slots // page_size) * page_bytes + section + (slots % page_size) * row
    idx = byte_index(mem.base[i] + starts, np.full(slots.size, row))
    mem.flat[idx] = rows.ravel()
    return idx


def check_all_pairs(src_layouts, dst_layouts, refs, num_layers, src_slots, dst_slots, rng, state=False,
                    sectioned=False):
    """Every (prefill, decode) plan against the reference.

    ``refs``: the exported tensor kinds in export order (buffer ``t * num_layers + l``).
    ``sectioned``: the refs are the sections of one paged buffer per layer (NSA index_k: data
    rows, then scales), page sizes from the layouts. Returns the decode memories.
    """
    p, d = len(src_layouts), len(dst_layouts)
    n = len(src_slots) if np.ndim(src_slots) else 1
    full = [[rng.integers(0, 256, (n, r.units, r.unit_bytes), dtype=np.uint8) for _ in range(num_layers)]
            for r in refs]

    def build(layout, slots):
        num_slots = layout.state_num_slots if state else layout.num_slots
        ps = layout.state_page_size if state else layout.page_size
        slots = np.atleast_1d(slots)
        if not sectioned:
            rows = [[full[t][l][:, held_units(r, layout.tp_rank, layout.tp_size)].reshape(n, -1)
                     for l in range(num_layers)] for t, r in enumerate(refs)]
            mem = Memory([rows[t][0].shape[1] * num_slots for t in range(len(refs)) for _ in range(num_layers)])
            want = np.zeros(mem.flat.size, dtype=np.int32)
            for t in range(len(refs)):
                for l in range(num_layers):
                    want[place(mem, t * num_layers + l, rows[t][l], slots)] = 1
            return mem, want
        page_bytes = ps * sum(r.units * r.unit_bytes for r in refs)
        mem = Memory([page_bytes * (num_slots // ps)] * num_layers)
        want = np.zeros(mem.flat.size, dtype=np.int32)
        for l in range(num_layers):
            section = 0
            for t, r in enumerate(refs):
                rows = full[t][l].reshape(n, -1)
                want[place(mem, l, rows, slots, ps, page_bytes, section)] = 1
                section += ps * r.units * r.unit_bytes
        return mem, want

    src_mem = [build(x, src_slots)[0] for x in src_layouts]
    expected = [build(x, dst_slots) for x in dst_layouts]
    got = [Memory(e[0].sizes) for e in expected]
    for dr in range(d):
        senders = senders_for(dst_layouts[dr], p)  # KV and state senders together
        writers = set()
        for sr in range(p):
            plan = (plan_state_transfer if state else plan_kv_transfer)(
                src_layouts[sr], dst_layouts[dr], src_slots, dst_slots)
            if not plan.empty:
                writers.add(sr)
            apply(plan, src_mem[sr], got[dr])
        if dst_layouts[dr].state_tensors:  # senders also count state (or KV) writers
            assert writers <= set(senders), (dr, writers, senders)
        else:
            assert writers == set(senders), (dr, writers, senders)
    for dr in range(d):
        mem, want = expected[dr]
        np.testing.assert_array_equal(got[dr].count, want, err_msg=f"decode rank {dr}: bytes written != once")
        np.testing.assert_array_equal(got[dr].flat, mem.flat, err_msg=f"decode rank {dr}: wrong bytes")
    return got
