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
integers change, each within int32 or the int64 the kernel declares for it (``x: tl.int64``,
which Triton keeps whatever the value) -- is bound once (:meth:`Relauncher.bind`): the bound
launch keeps the compiled kernel and its fixed arguments, and a launch is then one range check
of the integers, the hooks check and the launcher's call (the direct path of ``write_strided``,
:mod:`transport.nvlink.direct`, where the key and the argument tuples cost more than the launch).

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


_DECLARED = ("i32", "i64")  # integer annotations a kernel may declare (``x: tl.int64``), which Triton then keeps


def _declared(param) -> str:
    """The integer type a kernel parameter declares (``""``: none; Triton types it by value)."""
    kind = getattr(param, "annotation_type", "")
    return kind if kind in _DECLARED else ""


def _param_type(param, v: int) -> str:
    """Triton's type for int ``v`` passed to ``param``: the declared one, else by value."""
    return _declared(param) or _int_type(v)


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
            if isinstance(a, int) and not (p.do_not_specialize and signature.get(p.name) == _param_type(p, a)):
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


def native_launch(native, compiled, num_tensors: int, int_types: tuple) -> Optional[tuple]:
    """``(function, block, shared, trailing, wide)`` for ``native.launch`` of ``compiled`` with
    ``num_tensors`` pointers then integers of ``int_types`` (``"i32"`` / ``"i64"``; bit ``i`` of
    ``wide`` set for the 8-byte ones), or None where that launch would not be the launch
    Triton's launcher makes: a kernel needing scratch memory, clusters, a cooperative or
    programmatic-dependent launch, or whose parameters (read from the driver) are not those
    pointers and integers followed only by pointer-sized ones (Triton's scratch arguments,
    passed null as its launcher does when it needs none)."""
    meta = getattr(compiled, "metadata", None)
    function = getattr(compiled, "function", None)
    if native is None or meta is None or not isinstance(function, int) or not set(int_types) <= set(_DECLARED):
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
    head = [8] * num_tensors + [8 if t == "i64" else 4 for t in int_types]
    if sizes is None or sizes[:len(head)] != head or any(n != 8 for n in sizes[len(head):]):
        return None
    wide = sum(1 << i for i, t in enumerate(int_types) if t == "i64")
    return function, 32 * meta.num_warps, meta.shared, len(sizes) - len(head), wide


class BoundLaunch:
    """One kernel's launch with fixed tensors, constexprs, device and ``num_warps``; each call
    gives the grid, the stream and the integer arguments. Once the relauncher keeps the kernel
    for this launch's key, a call whose integers fit the bound types -- int32, or int64 where
    the kernel declares it (``x: tl.int64``) -- calls its launcher directly; any other call goes
    through :class:`Relauncher` (the JIT at first)."""

    def __init__(self, relauncher: Relauncher, device: int, num_warps: int, tensors: tuple, constexprs: tuple,
                 native=None):
        self._relauncher, self._device, self._num_warps = relauncher, device, num_warps
        self._tensors, self._constexprs = tensors, constexprs
        self._values = tuple(v for _, v in constexprs)
        self._compiled = None  # the kept kernel of the bound types' key
        self._native_module = native
        self._native: Optional[tuple] = None  # (function, block, shared, trailing, wide) once kept (native_launch)
        self._pointers = tuple(t.data_ptr() for t in tensors) if native is not None else ()
        params = getattr(relauncher._fn, "params", None) or []
        self._limits = [_I64 if _declared(p) == "i64" else _I32 for p in params[len(tensors):]]  # per parameter

    def fits(self, ints: tuple) -> bool:
        """Whether ``ints`` fit the bound types (:meth:`launch_fitted` takes them)."""
        return len(ints) <= len(self._limits) and all(lo <= v <= hi for v, (lo, hi) in zip(ints, self._limits))

    def __call__(self, grid: int, stream, ints: tuple) -> None:
        """Launch ``grid`` programs on the torch ``stream`` with integer arguments ``ints``
        (at least one)."""
        if self.fits(ints):
            self.launch_fitted(grid, stream, ints)
        else:
            self._relauncher(grid, stream, self._device, self._tensors + tuple(ints), self._constexprs, self._num_warps)

    @property
    def native_spec(self) -> Optional[tuple]:
        """``(function, block, shared, trailing, wide, *tensor addresses)``: what ``native``'s
        launches of this kernel take, once it is kept and found equivalent (None before, or
        where it is not)."""
        return None if self._native is None else self._native + self._pointers

    def launch_fitted(self, grid: int, stream, ints: tuple) -> None:
        """:meth:`__call__` for ``ints`` the caller knows to fit the bound types (:meth:`fits`;
        Python ints): through the C launch where it was found equivalent
        (:func:`native_launch`), else Triton's launcher."""
        compiled = self._compiled
        if compiled is not None and not _hooks_installed():
            native = self._native
            if native is not None:
                function, block, shared, trailing, wide = native
                self._native_module.launch(function, block, shared, stream.cuda_stream, grid, self._pointers, ints,
                                           trailing, wide)
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
                signature = getattr(self._compiled.src, "signature", {})
                names = [p.name for p in r._fn.params[len(self._tensors): len(args)]]
                self._native = native_launch(self._native_module, self._compiled, len(self._tensors),
                                             tuple(signature.get(name) for name in names))
