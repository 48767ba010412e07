"""The benchmarks' shared front-end: Timing's statistics, the table, the JSON document, progress."""

from __future__ import annotations

import io
import json
import statistics

import pytest

from kvtransfer.benchmarks import _report
from kvtransfer.benchmarks._report import Progress, Timing


def test_timing_statistics_follow_the_samples():
    samples = (0.4, 0.1, 0.3, 0.2, 0.5)
    t = Timing(samples)
    assert t.median == statistics.median(samples) and (t.min, t.max) == (0.1, 0.5)
    assert t.spread == pytest.approx((0.5 - 0.1) / t.median)
    assert t.percentile(0) == 0.1 and t.percentile(100) == 0.5 and t.percentile(50) == t.median
    assert t.percentile(90) == pytest.approx(0.46)
    assert t.rate(3 * 10**9) == pytest.approx(3 / t.median)
    assert t.to_json()["samples_s"] == list(samples)
    with pytest.raises(ValueError, match="at least one sample"):
        Timing(())
    with pytest.raises(ValueError, match=r"in \[0, 100\]"):
        t.percentile(101)


def test_time_wall_runs_the_hooks_around_every_run_and_keeps_to_its_budget():
    calls = []
    t = _report.time_wall(lambda: calls.append("run"), 3, warmup=1, before=lambda: calls.append("before"),
                          after=lambda: calls.append("after"))
    assert len(t.samples) == 3 and calls == ["before", "run", "after"] * 4
    assert len(_report.time_wall(lambda: None, 50, budget_s=0.0).samples) == 1


def test_table_document_and_progress(tmp_path):
    text = _report.format_table(["name", "GB/s"], [["a", "1.00"], ["long name", "10.00"]])
    lines = text.splitlines()
    assert lines[0].startswith("name") and lines[2].startswith("a ") and lines[3].endswith("10.00")
    doc = _report.document("demo", ["--x", "1"], {"x": 1}, [{"y": 2}])
    assert doc["command"] == "kvtransfer bench demo --x 1" and doc["machine"]["cpu_count"] >= 1
    path = _report.write_json(tmp_path / "sub" / "demo.json", doc)
    assert json.loads(path.read_text())["results"] == [{"y": 2}]
    out = io.StringIO()
    p = Progress(2, stream=out)
    p.step("first")
    p.step("second")
    assert out.getvalue().splitlines()[1].startswith("[2/2] second")
