"""Top-k sampling: the CPU path (``Sampling.draw``) and the GPU sampler
(:mod:`kvtransfer.models.sampler`, on CPU tensors under Triton's interpreter and on CUDA) keep
the same tokens, draw only among them, in proportion to their renormalised softmax, and greedy
is unchanged."""

import pytest
import torch

from kvtransfer.models.engine import Sampling
from kvtransfer.models.sampler import MAX_TOP_K, top_k_thresholds
from tests.kvtransfer.models._support import run_interpreted

ROW = [2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -2.0, 0.2]  # top 3: indices 0, 5, 1


def _restricted_softmax(row: torch.Tensor, k: int, temp: float) -> torch.Tensor:
    """The reference: softmax(row / T) over the k largest entries, 0 elsewhere."""
    keep = torch.zeros_like(row, dtype=torch.bool)
    keep[row.topk(k).indices] = True
    return torch.softmax((row / temp).masked_fill(~keep, float("-inf")), -1)


@pytest.mark.parametrize("bad", [-1, MAX_TOP_K + 1, 2.0, True])
def test_top_k_outside_its_range_is_refused(bad):
    with pytest.raises(ValueError, match="top_k must be an int"):
        Sampling(temperature=1.0, top_k=bad)


def test_thresholds_keep_the_k_largest_and_ties_with_the_kth():
    logits = torch.tensor([ROW, ROW, [1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 0.0]])
    thr = top_k_thresholds(logits, torch.tensor([0, 3, 2]))
    kept = logits >= thr[:, None]
    assert kept[0].all()  # 0: no limit
    assert kept[1].nonzero()[:, 0].tolist() == [0, 1, 5]
    assert kept[2].nonzero()[:, 0].tolist() == [1, 2, 4]  # a three-way tie at the 2nd value
    assert top_k_thresholds(logits, torch.tensor([8, 9, 1000])).eq(float("-inf")).all()  # k >= vocab


def test_cpu_draws_stay_in_the_top_k_and_follow_their_softmax():
    row = torch.tensor(ROW)
    n, temp = 6000, 0.7
    one = {Sampling(temperature=temp, seed=s, top_k=1).draw(row, 5)[0] for s in range(50)}
    assert one == {0}  # top-1 at any temperature is the argmax
    tokens = torch.tensor([Sampling(temperature=temp, seed=s, top_k=3).draw(row, 5)[0] for s in range(n)])
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq - _restricted_softmax(row, 3, temp)).abs().max().item() < 0.03
    token, logprob = Sampling(temperature=temp, seed=1, top_k=3).draw(row, 5)
    assert logprob == pytest.approx(torch.log_softmax(row, -1)[token].item())  # of the unfiltered logits


def _sampler_case(device: str, n: int):
    """``(tokens, reference frequencies, greedy tokens, argmax)``: ``n`` seeded draws of ROW at
    top-k 3, then a greedy batch whose rows ask for top-k (ignored at temperature 0)."""
    from kvtransfer.models.sampler import sample

    row = torch.tensor(ROW, device=device)
    temp = 0.7
    keys = torch.arange(n, dtype=torch.int64, device=device) * 7919
    tokens, _ = sample(row.expand(n, -1).contiguous(), torch.full((n,), temp, device=device), keys,
                       torch.full((n,), 3, dtype=torch.int64, device=device))
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3000, generator=gen).to(device)
    greedy, _ = sample(logits, torch.zeros(4, device=device), keys[:4],
                       torch.tensor([0, 1, 5, 2], dtype=torch.int64, device=device))
    return tokens.cpu(), _restricted_softmax(row.cpu(), 3, temp), greedy.cpu(), logits.argmax(-1).cpu()


def print_interpreted_sampler() -> None:
    """Entry point of the interpreter subprocess: frequency error, then whether greedy held."""
    tokens, ref, greedy, argmax = _sampler_case("cpu", 2000)
    freq = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    print(float((freq - ref).abs().max()), int(set(tokens.tolist()) <= {0, 1, 5}), int(torch.equal(greedy, argmax)))


def test_interpreted_sampler_keeps_the_top_k_and_greedy():
    (err, inside, greedy_ok), = run_interpreted("tests.kvtransfer.models.test_sampler", "print_interpreted_sampler")
    assert int(inside) == 1 and int(greedy_ok) == 1
    assert float(err) < 0.05


@pytest.mark.gpu
def test_cuda_sampler_keeps_the_top_k_and_greedy():
    tokens, ref, greedy, argmax = _sampler_case("cuda", 40000)
    assert set(tokens.tolist()) <= {0, 1, 5}
    freq = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    assert (freq - ref).abs().max().item() < 0.015
    assert torch.equal(greedy, argmax)
