"""PNG plots of the benchmarks, through matplotlib (the ``bench`` extra).

One kind of figure serves them all: a grid of panels, each with a line per series (a transfer
path, a percentile) against one x quantity (prompt length, request rate), and reference lines
drawn dashed (the link's bandwidth). :func:`line_grid` writes it; matplotlib is imported only
here, with the non-interactive Agg backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["Panel", "line_grid", "plots_available"]


@dataclass(frozen=True)
class Panel:
    """One subplot: ``series`` name -> (xs, ys) drawn as lines with markers; ``bands`` name ->
    (lows, highs) of a series, shaded around it (the spread over repeats); ``references`` name
    -> (xs, ys) drawn dashed in black (a baseline such as the link)."""

    title: str
    series: dict
    references: dict = field(default_factory=dict)
    bands: dict = field(default_factory=dict)


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _short_number(x: float, _pos=None) -> str:
    """Tick labels: 1024 -> "1k", 131072 -> "128k", 512 -> "512"."""
    return f"{x / 1024:g}k" if x >= 1024 else f"{x:g}"


def line_grid(path: Path, title: str, panels: Sequence[Panel], xlabel: str, ylabel: str, ncols: int = 2,
              logx: bool = True) -> Path:
    """Write ``panels`` as one PNG at ``path``; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.2 * nrows), squeeze=False)
    names = sorted({n for p in panels for n in p.series})
    colours = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}  # one colour per series everywhere
    for ax, panel in zip(axes.flat, panels):
        for name, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, marker="o", label=name, color=colours[name])
            if name in panel.bands:
                ax.fill_between(xs, *panel.bands[name], color=colours[name], alpha=0.15, linewidth=0)
        for name, (xs, ys) in panel.references.items():
            ax.plot(xs, ys, linestyle="--", color="black", label=name)
        if logx:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_short_number))
        ax.set_ylim(bottom=0)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
