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

The caller must have made ``device`` current in CUDA (``cudaSetDevice`` or ``torch.cuda.device``):
the launcher launches in the current context.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["Relauncher"]

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
    for h in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


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
