"""MLATokenToKVPool / MLATokenToKVPoolFP4: layout, exports, round trips, CPU copy, bad input."""

import pytest
import torch

from pools.fp4 import FP4_BLOCK, dequantize_fp4, quantize_fp4
from pools.mla import MLATokenToKVPool, MLATokenToKVPoolFP4
from tests.pools._support import Counter, Layer

SIZE, PAGE, RANK, ROPE, LAYERS = 64, 16, 64, 32, 3
DIM = RANK + ROPE
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def make(dtype=torch.bfloat16, device="cpu", start_layer=None, cls=MLATokenToKVPool):
    return cls(SIZE, PAGE, dtype, RANK, ROPE, LAYERS, device, False, start_layer=start_layer)


def make_fp4(device="cpu", start_layer=None):
    return make(torch.float4_e2m1fn_x2, device, start_layer, MLATokenToKVPoolFP4)


def rand_loc(n, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(SIZE, generator=g)[:n] + PAGE).to(device)  # never the padding page


def store_of(dtype):
    return torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


# -- layout and exports --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_dtypes_bytes(dtype):
    pool = make(dtype)
    item = torch.tensor([], dtype=dtype).element_size()
    assert len(pool.kv_buffer) == LAYERS
    for buf in pool.kv_buffer:
        assert buf.shape == (SIZE + PAGE, 1, DIM) and buf.dtype == store_of(dtype)
        assert not buf.any()
    assert pool.get_kv_size_bytes() == LAYERS * (SIZE + PAGE) * DIM * item
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_exports_match_tensors(dtype):
    pool = make(dtype)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer]  # [KV_0 .. KV_{L-1}]
    assert lens == [b.numel() * b.element_size() for b in pool.kv_buffer]
    row = DIM * pool.kv_buffer[0].element_size()
    assert items == [row * PAGE] * LAYERS
    for ptr, buf, item in zip(ptrs, pool.kv_buffer, items):
        s, p = 37, 3
        assert ptr + s * (item // PAGE) == buf[s].data_ptr()
        assert ptr + p * item == buf[p * PAGE].data_ptr()


def test_fp4_shapes_and_exports():
    pool = make_fp4()
    m = SIZE + PAGE
    for kv, sc in zip(pool.kv_buffer, pool.kv_scale_buffer):
        assert kv.shape == (m, 1, DIM // 2) and kv.dtype == torch.uint8
        assert sc.shape == (m, DIM // FP4_BLOCK) and sc.dtype == torch.uint8
    assert pool.get_kv_size_bytes() == LAYERS * m * (DIM // 2 + DIM // FP4_BLOCK)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    bufs = pool.kv_buffer + pool.kv_scale_buffer  # [KV_0..KV_{L-1}, KVscale_0..KVscale_{L-1}]
    assert ptrs == [b.data_ptr() for b in bufs]
    assert lens == [b.nbytes for b in bufs]
    assert items == [DIM // 2 * PAGE] * LAYERS + [DIM // FP4_BLOCK * PAGE] * LAYERS


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_set_kv_buffer_round_trip(dtype):
    pool = make(dtype)
    loc = rand_loc(10)
    x = torch.randn(10, 1, DIM, dtype=torch.bfloat16)
    pool.set_kv_buffer(Layer(1), loc, x, None)
    ref = x.to(dtype)  # torch cast is the reference for FP8 too
    got = pool.get_key_buffer(1)
    assert got.dtype == dtype
    assert torch.equal(as_bytes(got[loc]), as_bytes(ref))
    untouched = torch.ones(SIZE + PAGE, dtype=torch.bool)
    untouched[loc] = False
    assert not pool.kv_buffer[1][untouched].any()
    assert not pool.kv_buffer[0].any() and not pool.kv_buffer[2].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nope_rope_packing(dtype):
    pool = make(dtype)
    loc = rand_loc(7)
    nope = torch.randn(7, 1, RANK)
    rope = torch.randn(7, 1, ROPE)
    pool.set_mla_kv_buffer(2, loc, nope, rope)
    ref = torch.cat([nope.to(dtype), rope.to(dtype)], dim=-1)  # row = [nope | rope]
    assert torch.equal(as_bytes(pool.get_key_buffer(2)[loc]), as_bytes(ref))
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(2), loc, torch.float32)
    assert got_nope.shape == (7, 1, RANK) and got_rope.shape == (7, 1, ROPE)
    assert torch.equal(got_nope, nope.to(dtype).float()) and torch.equal(got_rope, rope.to(dtype).float())
    value = pool.get_value_buffer(2)  # a view of the nope part
    assert value.shape == (SIZE + PAGE, 1, RANK) and value.data_ptr() == pool.kv_buffer[2].data_ptr()
    assert torch.equal(as_bytes(value[loc]), as_bytes(nope.to(dtype)))


def test_default_dst_dtype_is_pool_dtype():
    pool = make(torch.float16)
    loc = rand_loc(3)
    pool.set_mla_kv_buffer(0, loc, torch.randn(3, RANK), torch.randn(3, ROPE))  # [n, dim] accepted
    nope, rope = pool.get_mla_kv_buffer(0, loc)
    assert nope.dtype == rope.dtype == torch.float16


def _fp4_bound_ok(x, deq, scale_bits):
    s = torch.exp2(scale_bits.float() - 127).repeat_interleave(FP4_BLOCK, dim=-1)  # per element (UE8M0)
    err = (x.float() - deq.float()).abs()
    return bool((err <= torch.maximum(s, x.float().abs()) / 4 * (1 + 2**-20)).all())


def test_fp4_set_kv_buffer_within_bound():
    pool = make_fp4()
    loc = rand_loc(12)
    x = torch.randn(12, 1, DIM) * 3
    pool.set_kv_buffer(Layer(0), loc, x, None)
    packed, scales = quantize_fp4(x)
    assert torch.equal(pool.kv_buffer[0][loc], packed) and torch.equal(pool.kv_scale_buffer[0][loc], scales[:, 0])
    got = pool.get_key_buffer(0)
    assert got.shape == (SIZE + PAGE, 1, DIM) and got.dtype == torch.bfloat16
    assert _fp4_bound_ok(x[:, 0], got[loc][:, 0], pool.kv_scale_buffer[0][loc])
    assert not got[0].any()  # padding slot stays zero
    value = pool.get_value_buffer(0)
    assert torch.equal(value, got[..., :RANK])


def test_fp4_nope_rope_matches_separate_quantization():
    pool = make_fp4()
    loc = rand_loc(5)
    nope, rope = torch.randn(5, 1, RANK), torch.randn(5, 1, ROPE) * 10
    pool.set_mla_kv_buffer(1, loc, nope.bfloat16(), rope.bfloat16())
    (pn, sn), (pr, sr) = quantize_fp4(nope.bfloat16()), quantize_fp4(rope.bfloat16())
    assert torch.equal(pool.kv_buffer[1][loc], torch.cat([pn, pr], dim=-1))
    assert torch.equal(pool.kv_scale_buffer[1][loc], torch.cat([sn, sr], dim=-1)[:, 0])
    got_nope, got_rope = pool.get_mla_kv_buffer(1, loc, torch.float32)
    assert torch.equal(got_nope, dequantize_fp4(pn, sn, torch.float32))
    assert _fp4_bound_ok(rope.bfloat16()[:, 0], got_rope[:, 0], sr[:, 0])  # the bound of what was quantized: bf16


# -- layer transfer counter ----------------------------------------------------------------
def test_counter_called_before_buffers_with_local_ids():
    for pool in (make(start_layer=4), make_fp4(start_layer=4)):
        counter = Counter()
        pool.register_layer_transfer_counter(counter)
        pool.get_key_buffer(5)
        pool.get_value_buffer(6)
        pool.get_kv_buffer(4)
        pool.get_mla_kv_buffer(Layer(6), torch.tensor([PAGE]))
        assert counter.calls == [1, 2, 0, 0, 2]
        with pytest.raises(KeyError, match=r"layer 3 is not held by this pool \(layers 4..6\)"):
            pool.get_key_buffer(3)
        assert counter.calls == [1, 2, 0, 0, 2]  # no wait for a layer the pool does not hold


# -- CPU copy ------------------------------------------------------------------------------
@pytest.mark.parametrize("fp4", [False, True])
def test_cpu_copy_round_trip_in_chunks(fp4):
    pool = make_fp4() if fp4 else make(torch.float8_e4m3fn)
    pool.cpu_offloading_chunk_size = 4  # 10 indices -> chunks of 4, 4, 2
    loc = rand_loc(10)
    for layer in range(LAYERS):
        pool.set_kv_buffer(layer, loc, torch.randn(10, 1, DIM))
    bufs = pool.kv_buffer + (pool.kv_scale_buffer if fp4 else [])
    before = [b.clone() for b in bufs]
    cpu = pool.get_cpu_copy(loc)
    assert len(cpu) == LAYERS and len(cpu[0]) == 3
    for b in bufs:
        b.zero_()
    pool.load_cpu_copy(cpu, loc)
    for b, ref in zip(bufs, before):
        assert torch.equal(b, ref)


def test_load_cpu_copy_rejects_malformed_copy_before_writing():
    pool = make()
    pool.cpu_offloading_chunk_size = 4
    loc = rand_loc(6)
    cpu = pool.get_cpu_copy(loc)
    cpu[2][1] = cpu[2][1][:1]  # last layer, second chunk: 1 row instead of 2
    cpu[0][0] = torch.ones_like(cpu[0][0])
    with pytest.raises(ValueError, match=r"kv_cache_cpu\[2\]\[1\] must have shape \[2, 1, 96\], got \[1, 1, 96\]"):
        pool.load_cpu_copy(cpu, loc)
    assert not pool.kv_buffer[0].any()
    with pytest.raises(ValueError, match=r"kv_cache_cpu must hold 3 layers, got 2"):
        pool.load_cpu_copy(cpu[:2], loc)
    fp4 = make_fp4()
    fp4.cpu_offloading_chunk_size = 4
    cpu = fp4.get_cpu_copy(loc)
    assert len(cpu[0]) == 2 and len(cpu[0][0]) == 2  # [layer][chunk][kv, kv_scale]
    cpu[1][1][1] = cpu[1][1][1].float()
    with pytest.raises(TypeError, match=r"kv_cache_cpu\[1\]\[1\]\[1\] must have dtype torch.uint8, got torch.float32"):
        fp4.load_cpu_copy(cpu, loc)
    cpu[1][1] = cpu[1][1][:1]
    with pytest.raises(ValueError, match=r"kv_cache_cpu\[1\] must be a list of chunks, each a list of 2 tensors"):
        fp4.load_cpu_copy(cpu, loc)


# -- bad input -----------------------------------------------------------------------------
def test_bad_input_messages():
    pool = make()
    loc = rand_loc(4)
    with pytest.raises(ValueError, match=r"cache_k must have shape \[4, 1, 96\], got \[4, 1, 95\]"):
        pool.set_kv_buffer(0, loc, torch.randn(4, 1, 95))
    with pytest.raises(TypeError, match=r"cache_k must be a floating-point tensor, got dtype torch.int32"):
        pool.set_kv_buffer(0, loc, torch.zeros(4, 1, DIM, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_k_rope must have shape \[4, 1, 32\], got \[4, 1, 64\]"):
        pool.set_mla_kv_buffer(0, loc, torch.randn(4, 1, RANK), torch.randn(4, 1, 64))
    with pytest.raises(ValueError, match=r"loc must lie in \[0, 80\), got values in \[0, 80\]"):
        pool.set_kv_buffer(0, torch.tensor([0, 80]), torch.randn(2, 1, DIM))
    with pytest.raises(TypeError, match=r"loc must be an integer tensor, got dtype torch.float32"):
        pool.get_mla_kv_buffer(0, torch.tensor([1.0]))
    with pytest.raises(KeyError, match=r"layer 3 is not held by this pool \(layers 0..2\)"):
        pool.set_kv_buffer(Layer(3), loc, torch.randn(4, 1, DIM))
    with pytest.raises(TypeError, match=r"layer must be an int or have an int layer_id, got str"):
        pool.set_kv_buffer("0", loc, torch.randn(4, 1, DIM))
    with pytest.raises(ValueError, match=r"kv_lora_rank must be a positive int, got 0"):
        MLATokenToKVPool(SIZE, PAGE, torch.bfloat16, 0, ROPE, LAYERS, "cpu", False)
    with pytest.raises(ValueError, match=r"FP4 MLA needs kv_lora_rank % 16 == 0 .* got kv_lora_rank=24, qk_rope_head_dim=8"):
        MLATokenToKVPoolFP4(SIZE, PAGE, torch.float4_e2m1fn_x2, 24, 8, LAYERS, "cpu", False)
    fp4 = make_fp4()
    with pytest.raises(TypeError, match=r"cache_k_nope and cache_k_rope must share a dtype, got torch.float32 and torch.bfloat16"):
        fp4.set_mla_kv_buffer(0, loc, torch.randn(4, 1, RANK), torch.randn(4, 1, ROPE, dtype=torch.bfloat16))


# -- CUDA ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_round_trip_and_exports(dtype):
    pool = make(dtype, device="cuda")
    loc = rand_loc(9, "cuda")
    nope, rope = torch.randn(9, 1, RANK, device="cuda"), torch.randn(9, 1, ROPE, device="cuda")
    pool.set_mla_kv_buffer(0, loc, nope, rope)
    ref = torch.cat([nope.to(dtype), rope.to(dtype)], dim=-1)
    assert torch.equal(as_bytes(pool.get_key_buffer(0)[loc]), as_bytes(ref))
    ptrs, lens, _ = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer] and all(b.is_cuda for b in pool.kv_buffer)
    assert lens == [b.nbytes for b in pool.kv_buffer]
    cpu = pool.get_cpu_copy(loc)
    assert cpu[0][0].device.type == "cpu"
    pool.kv_buffer[0].zero_()
    pool.load_cpu_copy(cpu, loc)
    assert torch.equal(as_bytes(pool.get_key_buffer(0)[loc]), as_bytes(ref))
    with pytest.raises(ValueError, match=r"cache_k must be on cuda(:0)?, got cpu"):
        pool.set_kv_buffer(0, loc, torch.randn(9, 1, DIM))


@pytest.mark.gpu
def test_cuda_fp4_round_trip():
    pool = make_fp4(device="cuda")
    loc = rand_loc(9, "cuda")
    x = torch.randn(9, 1, DIM, device="cuda")
    pool.set_kv_buffer(0, loc, x)
    got = pool.get_mla_kv_buffer(0, loc, torch.float32)
    deq = torch.cat(got, dim=-1)
    assert _fp4_bound_ok(x[:, 0].cpu(), deq[:, 0].cpu(), pool.kv_scale_buffer[0][loc].cpu())
