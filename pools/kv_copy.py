"""Move KV rows ``buf[tgt_loc] <- buf[src_loc]`` in every per-layer buffer of a pool at once.

Two paths behind :func:`move_kv_cache`:

- ``MoveBackend.NATIVE``: per buffer ``buf[tgt] = buf[src]`` (torch gathers every source row
  before it scatters, so any overlap of ``tgt_loc`` and ``src_loc`` is fine).
- ``MoveBackend.TRITON``: ONE launch of a tiled Triton kernel covers all buffers (all
  layers' K and V, plus scale buffers for FP4 pools). Grid ``(loc_blocks, num_buffers,
  row_tiles)``; a program copies ``BLOCK_LOCS`` rows x ``BLOCK_WORDS`` words of one buffer,
  loading all of its source words before it stores. Words are 8/4/2/1 bytes: the widest
  size that divides every buffer's base address and row stride; when all of those are
  16-byte aligned the kernel tells the compiler so, and each thread moves 16 bytes per
  access (``ld.global.v2.b64``, checked in the generated PTX for sm_90).

Overlap contract of the Triton path: ``tgt_loc`` entries must be distinct (as for the
native path, where a duplicate target gets an unspecified one of its sources). When
``len(tgt_loc) <= SINGLE_BLOCK_MAX_LOCS`` one loc block holds every row, so the result
equals the native path for ANY overlap of ``tgt_loc`` and ``src_loc`` (the in-place case of
speculative decoding). For longer moves, loc blocks run concurrently: ``tgt_loc`` and
``src_loc`` must then be disjoint sets.

Pointer tables (:class:`KVCopyTable`) are built once, at pool init; a move only launches.
Triton decides interpreted vs compiled execution when a function is jitted, so the kernel
is jitted lazily, once per value of ``TRITON_INTERPRET`` (``kernel_for_current_env``): with
``TRITON_INTERPRET=1`` the Triton path runs on CPU tensors (slowly: tests use tiny shapes).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from pools._checks import check_indices

try:  # triton is optional (not installed on every platform)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

__all__ = [
    "MoveBackend",
    "KVCopyTable",
    "build_copy_table",
    "move_kv_cache",
    "move_kv_cache_native",
    "kernel_for_current_env",
    "triton_available",
    "LaunchConfig",
    "launch_config",
    "launch",
    "warmup",
    "SINGLE_BLOCK_MAX_LOCS",
]

# Moves of at most this many rows run as a single loc block (overlap-safe).
SINGLE_BLOCK_MAX_LOCS = 128
# Loc block of longer moves.
_BLOCK_LOCS_LARGE = 32
# Bytes one program moves at most (registers: 32 KiB / 256 threads = 128 B per thread).
_PROGRAM_BYTES = 32 * 1024
_MAX_GRID_YZ = 65535


class MoveBackend(enum.Enum):
    """Which implementation :func:`move_kv_cache` uses."""

    AUTO = "auto"  # TRITON on CUDA when triton is importable, NATIVE otherwise
    NATIVE = "native"  # torch gather/scatter per buffer
    TRITON = "triton"  # one tiled kernel launch; on CPU only under TRITON_INTERPRET=1


@dataclass(frozen=True)
class KVCopyTable:
    """The per-layer buffers of a pool, prepared once for :func:`move_kv_cache`.

    ``data_ptrs``: ``[num_buffers]`` uint64 on ``device``, ``buffers[i].data_ptr()``;
    ``data_strides``: ``[num_buffers]`` int64 on ``device``, bytes of one row (token slot) of
    ``buffers[i]``. ``num_rows`` is the row count every buffer shares; ``word_bytes`` the
    copy unit (8/4/2/1), dividing every base address and row stride; ``align_words`` is 2
    when they are all 16-byte aligned (the kernel then moves 16 bytes per thread access),
    else 1.
    """

    buffers: Tuple[torch.Tensor, ...]  # each [num_rows, ...] contiguous
    data_ptrs: torch.Tensor  # [num_buffers] uint64
    data_strides: torch.Tensor  # [num_buffers] int64, row bytes
    num_rows: int
    max_row_bytes: int
    word_bytes: int
    align_words: int
    device: torch.device

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)


def build_copy_table(buffers: Sequence[torch.Tensor]) -> KVCopyTable:
    """Check ``buffers`` (contiguous, one device, same row count) and build their tables."""
    buffers = tuple(buffers)
    if not buffers:
        raise ValueError("build_copy_table needs at least one buffer, got none")
    if len(buffers) > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} buffers fit one launch, got {len(buffers)}")
    device = buffers[0].device
    num_rows = buffers[0].shape[0] if buffers[0].dim() else 0
    for i, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"buffers[{i}] must be a torch.Tensor, got {type(b).__name__}")
        if b.device != device:
            raise ValueError(f"buffers[{i}] must be on {device} like buffers[0], got {b.device}")
        if b.dim() < 1 or b.shape[0] != num_rows:
            raise ValueError(f"buffers[{i}] must have {num_rows} rows like buffers[0], got shape {list(b.shape)}")
        if not b.is_contiguous():
            raise ValueError(f"buffers[{i}] must be contiguous, got strides {b.stride()}")
    row_bytes = [b[0].nbytes if num_rows else 0 for b in buffers]
    ptrs = [b.data_ptr() for b in buffers]
    align = 16
    while align > 1 and any(x % align for x in row_bytes + ptrs):
        align //= 2
    word = min(align, 8)
    return KVCopyTable(
        buffers=buffers,
        data_ptrs=torch.tensor(ptrs, dtype=torch.uint64).to(device),
        data_strides=torch.tensor(row_bytes, dtype=torch.int64).to(device),
        num_rows=num_rows,
        max_row_bytes=max(row_bytes),
        word_bytes=word,
        align_words=align // word,
        device=device,
    )


def move_kv_cache_native(buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """``buf[tgt_loc] = buf[src_loc]`` for every buffer (no checks; gather before scatter)."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.reshape(-1).long()
    src = src_loc.reshape(-1).long()
    for buf in buffers:
        buf[tgt] = buf[src]


def triton_available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


if tl is not None:

    def _copy_rows_all_buffers(
        data_ptrs,  # [num_buffers] uint64: buffer base addresses
        strides,  # [num_buffers] int64: row bytes of each buffer
        tgt_loc,  # [num_locs] int32/int64
        src_loc,  # [num_locs] int32/int64
        num_locs,
        BLOCK_LOCS: tl.constexpr,
        BLOCK_WORDS: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        ALIGN_WORDS: tl.constexpr,
    ):
        """Program (loc block, buffer, row tile): rows tgt <- src, words of one tile."""
        loc_block = tl.program_id(0)
        buf = tl.program_id(1)
        tile = tl.program_id(2)

        row_words = tl.load(strides + buf) // WORD_BYTES
        raw = tl.load(data_ptrs + buf)
        if WORD_BYTES == 8:
            base = tl.cast(raw, tl.pointer_type(tl.int64))
        elif WORD_BYTES == 4:
            base = tl.cast(raw, tl.pointer_type(tl.int32))
        elif WORD_BYTES == 2:
            base = tl.cast(raw, tl.pointer_type(tl.int16))
        else:
            base = tl.cast(raw, tl.pointer_type(tl.uint8))
        if ALIGN_WORDS > 1:  # every base address and row stride is ALIGN_WORDS words aligned
            base = tl.multiple_of(base, ALIGN_WORDS * WORD_BYTES)
            row_words = tl.multiple_of(row_words, ALIGN_WORDS)

        words = tile * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
        words = tl.max_contiguous(tl.multiple_of(words, BLOCK_WORDS), BLOCK_WORDS)
        locs = loc_block * BLOCK_LOCS + tl.arange(0, BLOCK_LOCS)
        mask_loc = locs < num_locs
        src = tl.load(src_loc + locs, mask=mask_loc, other=0).to(tl.int64)
        tgt = tl.load(tgt_loc + locs, mask=mask_loc, other=0).to(tl.int64)

        mask = mask_loc[:, None] & (words < row_words)[None, :]
        vals = tl.load(base + src[:, None] * row_words + words[None, :], mask=mask)
        tl.store(base + tgt[:, None] * row_words + words[None, :], vals, mask=mask)


_KERNELS: Dict[bool, object] = {}


def kernel_for_current_env():
    """The jitted kernel for the current ``TRITON_INTERPRET`` setting (jitted on first use)."""
    if triton is None:
        raise RuntimeError("the Triton KV-copy path needs the triton package, which is not installed")
    interpret = _interpreting()
    kernel = _KERNELS.get(interpret)
    if kernel is None:
        kernel = _KERNELS[interpret] = triton.jit(_copy_rows_all_buffers)
    return kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and grid of one kernel launch."""

    block_locs: int
    block_words: int
    num_warps: int
    grid: Tuple[int, int, int]


def launch_config(
    table: KVCopyTable, num_locs: int, block_locs: Optional[int] = None, program_bytes: int = _PROGRAM_BYTES
) -> LaunchConfig:
    """Tile sizes for moving ``num_locs`` rows of ``table``'s buffers.

    Default ``block_locs``: one block of ``next_pow2(num_locs)`` rows up to
    ``SINGLE_BLOCK_MAX_LOCS`` (overlap-safe), else 32. A program moves at most
    ``program_bytes`` (a power of two, >= one word per row). Overrides serve tuning.
    """
    if block_locs is None:
        block_locs = max(4, _next_pow2(num_locs)) if num_locs <= SINGLE_BLOCK_MAX_LOCS else _BLOCK_LOCS_LARGE
    if block_locs <= 0 or block_locs & (block_locs - 1):
        raise ValueError(f"block_locs must be a power of two, got {block_locs}")
    row_words = max(1, table.max_row_bytes // table.word_bytes)
    budget_words = max(1, program_bytes // table.word_bytes // block_locs)
    block_words = min(_next_pow2(row_words), 1 << (budget_words.bit_length() - 1))
    tile_bytes = block_locs * block_words * table.word_bytes
    num_warps = 8 if tile_bytes >= 16 * 1024 else 4
    grid = (math.ceil(num_locs / block_locs), table.num_buffers, math.ceil(row_words / block_words))
    return LaunchConfig(block_locs, block_words, num_warps, grid)


def _resolve(backend: MoveBackend, device: torch.device) -> MoveBackend:
    if not isinstance(backend, MoveBackend):
        raise TypeError(f"backend must be a MoveBackend, got {type(backend).__name__}")
    if backend is MoveBackend.AUTO:
        return MoveBackend.TRITON if device.type == "cuda" and triton is not None else MoveBackend.NATIVE
    if backend is MoveBackend.TRITON:
        if triton is None:
            raise RuntimeError("MoveBackend.TRITON needs the triton package, which is not installed")
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(f"MoveBackend.TRITON needs a CUDA device or TRITON_INTERPRET=1, buffers are on {device}")
    return backend


def move_kv_cache(
    table: KVCopyTable,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
    backend: MoveBackend = MoveBackend.AUTO,
    check: bool = True,
) -> None:
    """Copy rows ``src_loc -> tgt_loc`` in every buffer of ``table`` (see the module docstring
    for the overlap contract of the Triton path).

    ``tgt_loc``/``src_loc``: 1-D integer tensors of equal length on the table's device.
    ``check``: also verify every index lies in ``[0, num_rows)`` (synchronises the device).
    """
    backend = _resolve(backend, table.device)
    for name, loc in (("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        if not isinstance(loc, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(loc).__name__}")
        if loc.device != table.device:
            raise ValueError(f"{name} must be on {table.device}, got {loc.device}")
        if loc.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must have dtype int32 or int64, got {loc.dtype}")
        if loc.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {list(loc.shape)}")
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc and src_loc must have equal lengths, got {tgt_loc.numel()} and {src_loc.numel()}")
    if check:
        check_indices("tgt_loc", tgt_loc, table.num_rows)
        check_indices("src_loc", src_loc, table.num_rows)
    num_locs = tgt_loc.numel()
    if num_locs == 0:
        return
    if backend is MoveBackend.NATIVE:
        move_kv_cache_native(table.buffers, tgt_loc, src_loc)
        return
    launch(table, tgt_loc.contiguous(), src_loc.contiguous(), launch_config(table, num_locs))


def launch(table: KVCopyTable, tgt_loc: torch.Tensor, src_loc: torch.Tensor, cfg: LaunchConfig) -> None:
    """Launch the kernel with ``cfg`` as is: no checks (``move_kv_cache`` is the checked
    entry point; this one serves warm-up and tuning). ``cfg.grid[0] * cfg.block_locs`` must
    cover ``len(tgt_loc)``."""
    num_locs = tgt_loc.numel()
    kernel = kernel_for_current_env()
    kernel[cfg.grid](
        table.data_ptrs,
        table.data_strides,
        tgt_loc,
        src_loc,
        num_locs,
        BLOCK_LOCS=cfg.block_locs,
        BLOCK_WORDS=cfg.block_words,
        WORD_BYTES=table.word_bytes,
        ALIGN_WORDS=table.align_words,
        num_warps=cfg.num_warps,
    )


def warmup(table: KVCopyTable, num_locs: Optional[Sequence[int]] = None) -> None:
    """Compile the kernel variants a pool will use (CUDA only; a no-op elsewhere).

    Moves the padding slot 0 onto itself, which changes nothing.
    """
    if table.device.type != "cuda" or triton is None:
        return
    for n in num_locs or (1, SINGLE_BLOCK_MAX_LOCS, SINGLE_BLOCK_MAX_LOCS + 1):
        zeros = torch.zeros(n, dtype=torch.int64, device=table.device)
        launch(table, zeros, zeros, launch_config(table, n))
