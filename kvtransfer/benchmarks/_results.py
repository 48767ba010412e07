"""``kvtransfer bench NAME --record``: run a benchmark and write its record in bench/RESULTS.md.

bench/RESULTS.md holds one section per benchmark, ``## kvtransfer bench NAME``. A record is the
machine, the date, the command line and everything the benchmark printed to stdout, in a
``text`` block. A benchmark whose runs differ in kind (host memory or GPU, one GPU or two) names
the kind of a run with ``record_variant(argv)``; its section then holds one record per kind,
each under ``### KIND``, and a run replaces only its own kind's record. Without a kind, a run's
record is the whole section. A run that fails (a non-zero exit, an exception) records nothing;
other sections and other kinds' records stay as they are.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional

from kvtransfer.benchmarks._report import machine_line

__all__ = ["RESULTS_PATH", "machine", "record", "run_recorded", "write_record"]

RESULTS_PATH = Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md"


def machine() -> str:
    """One line: GPUs (when torch sees CUDA), CPU model and cores, torch and triton versions."""
    return machine_line()


# Library log records interleaved with a benchmark's output (NIXL's "2026-11-30 09:20:49 NIXL INFO ...")
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(,\d+)? \S+ +(DEBUG|INFO) ")


def heading(name: str) -> str:
    """The line that starts benchmark ``name``'s section."""
    return f"## kvtransfer bench {name}"


def record(name: str, argv: list[str], output: str, when: Optional[datetime.datetime] = None,
           variant: Optional[str] = None) -> str:
    """The text of one record of benchmark ``name``, its heading included: the section's
    (``## kvtransfer bench NAME``) or, with ``variant``, the kind's (``### VARIANT``). Library
    INFO/DEBUG log records are dropped from ``output``."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    output = "".join(line for line in output.splitlines(keepends=True) if not _LOG_RECORD.match(line))
    command = shlex.join(["kvtransfer", "bench", name, *argv])
    title = f"### {variant}" if variant else heading(name)
    return (f"{title}\n\n- machine: {machine()}\n- date: {when:%Y-%m-%d %H:%M} UTC\n"
            f"- command: `{command}`\n\n```text\n{output.rstrip()}\n```\n")


def _block_end(lines: list[str], start: int, prefixes: tuple) -> int:
    """The index of the first line after ``start`` that opens a block at one of ``prefixes``'
    levels, outside fenced code; ``len(lines)`` when none does."""
    fenced = False
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif not fenced and lines[i].startswith(prefixes):
            return i
    return len(lines)


def _find(lines: list[str], line: str, lo: int, hi: int) -> Optional[int]:
    return next((i for i in range(lo, hi) if lines[i].rstrip("\n") == line), None)


def _splice(lines: list[str], lo: int, hi: int, text: str) -> list[str]:
    """``lines`` with ``lines[lo:hi]`` replaced by ``text``, one blank line before what follows."""
    tail = lines[hi:]
    block = text.rstrip("\n") + "\n" + ("\n" if tail else "")
    return lines[:lo] + block.splitlines(keepends=True) + tail


def write_record(path: Path, name: str, text: str, variant: Optional[str] = None) -> None:
    """Put ``text`` (from :func:`record`) in benchmark ``name``'s section of ``path``: the whole
    section without ``variant``; else the section's ``### VARIANT`` record, the section made
    when there is none. A missing section goes at the end of the file."""
    old = path.read_text() if path.exists() else ""
    lines = old.splitlines(keepends=True)
    start = _find(lines, heading(name), 0, len(lines))
    if start is None:
        body = text if variant is None else f"{heading(name)}\n\n{text}"
        path.write_text(old.rstrip("\n") + ("\n\n" if old else "") + body.rstrip("\n") + "\n")
        return
    end = _block_end(lines, start, ("## ",))
    if variant is None:
        lines = _splice(lines, start, end, text)
    else:
        sub = _find(lines, f"### {variant}", start + 1, end)
        if sub is None:  # a new kind: after the section's last line
            while end > start + 1 and not lines[end - 1].strip():
                end -= 1
            lines = _splice(lines, end, end, "\n" + text)
        else:
            lines = _splice(lines, sub, _block_end(lines, sub, ("## ", "### ")), text)
    path.write_text("".join(lines))


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self._streams = streams

    def write(self, text: str) -> int:
        for s in self._streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self._streams:
            s.flush()


def run_recorded(name: str, main: Callable[[list[str]], Optional[int]], argv: list[str],
                 path: Optional[Path] = None, variant: Optional[str] = None) -> int:
    """Run ``main(argv)`` with its stdout shown and kept; on success write its record to
    ``path`` (default :data:`RESULTS_PATH`). ``variant``: the kind of run, when the benchmark's
    section keeps one record per kind."""
    path = RESULTS_PATH if path is None else path
    kept = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, kept)):
        rc = int(main(argv) or 0)
    if rc != 0:
        print(f"kvtransfer bench {name}: exit status {rc}, nothing recorded in {path}", file=sys.stderr)
        return rc
    write_record(path, name, record(name, argv, kept.getvalue(), variant=variant), variant)
    print(f"kvtransfer bench {name}: recorded in {path}", file=sys.stderr)
    return rc
