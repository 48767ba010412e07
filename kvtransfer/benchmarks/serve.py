"""``kvtransfer bench serve``: time to first token, inter-token latency and throughput under load,
disaggregated (router -> prefill node -> decode node) against a colocated node on the same
machine, with the same requests.

    kvtransfer bench serve                               # SmolLM2, prefill TP 1 -> decode TP 1, CPU
    kvtransfer bench serve --concurrency 8 --requests 64 --prompt-tokens 128:512
    kvtransfer bench serve --rate 2 --requests 40       # Poisson arrivals, 2 requests/s
    kvtransfer bench serve --router http://host:30000 --colocated http://host:30003   # running servers
    kvtransfer bench serve --quick                       # the tiny MLA model, under a minute here
    kvtransfer bench serve --pool-tokens 2048 --requests 64 --concurrency 16 --prompt-tokens 1000:1800
                                                         # load: each request fits a pool alone, few together

The load generator is the one users know from vLLM's ``benchmark_serving`` and SGLang's
``bench_serving``: streaming ``/v1/completions`` requests (``ignore_eos``, so each produces its
drawn number of tokens), prompt and output lengths drawn uniformly from ``--prompt-tokens`` and
``--output-tokens`` with ``--seed``, sent at a fixed ``--concurrency`` or at ``--rate``
requests per second. Per mode: TTFT (request sent -> first token), ITL (gaps between tokens),
end-to-end latency (median, p90, p99), output tokens/s and requests/s. For the disaggregated
mode TTFT is split by what the nodes report: prefill queueing, prefill compute, KV transfer
(prefill had the KV -> every write landed on decode, including waiting for decode to ask), and
the rest (HTTP, routing, control messages, the first token's way back). Queue: the mean time a
request waited for pages before its prompt was computed (disaggregated: prefill's queue, which
holds the wait for decode's reservation; colocated: the node's ``kvtransfer_queue_seconds``).
``--pool-tokens`` sizes every node's KV pool (token slots): with long prompts and small pools,
requests wait for pages on every node, and all of them must still complete.

Output: the table (stdout), ``serve.json`` (every request's figures, the machine) and
``serve.png`` (TTFT and ITL percentiles, disaggregated against colocated) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from kvtransfer._args import HelpFormatter, description, positive_int
from kvtransfer.benchmarks._plots import Panel, line_grid, plots_available
from kvtransfer.benchmarks._report import Progress, Timing, document, format_table, machine_line, write_json

DEFAULT_OUT = Path("bench/out/serve")
PERCENTILES = (50, 90, 99)
QUICK = dict(model="mla-tiny", requests=12, concurrency=3, prompt_tokens=(16, 96), output_tokens=(4, 12),
             prefill_tp=2)
WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not which but "
         "all were when we there can more if will one about time been has would so what out up into its them "
         "only other new some could these may first then do any like now such our over man me even most made "
         "after also did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three").split()


def _range(text: str) -> tuple:
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class Work:
    """One request of the workload."""

    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class Sample:
    """What one request measured (seconds from its start)."""

    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: List[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    kv: dict = field(default_factory=dict)  # the router's kvtransfer figures (disaggregated)


def workload(tokenizer, n: int, prompt_tokens: tuple, output_tokens: tuple, seed: int) -> List[Work]:
    """``n`` requests of random words; each prompt encodes to its drawn token count or just over."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        want = rng.randint(*prompt_tokens)
        words: List[str] = []
        while len(tokenizer.encode(" ".join(words))) < want:  # words enough, however many tokens a word is
            words.extend(rng.choice(WORDS) for _ in range(max(1, len(words))))
        lo, hi = 1, len(words)  # then the fewest of them that encode to ``want`` tokens or more
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if len(tokenizer.encode(" ".join(words[:mid]))) < want else (lo, mid)
        text = " ".join(words[:lo])
        out.append(Work(text, len(tokenizer.encode(text)), rng.randint(*output_tokens)))
    return out


async def _one(client, url: str, work: Work, sample: Sample) -> None:
    body = {"prompt": work.prompt, "max_tokens": work.output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last: Optional[float] = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600.0) as resp:
            if resp.status_code != 200:
                sample.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    sample.error = chunk["error"]["message"]
                    return
                sample.kv.update(chunk.get("kvtransfer") or {})  # the router's figures: on the last choice chunk
                if chunk.get("usage"):
                    sample.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    sample.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:  # a chunk per token event (its text may be empty: a partial character)
                    now = time.perf_counter() - start
                    if last is None:
                        sample.ttft = now
                    else:
                        sample.itl.append(now - last)
                    last = now
        sample.latency = time.perf_counter() - start
        sample.ok = last is not None
        if not sample.ok:
            sample.error = "no token came back"
    except Exception as exc:  # noqa: BLE001 - recorded per request, the run goes on
        sample.error = f"{type(exc).__name__}: {exc}"


async def run_load(url: str, works: List[Work], concurrency: Optional[int], rate: Optional[float], seed: int,
                   progress: Optional[Progress] = None) -> tuple:
    """Every request of ``works`` against ``url``; (samples, wall seconds)."""
    import httpx

    from kvtransfer.serve.http import client_limits

    samples = [Sample() for _ in works]
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(works))
    limits = client_limits(max_connections=len(works) + 4, max_keepalive_connections=len(works) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def go(i: int) -> None:
            async with gate:
                await _one(client, url, works[i], samples[i])
            if progress is not None:
                progress.step(f"{url} request {i + 1}")

        start = time.perf_counter()
        tasks = []
        for i in range(len(works)):
            tasks.append(asyncio.ensure_future(go(i)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return samples, time.perf_counter() - start


def summarize(samples: List[Sample], wall_s: float) -> dict:
    """Percentiles and rates of one mode's samples (seconds; tokens/s)."""
    ok = [s for s in samples if s.ok]
    out = {"requests": len(samples), "succeeded": len(ok), "wall_s": wall_s,
           "errors": sorted({s.error for s in samples if not s.ok})[:5]}
    if not ok:
        return out
    ttft, lat = Timing(tuple(s.ttft for s in ok)), Timing(tuple(s.latency for s in ok))
    gaps = [g for s in ok for g in s.itl]
    itl = Timing(tuple(gaps)) if gaps else None
    for name, t in (("ttft", ttft), ("itl", itl), ("latency", lat)):
        if t is not None:
            out[name] = {f"p{q}": t.percentile(q) for q in PERCENTILES} | {"mean": statistics.fmean(t.samples)}
    out["output_tokens_per_s"] = sum(s.output_tokens for s in ok) / wall_s
    out["requests_per_s"] = len(ok) / wall_s
    out["prompt_tokens"] = sum(s.prompt_tokens for s in ok)
    out["output_tokens"] = sum(s.output_tokens for s in ok)
    return out


def queue_mean(samples: List[Sample]) -> Optional[float]:
    """Disaggregated: the mean of prefill's queue (arrival -> admitted, after decode's reservation)."""
    waits = [(s.kv.get("prefill") or {}).get("queue_s") for s in samples if s.ok]
    waits = [w for w in waits if w is not None]
    return statistics.fmean(waits) if waits else None


async def queue_totals(client, url: str) -> tuple:
    """A node's ``kvtransfer_queue_seconds`` (sum, count) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(f"{url}/metrics", timeout=30.0)).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values.get("kvtransfer_queue_seconds_sum", 0.0), values.get("kvtransfer_queue_seconds_count", 0.0)


def ttft_split(samples: List[Sample]) -> Optional[dict]:
    """Medians of the disaggregated TTFT's parts, from the nodes' figures."""
    rows = []
    for s in samples:
        pre = s.kv.get("prefill") or {}
        if not s.ok or pre.get("compute_s") is None:
            continue
        transfer = (pre.get("decode_wait_s") or 0.0) + (pre.get("transfer_s") or 0.0)
        parts = {"prefill queue": pre["queue_s"], "prefill compute": pre["compute_s"], "KV transfer": transfer}
        parts["HTTP, routing, control"] = s.ttft - sum(parts.values())
        rows.append(parts)
    if not rows:
        return None
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {
        "kv_bytes_median": statistics.median(s.kv.get("kv_bytes", 0) for s in samples if s.ok)}


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def report(results: dict, split: Optional[dict]) -> str:
    header = ["mode", "ok", "queue mean", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99", "E2E p50", "p99",
              "out tok/s", "req/s"]
    rows = []
    for mode, r in results.items():
        t, i, lat = r.get("ttft", {}), r.get("itl", {}), r.get("latency", {})
        rows.append([mode, f"{r['succeeded']}/{r['requests']}", _ms(r.get("queue_mean_s")),
                     _ms(t.get("p50")), _ms(t.get("p90")), _ms(t.get("p99")),
                     _ms(i.get("p50")), _ms(i.get("p90")), _ms(i.get("p99")), _ms(lat.get("p50")), _ms(lat.get("p99")),
                     f"{r.get('output_tokens_per_s', 0):.1f}", f"{r.get('requests_per_s', 0):.2f}"])
    text = format_table(header, rows) + "\n(times in ms)"
    if split:
        parts = ", ".join(f"{k} {_ms(v)} ms" for k, v in split.items() if k != "kv_bytes_median")
        text += f"\ndisaggregated TTFT, medians of its parts: {parts}; KV per request {split['kv_bytes_median'] / 2**20:.2f} MiB"
    for mode, r in results.items():
        for e in r.get("errors", []):
            text += f"\n{mode} error: {e}"
    return text


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtransfer bench serve", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefill-tp", type=positive_int, default=1)
    ap.add_argument("--decode-tp", type=positive_int, default=1)
    ap.add_argument("--prefill-page-size", type=positive_int, default=16)
    ap.add_argument("--decode-page-size", type=positive_int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--router", default=None, help="a running router (with --colocated): start nothing")
    ap.add_argument("--colocated", default=None, help="a running colocated node")
    ap.add_argument("--requests", type=positive_int, default=32)
    ap.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight (unless --rate)")
    ap.add_argument("--rate", type=float, default=None, help="requests per second, Poisson arrivals")
    ap.add_argument("--prompt-tokens", type=_range, default=(64, 256), help="N or LO:HI, drawn uniformly")
    ap.add_argument("--output-tokens", type=_range, default=(16, 64), help="N or LO:HI, drawn uniformly")
    ap.add_argument("--pool-tokens", type=positive_int, default=None,
                    help="KV pool size of every node started, in token slots (default: the nodes' default)")
    ap.add_argument("--layerwise", type=int, default=0, metavar="LAYERS",
                    help="the prefill node sends each chunk's KV every LAYERS layers of its forward (0: after the prompt)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="the tiny MLA model, a dozen short requests")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    return ap


async def _main(args, argv) -> int:
    import httpx

    from kvtransfer.demo import DemoFailed, launch, stop_all
    from kvtransfer.models import registry
    from kvtransfer.serve.http import client_limits

    servers: dict = {}
    try:
        _, tokenizer = registry.load(registry.parse_name(args.model))
        router, colocated = args.router, args.colocated
        if router is None:
            logdir = tempfile.mkdtemp(prefix="kvtransfer-bench-serve-")
            print(f"starting the nodes (logs in {logdir})", file=sys.stderr, flush=True)
            async with httpx.AsyncClient(limits=client_limits()) as client:
                await launch(client, args, logdir, servers, False, time.monotonic())
            router, colocated = servers["router"].url, servers["colocated"].url
        works = workload(tokenizer, args.requests, args.prompt_tokens, args.output_tokens, args.seed)
        await run_load(router, works[:2], 2, None, args.seed)  # warm-up: first connections, first plans
        await run_load(colocated, works[:2], 2, None, args.seed)
        progress = Progress(2 * len(works))
        results, samples = {}, {}
        for mode, url in (("disaggregated", router), ("colocated", colocated)):
            async with httpx.AsyncClient() as client:
                queued = await queue_totals(client, colocated)
                samples[mode], wall = await run_load(url, works, None if args.rate else args.concurrency,
                                                     args.rate, args.seed, progress)
                results[mode] = summarize(samples[mode], wall)
                if mode == "colocated":
                    total, count = (b - a for a, b in zip(queued, await queue_totals(client, colocated)))
                    results[mode]["queue_mean_s"] = total / count if count else None
                else:
                    results[mode]["queue_mean_s"] = queue_mean(samples[mode])
    except DemoFailed as exc:
        print(f"kvtransfer bench serve: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(servers.values())
    split = ttft_split(samples["disaggregated"])
    load = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"kvtransfer bench serve: {args.model}, prefill TP {args.prefill_tp} (page {args.prefill_page_size}) -> "
          f"decode TP {args.decode_tp} (page {args.decode_page_size}) vs colocated TP 1, {args.dtype} on {args.device}; "
          f"{args.requests} requests, {load}, prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, "
          f"outputs {args.output_tokens[0]}-{args.output_tokens[1]}, seed {args.seed}, "
          f"pools {args.pool_tokens or 'default'}"
          f"{f', KV sent every {args.layerwise} layers' if args.layerwise else ''}; {machine_line()}")
    print(report(results, split))
    config = {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    doc = document("serve", argv, config, [{"mode": m, **r} for m, r in results.items()], ttft_split=split,
                   samples={m: [asdict(s) for s in ss] for m, ss in samples.items()})
    path = write_json(args.out / "serve.json", doc)
    if plots_available():
        panels = [Panel(f"{name} (ms)", {m: (list(PERCENTILES), [results[m][key][f"p{q}"] * 1e3 for q in PERCENTILES])
                                          for m in results if key in results[m]})
                  for name, key in (("time to first token", "ttft"), ("inter-token latency", "itl"),
                                    ("end-to-end latency", "latency"))]
        png = line_grid(args.out / "serve.png", f"kvtransfer bench serve: {args.model}, {load}", panels,
                        "percentile", "ms", ncols=3, logx=False)
        print(f"wrote {path} and {png}")
    else:
        print(f"wrote {path} (no matplotlib: no plot)")
    failed = sum(r["requests"] - r["succeeded"] for r in results.values())
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if (args.router is None) != (args.colocated is None):
        print("kvtransfer bench serve: error: --router and --colocated go together", file=sys.stderr)
        return 2
    if args.rate is not None and args.rate <= 0:
        print("kvtransfer bench serve: error: --rate must be positive", file=sys.stderr)
        return 2
    return asyncio.run(_main(args, argv))
