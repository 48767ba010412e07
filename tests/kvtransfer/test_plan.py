"""kvtransfer.plan against the reference of tests/kvtransfer/_support.py: every TP mix, page
size and pool kind; coalescing; exactly-once; mismatches."""

import numpy as np
import pytest

from kvtransfer.plan import (
    BufferSet,
    LayoutMismatch,
    KVKind,
    RankLayout,
    plan_kv_transfer,
    plan_state_transfer,
    senders_for,
)
from tests.kvtransfer._support import (
    HEADS,
    TP,
    case_mamba2_groups_replicated_when_tp_exceeds_them,
    case_mamba_state,
    case_mha_every_tp_mix,
    case_mha_page_sizes_differ,
    case_mha_v_head_dim_differs,
    case_mla_replicated,
    case_nsa_kv_and_index,
    mamba_layouts,
)


# -- MHA / GQA: every H, P, D; K and V; bf16, FP8 and FP4 ----------------------------------
@pytest.mark.parametrize("d", TP)
@pytest.mark.parametrize("p", TP)
@pytest.mark.parametrize("heads", HEADS)
def test_mha_every_tp_mix(heads, p, d):
    case_mha_every_tp_mix(heads, p, d)


@pytest.mark.parametrize("src_ps,dst_ps", [(64, 16), (64, 1), (16, 64), (1, 64), (16, 16)])
@pytest.mark.parametrize("mode", ["random", "contiguous"])
def test_mha_page_sizes_differ(src_ps, dst_ps, mode):
    case_mha_page_sizes_differ(src_ps, dst_ps, mode)


def test_mha_v_head_dim_differs():
    case_mha_v_head_dim_differs()


# -- MLA / NSA: replicated latent rows, one prefill rank per decode rank, spread ------------
@pytest.mark.parametrize("d", TP)
@pytest.mark.parametrize("p", TP)
@pytest.mark.parametrize("kind", [KVKind.MLA, KVKind.MLA_FP4])
def test_mla_replicated(kind, p, d):
    case_mla_replicated(kind, p, d)


@pytest.mark.parametrize("src_ps,dst_ps,mode", [(64, 64, "random"), (64, 16, "random"), (16, 64, "contiguous"),
                                                (64, 1, "random"), (4, 4, "contiguous")])
@pytest.mark.parametrize("p,d", [(1, 1), (2, 4), (8, 2)])
def test_nsa_kv_and_index(p, d, src_ps, dst_ps, mode):
    case_nsa_kv_and_index(p, d, src_ps, dst_ps, mode)


def test_nsa_index_whole_pages_merge_to_one_range():
    n, ps, layers = 4 * 64, 64, 3
    lay = RankLayout.attention(KVKind.NSA, tp_rank=0, tp_size=1, page_size=ps, layer_ids=range(layers),
                               dtype="bfloat16", head_dim=576, num_slots=8 * ps).with_nsa_index(index_head_dim=128,
                                                                                                   num_pages=8)
    slots = np.arange(ps, ps + n)
    plan = plan_state_transfer(lay, lay, slots, slots + ps)
    sb, so, db, do, ln = plan.flatten()
    assert plan.buffers is BufferSet.STATE
    assert sb.tolist() == list(range(layers))  # data and scale sections of 4 whole pages: one range
    assert (ln == 4 * ps * (128 + 4)).all() and (so == ps * (128 + 4)).all() and (do == 2 * ps * (128 + 4)).all()


# -- Mamba: conv sub-blocks sharded on their own, temporal heads ---------------------------
@pytest.mark.parametrize("d", TP)
@pytest.mark.parametrize("p", TP)
def test_mamba_state(p, d):
    case_mamba_state(p, d)


@pytest.mark.parametrize("d", TP)
@pytest.mark.parametrize("p", TP)
@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_mamba2_groups_replicated_when_tp_exceeds_them(n_groups, p, d):
    case_mamba2_groups_replicated_when_tp_exceeds_them(n_groups, p, d)


def test_conv_groups_sharded_on_their_own_not_as_one_block():
    """P=1 -> D=2 with [x | B | C]: decode rank 1 takes the second half of each sub-block."""
    groups = [(8, 4, 4)]
    src, dst = mamba_layouts(1, groups), mamba_layouts(2, groups)
    plan = plan_state_transfer(src[0], dst[1], 1, 2)
    sb, so, db, do, ln = plan.flatten()
    conv0 = sb < 3  # conv tensor 0, layers 0..2
    unit = 6
    src_row = 16 * unit  # slot 1 of the prefill row: x[4:8], B[2:4], C[2:4]
    assert so[conv0][:3].tolist() == [src_row + 4 * unit, src_row + 10 * unit, src_row + 14 * unit]
    assert do[conv0][:3].tolist() == [2 * 8 * unit, 2 * 8 * unit + 4 * unit, 2 * 8 * unit + 6 * unit]


def test_senders_count_kv_and_state():
    """2 KV heads at prefill TP 4 -> decode TP 1: KV from ranks 0 and 2 (one replica per head),
    temporal heads split 4 ways: state from every rank."""
    def layouts(tp):
        return [RankLayout.attention(KVKind.MHA, tp_rank=r, tp_size=tp, page_size=1, layer_ids=[0], dtype="bfloat16",
                                     head_dim=64, total_heads=2, num_slots=16).with_mamba(
            layer_ids=[1], num_slots=4, conv_dims=[16 // tp], conv_unit_bytes=[6], temporal_heads=8 // tp,
            temporal_head_bytes=64) for r in range(tp)]
    src, (dst,) = layouts(4), layouts(1)
    kv = [r for r in range(4) if not plan_kv_transfer(src[r], dst, [1, 2], [3, 4]).empty]
    st = [r for r in range(4) if not plan_state_transfer(src[r], dst, 1, 2).empty]
    assert (kv, st, senders_for(dst, 4)) == ([0, 2], [0, 1, 2, 3], [0, 1, 2, 3])


def test_mamba_slots_are_ints_and_checked():
    src = mamba_layouts(1, [(8, 4, 4)])[0]
    with pytest.raises(TypeError, match="must be an int"):
        plan_state_transfer(src, src, np.array([1]), 2)
    with pytest.raises(ValueError, match=r"src_slots must lie in \[1, 6\)"):
        plan_state_transfer(src, src, 0, 2)


# -- coalescing ------------------------------------------------------------------------
@pytest.mark.parametrize("src_ps,dst_ps", [(1, 1), (16, 1), (64, 16)])
def test_contiguous_slots_give_one_range_per_buffer(src_ps, dst_ps):
    n, layers = 300, 4
    src = RankLayout.attention(KVKind.MHA, tp_rank=1, tp_size=2, page_size=src_ps, layer_ids=range(layers),
                               dtype="bfloat16", head_dim=128, total_heads=8, num_slots=1024)
    dst = RankLayout.attention(KVKind.MHA, tp_rank=1, tp_size=2, page_size=dst_ps, layer_ids=range(layers),
                               dtype="bfloat16", head_dim=128, total_heads=8, num_slots=2048)
    plan = plan_kv_transfer(src, dst, np.arange(64, 64 + n), np.arange(700, 700 + n))
    sb, so, db, do, ln = plan.flatten()
    row = 4 * 128 * 2
    assert plan.num_runs == 1 and plan.num_entries == sb.size == 2 * layers
    assert sb.tolist() == db.tolist() == list(range(2 * layers))
    assert (so == 64 * row).all() and (do == 700 * row).all() and (ln == n * row).all()


def test_runs_split_only_where_a_side_jumps():
    lay = RankLayout.attention(KVKind.MLA, tp_rank=0, tp_size=1, page_size=1, layer_ids=[0], dtype="bfloat16",
                               head_dim=64, num_slots=64)
    src = np.array([5, 6, 7, 20, 21, 9])
    dst = np.array([1, 2, 3, 4, 5, 6])
    plan = plan_kv_transfer(lay, lay, src, dst)
    assert list(zip(plan.run_src, plan.run_dst, plan.run_len)) == [(5, 1, 3), (20, 4, 2), (9, 6, 1)]


def test_runs_that_continue_out_of_order_are_chained():
    lay = RankLayout.attention(KVKind.MLA, tp_rank=0, tp_size=1, page_size=1, layer_ids=[0], dtype="bfloat16",
                               head_dim=64, num_slots=64)
    rng = np.random.default_rng(0)
    perm = rng.permutation(40)  # one contiguous block on both sides, tokens in random order
    plan = plan_kv_transfer(lay, lay, 10 + perm, 20 + perm)
    assert (plan.num_runs, int(plan.run_src[0]), int(plan.run_dst[0]), int(plan.run_len[0])) == (1, 10, 20, 40)
    plan = plan_kv_transfer(lay, lay, np.array([5, 3, 4, 30]), np.array([10, 8, 9, 40]))
    assert sorted(zip(plan.run_src.tolist(), plan.run_dst.tolist(), plan.run_len.tolist())) == [(3, 8, 3), (30, 40, 1)]


def test_empty_request_and_idle_pair():
    mk = lambda r, tp: RankLayout.attention(  # noqa: E731
        KVKind.MHA, tp_rank=r, tp_size=tp, page_size=1, layer_ids=[0], dtype="bfloat16", head_dim=64,
        total_heads=2, num_slots=32)
    plan = plan_kv_transfer(mk(0, 1), mk(0, 1), np.zeros(0, int), np.zeros(0, int))
    assert plan.empty and all(a.size == 0 for a in plan.flatten())
    idle = plan_kv_transfer(mk(1, 2), mk(0, 2), [3, 4], [5, 6])  # prefill rank 1 holds head 1 only
    assert idle.empty and idle.num_entries == 0 and senders_for(mk(0, 2), 2) == [0]


# -- bad input -------------------------------------------------------------------------
def _mha(**kw):
    args = dict(tp_rank=0, tp_size=1, page_size=1, layer_ids=range(2), dtype="bfloat16", head_dim=128,
                total_heads=8, num_slots=64)
    args.update(kw)
    return RankLayout.attention(KVKind.MHA, **args)


@pytest.mark.parametrize("change,match", [
    (dict(head_dim=64), "head_dim: this side 128, peer 64"),
    (dict(dtype="float16"), "dtype: this side 'bfloat16', peer 'float16'"),
    (dict(layer_ids=range(1, 3)), r"layer_ids: this side \[0, 1\], peer \[1, 2\]"),
    (dict(total_heads=16), "total_heads: this side 8, peer 16"),
])
def test_mismatch_raises_with_both_values(change, match):
    with pytest.raises(LayoutMismatch, match=match):
        plan_kv_transfer(_mha(), _mha(**change), [1], [1])


def test_kind_mismatch():
    mla = RankLayout.attention(KVKind.MLA, tp_rank=0, tp_size=1, page_size=1, layer_ids=range(2),
                               dtype="bfloat16", head_dim=128, num_slots=64)
    with pytest.raises(LayoutMismatch, match="kind: this side mha, peer mla"):
        plan_kv_transfer(_mha(), mla, [1], [1])


def test_tp_that_cannot_split_heads():
    with pytest.raises(LayoutMismatch, match="total heads 8 and TP size 3 must divide one another"):
        _mha(tp_size=3)
    with pytest.raises(LayoutMismatch, match="total heads 8 and TP size 3"):
        senders_for(_mha(), 3)
    with pytest.raises(LayoutMismatch, match=r"must divide TP size 4 or be divided by it, got \(units, size\) "
                                             r"groups \[\[6, 1\], \[4, 1\], \[6, 1\]\]"):
        mamba_layouts(4, [(6, 4, 6)])


def test_conv_groups_mismatch():
    with pytest.raises(LayoutMismatch, match=r"conv_shard_groups: this side \[\[\[8, 1\], \[4, 1\], \[4, 1\]\]\], peer \[\[\[4, 1\], \[4, 1\], \[8, 1\]\]\]"):
        plan_state_transfer(mamba_layouts(1, [(8, 4, 4)])[0], mamba_layouts(1, [(4, 4, 8)])[0], 1, 1)


def test_bad_slots():
    lay = _mha(page_size=16, num_slots=64)
    with pytest.raises(ValueError, match="equal length, got 2 and 1"):
        plan_kv_transfer(lay, lay, [16, 17], [16])
    with pytest.raises(ValueError, match=r"src_slots must lie in \[16, 64\) \(page 0 is padding\), got values in \[3, 17\]"):
        plan_kv_transfer(lay, lay, [3, 17], [16, 17])
    with pytest.raises(ValueError, match="dst_slots must be distinct: 2 slots, 1 distinct"):
        plan_kv_transfer(lay, lay, [16, 17], [20, 20])
    with pytest.raises(TypeError, match="must hold integers"):
        plan_kv_transfer(lay, lay, [16.0], [20])
    with pytest.raises(ValueError, match="needs layouts with state"):
        plan_state_transfer(lay, lay, 1, 1)
    with pytest.raises(TypeError, match="src must be a RankLayout"):
        plan_kv_transfer("x", lay, [16], [16])


def test_select_one_layer():
    lay = _mha(layer_ids=range(4))
    plan = plan_kv_transfer(lay, lay, [1, 2, 3, 9], [4, 5, 6, 7])
    full = plan.flatten()
    part = plan.select(plan.src_buf % 4 == 2)
    got = part.flatten()
    assert set(got[0].tolist()) == {2, 6}  # K_2 and V_2
    keep = np.isin(full[0], [2, 6])
    for a, b in zip(got, full):
        np.testing.assert_array_equal(np.sort(a), np.sort(b[keep]))
    with pytest.raises(ValueError, match=r"keep must be a bool array of shape \[8\], got int64 \[2\]"):
        plan.select(np.array([1, 2]))


def test_msgpack_round_trip_every_kind():
    layouts = [_mha(), _mha(tp_size=8, tp_rank=5, total_heads=2), mamba_layouts(4, [(64, (2, 8), (2, 8))])[3],
               RankLayout.attention(KVKind.MLA_FP4, tp_rank=0, tp_size=2, page_size=64, layer_ids=[0, 2],
                                    dtype="float4_e2m1fn_x2", head_dim=576, num_slots=256),
               RankLayout.attention(KVKind.NSA, tp_rank=1, tp_size=2, page_size=64, layer_ids=[0], dtype="bfloat16",
                                    head_dim=576, num_slots=256).with_nsa_index(index_head_dim=128, num_pages=4)]
    for lay in layouts:
        back = RankLayout.from_msgpack(lay.to_msgpack())
        assert back == lay and hash(back) == hash(lay)
        back.check_compatible(lay)


def test_plan_owns_its_tables():
    lay = _mha(num_slots=128)
    src, dst = np.array([9, 3, 40, 7]), np.array([5, 60, 2, 11])  # no two tokens share a run
    plan = plan_kv_transfer(lay, lay, src, dst)
    src[:] = 1
    dst[:] = 1
    assert plan.run_src.tolist() == [9, 3, 40, 7] and plan.run_dst.tolist() == [5, 60, 2, 11]
    with pytest.raises(ValueError, match="read-only"):
        plan.run_len[0] = 5


# -- scratch is sized from the request, not from the layout ---------------------------------
def _scratch_elements() -> int:
    from kvtransfer import plan as plan_mod

    return max((a.size for a in vars(plan_mod._SCRATCH).values()), default=0)


def test_a_huge_slot_count_costs_nothing_for_a_small_request():
    """A peer's layout claiming num_slots=2**32: a 16-token plan allocates scratch by its own
    slots (the tables of a dense request, a sort for sparse ones), never by the pool's size."""
    big = _mha(num_slots=2**32)
    rng = np.random.default_rng(5)
    src = rng.choice(np.arange(1, 2**20), 16, replace=False)  # sparse, unordered: the chaining path
    dst = np.sort(rng.choice(np.arange(2**31, 2**32, 2**20), 16, replace=False))[::-1]
    dst[1] = dst[0] + 1  # one run continues another out of request order
    src[1] = src[0] + 1
    sb, so, db, do, ln = plan_kv_transfer(big, big, src, dst).flatten()
    row = big.kv_tensors[0].row_bytes
    rows = {(int(b), int(o) + k, int(p) + k) for b, o, p, n in zip(sb, so, do, ln) for k in range(0, int(n), row)}
    assert sb.tolist() == db.tolist()
    assert rows == {(b, int(s) * row, int(d) * row) for b in range(big.num_kv_buffers) for s, d in zip(src, dst)}
    assert _scratch_elements() <= max(1 << 16, 16 * 16)
    with pytest.raises(ValueError, match="dst_slots must be distinct: 2 slots, 1 distinct"):
        plan_kv_transfer(big, big, [1, 2], [2**32 - 1, 2**32 - 1])


@pytest.mark.parametrize("seed", range(6))
def test_sparse_run_lookup_matches_the_dense_table(seed, monkeypatch):
    """The sorted-search path of run chaining and the distinct check give the plan the
    dense table gives, duplicated src slots included."""
    from kvtransfer import plan as plan_mod

    lay = _mha(num_slots=4096)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 200))
    src = rng.integers(1, 4096, n)
    src[rng.integers(0, n, 3)] = src[0]  # duplicated sources
    dst = rng.choice(np.arange(1000, 4096), n, replace=False)
    chunk = rng.integers(0, n)  # a run split in two out of order, on both sides
    src[chunk:] = np.arange(n - chunk) + 3000 - (n - chunk) - 1
    dst[chunk:] = np.arange(n - chunk) + 100
    dense = plan_kv_transfer(lay, lay, np.roll(src, 7), np.roll(dst, 7))
    monkeypatch.setattr(plan_mod, "_dense", lambda span, n: False)
    sparse = plan_kv_transfer(lay, lay, np.roll(src, 7), np.roll(dst, 7))
    for got, want in zip(sparse.flatten(), dense.flatten()):
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(12))
def test_small_requests_plan_as_the_array_path_does(seed, monkeypatch):
    """Up to SMALL_REQUEST tokens the slots are checked and cut into runs in Python ints:
    the plan (runs, ranges, errors) is the one the numpy path builds, sectioned pages
    (NSA index), out-of-order runs and duplicated sources included."""
    from kvtransfer import plan as plan_mod

    rng = np.random.default_rng(seed)
    ps = int(rng.choice([1, 4, 16]))
    n = int(rng.integers(1, plan_mod.SMALL_REQUEST + 1))
    nsa = RankLayout.attention(KVKind.NSA, tp_rank=0, tp_size=1, page_size=ps, layer_ids=range(2), dtype="bfloat16",
                               head_dim=576, num_slots=64 * ps).with_nsa_index(index_head_dim=128, num_pages=64)
    lay = _mha(num_slots=64 * ps, page_size=ps)
    src = ps + rng.permutation(63 * ps)[:n] if seed % 3 == 0 else ps + np.arange(n)  # scattered or one block
    dst = 5 * ps + np.arange(n)
    if seed % 4 == 1:  # a run split in two out of order, on both sides
        cut = int(rng.integers(0, n))
        src, dst = np.roll(src, cut), np.roll(dst, cut)
    if seed % 5 == 2:
        src[rng.integers(0, n, 2)] = src[0]  # duplicated sources
    cases = [lambda: plan_kv_transfer(lay, lay, src, dst), lambda: plan_state_transfer(nsa, nsa, src, dst),
             lambda: plan_kv_transfer(lay, lay, src, np.maximum(dst - 5 * ps, 0)),  # page 0: refused
             lambda: plan_kv_transfer(lay, lay, src, np.full(n, dst[0]))]  # not distinct (n > 1)
    paths = (plan_mod.SMALL_REQUEST, 0)
    for build in cases:
        seen = []
        for small in paths:
            monkeypatch.setattr(plan_mod, "SMALL_REQUEST", small)
            try:
                plan = build()
                seen.append([a.tolist() for a in (plan.run_src, plan.run_dst, plan.run_len, *plan.flatten())])
            except ValueError as exc:
                seen.append(str(exc))
        assert seen[0] == seen[1]
