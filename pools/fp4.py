"""FP4 (e2m1) quantization with 16-element blocks and UE8M0 (power-of-two) block scales.

This is the seed's FP4 KV format, the one SGLang's ``KVFP4QuantizeUtil`` (its block-16 "MXFP4"
recipe, ``FP4MXBlock16KVQuantizeUtil`` in ``sglang/srt/layers/quantization/kvfp4_tensor.py``)
writes, byte for byte, so FP4 pages move between a kvtransfer pool and an SGLang pool unchanged.

Format
------
``x`` of shape ``[..., n]`` is cut into blocks of ``FP4_BLOCK = 16`` consecutive elements of its
last dimension. All arithmetic is fp32 (bf16 and fp16 inputs are widened exactly first).

- ``scales``: uint8 ``[..., n // 16]``, one UE8M0 byte per block: ``E + 127`` where::

      E = ceil(log2(max(amax / 6, 1e-10)))     # amax = the block's largest |x|

  so the block's scale is ``S = 2**E`` and ``|x| / S <= 6`` (the largest e2m1 magnitude). The
  lower clamp makes ``E >= -33`` (byte ``>= 94``): an all-zero block gets byte 94 and every
  block whose ``amax < 6e-10`` shares the scale ``2**-33``. ``E`` is at most 126 for finite
  input (byte ``<= 253``), so nothing saturates.
- ``packed``: uint8 ``[..., n // 2]``; byte ``i`` holds element ``2i`` in its LOW nibble and
  element ``2i + 1`` in its HIGH nibble. A nibble is ``sign << 3 | m``: ``sign`` is 1 for every
  negative ``x`` (also those whose magnitude rounds to 0: code 8, "-0"), ``m`` is the number of
  midpoints ``(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)`` that ``|x| / S`` reaches (``>=``), i.e.
  the nearest of the e2m1 magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with ties going to the
  LARGER one; ``|x| / S`` above 6 (see below) gives 6.
- ``dequantize_fp4`` returns ``e2m1(code) * 2**(byte - 127)`` computed in fp32 and cast to the
  output dtype: exact in fp32 and bf16 (two significant bits, exponents within range), exact in
  fp16 while the value lies in fp16's range.

fp32 rounding: SGLang's quantizer is ``torch.compile``d, and the generated kernels compute bf16 /
fp16 pointwise math in fp32; this one computes ``amax / 6``, ``log2`` and ``ceil`` in fp32 too.
Where a block's amax lies a sliver above ``6 * 2**k`` (relative ``< 2**-18``, narrower for small
``|k|``), the fp32 ``log2`` rounds to exactly ``k`` and the block keeps ``E = k``; its largest
elements land a hair above 6 and get code 7 (6). A GPU's ``log2`` may differ from the CPU's by
an ulp inside that sliver; elsewhere the bytes are identical. (SGLang run eagerly on bf16 input
would round ``log2`` to bf16 and pick the smaller exponent in a much wider sliver.)

Error bound (tested on random data in ``tests/pools/test_fp4.py``)
-------------------------------------------------------------------
For every element ``x`` of a block with scale ``S = 2**E``::

    |x - dequantize_fp4(*quantize_fp4(x))| <= max(S, |x|) / 4

Proof: ``q = |x| / S <= 6``. The e2m1 grid has spacing 0.5 on ``[0, 2]``, 1 on ``[2, 4]`` and
2 on ``[4, 6]``, so rounding to the nearest grid point (either way on a tie) errs by at most
half a spacing: ``0.25 S`` when ``q <= 2``; ``0.5 S <= |x| / 4`` when ``2 < q <= 4`` (as
``|x| > 2 S``); ``S <= |x| / 4`` when ``4 < q <= 6`` (as ``|x| > 4 S``). The same cases give the
plain ``|x - deq| <= S``. In the fp32 sliver above, ``q`` exceeds 6 by a relative ``< 2**-18``
and is rounded to 6, erring by far less than ``|x| / 4``; the test allows a relative slack of
``2**-20`` for fp32 rounding. Power-of-two scales cost accuracy against finer (e4m3) scales: a
block's ``amax / S`` lies in ``(3, 6]``, not always near 6.

Non-finite inputs are not checked (a data-dependent check would synchronise the device): their
codes are unspecified.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_BLOCK", "FP4_SCALE_BIAS", "E2M1_VALUES", "quantize_fp4", "dequantize_fp4"]

FP4_BLOCK = 16
FP4_SCALE_BIAS = 127  # UE8M0: scale byte = exponent + 127

# e2m1 magnitudes, indexed by the low 3 bits of a code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes: the number reached (>=) is the magnitude index.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_MAX = 6.0
_SCALE_FLOOR = 1e-10  # lower clamp of amax / 6 (SGLang's): exponents >= -33

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., n]`` (fp32/bf16/fp16, ``n`` a multiple of 16) to e2m1.

    Returns ``(packed, scales)``: uint8 ``[..., n // 2]`` and uint8 ``[..., n // 16]`` (UE8M0
    exponent bytes), on ``x``'s device. See the module docstring for the format.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must have dtype float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % FP4_BLOCK != 0:
        raise ValueError(f"x's last dimension must be a multiple of {FP4_BLOCK}, got shape {list(x.shape)}")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    blocks = x.to(torch.float32).reshape(*lead, n // FP4_BLOCK, FP4_BLOCK)  # [..., n/16, 16]
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., n/16, 1]
    exp = torch.ceil(torch.log2((amax / _E2M1_MAX).clamp(min=_SCALE_FLOOR)))  # [..., n/16, 1], -33..126
    q = blocks / torch.exp2(exp)  # [..., n/16, 16], exact (power-of-two divisor)
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(q.abs(), midpoints, right=True).to(torch.uint8)  # [..., n/16, 16], 0..7
    sign = (q < 0).to(torch.uint8)
    codes = (sign << 3 | mag).reshape(*lead, n // 2, 2)  # [..., n/2, 2]
    packed = codes[..., 0] | (codes[..., 1] << 4)  # [..., n/2]
    scales = (exp + FP4_SCALE_BIAS).to(torch.uint8).reshape(*lead, n // FP4_BLOCK)  # [..., n/16]
    return packed.contiguous(), scales.contiguous()


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`: uint8 ``packed`` ``[..., n // 2]`` and uint8 ``scales``
    ``[..., n // 16]`` -> ``[..., n]`` of ``dtype`` (fp32/bf16/fp16)."""
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(
            f"packed and scales must be torch.Tensors, got {type(packed).__name__}, {type(scales).__name__}"
        )
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"packed and scales must have dtype torch.uint8, got {packed.dtype}, {scales.dtype}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if packed.dim() == 0 or scales.dim() != packed.dim():
        raise ValueError(f"packed and scales must have the same rank >= 1, got {list(packed.shape)}, {list(scales.shape)}")
    half = FP4_BLOCK // 2
    lead, nbytes = tuple(packed.shape[:-1]), packed.shape[-1]
    if tuple(scales.shape[:-1]) != lead or nbytes != scales.shape[-1] * half:
        raise ValueError(
            f"scales must have shape {list(lead) + [nbytes // half]} for packed {list(packed.shape)} "
            f"(one scale per {FP4_BLOCK} elements), got {list(scales.shape)}"
        )
    n = nbytes * 2
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    lut = torch.cat([lut, -lut])  # [16]: code -> value (code 8 is -0.0)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, n)  # [..., n]
    values = lut[codes.long()].reshape(*lead, n // FP4_BLOCK, FP4_BLOCK)  # [..., n/16, 16]
    scale = torch.exp2(scales.to(torch.float32) - FP4_SCALE_BIAS).unsqueeze(-1)  # [..., n/16, 1]
    return (values * scale).reshape(*lead, n).to(dtype)
