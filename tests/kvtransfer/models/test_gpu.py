"""The same models on CUDA (skipped without a GPU): float32 tokens equal the CPU's, logits close;
TP 2 over NCCL with two GPUs."""

import pytest
import torch

from kvtransfer.models import launch
from kvtransfer.models.config import ModelName
from kvtransfer.models.jobs import Generate
from tests.kvtransfer.models._support import SMALL, byte_prompts, engine_config, tiny_spec

GPU_ATOL = 1e-3  # float32 on both sides; cuBLAS and CPU BLAS sum in different orders
NEW = 6


def _spec(request, name):
    return request.getfixturevalue("smollm2")[0] if name is ModelName.SMOLLM2 else tiny_spec(name)


def _prompts(request, name):
    if name is ModelName.SMOLLM2:
        return (tuple(request.getfixturevalue("smollm2")[1].encode("The capital of France is")),)
    return byte_prompts("hello gpu", "abc")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [m for m in ModelName if not m.random_weights])
def test_cuda_matches_cpu(request, name):
    spec = _spec(request, name)
    job = Generate(_prompts(request, name), NEW, record_logits=True)
    cpu = launch.run(spec, 1, SMALL, job)
    gpu = launch.run(spec, 1, engine_config(device="cuda"), job)
    assert gpu.output_ids == cpu.output_ids
    for a, b in zip(cpu.logits, gpu.logits):
        assert (a - b).abs().max().item() < GPU_ATOL


@pytest.mark.multigpu
@pytest.mark.parametrize("name", [ModelName.TINY_MLA, ModelName.TINY_HYBRID])
def test_cuda_tp2_matches_cpu_tp1(request, name):
    spec = tiny_spec(name)
    job = Generate(_prompts(request, name), NEW, record_logits=True)
    cpu = launch.run(spec, 1, SMALL, job)
    gpu = launch.run(spec, 2, engine_config(device="cuda"), job)
    assert gpu.output_ids == cpu.output_ids


@pytest.mark.gpu
def test_smollm2_bfloat16_on_cuda(smollm2):
    spec, tok = smollm2
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = launch.run(spec, 1, engine_config(device="cuda", dtype=torch.bfloat16),
                     Generate((tuple(prompt),), 12, tok.stop_ids))
    assert "Paris" in tok.decode(out.output_ids[0])
