"""`kvtransfer bench plan` runs end to end on a small request."""

from kvtransfer.benchmarks.plan import main


def test_bench_plan_small(capsys):
    assert main(["--tokens", "512", "--layers", "2", "--repeat", "2", "--flatten-repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "factored plan" in out and "4 buffer pairs x" in out and "2048 at one per (buffer, token)" in out
