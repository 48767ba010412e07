"""MLA attention over the pool's latent rows in place (absorbed weights, the paged Triton
kernels) against a plain PyTorch reference that decompresses every cached token: on CPU under
Triton's interpreter (small shapes), on CUDA with DeepSeek-V2-Lite's shape too (marked gpu),
and the tiny MLA model's tokens on CUDA against its CPU path.

Decode batches (one token per request, the split-KV kernel) and extend batches (chunks after
cached prefixes, the extend kernel), page sizes 1, 16 and 64."""

import pytest
import torch

from kvtransfer.models.batch import ExtendIndex
from kvtransfer.models.mla_attention import mla_attention
from tests.kvtransfer.models._support import engine_config, paged_pool, run_interpreted, tiny_spec

CASES = [  # page_size, heads, nope, rope, v_head_dim, rank, (prefix, extend) per request
    (1, 4, 16, 8, 16, 32, ((0, 1), (6, 1), (20, 1))),
    (16, 4, 16, 8, 16, 32, ((0, 9), (16, 5), (40, 20))),
    (64, 2, 16, 16, 32, 64, ((70, 1), (3, 1))),
    (64, 2, 16, 16, 32, 64, ((64, 2), (0, 30))),
]
DEEPSEEK = [  # DeepSeek-V2-Lite's heads and dims (GPU only)
    (16, 16, 128, 64, 128, 512, ((1000, 1), (3, 1), (257, 1))),
    (16, 16, 128, 64, 128, 512, ((0, 200), (300, 65))),
]


def reference(q_nope, q_pe, w_kb, w_vb, rows, r2t, req_rows, spans, scale):
    """Per request: decompress every cached token's key and value, causal softmax in float64."""
    rank = w_kb.shape[2]
    out, start = [], 0
    for row, (prefix, n) in zip(req_rows.tolist(), spans):
        cached = rows[r2t[row, : prefix + n].long(), 0].double()  # [S, rank + rope]
        c, k_pe = cached[:, :rank], cached[:, rank:]
        k_nope = torch.einsum("sr,hnr->shn", c, w_kb.double())  # [S, H, nope]
        v = torch.einsum("sr,hvr->shv", c, w_vb.double())  # [S, H, v]
        qn, qp = q_nope[start:start + n].double(), q_pe[start:start + n].double()
        s = (torch.einsum("thn,shn->hts", qn, k_nope) + torch.einsum("thr,sr->hts", qp, k_pe)) * scale
        seen = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]  # [n, S]
        out.append(torch.einsum("hts,shv->thv", torch.softmax(s.masked_fill(~seen, float("-inf")), -1), v))
        start += n
    return torch.cat(out)


def _error(case, dtype, device) -> float:
    page_size, heads, nope, rope, vd, rank, spans = case
    gen = torch.Generator().manual_seed(sum(p * 5 + n for p, n in spans) + page_size + rank)
    rows, _, r2t, req_rows = paged_pool(page_size, 1, rank + rope, 1, [p + n for p, n in spans], dtype, device, gen)
    t = sum(n for _, n in spans)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    q_nope, q_pe = randn(t, heads, nope), randn(t, heads, rope)
    w_kb, w_vb = randn(heads, nope, rank, scale=rank ** -0.5), randn(heads, vd, rank, scale=rank ** -0.5)
    host = torch.tensor([[p for p, _ in spans], [n for _, n in spans]], dtype=torch.int32)
    index = ExtendIndex(req_rows=req_rows, prefix_lens=host[0].to(device),
                        cu_seqlens=torch.cat((torch.zeros(1, dtype=torch.int32), host[1].cumsum(0).to(torch.int32))).to(device),
                        max_extend=int(host[1].max()), max_len=int((host[0] + host[1]).max()))
    scale = (nope + rope) ** -0.5
    out = mla_attention(q_nope, q_pe, w_kb, w_vb, rows, r2t, index, scale)
    ref = reference(*(x.cpu() for x in (q_nope, q_pe, w_kb, w_vb, rows, r2t, req_rows)), spans, scale)
    return float((out.cpu().double() - ref).norm() / ref.norm())


def print_interpreted_errors() -> None:
    """Entry point of the interpreter subprocess: one ``case error`` line per case."""
    for i, case in enumerate(CASES):
        print(i, _error(case, torch.float32, "cpu"), flush=True)


@pytest.fixture(scope="module")
def interpreted_errors():
    return {int(i): float(e) for i, e in run_interpreted("tests.kvtransfer.models.test_mla_attention", "print_interpreted_errors")}


@pytest.mark.parametrize("i", range(len(CASES)))
def test_interpreted_matches_reference(interpreted_errors, i):
    err = interpreted_errors[i]
    assert err < 1e-5, f"relative error {err:.2e} for {CASES[i]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + DEEPSEEK, ids=lambda c: f"page{c[0]}-h{c[1]}-rank{c[5]}-ext{max(n for _, n in c[6])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(case, dtype):
    err = _error(case, dtype, "cuda")
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"relative error {err:.2e}"


def test_rows_of_another_width_are_refused():
    index = ExtendIndex(torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                        torch.tensor([0, 1], dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match=r"rows must hold rank \+ rope = 32 \+ 8 columns"):
        mla_attention(torch.zeros(1, 2, 16), torch.zeros(1, 2, 8), torch.zeros(2, 16, 32), torch.zeros(2, 16, 32),
                      torch.zeros(8, 1, 48), torch.zeros(2, 4, dtype=torch.int32), index, 0.1)


class _Generate:
    """Prompts through chunks of 8 tokens beside each other, then decode; tokens and logits."""

    def __call__(self, engine):
        reqs = [engine.add(p, n, record_logits=True) for p, n in (((5, 6, 7), 6), (tuple(range(40, 70)), 4),
                                                                    (tuple(range(100, 113)), 5))]
        engine.run()
        return [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_mla_on_cuda_equals_its_cpu_path(page_size):
    from kvtransfer.models import launch
    from kvtransfer.models.config import ModelName

    spec = tiny_spec(ModelName.TINY_MLA)
    cfg = dict(max_requests=4, chunk_size=8, page_size=page_size)
    cpu_ids, cpu_logits = launch.run(spec, 1, engine_config(**cfg), _Generate())
    gpu_ids, gpu_logits = launch.run(spec, 1, engine_config(**cfg, device="cuda"), _Generate())
    assert gpu_ids == cpu_ids
    for a, b in zip(cpu_logits, gpu_logits):
        assert (a - b).abs().max().item() < 1e-3
