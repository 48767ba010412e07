"""``kvtransfer bench soak``: many requests through the router while clients hang up and the
prefill node is killed and started again; then nothing may be left behind on any node.

    kvtransfer bench soak                                  # 1,000 requests, 20% hang-ups, mla-tiny
    kvtransfer bench soak --requests 200 --hang-up 0.5

The nodes (prefill, decode, and the colocated one ``launch`` starts beside them) and the router
run as for ``bench serve``, with pools of ``--pool-tokens`` slots. ``--requests`` completions
(prompt and output lengths drawn from ``--prompt-tokens`` / ``--output-tokens``, half of them
streamed) go out at ``--concurrency``; a ``--hang-up`` share of the clients leave at a random
moment (``--hang-up-within`` seconds after sending: before the first token, in the middle, or
after the end). When half of the requests have started, the prefill node is killed (SIGKILL,
with its ranks) and started again on the same ports; the requests it held fail, the router
routes to it again once it answers.

At the end, once the nodes are idle: every node's slots in use, requests running, waiting and
in flight (``/metrics``) must be 0, and the threads and open files of each server's processes
no more than they were after the warm-up (the restarted prefill node against its first
incarnation's figures). The exit status is 1 when anything is left.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import signal
import sys
import tempfile
import time
from typing import Optional

from kvtransfer._args import positive_int
from kvtransfer._procs import group_members

RETRY_FOR_S = 60.0  # how long a client tries again after 503s with Retry-After
GAUGES = ("kvtransfer_slots_in_use", "kvtransfer_requests_running", "kvtransfer_requests_waiting",
          "kvtransfer_requests_in_flight")


def _parser() -> argparse.ArgumentParser:
    from kvtransfer.benchmarks.serve import _range

    ap = argparse.ArgumentParser(prog="kvtransfer bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mla-tiny")
    ap.add_argument("--requests", type=positive_int, default=1000)
    ap.add_argument("--concurrency", type=positive_int, default=16)
    ap.add_argument("--hang-up", type=float, default=0.2, help="share of clients that leave early")
    ap.add_argument("--hang-up-within", type=float, default=1.0, help="they leave this many seconds at most "
                    "after sending")
    ap.add_argument("--prompt-tokens", type=_range, default=(16, 600), help="N or LO:HI, drawn uniformly")
    ap.add_argument("--output-tokens", type=_range, default=(4, 64), help="N or LO:HI, drawn uniformly")
    ap.add_argument("--pool-tokens", type=positive_int, default=1024, help="KV pool of every node, token slots")
    ap.add_argument("--no-restart", action="store_true", help="do not kill and restart the prefill node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    return ap


def resources(pgid: int) -> dict:
    """Threads and open files of the live processes of a server's process group (``kinds``: the
    open files by what they are: socket, pipe, anon_inode:[eventfd], a path, ...)."""
    threads, kinds = 0, collections.Counter()
    for pid in group_members(pgid):
        try:
            threads += len(os.listdir(f"/proc/{pid}/task"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}").split(":[")[0]  # socket:[inode] -> socket
                kinds[re.sub(r"[0-9a-f]{6,}", "*", target)] += 1  # one name for UCX's per-process files
        except OSError:  # it (or the file) ended meanwhile
            pass
    return {"threads": threads, "fds": sum(kinds.values()), "kinds": kinds}


async def gauges(client, url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(f"{url}/metrics", timeout=30.0)).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {g: values.get(g, 0.0) for g in GAUGES}


async def _request(client, url: str, body: dict) -> str:
    """One completion to its end: "ok", or what went wrong. A 503 with ``Retry-After`` (a node
    down or full) is tried again after that many seconds, as the OpenAI SDK does, for
    :data:`RETRY_FOR_S` at most."""
    give_up = time.monotonic() + RETRY_FOR_S
    while True:
        outcome, retry_after = await _attempt(client, url, body)
        if retry_after is None or time.monotonic() + retry_after > give_up:
            return outcome
        await asyncio.sleep(retry_after)


async def _attempt(client, url: str, body: dict) -> tuple:
    """(outcome, seconds to wait before trying again or None)."""
    if not body["stream"]:
        resp = await client.post(f"{url}/v1/completions", json=body, timeout=600.0)
        return ("ok" if resp.status_code == 200 else f"HTTP {resp.status_code}"), _retry_after(resp)
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600.0) as resp:
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}", _retry_after(resp)
        async for line in resp.aiter_lines():
            if line.startswith("data: {\"error\""):
                return "error in the stream", None
            if line == "data: [DONE]":
                return "ok", None
    return "the stream ended without [DONE]", None


def _retry_after(resp) -> Optional[float]:
    value = resp.headers.get("retry-after")
    return float(value) if resp.status_code == 503 and value and value.isdigit() else None


async def _restart(servers: dict, client, timeout_s: float) -> float:
    """Kill the prefill node (and its ranks) and start it again on its ports; seconds it took."""
    from kvtransfer.demo import Server, _wait_ready

    old = servers["prefill"]
    start = time.monotonic()
    os.killpg(old.proc.pid, signal.SIGKILL)
    old.stop()
    new = servers["prefill"] = Server(old.name, old.args, os.path.dirname(old.log_path), old.port, move_ports=False)
    await _wait_ready(client, [new], timeout_s, start)
    return time.monotonic() - start


async def _settled(client, router: str, servers: dict, names) -> dict:
    """:func:`resources` of each server once the idle keep-alive connections are gone: past
    their expiry, one request lets the router's pool (and ours) close them."""
    from kvtransfer.serve.http import CLIENT_KEEPALIVE_EXPIRY_S

    await asyncio.sleep(CLIENT_KEEPALIVE_EXPIRY_S + 1)
    await _request(client, router, {"prompt": "settle", "max_tokens": 2, "stream": False})
    await asyncio.sleep(1.0)
    return {n: resources(servers[n].proc.pid) for n in names}


async def _main(args) -> int:
    import httpx

    from kvtransfer.demo import DemoFailed, launch, stop_all
    from kvtransfer.serve.http import client_limits

    args.device, args.dtype, args.prefill_tp, args.decode_tp = "cpu", "float32", 1, 1
    args.prefill_page_size, args.decode_page_size = 16, 64
    servers: dict = {}
    rng = random.Random(args.seed)
    counts: collections.Counter = collections.Counter()
    limits = client_limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    try:
        async with httpx.AsyncClient(limits=limits) as client:
            logdir = tempfile.mkdtemp(prefix="kvtransfer-bench-soak-")
            print(f"starting the nodes (logs in {logdir})", file=sys.stderr, flush=True)
            await launch(client, args, logdir, servers, False, time.monotonic())
            router = servers["router"].url
            for stream in (False, True):  # warm-up: first connections, first plans
                await _request(client, router, {"prompt": "warm up", "max_tokens": 4, "stream": stream})
            names = ("prefill", "decode", "router")
            before = await _settled(client, router, servers, names)
            gate = asyncio.Semaphore(args.concurrency)
            restart: dict = {}
            start = time.monotonic()

            async def one(i: int) -> None:
                body = {"prompt": "x" * rng.randint(*args.prompt_tokens),
                        "max_tokens": rng.randint(*args.output_tokens), "temperature": 0, "ignore_eos": True, "stream": rng.random() < 0.5}
                leave = rng.uniform(0, args.hang_up_within) if rng.random() < args.hang_up else None
                async with gate:
                    if i == args.requests // 2 and not args.no_restart:
                        restart["task"] = asyncio.ensure_future(_restart(servers, client, args.startup_timeout))
                    try:
                        outcome = await asyncio.wait_for(_request(client, router, body), leave)
                    except asyncio.TimeoutError:
                        outcome = "hung up"
                    except httpx.HTTPError as exc:
                        outcome = type(exc).__name__
                counts[outcome] += 1

            await asyncio.gather(*(one(i) for i in range(args.requests)))
            wall = time.monotonic() - start
            restart_s = await restart["task"] if "task" in restart else None
            deadline = time.monotonic() + 120
            left = {}
            while time.monotonic() < deadline:
                left = {n: await gauges(client, servers[n].url) for n in ("prefill", "decode")}
                if not any(v for g in left.values() for v in g.values()):
                    break
                await asyncio.sleep(0.5)
            after = await _settled(client, router, servers, names)
            router_text = (await client.get(f"{router}/metrics")).text
    except DemoFailed as exc:
        print(f"kvtransfer bench soak: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(servers.values())
    aborted = next((line.split()[-1] for line in router_text.splitlines()
                    if line.startswith('kvtransfer_router_requests_total{outcome="aborted"}')), "?")
    print(f"kvtransfer bench soak: {args.model}, pools {args.pool_tokens} slots, {args.requests} requests at "
          f"concurrency {args.concurrency}, {args.hang_up:.0%} of clients leave within {args.hang_up_within:g} s, "
          f"prefill node {'not restarted' if args.no_restart else f'killed and restarted ({restart_s:.1f} s)'}; "
          f"{wall:.0f} s")
    print("clients: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()) + f"; the router counted "
          f"{aborted} aborted")
    leaks = 0
    for n in ("prefill", "decode"):
        figures = ", ".join(f"{g.removeprefix('kvtransfer_')} {v:g}" for g, v in left[n].items())
        print(f"{n} node at the end: {figures}")
        leaks += sum(1 for v in left[n].values() if v)
    for n in names:
        grew = {k: after[n][k] - before[n][k] for k in ("threads", "fds")}
        print(f"{n}: threads {before[n]['threads']} -> {after[n]['threads']}, open files {before[n]['fds']} -> "
              f"{after[n]['fds']}")
        leaks += sum(1 for v in grew.values() if v > 0)
        more = after[n]["kinds"] - before[n]["kinds"]
        if more:
            print(f"  {n}: open files more than after the warm-up: {dict(more)}")
    print("nothing left behind" if not leaks else f"{leaks} figure(s) above are left behind")
    return 1 if leaks else 0


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if not 0 <= args.hang_up <= 1:
        print(f"kvtransfer bench soak: error: --hang-up must be in [0, 1], got {args.hang_up}", file=sys.stderr)
        return 2
    return asyncio.run(_main(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
