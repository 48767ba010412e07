"""``kvtransfer bench serve --quick``: real nodes and a router on this machine, the JSON's figures
consistent with each other, the plot written."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_serve_quick(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvtransfer", "bench", "serve", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "serve.json").read_text())
    assert doc["benchmark"] == "serve" and doc["machine"]["cpu_count"] >= 1
    modes = {r["mode"]: r for r in doc["results"]}
    assert set(modes) == {"disaggregated", "colocated"}
    for mode, r in modes.items():
        samples = doc["samples"][mode]
        assert r["succeeded"] == r["requests"] == len(samples) == 12
        assert r["output_tokens"] == sum(s["output_tokens"] for s in samples)
        assert all(s["ok"] and s["ttft"] > 0 and s["latency"] >= s["ttft"] for s in samples)
        assert all(len(s["itl"]) == s["output_tokens"] - 1 for s in samples)  # ignore_eos: every drawn token
        assert r["ttft"]["p50"] <= r["ttft"]["p90"] <= r["ttft"]["p99"]
    # the same requests in both modes: the same prompt and output token counts
    assert [s["prompt_tokens"] for s in doc["samples"]["colocated"]] == [
        s["prompt_tokens"] for s in doc["samples"]["disaggregated"]]
    split = doc["ttft_split"]
    assert split["prefill compute"] > 0 and split["KV transfer"] > 0 and split["kv_bytes_median"] > 0
    assert all(s["kv"]["kv_bytes"] > 0 and s["kv"]["prefill"]["compute_s"] > 0 for s in doc["samples"]["disaggregated"])
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert "disaggregated TTFT, medians of its parts" in out.stdout
