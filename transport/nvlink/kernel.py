"""The NVLink row-scatter kernel: one launch copies a batch of byte rows into peer memory.

Row table
---------
A batch reaches the kernel as ONE contiguous int64 tensor on the writing GPU::

    rows  # [3, num_rows] int64
    rows[0]  # [num_rows] source addresses (local GPU memory)
    rows[1]  # [num_rows] destination addresses (the peer's memory, mapped by CUDA IPC)
    rows[2]  # [num_rows] bytes to copy (> 0); rows may differ in length

Addresses are absolute: :func:`build_row_table` gathers them on the host from the pointer
tables prepared at register/connect time (``base[region] + offset``), so a batch costs one
numpy gather and one host-to-device copy, and the kernel reads three int64 per row.

Copy paths (:class:`CopyPath`, chosen per batch by :func:`choose_path`)
---------------------------------------------------------------------
- ``VEC16``: every address and length is a multiple of 16 bytes. The kernel moves int64
  elements with ``tl.multiple_of`` hints of 16 bytes on the row pointers and 2 elements on
  the row lengths, so loads and stores compile to 16-byte vector accesses.
- ``VEC8``: every address and length is a multiple of 8 bytes: 8-byte accesses.
- ``BYTES``: anything else; a correct, slower byte-by-byte path.

Tiling
------
A tile is ``BLOCK_R`` rows; a program copies them at once as a ``[BLOCK_R, BLOCK_C]`` tile of elements and
walks long rows in steps of ``BLOCK_C`` (the loop runs to the longest row of its tile). Small
rows (one head slice, 256 B) therefore keep several rows of loads in flight per program;
long rows (whole pages) keep ``BLOCK_C`` elements per row in flight.

Strided table (factored batches)
--------------------------------
A batch of buffer pairs x slots (``transport.base.StridedBatch``) reaches
:func:`scatter_strided` as ONE int64 tensor of ``5 * P + 2 * S`` elements, built on the host
in O(P + S) by :func:`build_strided_table`::

    table[0 * P : 1 * P]  # [P] source address of slot 0 of each pair (base + offset)
    table[1 * P : 2 * P]  # [P] source stride (bytes between slots)
    table[2 * P : 3 * P]  # [P] destination address of slot 0 (peer memory mapped here)
    table[3 * P : 4 * P]  # [P] destination stride
    table[4 * P : 5 * P]  # [P] bytes per row (> 0)
    table[5 * P : 5 * P + S]  # [S] source slots
    table[5 * P + S :]        # [S] destination slots

The two parts may also live apart (:func:`scatter_strided_split`): the pair part, which
depends only on the buffer pairs (the two sides' layouts), built and uploaded once and kept on
the GPU; the slot part (``[2 * S]``: source slots, then destination slots) written per write
at some element ``slot_base`` of a ring of slots on the GPU (:mod:`transport.nvlink.direct`).

Row ``r`` (of ``P * S``, pair-major) is pair ``p = r // S``, slot ``s = r % S``: the kernel
computes ``src = table[p] + table[5P + s] * table[P + p]`` (and the same for the destination)
itself, then copies as the row-table kernel does. Its copy path comes from
:func:`choose_path` over the pair part alone: a slot multiplies a stride, so addresses of
every slot share the alignment of the pair's address and stride.

Staged copies (gather / scatter through a staging buffer)
---------------------------------------------------------
The same two kernels also serve the staged engine (:mod:`transport.nvlink.staged`), which moves
a large batch as contiguous chunks: *gather* copies rows ``[begin, end)`` from their sources
into a staging buffer, back to back, and *scatter* copies them from a staging buffer to their
destinations. A row's place in the staging stream is its byte offset ``off(r)`` among all rows
(an exclusive prefix sum of the lengths); a chunk of rows starting at row ``b`` lands at
``stage + off(r) - off(b)`` (:class:`Stage`). The tables carry ``off`` as one more section:

    rows[3]  # [num_rows] off(r), the row table's staged form is [4, num_rows]

and the strided table's staged form has a sixth pair section, ``[6 * P + 2 * S]`` in all::

    table[5 * P : 6 * P]  # [P] bytes of one slot over the pairs before p (exclusive prefix sum of the lengths)
    table[6 * P :]        # [2 * S] the slot part, as above

Rows are pair-major, so ``off(p, s) = S * table[5 * P + p] + s * bytes(p)``: the pair part
depends on the layouts alone, and a staged write's pair part stays resident like a direct
one's (:mod:`transport.nvlink.direct`).

CPU tensors run the same kernel in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
set before triton is imported: tests do so in a subprocess, with tiny shapes, to check the
indexing without a GPU.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from transport.nvlink.launch import Relauncher

try:  # triton is a Linux x86-64 dependency; the pure parts below work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "CopyPath",
    "empty_for",
    "Stage",
    "StageMode",
    "KernelConfig",
    "LaunchPlan",
    "SplitLaunch",
    "build_row_table",
    "build_strided_table",
    "choose_path",
    "check_row_table",
    "plan_launch",
    "plan_shape",
    "scatter_rows",
    "scatter_strided",
    "scatter_strided_split",
]


def empty_for(stream, shape, dtype, device: int):
    """An uninitialised tensor on GPU ``device`` for work queued on ``stream`` (a torch stream),
    allocated for that stream: the caching allocator orders a block's reuse only on the stream
    it was allocated for, so a block taken on the caller's stream could still be written by work
    queued there (a model's temporaries, freed as soon as launched), which ``stream`` does not
    wait for."""
    import torch

    with torch.cuda.stream(stream):
        return torch.empty(shape, dtype=dtype, device=torch.device("cuda", device))


class CopyPath(enum.Enum):
    """The alignment every row of a batch shares, in bytes."""

    VEC16 = 16
    VEC8 = 8
    BYTES = 1

    @property
    def elem_bytes(self) -> int:
        return 1 if self is CopyPath.BYTES else 8


class StageMode(enum.Enum):
    """Which side of a row goes through the staging buffer."""

    GATHER = 1  # sources -> staging buffer
    SCATTER = 2  # staging buffer -> destinations


@dataclass(frozen=True)
class Stage:
    """The staging side of one gather or scatter launch: the buffer's address and the staging
    offset of the chunk's first row (``off(begin)``, subtracted from every row's offset)."""

    mode: StageMode
    address: int
    origin: int


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of :func:`scatter_rows`.

    ``tile_bytes`` is the data one program moves per loop step (``BLOCK_R * BLOCK_C``
    elements); ``max_block_c_bytes`` caps the per-row step for long rows. ``max_programs``
    > 0 launches at most that many programs, each walking tiles with a grid stride (0: one
    program per tile). ``load_cache`` / ``store_cache`` are Triton cache modifiers ("" is
    the default policy).
    """

    tile_bytes: int = 8192
    max_block_c_bytes: int = 8192
    num_warps: int = 4
    max_programs: int = 0
    load_cache: str = ""
    store_cache: str = ""

    def __post_init__(self):
        for name in ("tile_bytes", "max_block_c_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not isinstance(self.max_programs, int) or self.max_programs < 0:
            raise ValueError(f"max_programs must be an int >= 0, got {self.max_programs!r}")
        if self.load_cache not in ("", ".ca", ".cg", ".cv"):
            raise ValueError(f"load_cache must be one of '', '.ca', '.cg', '.cv', got {self.load_cache!r}")
        if self.store_cache not in ("", ".wb", ".cg", ".cs", ".wt"):
            raise ValueError(f"store_cache must be one of '', '.wb', '.cg', '.cs', '.wt', got {self.store_cache!r}")


@dataclass(frozen=True)
class LaunchPlan:
    """What :func:`plan_launch` decided for one batch."""

    path: CopyPath
    block_r: int  # rows per tile
    block_c: int  # elements per row per loop step
    num_tiles: int  # ceil(num_rows / block_r)
    num_programs: int  # programs launched; each walks tiles pid, pid + num_programs, ...
    load_cache: str = ""
    store_cache: str = ""


def build_row_table(
    src_base: np.ndarray,
    src_region: np.ndarray,
    src_offset: np.ndarray,
    dst_base: np.ndarray,
    dst_region: np.ndarray,
    dst_offset: np.ndarray,
    length: np.ndarray,
    out: np.ndarray | None = None,
    staged: bool = False,
) -> np.ndarray:
    """Gather absolute row addresses: ``rows[0] = src_base[src_region] + src_offset`` etc.

    ``src_base`` / ``dst_base`` are the pointer tables (int64, indexed by region id); the
    region ids must already be checked (``WriteBatch.check_bounds``). ``staged`` adds the
    fourth row, each row's staging offset (exclusive prefix sum of the lengths). ``out`` may be
    a preallocated ``[3, n]`` (``[4, n]``) int64 array (a pinned staging buffer's numpy view).
    """
    n, k = int(length.size), 4 if staged else 3
    if out is None:
        out = np.empty((k, n), dtype=np.int64)  # [3 or 4, num_rows]
    elif out.shape != (k, n) or out.dtype != np.int64:
        raise ValueError(f"out must be a [{k}, {n}] int64 array, got {list(out.shape)} {out.dtype}")
    np.add(np.take(src_base, src_region), src_offset, out=out[0])
    np.add(np.take(dst_base, dst_region), dst_offset, out=out[1])
    out[2] = length
    if staged and n:
        out[3, 0] = 0
        np.cumsum(length[:-1], out=out[3, 1:])
    return out


def build_strided_table(
    src_base: np.ndarray,
    dst_base: np.ndarray,
    pairs: tuple,
    src_slot: np.ndarray,
    dst_slot: np.ndarray,
    out: np.ndarray | None = None,
    staged: bool = False,
) -> np.ndarray:
    """The ``[5 * P + 2 * S]`` strided table (module doc) of a factored batch.

    ``pairs`` = ``(src_region, src_offset, src_stride, dst_region, dst_offset, dst_stride,
    length)``, ``[P]`` each; region ids already checked against the pointer tables. ``staged``:
    the ``[6 * P + 2 * S]`` form, whose sixth pair section is each pair's staging prefix (bytes
    of one slot over the pairs before it). ``out`` may be a preallocated int64 array of that
    size (a pinned staging buffer's view).
    """
    src_region, src_offset, src_stride, dst_region, dst_offset, dst_stride, length = pairs
    p, n = int(length.size), int(src_slot.size)
    size, k = strided_table_size(p, n, staged), 6 if staged else 5
    if out is None:
        out = np.empty(size, dtype=np.int64)  # [5 or 6 * P + 2 * S]
    elif out.shape != (size,) or out.dtype != np.int64:
        raise ValueError(f"out must be a [{size}] int64 array, got {list(out.shape)} {out.dtype}")
    head = out[: k * p].reshape(k, p)  # [5 or 6, P] the pair part
    np.add(np.take(src_base, src_region), src_offset, out=head[0])
    head[1] = src_stride
    np.add(np.take(dst_base, dst_region), dst_offset, out=head[2])
    head[3] = dst_stride
    head[4] = length
    if staged and p:
        head[5, 0] = 0
        np.cumsum(length[:-1], out=head[5, 1:])
    out[k * p : k * p + n] = src_slot
    out[k * p + n : k * p + 2 * n] = dst_slot
    return out


def choose_path(rows: np.ndarray) -> CopyPath:
    """The widest access every row allows: VEC16 when all addresses and lengths are 16-byte
    multiples, VEC8 for 8-byte multiples, else BYTES."""
    if rows.size == 0:
        return CopyPath.VEC16
    bits = int(np.bitwise_or.reduce(rows, axis=None))
    if bits & 15 == 0:
        return CopyPath.VEC16
    if bits & 7 == 0:
        return CopyPath.VEC8
    return CopyPath.BYTES


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def plan_launch(num_rows: int, max_len: int, path: CopyPath, config: KernelConfig) -> LaunchPlan:
    """Tile shape for a batch whose longest row is ``max_len`` bytes."""
    if num_rows < 0 or (num_rows and max_len <= 0):
        raise ValueError(f"need num_rows >= 0 and max_len > 0, got {num_rows}, {max_len}")
    eb = path.elem_bytes
    # Short rows: one step covers the row; long rows: steps of max_block_c_bytes.
    block_c = min(_pow2_at_least(max(1, -(-max_len // eb))), config.max_block_c_bytes // eb)
    block_c = max(block_c, 16 // eb if path is not CopyPath.BYTES else 16)
    block_r = max(1, (config.tile_bytes // eb) // block_c)
    num_tiles = -(-num_rows // block_r)
    programs = min(num_tiles, config.max_programs) if config.max_programs else num_tiles
    return LaunchPlan(path, block_r, block_c, num_tiles, programs, config.load_cache, config.store_cache)


def plan_shape(max_len: int, path: CopyPath, config: KernelConfig) -> LaunchPlan:
    """The tile shape of :func:`plan_launch` for rows of at most ``max_len`` bytes, whatever
    their number: ``num_tiles`` 0 and ``num_programs`` the config's cap (0: one program per
    tile), which :func:`scatter_strided_split` applies to each launch's rows."""
    plan = plan_launch(1, max_len, path, config)
    return LaunchPlan(path, plan.block_r, plan.block_c, 0, config.max_programs, config.load_cache,
                      config.store_cache)


def _check_device(t, name: str, device) -> None:
    import torch

    want = torch.device(device)
    if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
        raise ValueError(f"{name} must be on {want}, got {t.device}")


def check_row_table(rows, device, staged: bool = False) -> None:
    """The one shape/dtype/device check before a launch: ``rows`` is a contiguous
    ``[3, num_rows]`` (``[4, num_rows]`` when ``staged``) int64 tensor on ``device``."""
    import torch

    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dtype != torch.int64:
        raise TypeError(f"rows must have dtype torch.int64, got {rows.dtype}")
    k = 4 if staged else 3
    if rows.dim() != 2 or rows.shape[0] != k:
        raise ValueError(f"rows must have shape [{k}, num_rows], got {list(rows.shape)}")
    if not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous, got strides {tuple(rows.stride())}")
    _check_device(rows, "rows", device)


def _copy_rows_body(
    src, dst, nbytes,
    ALIGN: tl.constexpr, BLOCK_C: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` for the ``[BLOCK_R]`` rows
    of one tile, ``BLOCK_C`` elements of ``ALIGN`` bytes (1: bytes, else 8-byte words with
    ``ALIGN``-byte alignment hints) per step. Shared by both kernels; inlined by Triton."""
    cols = tl.arange(0, BLOCK_C)  # [BLOCK_C]
    if ALIGN == 1:
        sp = src.to(tl.pointer_type(tl.uint8))
        dp = dst.to(tl.pointer_type(tl.uint8))
        n = nbytes
    else:
        sp = tl.multiple_of(src.to(tl.pointer_type(tl.int64)), [ALIGN])
        dp = tl.multiple_of(dst.to(tl.pointer_type(tl.int64)), [ALIGN])
        n = tl.multiple_of(nbytes >> 3, [ALIGN // 8])  # [BLOCK_R] elements
    steps = tl.cdiv(tl.max(n, axis=0), BLOCK_C)
    for k in range(0, steps):
        c = k * BLOCK_C + cols  # [BLOCK_C]
        m = c[None, :] < n[:, None]  # [BLOCK_R, BLOCK_C]
        v = tl.load(sp[:, None] + c[None, :], mask=m, cache_modifier=LOAD_CACHE)
        tl.store(dp[:, None] + c[None, :], v, mask=m, cache_modifier=STORE_CACHE)


# The kernels call it by this name; triton.jit follows TRITON_INTERPRET as set at import, the
# same condition _kernel requires for the interpreter.
_copy_rows = triton.jit(_copy_rows_body) if triton is not None else None


def _scatter_rows_body(
    rows_ptr, n_rows, row_begin, row_end, num_tiles, stage: tl.int64, stage_origin: tl.int64,
    STAGE: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    LOAD_CACHE: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    """Copy the rows of tiles ``pid, pid + num_programs, ...`` (tile t: rows ``row_begin +
    [t * BLOCK_R, (t + 1) * BLOCK_R)`` below ``row_end`` of the row table; see the module doc).
    ``STAGE`` 0: source to destination; 1 (gather): source to ``stage``; 2 (scatter): ``stage``
    to destination."""
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        r = tl.arange(0, BLOCK_R).to(tl.int64) + tile * BLOCK_R + row_begin  # [BLOCK_R] rows (int64)
        ok = r < row_end
        nbytes = tl.load(rows_ptr + (r + n_rows) + n_rows, mask=ok, other=0)
        if STAGE == 0:
            src = tl.load(rows_ptr + r, mask=ok, other=0)  # [BLOCK_R] addresses
            dst = tl.load(rows_ptr + n_rows + r, mask=ok, other=0)
        else:
            staged = stage + tl.load(rows_ptr + 3 * n_rows + r, mask=ok, other=0) - stage_origin
            if STAGE == 1:
                src = tl.load(rows_ptr + r, mask=ok, other=0)
                dst = staged
            else:
                src = staged
                dst = tl.load(rows_ptr + n_rows + r, mask=ok, other=0)
        _copy_rows(src, dst, nbytes, ALIGN, BLOCK_C, LOAD_CACHE, STORE_CACHE)


def _scatter_strided_body(
    tab_ptr, slots_ptr, slot_base, n_pairs, n_slots, row_begin, row_end, num_tiles,
    stage: tl.int64, stage_origin: tl.int64,
    STAGE: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    LOAD_CACHE: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    """Copy rows ``p * S + s`` of tiles ``pid, pid + num_programs, ...`` (offset by
    ``row_begin``, below ``row_end``), computing each row's addresses from the pair part at
    ``tab_ptr`` and the slot part at ``slots_ptr + slot_base`` (module doc; one table: the same
    tensor, ``slot_base = 5 * P``); ``STAGE`` as in the row-table kernel."""
    slot_ptr = slots_ptr + slot_base
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        r = tl.arange(0, BLOCK_R).to(tl.int64) + tile * BLOCK_R + row_begin  # [BLOCK_R] rows (int64)
        ok = r < row_end
        p = tl.where(ok, r // n_slots, 0)  # [BLOCK_R] pair of each row
        s = tl.where(ok, r - p * n_slots, 0)  # [BLOCK_R] slot position of each row
        nbytes = tl.load(tab_ptr + 4 * n_pairs + p, mask=ok, other=0)
        src = tl.load(tab_ptr + p, mask=ok, other=0) + tl.load(slot_ptr + s, mask=ok, other=0) * tl.load(
            tab_ptr + n_pairs + p, mask=ok, other=0)
        dst = tl.load(tab_ptr + 2 * n_pairs + p, mask=ok, other=0) + tl.load(
            slot_ptr + n_slots + s, mask=ok, other=0) * tl.load(tab_ptr + 3 * n_pairs + p, mask=ok, other=0)
        if STAGE != 0:
            staged = stage + n_slots * tl.load(tab_ptr + 5 * n_pairs + p, mask=ok, other=0) + s * nbytes - stage_origin
            if STAGE == 1:
                dst = staged
            else:
                src = staged
        _copy_rows(src, dst, nbytes, ALIGN, BLOCK_C, LOAD_CACHE, STORE_CACHE)


_KERNELS: dict = {}
_INTS = {  # the integer parameters of each kernel, all unspecialized (transport.nvlink.launch)
    "_scatter_rows_body": ["n_rows", "row_begin", "row_end", "num_tiles", "stage", "stage_origin"],
    "_scatter_strided_body": ["slot_base", "n_pairs", "n_slots", "row_begin", "row_end", "num_tiles", "stage",
                              "stage_origin"],
}


def _kernel(interpret: bool, body=None):
    """The kernel: a :class:`~transport.nvlink.launch.Relauncher` of the jitted body, or
    Triton's interpreter for CPU tensors (tests)."""
    if triton is None:
        raise RuntimeError("the NVLink copy kernel needs triton (pip install triton); it is not installed")
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("CPU row tables run only in Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
    body = _scatter_rows_body if body is None else body
    key = (interpret, body.__name__)
    if key not in _KERNELS:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _KERNELS[key] = InterpretedFunction(body)
        else:  # one compiled variant whatever the integers (sizes, row ranges, staging addresses)
            _KERNELS[key] = Relauncher(triton.jit(body, do_not_specialize=_INTS[body.__name__]))
    return _KERNELS[key]


def _run(kernel, grid: int, table, device, stream, args: tuple, constexprs: tuple, num_warps: int) -> None:
    """Launch on ``stream`` (a torch stream of ``device``; None: the current one), or in the
    interpreter for a CPU ``table``."""
    if table.device.type == "cpu":
        kernel[(grid,)](*args, **dict(constexprs), num_warps=num_warps)
        return
    import torch

    index = torch.device(device).index if not isinstance(device, int) else device
    kernel(grid, torch.cuda.current_stream(index) if stream is None else stream, index, args, constexprs, num_warps)


def _range(n: int, begin: int, end, plan: LaunchPlan) -> tuple[int, int]:
    """Check ``[begin, end)`` against ``n`` rows and the plan (one of :func:`plan_shape`, with
    ``num_tiles`` 0, covers any number); return it with ``end`` filled in."""
    end = n if end is None else int(end)
    begin = int(begin)
    if not 0 <= begin <= end <= n:
        raise ValueError(f"row range [{begin}, {end}) must lie within [0, {n}]")
    if plan.num_tiles and plan.num_tiles * plan.block_r < end - begin:
        raise ValueError(f"plan covers {plan.num_tiles * plan.block_r} rows, the range has {end - begin}")
    return begin, end


def _constexprs(mode: int, plan: LaunchPlan) -> tuple:
    return (("STAGE", mode), ("ALIGN", plan.path.value), ("BLOCK_R", plan.block_r), ("BLOCK_C", plan.block_c),
            ("LOAD_CACHE", plan.load_cache), ("STORE_CACHE", plan.store_cache))


def _stage_args(stage: Optional[Stage]) -> tuple[int, int, int]:
    if stage is None:
        return 0, 0, 0
    if not isinstance(stage, Stage):
        raise TypeError(f"stage must be a Stage or None, got {type(stage).__name__}")
    return stage.mode.value, int(stage.address), int(stage.origin)


def scatter_rows(rows, plan: LaunchPlan, device, num_warps: int = 4, *, begin: int = 0, end: Optional[int] = None,
                 stage: Optional[Stage] = None, checked: bool = False, stream=None) -> None:
    """Launch the copy of rows ``[begin, end)`` (default: all) of ``rows`` (``[3, num_rows]``
    int64 on ``device``, or ``[4, num_rows]`` with staging offsets when ``stage`` is given; see
    the module doc) on ``stream``. CPU tensors run in Triton's interpreter. ``checked``:
    the caller already ran :func:`check_row_table` on this table (per-chunk launches).
    ``stream``: a torch stream of ``device`` (default: the current one); ``device`` must be
    current in CUDA (the launch takes :mod:`transport.nvlink.launch`'s direct path)."""
    if not checked:
        check_row_table(rows, device, staged=stage is not None)
    n = int(rows.shape[1])
    begin, end = _range(n, begin, end, plan)
    if end == begin:
        return
    mode, address, origin = _stage_args(stage)
    num_tiles = -(-(end - begin) // plan.block_r)
    _run(_kernel(rows.device.type == "cpu"), min(plan.num_programs, num_tiles), rows, device, stream,
         (rows, n, begin, end, num_tiles, address, origin), _constexprs(mode, plan), num_warps)


def strided_table_size(num_pairs: int, num_slots: int, staged: bool = False) -> int:
    """Elements of the strided table: ``5 P + 2 S``, plus ``P`` staging prefixes when staged."""
    return (6 if staged else 5) * num_pairs + 2 * num_slots


def check_strided_table(table, num_pairs: int, num_slots: int, device, staged: bool = False) -> None:
    """The one shape/dtype/device check before a strided launch: ``table`` is a contiguous
    ``[5 * num_pairs + 2 * num_slots]`` int64 tensor on ``device`` (``6 * num_pairs + ...``
    when ``staged``)."""
    import torch

    if not isinstance(table, torch.Tensor):
        raise TypeError(f"table must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise TypeError(f"table must have dtype torch.int64, got {table.dtype}")
    size = strided_table_size(num_pairs, num_slots, staged)
    k = 6 if staged else 5
    if table.dim() != 1 or table.shape[0] != size:
        raise ValueError(
            f"table must have shape [{k} * {num_pairs} + 2 * {num_slots}] = [{size}], got {list(table.shape)}")
    if not table.is_contiguous():
        raise ValueError(f"table must be contiguous, got strides {tuple(table.stride())}")
    _check_device(table, "table", device)


def scatter_strided(table, num_pairs: int, num_slots: int, plan: LaunchPlan, device, num_warps: int = 4, *,
                    begin: int = 0, end: Optional[int] = None, stage: Optional[Stage] = None,
                    checked: bool = False, stream=None) -> None:
    """Launch the copy of rows ``[begin, end)`` (default: all ``num_pairs * num_slots``) of a
    factored batch: ``table`` is the strided table (module doc; on ``device``, with the staging
    offsets section when ``stage`` is given), ``plan`` from :func:`plan_launch`. CPU tensors
    run in Triton's interpreter; ``checked`` and ``stream`` as for :func:`scatter_rows`."""
    if not checked:
        check_strided_table(table, num_pairs, num_slots, device, staged=stage is not None)
    begin, end = _range(num_pairs * num_slots, begin, end, plan)
    if end == begin:
        return
    mode, address, origin = _stage_args(stage)
    num_tiles = -(-(end - begin) // plan.block_r)
    _run(_kernel(table.device.type == "cpu", _scatter_strided_body), min(plan.num_programs, num_tiles), table, device,
         stream, (table, table, (6 if stage is not None else 5) * num_pairs, num_pairs, num_slots, begin, end,
                  num_tiles, address, origin),
         _constexprs(mode, plan), num_warps)


def check_split_tables(pairs, slots, num_pairs: int, slot_base: int, num_slots: int, device,
                       staged: bool = False) -> None:
    """The shape/dtype/device check of a split strided launch: ``pairs`` a contiguous int64
    ``[5 * num_pairs]`` tensor (the pair part; ``[6 * num_pairs]`` when ``staged``), ``slots`` a
    contiguous int64 1-D tensor holding the ``[2 * num_slots]`` slot part at element
    ``slot_base``, both on ``device``."""
    import torch

    check_strided_table(pairs, num_pairs, 0, device, staged)
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous():
        raise ValueError(f"slots must be a contiguous 1-D int64 tensor, got {slots.dtype} {list(slots.shape)}")
    if not 0 <= slot_base <= slots.numel() - 2 * num_slots:
        raise ValueError(f"slot part [{slot_base}, +{2 * num_slots}) runs past slots of {slots.numel()} elements")
    _check_device(slots, "slots", device)


def scatter_strided_split(pairs, slots, slot_base: int, num_pairs: int, num_slots: int, plan: LaunchPlan, device,
                          num_warps: int = 4, *, begin: int = 0, end: Optional[int] = None,
                          stage: Optional[Stage] = None, checked: bool = False, stream=None) -> None:
    """Launch the copy of rows ``[begin, end)`` (default: all ``num_pairs * num_slots``) of a
    factored batch whose table is split: the pair part ``pairs`` (``[5 * P]``, or ``[6 * P]``
    with the staging prefixes when ``stage`` is given; resident: built once per buffer-pair set)
    and the slot part at ``slots[slot_base : slot_base + 2 * S]`` (source slots, then
    destination slots; uploaded per write). ``plan``: from :func:`plan_launch` or, for any
    number of rows, :func:`plan_shape`. CPU tensors run in Triton's interpreter; ``checked``
    (:func:`check_split_tables` already ran) and ``stream`` as for :func:`scatter_rows`."""
    if not checked:
        check_split_tables(pairs, slots, num_pairs, slot_base, num_slots, device, staged=stage is not None)
    begin, end = _range(num_pairs * num_slots, begin, end, plan)
    if end == begin:
        return
    mode, address, origin = _stage_args(stage)
    num_tiles = -(-(end - begin) // plan.block_r)
    grid = min(plan.num_programs, num_tiles) if plan.num_programs else num_tiles
    _run(_kernel(pairs.device.type == "cpu", _scatter_strided_body), grid, pairs,
         device, stream, (pairs, slots, int(slot_base), num_pairs, num_slots, begin, end, num_tiles, address, origin),
         _constexprs(mode, plan), num_warps)


_I32_MAX = (1 << 31) - 1


class SplitLaunch:
    """:func:`scatter_strided_split` over fixed tables -- a pair set's resident pair part
    ``pairs`` (``[5 * num_pairs]``, ``[6 * num_pairs]`` for a staged ``mode``) and a ring
    ``slots`` that holds each write's slot part at some ``slot_base`` -- checked once here
    (:func:`check_split_tables`); a call launches the copy of rows ``[begin, end)`` of
    ``num_pairs * num_slots`` with only the slot part's place and count (and, staged, the
    staging buffer) -- the launch bound once, :meth:`~transport.nvlink.launch.Relauncher.bind`.
    ``mode``: None for the direct copy, or the :class:`StageMode` of every call (the staged
    engine binds one launch to gather on the local GPU, one to scatter on the peer's). Tensors on
    GPU ``device`` (an int) only."""

    def __init__(self, pairs, slots, num_pairs: int, plan: LaunchPlan, device: int, num_warps: int = 4,
                 native=None, mode: Optional[StageMode] = None):
        """``native``: the C launch (:mod:`transport.nvlink.native`; None: Triton's launcher)."""
        import torch

        check_split_tables(pairs, slots, num_pairs, 0, 0, torch.device("cuda", device), staged=mode is not None)
        self.num_pairs, self.plan, self.mode, self._ring_size = num_pairs, plan, mode, int(slots.numel())
        self._launch = _kernel(False, _scatter_strided_body).bind(
            device, num_warps, (pairs, slots), _constexprs(0 if mode is None else mode.value, plan), native)

    def native_spec(self) -> Optional[tuple]:
        """``(function, block, shared, trailing, wide, pair table, ring)``: this launch as the C
        pipeline (:mod:`transport.nvlink.native`) takes it, once a launch kept the kernel and
        found the C launch equivalent; None before, or where it is not."""
        return self._launch.native_spec

    def __call__(self, slot_base: int, num_slots: int, stream, begin: int = 0, end: Optional[int] = None,
                 stage: Optional[Stage] = None) -> None:
        """Launch on the torch ``stream`` (its device current in CUDA) over the slot part at
        ``slots[slot_base : slot_base + 2 * num_slots]`` (Python ints): rows ``[begin, end)``
        (default: all), through the staging buffer ``stage`` (its mode this launch's)."""
        if not 0 <= slot_base <= self._ring_size - 2 * num_slots:
            raise ValueError(f"slot part [{slot_base}, +{2 * num_slots}) runs past slots of {self._ring_size} elements")
        if (stage is None) != (self.mode is None) or (stage is not None and stage.mode is not self.mode):
            raise ValueError(f"this launch stages as {self.mode}, got stage {stage!r}")
        begin, end = _range(self.num_pairs * num_slots, begin, end, self.plan)
        if end == begin:
            return
        num_tiles = -(-(end - begin) // self.plan.block_r)
        programs = self.plan.num_programs
        _, address, origin = _stage_args(stage)
        ints = (slot_base, self.num_pairs, num_slots, begin, end, num_tiles, address, origin)
        grid = min(programs, num_tiles) if programs else num_tiles
        if end <= _I32_MAX and slot_base <= _I32_MAX:  # rows and slot_base the largest int32s (stages: int64)
            self._launch.launch_fitted(grid, stream, ints)
        else:
            self._launch(grid, stream, ints)
