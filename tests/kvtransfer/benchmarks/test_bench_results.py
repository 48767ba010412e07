"""``kvtransfer bench NAME --record``: the section of bench/RESULTS.md a benchmark rewrites, and
the record of one kind of run within it."""

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
    _results.write_record(path, "plan", "## kvtransfer bench plan\n\nnew\n")
    text = path.read_text()
    assert "old plan table" not in text and "new\n\n## kvtransfer bench nvlink\n\nold nvlink table" in text
    assert text.endswith("## Probes\n\nkept as is\n")
    _results.write_record(path, "other", "## kvtransfer bench other\n\nx\n")
    assert path.read_text().endswith("kept as is\n\n## kvtransfer bench other\n\nx\n")


def test_section_names_machine_date_and_command():
    when = datetime.datetime(2026, 11, 30, 9, 30, tzinfo=datetime.timezone.utc)
    text = _results.record("nvlink", ["--reps", "3"], "a | b\n1 | 2\n\n", when)
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


def test_a_kind_of_run_replaces_only_its_own_record_in_the_section(tmp_path, capsys):
    from kvtransfer.benchmarks import transfer

    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    variant = transfer.record_variant(["--memory", "host", "--quick"])
    assert variant == "host memory"
    assert _results.run_recorded("transfer", lambda argv: print("host table") or 0, ["--quick"], path,
                                 variant=variant) == 0
    assert _results.run_recorded("transfer", lambda argv: print("gpu table") or 0, ["--memory", "gpu"], path,
                                 variant="GPU") == 0
    text = path.read_text()
    assert "kept as is\n\n## kvtransfer bench transfer\n\n### host memory\n\n- machine: " in text
    assert text.index("### host memory") < text.index("host table") < text.index("### GPU") < text.index("gpu table")
    assert _results.run_recorded("transfer", lambda argv: print("new host table") or 0, ["--quick"], path,
                                 variant=variant) == 0
    text = path.read_text()
    assert "host table\n" not in text.replace("new host table", "") and "new host table" in text and "gpu table" in text
    assert text.index("### host memory") < text.index("new host table") < text.index("### GPU")
    assert text.count("## kvtransfer bench transfer\n") == 1 and "old plan table" in text and "kept as is" in text


def test_the_kinds_of_run_of_nvlink_and_transport():
    from kvtransfer.benchmarks import nvlink, transport

    assert nvlink.record_variant([]) == "two GPUs"
    assert nvlink.record_variant(["--dst-device", "0", "--tokens", "1024"]) == "one GPU"
    assert transport.record_variant(["--cuda"]) == "blocks, GPU"
    assert transport.record_variant([]) == "blocks, host memory"
    assert transport.record_variant(["--kv", "--cuda"]) == "KV request, GPU"
    assert transport.record_variant(["--kv", "--two-hosts", "--iters", "7"]) == "KV request, two hosts"


def test_the_kinds_of_run_of_transfer():
    from kvtransfer.benchmarks import transfer

    assert transfer.record_variant(["--memory", "host"]) == "host memory"
    assert transfer.record_variant(["--memory", "gpu"]) == "GPU"
    assert transfer.record_variant(["--two-hosts", "--tokens", "1024"]) == "two hosts"
    assert transfer.record_variant(["--memory", "host", "--layerwise", "on,off"]) == "host memory, layer-wise"
    assert transfer.record_variant(["--two-hosts", "--layerwise", "on"]) == "two hosts, layer-wise"


def test_a_heading_inside_the_output_does_not_end_the_record(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(DOC)
    text = "### one GPU\n\n```text\n## not a heading\n### nor this\n```\n"
    _results.write_record(path, "nvlink", "## kvtransfer bench nvlink\n\n" + text)
    _results.write_record(path, "nvlink", text.replace("nor this", "nor that"), "one GPU")
    got = path.read_text()
    assert "nor that" in got and "nor this" not in got and got.count("### one GPU") == 1
    assert got.endswith("## Probes\n\nkept as is\n")
