"""Launch a jitted Triton kernel again without the JIT's work per call.

Why
---
``kernel[grid](...)`` costs several times the launcher's own host time (bench/RESULTS.md): it
asks torch for the current device and stream, binds and specializes every argument, looks the
compiled kernel up and only then calls the launcher. The staged engine launches two kernels per chunk of a pipeline, so that overhead decides whether the
host keeps ahead of the copy engine.

How
---
:class:`Relauncher` launches through Triton the first time it sees a *launch key* and keeps the
compiled kernel Triton returns; later launches with the same key call the compiled kernel's
launcher directly, on a stream given by the caller. The launch key is everything Triton
specializes on, computed here cheaply:

- the device, ``num_warps`` and the constexpr values;
- per tensor argument: dtype and whether its address is a multiple of 16 bytes;
- per integer argument: its type by range (i32 / i64 / u64). Integers must be declared
  ``do_not_specialize`` on the kernel, so that the range is all Triton looks at; the relauncher
  checks that, and checks the types in the compiled kernel's signature against its own before
  it keeps the kernel: on any mismatch it stays on the slow path.

The direct path is used only where it is known to work: Triton's ``CompiledKernel`` exposes
``run`` / ``function`` / ``packed_metadata`` (Triton 3.3 to 3.9 alike) and no launch hooks (a
profiler) are installed. Otherwise every launch goes through ``kernel[grid](...)``.

A launch that repeats with the same tensors, constexprs, device and ``num_warps`` -- only its
integers change, all within int32 -- is bound once (:meth:`Relauncher.bind`): the bound launch
keeps the compiled kernel and its fixed arguments, and a launch is then one range check of the
integers, the hooks check and the launcher's call (the direct path of ``write_strided``,
:mod:`transport.nvlink.fastpath`, where the key and the argument tuples cost more than the launch).

Given the C steps (:mod:`transport.nvlink.native`), a bound launch goes one step further once
the kernel is kept: it calls ``cuLaunchKernel`` itself with the tensors' addresses, the int32s
and null scratch pointers -- where :func:`native_launch` found that to be exactly the launch
Triton's launcher makes (the parameters as the driver reports them, no scratch memory, no
clusters, no cooperative or programmatic-dependent launch); elsewhere it stays on Triton's.

The caller must have made ``device`` current in CUDA (``cudaSetDevice`` or ``torch.cuda.device``):
the launcher launches in the current context.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["BoundLaunch", "Relauncher", "native_launch"]

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)


def _int_type(v: int) -> str:
    """Triton's type for an unspecialized Python int argument."""
    if _I32[0] <= v <= _I32[1]:
        return "i32"
    if _I64[0] <= v <= _I64[1]:
        return "i64"
    return "u64"


_KNOBS: list = []  # triton.knobs once imported (None: this Triton has none)


def _hooks_installed() -> bool:
    if not _KNOBS:
        try:
            from triton import knobs
        except ImportError:  # Triton < 3.3: no knobs; stay on the slow path
            knobs = None
        _KNOBS.append(knobs)
    knobs = _KNOBS[0]
    if knobs is None:
        return True
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook  # a HookChain (Triton >= 3.5) or a function
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


class Relauncher:
    """One jitted kernel (``triton.jit(..., do_not_specialize=<every int argument>)``), launched
    directly after its first launch per launch key (module doc)."""

    def __init__(self, fn):
        self._fn = fn
        self._compiled: dict = {}  # launch key -> CompiledKernel
        self.direct_launches = 0  # launches that skipped the JIT (tests and benchmarks read it)

    def _key(self, device: int, num_warps: int, args: tuple, constexprs: tuple) -> Optional[tuple]:
        kinds = []
        for a in args:  # on every launch: the common types first, no hasattr
            if type(a) is int:
                kinds.append("i32" if _I32[0] <= a <= _I32[1] else _int_type(a))
                continue
            if isinstance(a, bool):
                return None
            if isinstance(a, int):
                kinds.append(_int_type(a))
                continue
            dtype = getattr(a, "dtype", None)
            if dtype is None or not hasattr(a, "data_ptr"):
                return None
            kinds.append((dtype, a.data_ptr() % 16 == 0))
        return (device, num_warps, constexprs, tuple(kinds))

    def _keepable(self, compiled, args: tuple, constexprs: tuple) -> bool:
        """The compiled kernel can be relaunched for any arguments of the same key."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "src")):
            return False
        params, signature = getattr(self._fn, "params", None), getattr(compiled.src, "signature", None)
        if params is None or not isinstance(signature, dict) or len(params) < len(args):
            return False
        for p, a in zip(params, args):
            if isinstance(a, int) and not (p.do_not_specialize and signature.get(p.name) == _int_type(a)):
                return False
        return [p.name for p in params[len(args):]] == [name for name, _ in constexprs]

    def __call__(self, grid: int, stream, device: int, args: tuple, constexprs: tuple[tuple[str, Any], ...],
                 num_warps: int) -> None:
        """Launch ``grid`` programs on the torch ``stream`` of ``device`` (made current by the
        caller) with positional ``args`` (the kernel's leading parameters) and ``constexprs``
        (``(name, value)`` pairs for the remaining ones, in parameter order)."""
        key = self._key(device, num_warps, args, constexprs)
        compiled = self._compiled.get(key) if key is not None else None
        if compiled is not None and not _hooks_installed():
            compiled.run(grid, 1, 1, stream.cuda_stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *(v for _, v in constexprs))
            self.direct_launches += 1
            return
        import torch

        with torch.cuda.device(device), torch.cuda.stream(stream):
            compiled = self._fn[(grid,)](*args, **dict(constexprs), num_warps=num_warps)
        if key is not None and self._keepable(compiled, args, constexprs):
            self._compiled[key] = compiled

    def bind(self, device: int, num_warps: int, tensors: tuple, constexprs: tuple[tuple[str, Any], ...],
             native=None) -> "BoundLaunch":
        """A launch of this kernel with ``tensors`` as its leading arguments, then integers, then
        ``constexprs``; see :class:`BoundLaunch` (``native``: its C launch)."""
        return BoundLaunch(self, device, num_warps, tuple(tensors), tuple(constexprs), native)


def native_launch(native, compiled, num_tensors: int, num_ints: int) -> Optional[tuple]:
    """``(function, block, shared, trailing)`` for ``native.launch`` of ``compiled`` with
    ``num_tensors`` pointers then ``num_ints`` int32 arguments, or None where that launch would
    not be the launch Triton's launcher makes: a kernel needing scratch memory, clusters, a
    cooperative or programmatic-dependent launch, or whose parameters (read from the driver) are
    not those pointers and ints followed only by pointer-sized ones (Triton's scratch arguments,
    passed null as its launcher does when it needs none)."""
    meta = getattr(compiled, "metadata", None)
    function = getattr(compiled, "function", None)
    if native is None or meta is None or not isinstance(function, int):
        return None
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "launch_pdl", False) or getattr(meta, "global_scratch_size", 0)
            or getattr(meta, "profile_scratch_size", 0) or not isinstance(getattr(meta, "num_warps", None), int)
            or not isinstance(getattr(meta, "shared", None), int)):
        return None
    try:
        sizes = native.param_sizes(function)
    except Exception:  # the driver cannot tell: Triton's launcher
        return None
    head = [8] * num_tensors + [4] * num_ints
    if sizes is None or sizes[:len(head)] != head or any(n != 8 for n in sizes[len(head):]):
        return None
    return function, 32 * meta.num_warps, meta.shared, len(sizes) - len(head)


class BoundLaunch:
    """One kernel's launch with fixed tensors, constexprs, device and ``num_warps``; each call
    gives the grid, the stream and the integer arguments. Once the relauncher keeps the kernel
    for this launch's key with int32 integers, a call whose integers are all int32 calls its
    launcher directly; any other call goes through :class:`Relauncher` (the JIT at first)."""

    def __init__(self, relauncher: Relauncher, device: int, num_warps: int, tensors: tuple, constexprs: tuple,
                 native=None):
        self._relauncher, self._device, self._num_warps = relauncher, device, num_warps
        self._tensors, self._constexprs = tensors, constexprs
        self._values = tuple(v for _, v in constexprs)
        self._compiled = None  # the kept kernel of the all-int32 key
        self._native_module = native
        self._native: Optional[tuple] = None  # (function, block, shared, trailing) once kept (native_launch)
        self._pointers = tuple(t.data_ptr() for t in tensors) if native is not None else ()

    def __call__(self, grid: int, stream, ints: tuple) -> None:
        """Launch ``grid`` programs on the torch ``stream`` with integer arguments ``ints``
        (at least one)."""
        if _I32[0] <= min(ints) and max(ints) <= _I32[1]:
            self.launch_i32(grid, stream, ints)
        else:
            self._relauncher(grid, stream, self._device, self._tensors + tuple(ints), self._constexprs, self._num_warps)

    def launch_i32(self, grid: int, stream, ints: tuple) -> None:
        """:meth:`__call__` for ``ints`` the caller knows to be int32 (Python ints): through
        the C launch where it was found equivalent (:func:`native_launch`), else Triton's
        launcher."""
        compiled = self._compiled
        if compiled is not None and not _hooks_installed():
            native = self._native
            if native is not None:
                function, block, shared, trailing = native
                self._native_module.launch(function, block, shared, stream.cuda_stream, grid, self._pointers, ints,
                                           trailing)
                self._relauncher.direct_launches += 1
                return
            compiled.run(grid, 1, 1, stream.cuda_stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *self._tensors, *ints, *self._values)
            self._relauncher.direct_launches += 1
            return
        r = self._relauncher
        args = self._tensors + tuple(ints)
        r(grid, stream, self._device, args, self._constexprs, self._num_warps)
        if compiled is None:
            key = r._key(self._device, self._num_warps, args, self._constexprs)
            self._compiled = r._compiled.get(key) if key is not None else None
            if self._compiled is not None:
                self._native = native_launch(self._native_module, self._compiled, len(self._tensors), len(ints))
