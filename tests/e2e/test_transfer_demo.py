"""The transfer demo, small: real processes, real NIXL transfers, verified bytes."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("kvtransfer.transfer_demo")


def _demo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="tcp,self,sm")
    return subprocess.run(
        [sys.executable, "-m", "kvtransfer", "transfer-demo", "--layers", "2", "--tokens", "300", *args],
        capture_output=True, text=True, timeout=240, env=env,
    )


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, heads, pages",
    [
        (2, 1, 8, (16, 64)),  # the README default shape: decode rows assembled from two senders
        (1, 4, 2, (1, 16)),  # decode TP > KV heads: heads replicated on decode
        (4, 2, 2, (64, 1)),  # prefill TP > KV heads: replicas spread over decode ranks
    ],
)
def test_demo_moves_and_verifies(prefill_tp, decode_tp, heads, pages):
    out = _demo("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--total-heads", str(heads),
                "--head-dim", "64", "--prefill-page-size", str(pages[0]), "--decode-page-size", str(pages[1]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all decode ranks match the reference" in out.stdout
    assert out.stdout.count(": OK") == decode_tp


def test_demo_rejects_impossible_tp():
    out = _demo("--prefill-tp", "3", "--total-heads", "8")
    assert out.returncode == 1
    assert "--prefill-tp=3 and --total-heads=8" in out.stderr
