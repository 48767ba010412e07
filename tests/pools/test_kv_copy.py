"""pools.kv_copy: pointer tables, native and Triton moves against a clone-and-index reference.

The Triton kernel runs on CPU under TRITON_INTERPRET=1 (tiny shapes): the kernel is jitted
per interpret setting at first use, and the tests check the interpreted variant really ran.
"""

import pytest
import torch

from pools import kv_copy
from pools.kv_copy import MoveBackend, build_copy_table, move_kv_cache
from tests.pools._support import reference_move

needs_triton = pytest.mark.skipif(not kv_copy.triton_available(), reason="needs the triton package")


def random_buffers(rows, shapes_dtypes, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    bufs = []
    for shape, dtype in shapes_dtypes:
        if dtype == torch.uint8:
            b = torch.randint(0, 256, (rows, *shape), generator=g, dtype=torch.uint8)
        else:
            b = torch.randn(rows, *shape, generator=g).to(dtype)
        bufs.append(b.to(device))
    return bufs


def disjoint_move(rows, n, seed=0, dtype=torch.int64, device="cpu"):
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    return perm[:n].to(dtype).to(device), perm[n : 2 * n].to(dtype).to(device)


def overlapping_move(n, dtype=torch.int64):
    """tgt = [1..n], src = [2..n+1]: every target but the last is also a source."""
    return torch.arange(1, n + 1, dtype=dtype), torch.arange(2, n + 2, dtype=dtype)


@pytest.fixture
def interpret(monkeypatch):
    if not kv_copy.triton_available():
        pytest.skip("needs the triton package")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kv_copy.kernel_for_current_env(), InterpretedFunction)
    yield


MIXED = [((2, 8), torch.bfloat16), ((2, 4), torch.float32), ((2, 3), torch.uint8)]


def test_table_matches_buffers():
    bufs = random_buffers(10, MIXED)
    table = build_copy_table(bufs)
    assert table.data_ptrs.dtype == torch.uint64 and table.data_strides.dtype == torch.int64
    assert table.data_ptrs.tolist() == [b.data_ptr() for b in bufs]
    assert table.data_strides.tolist() == [b[0].numel() * b.element_size() for b in bufs]
    assert table.num_rows == 10 and table.num_buffers == 3
    assert table.word_bytes == 2  # the uint8 [2, 3] rows are 6 bytes
    assert build_copy_table(bufs[:2]).word_bytes == 8


def test_table_rejects_bad_buffers():
    with pytest.raises(ValueError, match="must have 10 rows like buffers\\[0\\], got shape \\[9, 4\\]"):
        build_copy_table([torch.zeros(10, 4), torch.zeros(9, 4)])
    with pytest.raises(ValueError, match="must be contiguous"):
        build_copy_table([torch.zeros(4, 10).t()])
    with pytest.raises(ValueError, match="at least one buffer"):
        build_copy_table([])


@pytest.mark.parametrize("seed", range(3))
def test_native_matches_reference(seed):
    bufs = random_buffers(40, MIXED, seed=seed)
    tgt, src = disjoint_move(40, 15, seed=seed)
    want = reference_move(bufs, tgt, src)
    move_kv_cache(build_copy_table(bufs), tgt, src, MoveBackend.NATIVE)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


def test_auto_is_native_on_cpu_and_overlap_safe():
    bufs = random_buffers(12, MIXED)
    tgt, src = overlapping_move(9)
    want = reference_move(bufs, tgt, src)
    move_kv_cache(build_copy_table(bufs), tgt, src)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


@needs_triton
def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    table = build_copy_table(random_buffers(4, MIXED))
    with pytest.raises(RuntimeError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        move_kv_cache(table, torch.tensor([1]), torch.tensor([2]), MoveBackend.TRITON)


@pytest.mark.parametrize(
    "layout",
    [
        [((2, 8), torch.bfloat16), ((2, 4), torch.float32)],  # 8-byte words
        [((3, 4), torch.float16), ((6,), torch.float32)],  # 8-byte words, rows of 24 bytes
        [((3,), torch.float32)],  # 4-byte words
        MIXED,  # 2-byte words
        [((5,), torch.uint8)],  # 1-byte words
    ],
)
def test_triton_interpreted_small_overlapping_move(interpret, layout):
    bufs = random_buffers(16, layout, seed=1)
    tgt, src = overlapping_move(7, dtype=torch.int32)
    want = reference_move(bufs, tgt, src)
    move_kv_cache(build_copy_table(bufs), tgt, src, MoveBackend.TRITON)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


def test_triton_interpreted_multi_block_disjoint_move(interpret):
    rows = 2 * kv_copy.SINGLE_BLOCK_MAX_LOCS + 40
    bufs = random_buffers(rows, [((2, 4), torch.float32), ((4,), torch.bfloat16)], seed=2)
    table = build_copy_table(bufs)
    n = kv_copy.SINGLE_BLOCK_MAX_LOCS + 13
    assert kv_copy.launch_config(table, n).grid[0] > 1
    tgt, src = disjoint_move(rows, n, seed=3)
    want = reference_move(bufs, tgt, src)
    move_kv_cache(table, tgt, src, MoveBackend.TRITON)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


def test_triton_interpreted_tiles_long_rows(interpret):
    bufs = random_buffers(12, [((64, 64), torch.float32)], seed=4)  # 16 KiB rows
    table = build_copy_table(bufs)
    cfg = kv_copy.launch_config(table, 100)
    assert cfg.grid[2] > 1 and cfg.block_locs * cfg.block_words * table.word_bytes <= 32 * 1024
    tgt, src = torch.tensor([0, 3, 7]), torch.tensor([5, 11, 3])
    want = reference_move(bufs, tgt, src)
    move_kv_cache(table, tgt, src, MoveBackend.TRITON)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


def test_bad_indices():
    table = build_copy_table(random_buffers(8, MIXED))
    with pytest.raises(ValueError, match="equal lengths, got 2 and 3"):
        move_kv_cache(table, torch.tensor([1, 2]), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="src_loc must lie in \\[0, 8\\), got values in \\[1, 8\\]"):
        move_kv_cache(table, torch.tensor([1, 2]), torch.tensor([1, 8]))
    with pytest.raises(TypeError, match="int32 or int64, got torch.float32"):
        move_kv_cache(table, torch.tensor([1.0]), torch.tensor([2]))
    with pytest.raises(ValueError, match="tgt_loc must be on cpu, got meta"):
        move_kv_cache(table, torch.tensor([1], device="meta"), torch.tensor([2]))
    with pytest.raises(TypeError, match="backend must be a MoveBackend, got str"):
        move_kv_cache(table, torch.tensor([1]), torch.tensor([2]), "triton")
    move_kv_cache(table, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 77, kv_copy.SINGLE_BLOCK_MAX_LOCS, 5000])
def test_triton_cuda_matches_reference(index_dtype, n):
    rows = 12000
    layout = [((8, 128), torch.bfloat16)] * 4 + [((8, 64), torch.uint8)] * 2 + [((8 * 128 // 16,), torch.uint8)]
    bufs = random_buffers(rows, layout, device="cuda", seed=n)
    tgt, src = disjoint_move(rows, n, seed=n, dtype=index_dtype, device="cuda")
    want = reference_move(bufs, tgt, src)
    move_kv_cache(build_copy_table(bufs), tgt, src, MoveBackend.TRITON)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


@pytest.mark.gpu
def test_triton_cuda_overlapping_single_block():
    bufs = random_buffers(300, [((4, 64), torch.float16), ((3,), torch.uint8)], device="cuda")
    tgt, src = overlapping_move(kv_copy.SINGLE_BLOCK_MAX_LOCS)
    tgt, src = tgt.cuda(), src.cuda()
    want = reference_move(bufs, tgt, src)
    table = build_copy_table(bufs)
    kv_copy.warmup(table)
    move_kv_cache(table, tgt, src)  # AUTO is Triton on CUDA
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))


@needs_triton
def test_kernel_compiles_for_sm90_with_16_byte_accesses(monkeypatch):
    """Compile (no GPU needed: triton ships ptxas) the large-move variant for an H100/H200
    and check the 16-byte-aligned case really issues 16-byte loads and stores."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no offline compile API")
    table = build_copy_table(random_buffers(64, [((8, 128), torch.bfloat16)]))
    assert (table.word_bytes, table.align_words) == (8, 2)
    cfg = kv_copy.launch_config(table, 10_000)
    signature = {
        "data_ptrs": "*u64",
        "strides": "*i64",
        "tgt_loc": "*i64",
        "src_loc": "*i64",
        "num_locs": "i32",
        "BLOCK_LOCS": "constexpr",
        "BLOCK_WORDS": "constexpr",
        "WORD_BYTES": "constexpr",
        "ALIGN_WORDS": "constexpr",
    }
    constexprs = {"BLOCK_LOCS": cfg.block_locs, "BLOCK_WORDS": cfg.block_words, "WORD_BYTES": 8, "ALIGN_WORDS": 2}
    src = ASTSource(kv_copy.kernel_for_current_env(), signature, constexprs=constexprs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
    except (FileNotFoundError, RuntimeError) as exc:  # no ptxas / no CUDA backend in this install
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    ptx = compiled.asm["ptx"]
    assert "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx
