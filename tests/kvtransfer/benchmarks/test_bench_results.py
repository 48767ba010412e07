"""``kvtransfer bench NAME --record``: the section of bench/RESULTS.md a benchmark rewrites."""

from __future__ import annotations

import datetime

from kvtransfer import cli
from kvtransfer.benchmarks import _results

DOC = """# Measured results

intro

## kvtransfer bench plan

old plan table

## kvtransfer bench nvlink

old nvlink table

## Probes

kept as is
"""


def test_write_section_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    _results.write_section(path, "## kvtransfer bench plan", "## kvtransfer bench plan\n\nnew\n")
    text = path.read_text()
    assert "old plan table" not in text and "new\n\n## kvtransfer bench nvlink\n\nold nvlink table" in text
    assert text.endswith("## Probes\n\nkept as is\n")
    _results.write_section(path, "## kvtransfer bench other", "## kvtransfer bench other\n\nx\n")
    assert path.read_text().endswith("kept as is\n\n## kvtransfer bench other\n\nx\n")


def test_section_names_machine_date_and_command():
    when = datetime.datetime(2026, 11, 30, 9, 30, tzinfo=datetime.timezone.utc)
    text = _results.section("nvlink", ["--reps", "3"], "a | b\n1 | 2\n\n", when)
    assert text.startswith("## kvtransfer bench nvlink\n\n- machine: ")
    assert "- date: 2026-11-30 09:30 UTC\n- command: `kvtransfer bench nvlink --reps 3`\n" in text
    assert text.endswith("```text\na | b\n1 | 2\n```\n")


def test_record_flag_rewrites_the_section_from_a_run(tmp_path, monkeypatch, capsys):
    path = tmp_path / "RESULTS.md"
    path.write_text(DOC.replace("plan", "move_kv"))
    monkeypatch.setattr(_results, "RESULTS_PATH", path)
    assert cli.main(["bench", "move_kv", "--record", "--cpu", "--iters", "2", "--warmup", "1"]) == 0
    printed = capsys.readouterr().out
    text = path.read_text()
    assert "old move_kv table" not in text and "native torch" in printed and "native torch" in text
    assert "- command: `kvtransfer bench move_kv --cpu --iters 2 --warmup 1`" in text
    assert "old nvlink table" in text and "kept as is" in text


def test_a_failed_run_records_nothing(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    assert _results.run_recorded("plan", lambda argv: 2, [], path) == 2
    assert path.read_text() == DOC


def test_a_titled_record_keeps_its_own_section(tmp_path, capsys):
    from kvtransfer.benchmarks import transfer

    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    title = transfer.record_title(["--memory", "host", "--quick"])
    assert title == "transfer (host memory)"
    assert _results.run_recorded("transfer", lambda argv: print("the table") or 0, ["--quick"], path, title=title) == 0
    text = path.read_text()
    assert "## kvtransfer bench transfer (host memory)\n" in text and "the table" in text
    assert "- command: `kvtransfer bench transfer --quick`" in text and "old plan table" in text
