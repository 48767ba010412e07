"""MHA / NoOp / FP4 token-to-KV pools: layout, exports, round trips, CPU copy, moves, errors."""

from types import SimpleNamespace

import pytest
import torch

from pools.fp4 import FP4_BLOCK, dequantize_fp4, quantize_fp4
from pools.kv_copy import MoveBackend
from pools.mha import MHATokenToKVPool, MHATokenToKVPoolFP4, NoOpMHATokenToKVPool
from tests.pools._support import Counter, reference_move

SIZE, PAGE, HEADS, DIM, LAYERS = 24, 4, 2, 16, 3
ROWS = SIZE + PAGE


def mha(dtype=torch.bfloat16, device="cpu", **kw):
    kw = {"start_layer": None, **kw}
    return MHATokenToKVPool(SIZE, PAGE, dtype, HEADS, DIM, LAYERS, device, **kw)


def fp4(device="cpu", **kw):
    return MHATokenToKVPoolFP4(SIZE, PAGE, torch.uint8, HEADS, DIM, LAYERS, device, **kw)


def rand(n, d=DIM, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, d, generator=g).to(device)


def expected_infos(buffers):
    return (
        [b.data_ptr() for b in buffers],
        [b.numel() * b.element_size() for b in buffers],
        [b[0].numel() * b.element_size() * PAGE for b in buffers],
    )


# -- layout ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,store", [(torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.uint8), (torch.float8_e5m2, torch.uint8)]
)
def test_shapes_dtypes_bytes(dtype, store):
    pool = mha(dtype, v_head_dim=8)
    assert pool.store_dtype == store
    assert len(pool.k_buffer) == len(pool.v_buffer) == LAYERS
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == (ROWS, HEADS, DIM) and v.shape == (ROWS, HEADS, 8)
        assert k.dtype == v.dtype == store
    item = torch.tensor([], dtype=store).element_size()
    assert pool.get_kv_size_bytes() == (LAYERS * ROWS * HEADS * DIM * item, LAYERS * ROWS * HEADS * 8 * item)
    assert pool.get_key_buffer(0).dtype == dtype and pool.get_value_buffer(2).shape == (ROWS, HEADS, 8)


def test_swa_head_shape_overrides():
    pool = mha(swa_head_num=4, swa_head_dim=8, swa_v_head_dim=4)
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (4, 8, 4)
    assert pool.k_buffer[0].shape == (ROWS, 4, 8) and pool.v_buffer[0].shape == (ROWS, 4, 4)


def test_exports_match_tensors_in_k_then_v_order():
    pool = mha(torch.float8_e4m3fn, v_head_dim=8)
    order = pool.k_buffer + pool.v_buffer
    assert pool.get_contiguous_buf_infos() == expected_infos(order)
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in order]
    assert pool.data_strides.tolist() == [b[0].numel() * b.element_size() for b in order]
    assert pool.k_data_ptrs.tolist() == [b.data_ptr() for b in pool.k_buffer]
    assert pool.v_data_ptrs.tolist() == [b.data_ptr() for b in pool.v_buffer]
    ptrs, lens, _ = pool.get_contiguous_buf_infos()
    spans = sorted(zip(ptrs, lens))
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # disjoint buffers


def test_fp4_shapes_and_export_order():
    pool = fp4()
    assert pool.store_dtype == torch.uint8
    for k, v, ks, vs in zip(pool.k_buffer, pool.v_buffer, pool.k_scale_buffer, pool.v_scale_buffer):
        assert k.shape == v.shape == (ROWS, HEADS, DIM // 2)
        assert ks.shape == vs.shape == (ROWS, HEADS * DIM // FP4_BLOCK)
        assert k.dtype == ks.dtype == torch.uint8
    order = pool.k_buffer + pool.v_buffer + pool.k_scale_buffer + pool.v_scale_buffer
    assert pool.get_contiguous_buf_infos() == expected_infos(order)
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in order]
    kv = LAYERS * ROWS * HEADS * DIM // 2
    sc = LAYERS * ROWS * HEADS * DIM // FP4_BLOCK
    assert pool.get_kv_size_bytes() == (kv + sc, kv + sc)


def test_noop_pool_is_placeholders():
    pool = NoOpMHATokenToKVPool(SIZE, PAGE, torch.bfloat16, HEADS, DIM, LAYERS, "cpu")
    assert pool.size == SIZE and pool.get_kv_size_bytes() == (0, 0) and pool.mem_usage == 0.0
    assert pool.get_key_buffer(0).shape == (PAGE, HEADS, DIM)
    k, v = pool.get_kv_buffer(1)
    assert k.shape == v.shape == (PAGE, HEADS, DIM)
    assert pool.get_contiguous_buf_infos() == expected_infos(pool.k_buffer + pool.v_buffer)
    with pytest.raises(RuntimeError, match="holds no KV cache"):
        pool.set_kv_buffer(0, torch.tensor([1]), rand(1), rand(1))
    before = [b.clone() for b in pool.k_buffer]
    pool.move_kv_cache(torch.tensor([1]), torch.tensor([2]))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer))


# -- set / get ---------------------------------------------------------------------------
def test_bf16_round_trip_and_casts():
    pool = mha(torch.bfloat16)
    loc = torch.tensor([1, 7, 20], dtype=torch.int32)
    k, v = rand(3, seed=1), rand(3, seed=2)
    k_in = k.clone()
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), loc, k, v, k_scale=2.0)
    assert torch.equal(k, k_in)  # the caller's tensor is not modified
    assert torch.equal(pool.get_key_buffer(1)[loc.long()], (k / 2.0).to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(1)[loc.long()], v.to(torch.bfloat16))
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_round_trip_against_torch_cast(dtype):
    pool = mha(dtype)
    loc = torch.tensor([3, 4, 5, 9])
    k, v = rand(4, seed=3) * 10, rand(4, seed=4)
    pool.set_kv_buffer(0, loc, k, v, k_scale=4.0, v_scale=0.5)
    want_k, want_v = (k / 4.0).to(dtype), (v / 0.5).to(dtype)
    got_k, got_v = pool.get_kv_buffer(0)
    assert got_k.dtype == dtype
    assert torch.equal(got_k[loc].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pool.v_buffer[0][loc], want_v.view(torch.uint8))
    # Already-fp8 input is stored as is (no scale applied).
    pool.set_kv_buffer(0, loc, want_v, want_k, k_scale=4.0)
    assert torch.equal(pool.k_buffer[0][loc], want_v.view(torch.uint8))


def test_layer_ids_with_start_layer_and_override():
    pool = MHATokenToKVPool(SIZE, PAGE, torch.float32, HEADS, DIM, 2, "cpu", start_layer=5, end_layer=6)
    k = rand(1, seed=5)
    pool.set_kv_buffer(SimpleNamespace(layer_id=0), torch.tensor([2]), k, k, layer_id_override=6)
    assert torch.equal(pool.k_buffer[1][2], k[0]) and pool.k_buffer[0].abs().sum() == 0
    assert torch.equal(pool.get_key_buffer(6)[2], k[0])
    with pytest.raises(KeyError, match="layer 4 is not held by this pool \\(layers 5..6\\)"):
        pool.get_key_buffer(4)
    with pytest.raises(KeyError, match="layer 7 is not held"):
        pool.set_kv_buffer(7, torch.tensor([2]), k, k)


def test_fp4_round_trip_within_bound():
    pool = fp4()
    loc = torch.tensor([2, 11, 27])
    k, v = rand(3, seed=6) * 3, rand(3, seed=7).to(torch.float16)
    pool.set_kv_buffer(1, loc, k, v, k_scale=3.0)
    ref_k = dequantize_fp4(*quantize_fp4((k / 3.0).reshape(3, HEADS * DIM))).reshape(3, HEADS, DIM)
    got_k = pool.get_key_buffer(1)
    assert got_k.shape == (ROWS, HEADS, DIM) and got_k.dtype == torch.bfloat16
    assert torch.equal(got_k[loc], ref_k)
    packed, scales = pool.get_fp4_value_buffer(1)
    want_packed, want_scales = quantize_fp4(v.reshape(3, HEADS * DIM))
    assert torch.equal(packed[loc].reshape(3, -1), want_packed) and torch.equal(scales[loc], want_scales)
    # Documented bound: |x - deq| <= max(S, |x|) / 4 per element.
    s = torch.exp2(scales[loc].float() - 127).repeat_interleave(FP4_BLOCK, -1).reshape(3, HEADS, DIM)  # UE8M0
    err = (pool.get_value_buffer(1)[loc].float() - v.float()).abs()
    assert bool((err <= torch.maximum(s, v.float().abs()) / 4 * (1 + 2.0**-20)).all())
    assert pool.get_key_buffer(0).abs().sum() == 0


def test_layer_counter_is_called_before_handing_out_buffers():
    for pool in (mha(start_layer=2), fp4(start_layer=2)):
        counter = Counter()
        pool.register_layer_transfer_counter(counter)
        pool.get_key_buffer(3)
        pool.get_value_buffer(4)
        pool.get_kv_buffer(2)
        assert counter.calls == [1, 2, 0, 0]  # local layer index, as the seed passes it
        if isinstance(pool, MHATokenToKVPoolFP4):
            pool.get_fp4_key_buffer(4)
            pool.get_fp4_value_buffer(3)
            assert counter.calls[-2:] == [2, 1]
        with pytest.raises(KeyError):
            pool.get_key_buffer(9)
        assert len(counter.calls) in (4, 6)  # no wait for a layer the pool lacks


# -- errors ------------------------------------------------------------------------------
def test_set_kv_buffer_rejects_bad_input():
    pool = mha(torch.bfloat16)
    loc = torch.tensor([1, 2])
    good = rand(2)
    with pytest.raises(ValueError, match="cache_k must have shape \\[2, 2, 16\\], got \\[3, 2, 16\\]"):
        pool.set_kv_buffer(0, loc, rand(3), good)
    with pytest.raises(ValueError, match="cache_v must have shape \\[2, 2, 16\\], got \\[2, 2, 8\\]"):
        pool.set_kv_buffer(0, loc, good, rand(2, d=8))
    with pytest.raises(TypeError, match="cache_k must have a floating-point dtype, got torch.int64"):
        pool.set_kv_buffer(0, loc, good.long(), good)
    with pytest.raises(ValueError, match="loc must lie in \\[0, 28\\), got values in \\[1, 28\\]"):
        pool.set_kv_buffer(0, torch.tensor([1, 28]), good, good)
    with pytest.raises(TypeError, match="loc must be an integer tensor, got dtype torch.float32"):
        pool.set_kv_buffer(0, torch.tensor([1.0, 2.0]), good, good)
    with pytest.raises(TypeError, match="loc must be a torch.Tensor, got list"):
        pool.set_kv_buffer(0, [1, 2], good, good)
    with pytest.raises(ValueError, match="cache_k must be on cpu, got meta"):
        pool.set_kv_buffer(0, loc, good.to("meta"), good)
    with pytest.raises(TypeError, match="layer must be an int or have an int layer_id, got str"):
        pool.set_kv_buffer("0", loc, good, good)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 to be quantized to FP4, got torch.float8_e4m3fn"):
        fp4().set_kv_buffer(0, loc, good.to(torch.float8_e4m3fn), good)


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ValueError, match="head_num must be a positive int, got 0"):
        MHATokenToKVPool(SIZE, PAGE, torch.bfloat16, 0, DIM, LAYERS, "cpu")
    with pytest.raises(ValueError, match="head_dim a multiple of 16, got 8"):
        MHATokenToKVPoolFP4(SIZE, PAGE, torch.uint8, HEADS, 8, LAYERS, "cpu")
    with pytest.raises(ValueError, match="v_head_dim == head_dim=16, got 32"):
        fp4(v_head_dim=32)


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fill_random(pool, seed=9):
    """Random bytes in every exported buffer (NaN patterns compare bytewise below)."""
    g = torch.Generator().manual_seed(seed)
    for buf in pool._export_buffers():
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(buf.device))


# -- CPU copy ----------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: mha(torch.float8_e4m3fn, v_head_dim=8), fp4])
def test_cpu_copy_round_trip_in_chunks(make):
    pool = make()
    pool.cpu_offloading_chunk_size = 3
    fill_random(pool, seed=8)
    src = torch.tensor([1, 5, 6, 9, 12, 13, 20])
    dst = torch.tensor([2, 3, 4, 25, 26, 27, 17])
    before = [b.clone() for b in pool._export_buffers()]
    cpu = pool.get_cpu_copy(src)
    groups = len(pool._layer_groups())
    assert len(cpu) == LAYERS and len(cpu[0]) == 3 and len(cpu[0][0]) == groups
    assert [c[0].shape[0] for c in cpu[0]] == [3, 3, 1]
    assert all(t.device.type == "cpu" for layer in cpu for c in layer for t in c)
    pool.load_cpu_copy(cpu, dst)
    for old, new in zip(before, pool._export_buffers()):
        want = old.clone()
        want[dst] = old[src]
        assert same_bytes(new, want)


def test_load_cpu_copy_rejects_bad_structure():
    pool = mha()
    pool.cpu_offloading_chunk_size = 2
    cpu = pool.get_cpu_copy(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="must be a list of 3 layers, got 2"):
        pool.load_cpu_copy(cpu[:2], torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="kv_cache_cpu\\[0\\] must hold 1 chunks, got 2"):
        pool.load_cpu_copy(cpu, torch.tensor([1, 2]))
    cpu[1][1][0] = cpu[1][1][0].float()
    with pytest.raises(TypeError, match="kv_cache_cpu\\[1\\]\\[1\\] must have dtype torch.bfloat16, got torch.float32"):
        pool.load_cpu_copy(cpu, torch.tensor([4, 5, 6]))


# -- move_kv_cache -----------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: mha(torch.bfloat16, v_head_dim=8), lambda: mha(torch.float8_e5m2), fp4])
def test_move_kv_cache_native(make):
    pool = make()
    fill_random(pool)
    tgt, src = torch.tensor([1, 2, 3, 20]), torch.tensor([2, 3, 4, 1])  # overlapping
    want = reference_move(pool._export_buffers(), tgt, src)
    pool.move_kv_cache(tgt, src)
    assert all(same_bytes(a, b) for a, b in zip(pool._export_buffers(), want))


@pytest.mark.parametrize("make", [lambda: mha(torch.float16, v_head_dim=8), fp4])
def test_move_kv_cache_triton_interpreted(monkeypatch, make):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    from pools import kv_copy

    assert isinstance(kv_copy.kernel_for_current_env(), InterpretedFunction)
    pool = make()
    fill_random(pool)
    tgt, src = torch.tensor([5, 6, 7, 22], dtype=torch.int32), torch.tensor([6, 7, 8, 1], dtype=torch.int32)
    want = reference_move(pool._export_buffers(), tgt, src)
    pool.move_kv_cache(tgt, src, backend=MoveBackend.TRITON)
    assert all(same_bytes(a, b) for a, b in zip(pool._export_buffers(), want))


def test_move_kv_cache_rejects_out_of_range():
    with pytest.raises(ValueError, match="tgt_loc must lie in \\[0, 28\\), got values in \\[28, 28\\]"):
        mha().move_kv_cache(torch.tensor([28]), torch.tensor([1]))


# -- CUDA --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda: mha(torch.bfloat16, device="cuda", enable_kv_cache_copy=True),
                                  lambda: mha(torch.float8_e4m3fn, device="cuda"),
                                  lambda: fp4(device="cuda")])
def test_cuda_pool_set_get_move_and_cpu_copy(make):
    pool = make()
    loc = torch.tensor([1, 9, 17], device="cuda")
    k, v = rand(3, seed=10, device="cuda"), rand(3, seed=11, device="cuda")
    pool.set_kv_buffer(2, loc, k, v)
    if isinstance(pool, MHATokenToKVPoolFP4):
        want_k = dequantize_fp4(*quantize_fp4(k.reshape(3, -1))).reshape(3, HEADS, DIM)
    else:
        want_k = k.to(pool.dtype)
    assert torch.equal(pool.get_key_buffer(2)[loc].view(torch.uint8), want_k.view(torch.uint8))
    fill_random(pool)
    tgt, src = torch.tensor([2, 3, 4, 21], device="cuda"), torch.tensor([3, 4, 5, 2], device="cuda")
    want = reference_move(pool._export_buffers(), tgt, src)
    pool.move_kv_cache(tgt, src)  # AUTO: the Triton kernel on CUDA
    torch.cuda.synchronize()
    assert all(same_bytes(a, b) for a, b in zip(pool._export_buffers(), want))
    cpu = pool.get_cpu_copy(torch.tensor([1, 2], device="cuda"))
    pool.load_cpu_copy(cpu, torch.tensor([10, 11], device="cuda"))
    for buf in pool._export_buffers():
        assert same_bytes(buf[10:12], buf[1:3])
