"""RankLayout: builders, msgpack round trip, compatibility errors, and from_pools on the real
pools — including real-pool transfers copied through the exported pointers."""

import ctypes

import numpy as np
import pytest
import torch

from kvtransfer.layout import KVKind, LayoutMismatch, RankLayout, ShardRule, StateKind, dtype_itemsize
from kvtransfer.plan import plan_kv_transfer, plan_state_transfer, senders_for
from pools.hybrid_linear import HybridLinearKVPool
from pools.mamba import MambaPool, MambaStateParams
from pools.mha import MHATokenToKVPool, MHATokenToKVPoolFP4
from pools.mla import MLATokenToKVPool, MLATokenToKVPoolFP4
from pools.nsa import NSATokenToKVPool
from pools.req_to_token import HybridReqToTokenPool


def exported(infos):
    """The exported buffers as writable uint8 numpy views (the transport's view of them)."""
    ptrs, lens, _ = infos
    return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p)) for p, n in zip(ptrs, lens)]


def copy_plan(plan, src_bufs, dst_bufs):
    for sb, so, db, do, ln in zip(*plan.flatten()):
        dst_bufs[db][do: do + ln] = src_bufs[sb][so: so + ln]


def mha(tp, heads, page_size=16, cls=MHATokenToKVPool, dtype=torch.bfloat16, head_dim=64, layers=2, size=96):
    return cls(size=size, page_size=page_size, dtype=dtype, head_num=max(1, heads // tp), head_dim=head_dim,
               layer_num=layers, device="cpu", start_layer=5)


def mamba(tp, size=4, layers=(1, 2)):
    params = MambaStateParams(conv_shapes=((96 // tp, 3),), temporal_shape=(8 // tp, 4, 16), layers=layers)
    return MambaPool(size=size, spec_state_size=0, cache_params=params)


# -- from_pools --------------------------------------------------------------------------
@pytest.mark.parametrize("cls,dtype,kind,nbuf", [
    (MHATokenToKVPool, torch.bfloat16, KVKind.MHA, 4),
    (MHATokenToKVPool, torch.float8_e4m3fn, KVKind.MHA, 4),
    (MHATokenToKVPoolFP4, torch.bfloat16, KVKind.MHA_FP4, 8),
])
def test_from_pools_mha(cls, dtype, kind, nbuf):
    pool = mha(2, 8, cls=cls, dtype=dtype)
    lay = RankLayout.from_pools(pool, tp_rank=1, tp_size=2)
    assert (lay.kind, lay.total_heads, lay.layer_ids, lay.page_size) == (kind, 8, (5, 6), 16)
    assert lay.num_kv_buffers == nbuf == len(pool.get_contiguous_buf_infos()[0])
    assert lay.num_slots == 96 + 16 and lay.dtype == str(dtype).removeprefix("torch.")
    _, _, items = pool.get_contiguous_buf_infos()
    assert [s.page_bytes for s in lay.kv_tensors] == items[::2]
    assert RankLayout.from_msgpack(lay.to_msgpack()) == lay


def test_the_layout_speaks_the_pools_enums():
    """One enum per concept: a layout's kinds are the ones the pools describe themselves with."""
    import pools.describe as described

    assert (KVKind, ShardRule, StateKind) == (described.KVKind, described.ShardRule, described.StateKind)
    with pytest.raises(ValueError, match="StateLayout.kind must be a StateKind other than NONE, got <StateKind.NONE"):
        described.StateLayout(StateKind.NONE, described.Export.STATE, (0,), 1, 4, (1,), ())


def test_from_pools_replicated_heads_needs_total():
    pool = mha(8, 2)  # 2 KV heads at TP 8: one head per rank
    with pytest.raises(LayoutMismatch, match="pool holds 1 heads, but 16 total KV heads at TP 8 give 2 per rank"):
        RankLayout.from_pools(pool, tp_rank=3, tp_size=8, total_kv_heads=16)
    lay = RankLayout.from_pools(pool, tp_rank=5, tp_size=8, total_kv_heads=2)
    assert lay.total_heads == 2 and lay.kv_tensors[0].pieces(5, 8) == [(128, 128, 0, 4)]  # rank 5 holds head 5 // 4


def test_from_pools_mla_nsa():
    mla = MLATokenToKVPool(size=64, page_size=16, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                           layer_num=3, device="cpu")
    lay = RankLayout.from_pools(mla, tp_rank=0, tp_size=4)
    assert (lay.kind, lay.head_dim, lay.kv_tensors[0].shard) == (KVKind.MLA, 576, ShardRule.REPLICATED)
    fp4 = MLATokenToKVPoolFP4(size=64, page_size=16, dtype=torch.float4_e2m1fn_x2, kv_lora_rank=512,
                              qk_rope_head_dim=64, layer_num=3, device="cpu")
    lay4 = RankLayout.from_pools(fp4, tp_rank=0, tp_size=1)
    assert lay4.kind is KVKind.MLA_FP4 and [s.row_bytes for s in lay4.kv_tensors] == [288, 36]
    nsa = NSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
                           layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False,
                           kv_cache_dim=656)
    layn = RankLayout.from_pools(nsa, tp_rank=1, tp_size=2)
    assert (layn.kind, layn.state_kind, layn.head_dim) == (KVKind.NSA, StateKind.NSA_INDEX, 656)
    assert layn.state_num_slots == nsa.num_index_pages * 64
    assert RankLayout.from_msgpack(layn.to_msgpack()) == layn


def test_from_pools_hybrid_and_req_pool():
    kv = HybridLinearKVPool(size=32, dtype=torch.bfloat16, page_size=1, head_num=2, head_dim=64,
                            full_attention_layer_ids=[0, 3], enable_kvcache_transpose=False, device="cpu",
                            mamba_pool=mamba(2))
    lay = RankLayout.from_pools(kv, tp_rank=0, tp_size=2, conv_shard_groups=[64, 16, 16])
    assert lay.is_hybrid and lay.layer_ids == (0, 3) and lay.state_layer_ids == (1, 2)
    assert lay.state_dims == (48, 4) and lay.conv_shard_groups == (((64, 1), (16, 1), (16, 1)),)
    assert lay.num_state_buffers == len(kv.get_state_buf_infos()[0])
    req = HybridReqToTokenPool(size=4, mamba_size=4, mamba_spec_state_size=0, max_context_len=8,
                               cache_params=mamba(2).cache_params)
    lay2 = RankLayout.from_pools(kv.full_kv_pool, req, tp_rank=0, tp_size=2, conv_shard_groups=[64, 16, 16])
    assert lay2.state_tensors == lay.state_tensors
    assert RankLayout.from_msgpack(lay.to_msgpack()) == lay
    with pytest.raises(ValueError, match=r"groups \[\[64, 1\], \[16, 1\]\] \(units, size\) give 40 channels per rank "
                                         r"at TP 2, the pool's conv_dim is 48"):
        RankLayout.from_pools(kv, tp_rank=0, tp_size=2, conv_shard_groups=[64, 16])


# -- real pools, real bytes ------------------------------------------------------------
@pytest.mark.parametrize("p,d,heads,src_ps,dst_ps", [(2, 1, 4, 16, 1), (1, 4, 2, 1, 16), (4, 2, 8, 16, 64)])
@pytest.mark.parametrize("cls", [MHATokenToKVPool, MHATokenToKVPoolFP4])
def test_real_mha_pools_transfer(cls, p, d, heads, src_ps, dst_ps):
    torch.manual_seed(p * 10 + d)
    n = 40
    src_pools = [mha(p, heads, src_ps, cls) for _ in range(p)]
    dst_pools = [mha(d, heads, dst_ps, cls) for _ in range(d)]
    src_slots = torch.randperm(96)[:n] + src_ps  # page 0 is padding
    dst_slots = torch.randperm(96)[:n] + dst_ps
    full_k = torch.randn(2, n, heads, 64)
    full_v = torch.randn(2, n, heads, 64)

    def heads_of(rank, tp):
        return list(range(rank * heads // tp, (rank + 1) * heads // tp)) if tp <= heads else [rank // (tp // heads)]

    for r, pool in enumerate(src_pools):
        for layer in (5, 6):
            h = heads_of(r, p)
            pool.set_kv_buffer(layer, src_slots, full_k[layer - 5][:, h], full_v[layer - 5][:, h])
    src_lays = [RankLayout.from_pools(x, tp_rank=r, tp_size=p, total_kv_heads=heads) for r, x in enumerate(src_pools)]
    dst_lays = [RankLayout.from_pools(x, tp_rank=r, tp_size=d, total_kv_heads=heads) for r, x in enumerate(dst_pools)]
    for dr in range(d):
        dst_bufs = exported(dst_pools[dr].get_contiguous_buf_infos())
        for sr in senders_for(dst_lays[dr], p):
            plan = plan_kv_transfer(src_lays[sr], dst_lays[dr], src_slots.numpy(), dst_slots.numpy())
            copy_plan(plan, exported(src_pools[sr].get_contiguous_buf_infos()), dst_bufs)
    for dr, pool in enumerate(dst_pools):
        h = heads_of(dr, d)
        for layer in (5, 6):
            ref = cls(size=n, page_size=1, dtype=torch.bfloat16, head_num=len(h), head_dim=64, layer_num=2,
                      device="cpu", start_layer=5)  # the expected shard, written and read back the same way
            ref.set_kv_buffer(layer, torch.arange(1, n + 1), full_k[layer - 5][:, h], full_v[layer - 5][:, h])
            torch.testing.assert_close(pool.get_key_buffer(layer)[dst_slots], ref.get_key_buffer(layer)[1:],
                                       rtol=0, atol=0)
            torch.testing.assert_close(pool.get_value_buffer(layer)[dst_slots], ref.get_value_buffer(layer)[1:],
                                       rtol=0, atol=0)


def mamba2(tp, n_groups, size=4, layers=(1, 2)):
    params = MambaStateParams.mamba2(tp_world_size=tp, intermediate_size=64, n_groups=n_groups, num_heads=8,
                                     head_dim=4, state_size=8, conv_kernel=4, layers=layers)
    return MambaPool(size=size, spec_state_size=0, cache_params=params)


@pytest.mark.parametrize("n_groups", [None, 1, 2])
@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 4), (4, 1)])
def test_real_mamba_state_transfer(p, d, n_groups):
    """Real MambaPools; ``n_groups`` None: conv [x | B | C] = [64 | 16 | 16] split evenly;
    else Mamba2 (``MambaStateParams.mamba2``) whose B, C groups replicate when TP > n_groups."""
    torch.manual_seed(p + d)
    if n_groups is None:
        groups, make = [64, 16, 16], mamba
    else:
        groups, make = [64, (n_groups, 8), (n_groups, 8)], lambda tp: mamba2(tp, n_groups)  # noqa: E731
    blocks = [(g, 1) if isinstance(g, int) else g for g in groups]
    conv = torch.randn(2, sum(n * c for n, c in blocks), 3).to(torch.bfloat16)  # [layers, conv_dim, K-1]
    temporal = torch.randn(2, 8, 4, 16 if n_groups is None else 8)  # [layers, heads, head_dim, state]

    def conv_shard(rank, tp):
        idx, start = [], 0
        for n, c in blocks:
            units = range(rank * n // tp, (rank + 1) * n // tp) if tp <= n else [rank // (tp // n)]
            idx += [start + u * c + i for u in units for i in range(c)]
            start += n * c
        return conv[:, idx]

    src_pools, dst_pools = [make(p) for _ in range(p)], [make(d) for _ in range(d)]
    for r, pool in enumerate(src_pools):
        pool.mamba_cache.conv[0][:, 3] = conv_shard(r, p)
        pool.mamba_cache.temporal[:, 3] = temporal[:, r * 8 // p: (r + 1) * 8 // p]
    lay = lambda x, r, tp: RankLayout.from_pools(  # noqa: E731
        mha(tp, 8), x, tp_rank=r, tp_size=tp, conv_shard_groups=groups)
    for dr, dpool in enumerate(dst_pools):
        dst_lay = lay(dpool, dr, d)
        for sr in senders_for(dst_lay, p):
            plan = plan_state_transfer(lay(src_pools[sr], sr, p), dst_lay, 3, 1)
            copy_plan(plan, exported(src_pools[sr].get_contiguous_buf_infos()),
                      exported(dpool.get_contiguous_buf_infos()))
        torch.testing.assert_close(dpool.mamba_cache.conv[0][:, 1], conv_shard(dr, d), rtol=0, atol=0)
        torch.testing.assert_close(dpool.mamba_cache.temporal[:, 1], temporal[:, dr * 8 // d: (dr + 1) * 8 // d],
                                   rtol=0, atol=0)


# -- wire and checks -------------------------------------------------------------------
def test_msgpack_errors():
    lay = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=1, page_size=1, layer_ids=[0], dtype="bfloat16",
                               head_dim=64, total_heads=1, num_slots=8)
    with pytest.raises(LayoutMismatch, match="not valid msgpack"):
        RankLayout.from_msgpack(b"\xc1")
    import msgpack

    with pytest.raises(LayoutMismatch, match="layout version must be 1, got 7"):
        RankLayout.from_msgpack(msgpack.packb({"version": 7, "layout": {}}))
    body = msgpack.unpackb(lay.to_msgpack())
    del body["layout"]["dtype"]
    with pytest.raises(LayoutMismatch, match="layout fields must be"):
        RankLayout.from_msgpack(msgpack.packb(body))


def test_builder_errors():
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        dtype_itemsize("float7")
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        RankLayout.attention(KVKind.MLA, tp_rank=2, tp_size=2, page_size=1, layer_ids=[0], dtype="bfloat16",
                             head_dim=64, num_slots=8)
    with pytest.raises(ValueError, match="FP4 needs head_dim divisible by 32, got 48"):
        RankLayout.attention(KVKind.MHA_FP4, tp_rank=0, tp_size=1, page_size=1, layer_ids=[0], dtype="bfloat16",
                             head_dim=48, total_heads=2, num_slots=8)
    with pytest.raises(ValueError, match=r"layer_ids must be non-empty and distinct, got \[1, 1\]"):
        RankLayout.attention(KVKind.MLA, tp_rank=0, tp_size=1, page_size=1, layer_ids=[1, 1], dtype="bfloat16",
                             head_dim=64, num_slots=8)


# -- the sharding rule -----------------------------------------------------------------
def test_shard_units_splits_then_replicates():
    from kvtransfer.layout import UnitShard, shard_units

    assert [list(shard_units(8, r, 4).units) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {shard_units(8, r, 4).replicas for r in range(4)} == {1}
    assert [shard_units(2, r, 8) for r in (0, 3, 4, 7)] == [UnitShard(0, 1, 4), UnitShard(0, 1, 4),
                                                           UnitShard(1, 1, 4), UnitShard(1, 1, 4)]
    with pytest.raises(ValueError, match="6 units and TP size 4 must divide one another"):
        shard_units(6, 0, 4)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 4\), got 4"):
        shard_units(8, 4, 4)


# -- from_pools reads each pool's description --------------------------------------------
def _nsa(dtype=torch.float8_e4m3fn, kv_cache_dim=656):
    return NSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64, layer_num=2,
                            device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=kv_cache_dim)


def _hybrid(tp, use_mla=False):
    kw = dict(use_mla=True, kv_lora_rank=64, qk_rope_head_dim=32) if use_mla else {}
    return HybridLinearKVPool(size=32, dtype=torch.bfloat16, page_size=1, head_num=max(1, 8 // tp), head_dim=64,
                              full_attention_layer_ids=[0, 3, 5], enable_kvcache_transpose=False, device="cpu",
                              mamba_pool=mamba(tp), **kw)


def _attention(kind, tp, r, **kw):
    return RankLayout.attention(kind, tp_rank=r, tp_size=tp, **kw)


# (name, tp, pools, from_pools kwargs, the layout the explicit builders give for them)
ROUND_TRIPS = [
    ("mha bf16", 2, lambda: (mha(2, 8),), dict(),
     lambda r: _attention(KVKind.MHA, 2, r, page_size=16, layer_ids=[5, 6], dtype="bfloat16", head_dim=64,
                          total_heads=8, num_slots=112)),
    ("mha fp8 heads replicated", 8, lambda: (mha(8, 2, dtype=torch.float8_e4m3fn),), dict(total_kv_heads=2),
     lambda r: _attention(KVKind.MHA, 8, r, page_size=16, layer_ids=[5, 6], dtype="float8_e4m3fn", head_dim=64,
                          total_heads=2, num_slots=112)),
    ("mha fp4", 4, lambda: (mha(4, 8, page_size=1, cls=MHATokenToKVPoolFP4),), dict(),
     lambda r: _attention(KVKind.MHA_FP4, 4, r, page_size=1, layer_ids=[5, 6], dtype="bfloat16", head_dim=64,
                          total_heads=8, num_slots=97)),
    ("mla", 4, lambda: (MLATokenToKVPool(size=64, page_size=16, dtype=torch.bfloat16, kv_lora_rank=512,
                                         qk_rope_head_dim=64, layer_num=3, device="cpu", start_layer=2),), dict(),
     lambda r: _attention(KVKind.MLA, 4, r, page_size=16, layer_ids=[2, 3, 4], dtype="bfloat16", head_dim=576,
                          num_slots=80)),
    ("mla fp4", 2, lambda: (MLATokenToKVPoolFP4(size=64, page_size=16, dtype=torch.float4_e2m1fn_x2, kv_lora_rank=512,
                                                qk_rope_head_dim=64, layer_num=3, device="cpu"),), dict(),
     lambda r: _attention(KVKind.MLA_FP4, 2, r, page_size=16, layer_ids=[0, 1, 2], dtype="float4_e2m1fn_x2",
                          head_dim=576, num_slots=80)),
    ("nsa fp8", 2, lambda: (_nsa(),), dict(),
     lambda r: _attention(KVKind.NSA, 2, r, page_size=64, layer_ids=[0, 1], dtype="float8_e4m3fn", head_dim=656,
                          num_slots=192).with_nsa_index(index_head_dim=128, num_pages=_nsa().num_index_pages)),
    ("hybrid mha + mamba", 2, lambda: (_hybrid(2),), dict(conv_shard_groups=[64, 16, 16]),
     lambda r: _attention(KVKind.MHA, 2, r, page_size=1, layer_ids=[0, 3, 5], dtype="bfloat16", head_dim=64,
                          total_heads=8, num_slots=33).with_mamba(
         layer_ids=[1, 2], num_slots=5, conv_dims=[48], conv_unit_bytes=[6], temporal_heads=4,
         temporal_head_bytes=4 * 16 * 4, conv_shard_groups=[64, 16, 16])),
    ("hybrid mla + mamba", 1, lambda: (_hybrid(1, use_mla=True),), dict(),
     lambda r: _attention(KVKind.MLA, 1, r, page_size=1, layer_ids=[0, 3, 5], dtype="bfloat16", head_dim=96,
                          num_slots=33).with_mamba(
         layer_ids=[1, 2], num_slots=5, conv_dims=[96], conv_unit_bytes=[6], temporal_heads=8,
         temporal_head_bytes=4 * 16 * 4)),
    ("mha + req-to-token mamba2", 4,
     lambda: (mha(4, 8, page_size=1), HybridReqToTokenPool(size=4, mamba_size=4, mamba_spec_state_size=0,
                                                            max_context_len=8, cache_params=mamba2(4, 2).cache_params,
                                                            mamba_layer_ids=[7, 9])),
     dict(conv_shard_groups=[64, (2, 8), (2, 8)]),
     lambda r: _attention(KVKind.MHA, 4, r, page_size=1, layer_ids=[5, 6], dtype="bfloat16", head_dim=64,
                          total_heads=8, num_slots=97).with_mamba(
         layer_ids=[7, 9], num_slots=5, conv_dims=[32], conv_unit_bytes=[6], temporal_heads=2,
         temporal_head_bytes=4 * 8 * 4, conv_shard_groups=[64, (2, 8), (2, 8)])),
]


@pytest.mark.parametrize("name,tp,make,kw,built", ROUND_TRIPS, ids=[c[0] for c in ROUND_TRIPS])
def test_each_pool_description_gives_the_builders_layout(name, tp, make, kw, built):
    """What the pool says it holds builds the layout the explicit builders give (which the old
    attribute-guessing from_pools fed): on every rank, and through the wire."""
    for r in sorted({0, tp - 1}):
        lay = RankLayout.from_pools(*make(), tp_rank=r, tp_size=tp, **kw)
        assert lay == built(r)
        assert RankLayout.from_msgpack(lay.to_msgpack()) == lay


def test_export_that_disagrees_with_the_description_raises():
    pool = mha(2, 8)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    pool.get_contiguous_buf_infos = lambda: (ptrs, lens, items[:-1] + [items[-1] // 2])
    with pytest.raises(LayoutMismatch, match=r"get_contiguous_buf_infos item_len of buffer 3 \(v, layer position 1\) "
                                             r"is 4096, the pool's description gives 8192"):
        RankLayout.from_pools(pool, tp_rank=0, tp_size=2)
    pool.get_contiguous_buf_infos = lambda: (ptrs[:2], lens[:2], items[:2])
    with pytest.raises(LayoutMismatch, match="must list 4 buffers"):
        RankLayout.from_pools(pool, tp_rank=0, tp_size=2)
    nsa = _nsa()
    infos = nsa.get_state_buf_infos()
    nsa.get_state_buf_infos = lambda: (infos[0], [n - 1 for n in infos[1]], infos[2])
    with pytest.raises(LayoutMismatch, match=r"get_state_buf_infos data_len of buffer 0 \(index_k, layer position 0\)"):
        RankLayout.from_pools(nsa, tp_rank=0, tp_size=1)


def test_from_pools_needs_a_description():
    with pytest.raises(TypeError, match="kv_pool must describe its buffers with transfer_layout"):
        RankLayout.from_pools(object(), tp_rank=0, tp_size=1)
    with pytest.raises(TypeError, match="kv_pool must hold KV buffers; MambaPool"):
        RankLayout.from_pools(mamba(1), tp_rank=0, tp_size=1)
    with pytest.raises(TypeError, match="state_pool must hold state buffers; MHATokenToKVPool"):
        RankLayout.from_pools(mha(1, 8), mha(1, 8), tp_rank=0, tp_size=1)


def _wire(**kw):
    import msgpack

    lay = RankLayout.attention(KVKind.MHA, tp_rank=0, tp_size=2, page_size=4, layer_ids=[0, 1], dtype="bfloat16",
                               head_dim=64, total_heads=4, num_slots=64)
    body = msgpack.unpackb(lay.to_msgpack())
    return lay, body


@pytest.mark.parametrize("change", [
    lambda b: b.update(layout=[1, 2]),
    lambda b: b["layout"].update(kv_tensors=[{"name": "k"}]),
    lambda b: b["layout"].update(kv_tensors=[7]),
    lambda b: b["layout"].update(kind="no-such-kind"),
    lambda b: b["layout"].update(layer_ids=5),
    lambda b: b["layout"]["kv_tensors"][0].update(groups=5),
    lambda b: b["layout"]["kv_tensors"][0].update(groups=[[4]]),
    lambda b: b["layout"]["kv_tensors"][0].update(shard="diagonal"),
    lambda b: b["layout"].update(conv_shard_groups=[3]),
    lambda b: b["layout"].update(tp_size="2"),
])
def test_well_formed_msgpack_of_the_wrong_shape_is_a_layout_mismatch(change):
    import msgpack

    _, body = _wire()
    change(body)
    with pytest.raises(LayoutMismatch, match="wrong shape|must be|layout fields|layout message"):
        RankLayout.from_msgpack(msgpack.packb(body))


@pytest.mark.parametrize("field,value,match", [
    ("row_bytes", 1, r"k: row_bytes 1 contradicts its groups \[\[4, 1\]\] x unit_bytes 128 at TP 2 \(256\)"),
    ("unit_bytes", 64, r"row_bytes 256 contradicts its groups .* x unit_bytes 64 at TP 2 \(128\)"),
    ("groups", [[8, 1]], r"row_bytes 256 contradicts its groups \[\[8, 1\]\] x unit_bytes 128 at TP 2 \(512\)"),
    ("page_bytes", 512, r"4 rows of 256 B from byte 0 do not fit its page of 512 B"),
])
def test_a_decoded_layout_that_contradicts_itself_is_refused(field, value, match):
    """A peer layout whose row_bytes disagrees with its own unit_bytes/groups would plan
    every token to wrong offsets: refused when decoded."""
    import msgpack

    lay, body = _wire()
    assert lay.kv_tensors[0].row_bytes == 256  # 2 of 4 heads x 64 dims x 2 bytes
    for spec in body["layout"]["kv_tensors"]:
        spec[field] = value
    with pytest.raises(LayoutMismatch, match=match):
        RankLayout.from_msgpack(msgpack.packb(body))


def test_a_layouts_cached_hash_matches_its_fields_and_is_not_pickled():
    """The hash is computed once per object (plans are cached per layout pair) and equals a
    fresh equal layout's; a pickled copy (another process, another string hash seed) carries
    no cached value and hashes its own fields."""
    import pickle

    make = lambda rank: RankLayout.attention(KVKind.MHA, tp_rank=rank, tp_size=2, page_size=16,  # noqa: E731
                                             layer_ids=range(4), dtype="bfloat16", head_dim=128, num_slots=64,
                                             total_heads=8)
    a = make(0)
    assert hash(a) == hash(make(0)) and a == make(0) and hash(a) != hash(make(1))
    copy = pickle.loads(pickle.dumps(a))
    assert "_hash" not in copy.__dict__ and copy == a and hash(copy) == hash(a)
