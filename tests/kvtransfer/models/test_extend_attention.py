"""The Triton paged extend-attention kernel against a plain PyTorch reference: on CPU under
Triton's interpreter (small shapes), and the same cases plus a long one on CUDA (marked gpu).

Several requests per launch, each a chunk of new tokens after a cached prefix (prefix lengths
from 0 up, chunks of 1 token to several blocks), on shuffled pages of sizes 1, 16 and 64, GQA
groups of 1, 3 and 4, a value head narrower than the key head, and rows that are not the
batch index."""

import pytest
import torch

from kvtransfer.models.extend_attention import extend_attention
from tests.kvtransfer.models._support import paged_pool, run_interpreted

CASES = [  # page_size, heads, kv_heads, head_dim, v_head_dim, (prefix, extend) per request
    (1, 4, 4, 16, 16, ((0, 5), (3, 1), (7, 20))),
    (16, 6, 2, 32, 32, ((0, 17), (16, 16), (33, 70))),
    (64, 8, 2, 32, 16, ((64, 3), (0, 64), (100, 65))),
    (16, 4, 1, 16, 16, tuple((p, 3) for p in range(0, 21, 4))),  # prefixes 0..20 side by side
]
LONG = (16, 32, 8, 128, 128, ((0, 300), (1000, 129), (517, 1), (64, 64)))  # GPU only


def reference(q, k_buf, v_buf, r2t, req_rows, spans, scale):
    """Per request: gather prefix + chunk through the table, causal softmax in float64."""
    out = []
    group = q.shape[1] // k_buf.shape[1]
    start = 0
    for row, (prefix, n) in zip(req_rows.tolist(), spans):
        slots = r2t[row, : prefix + n].long()
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)  # [S, H, DV]
        s = torch.einsum("thd,shd->hts", q[start:start + n].double(), k) * scale  # [H, n, S]
        seen = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]  # [n, S]
        s = s.masked_fill(~seen, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", torch.softmax(s, -1), v))
        start += n
    return torch.cat(out)


def _error(case, dtype, device) -> float:
    """Relative error of the kernel against :func:`reference` on fresh inputs of ``case``."""
    page_size, heads, kv_heads, d, dv, spans = case
    gen = torch.Generator().manual_seed(sum(p * 3 + n for p, n in spans) + page_size * 7 + heads)
    lengths = [p + n for p, n in spans]
    k_buf, v_buf, r2t, req_rows = paged_pool(page_size, kv_heads, d, dv, lengths, dtype, device, gen)
    extends = [n for _, n in spans]
    t = sum(extends)
    q = torch.randn(t, heads, d, generator=gen).to(dtype).to(device)
    prefix_lens = torch.tensor([p for p, _ in spans], dtype=torch.int32, device=device)
    cu = torch.tensor([0] + extends, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    scale = d ** -0.5
    out = torch.full((t, heads, dv), float("nan"), dtype=dtype, device=device)
    extend_attention(q, k_buf, v_buf, r2t, req_rows, prefix_lens, cu, max(extends), scale, out=out)
    if out.isnan().any():
        return float("nan")  # a token or head the kernel never wrote
    ref = reference(q.cpu(), k_buf.cpu(), v_buf.cpu(), r2t.cpu(), req_rows.cpu(), spans, scale)
    return float((out.cpu().double() - ref).norm() / ref.norm())


def print_interpreted_errors() -> None:
    """Entry point of the interpreter subprocess: one ``case error`` line per case."""
    for i, case in enumerate(CASES):
        print(i, _error(case, torch.float32, "cpu"), flush=True)


@pytest.fixture(scope="module")
def interpreted_errors():
    """The kernel on CPU tensors under the interpreter: one subprocess runs every case."""
    return {int(i): float(err) for i, err in run_interpreted("tests.kvtransfer.models.test_extend_attention",
                                                             "print_interpreted_errors")}


@pytest.mark.parametrize("i", range(len(CASES)))
def test_interpreted_matches_reference(interpreted_errors, i):
    err = interpreted_errors[i]
    assert err < 1e-5, f"relative error {err:.2e} for {CASES[i]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [LONG], ids=lambda c: f"page{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(case, dtype):
    err = _error(case, dtype, "cuda")
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


def _args(**bad):
    args = dict(q=torch.zeros(5, 4, 16), k_buf=torch.zeros(8, 2, 16), v_buf=torch.zeros(8, 2, 16),
                req_to_token=torch.zeros(4, 8, dtype=torch.int32), req_rows=torch.ones(2, dtype=torch.int32),
                prefix_lens=torch.zeros(2, dtype=torch.int32), cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32),
                max_extend=3, scale=0.25)
    args.update(bad)
    return args


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(5, 5, 16)), "multiple of KV heads"),
    (dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens must have shape \[3\]"),
    (dict(prefix_lens=torch.zeros(2, dtype=torch.int64)), "prefix_lens must have dtype torch.int32"),
    (dict(req_rows=torch.ones(2)), "req_rows must be int32 or int64"),
    (dict(max_extend=-1), "max_extend must be an int >= 0"),
    (dict(rope_dim=16), r"rope_dim must be an int in \[0, 16\)"),
    (dict(v_buf=torch.zeros(8, 2, 16, dtype=torch.float64)), "v_buf must have dtype torch.float32"),
])
def test_bad_arguments_are_refused(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        extend_attention(**_args(**bad))
