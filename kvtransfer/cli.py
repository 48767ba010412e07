"""The ``kvtransfer`` command: ``demo``, ``bench NAME``, ``layouts``, ``generate``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def _bench_names() -> list[str]:
    import kvtransfer.benchmarks as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvtransfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="local prefill -> decode demo", add_help=False)
    sub.add_parser("layouts", help="print pool layouts for a few model shapes", add_help=False)
    sub.add_parser("generate", help="colocated greedy generation with a model (--model, --tp, --prompt)",
                   add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(_bench_names()), add_help=False)
    bench.add_argument("name", nargs="?", choices=_bench_names())
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if args.name is None:  # `kvtransfer bench` or `kvtransfer bench --help`
            print("usage: kvtransfer bench NAME [--help | options]\nNAME: " + ", ".join(_bench_names()))
            return 0 if rest in ([], ["--help"], ["-h"]) else 2
        module = importlib.import_module(f"kvtransfer.benchmarks.{args.name}")
        return int(module.main(rest) or 0)
    module = importlib.import_module(f"kvtransfer.{args.command}")
    return int(module.main(rest) or 0)
