"""``kvtransfer bench NAME --record``: run a benchmark and write its section of bench/RESULTS.md.

The section ``## kvtransfer bench NAME`` is replaced (or appended) with the machine, the date,
the command line and everything the benchmark printed to stdout, in a ``text`` block. A run
that fails (a non-zero exit, an exception) records nothing. Other sections stay as they are.
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

__all__ = ["RESULTS_PATH", "machine", "run_recorded", "write_section"]

RESULTS_PATH = Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md"


def machine() -> str:
    """One line: GPUs (when torch sees CUDA), CPU model and cores, torch and triton versions."""
    return machine_line()


# Library log records interleaved with a benchmark's output (NIXL's "2026-11-30 09:20:49 NIXL INFO ...")
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(,\d+)? \S+ +(DEBUG|INFO) ")


def section(name: str, argv: list[str], output: str, when: Optional[datetime.datetime] = None,
            title: Optional[str] = None) -> str:
    """The text of benchmark ``name``'s section, heading included (library INFO/DEBUG log
    records dropped from ``output``); ``title``: the heading's name when it is not ``name``."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    output = "".join(line for line in output.splitlines(keepends=True) if not _LOG_RECORD.match(line))
    command = shlex.join(["kvtransfer", "bench", name, *argv])
    return (f"## kvtransfer bench {title or name}\n\n- machine: {machine()}\n- date: {when:%Y-%m-%d %H:%M} UTC\n"
            f"- command: `{command}`\n\n```text\n{output.rstrip()}\n```\n")


def write_section(path: Path, heading: str, text: str) -> None:
    """Replace the section that starts with the line ``heading`` (up to the next ``## `` line)
    by ``text``, or append ``text`` when there is none."""
    old = path.read_text() if path.exists() else ""
    lines = old.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == heading), None)
    if start is None:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + tail if tail else "")
    path.write_text(new)


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
                 path: Optional[Path] = None, title: Optional[str] = None) -> int:
    """Run ``main(argv)`` with its stdout shown and kept; on success write its section to
    ``path`` (default :data:`RESULTS_PATH`). ``title``: the section's name when it is not
    ``name`` (a benchmark whose runs on different memory keep a section each)."""
    path = RESULTS_PATH if path is None else path
    kept = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, kept)):
        rc = int(main(argv) or 0)
    if rc != 0:
        print(f"kvtransfer bench {name}: exit status {rc}, nothing recorded in {path}", file=sys.stderr)
        return rc
    write_section(path, f"## kvtransfer bench {title or name}", section(name, argv, kept.getvalue(), title=title))
    print(f"kvtransfer bench {name}: recorded in {path}", file=sys.stderr)
    return rc
