"""The benchmarks' shared front-end: one timing helper, one output format.

Every ``kvtransfer bench`` command times with :func:`time_wall` (host clock) or
:func:`time_cuda` (CUDA events), both returning a :class:`Timing` (all samples; median and
spread derived from them), and writes what it measured the same way:

- a table on the terminal (:func:`format_table`);
- a JSON document (:func:`document` + :func:`write_json`): the benchmark's name, the date, the
  command line, the machine's description (:func:`machine_info`: GPUs, driver, CPU, versions),
  its configuration and its results;
- PNG plots (:mod:`kvtransfer.benchmarks._plots`).

Long runs report progress on stderr (:class:`Progress`), so stdout stays the table that
``--record`` keeps in bench/RESULTS.md. A benchmark that plugs in (``transfer``; ``serve``, whose
per-request TTFT / inter-token samples are :class:`Timing`, ``percentile`` for p50/p90/p99, one
:class:`~kvtransfer.benchmarks._plots.Panel` per figure) brings its own cases and figures;
nothing here knows of KV.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["Progress", "Timing", "document", "format_table", "machine_info", "machine_line", "time_cuda",
           "time_once", "time_wall", "write_json"]

SCHEMA_VERSION = 1


# -- timing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed repeat, in the order they ran."""

    samples: tuple

    def __post_init__(self):
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) of the samples, linear between neighbours (TTFT p99)."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {q}")
        ordered = sorted(self.samples)
        pos = (len(ordered) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    @property
    def spread(self) -> float:
        """(max - min) / median: the run-to-run spread as a fraction of the median."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    def rate(self, nbytes: int) -> float:
        """GB/s (1e9 bytes per second) of ``nbytes`` moved in the median time."""
        return nbytes / self.median / 1e9

    def to_json(self) -> dict:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max, "p90_s": self.percentile(90),
                "spread": self.spread, "repeats": len(self.samples), "samples_s": list(self.samples)}


def time_once(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one ``fn()`` (for benchmarks that interleave the paths they compare
    run by run; their samples then make a :class:`Timing`)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_wall(fn: Callable[[], object], repeats: int, warmup: int = 0, budget_s: Optional[float] = None,
              before: Optional[Callable[[], object]] = None, after: Optional[Callable[[], object]] = None) -> Timing:
    """Wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones.

    ``budget_s``: stop repeating once the timed runs took this long together (at least one run
    is timed), so that a slow path on a long prompt does not hold the whole run up.
    ``before`` / ``after``: untimed work around every run (warm-up runs included), such as
    telling a receiver to watch for the run's notification and collecting it."""
    for _ in range(warmup):
        before and before()
        fn()
        after and after()
    samples, spent = [], 0.0
    for _ in range(repeats):
        before and before()
        samples.append(time_once(fn))
        after and after()
        spent += samples[-1]
        if budget_s is not None and spent >= budget_s:
            break
    return Timing(tuple(samples))


def time_cuda(fn: Callable[[], object], repeats: int, warmup: int = 0, busy_cycles: int = 0) -> Timing:
    """Seconds of the GPU work ``fn()`` enqueues on the current stream, by CUDA events.

    ``busy_cycles`` > 0: the stream first spins that many GPU clock cycles (``torch.cuda._sleep``)
    before the start event, so that the GPU is still busy while ``fn()`` enqueues: the events
    then time the work alone. Without it, on an idle GPU, the start event completes at once and
    the sample also holds ``fn()``'s host time up to its launch."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return Timing(tuple(samples))


# -- the machine -------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(*dists: str) -> Optional[str]:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def machine_info() -> dict:
    """What a figure was measured on: GPUs (when torch sees CUDA) and driver, CPU model and
    count, memory, OS, and the versions of the libraries on the data path."""
    info = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "gpus": [], "gpu_driver": None, "cuda": None}
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        info["memory_gib"] = None
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
            info["gpu_driver"] = _driver()
    except ImportError:
        pass
    info["versions"] = {
        "kvtransfer": _version("kvtransfer"), "torch": _version("torch"), "triton": _version("triton"),
        "numpy": _version("numpy"), "nixl": _version("nixl-cu12", "nixl-cu13", "nixl"),
        "matplotlib": _version("matplotlib"),
    }
    return info


def machine_line(info: Optional[dict] = None) -> str:
    """One line: GPUs, CPU model and cores, torch and triton versions (bench/RESULTS.md's)."""
    info = machine_info() if info is None else info
    parts = [f"{info['cpu']} ({info['cpu_count']} cores)"]
    names = info["gpus"]
    if names:
        parts.insert(0, ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names)))
    for lib in ("torch", "triton"):
        if info["versions"].get(lib):
            parts.append(f"{lib} {info['versions'][lib]}")
    return ", ".join(parts)


# -- output ------------------------------------------------------------------------------------


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A plain-text table: the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "-" * len(line(header))] + [line(r) for r in rows])


def document(benchmark: str, argv: Sequence[str], config: dict, results: list, **extra) -> dict:
    """The JSON document of one run: what ran, where, when, with which settings, and every figure."""
    return {"benchmark": benchmark, "schema": SCHEMA_VERSION,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join(["kvtransfer", "bench", benchmark, *argv]),
            "machine": machine_info(), "config": config, **extra, "results": results}


def write_json(path: Path, doc: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return path


class Progress:
    """``[k/n] what (elapsed, ~left)`` lines on stderr, one per step of a long run."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled, self.done = total, enabled, 0
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {what}  ({elapsed:.0f} s, ~{left:.0f} s left)", file=self.stream,
              flush=True)
