"""NSATokenToKVPool: KV + paged index_k layout, exports, index_k round trips, CPU copy, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.nsa import NSATokenToKVPool
from tests.pools._support import Counter

SIZE, PAGE, RANK, ROPE, IDX, LAYERS = 128, 64, 128, 64, 128, 2
PLAIN_DIM = RANK + ROPE
PACKED_DIM = RANK + RANK // 128 * 4 + ROPE * 2  # fp8 nope | fp32 scale per 128 | bf16 rope
NUM_PAGES = (SIZE + PAGE + 1) // PAGE
PAGE_BYTES = PAGE * IDX + PAGE * 4


def make(dtype=torch.bfloat16, kv_cache_dim=PLAIN_DIM, device="cpu", start_layer=None, page_size=PAGE, index_head_dim=IDX):
    return NSATokenToKVPool(
        SIZE, page_size, RANK, dtype, ROPE, LAYERS, device, index_head_dim, False, kv_cache_dim, start_layer=start_layer
    )


def index_inputs(n, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, IDX, generator=g) * 50).to(torch.float8_e4m3fn).to(device)  # [n, 128] fp8
    s = (torch.rand(n, generator=g) + 0.1).to(device)  # [n] fp32
    return k, s


def reference_index_page_bytes(buf, loc):
    """Independent reading of the documented page layout, token by token."""
    data, scales = [], []
    for t in loc.tolist():
        page, off = divmod(t, PAGE)
        data.append(buf[page, off * IDX : (off + 1) * IDX])
        scales.append(buf[page, PAGE * IDX + 4 * off : PAGE * IDX + 4 * off + 4])
    return torch.stack(data), torch.stack(scales)


# -- layout and exports --------------------------------------------------------------------
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, PLAIN_DIM), (torch.float8_e4m3fn, PACKED_DIM)])
def test_shapes_bytes_and_exports(dtype, dim):
    pool = make(dtype, dim)
    assert pool.kv_cache_dim == dim and pool.nsa_kv_cache_store_fp8 == (dim == PACKED_DIM)
    item = 2 if dtype == torch.bfloat16 else 1
    for kv, ib in zip(pool.kv_buffer, pool.index_k_with_scale_buffer):
        assert kv.shape == (SIZE + PAGE, 1, dim) and kv.dtype == (torch.bfloat16 if item == 2 else torch.uint8)
        assert ib.shape == (NUM_PAGES, PAGE_BYTES) and ib.dtype == torch.uint8
    kv_bytes = LAYERS * (SIZE + PAGE) * dim * item
    assert pool.get_kv_size_bytes() == kv_bytes + LAYERS * NUM_PAGES * PAGE_BYTES
    ptrs, lens, items = pool.get_contiguous_buf_infos()  # [KV_0 .. KV_{L-1}]
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer]
    assert lens == [b.nbytes for b in pool.kv_buffer] and items == [dim * item * PAGE] * LAYERS
    ptrs, lens, items = pool.get_state_buf_infos()  # [index_k_0 .. index_k_{L-1}]
    assert ptrs == [b.data_ptr() for b in pool.index_k_with_scale_buffer]
    assert lens == [NUM_PAGES * PAGE_BYTES] * LAYERS and items == [PAGE_BYTES] * LAYERS
    for ptr, buf, it in zip(ptrs, pool.index_k_with_scale_buffer, items):
        assert ptr + 2 * it == buf[2].data_ptr()


# -- index_k -------------------------------------------------------------------------------
def test_index_k_write_read_round_trip():
    pool = make()
    pages = torch.tensor([2, 1])  # a request on pages 2 then 1, 100 tokens
    seq_len = 100
    t = torch.arange(seq_len)
    loc = pages[t // PAGE] * PAGE + t % PAGE
    k, s = index_inputs(seq_len)
    pool.set_index_k_scale_buffer(1, loc, k, s)
    buf = pool.index_k_with_scale_buffer[1]
    data, scale = reference_index_page_bytes(buf, loc)
    assert torch.equal(data, k.view(torch.uint8))
    assert torch.equal(scale, torch.from_numpy(s.numpy().astype(np.float32).view(np.uint8).reshape(-1, 4)))
    assert not pool.index_k_with_scale_buffer[0].any() and not buf[0].any()
    got_k = pool.get_index_k_continuous(1, seq_len, pages)
    got_s = pool.get_index_k_scale_continuous(1, seq_len, pages)
    assert got_k.shape == (seq_len, IDX) and got_k.dtype == torch.uint8
    assert torch.equal(got_k, k.view(torch.uint8))
    assert torch.equal(got_s.view(torch.float32).view(-1), s)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, NUM_PAGES * PAGE - 1), min_size=1, max_size=40, unique=True), st.integers(0, 2**16))
def test_index_k_scattered_writes_land_at_documented_positions(slots, seed):
    pool = make()
    loc = torch.tensor(slots)
    k, s = index_inputs(len(slots), seed=seed)
    pool.set_index_k_scale_buffer(0, loc, k, s)
    buf = pool.index_k_with_scale_buffer[0]
    data, scale = reference_index_page_bytes(buf, loc)
    assert torch.equal(data, k.view(torch.uint8)) and torch.equal(scale.view(torch.float32).view(-1), s)
    assert int(buf.count_nonzero()) == int(k.view(torch.uint8).count_nonzero()) + int(s.view(torch.uint8).count_nonzero())


def test_index_k_batched_getter_and_byte_inputs():
    pool = make()
    seq = torch.tensor([70, 0, 5])
    page_table = torch.tensor([[1, 2], [0, 0], [0, 0]])  # request 2 sits on the padding page: fine for reads
    k, s = index_inputs(75, seed=1)
    loc = torch.cat([torch.arange(PAGE, PAGE + 70), torch.arange(5)])
    pool.set_index_k_scale_buffer(0, loc, k.view(torch.uint8), s.view(torch.uint8).view(-1, 4))  # byte forms
    got_k, got_s = pool.get_index_k_scale_buffer(0, seq, page_table, 75, 70)
    assert torch.equal(got_k, k.view(torch.uint8))
    assert torch.equal(got_s, s.view(torch.uint8).view(-1, 4))
    empty_k, empty_s = pool.get_index_k_scale_buffer(0, torch.tensor([0]), torch.zeros(1, 0, dtype=torch.long), 0, 0)
    assert empty_k.shape == (0, IDX) and empty_s.shape == (0, 4)


def test_index_getters_wait_for_layer():
    pool = make(start_layer=10)
    counter = Counter()
    pool.register_layer_transfer_counter(counter)
    pool.get_index_k_with_scale_buffer(11)
    pool.get_index_k_continuous(10, 3, torch.tensor([1]))
    pool.get_index_k_scale_continuous(11, 3, torch.tensor([1]))
    pool.get_index_k_scale_buffer(10, torch.tensor([3]), torch.tensor([[1]]), 3, 3)
    pool.get_key_buffer(11)
    assert counter.calls == [1, 0, 1, 0, 1]
    pool.set_index_k_scale_buffer(10, torch.tensor([64]), *index_inputs(1))  # writes do not wait
    assert counter.calls == [1, 0, 1, 0, 1]


# -- KV rows -------------------------------------------------------------------------------
def test_plain_rows_nope_rope():
    pool = make()
    loc = torch.tensor([64, 65, 130])
    nope, rope = torch.randn(3, 1, RANK), torch.randn(3, 1, ROPE)
    pool.set_mla_kv_buffer(0, loc, nope, rope)
    ref = torch.cat([nope, rope], dim=-1).bfloat16()
    assert torch.equal(pool.get_key_buffer(0)[loc], ref)
    got_nope, got_rope = pool.get_mla_kv_buffer(0, loc)
    assert torch.equal(got_nope, ref[..., :RANK]) and torch.equal(got_rope, ref[..., RANK:])


def test_packed_fp8_rows():
    pool = make(torch.float8_e4m3fn, PACKED_DIM)
    loc = torch.tensor([64, 100, 191])
    nope = torch.randn(3, 1, RANK) * torch.tensor([1.0, 100.0, 0.0]).view(3, 1, 1)  # last row all zero
    rope = torch.randn(3, 1, ROPE)
    pool.set_mla_kv_buffer(1, loc, nope, rope)
    row = pool.kv_buffer[1][loc][:, 0]  # [3, PACKED_DIM] uint8
    scale = row[:, RANK : RANK + 4].contiguous().view(torch.float32)[:, 0]
    amax = nope[:, 0].abs().amax(-1)
    assert torch.allclose(scale[:2], amax[:2] / 448) and scale[2] == 1.0
    assert torch.equal(row[:, RANK + 4 :], rope[:, 0].bfloat16().view(torch.uint8))
    # torch-cast reference, SGLang's order: times the fp32 reciprocal, clamped to +-448
    ref_fp8 = (nope[:, 0] * (1.0 / scale[:, None])).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(row[:, :RANK], ref_fp8.view(torch.uint8))
    got_nope, got_rope = pool.get_mla_kv_buffer(1, loc, torch.float32)
    assert torch.equal(got_nope[:, 0], ref_fp8.float() * scale[:, None])
    assert torch.equal(got_rope, rope.bfloat16().float())
    err = (got_nope - nope).abs()
    assert bool((err <= nope.abs() / 16 + scale.view(3, 1, 1) * 2**-9).all())  # e4m3: 3 mantissa bits


def test_packed_fp8_nope_multiplies_by_the_reciprocal():
    """Pinned bytes where x / scale and x * (1 / scale) round to different e4m3 codes.

    Tile amax 13: scale = fp32(13 / 448) = 0.029017856 (bytes db b6 ed 3c), 1 / scale = 34.46154.
    13 * 34.46154 = 448.00003 -> clamped to 448 = 0x7e. 4.875 * 34.46154 = 168.00002 -> 176 = 0x73
    (4.875 / scale is exactly 168, an e4m3 tie between 160 and 176 that rounds to even: 160 = 0x72).
    9.75 -> 336.00003 -> 352 = 0x7b (divided: the tie 336 -> 320 = 0x7a). -4.875 -> 0x80 | 0x73.
    """
    pool = make(torch.float8_e4m3fn, PACKED_DIM)
    nope = torch.zeros(1, 1, RANK)
    nope[0, 0, :4] = torch.tensor([13.0, 4.875, 9.75, -4.875])
    pool.set_mla_kv_buffer(0, torch.tensor([70]), nope, torch.zeros(1, 1, ROPE))
    row = pool.kv_buffer[0][70, 0]  # [PACKED_DIM] uint8
    assert row[:4].tolist() == [0x7E, 0x73, 0x7B, 0xF3] and not row[4:RANK].any()
    assert row[RANK : RANK + 4].tolist() == [0xDB, 0xB6, 0xED, 0x3C]
    # The same from the formulas in numpy fp32, and the division really differs here.
    scale = np.float32(13) / np.float32(448)
    assert list(scale.tobytes()) == [0xDB, 0xB6, 0xED, 0x3C]
    x = np.array([13.0, 4.875, 9.75, -4.875], dtype=np.float32)
    e4m3 = lambda a: torch.from_numpy(np.clip(a, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert e4m3(x * (np.float32(1) / scale)) == row[:4].tolist()
    assert e4m3(x / scale) == [0x7E, 0x72, 0x7A, 0xF2]


# -- CPU copy ------------------------------------------------------------------------------
def test_cpu_copy_of_kv_and_index_k():
    pool = make()
    pool.cpu_offloading_chunk_size = PAGE  # one page per index chunk, 64 tokens per KV chunk
    pages = torch.tensor([2, 1])
    t = torch.arange(100)  # partial last page
    loc = pages[t // PAGE] * PAGE + t % PAGE
    for layer in range(LAYERS):
        pool.set_kv_buffer(layer, loc, torch.randn(100, 1, PLAIN_DIM))
        pool.set_index_k_scale_buffer(layer, loc, *index_inputs(100, seed=layer))
    kv_before = [b.clone() for b in pool.kv_buffer]
    idx_before = [b.clone() for b in pool.index_k_with_scale_buffer]
    cpu = pool.get_cpu_copy(loc)
    assert set(cpu) == {"kv", "index_k"} and len(cpu["index_k"][0]) == 2
    assert torch.equal(cpu["index_k"][0][0], idx_before[0][2:3])
    for b in pool.kv_buffer + pool.index_k_with_scale_buffer:
        b.zero_()
    pool.load_cpu_copy(cpu, loc)
    for b, ref in zip(pool.kv_buffer + pool.index_k_with_scale_buffer, kv_before + idx_before):
        assert torch.equal(b, ref)


def test_cpu_copy_errors():
    pool = make()
    with pytest.raises(ValueError, match=r"indices must be runs of whole pages of 64 slots"):
        pool.get_cpu_copy(torch.tensor([64, 65, 129]))
    loc = torch.arange(64, 128)
    cpu = pool.get_cpu_copy(loc)
    with pytest.raises(ValueError, match=r"must be a dict with keys \['index_k', 'kv'\], got \['kv'\]"):
        pool.load_cpu_copy({"kv": cpu["kv"]}, loc)
    cpu["index_k"][1][0] = cpu["index_k"][1][0].float()
    cpu["kv"][0][0] = torch.ones_like(cpu["kv"][0][0])
    with pytest.raises(TypeError, match=r"index_k\[1\]\[0\] must have dtype torch.uint8, got torch.float32"):
        pool.load_cpu_copy(cpu, loc)
    assert not pool.kv_buffer[0].any()  # nothing written


# -- bad input -----------------------------------------------------------------------------
def test_bad_input_messages():
    with pytest.raises(ValueError, match=r"needs page_size 64, got 32"):
        make(page_size=32)
    with pytest.raises(ValueError, match=r"needs index_head_dim 128, got 64"):
        make(index_head_dim=64)
    with pytest.raises(ValueError, match=r"kv_cache_dim 260 != kv_lora_rank \+ qk_rope_head_dim \(192\) needs dtype torch.float8_e4m3fn"):
        make(torch.bfloat16, PACKED_DIM)
    with pytest.raises(ValueError, match=r"packed FP8 rows of kv_lora_rank=128, qk_rope_head_dim=64 are 260 bytes, got kv_cache_dim=300"):
        make(torch.float8_e4m3fn, 300)
    packed = make(torch.float8_e4m3fn, PACKED_DIM)
    with pytest.raises(ValueError, match=r"set_kv_buffer writes plain rows; .* use set_mla_kv_buffer"):
        packed.set_kv_buffer(0, torch.tensor([64]), torch.randn(1, 1, PACKED_DIM))
    pool = make()
    k, s = index_inputs(2)
    with pytest.raises(ValueError, match=r"loc must lie in \[0, 192\), got values in \[64, 192\]"):
        pool.set_index_k_scale_buffer(0, torch.tensor([64, 192]), k, s)
    with pytest.raises(TypeError, match=r"index_k must be float8_e4m3fn or uint8, got torch.float32"):
        pool.set_index_k_scale_buffer(0, torch.tensor([64, 65]), k.float(), s)
    with pytest.raises(ValueError, match=r"index_k_scale must have shape \[2\] or \[2, 1\], got \[3\]"):
        pool.set_index_k_scale_buffer(0, torch.tensor([64, 65]), k, torch.ones(3))
    with pytest.raises(ValueError, match=r"seq_len 65 needs 2 pages, got 1 page_indices"):
        pool.get_index_k_continuous(0, 65, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"page_indices must lie in \[0, 3\), got values in \[3, 3\]"):
        pool.get_index_k_continuous(0, 5, torch.tensor([3]))
    with pytest.raises(ValueError, match=r"seq_len_sum must equal sum\(seq_len_tensor\) = 7, got 8"):
        pool.get_index_k_scale_buffer(0, torch.tensor([3, 4]), torch.tensor([[1], [2]]), 8, 4)
    with pytest.raises(KeyError, match=r"layer 2 is not held by this pool"):
        pool.get_index_k_with_scale_buffer(2)


# -- CUDA ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_index_k_and_cpu_copy():
    pool = make(torch.float8_e4m3fn, PACKED_DIM, device="cuda")
    loc = torch.arange(PAGE, 2 * PAGE, device="cuda")
    k, s = index_inputs(PAGE, device="cuda")
    pool.set_index_k_scale_buffer(0, loc, k, s)
    nope, rope = torch.randn(PAGE, 1, RANK, device="cuda"), torch.randn(PAGE, 1, ROPE, device="cuda")
    pool.set_mla_kv_buffer(0, loc, nope, rope)
    pages = torch.tensor([1], device="cuda")
    assert torch.equal(pool.get_index_k_continuous(0, PAGE, pages), k.view(torch.uint8))
    assert torch.equal(pool.get_index_k_scale_continuous(0, PAGE, pages).view(torch.float32).view(-1), s)
    assert pool.get_state_buf_infos()[0] == [b.data_ptr() for b in pool.index_k_with_scale_buffer]
    before = [b.clone() for b in pool.kv_buffer + pool.index_k_with_scale_buffer]
    cpu = pool.get_cpu_copy(loc)
    for b in pool.kv_buffer + pool.index_k_with_scale_buffer:
        b.zero_()
    pool.load_cpu_copy(cpu, loc)
    for b, ref in zip(pool.kv_buffer + pool.index_k_with_scale_buffer, before):
        assert torch.equal(b, ref)
    got_rope = pool.get_mla_kv_buffer(0, loc, torch.float32)[1]
    assert torch.equal(got_rope, rope.bfloat16().float())
