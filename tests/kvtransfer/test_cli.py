"""The command line: every benchmark runs at a small size and prints its table."""

import os
import subprocess
import sys

import pytest


def _kvt(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="tcp,self,sm", NIXL_LOG_LEVEL="WARN")
    return subprocess.run([sys.executable, "-m", "kvtransfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_bench_lists_names_and_rejects_unknown():
    out = _kvt("bench")
    assert out.returncode == 0 and "transport" in out.stdout and "plan" in out.stdout
    bad = _kvt("bench", "nonesuch")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_bench_transport_small():
    out = _kvt("bench", "transport", "--total", "8M", "--blocks", "256K", "--iters", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GB/s" in out.stdout


def test_bench_move_kv_cpu():
    out = _kvt("bench", "move_kv", "--cpu", "--iters", "2", "--warmup", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "native torch" in out.stdout


def test_layouts_prints_every_pool_kind():
    out = _kvt("layouts", "--page-size", "16", "--tp-size", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("MHA bf16", "MHA fp8", "MHA fp4", "MLA", "NSA", "hybrid"):
        assert name in out.stdout
    assert "state buffers" in out.stdout


def test_bench_nvlink_says_it_needs_two_gpus():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("has GPUs: the real benchmark runs in bench/gpu_check.sh")
    out = _kvt("bench", "nvlink")
    assert out.returncode != 0
    assert "GPU" in out.stdout + out.stderr
