"""What one prefill request writes per chunk (:meth:`PrefillRequest.post`): the batches and
notifications handed to the decode rank's transport peer, which records them (the bytes'
landing is the managers' tests' part, through real transports)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtransfer.control.prefill_request as prefill_request
from kvtransfer.control.prefill_request import Chunk, PrefillRequest
from kvtransfer.control.state import KVPoll, RequestStatus
from kvtransfer.control.wire import KVArrived, TransferRequest
from kvtransfer.layout import RankLayout
from pools import MHATokenToKVPool
from transport.base import Transfer, TransferStatus
from transport.batch import WriteBatch

LAYERS, KEY = 4, ("decode", 0)


def _layout(page: int) -> RankLayout:
    pool = MHATokenToKVPool(size=8 * page, page_size=page, dtype=torch.bfloat16, head_num=2, head_dim=8,
                            layer_num=LAYERS, device="cpu")
    return RankLayout.from_pools(pool, tp_rank=0, tp_size=1)


class _Done(Transfer):
    def status(self) -> TransferStatus:
        return TransferStatus.DONE

    @property
    def error(self):
        return None

    def abort(self) -> None:
        pass


class _Recorder:
    """A transport peer that records each write's batch and notification."""

    def __init__(self):
        self.writes = []

    def write(self, batch, notify=None):
        self.writes.append((batch, KVArrived.from_msgpack(notify)))
        return _Done()

    write_strided = write


class _DecodeRank:
    """The part of a connected decode rank (``DecodePeer``) that ``post`` reads."""

    def __init__(self, layout: RankLayout):
        self.layout, self.peer = layout, _Recorder()
        self.reads_from_me = self.writes_aux = True

    def batch(self, plan):
        return ("rows", plan.num_token_entries)


@pytest.fixture
def planned(monkeypatch):
    """The planner's calls: (source slots, destination slots) of each."""
    calls = []
    plan = prefill_request.plan_kv_transfer

    def counting(src, dst, src_slots, dst_slots):
        calls.append((src_slots.tolist(), dst_slots.tolist()))
        return plan(src, dst, src_slots, dst_slots)

    monkeypatch.setattr(prefill_request, "plan_kv_transfer", counting)
    return calls


def _request(tokens: int, prefix: int = 0) -> tuple:
    mine, decode = _layout(4), _layout(8)
    rank = _DecodeRank(decode)
    out = PrefillRequest("r", RequestStatus("r"), since=0.0)
    dst = np.arange(8, 8 + tokens - prefix, dtype="<i8").tobytes()
    ask = TransferRequest(request_id="r", instance="decode", decode_tp_rank=0, dst_slots=dst,
                          prefix_tokens=prefix, state_slot=-1)
    assert out.attach(KEY, ask, lambda instance: frozenset({KEY}), 0.0, 60.0) is None
    return out, mine, {KEY: rank}, rank.peer.writes


def test_a_last_chunk_of_no_tokens_plans_nothing_and_writes_no_bytes_with_the_last_notification(planned):
    """A prompt sent layer by layer: its 5 tokens go in two groups of layers, planned once; the
    last chunk, no tokens, carries the first token: one write of no bytes, not planned."""
    out, mine, peers, writes = _request(5)
    slots = np.arange(4, 9, dtype=np.int64)
    out.post(Chunk(slots, False, None, None, layers=(0, 2)), mine, peers)
    out.post(Chunk(slots, False, None, None, layers=(2, LAYERS)), mine, peers)
    assert out.status.last_posted_at is None
    out.post(Chunk(slots[:0], True, None, b"token"), mine, peers)
    assert out.status.last_posted_at >= out.status.times[KVPoll.Transferring]  # the last post's start
    assert planned == [(slots.tolist(), list(range(8, 13)))]
    assert [batch for batch, _ in writes[:2]] == [("rows", 5 * 2 * 2)] * 2  # 5 tokens x K, V x 2 layers
    last, note = writes[2]
    assert isinstance(last, WriteBatch) and len(last) == 0 and last.nbytes == 0
    assert (note.seq, note.total, note.aux) == (2, 3, b"token")
    assert [n.total for _, n in writes[:2]] == [0, 0]
    assert out.last_posted and out.status.state is KVPoll.Transferring


def test_a_chunk_decode_holds_whole_writes_no_bytes_without_a_plan(planned):
    """Decode holds the first 3 tokens: a first chunk of 3 sends nothing (one write of no bytes,
    not planned), the last chunk of 2 is planned from token 3 on."""
    out, mine, peers, writes = _request(5, prefix=3)
    out.post(Chunk(np.arange(4, 7, dtype=np.int64), False, None, None), mine, peers)
    out.post(Chunk(np.arange(7, 9, dtype=np.int64), True, None, b""), mine, peers)
    assert planned == [([7, 8], [8, 9])]
    assert len(writes[0][0]) == 0 and writes[1][0] == ("rows", 2 * 2 * LAYERS)
    assert [(n.seq, n.total) for _, n in writes] == [(0, 0), (1, 2)]
