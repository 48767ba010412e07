"""MambaPool: layout, exports, slot bookkeeping, copies. References are built from the tensors
and params independently of the pool's own export code."""

import math
import random

import pytest
import torch

from pools.mamba import MambaPool, MambaSpeculativeState, MambaState, MambaStateParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

LAYERS = (1, 4, 6)  # non-contiguous global ids: exercises the id -> index mapping


def make_params(conv_dtype=torch.bfloat16, temporal_dtype=torch.float32):
    # two conv tensors of different widths so the export order is observable
    return MambaStateParams(
        conv_shapes=((12, 3), (8, 3)), temporal_shape=(4, 5, 6), layers=LAYERS,
        conv_dtype=conv_dtype, temporal_dtype=temporal_dtype,
    )


def make_pool(device="cpu", size=6, draft=None, spec_size=3):
    return MambaPool(
        size=size, spec_state_size=spec_size, cache_params=make_params(), mamba_layer_ids=LAYERS,
        device=device, speculative_num_draft_tokens=draft,
    )


def fill_random(pool, seed=0):
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.mamba_cache.conv, pool.mamba_cache.temporal]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def states(pool):
    return [*pool.mamba_cache.conv, pool.mamba_cache.temporal]


# -- params ------------------------------------------------------------------------
def test_mamba2_params_match_formula():
    # n_groups divisible by tp: groups are split as they are
    p = MambaStateParams.mamba2(
        tp_world_size=2, intermediate_size=64, n_groups=4, num_heads=8, head_dim=16,
        state_size=8, conv_kernel=4, layers=[0, 2],
    )
    assert p.conv_shapes == (((64 + 2 * 4 * 8) // 2, 3),)
    assert p.temporal_shape == (4, 16, 8)
    # one group, tp 4: the group is replicated to every rank
    q = MambaStateParams.mamba2(
        tp_world_size=4, intermediate_size=64, n_groups=1, num_heads=8, head_dim=16,
        state_size=8, conv_kernel=4, layers=[0],
    )
    assert q.conv_shapes == (((64 + 2 * 4 * 8) // 4, 3),)
    assert q.temporal_shape == (2, 16, 8)


def test_bytes_per_slot_matches_tensors():
    pool = make_pool()
    assert pool.cache_params.bytes_per_slot == sum(t[:, 1].nbytes for t in states(pool))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(conv_shapes=(), temporal_shape=(1, 2, 3), layers=(0,)), ValueError, "conv_shapes"),
        (dict(conv_shapes=((4, 3, 1),), temporal_shape=(1, 2, 3), layers=(0,)), ValueError, r"conv_shapes\[0\] must be 2"),
        (dict(conv_shapes=((4, 3),), temporal_shape=(1, 2), layers=(0,)), ValueError, "temporal_shape must be 3"),
        (dict(conv_shapes=((4, 0),), temporal_shape=(1, 2, 3), layers=(0,)), ValueError, "positive"),
        (dict(conv_shapes=((4, 3),), temporal_shape=(1, 2, 3), layers=(0, 0)), ValueError, "distinct"),
        (dict(conv_shapes=((4, 3),), temporal_shape=(1, 2, 3), layers=()), ValueError, "non-empty"),
        (dict(conv_shapes=((4, 3),), temporal_shape=(1, 2.0, 3), layers=(0,)), TypeError, "ints"),
        (dict(conv_shapes=((4, 3),), temporal_shape=(1, 2, 3), layers=(0,), conv_dtype="bf16"), TypeError, "conv_dtype"),
    ],
)
def test_params_reject_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MambaStateParams(**kwargs)


def test_mamba2_params_reject_indivisible_heads():
    with pytest.raises(ValueError, match="num_heads=6 must be divisible by tp_world_size=4"):
        MambaStateParams.mamba2(
            tp_world_size=4, intermediate_size=64, n_groups=4, num_heads=6, head_dim=8,
            state_size=8, conv_kernel=4, layers=[0],
        )


# -- layout ------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", [None, 2])
def test_shapes_dtypes_bytes(device, draft):
    pool = make_pool(device, size=6, draft=draft, spec_size=3)
    p = pool.cache_params
    L = len(LAYERS)
    cache = pool.mamba_cache
    assert [tuple(t.shape) for t in cache.conv] == [(L, 7) + s for s in p.conv_shapes]
    assert tuple(cache.temporal.shape) == (L, 7) + p.temporal_shape
    assert all(t.dtype == torch.bfloat16 for t in cache.conv) and cache.temporal.dtype == torch.float32
    assert all(t.device.type == device for t in states(pool))
    expect = L * 7 * (sum(math.prod(s) for s in p.conv_shapes) * 2 + math.prod(p.temporal_shape) * 4)
    if draft is None:
        assert type(cache) is MambaState
    else:
        assert isinstance(cache, MambaSpeculativeState)
        assert tuple(cache.intermediate_ssm.shape) == (L, 4, draft) + p.temporal_shape
        assert [tuple(t.shape) for t in cache.intermediate_conv_window] == [(L, 4, draft) + s for s in p.conv_shapes]
        assert cache.intermediate_ssm.device.type == device
        expect += L * 4 * draft * (sum(math.prod(s) for s in p.conv_shapes) * 2 + math.prod(p.temporal_shape) * 4)
    assert cache.mem_usage_bytes() == expect
    assert pool.mem_usage == pytest.approx(expect / (1 << 30))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", [None, 2])
def test_exports_match_tensors(device, draft):
    pool = make_pool(device, draft=draft)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    dims = pool.get_state_dim_per_tensor()
    # contract order: conv[0] per layer, conv[1] per layer, temporal per layer
    expected = [(t, l) for t in states(pool) for l in range(len(LAYERS))]
    assert len(ptrs) == len(lens) == len(items) == len(dims) == len(expected) == 3 * len(LAYERS)
    for (t, l), ptr, n, item, dim in zip(expected, ptrs, lens, items, dims):
        assert ptr == t[l].data_ptr()
        assert n == t[l].numel() * t.element_size()
        assert item * (pool.size + 1) == n
        assert dim == t.shape[2]
        for slot in (0, 1, pool.size):  # slot s of the layer starts at ptr + s * item
            assert t[l, slot].data_ptr() == ptr + slot * item
    if draft is not None:  # speculative intermediates are never exported
        spec = [pool.mamba_cache.intermediate_ssm, *pool.mamba_cache.intermediate_conv_window]
        ranges = [(s.data_ptr(), s.data_ptr() + s.nbytes) for s in spec]
        assert not any(lo <= p < hi for p in ptrs for lo, hi in ranges)


def test_layer_cache_views_by_global_id():
    pool = make_pool(draft=2)
    fill_random(pool)
    for local, layer_id in enumerate(LAYERS):
        st = pool.mamba2_layer_cache(layer_id)
        assert isinstance(st, MambaSpeculativeState)
        assert st.temporal.data_ptr() == pool.mamba_cache.temporal[local].data_ptr()
        assert [c.data_ptr() for c in st.conv] == [c[local].data_ptr() for c in pool.mamba_cache.conv]
        assert st.intermediate_ssm.data_ptr() == pool.mamba_cache.intermediate_ssm[local].data_ptr()
        assert torch.equal(st.temporal, pool.mamba_cache.temporal[local])


@pytest.mark.parametrize("bad", [0, 2, 7, "1", True])
def test_layer_cache_rejects_other_layers(bad):
    pool = make_pool()
    with pytest.raises(KeyError, match=r"not a mamba layer.*\[1, 4, 6\]"):
        pool.mamba2_layer_cache(bad)


def test_speculative_params_need_speculative_pool():
    assert make_pool(draft=2).get_speculative_mamba2_params_all_layers() is not None
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        make_pool().get_speculative_mamba2_params_all_layers()


def test_constructor_rejects_bad_input():
    with pytest.raises(TypeError, match="MambaStateParams"):
        MambaPool(size=4, spec_state_size=1, cache_params=object(), mamba_layer_ids=[0])
    with pytest.raises(ValueError, match="size must be a positive int"):
        MambaPool(size=0, spec_state_size=1, cache_params=make_params(), mamba_layer_ids=LAYERS)
    with pytest.raises(ValueError, match="spec_state_size"):
        MambaPool(size=2, spec_state_size=0, cache_params=make_params(), speculative_num_draft_tokens=2)


def test_layer_ids_default_to_params():
    pool = MambaPool(size=2, spec_state_size=1, cache_params=make_params())
    assert pool.mamba_layer_ids == LAYERS and pool.num_mamba_layers == 3


# -- slots -------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_alloc_free_random_sequence(device):
    pool = make_pool(device, size=9)
    rng = random.Random(1)
    held: list[int] = []
    for _ in range(300):
        if rng.random() < 0.55:
            n = rng.randint(0, 4)
            got = pool.alloc(n)
            if n > pool.size - len(held):
                assert got is None
            else:
                assert got.dtype == torch.int64 and got.device.type == device and got.numel() == n
                got = got.tolist()
                assert 0 not in got and not set(got) & set(held) and len(set(got)) == n
                held += got
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free(torch.tensor(held[:k], device=device))
            held = held[k:]
        assert pool.available_size() == pool.size - len(held)
        free = pool.free_slots.tolist()
        assert sorted(free + held) == list(range(1, pool.size + 1))
    pool.clear()
    assert pool.available_size() == pool.size
    assert sorted(pool.alloc(pool.size).tolist()) == list(range(1, pool.size + 1))
    assert pool.alloc(1) is None


def test_alloc_zeroes_state():
    pool = make_pool(size=3)
    slots = pool.alloc(3)
    fill_random(pool)
    pool.free(slots[:2])
    again = pool.alloc(2)
    for t in states(pool):
        assert not t[:, again].any()
        assert t[:, slots[2]].any()  # a slot still held keeps its state


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([0], ValueError, "padding slot 0"),
        ([7], ValueError, r"must lie in \[0, 7\)"),
        ([-1], ValueError, "must lie in"),
        ([2], ValueError, r"double free or foreign slot: slots \[2\]"),
        ([1, 1], ValueError, "holds a slot twice"),
        (torch.tensor([1.0]), TypeError, "integer tensor"),
    ],
)
def test_free_rejects_bad_slots(bad, exc, match):
    pool = make_pool(size=6)
    pool.alloc(1)  # slot 1 held, slot 2 never handed out
    before = pool.available_size()
    with pytest.raises(exc, match=match):
        pool.free(bad)
    assert pool.available_size() == before


def test_double_free():
    pool = make_pool()
    s = pool.alloc(2)
    pool.free(s)
    pool.free([])  # nothing to free is fine
    with pytest.raises(ValueError, match="double free"):
        pool.free(s[:1])


def test_alloc_rejects_bad_size():
    pool = make_pool()
    with pytest.raises(ValueError, match="need_size must be >= 0"):
        pool.alloc(-1)
    with pytest.raises(TypeError, match="need_size must be an int"):
        pool.alloc(1.0)


# -- copies ------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_copy_from_and_fork_from(device):
    pool = make_pool(device, size=6)
    slots = pool.alloc(4)
    fill_random(pool, seed=3)
    ref = [t.clone() for t in states(pool)]
    src, dst = slots[:2], slots[2:]
    pool.copy_from(src, dst)
    for t, r in zip(states(pool), ref):
        expect = r.clone()
        expect[:, dst] = r[:, src]
        assert torch.equal(t, expect)
    forked = pool.fork_from(slots[0])
    assert forked.numel() == 1 and int(forked) not in slots.tolist()
    for t in states(pool):
        assert torch.equal(t[:, forked[0]], t[:, slots[0]])
    pool.alloc(pool.available_size())
    assert pool.fork_from(slots[0]) is None


def test_copy_from_rejects_bad_input():
    pool = make_pool()
    with pytest.raises(ValueError, match="same length"):
        pool.copy_from([1, 2], [3])
    with pytest.raises(ValueError, match="dst_index must lie in"):
        pool.copy_from([1], [99])
    with pytest.raises(ValueError, match="one source slot"):
        pool.fork_from([1, 2])


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_copy_round_trip(device):
    pool = make_pool(device, size=6)
    slots = pool.alloc(5)
    fill_random(pool, seed=5)
    src = slots[[0, 3]]
    conv_cpu, temporal_cpu = pool.get_cpu_copy(src)
    assert all(c.device.type == "cpu" for c in conv_cpu) and temporal_cpu.device.type == "cpu"
    for c, t in zip([*conv_cpu, temporal_cpu], states(pool)):
        assert torch.equal(c, t[:, src].cpu())
    ref = [t.clone() for t in states(pool)]
    dst = slots[[1, 4]]
    pool.load_cpu_copy((conv_cpu, temporal_cpu), dst)
    for t, r in zip(states(pool), ref):
        expect = r.clone()
        expect[:, dst] = r[:, src]
        assert torch.equal(t, expect)


def test_load_cpu_copy_rejects_mismatch():
    pool = make_pool()
    conv_cpu, temporal_cpu = pool.get_cpu_copy([1, 2])
    with pytest.raises(ValueError, match=r"conv\[0\] must have shape \[3, 1, 12, 3\], got \[3, 2, 12, 3\]"):
        pool.load_cpu_copy((conv_cpu, temporal_cpu), [1])
    with pytest.raises(ValueError, match=r"temporal must have shape \[3, 1, 4, 5, 6\], got \[3, 2, 4, 5, 6\]"):
        pool.load_cpu_copy(([c[:, :1] for c in conv_cpu], temporal_cpu), [1])
    with pytest.raises(TypeError, match=r"conv\[0\] must have dtype torch.bfloat16"):
        pool.load_cpu_copy(([conv_cpu[0].float(), conv_cpu[1]], temporal_cpu), [1, 2])
    with pytest.raises(ValueError, match="list of 2 tensors"):
        pool.load_cpu_copy((conv_cpu[:1], temporal_cpu), [1, 2])
    with pytest.raises(TypeError, match="pair"):
        pool.load_cpu_copy(temporal_cpu, [1, 2])
