"""``kvtransfer bench serve --quick --layerwise on,off``: real nodes and a router on this machine,
KV sent layer by layer and after the prompt alternated, two prompt spans against the same nodes,
each span's JSON figures consistent with each other, its plot written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_serve_quick_over_two_prompt_spans(tmp_path):
    spans = (("serve-16-96", (16, 96)), ("serve-64", (64, 64)))
    out = subprocess.run([sys.executable, "-m", "kvtransfer", "bench", "serve", "--quick", "--layerwise", "on,off",
                          "--requests", "8", "--prompt-tokens", "16:96,64", "--max-running", "4",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stderr.count("starting the nodes") == 1  # one set of nodes for both spans
    assert not (tmp_path / "serve.json").exists()
    for stem, (lo, hi) in spans:
        doc = json.loads((tmp_path / f"{stem}.json").read_text())
        assert doc["benchmark"] == "serve" and doc["machine"]["cpu_count"] >= 1
        assert doc["config"]["prompt_tokens"] == [lo, hi] and doc["config"]["max_running"] == 4
        assert f"prompts {lo}-{hi} tokens" in out.stdout
        modes = {r["mode"]: r for r in doc["results"]}
        assert set(modes) == {"disaggregated layer-wise", "disaggregated", "colocated"}
        assert doc["config"]["rounds"] is None
        for mode, r in modes.items():
            samples = doc["samples"][mode]
            assert r["succeeded"] == r["requests"] == len(samples) == 8
            assert r["output_tokens"] == sum(s["output_tokens"] for s in samples)
            assert all(s["ok"] and s["ttft"] > 0 and s["latency"] >= s["ttft"] for s in samples)
            assert all(len(s["itl"]) == s["output_tokens"] - 1 for s in samples)  # ignore_eos: every drawn token
            assert r["ttft"]["p50"] <= r["ttft"]["p90"] <= r["ttft"]["p99"]
        # the same requests in every mode: the same prompt and output token counts
        for mode in ("disaggregated", "disaggregated layer-wise"):
            assert [s["prompt_tokens"] for s in doc["samples"]["colocated"]] == [
                s["prompt_tokens"] for s in doc["samples"][mode]]
            split = doc["ttft_split"][mode]
            assert split["prefill compute"] > 0 and split["KV transfer"] > 0 and split["kv_bytes_median"] > 0
            landed = split["first token sampled -> KV landed on decode"]
            assert 0 < landed < split["first token sampled -> in decode's batch"]  # one host: the nodes' clocks are one
            assert 0 < split["first token sampled -> prefill posts the last writes"] < landed
            # the client runs there too: the way in and the way out, stamped on its clock
            way_in, way_out = split["request sent -> in prefill's queue"], split["KV landed -> first token at the client"]
            assert 0 < way_in < modes[mode]["ttft"]["p50"] and 0 < way_out < modes[mode]["ttft"]["p50"]
            for s in doc["samples"][mode]:
                assert s["kv"]["kv_bytes"] > 0 and s["kv"]["prefill"]["compute_s"] > 0
                pre = s["kv"]["prefill"]
                assert s["kv"]["decoding_at"] > s["kv"]["landed_at"] > pre["posted_at"] > pre["sampled_at"]
        assert (tmp_path / f"{stem}.png").stat().st_size > 10_000
        # the nodes counted the prompt lengths that were drawn: each within the span, up to a word over
        assert all(lo <= s["prompt_tokens"] <= hi + 8 for s in doc["samples"]["colocated"])
    assert out.stdout.count("2 rounds alternating the modes") == 2
    for mode in ("disaggregated", "disaggregated layer-wise"):
        assert out.stdout.count(f"{mode} TTFT, medians of its parts") == 2


def test_prompt_spans_are_checked():
    out = subprocess.run([sys.executable, "-m", "kvtransfer", "bench", "serve", "--prompt-tokens", "64,9:3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "expected 0 < LO <= HI, got '9:3'" in out.stderr, out.stderr


@pytest.mark.parametrize("tokens_per_byte", [1, 3])
def test_each_prompt_is_the_fewest_words_that_reach_its_drawn_length(tokens_per_byte):
    """Words of several tokens each (a byte tokenizer, or three tokens a byte) do not overshoot."""
    from kvtransfer.benchmarks.serve import workload

    class Tokens:
        def encode(self, text):
            return list(text.encode()) * tokens_per_byte

    works = workload(Tokens(), 40, (256, 1024), (1, 2), seed=0)
    for work in works:  # at least the range's least; without its last word, short of the drawn length
        assert work.prompt_tokens == len(Tokens().encode(work.prompt)) >= 256
        assert len(Tokens().encode(work.prompt.rsplit(" ", 1)[0])) < 1024
    assert len({w.prompt_tokens for w in works}) > 30  # drawn, not one length
