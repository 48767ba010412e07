"""pools.fp4: format (scales, nibble order, codes) against brute-force references, error bound."""

import pytest
import torch

from pools.fp4 import E2M1_VALUES, FP4_BLOCK, dequantize_fp4, quantize_fp4

# Every finite non-negative float8_e4m3fn value, ascending (0x7F is NaN).
E4M3_POSITIVE = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def ref_scale(block: torch.Tensor) -> float:
    """Smallest e4m3 value >= amax / 6 (brute force over all e4m3 values)."""
    target = block.abs().max().double() / 6
    return float(E4M3_POSITIVE[E4M3_POSITIVE >= target].min())


def ref_codes(x: torch.Tensor) -> list:
    """Per element code (sign << 3 | nearest magnitude index; ties -> smaller), row-major."""
    codes = []
    for block in x.reshape(-1, FP4_BLOCK).double():
        s = ref_scale(block)
        for v in block:
            q = 0.0 if s == 0 else min(abs(float(v)) / s, 6.0)
            dist = (GRID - q).abs()
            mag = int(torch.nonzero(dist == dist.min())[0])
            codes.append((8 if (v < 0 and mag > 0) else 0) | mag)
    return codes


def unpack_nibbles(packed: torch.Tensor) -> list:
    out = []
    for byte in packed.reshape(-1).tolist():
        out += [byte & 0xF, byte >> 4]  # element 2i low, 2i+1 high
    return out


def random_blocks(rows: int, n: int, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Rows of values whose blocks span magnitudes 1e-4 .. 1e3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    mags = 10 ** (torch.rand(rows, n // FP4_BLOCK, 1, generator=g) * 7 - 4)
    return (x.reshape(rows, n // FP4_BLOCK, FP4_BLOCK) * mags).reshape(rows, n).to(dtype)


def test_shapes_and_dtypes():
    x = torch.randn(3, 5, 64)
    packed, scales = quantize_fp4(x)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert scales.shape == (3, 5, 4) and scales.dtype == torch.uint8
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = dequantize_fp4(packed, scales, dtype)
        assert out.shape == x.shape and out.dtype == dtype


def test_scales_and_codes_match_brute_force_reference():
    x = random_blocks(2, 64, seed=1)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 3] = -x[1, 3].abs() - 1e-3  # a negative value
    packed, scales = quantize_fp4(x)
    want_scales = [ref_scale(b) for b in x.reshape(-1, FP4_BLOCK)]
    got_scales = scales.view(torch.float8_e4m3fn).double().reshape(-1).tolist()
    assert got_scales == want_scales
    assert got_scales[0] == 0.0
    assert unpack_nibbles(packed) == ref_codes(x)


def test_nibble_order_low_then_high():
    x = torch.zeros(32)
    x[0], x[1] = 6.0, -3.0  # scale 1 (amax 6): codes 7 and 8|5
    packed, scales = quantize_fp4(x)
    assert scales[0].view(torch.float8_e4m3fn).item() == 1.0
    assert packed[0].item() == (7 | (13 << 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_bound_on_random_data(dtype):
    x = random_blocks(64, 128, dtype=dtype, seed=2)
    packed, scales = quantize_fp4(x)
    deq = dequantize_fp4(packed, scales, torch.float32)
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(FP4_BLOCK, dim=-1)  # [64, 128]
    xf = x.float()
    err = (xf - deq).abs()
    slack = 1 + 2.0**-20
    assert bool((err <= torch.maximum(s, xf.abs()) / 4 * slack).all())
    assert bool((err <= s * slack).all())
    # The bound is not vacuous: errors reach a good fraction of it.
    assert float((err / torch.maximum(s, xf.abs())).max()) > 0.1


def test_dequantize_is_exact_in_every_output_dtype():
    packed, scales = quantize_fp4(random_blocks(8, 64, seed=3))
    ref = dequantize_fp4(packed, scales, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_fp4(packed, scales, dtype).float(), ref)


def test_saturation_above_e4m3_range():
    x = torch.zeros(16)
    x[0], x[1] = 5000.0, -1.0
    deq = dequantize_fp4(*quantize_fp4(x), dtype=torch.float32)
    assert deq[0].item() == 6 * 448.0


def test_round_trip_of_representable_values_is_exact():
    g = torch.Generator().manual_seed(4)
    grid = torch.tensor(E2M1_VALUES)
    vals = grid[torch.randint(0, 8, (4, 32), generator=g)] * torch.where(torch.rand(4, 32, generator=g) < 0.5, -1, 1)
    vals[:, 0] = 6.0  # every block's amax is 6 -> scale 1
    vals[:, 16] = 6.0
    out = dequantize_fp4(*quantize_fp4(vals * 0.25), dtype=torch.float32)  # scale 0.25 is e4m3
    assert torch.equal(out, vals * 0.25)


def test_bad_input():
    with pytest.raises(TypeError, match="dtype float32, bfloat16 or float16, got torch.int32"):
        quantize_fp4(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 16, got shape \\[2, 24\\]"):
        quantize_fp4(torch.zeros(2, 24))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        quantize_fp4([1.0] * 32)
    packed, scales = quantize_fp4(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="scales must have shape \\[2, 2\\].*got \\[2, 3\\]"):
        dequantize_fp4(packed, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="torch.uint8, got torch.float32"):
        dequantize_fp4(packed.float(), scales)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16, got torch.int8"):
        dequantize_fp4(packed, scales, torch.int8)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    x = random_blocks(16, 256, seed=5)
    p_cpu, s_cpu = quantize_fp4(x)
    p_gpu, s_gpu = quantize_fp4(x.cuda())
    assert torch.equal(p_gpu.cpu(), p_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(dequantize_fp4(p_gpu, s_gpu).cpu(), dequantize_fp4(p_cpu, s_cpu))
