"""``kvtransfer demo``, the README's main command, for the three models with prefill -> decode TP
pairs and page sizes that differ: real processes, real NIXL transfers, completions compared
with a colocated node and every request's KV verified layer by layer."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.kvtransfer.serve._demo import started_demo, stopped_demo


def _demo(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtransfer", "demo", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("model, prefill_tp, decode_tp, pages, prompts", [
    ("smollm2", 3, 1, (16, 64), 2),  # the README's run, shorter
    ("smollm2", 1, 3, (64, 16), 1),
    # mla-tiny 2 -> 1 (16 -> 64) is test_api.py's cluster, compared and verified there
    ("mla-tiny", 1, 2, (1, 16), 2),
    ("hybrid-tiny", 2, 1, (16, 64), 2),
    ("hybrid-tiny", 1, 2, (64, 1), 2),
])
def test_demo(model, prefill_tp, decode_tp, pages, prompts):
    out = _demo("--model", model, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
                "--prefill-page-size", str(pages[0]), "--decode-page-size", str(pages[1]),
                "--prompts", str(prompts), "--max-tokens", "10" if model == "smollm2" else "6")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{prompts} of {prompts} completions equal the colocated node's" in out.stdout
    assert f"{prompts} of {prompts} requests' KV verified layer by layer" in out.stdout
    assert out.stdout.count("bit for bit; same as the colocated node") == prompts
    moved = [float(x) for x in re.findall(r"KV ([0-9.]+) MiB in", out.stdout)]
    assert len(moved) == prompts and all(x > 0 for x in moved)
    if model == "smollm2":
        assert "'The capital of France is Paris.'" in out.stdout
    logdir = re.search(r"logs in (\S+)", out.stdout).group(1)
    assert "Traceback" not in "".join(open(f"{logdir}/{name}").read() for name in
                                      ("prefill-node.log", "decode-node.log", "router.log", "colocated-node.log"))


@pytest.mark.parametrize("cores, ranks, threads", [(2, 5, 1), (16, 5, 3), (1, 3, 1), (64, 4, 16)])
def test_the_demos_ranks_share_the_cores(monkeypatch, cores, ranks, threads):
    """Every rank process the demo starts gets an equal share of the cores it may run on (a
    node's own default assumes the machine is its alone: on two cores the demo's five ranks
    asked for seven threads)."""
    from kvtransfer.demo import threads_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert threads_per_rank(ranks) == threads


def test_demo_bad_input_is_one_line():
    out = _demo("--model", "smollm2", "--prefill-tp", "2")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "kvtransfer demo: error: --prefill-tp: TP size 2 does not divide the query heads=9; this model allows TP 1, 3")
    out = _demo("--model", "gpt-5")
    assert out.returncode == 2 and "unknown model 'gpt-5'" in out.stderr


def test_demo_interrupted_leaves_nothing_behind():
    import signal

    proc, before = started_demo("--model", "mla-tiny", "--prompts", "1")
    err = stopped_demo(proc, before, signal.SIGINT)
    assert proc.returncode == 130, err
    assert "interrupted" in err
