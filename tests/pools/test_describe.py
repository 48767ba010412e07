"""pools.describe: every pool's transfer_layout() agrees with its own layout exports."""

import pytest
import torch

from pools import (Export, HybridLinearKVPool, HybridReqToTokenPool, KVKind, MambaPool, MambaStateParams,
                   MHATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPool, MLATokenToKVPoolFP4, NoOpMHATokenToKVPool,
                   NSATokenToKVPool, ShardRule, StateKind, TensorLayout)


def mamba(layers=(1, 2)):
    params = MambaStateParams(conv_shapes=((48, 3), (16, 2)), temporal_shape=(4, 4, 16), layers=layers)
    return MambaPool(size=5, spec_state_size=0, cache_params=params)


def hybrid(use_mla=False):
    kw = dict(use_mla=True, kv_lora_rank=64, qk_rope_head_dim=32) if use_mla else {}
    return HybridLinearKVPool(size=32, dtype=torch.bfloat16, page_size=4, head_num=2, head_dim=64,
                              full_attention_layer_ids=[0, 3, 5], enable_kvcache_transpose=False, device="cpu",
                              mamba_pool=mamba(), **kw)


POOLS = {
    "mha bf16": lambda: MHATokenToKVPool(40, 8, torch.bfloat16, 2, 64, 3, "cpu", v_head_dim=32, start_layer=4),
    "mha fp8": lambda: MHATokenToKVPool(40, 8, torch.float8_e4m3fn, 2, 64, 3, "cpu"),
    "mha noop": lambda: NoOpMHATokenToKVPool(40, 8, torch.bfloat16, 2, 64, 3, "cpu"),
    "mha fp4": lambda: MHATokenToKVPoolFP4(40, 8, torch.uint8, 2, 64, 3, "cpu"),
    "mla bf16": lambda: MLATokenToKVPool(64, 16, torch.bfloat16, 512, 64, 2, "cpu", start_layer=1),
    "mla fp4": lambda: MLATokenToKVPoolFP4(64, 16, torch.float4_e2m1fn_x2, 512, 64, 2, "cpu"),
    "nsa fp8": lambda: NSATokenToKVPool(128, 64, 512, torch.float8_e4m3fn, 64, 2, "cpu", index_head_dim=128,
                                        enable_memory_saver=False, kv_cache_dim=656),
    "hybrid mha": hybrid,
    "hybrid mla": lambda: hybrid(use_mla=True),
    "mamba": mamba,
    "req mamba": lambda: HybridReqToTokenPool(size=4, mamba_size=4, mamba_spec_state_size=0, max_context_len=8,
                                              cache_params=mamba().cache_params, mamba_layer_ids=[7, 9]),
}


def check_part(pool, part):
    """The export the part names lists one buffer per tensor kind and layer, each an
    item_len of one page (or slot) of the described rows and a data_len of all of them."""
    _, lens, items = getattr(pool, part.export.value)()
    num_layers = len(part.layer_ids)
    kinds = sorted({t.export_index for t in part.tensors})
    assert kinds == list(range(len(kinds))) and len(items) == len(lens) == len(kinds) * num_layers
    for t in part.tensors:
        page = t.page_bytes if t.page_bytes is not None else part.page_size * t.row_bytes
        for j in range(num_layers):
            b = t.export_index * num_layers + j
            assert items[b] == page, (t.name, j)
            assert lens[b] == part.num_slots // part.page_size * page + part.num_slots % part.page_size * t.row_bytes
    sections = [t for t in part.tensors if t.page_bytes is not None]
    if sections:  # sections tile the page, in order
        ends = [t.section_start + part.page_size * t.row_bytes for t in sections]
        assert [t.section_start for t in sections] == [0] + ends[:-1] and ends[-1] == sections[0].page_bytes


@pytest.mark.parametrize("name", sorted(POOLS))
def test_description_matches_exports(name):
    pool = POOLS[name]()
    desc = pool.transfer_layout()
    assert desc.kv is not None or desc.state is not None
    for part in (desc.kv, desc.state):
        if part is not None:
            check_part(pool, part)
    if desc.state is not None and desc.state.kind is StateKind.MAMBA:
        dims = pool.get_state_dim_per_tensor()
        assert list(desc.state.dims) == dims[:: len(desc.state.layer_ids)]
    assert pool.transfer_layout() == desc  # plain data: equal each time


def test_what_each_kind_says():
    mha = POOLS["mha bf16"]().transfer_layout().kv
    assert (mha.kind, mha.layer_ids, mha.num_slots, mha.dtype) == (KVKind.MHA, (4, 5, 6), 48, "bfloat16")
    assert mha.tensors == (TensorLayout("k", 0, ShardRule.HEADS, 2, 128), TensorLayout("v", 1, ShardRule.HEADS, 2, 64))
    fp4 = POOLS["mha fp4"]().transfer_layout().kv
    assert [(t.name, t.unit_bytes) for t in fp4.tensors] == [("k", 32), ("v", 32), ("k_scale", 4), ("v_scale", 4)]
    nsa = POOLS["nsa fp8"]().transfer_layout()
    assert nsa.kv.kind is KVKind.NSA and nsa.kv.tensors[0].shard is ShardRule.REPLICATED
    assert (nsa.state.kind, nsa.state.export, nsa.state.dims) == (StateKind.NSA_INDEX, Export.STATE, (128,))
    hyb = POOLS["hybrid mha"]().transfer_layout()
    assert hyb.kv.layer_ids == (0, 3, 5) and hyb.state.export is Export.STATE and hyb.state.layer_ids == (1, 2)
    assert [t.model_sub_blocks for t in hyb.state.tensors] == [True, True, False]
    assert POOLS["mamba"]().transfer_layout().kv is None
    assert POOLS["req mamba"]().transfer_layout().state.layer_ids == (7, 9)


def test_bad_description():
    with pytest.raises(ValueError, match=r"TensorLayout 'k'.units must be a positive int, got 0"):
        TensorLayout("k", 0, ShardRule.HEADS, 0, 128)
    with pytest.raises(TypeError, match=r"TensorLayout 'k'.shard must be a ShardRule, got str"):
        TensorLayout("k", 0, "heads", 2, 128)
