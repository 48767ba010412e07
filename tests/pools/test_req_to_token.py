"""ReqToTokenPool and HybridReqToTokenPool: rows, Mamba slots, ping-pong track buffers."""

import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from pools.mamba import MambaStateParams
from pools.req_to_token import HybridReqToTokenPool, ReqToTokenPool
from tests.pools._support import Counter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LAYERS = (0, 3)


@dataclass
class Req:
    """The attributes the pools read and write (see pools/req_to_token.py)."""

    req_pool_idx: Optional[int] = None
    is_chunked: int = 0
    kv_committed_len: int = 0
    mamba_pool_idx: Optional[torch.Tensor] = None
    mamba_ping_pong_track_buffer: Optional[torch.Tensor] = None
    mamba_next_track_idx: Optional[int] = None


def make_hybrid(device="cpu", size=4, mamba_size=12, extra=False, overlap=True, start_layer=None):
    params = MambaStateParams(conv_shapes=((6, 3),), temporal_shape=(2, 3, 4), layers=LAYERS)
    return HybridReqToTokenPool(
        size=size, mamba_size=mamba_size, mamba_spec_state_size=1, max_context_len=8, device=device,
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=LAYERS,
        enable_mamba_extra_buffer=extra, enable_overlap_schedule=overlap, start_layer=start_layer,
    )


def mamba_allocated(pool):
    """Slots the Mamba pool has handed out, from its free list (independent of any request)."""
    return set(range(1, pool.mamba_pool.size + 1)) - set(pool.mamba_pool.free_slots.tolist())


# -- ReqToTokenPool ----------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_buffer_shape_dtype(device):
    pool = ReqToTokenPool(size=5, max_context_len=16, device=device)
    assert tuple(pool.req_to_token.shape) == (6, 16)
    assert pool.req_to_token.dtype == torch.int32 and pool.req_to_token.device.type == device
    assert pool.req_to_token.nbytes == 6 * 16 * 4
    rows = pool.alloc([Req(), Req()])
    pool.write((rows[1], slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
    assert pool.req_to_token[rows[1], :3].tolist() == [7, 8, 9]


def test_alloc_free_random_sequence():
    pool = ReqToTokenPool(size=7, max_context_len=4)
    rng = random.Random(2)
    live: list[Req] = []
    for _ in range(300):
        if rng.random() < 0.5:
            reqs = [Req() for _ in range(rng.randint(0, 3))]
            if live and rng.random() < 0.3:  # a chunked request continues with its row
                cont = rng.choice(live)
                cont.is_chunked = 1
                reqs.append(cont)
            fresh = sum(r.req_pool_idx is None for r in reqs)
            before = [r.req_pool_idx for r in reqs]
            rows = pool.alloc(reqs)
            if fresh > pool.size - len(live):
                assert rows is None and [r.req_pool_idx for r in reqs] == before
            else:
                assert rows == [r.req_pool_idx for r in reqs]
                live += [r for r, b in zip(reqs, before) if b is None]
        elif live:
            pool.free(live.pop(rng.randrange(len(live))))
        held = [r.req_pool_idx for r in live]
        assert len(set(held)) == len(held) and 0 not in held
        assert pool.available_size() == pool.size - len(live)
        assert sorted(held + pool.free_slots) == list(range(1, pool.size + 1))
    pool.clear()
    assert pool.available_size() == pool.size


def test_reuse_rules():
    pool = ReqToTokenPool(size=3, max_context_len=4)
    a = Req()
    (row,) = pool.alloc([a])
    with pytest.raises(ValueError, match="neither chunked nor has committed KV"):
        pool.alloc([a])
    a.kv_committed_len = 5
    assert pool.alloc([a, Req()])[0] == row
    stranger = Req(req_pool_idx=3, is_chunked=1)  # row 3 was never handed out to it
    with pytest.raises(ValueError, match="reuses row 3, which is not an allocated row"):
        pool.alloc([stranger])
    with pytest.raises(ValueError, match="reuse the same row"):
        pool.alloc([a, Req(req_pool_idx=row, is_chunked=1)])


def test_exhausted_returns_none_and_double_free():
    pool = ReqToTokenPool(size=2, max_context_len=4)
    reqs = [Req(), Req(), Req()]
    assert pool.alloc(reqs) is None
    assert all(r.req_pool_idx is None for r in reqs) and pool.available_size() == 2
    pool.alloc(reqs[:2])
    pool.free(reqs[0])
    assert reqs[0].req_pool_idx is None
    with pytest.raises(ValueError, match="double free: request has no req_pool_idx"):
        pool.free(reqs[0])
    with pytest.raises(ValueError, match="row 1 is not allocated"):
        pool.free(Req(req_pool_idx=1))


def test_constructor_rejects_bad_size():
    with pytest.raises(ValueError, match="size must be a positive int"):
        ReqToTokenPool(size=0, max_context_len=4)


# -- HybridReqToTokenPool ----------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_alloc_maps_mamba_slots(device):
    pool = make_hybrid(device)
    reqs = [Req(), Req(), Req()]
    rows = pool.alloc(reqs)
    mids = [int(r.mamba_pool_idx) for r in reqs]
    assert len(set(mids)) == 3 and 0 not in mids and mamba_allocated(pool) == set(mids)
    assert pool.get_mamba_indices(torch.tensor(rows, device=device)).tolist() == mids
    assert pool.req_index_to_mamba_index_mapping.dtype == torch.int32
    assert tuple(pool.req_index_to_mamba_index_mapping.shape) == (pool.size + 1,)
    # a request that brings its Mamba slot (radix-cache hit) keeps it
    pool.free_mamba_cache(reqs[0])
    keep = pool.mamba_pool.alloc(1)[0]
    hit = Req(mamba_pool_idx=keep)
    (row,) = pool.alloc([hit])
    assert int(hit.mamba_pool_idx) == int(keep) and int(pool.get_mamba_indices(row)) == int(keep)


@pytest.mark.parametrize("overlap, size", [(True, 2), (False, 1)])
def test_hybrid_ping_pong_track_buffers(overlap, size):
    pool = make_hybrid(extra=True, overlap=overlap)
    assert pool.mamba_ping_pong_track_buffer_size == size
    reqs = [Req(), Req()]
    rows = pool.alloc(reqs)
    mapping = pool.req_index_to_mamba_ping_pong_track_buffer_mapping
    assert tuple(mapping.shape) == (pool.size + 1, size) and mapping.dtype == torch.int32
    slots = []
    for r, row in zip(reqs, rows):
        assert r.mamba_next_track_idx == 0 and r.mamba_ping_pong_track_buffer.numel() == size
        assert mapping[row].tolist() == r.mamba_ping_pong_track_buffer.tolist()
        slots += [int(r.mamba_pool_idx), *r.mamba_ping_pong_track_buffer.tolist()]
    assert len(set(slots)) == len(slots) == 2 * (1 + size) and mamba_allocated(pool) == set(slots)
    for i in range(size):
        assert pool.get_mamba_ping_pong_other_idx(i) == (1 - i if size == 2 else i)
    with pytest.raises(ValueError, match=rf"mamba_next_track_idx must be in \[0, {size}\)"):
        pool.get_mamba_ping_pong_other_idx(size)


@pytest.mark.parametrize("overlap, keep", [(True, None), (True, 0), (True, 1), (False, None), (False, 0)])
def test_free_mamba_cache_rules(overlap, keep):
    pool = make_hybrid(extra=True, overlap=overlap)
    req = Req()
    pool.alloc([req])
    mid, track = int(req.mamba_pool_idx), req.mamba_ping_pong_track_buffer.tolist()
    pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep)
    assert req.mamba_pool_idx is None
    kept = set() if keep is None else {track[keep]}
    assert mamba_allocated(pool) == kept  # the Mamba slot and every other track slot are free
    assert mid not in kept
    with pytest.raises(ValueError, match="double free: request has no mamba_pool_idx"):
        pool.free_mamba_cache(req)


def test_free_mamba_cache_rejects_bad_keep():
    pool = make_hybrid(extra=True, overlap=False)
    req = Req()
    pool.alloc([req])
    before = mamba_allocated(pool)
    with pytest.raises(ValueError, match=r"to_keep must be in \[0, 1\) or None, got 1"):
        pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=1)
    assert mamba_allocated(pool) == before and req.mamba_pool_idx is not None
    pool.free(req)  # the row is gone: its track slots can no longer be found
    with pytest.raises(ValueError, match="needs the request's req_pool_idx"):
        pool.free_mamba_cache(req)
    assert mamba_allocated(pool) == before


def test_free_mamba_cache_without_extra_buffer_frees_only_state():
    pool = make_hybrid()
    a, b = Req(), Req()
    pool.alloc([a, b])
    pool.free_mamba_cache(a)
    assert mamba_allocated(pool) == {int(b.mamba_pool_idx)}
    pool.free(a)
    assert a.req_pool_idx is None and pool.available_size() == pool.size - 1


@pytest.mark.parametrize("extra", [False, True])
def test_hybrid_exhausted_mamba_returns_none_and_changes_nothing(extra):
    # 5 Mamba slots: with track buffers (2 each) a request needs 3
    pool = make_hybrid(size=4, mamba_size=5 if extra else 2, extra=extra)
    first = [Req()] if extra else [Req(), Req()]
    pool.alloc(first)
    rows_free, mamba_free = pool.available_size(), pool.mamba_pool.available_size()
    late = Req()
    assert pool.alloc([late]) is None
    assert late.req_pool_idx is None and late.mamba_pool_idx is None
    assert pool.available_size() == rows_free and pool.mamba_pool.available_size() == mamba_free


def test_hybrid_random_sequence():
    pool = make_hybrid(size=5, mamba_size=11, extra=True)
    rng = random.Random(3)
    live: list[Req] = []
    for _ in range(200):
        if rng.random() < 0.5:
            reqs = [Req() for _ in range(rng.randint(1, 2))]
            if pool.alloc(reqs) is not None:
                live += reqs
            else:
                assert all(r.req_pool_idx is None and r.mamba_pool_idx is None for r in reqs)
        elif live:
            r = live.pop(rng.randrange(len(live)))
            pool.free_mamba_cache(r)
            pool.free(r)
        slots = [s for r in live for s in [int(r.mamba_pool_idx), *r.mamba_ping_pong_track_buffer.tolist()]]
        assert len(set(slots)) == len(slots) and 0 not in slots and mamba_allocated(pool) == set(slots)
        assert pool.available_size() == pool.size - len(live)
    pool.clear()
    assert pool.available_size() == pool.size and pool.mamba_pool.available_size() == pool.mamba_pool.size
    assert not pool.req_index_to_mamba_index_mapping.any()
    assert not pool.req_index_to_mamba_ping_pong_track_buffer_mapping.any()


@pytest.mark.parametrize("start_layer", [None, 2])
def test_layer_transfer_counter_called_before_state(start_layer):
    pool = make_hybrid(start_layer=start_layer)
    local0 = 0 - (start_layer or 0)
    counter = Counter(missing={local0})
    pool.register_layer_transfer_counter(counter)
    st = pool.mamba2_layer_cache(3)
    assert counter.calls == [3 - (start_layer or 0)]
    with pytest.raises(TimeoutError, match="not arrived"):
        pool.mamba2_layer_cache(0)
    counter.calls.pop()
    assert st.temporal.data_ptr() == pool.mamba_pool.mamba_cache.temporal[1].data_ptr()
    with pytest.raises(KeyError, match=r"layer 1 is not a mamba layer.*\[0, 3\]"):
        pool.mamba2_layer_cache(1)
    assert counter.calls == [3 - (start_layer or 0)]  # no wait for a bad layer
    with pytest.raises(TypeError, match="wait_until"):
        pool.register_layer_transfer_counter(object())


def test_hybrid_state_exports_are_the_mamba_pools():
    pool = make_hybrid()
    ptrs, lens, items = pool.get_state_buf_infos()
    dims = pool.get_state_dim_per_tensor()
    mp = pool.mamba_pool.mamba_cache
    tensors = [(t, l) for t in [*mp.conv, mp.temporal] for l in range(len(LAYERS))]
    assert len(ptrs) == len(lens) == len(items) == len(dims) == len(tensors)
    assert ptrs == [t[l].data_ptr() for t, l in tensors]
    assert lens == [t[l].nbytes for t, l in tensors]
    assert items == [t[l, 0].nbytes for t, l in tensors]
    assert dims == [t.shape[2] for t, _ in tensors]
    with pytest.raises(ValueError, match="speculative"):
        pool.get_speculative_mamba2_params_all_layers()
