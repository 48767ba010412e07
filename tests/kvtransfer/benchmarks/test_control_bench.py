"""``kvtransfer bench control``'s own smoke test: a small run completes, and the soak (aborts,
a prefill restart) leaves nothing behind (the benchmark exits non-zero on any leak)."""

from kvtransfer.benchmarks.control import main


def test_small_control_bench_runs_clean(capsys):
    assert main(["--latency-requests", "5", "--inflight", "20", "--soak", "200"]) == 0
    out = capsys.readouterr().out
    assert "all zero" in out and "control overhead" in out
