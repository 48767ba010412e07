"""HybridLinearKVPool: layer-id mapping over an MHA or MLA pool plus a MambaPool."""

import pytest
import torch

from pools.hybrid_linear import HybridLinearKVPool
from pools.mamba import MambaPool, MambaStateParams
from pools.mha import MHATokenToKVPool
from pools.mla import MLATokenToKVPool
from tests.pools._support import Counter, Layer

SIZE, PAGE, HEADS, HEAD_DIM, RANK, ROPE = 32, 4, 2, 8, 32, 16
FULL = [1, 3, 5]  # full-attention layers; the others are mamba layers
MAMBA = [0, 2, 4]


def make_mamba(device="cpu", layers=MAMBA):
    params = MambaStateParams(conv_shapes=((6, 3), (4, 3)), temporal_shape=(2, 4, 5), layers=tuple(layers))
    return MambaPool(size=4, spec_state_size=2, cache_params=params, device=device, speculative_num_draft_tokens=2)


def make(use_mla=False, device="cpu", start_layer=None, full=FULL, mamba=None, dtype=torch.bfloat16, **kw):
    return HybridLinearKVPool(
        size=SIZE, dtype=dtype, page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM,
        full_attention_layer_ids=full, enable_kvcache_transpose=kw.pop("enable_kvcache_transpose", False),
        device=device, mamba_pool=mamba or make_mamba(device), use_mla=use_mla,
        kv_lora_rank=RANK if use_mla else None, qk_rope_head_dim=ROPE if use_mla else None,
        start_layer=start_layer, **kw,
    )


# -- construction and exports ----------------------------------------------------------------
@pytest.mark.parametrize("use_mla", [False, True])
def test_inner_pool_and_exports(use_mla):
    pool = make(use_mla)
    inner = pool.full_kv_pool
    assert isinstance(inner, MLATokenToKVPool if use_mla else MHATokenToKVPool)
    assert inner.layer_num == len(FULL) and inner.size == SIZE and inner.page_size == PAGE
    assert pool.full_attention_layer_id_mapping == {1: 0, 3: 1, 5: 2}
    bufs = inner.kv_buffer if use_mla else inner.k_buffer + inner.v_buffer
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in bufs] and lens == [b.nbytes for b in bufs]
    assert items == [b[0].nbytes * PAGE for b in bufs]
    assert pool.get_kv_size_bytes() == inner.get_kv_size_bytes()
    # state side: per state tensor (conv list, then temporal), per mamba layer; no spec buffers
    state = [*pool.mamba_pool.mamba_cache.conv, pool.mamba_pool.mamba_cache.temporal]
    ptrs, lens, items = pool.get_state_buf_infos()
    assert ptrs == [t[l].data_ptr() for t in state for l in range(len(MAMBA))]
    assert lens == [t[l].nbytes for t in state for l in range(len(MAMBA))]
    assert items == [t[l][0].nbytes for t in state for l in range(len(MAMBA))]
    assert pool.get_state_dim_per_tensor() == [6] * 3 + [4] * 3 + [2] * 3


# -- layer mapping -------------------------------------------------------------------------
def test_mha_layer_mapping_get_and_set():
    pool = make()
    inner = pool.full_kv_pool
    for i, layer_id in enumerate(FULL):
        assert pool.get_key_buffer(layer_id).data_ptr() == inner.k_buffer[i].data_ptr()
        assert pool.get_value_buffer(layer_id).data_ptr() == inner.v_buffer[i].data_ptr()
        k, v = pool.get_kv_buffer(layer_id)
        assert (k.data_ptr(), v.data_ptr()) == (inner.k_buffer[i].data_ptr(), inner.v_buffer[i].data_ptr())
    loc = torch.tensor([4, 9, 30])
    k, v = torch.randn(3, HEADS, HEAD_DIM), torch.randn(3, HEADS, HEAD_DIM)
    layer = Layer(5)
    pool.set_kv_buffer(layer, loc, k, v)
    assert layer.layer_id == 5  # the caller's object is not patched
    assert torch.equal(inner.k_buffer[2][loc], k.bfloat16()) and torch.equal(inner.v_buffer[2][loc], v.bfloat16())
    pool.set_kv_buffer(1, loc, v, k)  # an int layer works too
    assert torch.equal(inner.k_buffer[0][loc], v.bfloat16())
    assert not inner.k_buffer[1].any()
    assert pool.get_v_head_dim() == HEAD_DIM


def test_mla_layer_mapping_get_and_set():
    pool = make(use_mla=True)
    inner = pool.full_kv_pool
    loc = torch.tensor([4, 31])
    nope, rope = torch.randn(2, 1, RANK), torch.randn(2, 1, ROPE)
    layer = Layer(3)
    pool.set_mla_kv_buffer(layer, loc, nope, rope)
    assert layer.layer_id == 3
    ref = torch.cat([nope, rope], dim=-1).bfloat16()
    assert torch.equal(inner.kv_buffer[1][loc], ref)
    assert not inner.kv_buffer[0].any() and not inner.kv_buffer[2].any()
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(3), loc)
    assert torch.equal(got_nope, ref[..., :RANK]) and torch.equal(got_rope, ref[..., RANK:])
    pool.set_kv_buffer(Layer(1), loc, ref, None)
    assert torch.equal(pool.get_key_buffer(1)[loc], ref)
    assert pool.get_value_buffer(5).shape == (SIZE + PAGE, 1, RANK)
    assert pool.get_v_head_dim() == RANK


@pytest.mark.parametrize("use_mla", [False, True])
def test_unknown_layer_is_key_error_naming_full_layers(use_mla):
    pool = make(use_mla)
    counter = Counter()
    pool.register_layer_transfer_counter(counter)
    msg = r"layer 2 is not a full-attention layer of this pool \(full-attention layers \[1, 3, 5\]\)"
    with pytest.raises(KeyError, match=msg):
        pool.get_key_buffer(2)
    with pytest.raises(KeyError, match=msg):
        pool.get_value_buffer(2)
    with pytest.raises(KeyError, match=r"layer 7 is not a full-attention layer"):
        pool.get_kv_buffer(7)
    with pytest.raises(KeyError, match=msg):
        pool.set_kv_buffer(Layer(2), torch.tensor([4]), torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, HEADS, HEAD_DIM))
    assert counter.calls == []  # no wait for a layer the pool does not hold


def test_counter_waits_with_global_ids_once():
    pool = make(start_layer=1)
    counter = Counter()
    pool.register_layer_transfer_counter(counter)
    assert pool.full_kv_pool.layer_transfer_counter is None  # the inner pool does not wait again
    pool.get_key_buffer(3)
    pool.get_value_buffer(5)
    pool.get_kv_buffer(1)
    assert counter.calls == [2, 4, 0]
    mla = make(use_mla=True)
    mla.register_layer_transfer_counter(counter)
    mla.get_mla_kv_buffer(Layer(5), torch.tensor([4]))
    assert counter.calls == [2, 4, 0, 5]
    with pytest.raises(TypeError, match=r"layer_transfer_counter must have a wait_until\(layer_id\) method"):
        pool.register_layer_transfer_counter(object())


# -- CPU copy ------------------------------------------------------------------------------
def test_cpu_copy_of_kv_and_mamba_state():
    pool = make()
    loc = torch.tensor([4, 5, 6, 7, 12])
    for layer_id in FULL:
        pool.set_kv_buffer(layer_id, loc, torch.randn(5, HEADS, HEAD_DIM), torch.randn(5, HEADS, HEAD_DIM))
    slots = pool.mamba_pool.alloc(2)
    state = [*pool.mamba_pool.mamba_cache.conv, pool.mamba_pool.mamba_cache.temporal]
    for t in state:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    inner = pool.full_kv_pool
    kv_bufs = inner.k_buffer + inner.v_buffer
    kv_before, state_before = [b.clone() for b in kv_bufs], [t.clone() for t in state]
    cpu = pool.get_cpu_copy(loc, slots)
    assert pool.get_cpu_copy(loc)[1] is None
    for b in kv_bufs + state:
        b.zero_()
    pool.load_cpu_copy(cpu, loc, slots)
    rest = torch.ones(SIZE + PAGE, dtype=torch.bool)
    rest[loc] = False
    for b, ref in zip(kv_bufs, kv_before):
        assert torch.equal(b[loc], ref[loc]) and not b[rest].any()
    for t, ref in zip(state, state_before):
        assert torch.equal(t[:, slots], ref[:, slots])
    with pytest.raises(ValueError, match=r"cache_cpu must be the \(kv_cpu, mamba_cpu\) pair"):
        pool.load_cpu_copy(cpu[0], loc)


# -- bad input -----------------------------------------------------------------------------
def test_bad_construction_and_calls():
    with pytest.raises(ValueError, match=r"enable_kvcache_transpose=True is not supported"):
        make(enable_kvcache_transpose=True)
    with pytest.raises(TypeError, match=r"mamba_pool must be a MambaPool, got dict"):
        make(mamba={"not": "a pool"})
    with pytest.raises(ValueError, match=r"full_attention_layer_ids \[1, 2\] and mamba layers \[0, 2, 4\] share \[2\]"):
        make(full=[1, 2])
    with pytest.raises(ValueError, match=r"full_attention_layer_ids must be distinct, got \[1, 1\]"):
        make(full=[1, 1])
    with pytest.raises(ValueError, match=r"must be a non-empty list of layer ids >= 0, got \[\]"):
        make(full=[])
    with pytest.raises(ValueError, match=r"use_mla needs kv_lora_rank and qk_rope_head_dim, got None and None"):
        HybridLinearKVPool(SIZE, torch.bfloat16, PAGE, HEADS, HEAD_DIM, FULL, False, "cpu", make_mamba(), use_mla=True)
    pool = make()
    with pytest.raises(ValueError, match=r"set_mla_kv_buffer needs an MLA pool \(use_mla=True\), got use_mla=False"):
        pool.set_mla_kv_buffer(1, torch.tensor([4]), torch.randn(1, 1, RANK), torch.randn(1, 1, ROPE))
    with pytest.raises(ValueError, match=r"get_mla_kv_buffer needs an MLA pool"):
        pool.get_mla_kv_buffer(1, torch.tensor([4]))
    with pytest.raises(TypeError, match=r"layer must be an int or have an int layer_id, got NoneType"):
        pool.set_kv_buffer(None, torch.tensor([4]), torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, HEADS, HEAD_DIM))


def test_move_kv_cache_delegates():
    pool = make()
    loc = torch.tensor([4, 5])
    pool.set_kv_buffer(3, loc, torch.randn(2, HEADS, HEAD_DIM), torch.randn(2, HEADS, HEAD_DIM))
    ref = pool.full_kv_pool.k_buffer[1][loc].clone()
    pool.move_kv_cache(torch.tensor([20, 21]), loc)
    assert torch.equal(pool.full_kv_pool.k_buffer[1][20:22], ref)
    with pytest.raises(NotImplementedError, match=r"MLATokenToKVPool has no move_kv_cache"):
        make(use_mla=True).move_kv_cache(torch.tensor([20]), torch.tensor([4]))


# -- CUDA ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("use_mla", [False, True])
def test_cuda_mapping_and_exports(use_mla):
    pool = make(use_mla, device="cuda")
    loc = torch.tensor([4, 9], device="cuda")
    if use_mla:
        nope, rope = torch.randn(2, 1, RANK, device="cuda"), torch.randn(2, 1, ROPE, device="cuda")
        pool.set_mla_kv_buffer(Layer(5), loc, nope, rope)
        assert torch.equal(pool.get_mla_kv_buffer(5, loc)[0], nope.bfloat16())
        bufs = pool.full_kv_pool.kv_buffer
    else:
        k = torch.randn(2, HEADS, HEAD_DIM, device="cuda")
        pool.set_kv_buffer(Layer(5), loc, k, k)
        assert torch.equal(pool.get_key_buffer(5)[loc], k.bfloat16())
        bufs = pool.full_kv_pool.k_buffer + pool.full_kv_pool.v_buffer
    assert pool.get_contiguous_buf_infos()[0] == [b.data_ptr() for b in bufs] and all(b.is_cuda for b in bufs)
    assert pool.get_state_buf_infos() == pool.mamba_pool.get_contiguous_buf_infos()
    with pytest.raises(KeyError, match=r"layer 0 is not a full-attention layer"):
        pool.get_key_buffer(0)
