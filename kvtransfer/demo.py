"""``kvtransfer demo``: disaggregated serving on this machine, end to end, checked.

Starts a prefill node (SmolLM2, TP 3, pages of 16 tokens), a decode node (TP 1, pages of 64),
the router in front of them, and a colocated node (TP 1) as the reference; sends a handful of
real prompts through the router; prints each prompt, its completion, the KV bytes moved, the
transfer time and rate; and compares every completion with the colocated node's. The router
checks each request's KV layer by layer (the digests of what prefill computed against what
decode received). Exits 0 only if every completion is equal and every KV check passed.

    kvtransfer demo                                  # SmolLM2, float32 on the CPU
    kvtransfer demo --model mla-tiny                 # MLA pools (prefill TP 2 -> decode TP 1)
    kvtransfer demo --model hybrid-tiny --prefill-tp 1 --decode-tp 2

Every process it starts is in a process group of its own and is gone when it exits, also on
Ctrl-C; their logs go to a temporary folder, named when something fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional

from kvtransfer._args import HelpFormatter, description, positive_float, positive_int
from kvtransfer.serve.http import client_limits, free_port

PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 12 plus 30?",
    "Name three colors of the rainbow.",
    "Say hello in Spanish.",
)
HEALTH_POLL_S = 0.25


PORT_FLAGS = ("--port", "--bootstrap-port")
PORT_RETRIES = 3


class Server:
    """One ``kvtransfer serve`` / ``router`` process in its own process group, its log in a file."""

    def __init__(self, name: str, args: List[str], logdir: str, port: int, move_ports: bool = True):
        self.name, self.args, self.port, self.move_ports = name, list(args), port, move_ports
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(logdir, f"{name.replace(' ', '-')}.log")
        self.retries = 0
        self._log = open(self.log_path, "wb")
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtransfer", *self.args], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def answered(self, health_status: int, info: dict) -> bool:
        """Whether ``/health`` and ``/info`` at this server's URL say it is up, and are its own:
        a port picked for it may be another process's before it binds (another server of the
        same kind answers on it until this one exits 2 and moves), so ``/info`` must name its pid."""
        return health_status == 200 and info.get("pid") == self.proc.pid

    def flag(self, name: str) -> Optional[str]:
        """The value this server was started with for the flag ``name`` (None if not given)."""
        return self.args[self.args.index(name) + 1] if name in self.args else None

    def starting(self) -> bool:
        """True while the process runs. A port picked for it can be taken by another process
        before the server binds it (the server then exits 2 saying the port "is not free"): such a
        server is started again on fresh ports, a few times, and this says True (unless it was
        made with ``move_ports=False``: others know it by its port)."""
        if self.proc.poll() is None:
            return True
        if not self.move_ports or self.retries >= PORT_RETRIES or self.proc.returncode != 2 \
                or "is not free" not in self.tail(2):
            return False
        self.retries += 1
        for i, arg in enumerate(self.args[:-1]):
            if arg in PORT_FLAGS:
                self.args[i + 1] = str(free_port())
        self.port = int(self.flag("--port"))
        self.url = f"http://127.0.0.1:{self.port}"
        self._log.write(f"[demo] a port was taken before the {self.name} bound it: starting it again on port "
                        f"{self.port}\n".encode())
        self._log.flush()
        self._spawn()
        return True

    def tail(self, lines: int = 3) -> str:
        with open(self.log_path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM to its process group): it stops its ranks and exits."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, wait_s: float = 10.0) -> None:
        """:meth:`terminate`, wait up to ``wait_s``, then SIGKILL whatever is left of the group."""
        self.terminate()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        try:  # the group's other members (rank processes) too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def stop_all(servers) -> None:
    """Stop servers together: every one is asked first, then each is waited for."""
    servers = list(servers)
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


class DemoFailed(RuntimeError):
    pass


async def _wait_ready(client, servers: List[Server], timeout_s: float, start: float) -> None:
    """Poll every server's /health until it answers 200; print each as it becomes ready."""
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for s in list(pending):
            if not s.starting():
                raise DemoFailed(f"the {s.name} exited with status {s.proc.returncode}: {s.tail()}")
            try:
                health = await client.get(f"{s.url}/health", timeout=2.0)
                if s.answered(health.status_code, (await client.get(f"{s.url}/info", timeout=2.0)).json()):
                    pending.remove(s)
                    print(f"  {s.name:<15} ready at {s.url} ({time.monotonic() - start:.1f} s)", flush=True)
            except Exception:  # noqa: BLE001 - not up yet
                pass
        if time.monotonic() > deadline:
            raise DemoFailed(f"not ready within {timeout_s:g} s: {', '.join(s.name for s in pending)} "
                             f"({pending[0].tail()})")
        await asyncio.sleep(HEALTH_POLL_S)


def heartbeat_timeout(device: str) -> float:
    """The nodes' heartbeat timeout: a serving node's 5 s on GPUs; on CPUs 20 s, since every node's
    model then runs on this machine's few cores (seven processes for the README's run), and a
    loaded small machine can keep one from running for seconds (measured: 5 s once in the
    test suite on two workers), which would lose a live peer and fail its request."""
    return 5.0 if device == "cuda" else 20.0


def threads_per_rank(ranks: int) -> int:
    """Torch threads for each of the ``ranks`` rank processes started on this machine: the cores
    this process may run on, shared among them. A node's own default (the cores over its TP)
    assumes it has the machine alone; several ranks at that default ask for more threads than
    there are cores, and the threads contend for them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks)


async def launch(client, args, logdir: str, servers: dict, verify_kv: bool, start: float) -> None:
    """Start a prefill node, a decode node and a colocated node, wait until they are ready, then
    start the router in front of them and wait for it (filling ``servers`` as each starts, so a
    caller can stop what started if this fails); every rank gets an equal share of this
    machine's cores (:func:`threads_per_rank`). ``args`` holds the demo's flags; ``transport``,
    ``prefill_gpu``, ``decode_gpu``, ``heartbeat_timeout``, ``layerwise_layers`` (the prefill
    node's ``--layerwise``), ``pool_tokens`` and ``max_running`` (every node's) may be absent
    (their defaults)."""
    ports = {k: free_port() for k in ("router", "prefill", "decode", "colocated", "bootstrap")}
    common = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
              "--threads", str(threads_per_rank(args.prefill_tp + args.decode_tp + 1)),
              "--transport", getattr(args, "transport", "auto"),
              "--heartbeat-timeout", str(getattr(args, "heartbeat_timeout", None) or heartbeat_timeout(args.device))]
    if getattr(args, "pool_tokens", None):  # the nodes' pool size (bench serve's --pool-tokens)
        common += ["--pool-tokens", str(args.pool_tokens)]
    if getattr(args, "max_running", None):  # requests in each engine at once (bench serve's --max-running)
        common += ["--max-running", str(args.max_running)]
    prefill_gpu, decode_gpu = str(getattr(args, "prefill_gpu", 0)), str(getattr(args, "decode_gpu", 1))
    servers["prefill"] = Server("prefill node", ["serve", "--role", "prefill", *common, "--tp", str(args.prefill_tp),
                                "--page-size", str(args.prefill_page_size), "--port", str(ports["prefill"]),
                                "--bootstrap-port", str(ports["bootstrap"]), "--gpu", prefill_gpu,
                                "--layerwise", str(getattr(args, "layerwise_layers", 0))],
                                logdir, ports["prefill"])
    servers["decode"] = Server("decode node", ["serve", "--role", "decode", *common, "--tp", str(args.decode_tp),
                               "--page-size", str(args.decode_page_size), "--port", str(ports["decode"]),
                               "--gpu", decode_gpu], logdir, ports["decode"])
    servers["colocated"] = Server("colocated node", ["serve", "--role", "colocated", *common, "--port",
                                  str(ports["colocated"]), "--gpu", prefill_gpu], logdir, ports["colocated"])
    await _wait_ready(client, [servers["prefill"], servers["decode"], servers["colocated"]], args.startup_timeout,
                      start)
    servers["router"] = Server("router", ["router", "--prefill", servers["prefill"].url, "--decode",
                               servers["decode"].url, "--port", str(ports["router"]),
                               *(["--verify-kv"] if verify_kv else [])], logdir, ports["router"])
    await _wait_ready(client, [servers["router"]], 60.0, start)


@dataclass
class Outcome:
    prompt: str
    text: Optional[str] = None
    reference: Optional[str] = None
    extra: Optional[dict] = None
    error: Optional[str] = None


async def _ask(client, url: str, prompt: str, max_tokens: int, verify: bool) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if verify:
        body["kvtransfer"] = {"verify": True}
    resp = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600.0)
    data = resp.json()
    if resp.status_code != 200:
        raise DemoFailed(data.get("error", {}).get("message", resp.text))
    return data


async def _run(args, logdir: str, servers: dict, start: float) -> int:
    import httpx

    async with httpx.AsyncClient(limits=client_limits()) as client:
        print("starting the nodes (first use also dequantizes SmolLM2 once, ~15 s):", flush=True)
        await launch(client, args, logdir, servers, True, start)
        prompts = list(PROMPTS[:args.prompts])
        print(f"\nsending {len(prompts)} chat requests through the router and to the colocated node "
              f"(greedy, {args.max_tokens} new tokens at most):\n", flush=True)
        outcomes = [Outcome(p) for p in prompts]

        async def one(o: Outcome):
            try:
                disagg, colo = await asyncio.gather(_ask(client, servers["router"].url, o.prompt, args.max_tokens, True),
                                                    _ask(client, servers["colocated"].url, o.prompt, args.max_tokens,
                                                         False))
                o.text, o.extra = disagg["choices"][0]["message"]["content"], disagg["kvtransfer"]
                o.reference = colo["choices"][0]["message"]["content"]
            except DemoFailed as exc:
                o.error = str(exc)
            except httpx.HTTPError as exc:
                o.error = _http_error(exc)

        await asyncio.gather(*(one(o) for o in outcomes))
    return _report(args, outcomes, start)


def _http_error(exc) -> str:
    """An httpx error as one line naming the URL (a connection error's own text may be empty)."""
    try:
        where = f" from {exc.request.url}"
    except RuntimeError:  # no request attached
        where = ""
    return f"{type(exc).__name__}{where}: {str(exc) or 'the connection failed with no message'}"


def _rate(bytes_per_s: float) -> str:
    """``3.42 GB/s``, or in MB/s below 1 GB/s (a small request on a CPU moves a few MB/s)."""
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _report(args, outcomes: List[Outcome], start: float) -> int:
    same = 0
    kv_bytes, transfer_s = 0, []
    for i, o in enumerate(outcomes, 1):
        print(f"[{i}] {o.prompt}")
        if o.error:
            print(f"    FAILED: {o.error}\n")
            continue
        x = o.extra
        print(f"    {o.text!r}")
        rate = x["kv_bytes"] / x["transfer_s"] if x["transfer_s"] > 0 else 0.0
        match = o.text == o.reference
        same += match
        kv_bytes += x["kv_bytes"]
        transfer_s.append(x["transfer_s"])
        print(f"    KV {x['kv_bytes'] / 2**20:.2f} MiB in {x['transfer_s'] * 1e3:.1f} ms ({_rate(rate)}), "
              f"verified {x['layers']} layers bit for bit; "
              f"{'same as the colocated node' if match else 'DIFFERS from the colocated node: ' + repr(o.reference)}\n")
    n = len(outcomes)
    print(f"{same} of {n} completions equal the colocated node's; "
          f"{sum(o.error is None for o in outcomes)} of {n} requests' KV verified layer by layer")
    if transfer_s:
        transfer_s.sort()
        print(f"KV moved: {kv_bytes / 2**20:.2f} MiB in {len(transfer_s)} transfers, median "
              f"{transfer_s[len(transfer_s) // 2] * 1e3:.1f} ms; {args.model} prefill TP {args.prefill_tp} (pages of "
              f"{args.prefill_page_size}) -> decode TP {args.decode_tp} (pages of {args.decode_page_size}), "
              f"{args.dtype} on {args.device}, transport {args.transport}")
    print(f"done in {time.monotonic() - start:.1f} s")
    return 0 if same == n else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtransfer demo", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, mla-tiny or hybrid-tiny")
    ap.add_argument("--prefill-tp", type=positive_int, default=None, help="default: 3 for smollm2, else 2")
    ap.add_argument("--decode-tp", type=positive_int, default=1, help="the decode node's TP size")
    ap.add_argument("--prefill-page-size", type=positive_int, default=16, help="tokens per KV page on prefill")
    ap.add_argument("--decode-page-size", type=positive_int, default=64, help="tokens per KV page on decode")
    ap.add_argument("--prompts", type=positive_int, default=len(PROMPTS), help=f"at most {len(PROMPTS)}")
    ap.add_argument("--max-tokens", type=positive_int, default=24, help="new tokens per request at most")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--transport", default="auto", choices=("auto", "nixl", "nvlink"), help="the KV transport")
    ap.add_argument("--prefill-gpu", type=int, default=0, help="CUDA: prefill rank r on GPU (this + r) %% GPUs")
    ap.add_argument("--decode-gpu", type=int, default=1, help="CUDA: decode rank r on GPU (this + r) %% GPUs; "
                    "the colocated node uses the prefill's")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the nodes may take to start")
    ap.add_argument("--heartbeat-timeout", type=positive_float, default=None,
                    help="seconds before the nodes lose a silent peer (default: 20 on cpu, 5 on cuda)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.prompts = min(args.prompts, len(PROMPTS))
    from kvtransfer.models import registry

    try:  # bad input is one line here, before any process starts
        name = registry.parse_name(args.model)
        args.model = name.value  # an alias is shown and passed on by the model's name
        args.prefill_tp = args.prefill_tp or (3 if name is registry.ModelName.SMOLLM2 else 2)
        config = registry.load_config(name)
        for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
            try:
                config.check_tp(tp)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
    except (ValueError, RuntimeError) as exc:
        print(f"kvtransfer demo: error: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    logdir = tempfile.mkdtemp(prefix="kvtransfer-demo-")
    print(f"kvtransfer demo: {args.model} {args.dtype} on {args.device}; prefill TP {args.prefill_tp} (pages of "
          f"{args.prefill_page_size}) -> decode TP {args.decode_tp} (pages of {args.decode_page_size}), "
          f"a colocated node as the reference; logs in {logdir}", flush=True)
    servers: dict = {}

    signals: list = []

    def on_signal(signum, _frame):  # Ctrl-C or SIGTERM: whatever the demo is doing, stop what it started
        signals.append(signum)
        raise KeyboardInterrupt  # (asyncio's own SIGINT handling cancels a task, which may not end)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(_run(args, logdir, servers, start))
    except DemoFailed as exc:
        print(f"kvtransfer demo: failed: {exc} (logs in {logdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if signals[:1] == [signal.SIGTERM]:  # a supervisor's orderly stop: 0 once all is torn down
            return 0
        print("kvtransfer demo: interrupted; stopping what it started", file=sys.stderr)
        return 130
    finally:
        stop_all(servers.values())
        for sig, handler in old.items():
            signal.signal(sig, handler)
