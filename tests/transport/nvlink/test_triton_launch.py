"""transport.nvlink.launch: the direct relaunch of jitted kernels.

CPU: the integer types and launch keys against Triton's own specialization. GPU: relaunched
kernels compute what the JIT computes, a key change (an int past 32 bits) compiles a new
variant instead of reusing a wrong one, specialized integers and launch hooks keep the JIT path.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from transport.nvlink import launch as triton_launch  # noqa: E402
from transport.nvlink.launch import Relauncher  # noqa: E402


def _add_body(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=m) + shift, mask=m)


BOUNDARIES = [0, 1, 16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, 2**64 - 1, -2**63]


@pytest.mark.parametrize("v", BOUNDARIES)
def test_int_type_is_tritons(v):
    from triton.runtime.jit import mangle_type

    assert triton_launch._int_type(v) == mangle_type(v)


def test_key_separates_types_and_refuses_other_arguments():
    r = Relauncher(None)
    x = torch.zeros(4, dtype=torch.int64)
    k32 = r._key(0, 4, (x, 3), (("BLOCK", 8),))
    assert k32 == r._key(0, 4, (x, 2**31 - 1), (("BLOCK", 8),))
    assert k32 != r._key(0, 4, (x, 2**31), (("BLOCK", 8),))
    assert k32 != r._key(1, 4, (x, 3), (("BLOCK", 8),))
    assert k32 != r._key(0, 8, (x, 3), (("BLOCK", 8),))
    assert k32 != r._key(0, 4, (x.to(torch.int32), 3), (("BLOCK", 8),))
    assert r._key(0, 4, (x, True), ()) is None
    assert r._key(0, 4, (x, 1.5), ()) is None


def test_hooks_detected():
    from triton import knobs

    def hook(*_):
        pass

    assert not triton_launch._hooks_installed()
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert triton_launch._hooks_installed()
        finally:
            chain.remove(hook)
    assert not triton_launch._hooks_installed()


def _launch(r, x, out, shift):
    n = x.numel()
    r(-(-n // 64), torch.cuda.current_stream(0), 0, (x, out, n, shift), (("BLOCK", 64),), 4)
    torch.cuda.synchronize(0)


@pytest.mark.gpu
def test_relaunch_matches_and_new_types_compile_anew():
    r = Relauncher(triton.jit(_add_body, do_not_specialize=["n", "shift"]))
    for n in (100, 1000, 37):
        x = torch.randint(-1000, 1000, (n,), dtype=torch.int64, device="cuda:0")
        for shift in (5, 7, 2**33 + 3, -(2**40), 11):
            out = torch.zeros_like(x)
            _launch(r, x, out, shift)
            assert torch.equal(out, x + shift), (n, shift)
    # one JIT launch per key (i32 shift, i64 shift), the other 13 direct
    assert r.direct_launches == 13


@pytest.mark.gpu
def test_specialized_ints_stay_on_the_jit():
    r = Relauncher(triton.jit(_add_body, do_not_specialize=["shift"]))  # n specialized
    for n in (64, 1, 65):
        x = torch.arange(n, dtype=torch.int64, device="cuda:0")
        out = torch.zeros_like(x)
        _launch(r, x, out, 3)
        assert torch.equal(out, x + 3)
    assert r.direct_launches == 0


@pytest.mark.gpu
def test_launch_hooks_take_the_jit():
    from triton import knobs

    r = Relauncher(triton.jit(_add_body, do_not_specialize=["n", "shift"]))
    x = torch.arange(100, dtype=torch.int64, device="cuda:0")
    out = torch.zeros_like(x)
    _launch(r, x, out, 1)
    seen = []
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no hook chain")
    chain.add(seen.append)
    try:
        _launch(r, x, out, 2)
    finally:
        chain.remove(seen.append)
    assert torch.equal(out, x + 2) and len(seen) == 1 and r.direct_launches == 0


# -- a bound launch: the compiled kernel called directly, its fixed arguments built once ----------------


class _Param:
    def __init__(self, name, do_not_specialize):
        self.name, self.do_not_specialize = name, do_not_specialize


class _Compiled:
    """What the JIT returns, as far as the relauncher looks; ``run`` records its arguments."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, signature, runs):
        self.src = type("Src", (), {"signature": signature})()
        self.run = lambda *a: runs.append(a)


class _Jit:
    """A jitted ``(x, out, n, shift, BLOCK)``; ``kernel[grid](...)`` records the JIT launch."""

    params = [_Param("x", False), _Param("out", False), _Param("n", True), _Param("shift", True),
              _Param("BLOCK", False)]

    def __init__(self):
        self.jit, self.runs = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit.append((grid, args, kwargs))
            kinds = {p.name: triton_launch._int_type(a) for p, a in zip(self.params, args) if isinstance(a, int)}
            return _Compiled(kinds, self.runs)
        return launch


class _Stream:
    cuda_stream = 99


def test_bound_launch_calls_the_compiled_kernel_with_the_fixed_arguments(monkeypatch):
    import contextlib

    monkeypatch.setattr(torch.cuda, "device", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda *a: contextlib.nullcontext())
    jit = _Jit()
    r = Relauncher(jit)
    x, out = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    bound = r.bind(0, 4, (x, out), (("BLOCK", 64),))
    bound(3, _Stream(), (100, 5))  # the first launch compiles (through the JIT)
    assert len(jit.jit) == 1 and jit.runs == [] and r.direct_launches == 0
    bound(2, _Stream(), (7, -8))
    bound.launch_fitted(1, _Stream(), (9, 10))
    assert jit.runs == [(2, 1, 1, 99, "fn", "meta", None, None, None, x, out, 7, -8, 64),
                        (1, 1, 1, 99, "fn", "meta", None, None, None, x, out, 9, 10, 64)]
    assert r.direct_launches == 2 and len(jit.jit) == 1
    bound(1, _Stream(), (9, 2**31))  # past int32: another key, through the relauncher (a new JIT launch)
    assert len(jit.jit) == 2 and len(jit.runs) == 2
    bound(1, _Stream(), (9, 2**31))  # the relauncher now keeps that one too
    assert len(jit.jit) == 2 and len(jit.runs) == 3


def test_bound_launch_leaves_a_launch_with_hooks_to_the_jit(monkeypatch):
    import contextlib

    monkeypatch.setattr(torch.cuda, "device", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda *a: contextlib.nullcontext())
    jit = _Jit()
    x = torch.zeros(2, dtype=torch.int64)
    bound = Relauncher(jit).bind(0, 4, (x, x), (("BLOCK", 8),))
    bound(1, _Stream(), (1, 2))
    bound(1, _Stream(), (1, 2))
    assert (len(jit.jit), len(jit.runs)) == (1, 1)
    monkeypatch.setattr(triton_launch, "_hooks_installed", lambda: True)  # a profiler listens
    bound(1, _Stream(), (1, 2))
    assert (len(jit.jit), len(jit.runs)) == (2, 1)


def test_split_launch_passes_the_slot_part_and_the_rows(monkeypatch):
    """``kernel.SplitLaunch``: one bound launch per pair set; per call the slot part's place,
    the rows and tiles, the grid capped by the plan; a slot part past the ring refused."""
    from transport.nvlink import kernel as kern

    calls = []

    class _Bound:
        def launch_fitted(self, grid, stream, ints):
            calls.append(("i32", grid, ints))

        def __call__(self, grid, stream, ints):
            calls.append(("any", grid, ints))

    class _Launcher:
        def bind(self, device, num_warps, tensors, constexprs, native=None):
            calls.append(("bind", device, num_warps, len(tensors), dict(constexprs)["BLOCK_R"]))
            return _Bound()

    monkeypatch.setattr(kern, "_kernel", lambda interpret, body=None: _Launcher())
    monkeypatch.setattr(kern, "check_split_tables", lambda *a, **k: None)
    pairs, ring = torch.zeros(5 * 3, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    plan = kern.plan_shape(2048, kern.CopyPath.VEC16, kern.KernelConfig())  # 2 KiB rows: 4 rows a tile
    launch = kern.SplitLaunch(pairs, ring, 3, plan, 1, 8)
    launch(10, 7, _Stream())
    capped = kern.SplitLaunch(pairs, ring, 3, kern.plan_shape(2048, kern.CopyPath.VEC16,
                                                                kern.KernelConfig(max_programs=2)), 1, 8)
    capped(0, 7, _Stream())
    assert calls == [("bind", 1, 8, 2, 4), ("i32", 6, (10, 3, 7, 0, 21, 6, 0, 0)),
                     ("bind", 1, 8, 2, 4), ("i32", 2, (0, 3, 7, 0, 21, 6, 0, 0))]
    with pytest.raises(ValueError, match=r"slot part \[60, \+8\) runs past slots of 64 elements"):
        launch(60, 4, _Stream())
    launch(0, 0, _Stream())  # no rows: nothing launched
    assert len(calls) == 4
