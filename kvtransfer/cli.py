"""The ``kvtransfer`` command: ``demo``, ``serve``, ``router``, ``generate``, ``transfer-demo``,
``bench NAME [--record]``, ``layouts``, ``bootstrap``.

``kvtransfer bench NAME --record ...`` runs the benchmark and, when it succeeds, rewrites its
record in bench/RESULTS.md (machine, date, command line, the table it printed): the benchmark's
section, or the record of this kind of run within it (``record_variant(argv)`` of the module).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


_MODULES = {"bootstrap": "kvtransfer.control.bootstrap", "transfer-demo": "kvtransfer.transfer_demo", "serve": "kvtransfer.serve.node",
            "router": "kvtransfer.serve.router", "layouts": "kvtransfer.cli_layouts"}  # commands whose module is not kvtransfer.<command>


def _bench_names() -> list[str]:
    import kvtransfer.benchmarks as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvtransfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="router + prefill, decode and colocated nodes on this machine: real text "
                   "from transferred KV, checked", add_help=False)
    sub.add_parser("transfer-demo", help="one request's KV from prefill ranks to decode ranks (no model)",
                   add_help=False)
    sub.add_parser("layouts", help="print pool layouts for a few model shapes", add_help=False)
    sub.add_parser("bootstrap", help="run the bootstrap service (prefill ranks register, decode finds them)",
                   add_help=False)
    sub.add_parser("generate", help="colocated greedy generation with a model (--model, --tp, --prompt)",
                   add_help=False)
    sub.add_parser("serve", help="a prefill, decode or colocated node over HTTP (--role, --model, --port)",
                   add_help=False)
    sub.add_parser("router", help="the OpenAI-compatible router in front of prefill and decode nodes",
                   add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(_bench_names()), add_help=False)
    bench.add_argument("name", nargs="?", choices=_bench_names())
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if args.name is None:  # `kvtransfer bench` or `kvtransfer bench --help`
            print("usage: kvtransfer bench NAME [--help | [--record] options]\nNAME: " + ", ".join(_bench_names())
                  + "\n--record: on success, rewrite the benchmark's record in bench/RESULTS.md")
            return 0 if rest in ([], ["--help"], ["-h"]) else 2
        module = importlib.import_module(f"kvtransfer.benchmarks.{args.name}")
        if "--record" in rest:
            from kvtransfer.benchmarks._results import run_recorded

            argv = [a for a in rest if a != "--record"]
            variant = getattr(module, "record_variant", lambda argv: None)(argv)  # a record per kind of run
            return run_recorded(args.name, module.main, argv, variant=variant)
        return int(module.main(rest) or 0)
    module = importlib.import_module(_MODULES.get(args.command, f"kvtransfer.{args.command}"))
    return int(module.main(rest) or 0)
