"""The fused decode kernels (kvtransfer.models.fused) against the PyTorch functions they replace
(layers.rms_norm, Rotary.apply with the pool's set_kv_buffer, silu * up): under Triton's
interpreter on CPU, and on CUDA in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F

from kvtransfer.models import fused
from kvtransfer.models.layers import Rotary, rms_norm
from tests.kvtransfer.models._support import run_interpreted

SHAPES = [(1, 4, 2, 16, 40), (5, 9, 3, 64, 100), (3, 8, 8, 32, 7)]  # tokens, heads, kv_heads, head_dim, hidden


def _errors(device, dtype):
    """Per shape: the largest relative error of each fused op against the reference."""
    out = []
    for t, heads, kv_heads, d, hidden in SHAPES:
        gen = torch.Generator().manual_seed(t * 1000 + hidden)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype).to(device)

        def rel(a, b):
            return float((a.double() - b.double()).norm() / b.double().norm())

        h, delta, w = rand(t, hidden), rand(t, hidden), rand(hidden)
        h_new, x = fused.add_rms_norm(h, delta, w, 1e-5)
        _, x0 = fused.add_rms_norm(h, None, w, 1e-5)
        norm_err = max(rel(h_new, h + delta), rel(x, rms_norm(h + delta, w, 1e-5)), rel(x0, rms_norm(h, w, 1e-5)))

        rotary = Rotary.build(d, 10000.0, 64, device)
        qkv = rand(t, (heads + 2 * kv_heads) * d)
        positions = torch.randint(0, 64, (t,), generator=gen).to(device)
        loc = (torch.randperm(20, generator=gen)[:t] + 1).to(device)
        k_buf = torch.full((21, kv_heads, d), float("nan"), dtype=dtype, device=device)
        v_buf = k_buf.clone()
        q = fused.rope_into_pool(qkv, positions, loc, rotary.cos, rotary.sin, k_buf, v_buf, heads, kv_heads, d)
        q_ref = rotary.apply(qkv[:, : heads * d].float().view(t, heads, d), positions)
        k_ref = rotary.apply(qkv[:, heads * d: (heads + kv_heads) * d].float().view(t, kv_heads, d), positions)
        v_ref = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
        rope_err = max(rel(q, q_ref), rel(k_buf[loc], k_ref), rel(v_buf[loc], v_ref))
        untouched = torch.ones(21, dtype=torch.bool)
        untouched[loc.cpu()] = False
        if not k_buf[untouched.to(device)].isnan().all():
            rope_err = float("inf")  # a row outside out_cache_loc was written

        gate_up = rand(t, 2 * hidden)
        act_err = rel(fused.silu_mul(gate_up), F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:])
        out.append((norm_err, rope_err, act_err))
    return out


def print_interpreted_errors() -> None:
    """Entry point of the interpreter subprocess: one line of three errors per shape."""
    for errs in _errors("cpu", torch.float32):
        print(*errs, flush=True)


def _check(errors, tol):
    for shape, errs in zip(SHAPES, errors):
        assert all(e < tol for e in errs), f"{shape}: errors (norm, rope, silu) {errs}"


def test_interpreted_match_torch():
    lines = run_interpreted("tests.kvtransfer.models.test_fused", "print_interpreted_errors")
    _check([tuple(float(v) for v in line) for line in lines], 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_match_torch(dtype, tol):
    _check(_errors("cuda", dtype), tol)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="twice a power of two"):
        fused.rope_into_pool(torch.zeros(1, 36), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                             torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(2, 1, 6), torch.zeros(2, 1, 6), 4, 1, 6)
    with pytest.raises(ValueError, match="delta must have shape"):
        fused.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="even number of columns"):
        fused.silu_mul(torch.zeros(2, 7))


def _outputs_given(device, dtype):
    """Whether each op writes into the output buffer it is given the bits it returns without one
    (add_rms_norm with and without a delta, small_linear, decode_linear through F.linear)."""
    gen = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    h, delta, w = rand(5, 40), rand(5, 40), rand(40)
    same = []
    for d in (delta, None):
        buf = torch.full_like(h, float("nan"))
        h_new, x = fused.add_rms_norm(h, d, w, 1e-5, h_out=buf)
        ref_h, ref_x = fused.add_rms_norm(h, d, w, 1e-5)
        same.append(h_new.data_ptr() == buf.data_ptr() and torch.equal(buf, ref_h) and torch.equal(x, ref_x))
    for rows in (3, 70):  # small_linear's rows, then F.linear's
        x, w = rand(rows, 24), rand(17, 24)
        buf = torch.full((rows, 17), float("nan"), dtype=dtype, device=device)
        y = fused.small_linear(x, w, out=buf) if rows <= 4 else fused.decode_linear(x, w, out=buf)
        ref = fused.small_linear(x, w) if rows <= 4 else fused.decode_linear(x, w)
        same.append(y.data_ptr() == buf.data_ptr() and torch.equal(buf, ref))
    return same


def print_interpreted_outputs_given() -> None:
    print(*_outputs_given("cpu", torch.float32), flush=True)


def test_interpreted_ops_write_into_the_outputs_they_are_given():
    (same,) = run_interpreted("tests.kvtransfer.models.test_fused", "print_interpreted_outputs_given")
    assert same == ["True"] * 4, same


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ops_write_into_the_outputs_they_are_given(dtype):
    assert all(_outputs_given("cuda", dtype))


def test_bad_outputs_are_refused():
    h, w = torch.zeros(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="h_out must have shape"):
        fused.add_rms_norm(h, h, w, 1e-5, h_out=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="h_out must be contiguous"):
        fused.add_rms_norm(h, h, w, 1e-5, h_out=torch.zeros(8, 4).T)
    with pytest.raises(TypeError, match="out must have dtype"):
        fused.decode_linear(h, torch.zeros(3, 8), out=torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be contiguous"):
        fused.small_linear(h[:2], torch.zeros(3, 8), out=torch.zeros(3, 2).T)


def _gemv_errors(device, dtype):
    out = []
    for m, n, k in ((1, 40, 24), (3, 17, 300), (4, 64, 512)):
        gen = torch.Generator().manual_seed(m * n + k)
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        w = torch.randn(n, k, generator=gen).to(dtype).to(device)
        ref = x.double() @ w.double().T
        for bn, bk in ((8, 64), (16, 256)):
            out.append(float((fused.small_linear(x, w, bn, bk).double() - ref).norm() / ref.norm()))
    return out


def print_interpreted_gemv_errors() -> None:
    print(*_gemv_errors("cpu", torch.float32), flush=True)


def test_interpreted_small_linear_matches_a_matmul():
    (errors,) = run_interpreted("tests.kvtransfer.models.test_fused", "print_interpreted_gemv_errors")
    assert all(float(e) < 1e-5 for e in errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_small_linear_matches_a_matmul(dtype, tol):
    assert all(e < tol for e in _gemv_errors("cuda", dtype))


def test_small_linear_refuses_too_many_rows():
    with pytest.raises(ValueError, match="1..4 rows, got 5"):
        fused.small_linear(torch.zeros(5, 8), torch.zeros(3, 8))
