"""pools.fp4: the seed's (SGLang's) byte format pinned on hand-worked blocks, a reference written
from the formulas (not from pools.fp4) on random data, nibble order, and the error bound."""

import math

import pytest
import torch

from pools.fp4 import E2M1_VALUES, FP4_BLOCK, dequantize_fp4, quantize_fp4

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def ref_block(block: list) -> tuple:
    """(scale byte, codes) of one 16-value block, from the formulas in Python floats:
    E = ceil(log2(max(amax / 6, 1e-10))), byte = E + 127, code = sign << 3 | #midpoints <= |x| / 2**E."""
    amax = max(abs(v) for v in block)
    e = math.ceil(math.log2(max(amax / 6, 1e-10)))
    codes = [(8 if v < 0 else 0) | sum(abs(v) / 2.0**e >= m for m in MIDPOINTS) for v in block]
    return e + 127, codes


def ref_quantize(x: torch.Tensor) -> tuple:
    """Flat lists (scale bytes, codes) of ``x`` in row-major block order."""
    scales, codes = [], []
    for block in x.float().reshape(-1, FP4_BLOCK).tolist():
        s, c = ref_block(block)
        scales.append(s)
        codes += c
    return scales, codes


def unpack_nibbles(packed: torch.Tensor) -> list:
    out = []
    for byte in packed.reshape(-1).tolist():
        out += [byte & 0xF, byte >> 4]  # element 2i low, 2i+1 high
    return out


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-element fp32 scale 2**(byte - 127), repeated over each block's 16 elements."""
    return torch.exp2(scales.float() - 127).repeat_interleave(FP4_BLOCK, dim=-1)


def random_blocks(rows: int, n: int, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Rows of values whose blocks span magnitudes 1e-4 .. 1e3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    mags = 10 ** (torch.rand(rows, n // FP4_BLOCK, 1, generator=g) * 7 - 4)
    return (x.reshape(rows, n // FP4_BLOCK, FP4_BLOCK) * mags).reshape(rows, n).to(dtype)


def pad(*values) -> list:
    return list(values) + [0.0] * (FP4_BLOCK - len(values))


# Hand-worked blocks: (values, scale byte, packed bytes, dequantized values), derived in comments.
KNOWN_BLOCKS = [
    # amax 6: E = ceil(log2(1)) = 0, byte 127, S = 1. Codes (midpoints reached, ties go up, every
    # negative keeps its sign): 6 -> 7, -6 -> 8|7 = 15, 0.25 -> 1, -0.25 -> 9, 0.75 -> 2 (tie 0.5/1
    # -> 1), 5 -> 7 (tie 4/6 -> 6), 4.9 -> 6, 2.5 -> 5 (tie 2/3 -> 3), 0.1 -> 0, -0.1 -> 8 ("-0"),
    # 1.75 -> 4, 1.7 -> 3, 3.5 -> 6, 3.4 -> 5, 0 -> 0, -0.0 -> 0 (not < 0).
    # Bytes (low | high << 4): 7|15<<4 = 247, 1|9<<4 = 145, 2|7<<4 = 114, 6|5<<4 = 86,
    # 0|8<<4 = 128, 4|3<<4 = 52, 6|5<<4 = 86, 0.
    ([6.0, -6.0, 0.25, -0.25, 0.75, 5.0, 4.9, 2.5, 0.1, -0.1, 1.75, 1.7, 3.5, 3.4, 0.0, -0.0], 127,
     [247, 145, 114, 86, 128, 52, 86, 0],
     [6.0, -6.0, 0.5, -0.5, 1.0, 6.0, 4.0, 3.0, 0.0, -0.0, 2.0, 1.5, 4.0, 3.0, 0.0, 0.0]),
    # amax 6.5: 6.5 / 6 = 1.083, log2 = 0.115, E = 1, byte 128, S = 2. 6.5 / 2 = 3.25 -> 5 (3);
    # -1 / 2 = -0.5 -> 9; 0.5 / 2 = 0.25 -> 1 (tie 0/0.5 -> 0.5, so 1.0 back); 3 / 2 = 1.5 -> 3.
    # Bytes: 5|9<<4 = 149, 1|3<<4 = 49. Dequantized: 3 * 2, -0.5 * 2, 0.5 * 2, 1.5 * 2.
    (pad(6.5, -1.0, 0.5, 3.0), 128, [149, 49] + [0] * 6, pad(6.0, -1.0, 1.0, 3.0)),
    # All zero: amax / 6 = 0 is clamped to 1e-10, E = ceil(-33.2) = -33, byte 94; codes 0.
    (pad(), 94, [0] * 8, pad()),
    # Negatives, amax 3: 3 / 6 = 0.5, E = -1, byte 126, S = 0.5. -3 -> -6: 15; -0.75 -> -1.5: 8|3 = 11;
    # -0.125 -> -0.25: 9 (tie -> 0.5, so -0.25 back); -0.0625 -> -0.125: 8 (-0). Bytes: 15|11<<4 = 191, 9|8<<4 = 137.
    (pad(-3.0, -0.75, -0.125, -0.0625), 126, [191, 137] + [0] * 6, pad(-3.0, -0.75, -0.25, -0.0)),
    # Tiny: amax / 6 = 5e-11 < 1e-10 -> clamped, E = -33, byte 94, S = 2**-33 = 1.164e-10.
    # 3e-10 / S = 2.58 -> 5 (3); -1e-10 / S = -0.86 -> 8|2 = 10 (1); 1e-12 / S = 0.009 -> 0.
    # Byte 5|10<<4 = 165.
    (pad(3e-10, -1e-10, 1e-12), 94, [165] + [0] * 7, pad(3 * 2.0**-33, -(2.0**-33), 0.0)),
    # Large, no saturation: 1e30 / 6 = 1.67e29, log2 = 97.07, E = 98, byte 225;
    # 1e30 / 2**98 = 3.16 -> 5 (3), dequantized 3 * 2**98.
    (pad(1e30), 225, [5] + [0] * 7, pad(3 * 2.0**98)),
]


@pytest.mark.parametrize("values,scale_byte,packed_bytes,dequantized", KNOWN_BLOCKS)
def test_known_blocks_bytes(values, scale_byte, packed_bytes, dequantized):
    x = torch.tensor(values, dtype=torch.float32)
    packed, scales = quantize_fp4(x)
    assert scales.tolist() == [scale_byte]
    assert packed.tolist() == packed_bytes
    assert ref_block(x.tolist()) == (scale_byte, unpack_nibbles(packed))  # the reference agrees
    out = dequantize_fp4(packed, scales, torch.float32)
    assert out.tolist() == torch.tensor(dequantized, dtype=torch.float32).tolist()


def test_known_blocks_in_one_tensor_keep_their_bytes():
    """The same blocks side by side in one row and in a batch: blocks are independent."""
    x = torch.tensor([v for b in KNOWN_BLOCKS for v in b[0]], dtype=torch.float32)
    packed, scales = quantize_fp4(x.reshape(2, -1) if len(KNOWN_BLOCKS) % 2 == 0 else x)
    assert scales.reshape(-1).tolist() == [b[1] for b in KNOWN_BLOCKS]
    assert packed.reshape(-1).tolist() == [byte for b in KNOWN_BLOCKS for byte in b[2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scales_and_codes_match_reference(dtype):
    x = random_blocks(4, 128, dtype=dtype, seed=1)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 3] = -x[1, 3].abs() - 1e-3  # a negative value
    packed, scales = quantize_fp4(x)
    want_scales, want_codes = ref_quantize(x)
    assert scales.reshape(-1).tolist() == want_scales
    assert scales[0, 0].item() == 94
    assert unpack_nibbles(packed) == want_codes


def test_shapes_and_dtypes():
    x = torch.randn(3, 5, 64)
    packed, scales = quantize_fp4(x)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert scales.shape == (3, 5, 4) and scales.dtype == torch.uint8
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = dequantize_fp4(packed, scales, dtype)
        assert out.shape == x.shape and out.dtype == dtype


def test_nibble_order_low_then_high():
    x = torch.zeros(32)
    x[0], x[1] = 6.0, -3.0  # amax 6: byte 127 (scale 1); codes 7 and 8|5
    packed, scales = quantize_fp4(x)
    assert scales.tolist() == [127, 94]  # the second block is all zero
    assert packed[0].item() == (7 | (13 << 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_bound_on_random_data(dtype):
    x = random_blocks(64, 128, dtype=dtype, seed=2)
    packed, scales = quantize_fp4(x)
    deq = dequantize_fp4(packed, scales, torch.float32)
    s = block_scales(scales)  # [64, 128]
    xf = x.float()
    err = (xf - deq).abs()
    slack = 1 + 2.0**-20
    assert bool((err <= torch.maximum(s, xf.abs()) / 4 * slack).all())
    assert bool((err <= s * slack).all())
    # The bound is not vacuous: errors reach a good fraction of it.
    assert float((err / torch.maximum(s, xf.abs())).max()) > 0.1


def test_dequantize_is_exact_in_every_output_dtype():
    packed, scales = quantize_fp4(random_blocks(8, 64, seed=3))  # values within fp16's range
    ref = dequantize_fp4(packed, scales, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_fp4(packed, scales, dtype).float(), ref)


def test_round_trip_of_representable_values_is_exact():
    g = torch.Generator().manual_seed(4)
    grid = torch.tensor(E2M1_VALUES)
    vals = grid[torch.randint(0, 8, (4, 32), generator=g)] * torch.where(torch.rand(4, 32, generator=g) < 0.5, -1, 1)
    vals[:, 0] = 6.0  # every block's amax is 6 -> scale 1
    vals[:, 16] = 6.0
    out = dequantize_fp4(*quantize_fp4(vals * 0.25), dtype=torch.float32)  # amax 1.5 -> scale 2**-2
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
