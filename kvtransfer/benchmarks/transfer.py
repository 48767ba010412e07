"""``kvtransfer bench transfer``: one request's KV (and state) moved by every path, side by side.

For each model preset, prefill/decode TP pair, page size, prompt length and slot order, the
pair (prefill rank 0 -> decode rank 0) of one request is planned by the real planner
(``plan_kv_transfer`` / ``plan_state_transfer`` + ``plan_batch``) and written, in the same run
and on the same buffers, by each path:

    link                 the baseline: a memcpy of the same byte count (host memory), or
                         torch's copy of it from the source GPU to the destination GPU
    nvlink kernel        the NVLink backend's direct push kernel (GPUs; ``write_strided``'s
                         direct path, as kvtransfer writes a plan)
    nvlink staged        its staged engine: gather, copy engine, scatter (two GPUs)
    nixl direct          the NIXL backend as kvtransfer writes a plan (``write_strided``:
                         touching whole-row runs coalesced)
    nixl staged          the NIXL backend's staged mode, when this build of it has one
    nixl per page        the peers' way: NIXL with one descriptor per page of each buffer, or
                         per token and head slice when TP differs, as SGLang's and vLLM's NIXL
                         paths issue them (built from the model's numbers, not from the plan)

Every path is verified before it is timed (the receiver's buffers, whole, against the expected
bytes built independently of the planner) and then timed end to end over ``--repeats`` (median
and spread), stopping once a path has used ``--budget-s`` (a path whose verified write alone
took that long keeps it as its one sample: NIXL at page 1 on a 64k prompt).
A path that cannot run here is skipped with the reason (host memory: no nvlink; one GPU: no
staged engine, and the link is a copy within the GPU; no staged mode in this NIXL). Per case: bytes, entries, time, GB/s, the ratio to the link and to the peers' way, and
the host time before the write (planning, or building the peers' descriptors) beside it.

``--layerwise on|off|on,off`` (host memory, NIXL; ``--layerwise-staged``: through the transport
with its staged mode on, as a serving node's, so a layer's many small ranges go staged) adds to
each case the request streamed layer by
layer (and, with ``--layer-group``, one write per group of layers) while this process computes,
against one write after the last layer, alternated round by round
(:mod:`kvtransfer.benchmarks._layerwise`): the tail after the last layer's compute, the
compute's stretch, and one layer's write alone. ``--two-hosts`` runs the writer and the receiver
in two network namespaces joined by a veth pair (root), NIXL over tcp between them.

Output: the table (stdout), ``transfer.json`` (every figure, the machine's description) and
``transfer-<model>.png`` (GB/s against prompt length per path, the link dashed) under ``--out``.
``--quick`` is a small run of every model kind (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from kvtransfer._args import HelpFormatter, description, on_off, positive_int
from kvtransfer.benchmarks._cases import Case, Pools
from kvtransfer.benchmarks._layerwise import LayerCompute, run_layerwise
from kvtransfer.benchmarks._models import PRESETS
from kvtransfer.benchmarks._plots import Panel, line_grid, plots_available
from kvtransfer.benchmarks._report import Progress, document, format_table, machine_line, time_wall, write_json
from kvtransfer.benchmarks._rig import PathResult, Rig, ucx_env

PATHS = ("link", "nvlink kernel", "nvlink staged", "nixl direct", "nixl staged", "nixl per page")
PEERS = "nixl per page"
DEFAULT_OUT = Path("bench/out/transfer")
QUICK = dict(models="llama3-8b,deepseek-v3,qwen3-next", layers=2, tokens="256,1024", page_sizes="1,16",
             tp="1:1,1:2", repeats=2, budget_s=0.5)


def _ints(text: str) -> list:
    out = []
    for part in text.split(","):
        t = part.strip().lower()
        try:
            value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected integers like 1024 or 4k, got {part!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected positive integers, got {value}")
        out.append(value)
    return out


def _tp_pairs(text: str) -> list:
    pairs = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"TP pairs look like 1:1,2:4 (prefill:decode), got {part!r}") from None
        if p <= 0 or d <= 0:
            raise argparse.ArgumentTypeError(f"TP sizes must be positive, got {part!r}")
        pairs.append((p, d))
    return pairs


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvtransfer bench transfer", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--models", default="llama3-70b", help=f"comma list of presets: {', '.join(PRESETS)}")
    ap.add_argument("--layers", type=positive_int, default=None, help="override: attention (and state) layers")
    ap.add_argument("--kv-heads", type=positive_int, default=None, help="override: total KV heads (GQA)")
    ap.add_argument("--head-dim", type=positive_int, default=None, help="override: head dim (MLA: latent width)")
    ap.add_argument("--tokens", default=None,
                    help="prompt lengths, e.g. 1k,4k (default 1k,4k,16k,64k,128k on GPUs, 1k,2k,4k in host memory)")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--tp", default="1:1,1:2", help="prefill:decode TP pairs (default 1:1,1:2)")
    ap.add_argument("--slots", choices=("random", "contiguous", "both"), default="random",
                    help="the request's pages: random pages of the pool or one contiguous range")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of: " + ", ".join(PATHS))
    ap.add_argument("--memory", choices=("auto", "host", "gpu"), default="auto",
                    help="where the buffers live (auto: GPUs when torch sees CUDA)")
    ap.add_argument("--two-hosts", action="store_true",
                    help="host memory: the writer and the receiver in two network namespaces, NIXL over tcp on a "
                         "veth pair between them (root; kvtransfer.netns)")
    ap.add_argument("--src-device", type=int, default=0)
    ap.add_argument("--dst-device", type=int, default=None, help="default: 1 with two GPUs, else 0 (same GPU)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--budget-s", type=float, default=10.0, help="stop repeating a path once it took this long")
    ap.add_argument("--pool-factor", type=float, default=1.25, help="pool slots per request token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of the JSON and PNGs")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="run nothing: print the table of this transfer.json and draw its PNGs (beside it, or in --out)")
    ap.add_argument("--layerwise", type=on_off, default=None, metavar="on|off|on,off",
                    help="also stream each case's request layer by layer while computing (on), write it after the "
                         "last layer (off), or both alternated (NIXL, host memory)")
    ap.add_argument("--layer-ms", type=float, default=2.0, help="--layerwise: CPU compute per layer")
    ap.add_argument("--layer-group", type=_ints, default=[1], metavar="G[,G...]",
                    help="--layerwise on: layers per write (each size a mode of its own: on, on/G)")
    ap.add_argument("--layerwise-reps", type=positive_int, default=9, help="--layerwise: timed rounds per mode")
    ap.add_argument("--layerwise-staged", action="store_true",
                    help="--layerwise: through the NIXL transport with its staged mode on, as a serving node's "
                         "(default: staged mode off)")
    ap.add_argument("--quick", action="store_true", help="a small run of every model kind (under a minute on a CPU)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == ap.get_default(key):  # flags given beside --quick win
                setattr(args, key, value)
    try:
        args.model_names = [m.strip() for m in args.models.split(",")]
        bad = [m for m in args.model_names if m not in PRESETS]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown models {bad}; presets: {', '.join(PRESETS)}")
        args.page_size_list = _ints(args.page_sizes)
        args.tp_pairs = _tp_pairs(args.tp)
        args.path_list = [p.strip() for p in args.paths.split(",")]
        bad = [p for p in args.path_list if p not in PATHS]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown paths {bad}; paths: {', '.join(PATHS)}")
        args.token_list = None if args.tokens is None else _ints(args.tokens)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    if args.pool_factor < 1.0:
        ap.error(f"--pool-factor must be >= 1, got {args.pool_factor}")
    if args.two_hosts:
        if args.memory == "gpu":
            ap.error("--two-hosts moves host memory (not --memory gpu)")
        args.memory = "host"
    if not args.layer_ms > 0:
        ap.error(f"--layer-ms must be positive, got {args.layer_ms}")
    args.compute = None  # --layerwise: the per-layer compute, calibrated at the first case
    return args


@dataclass(frozen=True)
class Where:
    """Where the buffers live and which backends can move them there."""

    src_device: Optional[int]
    dst_device: Optional[int]
    backends: tuple
    skipped: dict  # path -> why it cannot run here

    @property
    def gpu(self) -> bool:
        return self.src_device is not None

    @property
    def link_name(self) -> str:
        if not self.gpu:
            return "memcpy (host)"
        if self.src_device == self.dst_device:
            return f"d2d copy (one GPU, cuda:{self.src_device})"
        return f"torch peer copy cuda:{self.src_device}->cuda:{self.dst_device}"


def _where(args) -> Where:
    import torch

    from kvtransfer.benchmarks._remote import nixl_staged_config

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = args.memory == "gpu" or (args.memory == "auto" and gpus > 0)
    if gpu and gpus == 0:
        raise SystemExit("kvtransfer bench transfer: --memory gpu, but torch sees no CUDA GPU")
    ucx_env(gpu)  # before the first NIXL agent (the probes below)
    skipped, backends = {}, []
    staged = _backend_error("nixl") or ("this nixl backend has no staged mode" if nixl_staged_config() is None else None)
    for backend, paths, why in (
        ("nvlink", ("nvlink kernel", "nvlink staged"),
         _backend_error("nvlink") if gpu else "host memory: the nvlink backend moves GPU memory only"),
        ("nixl", ("nixl direct", PEERS), _backend_error("nixl")),
        ("nixl-staged", ("nixl staged",), staged),
    ):
        if why is None:
            backends.append(backend)
        else:
            skipped.update({p: why for p in paths})
    if not gpu:
        return Where(None, None, tuple(backends), skipped)
    dst = args.dst_device if args.dst_device is not None else (1 if gpus >= 2 else args.src_device)
    if max(args.src_device, dst) >= gpus:
        raise SystemExit(f"kvtransfer bench transfer: cuda:{max(args.src_device, dst)} asked for, {gpus} GPU(s) seen")
    if dst == args.src_device:
        skipped.setdefault("nvlink staged", "needs 2 GPUs (one GPU here: source and destination share it)")
    return Where(args.src_device, dst, tuple(backends), skipped)


def _fitting(shape, prefill_tp: int, decode_tp: int, args, where: Where) -> tuple:
    """``(lengths, why)``: the prompt lengths whose pools fit the free memory (on each GPU, or in
    host memory), and why the others do not."""
    fits, why = [], ""
    for tokens in sorted(args.token_list):
        pools = Pools.for_tokens(shape, prefill_tp, decode_tp, tokens, args.pool_factor)
        need, free = _memory(pools, where)
        if any(n > f for n, f in zip(need, free)):
            why = ("needs " + " / ".join(f"{n / 2**30:.1f}" for n in need) + " GiB, "
                   + " / ".join(f"{f / 2**30:.1f}" for f in free) + " GiB free")
            break
        fits.append(tokens)
    return [t for t in args.token_list if t in fits], why


def _memory(pools: Pools, where: Where) -> tuple:
    """``(needs, frees)`` in bytes per memory the run uses (two GPUs, one GPU, or the host):
    both sides' buffers, the link's two 1 GiB pieces, and room for one buffer's checksum
    temporaries (int64 words: 12 times the buffer) and a margin of 2 GiB."""
    src, dst = (sum(a + b) for a, b in (pools.sizes("src"), pools.sizes("dst")))
    big = max(max(a + b) for a, b in (pools.sizes("src"), pools.sizes("dst")))
    extra = (1 << 30) + 12 * big + (2 << 30)
    if not where.gpu:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        return (src + dst + 2 * extra,), (avail,)
    import torch

    if where.src_device == where.dst_device:
        return (src + dst + 2 * extra,), (torch.cuda.mem_get_info(where.src_device)[0],)
    return (src + extra, dst + extra), tuple(torch.cuda.mem_get_info(d)[0] for d in (where.src_device, where.dst_device))


def _backend_error(backend: str) -> Optional[str]:
    """Why a transport of ``backend`` cannot be made here (None: it can)."""
    from kvtransfer.benchmarks._remote import make_transport

    try:
        make_transport(backend).close()
    except Exception as exc:  # ImportError, a CUDA or UCX failure: the paths of that backend are skipped
        return f"no {backend} transport here: {type(exc).__name__}: {exc}"
    return None


# -- one case ----------------------------------------------------------------------------------


def _run_case(rig: Rig, case: Case, where: Where, args, progress: Progress) -> dict:
    """Plan, verify and time every path on ``case``; the case's JSON record."""
    plans = case.plans()
    plan_bytes = sum(p.nbytes for p in plans)
    planned = case.planned(rig.src, rig.dst)
    plan_t = time_wall(lambda: case.planned(rig.src, rig.dst), args.repeats)
    peer_batch = case.peer_batch(rig.src, rig.dst)
    peer_t = time_wall(lambda: case.peer_batch(rig.src, rig.dst), args.repeats)
    expect = rig.expected_checksums(case)
    results = []
    for path in args.path_list:
        if path in where.skipped:
            results.append(PathResult(path, "skipped", where.skipped[path]))
            continue
        t0 = time.monotonic()
        if path == "link":
            ok, timing = rig.link(plan_bytes, 3 * args.repeats, args.budget_s)  # every ratio's base: cheap, steady
            res = PathResult(path, "ok" if ok else "failed", "" if ok else "copy differs", plan_bytes, 1, ok, timing,
                             extra={"what": where.link_name})
        else:
            try:
                res = _run_write_path(rig, path, planned, peer_batch, plan_t, peer_t, expect, args)
            except Exception as exc:  # one path's failure must not cost the others' figures
                res = PathResult(path, "failed", f"{type(exc).__name__}: {exc}")
        results.append(res)
        progress.step(f"{case.name}: {path} {_short(res)} in {time.monotonic() - t0:.1f} s")
    record = _record(case, plans, plan_bytes, plan_t, results)
    if args.layerwise:
        record["layerwise"] = _run_layerwise(rig, case, where, args)
    return record


def _run_layerwise(rig: Rig, case: Case, where: Where, args) -> dict:
    """``--layerwise``'s figures on ``case``, or ``{"skipped": why}``."""
    if where.gpu:
        return {"skipped": "layer-wise streaming is measured in host memory (GPUs: kvtransfer bench nvlink)"}
    backend, path = ("nixl-staged", "nixl staged") if args.layerwise_staged else ("nixl", "nixl direct")
    if backend not in where.backends:
        return {"skipped": where.skipped[path]}
    if args.compute is None:
        args.compute = LayerCompute(args.layer_ms)
    try:
        return run_layerwise(rig, case, args.layerwise, tuple(args.layer_group), args.compute, 1, args.layerwise_reps,
                             backend)
    except Exception as exc:  # reported beside the other figures
        return {"failed": f"{type(exc).__name__}: {exc}"}


def _run_write_path(rig, path, planned, peer_batch, plan_t, peer_t, expect, args) -> PathResult:
    if path.startswith("nvlink"):
        from transport.nvlink import NvlinkEngine

        engine = NvlinkEngine.KERNEL if path == "nvlink kernel" else NvlinkEngine.STAGED
        write, took = rig.nvlink_writer(engine, planned)
        if took is not engine:
            return PathResult(path, "skipped", f"the {engine.value} engine cannot run here (the write took "
                                               f"{took.value})")
        batches, prep, entries = planned, plan_t, sum(len(b) for b in planned)
    elif path == PEERS:
        batches, prep, entries = [peer_batch], peer_t, len(peer_batch)
        write = rig.nixl_writer("nixl", batches)
    else:
        backend = "nixl" if path == "nixl direct" else "nixl-staged"
        batches, prep = planned, plan_t
        entries = sum(len(b.coalesced()) if hasattr(b, "coalesced") else len(b) for b in planned)
        write = rig.nixl_writer(backend, batches)
    nbytes = sum(b.nbytes for b in batches)
    ok, timing, why = rig.run_write(path, write, expect, args.repeats, args.budget_s)
    return PathResult(path, "ok" if ok else "failed", why, nbytes, entries, ok, timing, prep)


def _short(res: PathResult) -> str:
    if res.status != "ok":
        return f"{res.status}: {res.reason}"
    return f"{res.timing.rate(res.nbytes):.2f} GB/s"


def _record(case: Case, plans, plan_bytes: int, plan_t, results: list) -> dict:
    by_path = {r.path: r for r in results}
    link, peers = by_path.get("link"), by_path.get(PEERS)

    def ratio(base, r):
        if base is None or base.status != "ok" or r.status != "ok":
            return None
        return base.timing.median / r.timing.median

    paths = []
    for r in results:
        rec = {"path": r.path, "status": r.status, "reason": r.reason, **r.extra}
        if r.status == "ok":
            rec.update(bytes=r.nbytes, entries=r.entries, verified=r.verified, time=r.timing.to_json(),
                       gbps=r.timing.rate(r.nbytes), vs_link=ratio(link, r), vs_peers=ratio(peers, r),
                       prep=None if r.prep is None else r.prep.to_json())
        paths.append(rec)
    p = case.pools
    return {"model": p.shape.name, "tokens": case.tokens, "page_size": case.page_size, "prefill_tp": p.prefill_tp,
            "decode_tp": p.decode_tp, "slots": case.slots, "pair": [0, 0], "pool_slots": p.num_slots,
            "expected_bytes": case.expected_bytes(),
            "plan": {"bytes": plan_bytes, "pairs": sum(x.num_pairs for x in plans),
                     "runs": sum(x.num_runs for x in plans), "time": plan_t.to_json()},
            "paths": paths}


# -- output ------------------------------------------------------------------------------------


def _table(records: list) -> str:
    header = ["model", "tokens", "page", "TP", "slots", "path", "MiB", "entries", "ms", "spread", "GB/s",
              "vs link", "vs peers", "prep ms", "ok"]
    rows = []
    for rec in records:
        for p in rec["paths"]:
            if p["status"] == "skipped":
                continue
            head = [rec["model"], str(rec["tokens"]), str(rec["page_size"]), f"{rec['prefill_tp']}->{rec['decode_tp']}",
                    rec["slots"], p["path"]]
            if p["status"] != "ok":
                rows.append(head + ["-"] * 8 + [f"FAILED: {p['reason']}"])
                continue
            pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
            rows.append(head + [f"{p['bytes'] / 2**20:.1f}", str(p["entries"]), f"{p['time']['median_s'] * 1e3:.2f}",
                                f"{p['time']['spread']:.0%}", f"{p['gbps']:.2f}", pct(p["vs_link"]),
                                pct(p["vs_peers"]),
                                "-" if p["prep"] is None else f"{p['prep']['median_s'] * 1e3:.2f}",
                                "yes" if p["verified"] else "NO"])
    return format_table(header, rows, left=6)


def _layerwise_table(records: list) -> str:
    """``--layerwise``: per case and mode, the compute and the tail after it (ms)."""
    header = ["model", "tokens", "page", "TP", "slots", "layers", "KiB/layer", "layer write", "mode", "compute",
              "stretch", "tail", "tail - layer write"]
    rows = []
    for rec in records:
        lw = rec.get("layerwise")
        head = [rec["model"], str(rec["tokens"]), str(rec["page_size"]), f"{rec['prefill_tp']}->{rec['decode_tp']}",
                rec["slots"]]
        if lw is None:
            continue
        if "layers" not in lw:
            rows.append(head + ["-"] * 7 + [lw.get("skipped") or f"FAILED: {lw.get('failed')}"])
            continue
        off = lw.get("off")
        for mode in (m for m in lw if isinstance(lw[m], dict)):
            fig = lw[mode]
            stretch = "-" if off is None or mode == "off" else f"{fig['compute_s'] / off['compute_s'] - 1:+.1%}"
            rows.append(head + [str(lw["layers"]), f"{lw['layer_bytes'] / 1024:.0f}", f"{lw['layer_s'] * 1e3:.2f}",
                                mode, f"{fig['compute_s'] * 1e3:.2f}", stretch, f"{fig['tail_s'] * 1e3:.2f}",
                                f"{(fig['tail_s'] - lw['layer_s']) * 1e3:+.2f}"])
    return ("layer-wise (ms; medians): compute = first layer's start -> last layer's end, stretch against off; "
            "tail = last layer's end -> the last notification seen by the receiver; layer write = one layer's "
            "writes alone\n" + format_table(header, rows, left=6))


def _panels(records: list, model: str) -> list:
    """One panel per (TP pair, page size, slot order) of ``model``: GB/s against prompt length."""
    groups = {}
    for rec in records:
        if rec["model"] == model:
            groups.setdefault((rec["prefill_tp"], rec["decode_tp"], rec["page_size"], rec["slots"]), []).append(rec)
    panels = []
    for (p, d, ps, slots), recs in sorted(groups.items()):
        series, refs, bands = {}, {}, {}
        for rec in sorted(recs, key=lambda r: r["tokens"]):
            for path in rec["paths"]:
                if path["status"] != "ok":
                    continue
                target = refs if path["path"] == "link" else series
                name = f"link: {path.get('what', 'link')}" if path["path"] == "link" else path["path"]
                xs, ys = target.setdefault(name, ([], []))
                xs.append(rec["tokens"])
                ys.append(path["gbps"])
                if target is series:  # the slowest and the fastest repeat
                    lows, highs = bands.setdefault(name, ([], []))
                    lows.append(path["bytes"] / path["time"]["max_s"] / 1e9)
                    highs.append(path["bytes"] / path["time"]["min_s"] / 1e9)
        panels.append(Panel(f"TP {p}->{d}, page {ps}, {slots} pages", series, refs, bands))
    return panels


def _write_outputs(args, argv, where: Where, records: list, too_big: list) -> list:
    config = {"models": args.model_names, "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "tokens": args.token_list, "page_sizes": args.page_size_list, "tp_pairs": args.tp_pairs,
              "slots": args.slots, "paths": args.path_list, "repeats": args.repeats, "budget_s": args.budget_s,
              "pool_factor": args.pool_factor, "seed": args.seed, "quick": args.quick,
              "layerwise": args.layerwise and list(args.layerwise), "layer_ms": args.layer_ms,
              "layer_reps": args.layerwise_reps, "layer_group": args.layer_group,
              "layerwise_staged": args.layerwise_staged,
              "memory": "gpu" if where.gpu else "host", "two_hosts": args.two_hosts, "src_device": where.src_device,
              "dst_device": where.dst_device, "link": where.link_name, "skipped": where.skipped,
              "skipped_lengths": [{"model": m, "tp": tp, "tokens": t, "reason": why} for m, tp, t, why in too_big]}
    doc = document("transfer", argv, config, records)
    return [write_json(args.out / "transfer.json", doc)] + _write_plots(args.out, doc)


def _write_plots(out: Path, doc: dict) -> list:
    """One PNG per model of the run ``doc`` (as written to transfer.json)."""
    if not plots_available():
        print("plots: skipped, matplotlib is not installed (pip install 'kvtransfer[bench]'; or render them "
              "elsewhere: kvtransfer bench transfer --from-json transfer.json)", file=sys.stderr)
        return []
    records, memory = doc["results"], "GPU" if doc["config"]["memory"] == "gpu" else "host memory"
    gpus = doc["machine"]["gpus"]
    where = f"{memory}, {len(gpus)}x {gpus[0]}" if gpus and memory == "GPU" else memory
    written = []
    for model in dict.fromkeys(r["model"] for r in records):
        slug = model.lower().replace(" ", "-")
        written.append(line_grid(out / f"transfer-{slug}.png", f"kvtransfer bench transfer: {model}, {where}",
                                 _panels(records, model), "prompt tokens", "GB/s"))
    return written


def _from_json(path: Path, out: Optional[Path]) -> int:
    """Print the table of a finished run's JSON and draw its plots (beside it unless ``out``)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("benchmark") != "transfer":
        raise SystemExit(f"kvtransfer bench transfer: {path} is not a transfer benchmark's JSON")
    print(f"{doc['command']}  ({doc['date']}, {machine_line(doc['machine'])})")
    print(_table(doc["results"]))
    for written in _write_plots(Path(path).parent if out is None else out, doc):
        print(f"wrote {written}", file=sys.stderr)
    return 0


def record_variant(argv) -> str:
    """The kind of a ``--record`` run in bench/RESULTS.md: host-memory, GPU and two-hosts runs keep
    a record each, and a ``--layerwise`` run of each another."""
    import torch

    args = _parse(argv)
    gpu = args.memory == "gpu" or (args.memory == "auto" and torch.cuda.is_available())
    kind = "two hosts" if args.two_hosts else "GPU" if gpu else "host memory"
    return f"{kind}, layer-wise" if args.layerwise else kind


# -- the command -------------------------------------------------------------------------------


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.from_json is not None:
        return _from_json(args.from_json, None if args.out == DEFAULT_OUT else args.out)
    if args.two_hosts:
        return _on_two_hosts(argv)
    return _run(args, argv)


def _on_two_hosts(argv: list) -> int:
    """The run in a writer process on one network namespace "host" and the receiver on another,
    NIXL over tcp on the veth pair between them; the namespaces go when it ends."""
    from kvtransfer.netns import netns_unavailable, writer_on_two_hosts

    why = netns_unavailable()
    if why:
        print(f"kvtransfer bench transfer: --two-hosts needs network namespaces: {why}", file=sys.stderr)
        return 2
    status, printed = writer_on_two_hosts(_writer, (argv,), tuple, 24 * 3600.0)
    print(printed, end="")  # here, where --record reads it
    return status


def _writer(receiver_host, argv: list) -> tuple:
    """The writer's process: its exit status and what it printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = _run(_parse(argv), argv, receiver_host)
    return status, out.getvalue()


def _run(args, argv: list, receiver_host=None) -> int:
    """The run (this process the writer; the receiver on ``receiver_host`` if given)."""
    where = _where(args)
    if args.token_list is None:
        args.token_list = [1024, 4096, 16384, 65536, 131072] if where.gpu else [1024, 2048, 4096]
    slot_orders = ["random", "contiguous"] if args.slots == "both" else [args.slots]
    shapes = [PRESETS[m].overridden(args.layers, args.kv_heads, args.head_dim) for m in args.model_names]
    for page in args.page_size_list:
        bad = [t for t in args.token_list if t % page]
        if bad:
            raise SystemExit(f"kvtransfer bench transfer: prompt lengths {bad} are not whole pages of {page}")
    n_cases = len(shapes) * len(args.tp_pairs) * len(args.page_size_list) * len(args.token_list) * len(slot_orders)
    runnable = [p for p in args.path_list if p not in where.skipped]
    progress = Progress(n_cases * len(runnable), enabled=not args.no_progress)
    per_length = len(args.page_size_list) * len(slot_orders) * len(runnable)  # progress steps per prompt length
    hosts = ", two network namespaces (tcp over veth)" if receiver_host is not None else ""
    print(f"transfer bench: {', '.join(s.name for s in shapes)}; pair prefill rank 0 -> decode rank 0; "
          f"{'GPU' if where.gpu else 'host memory'}{hosts}, link = {where.link_name}; median of up to {args.repeats} "
          f"(budget {args.budget_s:g} s per path)", flush=True)
    records = []
    rng = np.random.default_rng(args.seed)
    rig = Rig(where.backends, where.src_device, where.dst_device, receiver_host)
    too_big = []  # (model, TP pair, tokens, why)
    try:
        for shape in shapes:
            for p, d in args.tp_pairs:
                rig.unload()  # the free memory below is what this group can have
                fits, why = _fitting(shape, p, d, args, where)
                too_big += [(shape.name, f"{p}->{d}", t, why) for t in args.token_list if t not in fits]
                progress.total -= (len(args.token_list) - len(fits)) * per_length
                if not fits:
                    continue
                pools = Pools.for_tokens(shape, p, d, max(fits), args.pool_factor)
                rig.load(pools, args.seed)
                for page in args.page_size_list:
                    for tokens in fits:
                        for slots in slot_orders:
                            case = Case.make(pools, tokens, page, slots, rng)
                            records.append(_run_case(rig, case, where, args, progress))
    finally:
        rig.close()
    print(_table(records))
    if args.layerwise:
        print(_layerwise_table(records))
    print("ms: median of the repeats, batch to every byte landed (nixl: the plan's coalescing into descriptors "
          "included); spread: (max - min) / median; vs link / vs peers: their median time over this path's; "
          "prep ms: host work before the write (kvtransfer: plan_kv_transfer + plan_batch; the peers' way: "
          "building its descriptor list)")
    for path, why in where.skipped.items():
        if path in args.path_list:
            print(f"skipped: {path}: {why}")
    for model, tp, tokens, why in too_big:
        print(f"skipped: {model} TP {tp} {tokens} tokens: {why}")
    for out in _write_outputs(args, argv, where, records, too_big):
        print(f"wrote {out}", file=sys.stderr)
    failed = [(r["tokens"], p["path"]) for r in records for p in r["paths"] if p["status"] == "failed"]
    failed += [(r["tokens"], "layer-wise") for r in records if "failed" in r.get("layerwise", {})]
    if failed:
        print(f"FAILED paths: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
