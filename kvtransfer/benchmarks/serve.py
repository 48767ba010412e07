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
    kvtransfer bench serve --layerwise on,off --prompt-tokens 4096 --concurrency 1
                                                         # KV sent layer by layer, and after the prompt, alternated
    kvtransfer bench serve --model llama3-8b --device cuda --layerwise on,off --concurrency 1 \\
        --prompt-tokens 1024,4096,16384,32000 --output-tokens 8 --pool-tokens 33500 --max-running 4
                                                         # one set of nodes, four prompt lengths in turn

The load generator is the one users know from vLLM's ``benchmark_serving`` and SGLang's
``bench_serving``: streaming ``/v1/completions`` requests (``ignore_eos``, so each produces its
drawn number of tokens), prompt and output lengths drawn uniformly from ``--prompt-tokens`` and
``--output-tokens`` with ``--seed``, sent at a fixed ``--concurrency`` or at ``--rate``
requests per second. Per mode: TTFT (request sent -> first token), ITL (gaps between tokens),
end-to-end latency (median, p90, p99), output tokens/s and requests/s. For the disaggregated
mode TTFT is split by what the nodes report: prefill queueing, prefill compute, KV transfer
(prefill had the KV -> every write landed on decode, including waiting for decode to ask), and
the rest (HTTP, routing, control messages, the first token's way back), and, on the clock the
nodes share, from the first token sampled on prefill (after its last layer) to the post of its
last writes and to decode counting every write landed (decode starts the request then); when
the run started the nodes (on this host, one clock with the client's), the rest's way in
(request sent -> in prefill's queue) and way out (KV landed -> first token at the client) too.
Queue: the mean time a request waited for pages before its prompt was computed
(disaggregated: prefill's queue, which holds the wait for decode's reservation; colocated: the
node's ``kvtransfer_queue_seconds``).
``--pool-tokens`` sizes every node's KV pool (token slots): with long prompts and small pools,
requests wait for pages on every node, and all of them must still complete.

``--layerwise on`` starts the prefill node with ``--layerwise LAYERS`` (``--layer-group``): each
chunk's KV leaves every LAYERS layers while the forward computes the later ones (mode
``disaggregated layer-wise``). ``--layerwise on,off`` runs both through that one node (the
``off`` requests ask for ``"layerwise": false``: KV after the prompt, prefill steps from the
captured graphs), alternated with the colocated node in ``--rounds`` rounds of the workload
(default 2 when there are several disaggregated modes), so that drift in the machine's speed
falls on every mode alike.

Output: the table (stdout), ``serve.json`` (every request's figures, the machine) and
``serve.png`` (TTFT and ITL percentiles, disaggregated against colocated) under ``--out``;
with several ``--prompt-tokens`` spans, a table, ``serve-<span>.json`` and ``serve-<span>.png``
per span, each as soon as its span has run.
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

from kvtransfer._args import HelpFormatter, description, on_off, positive_int
from kvtransfer.benchmarks._plots import Panel, line_grid, plots_available
from kvtransfer.benchmarks._report import Progress, Timing, document, format_table, machine_line, write_json

DEFAULT_OUT = Path("bench/out/serve")
PERCENTILES = (50, 90, 99)
QUICK = dict(model="mla-tiny", requests=12, concurrency=3, prompt_tokens=((16, 96),), output_tokens=(4, 12),
             prefill_tp=2)
WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not which but "
         "all were when we there can more if will one about time been has would so what out up into its them "
         "only other new some could these may first then do any like now such our over man me even most made "
         "after also did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three").split()


def _spans(text: str) -> tuple:
    """``N|LO:HI[,...]``: the prompt-length spans, in order."""
    return tuple(_range(part.strip()) for part in text.split(","))


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
    sent_at: float = 0.0  # time.monotonic() when it was sent, and when its first token came
    first_at: float = 0.0


@dataclass(frozen=True)
class Mode:
    """One way of serving the workload: a server, and the ``kvtransfer`` object its requests carry."""

    name: str
    url: str
    extension: Optional[dict] = None

    @property
    def disaggregated(self) -> bool:
        return self.name.startswith("disaggregated")


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


async def _one(client, url: str, work: Work, sample: Sample, extension: Optional[dict] = None) -> None:
    body = {"prompt": work.prompt, "max_tokens": work.output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if extension:
        body["kvtransfer"] = extension
    start, sample.sent_at = time.perf_counter(), time.monotonic()
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
                        sample.ttft, sample.first_at = now, time.monotonic()
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
                   progress: Optional[Progress] = None, extension: Optional[dict] = None) -> tuple:
    """Every request of ``works`` against ``url`` (with ``extension`` as their ``kvtransfer``
    object); (samples, wall seconds)."""
    import httpx

    from kvtransfer.serve.http import client_limits

    samples = [Sample() for _ in works]
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(works))
    limits = client_limits(max_connections=len(works) + 4, max_keepalive_connections=len(works) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def go(i: int) -> None:
            async with gate:
                await _one(client, url, works[i], samples[i], extension)
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


POSTED = "first token sampled -> prefill posts the last writes"
LANDED = "first token sampled -> KV landed on decode"
DECODING = "first token sampled -> in decode's batch"
# the parts of "HTTP, routing, control" that stamps on one clock (this host's) show
HEAD = "request sent -> in prefill's queue"
TAIL = "KV landed -> first token at the client"


def ttft_split(samples: List[Sample], one_clock: bool = False) -> Optional[dict]:
    """Medians of the disaggregated TTFT's parts, from the nodes' figures; with them, when the
    nodes stamped it on one clock, from prefill's first token sampled to the post of its last
    writes (``POSTED``: prefill's part of the tail), to decode's last write counted (``LANDED``: the
    KV's tail, which layer-wise sending shortens) and to decode's engine taking the request
    into its decode batch (``DECODING``). ``one_clock``: the
    client's clock is the nodes' too (they run on this host), so the way in (``HEAD``: sent ->
    prefill's queue) and the way out (``TAIL``: decode's last write counted -> first token here)
    are split out of "HTTP, routing, control"."""
    rows, posted, landed, decoding, ends = [], [], [], [], []
    for s in samples:
        pre = s.kv.get("prefill") or {}
        if not s.ok or pre.get("compute_s") is None:
            continue
        transfer = (pre.get("decode_wait_s") or 0.0) + (pre.get("transfer_s") or 0.0)
        parts = {"prefill queue": pre["queue_s"], "prefill compute": pre["compute_s"], "KV transfer": transfer}
        parts["HTTP, routing, control"] = s.ttft - sum(parts.values())
        rows.append(parts)
        if pre.get("sampled_at") is not None and s.kv.get("landed_at") is not None:
            landed.append(s.kv["landed_at"] - pre["sampled_at"])
            if pre.get("posted_at") is not None:
                posted.append(pre["posted_at"] - pre["sampled_at"])
            if s.kv.get("decoding_at"):
                decoding.append(s.kv["decoding_at"] - pre["sampled_at"])
            if one_clock:
                queued_at = pre["sampled_at"] - pre["compute_s"] - pre["queue_s"]
                ends.append({HEAD: queued_at - s.sent_at, TAIL: s.first_at - s.kv["landed_at"]})
    if not rows:
        return None
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    if posted:
        out[POSTED] = statistics.median(posted)
    if landed:
        out[LANDED] = statistics.median(landed)
    if decoding:
        out[DECODING] = statistics.median(decoding)
    if ends:
        out |= {k: statistics.median(e[k] for e in ends) for k in (HEAD, TAIL)}
    return out | {"kv_bytes_median": statistics.median(s.kv.get("kv_bytes", 0) for s in samples if s.ok)}


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def report(results: dict, splits: dict) -> str:
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
    for mode, split in splits.items():
        parts = ", ".join(f"{k} {_ms(v)} ms" for k, v in split.items()
                          if k not in ("kv_bytes_median", POSTED, LANDED, DECODING, HEAD, TAIL))
        text += (f"\n{mode} TTFT, medians of its parts: {parts}; KV per request "
                 f"{split['kv_bytes_median'] / 2**20:.2f} MiB")
        for key in (POSTED, LANDED, DECODING, HEAD, TAIL):
            if key in split:
                text += f"; {key} {_ms(split[key])} ms"
    for mode, r in results.items():
        for e in r.get("errors", []):
            text += f"\n{mode} error: {e}"
    return text


def modes(args, router: str, colocated: str) -> List[Mode]:
    """The modes of this run, in the order each round runs them."""
    out = []
    for switch in args.layerwise:
        if switch == "on":
            out.append(Mode("disaggregated layer-wise", router))
        else:  # through a --layerwise node (both switches), the request asks for its KV after the prompt
            out.append(Mode("disaggregated", router, {"layerwise": False} if "on" in args.layerwise else None))
    return out + [Mode("colocated", colocated)]


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
    ap.add_argument("--prompt-tokens", type=_spans, default="64:256", metavar="N|LO:HI[,...]",
                    help="N or LO:HI, drawn uniformly; several, comma separated: each in turn against the same "
                         "nodes (serve-<span>.json and serve-<span>.png each)")
    ap.add_argument("--output-tokens", type=_range, default=(16, 64), help="N or LO:HI, drawn uniformly")
    ap.add_argument("--pool-tokens", type=positive_int, default=None,
                    help="KV pool size of every node started, in token slots (default: the nodes' default)")
    ap.add_argument("--max-running", type=positive_int, default=None,
                    help="requests in the engine at once on every node started (default: the nodes' default; "
                         "fewer on a GPU: fewer captured graphs, less memory per node)")
    ap.add_argument("--layerwise", type=on_off, default="off", metavar="on|off|on,off",
                    help="disaggregated: KV sent layer by layer as prefill computes it (on), after the prompt (off), "
                         "or both alternated (on,off)")
    ap.add_argument("--layer-group", type=positive_int, default=4, metavar="LAYERS",
                    help="--layerwise on: the prefill node sends every LAYERS layers (4: on one H100, 4,096-token "
                         "prompts of llama3-8b stretched prefill by 1.4%% sent every 4 layers, 3.4%% every layer)")
    ap.add_argument("--rounds", type=positive_int, default=None,
                    help="the workload in this many parts, each run by every mode in turn (default: 2 with "
                         "several disaggregated modes, else 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="the tiny MLA model, a dozen short requests (flags given "
                                                              "beside it win)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    return ap


@dataclass
class Measured:
    """One prompt-length span's run: per mode, its summary and its samples."""

    span: tuple
    rounds: int
    results: dict
    samples: dict


async def _measure(args, span: tuple, tokenizer, router: str, colocated: str) -> Measured:
    """The workload of prompts drawn from ``span`` through every mode, alternated in rounds."""
    import httpx

    works = workload(tokenizer, args.requests, span, args.output_tokens, args.seed)
    run = modes(args, router, colocated)
    for mode in run:  # warm-up: first connections, first plans
        await run_load(mode.url, works[:2], 2, None, args.seed, extension=mode.extension)
    rounds = args.rounds or (2 if sum(m.disaggregated for m in run) > 1 else 1)
    parts = [works[i::rounds] for i in range(rounds)]
    progress = Progress(len(run) * len(works))
    samples = {m.name: [] for m in run}
    walls = dict.fromkeys(samples, 0.0)
    queued = dict.fromkeys(("sum", "count"), 0.0)
    for part in (p for p in parts if p):
        for mode in run:
            async with httpx.AsyncClient() as client:
                before = await queue_totals(client, colocated)
                got, wall = await run_load(mode.url, part, None if args.rate else args.concurrency, args.rate,
                                           args.seed, progress, mode.extension)
                if mode.name == "colocated":
                    after = await queue_totals(client, colocated)
                    queued["sum"] += after[0] - before[0]
                    queued["count"] += after[1] - before[1]
            samples[mode.name] += got
            walls[mode.name] += wall
    results = {name: summarize(ss, walls[name]) for name, ss in samples.items()}
    for mode in run:
        results[mode.name]["queue_mean_s"] = (queue_mean(samples[mode.name]) if mode.disaggregated else
                                              queued["sum"] / queued["count"] if queued["count"] else None)
    return Measured(span, rounds, results, samples)


async def _main(args, argv) -> int:
    import httpx

    from kvtransfer.demo import DemoFailed, launch, stop_all
    from kvtransfer.models import registry
    from kvtransfer.serve.http import client_limits

    servers: dict = {}
    measured = []
    try:
        _, tokenizer = registry.load(registry.parse_name(args.model))
        router, colocated = args.router, args.colocated
        if router is None:
            logdir = tempfile.mkdtemp(prefix="kvtransfer-bench-serve-")
            print(f"starting the nodes (logs in {logdir})", file=sys.stderr, flush=True)
            async with httpx.AsyncClient(limits=client_limits()) as client:
                await launch(client, args, logdir, servers, False, time.monotonic())
            router, colocated = servers["router"].url, servers["colocated"].url
        several = len(args.prompt_tokens) > 1
        for span in args.prompt_tokens:
            if several:
                print(f"prompts of {_span_text(span)} tokens", file=sys.stderr, flush=True)
            measured.append(await _measure(args, span, tokenizer, router, colocated))
            _write(args, argv, measured[-1], f"serve-{_span_text(span)}" if several else "serve")  # as it comes
    except DemoFailed as exc:
        print(f"kvtransfer bench serve: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(servers.values())
    failed = sum(r["requests"] - r["succeeded"] for m in measured for r in m.results.values())
    return 1 if failed else 0


def _span_text(span: tuple) -> str:
    lo, hi = span
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _write(args, argv, m: Measured, stem: str) -> None:
    """Print ``m``'s header and table; write ``{stem}.json`` and ``{stem}.png`` under ``--out``."""
    one_clock = args.router is None  # the nodes this run started, on this host
    splits = {mode: split for mode, split in ((name, ttft_split(ss, one_clock)) for name, ss in m.samples.items()
                                              if name.startswith("disaggregated")) if split}
    load = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
    print(f"kvtransfer bench serve: {args.model}, prefill TP {args.prefill_tp} (page {args.prefill_page_size}) -> "
          f"decode TP {args.decode_tp} (page {args.decode_page_size}) vs colocated TP 1, {args.dtype} on {args.device}; "
          f"{args.requests} requests, {load}, prompts {m.span[0]}-{m.span[1]} tokens, "
          f"outputs {args.output_tokens[0]}-{args.output_tokens[1]}, seed {args.seed}, "
          f"pools {args.pool_tokens or 'default'}"
          f"{f', layer-wise: KV sent every {args.layer_group} layers' if 'on' in args.layerwise else ''}"
          f"{f', {m.rounds} rounds alternating the modes' if m.rounds > 1 else ''}; {machine_line()}")
    print(report(m.results, splits), flush=True)
    config = {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
              for k, v in vars(args).items()}
    config["prompt_tokens"] = list(m.span)
    doc = document("serve", argv, config, [{"mode": name, **r} for name, r in m.results.items()], ttft_split=splits,
                   samples={name: [asdict(s) for s in ss] for name, ss in m.samples.items()})
    path = write_json(args.out / f"{stem}.json", doc)
    if plots_available():
        panels = [Panel(f"{name} (ms)", {mode: (list(PERCENTILES), [r[key][f"p{q}"] * 1e3 for q in PERCENTILES])
                                          for mode, r in m.results.items() if key in r})
                  for name, key in (("time to first token", "ttft"), ("inter-token latency", "itl"),
                                    ("end-to-end latency", "latency"))]
        png = line_grid(args.out / f"{stem}.png", f"kvtransfer bench serve: {args.model}, {load}, prompts "
                        f"{_span_text(m.span)} tokens", panels, "percentile", "ms", ncols=3, logx=False)
        print(f"wrote {path} and {png}")
    else:
        print(f"wrote {path} (no matplotlib: no plot)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:
        defaults = ap.parse_args([])
        for k, v in QUICK.items():
            if getattr(args, k) == getattr(defaults, k):  # flags given beside --quick win
                setattr(args, k, v)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.layerwise_layers = args.layer_group if "on" in args.layerwise else 0  # the prefill node's --layerwise
    if (args.router is None) != (args.colocated is None):
        print("kvtransfer bench serve: error: --router and --colocated go together", file=sys.stderr)
        return 2
    if args.rate is not None and args.rate <= 0:
        print("kvtransfer bench serve: error: --rate must be positive", file=sys.stderr)
        return 2
    return asyncio.run(_main(args, argv))
