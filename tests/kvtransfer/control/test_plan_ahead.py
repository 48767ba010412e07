"""A prefill rank makes the pair sets of its writes to a decode rank resident at its hello
(``DecodePeer.plan_ahead``): the pairs of a one-token plan are those of every request's write,
whatever its slots. The transport's side (``NvlinkPeer.plan_pairs`` keeping them on the GPU) is
tested in tests/transport; here a stand-in peer records what it is given."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvtransfer.batches import BufferRegions
from kvtransfer.control.prefill_peers import DecodePeer
from kvtransfer.plan import KVKind, RankLayout, plan_kv_transfer, plan_state_transfer, senders_for
from tests.kvtransfer._support import mamba_layouts
from transport.base import Peer, StridedBatch


class _NoPlans(Peer):
    """A transport peer that keeps nothing resident (as NIXL's); it is never written to here."""

    def takes_strided(self, entries: int) -> bool:
        return True

    def write(self, batch, notify=None):
        raise NotImplementedError("plan_ahead does not write")

    def close(self) -> None:
        pass


class _Peer(_NoPlans):
    """A transport peer that expands strided batches and keeps pair sets (as NVLink's does)."""

    def __init__(self, fail: bool = False):
        self.planned, self.fail = [], fail

    def plan_pairs(self, batch):
        if self.fail:
            raise RuntimeError("CUDA error: out of memory")
        self.planned.append(batch)


def _mha(tp_rank, tp_size, page_size, slots=512):
    return RankLayout.attention(KVKind.MHA, tp_rank=tp_rank, tp_size=tp_size, page_size=page_size,
                                layer_ids=range(3), dtype="bfloat16", head_dim=8, num_slots=slots, total_heads=8)


def _entry(mine: RankLayout, theirs: RankLayout, peer, reads_from_me: bool = True) -> DecodePeer:
    src = BufferRegions.of(100 + np.arange(mine.num_kv_buffers), 200 + np.arange(mine.num_state_buffers))
    dst = BufferRegions.of(300 + np.arange(theirs.num_kv_buffers), 400 + np.arange(theirs.num_state_buffers))
    return DecodePeer(None, b"", theirs, "nvlink", src, dst, peer, reads_from_me=reads_from_me, writes_aux=True,
                      session=None)


def _same_pairs(a: StridedBatch, b: StridedBatch) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.pairs, b.pairs))


@pytest.mark.parametrize("src_tp, dst_tp, src_ps, dst_ps", [(1, 1, 16, 16), (2, 1, 16, 64), (1, 4, 1, 16),
                                                          (4, 2, 64, 1)])
def test_the_pairs_made_ahead_are_those_of_every_requests_write(src_tp, dst_tp, src_ps, dst_ps):
    """For each TP mix, every prefill rank that a decode rank reads from (``senders_for``, as the
    manager asks) makes its one KV pair set resident, and the others none; a request of many
    tokens at random slots, later, brings the same pairs."""
    rng = np.random.default_rng(src_tp * 10 + dst_tp)
    made = 0
    for dst_rank in range(dst_tp):
        theirs = _mha(dst_rank, dst_tp, dst_ps)
        readers = senders_for(theirs, src_tp)
        for src_rank in range(src_tp):
            mine = _mha(src_rank, src_tp, src_ps)
            peer = _Peer()
            entry = _entry(mine, theirs, peer, reads_from_me=src_rank in readers)
            src_slots = rng.permutation(np.arange(src_ps, 512))[:40]
            dst_slots = rng.permutation(np.arange(dst_ps, 512))[:40]
            request = plan_kv_transfer(mine, theirs, src_slots, dst_slots)
            want = int(src_rank in readers and not request.empty)
            assert entry.plan_ahead(mine) == len(peer.planned) == want
            if want:
                batch = entry.batch(request)
                assert isinstance(batch, StridedBatch) and _same_pairs(peer.planned[0], batch)
            made += want
    assert made >= dst_tp  # every decode rank has a sender


def test_a_mamba_model_makes_its_state_pairs_resident_too():
    groups = [(64, 16, 16)]
    mine, theirs = mamba_layouts(2, groups)[1], mamba_layouts(1, groups)[0]
    peer = _Peer()
    entry = _entry(mine, theirs, peer)
    assert entry.plan_ahead(mine) == 2
    kv = entry.batch(plan_kv_transfer(mine, theirs, [3, 5, 9], [2, 7, 4]))
    state = entry.batch(plan_state_transfer(mine, theirs, 4, 2))
    assert _same_pairs(peer.planned[0], kv) and _same_pairs(peer.planned[1], state)


def test_nothing_is_made_where_the_transport_keeps_none_or_the_rank_reads_nothing():
    mine, theirs = _mha(0, 1, 16), _mha(0, 1, 16)
    assert _entry(mine, theirs, _NoPlans()).plan_ahead(mine) == 0
    peer = _Peer()
    assert _entry(mine, theirs, peer, reads_from_me=False).plan_ahead(mine) == 0 and peer.planned == []


def test_a_failure_to_make_them_is_logged_and_leaves_the_hello_standing(caplog):
    mine, theirs = _mha(0, 1, 16), _mha(0, 1, 16)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.control.prefill"):
        assert _entry(mine, theirs, _Peer(fail=True)).plan_ahead_or_log(mine, ("d", 0)) == 0
    assert "pair sets of the writes to decode rank ('d', 0) were not made ahead: CUDA error: out of memory" \
        in caplog.text
