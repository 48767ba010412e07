"""The Triton paged decode-attention kernel against a plain PyTorch reference: on CPU under
Triton's interpreter (small shapes), and the same cases on CUDA (marked gpu).

Requests take pages from a shuffled pool (so slots are not contiguous), with page sizes 1, 16
and 64, GQA groups of 1, 3 and 4, several lengths per batch (1, a page boundary, long ones),
and a request row that is not the batch index."""

import pytest
import torch

from kvtransfer.models import decode_attention as da
from tests.kvtransfer.models._support import paged_pool, run_interpreted

CASES = [  # page_size, heads, kv_heads, head_dim, v_head_dim, lengths
    (1, 4, 4, 16, 16, (1, 7, 33)),
    (16, 9, 3, 64, 64, (1, 16, 17, 150)),
    (64, 8, 2, 32, 32, (64, 65, 5, 200)),
    (16, 4, 1, 32, 16, (40, 3)),
]


def reference(q, k_buf, v_buf, r2t, req_rows, seq_lens, scale):
    """Per request: gather its K/V through the table, softmax in float64."""
    out = []
    group = q.shape[1] // k_buf.shape[1]
    for i in range(q.shape[0]):
        slots = r2t[int(req_rows[i]), : int(seq_lens[i])].long()
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)  # [S, H, DV]
        s = torch.einsum("hd,shd->hs", q[i].double(), k) * scale
        out.append(torch.einsum("hs,shd->hd", torch.softmax(s, -1), v))
    return torch.stack(out)


def _error(case, dtype, device, splits) -> float:
    """Relative error of the kernel against :func:`reference` on fresh inputs of ``case``."""
    page_size, heads, kv_heads, d, dv, lengths = case
    gen = torch.Generator().manual_seed(sum(lengths) * 131 + page_size * 7 + heads + splits)
    k_buf, v_buf, r2t, req_rows = paged_pool(page_size, kv_heads, d, dv, lengths, dtype, device, gen)
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype).to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = torch.full((len(lengths), heads, dv), float("nan"), dtype=dtype, device=device)
    da.decode_attention(q, k_buf, v_buf, r2t, req_rows, seq_lens, scale, splits, out=out)
    if out.isnan().any():
        return float("nan")  # a head or request the kernel never wrote
    ref = reference(q.cpu(), k_buf.cpu(), v_buf.cpu(), r2t.cpu(), req_rows.cpu(), seq_lens.cpu(), scale)
    return float((out.cpu().double() - ref).norm() / ref.norm())


INTERPRETED = [(i, splits) for i in range(len(CASES)) for splits in (1, 4)]


def print_interpreted_errors() -> None:
    """Entry point of the interpreter subprocess: one ``case splits error`` line per case."""
    for i, splits in INTERPRETED:
        print(i, splits, _error(CASES[i], torch.float32, "cpu", splits), flush=True)


@pytest.fixture(scope="module")
def interpreted_errors():
    """The kernel on CPU tensors under the interpreter: one subprocess runs every case."""
    lines = run_interpreted("tests.kvtransfer.models.test_decode_attention", "print_interpreted_errors")
    return {(int(i), int(splits)): float(err) for i, splits, err in lines}


@pytest.mark.parametrize("i, splits", INTERPRETED, ids=lambda v: str(v))
def test_interpreted_matches_reference(interpreted_errors, i, splits):
    err = interpreted_errors[i, splits]
    assert err < 1e-5, f"relative error {err:.2e} for {CASES[i]}, splits {splits}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"page{c[0]}-h{c[1]}-kv{c[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 8])
def test_cuda_matches_reference(case, dtype, splits):
    err = _error(case, dtype, "cuda", splits)
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


def test_num_splits_fills_the_chip_within_the_sequence():
    assert da.num_splits(1, 3, 1000) == 16  # 1000 tokens = 16 blocks of 64
    assert da.num_splits(1, 8, 100_000) == da.MAX_SPLITS
    assert da.num_splits(64, 8, 4096) == 1
    assert da.num_splits(4, 2, 1) == 1


@pytest.mark.parametrize("bad, match", [
    (dict(splits=3), "power of two"),
    (dict(seq_lens=torch.ones(2, dtype=torch.int64)), "seq_lens must have dtype torch.int32"),
    (dict(q=torch.zeros(2, 5, 16)), "multiple of KV heads"),
    (dict(req_to_token=torch.zeros(4, 8, dtype=torch.int64)), "req_to_token must have dtype torch.int32"),
])
def test_bad_arguments_are_refused(bad, match):
    args = dict(q=torch.zeros(2, 4, 16), k_buf=torch.zeros(8, 2, 16), v_buf=torch.zeros(8, 2, 16),
                req_to_token=torch.zeros(4, 8, dtype=torch.int32), req_rows=torch.ones(2, dtype=torch.int32),
                seq_lens=torch.ones(2, dtype=torch.int32), scale=0.25, splits=1)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        da.decode_attention(**args)
