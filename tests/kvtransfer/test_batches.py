"""The plan -> batch road (``kvtransfer.batches``): buffer numbers to region ids through
explicit maps on both sides; the batch writes exactly the plan's bytes. (The real transfer
through it, between processes, is the demo's e2e test.)"""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.batches import BufferRegions, plan_batch
from kvtransfer.plan import KVKind, RankLayout, plan_kv_transfer, plan_state_transfer
from transport.base import StridedBatch, WriteBatch

FIELDS = ("src_region", "src_offset", "dst_region", "dst_offset", "length")


def _byte_map(arrays) -> dict:
    """(src region, byte) -> (dst region, byte) for every byte of flat entries."""
    out = {}
    for sr, so, dr, do, ln in zip(*(np.asarray(a).tolist() for a in arrays)):
        for i in range(ln):
            out[sr, so + i] = (dr, do + i)
    return out


def _mha(tp_rank, tp_size, page_size, heads=4, head_dim=4, slots=256):
    return RankLayout.attention(KVKind.MHA, tp_rank=tp_rank, tp_size=tp_size, page_size=page_size,
                                layer_ids=range(2), dtype="float16", head_dim=head_dim, num_slots=slots,
                                total_heads=heads)


def _maps(layout, first_id):
    """A map whose region ids are not the buffer numbers (registration order is irrelevant)."""
    ids = first_id + 3 * np.arange(layout.num_kv_buffers)[::-1]
    return BufferRegions.of(ids), ids


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (2, 2)])
def test_strided_batch_writes_the_plans_bytes_through_the_maps(src_tp, dst_tp):
    rng = np.random.default_rng(src_tp * 10 + dst_tp)
    src, dst = _mha(0, src_tp, 16), _mha(0, dst_tp, 1)
    src_slots, dst_slots = rng.permutation(np.arange(16, 256))[:40], rng.permutation(np.arange(1, 256))[:40]
    plan = plan_kv_transfer(src, dst, src_slots, dst_slots)
    (s_map, s_ids), (d_map, d_ids) = _maps(src, 7), _maps(dst, 40)
    batch = plan_batch(plan, s_map, d_map)
    assert isinstance(batch, StridedBatch)
    sb, so, db, do, ln = plan.flatten()
    want = _byte_map((s_ids[sb], so, d_ids[db], do, ln))
    got = batch.expand()
    assert _byte_map(getattr(got, f) for f in FIELDS) == want
    assert set(batch.src_region.tolist()) <= set(s_ids.tolist())
    assert set(batch.dst_region.tolist()) <= set(d_ids.tolist())


@pytest.mark.parametrize("src_tp, dst_tp, page", [(1, 1, 16), (2, 1, 16), (1, 2, 1)])
def test_the_flat_form_is_the_strided_form_coalesced(src_tp, dst_tp, page):
    """For a peer that does not expand a StridedBatch on the device (NIXL), ``strided=False``
    gives the plan's merged ranges directly: the same entries as ``coalesced()``, in order."""
    rng = np.random.default_rng(src_tp + 3 * dst_tp + page)
    src, dst = _mha(0, src_tp, page), _mha(0, dst_tp, page)
    contiguous = np.arange(32, 72)
    for src_slots, dst_slots in ((contiguous, contiguous + 64),
                                 (rng.permutation(np.arange(16, 256))[:40], rng.permutation(np.arange(16, 256))[:40])):
        plan = plan_kv_transfer(src, dst, src_slots, dst_slots)
        (s_map, _), (d_map, _) = _maps(src, 7), _maps(dst, 40)
        flat = plan_batch(plan, s_map, d_map, strided=False)
        assert isinstance(flat, WriteBatch)
        want = plan_batch(plan, s_map, d_map).coalesced()
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(flat, f), getattr(want, f))
            assert getattr(flat, f).dtype == np.int64


def test_sectioned_state_pages_take_the_flat_batch():
    def nsa(page_size):
        lay = RankLayout.attention(KVKind.NSA, tp_rank=0, tp_size=1, page_size=page_size, layer_ids=range(2),
                                   dtype="uint8", head_dim=656, num_slots=64 * page_size)
        return lay.with_nsa_index(index_head_dim=128, num_pages=64)

    src, dst = nsa(4), nsa(8)
    slots = np.arange(8, 40)
    plan = plan_state_transfer(src, dst, slots, slots + 16)
    maps = BufferRegions.of(kv=[0, 1], state=[5, 9])
    batch = plan_batch(plan, maps, BufferRegions.of(kv=[0, 1], state=[11, 2]))
    assert isinstance(batch, WriteBatch)
    sb, so, db, do, ln = plan.flatten()
    assert _byte_map((getattr(batch, f) for f in FIELDS)) == _byte_map(
        (np.array([5, 9])[sb], so, np.array([11, 2])[db], do, ln))


def test_a_map_too_short_for_the_plan_is_named():
    src = dst = _mha(0, 1, 1)
    plan = plan_kv_transfer(src, dst, [1, 2], [3, 4])
    with pytest.raises(ValueError, match="destination side, whose map holds 2 buffers"):
        plan_batch(plan, BufferRegions.of(range(4)), BufferRegions.of([0, 1]))
    with pytest.raises(TypeError, match="dst must be BufferRegions"):
        plan_batch(plan, BufferRegions.of(range(4)), [0, 1, 2, 3])


def test_maps_validate_and_round_trip():
    m = BufferRegions.of([3, 1, 2], [7])
    assert BufferRegions.from_wire(m.to_wire()).to_wire() == {"kv": [3, 1, 2], "state": [7]}
    assert not m.kv.flags.writeable
    with pytest.raises(ValueError, match=">= 0"):
        BufferRegions.of([0, -1])
    with pytest.raises(TypeError, match="integers"):
        BufferRegions.of([0.5])
    with pytest.raises(ValueError, match="keys \\['kv', 'state'\\]"):
        BufferRegions.from_wire({"kv": [1]})
    with pytest.raises(ValueError, match="must be a list"):
        BufferRegions.from_wire({"kv": 5, "state": []})


class _Registry:
    """A transport's register/deregister only (what BufferRegions.register calls)."""

    def __init__(self, fail_at=None):
        self.live, self.next, self.fail_at = {}, 10, fail_at

    def register(self, ptr, length, device=None):
        if ptr == self.fail_at:
            raise ValueError(f"bad pointer {ptr}")
        self.live[self.next] = (ptr, length, device)
        self.next += 1
        return self.next - 1

    def deregister(self, rid):
        del self.live[rid]


def test_register_maps_export_order_and_undoes_a_failure():
    reg = _Registry()
    m = BufferRegions.register(reg, ([100, 200], [8, 8], [4, 4]), ([300], [16], [16]), device=None)
    assert m.kv.tolist() == [10, 11] and m.state.tolist() == [12]
    assert [reg.live[i][0] for i in (10, 11, 12)] == [100, 200, 300]
    m.deregister(reg)
    assert reg.live == {}
    bad = _Registry(fail_at=300)
    with pytest.raises(ValueError, match="bad pointer 300"):
        BufferRegions.register(bad, ([100, 200], [8, 8], [4, 4]), ([300], [16], [16]))
    assert bad.live == {}


def test_a_kv_plan_written_as_the_control_plane_writes_it_lands_byte_for_byte(monkeypatch):
    """The control plane's road to a NIXL peer with the staged mode on: ``plan_batch(...,
    strided=peer.takes_strided(plan.num_token_entries))`` gives the StridedBatch, ``write_batch`` sends it through
    ``write_strided`` (a strided staged write), and the decode rank's buffers (a receiver
    process over loopback NIXL) hold the plan's bytes, as its flat ranges say, when its
    notification arrives. A request of fewer than ``min_rows`` entries keeps the flat form (it
    goes direct, where the plan's own flat ranges cost the host least)."""
    from transport._nixl_import import load_nixl_api

    try:
        load_nixl_api()
    except ImportError as exc:  # NIXL is an optional extra
        pytest.skip(f"NIXL is not installed: {exc}")
    from kvtransfer.batches import write_batch
    from tests.transport._nixl_peer import LOOPBACK_ENV, payload
    from tests.transport._support import Receiver, assert_same
    from transport.nixl import NixlConfig, NixlTransport
    from transport.nixl.staged import StagedNixlConfig
    from transport.nixl.staged.sender import StridedStagedTransfer

    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    rng = np.random.default_rng(31)
    common = dict(layer_ids=range(2), dtype="bfloat16", head_dim=16, total_heads=8, num_slots=512)
    src = RankLayout.attention(KVKind.MHA, tp_rank=1, tp_size=2, page_size=1, **common)  # 128 B rows
    dst = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=1, page_size=4, **common)  # 256 B rows
    plan = plan_kv_transfer(src, dst, rng.permutation(np.arange(1, 512))[:300], rng.permutation(np.arange(4, 512))[:300])
    src_bytes, dst_bytes = 512 * 128, 512 * 256  # per buffer
    staged = StagedNixlConfig(slot_bytes=1 << 16, slots=3, min_rows=64)
    rx = Receiver([dst_bytes] * 4, staged=staged)
    t = NixlTransport(NixlConfig(staged=staged))
    try:
        pools = [rng.integers(0, 256, src_bytes, dtype=np.uint8) for _ in range(4)]
        s_map = BufferRegions.of([t.register(p.ctypes.data, p.nbytes) for p in pools])
        peer = t.connect(rx.export)
        small = plan_kv_transfer(src, dst, np.arange(1, 9), np.arange(4, 12))
        assert small.num_token_entries < staged.min_rows and not peer.takes_strided(small.num_token_entries)
        assert peer.takes_strided(plan.num_token_entries)
        batch = plan_batch(plan, s_map, BufferRegions.of(range(4)), strided=peer.takes_strided(plan.num_token_entries))
        assert isinstance(batch, StridedBatch)
        note = payload(1, [(r, 0, dst_bytes) for r in range(4)])
        tr = write_batch(peer, batch, note)
        assert isinstance(tr, StridedStagedTransfer)
        tr.wait(60)
        want = [np.zeros(dst_bytes, np.uint8) for _ in range(4)]
        for sb, so, db, do, n in zip(*(a.tolist() for a in plan.flatten())):
            want[db][do:do + n] = pools[sb][so:so + n]
        assert [n for n, _ in rx.wait_notes(1)] == [note]
        for r in range(4):
            assert_same(rx.dump(r), want[r], f"decode buffer {r}")
    finally:
        t.close()
        rx.stop()
