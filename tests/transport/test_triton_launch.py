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
