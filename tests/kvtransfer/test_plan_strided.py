"""``TransferPlan.strided()`` (pairs x token slots) on a sweep of the planner's reference cases
(``tests/kvtransfer/_support.py``, which test_plan runs as built).

Every plan those cases build is routed through :class:`_ViaStrided`: its strided form, as a
``transport.base.StridedBatch`` expanded to flat entries, must equal ``flatten()`` as a set of
byte ranges once touching ranges are merged (an independent merge, below), and the merged
expansion is what the reference then copies byte by byte (every byte once, right values).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.plan import KVKind, RankLayout, plan_kv_transfer, plan_state_transfer
from tests.kvtransfer import _support as support
from transport.base import StridedBatch


def _merged(sb, so, db, do, ln):
    """Canonical form: sorted by every field, ranges touching on both sides merged."""
    order = np.lexsort((ln, do, db, so, sb))
    sb, so, db, do, ln = (np.asarray(a, dtype=np.int64)[order] for a in (sb, so, db, do, ln))
    out: list[list[int]] = []
    for e in zip(sb.tolist(), so.tolist(), db.tolist(), do.tolist(), ln.tolist()):
        if out and out[-1][0] == e[0] and out[-1][2] == e[2] and out[-1][1] + out[-1][4] == e[1] \
                and out[-1][3] + out[-1][4] == e[3]:
            out[-1][4] += e[4]
        else:
            out.append(list(e))
    arr = np.array(out, dtype=np.int64).reshape(-1, 5)
    return tuple(arr[:, i] for i in range(5))


class _ViaStrided:
    """A plan whose ``flatten`` is its strided form, expanded and merged (checked first)."""

    seen = {"strided": 0, "none": 0}

    def __init__(self, plan):
        self.plan = plan
        self.empty = plan.empty

    def flatten(self):
        plan = self.plan
        flat = plan.flatten()
        form = plan.strided()
        if form is None:
            assert plan.src_page_size != 1 or plan.dst_page_size != 1
            _ViaStrided.seen["none"] += 1
            return flat
        _ViaStrided.seen["strided"] += 1
        batch = StridedBatch.of(*form)  # buffer numbers stand for region ids
        assert batch.num_pairs == plan.num_pairs and batch.num_slots == plan.num_tokens
        assert batch.nbytes == plan.nbytes
        e = batch.expand()
        got = _merged(e.src_region, e.src_offset, e.dst_region, e.dst_offset, e.length)
        want = _merged(*flat)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        return got


@pytest.fixture(autouse=True)
def via_strided(monkeypatch):
    monkeypatch.setattr(support, "plan_kv_transfer", lambda *a: _ViaStrided(plan_kv_transfer(*a)))
    monkeypatch.setattr(support, "plan_state_transfer", lambda *a: _ViaStrided(plan_state_transfer(*a)))
    _ViaStrided.seen.update(strided=0, none=0)
    yield


@pytest.mark.parametrize("d", support.TP)
@pytest.mark.parametrize("p", support.TP)
@pytest.mark.parametrize("heads", [1, 8, 32])
def test_mha_every_tp_mix(heads, p, d):
    support.case_mha_every_tp_mix(heads, p, d)
    assert _ViaStrided.seen["strided"] > 0 and _ViaStrided.seen["none"] == 0


@pytest.mark.parametrize("src_ps,dst_ps", [(64, 16), (1, 64), (16, 16)])
@pytest.mark.parametrize("mode", ["random", "contiguous"])
def test_mha_page_sizes_differ(src_ps, dst_ps, mode):
    support.case_mha_page_sizes_differ(src_ps, dst_ps, mode)


def test_mha_v_head_dim_differs():
    support.case_mha_v_head_dim_differs()


@pytest.mark.parametrize("p,d", [(1, 1), (2, 8), (8, 2), (4, 4)])
@pytest.mark.parametrize("kind", [KVKind.MLA, KVKind.MLA_FP4])
def test_mla_replicated(kind, p, d):
    support.case_mla_replicated(kind, p, d)


@pytest.mark.parametrize("src_ps,dst_ps,mode", [(64, 16, "random"), (64, 1, "random"), (4, 4, "contiguous")])
@pytest.mark.parametrize("p,d", [(1, 1), (2, 4)])
def test_nsa_kv_strided_index_pages_not(p, d, src_ps, dst_ps, mode):
    support.case_nsa_kv_and_index(p, d, src_ps, dst_ps, mode)
    assert _ViaStrided.seen["strided"] > 0 and _ViaStrided.seen["none"] > 0  # KV strided, index_k pages not


def test_nsa_index_with_page_size_one_is_strided():
    """Sectioned pages of one slot: a slot's sections are ``slot * page + section``."""
    n, layers = 20, 2
    lay = [RankLayout.attention(KVKind.NSA, tp_rank=0, tp_size=1, page_size=1, layer_ids=range(layers),
                                dtype="float8_e4m3fn", head_dim=656, num_slots=n + 3)
           .with_nsa_index(index_head_dim=128, num_pages=n + 3)]
    rng = np.random.default_rng(4)
    slots = support.alloc_slots(rng, n, 1, n + 3), support.alloc_slots(rng, n, 1, n + 3)
    support.check_all_pairs(lay, lay, [support.Ref(1, 128, "replicated"), support.Ref(1, 4, "replicated")],
                              layers, *slots, rng, state=True, sectioned=True)
    assert _ViaStrided.seen == {"strided": 1, "none": 0}


@pytest.mark.parametrize("p,d", [(1, 1), (2, 4), (8, 2)])
def test_mamba_state(p, d):
    support.case_mamba_state(p, d)
    assert _ViaStrided.seen["none"] == 0


@pytest.mark.parametrize("n_groups", [1, 8])
def test_mamba2_groups(n_groups):
    support.case_mamba2_groups_replicated_when_tp_exceeds_them(n_groups, 8, 2)


def test_strided_form_is_token_slots_of_the_runs():
    """Contiguous slots: one run per pair in flatten, one slot per token here, same bytes."""
    lay = support.attention_layouts(KVKind.MHA, 1, 16, 8, layer_ids=range(2), dtype="bfloat16", head_dim=64,
                                  total_heads=4)[0]
    src_slots, dst_slots = np.arange(16, 48), np.arange(64, 96)
    plan = plan_kv_transfer(lay, lay, src_slots, dst_slots)
    sb, so, ss, db, do, ds, ln, s_slot, d_slot = plan.strided()
    np.testing.assert_array_equal(s_slot, src_slots)
    np.testing.assert_array_equal(d_slot, dst_slots)
    assert plan.num_runs == 1 and sb.size == 4  # K and V of 2 layers
    np.testing.assert_array_equal(ss, ln)  # whole rows: stride == row
    empty = plan_kv_transfer(lay, lay, np.zeros(0, np.int64), np.zeros(0, np.int64)).strided()
    assert len(StridedBatch.of(*empty)) == 0
