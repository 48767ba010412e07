"""FP4 (e2m1) quantization with 16-element blocks and float8_e4m3fn block scales.

Format (the contract shared with the MLA pools, see ``notes/fp4_api.md``)
-----------------------------------------------------------------------
``x`` of shape ``[..., n]`` is cut into blocks of ``FP4_BLOCK = 16`` consecutive elements of
its last dimension.

- ``scales``: uint8 ``[..., n // 16]``, the ``torch.float8_e4m3fn`` bit pattern of each
  block's scale ``S = roundup_e4m3(amax / 6)`` where ``amax`` is the block's largest
  ``|x|`` and ``roundup_e4m3`` is the smallest e4m3 value >= its argument (so no element
  of the block exceeds ``6 * S``, the largest e2m1 magnitude). An all-zero block gets
  ``S = 0`` (bit pattern 0) and dequantizes to zeros exactly. The smallest positive
  scale is the e4m3 subnormal ``2**-9``; the largest is 448, so blocks with
  ``amax > 6 * 448 = 2688`` saturate (their elements are clamped to ``+-2688``).
- ``packed``: uint8 ``[..., n // 2]``; byte ``i`` holds element ``2i`` in its LOW nibble and
  element ``2i + 1`` in its HIGH nibble. A nibble is ``sign << 3 | m`` where ``m`` indexes
  the e2m1 magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` and is the nearest one to
  ``|x| / S`` (a tie goes to the smaller magnitude). Zero magnitudes never carry the sign
  bit.
- ``dequantize_fp4`` returns ``e2m1(code) * S``; that product is exact in bf16, fp16 and
  fp32 (it has at most 6 significant bits and lies in ``[2**-10, 2688]``).

Error bound (tested on random data in ``tests/pools/test_fp4.py``)
-------------------------------------------------------------------
For every element ``x`` of a block with scale ``S`` and ``|x| <= 2688``::

    |x - dequantize_fp4(*quantize_fp4(x))| <= max(S, |x|) / 4

Proof: ``q = |x| / S <= 6``. The e2m1 grid has spacing 0.5 on ``[0, 2]``, 1 on ``[2, 4]``
and 2 on ``[4, 6]``, so rounding to the nearest grid point errs by at most half a spacing:
``0.25 S`` when ``q <= 2``; ``0.5 S <= |x| / 4`` when ``2 < q <= 4`` (as ``|x| > 2 S``);
``S <= |x| / 4`` when ``4 < q <= 6`` (as ``|x| > 4 S``). The same cases give the plain
``|x - deq| <= S``. fp32 rounding of ``|x| / S`` can only flip a value that sits on a
rounding midpoint (error exactly half a spacing either way), and when fp32 ``amax / 6``
rounds below the true quotient the largest element is clamped to ``6 S``, erring by
``~2**-24 |x|``; the test allows a relative slack of ``2**-20``.

Non-finite inputs are not checked (a data-dependent check would synchronise the device):
their codes are unspecified.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_BLOCK", "E2M1_VALUES", "quantize_fp4", "dequantize_fp4"]

FP4_BLOCK = 16

# e2m1 magnitudes, indexed by the low 3 bits of a code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes: bucketize(|q|) is the nearest magnitude index.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _roundup_e4m3(s: torch.Tensor) -> torch.Tensor:
    """Smallest float8_e4m3fn value >= ``s`` (fp32, 0 <= s <= 448), as uint8 bit patterns."""
    nearest = s.to(torch.float8_e4m3fn)
    bits = nearest.view(torch.uint8)
    # For non-negative e4m3 values the bit pattern is monotonic: +1 is the next value up.
    too_small = nearest.to(torch.float32) < s
    return torch.where(too_small, bits + 1, bits)


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., n]`` (fp32/bf16/fp16, ``n`` a multiple of 16) to e2m1.

    Returns ``(packed, scales)``: uint8 ``[..., n // 2]`` and uint8 ``[..., n // 16]``
    (float8_e4m3fn bit patterns), on ``x``'s device. See the module docstring for the format.
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
    scale_bits = _roundup_e4m3((amax / _E2M1_MAX).clamp(max=_E4M3_MAX))  # [..., n/16, 1]
    scale = scale_bits.view(torch.float8_e4m3fn).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks.abs() / safe).clamp(max=_E2M1_MAX)  # [..., n/16, 16]
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(q, midpoints).to(torch.uint8)  # [..., n/16, 16], 0..7
    sign = ((blocks < 0) & (mag > 0)).to(torch.uint8)
    codes = (sign << 3 | mag).reshape(*lead, n // 2, 2)  # [..., n/2, 2]
    packed = codes[..., 0] | (codes[..., 1] << 4)  # [..., n/2]
    return packed.contiguous(), scale_bits.reshape(*lead, n // FP4_BLOCK).contiguous()


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
    lut = torch.cat([lut, -lut])  # [16]: code -> value
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, n)  # [..., n]
    values = lut[codes.long()].reshape(*lead, n // FP4_BLOCK, FP4_BLOCK)  # [..., n/16, 16]
    scale = scales.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)  # [..., n/16, 1]
    return (values * scale).reshape(*lead, n).to(dtype)
