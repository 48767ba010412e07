"""Shared helpers of the planner tests: the reference they compare against, and the cases
that both ``test_plan`` (as built) and ``test_plan_strided`` (through the strided form) run.

The reference: full unsharded data for a random request is sharded the way each side's TP
would shard it (written here from the TP rules, independently of ``kvtransfer.layout``), laid
out in plain numpy byte buffers at each side's slots, and every (prefill rank, decode rank)
plan is run as a plain byte copy. Each decode rank must then equal its expected shard, every
byte of the request's rows written exactly once and nothing else written.

``check_all_pairs`` looks ``plan_kv_transfer`` / ``plan_state_transfer`` up in this module at
call time, so a test may patch them here (``test_plan_strided`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtransfer.plan import KVKind, RankLayout, plan_kv_transfer, plan_state_transfer, senders_for


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


# -- cases shared by test_plan and test_plan_strided -------------------------------------
TP = [1, 2, 4, 8]
HEADS = [1, 2, 4, 8, 16, 32]
ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}
PAGE_SIZES = [1, 16, 64]


def attention_layouts(kind, tp, page_size, num_pages, **kw):
    return [RankLayout.attention(kind, tp_rank=r, tp_size=tp, page_size=page_size, num_slots=num_pages * page_size,
                                 **kw) for r in range(tp)]


def mha_refs(kind, heads, head_dim, dtype):
    if kind is KVKind.MHA_FP4:  # packed K, V, then block-16 scale rows: a head is a range in each
        return [Ref(heads, head_dim // 2, "heads")] * 2 + [Ref(heads, head_dim // 16, "heads")] * 2
    return [Ref(heads, head_dim * ITEMSIZE[dtype], "heads")] * 2


def run_attention(kind, p, d, refs, rng, n=20, layers=2, src_ps=1, dst_ps=1, mode="random", **kw):
    pages = lambda ps: -(-n // ps) + 3  # noqa: E731  (request pages + padding + spare)
    src = attention_layouts(kind, p, src_ps, pages(src_ps), layer_ids=range(3, 3 + layers), **kw)
    dst = attention_layouts(kind, d, dst_ps, pages(dst_ps), layer_ids=range(3, 3 + layers), **kw)
    src_slots = alloc_slots(rng, n, src_ps, pages(src_ps), mode)
    dst_slots = alloc_slots(rng, n, dst_ps, pages(dst_ps), mode)
    check_all_pairs(src, dst, refs, layers, src_slots, dst_slots, rng)
    return src, dst


def case_mha_every_tp_mix(heads, p, d):
    rng = np.random.default_rng(heads * 100 + p * 10 + d)
    i = HEADS.index(heads) + TP.index(p) + TP.index(d)
    variants = [
        (KVKind.MHA, "bfloat16", [64, 128, 256][i % 3]),
        (KVKind.MHA, "float8_e4m3fn", [128, 256, 64][i % 3]),  # fp8 stored as uint8
        (KVKind.MHA_FP4, "bfloat16", [256, 64, 128][i % 3]),
    ]
    for j, (kind, dtype, head_dim) in enumerate(variants):
        src_ps, dst_ps = PAGE_SIZES[(i + j) % 3], PAGE_SIZES[(i + 2 * j + 1) % 3]
        run_attention(kind, p, d, mha_refs(kind, heads, head_dim, dtype), rng, src_ps=src_ps, dst_ps=dst_ps,
                      dtype=dtype, head_dim=head_dim, total_heads=heads)


def case_mha_page_sizes_differ(src_ps, dst_ps, mode):
    rng = np.random.default_rng(src_ps * 7 + dst_ps)
    for p, d in [(2, 4), (4, 2), (1, 1)]:
        run_attention(KVKind.MHA, p, d, mha_refs(KVKind.MHA, 4, 64, "bfloat16"), rng, n=150, src_ps=src_ps,
                      dst_ps=dst_ps, mode=mode, dtype="bfloat16", head_dim=64, total_heads=4)


def case_mha_v_head_dim_differs():
    rng = np.random.default_rng(5)
    refs = [Ref(8, 128 * 2, "heads"), Ref(8, 64 * 2, "heads")]
    for p, d in [(2, 8), (8, 2), (4, 4)]:
        run_attention(KVKind.MHA, p, d, refs, rng, dtype="bfloat16", head_dim=128, v_head_dim=64, total_heads=8)


def case_mla_replicated(kind, p, d):
    rng = np.random.default_rng(p * 10 + d)
    refs = ([Ref(1, 576 * 2, "replicated")] if kind is KVKind.MLA
            else [Ref(1, 576 // 2, "replicated"), Ref(1, 576 // 16, "replicated")])
    src_ps, dst_ps = PAGE_SIZES[p % 3], PAGE_SIZES[d % 3]
    src, dst = run_attention(kind, p, d, refs, rng, src_ps=src_ps, dst_ps=dst_ps, dtype="bfloat16", head_dim=576)
    senders = [senders_for(x, p) for x in dst]
    assert all(len(s) == 1 for s in senders)
    assert {s[0] for s in senders} == set(range(min(p, d)))  # spread over prefill ranks


def case_nsa_kv_and_index(p, d, src_ps, dst_ps, mode):
    rng = np.random.default_rng(src_ps + dst_ps + p)
    n, layers = 150, 2

    def layouts(tp, ps):
        pages = -(-n // ps) + 3
        return [RankLayout.attention(KVKind.NSA, tp_rank=r, tp_size=tp, page_size=ps, layer_ids=range(layers),
                                     dtype="float8_e4m3fn", head_dim=656, num_slots=pages * ps)
                .with_nsa_index(index_head_dim=128, num_pages=pages) for r in range(tp)], pages

    (src, sp), (dst, dp) = layouts(p, src_ps), layouts(d, dst_ps)
    src_slots, dst_slots = alloc_slots(rng, n, src_ps, sp, mode), alloc_slots(rng, n, dst_ps, dp, mode)
    check_all_pairs(src, dst, [Ref(1, 656, "replicated")], layers, src_slots, dst_slots, rng)
    index_refs = [Ref(1, 128, "replicated"), Ref(1, 4, "replicated")]  # fp8 rows, then fp32 scales
    check_all_pairs(src, dst, index_refs, layers, src_slots, dst_slots, rng, state=True, sectioned=True)


def conv_dim(groups, tp):
    """Channels per rank (the pool's conv_dim) of sub-blocks: ints split, (units, size) by units."""
    return sum(g // tp if isinstance(g, int) else max(1, g[0] // tp) * g[1] for g in groups)


def mamba_layouts(tp, groups, heads=8, num_slots=6):
    kv = dict(page_size=1, layer_ids=[0, 3], dtype="bfloat16", head_dim=64, total_heads=8, num_slots=16)
    out = []
    for r in range(tp):
        base = RankLayout.attention(KVKind.MHA, tp_rank=r, tp_size=tp, **kv)
        out.append(base.with_mamba(
            layer_ids=[1, 2, 4], num_slots=num_slots, conv_dims=[conv_dim(g, tp) for g in groups],
            conv_unit_bytes=[3 * 2] * len(groups), temporal_heads=heads // tp, temporal_head_bytes=16 * 4 * 4,
            conv_shard_groups=[list(g) for g in groups]))
    return out


def case_mamba_state(p, d):
    rng = np.random.default_rng(p * 10 + d)
    groups = [(64, 16, 16), (32, 32, 8)]  # e.g. [x | B | C] and [q | k | v] sizes, unsharded
    refs = [Ref(sum(g), 3 * 2, "groups", g) for g in groups] + [Ref(8, 16 * 4 * 4, "groups", (8,))]
    src, dst = mamba_layouts(p, groups), mamba_layouts(d, groups)
    src_slot, dst_slot = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    check_all_pairs(src, dst, refs, 3, src_slot, dst_slot, rng, state=True)
    check_all_pairs(src, dst, [Ref(8, 128, "heads")] * 2, 2, np.array([3, 4, 9]), np.array([7, 2, 3]), rng)


def case_mamba2_groups_replicated_when_tp_exceeds_them(n_groups, p, d):
    """Mamba2 conv ``[x | B | C]``: B and C are n_groups groups of ``state`` channels; a TP above
    n_groups replicates them (rank r holds group r // (T // n_groups)), x is split."""
    rng = np.random.default_rng(n_groups * 100 + p * 10 + d)
    groups = [(64, (n_groups, 8), (n_groups, 8))]
    refs = [Ref(64 + 16 * n_groups, 3 * 2, "groups", groups[0]), Ref(8, 16 * 4 * 4, "groups", (8,))]
    src, dst = mamba_layouts(p, groups), mamba_layouts(d, groups)
    check_all_pairs(src, dst, refs, 3, 2, 5, rng, state=True)
