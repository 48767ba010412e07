"""``kvtransfer serve``: a prefill, decode or colocated node over HTTP.

    kvtransfer serve --role prefill   --model smollm2 --tp 3 --page-size 16 --port 30001
    kvtransfer serve --role decode    --model smollm2 --tp 1 --page-size 64 --port 30002
    kvtransfer serve --role colocated --model smollm2 --tp 1 --port 30003

A node is this HTTP process (FastAPI on uvicorn: tokenizer, chat template, text, the OpenAI
shapes, metrics; :mod:`kvtransfer.serve.node_app`, with what each role does differently in
:mod:`kvtransfer.serve.roles`) and one process per TP rank (:mod:`kvtransfer.serve.worker`: model shard,
pools, transports, KV manager). A prefill node also runs the bootstrap service its ranks
register with (``--bootstrap-port``; ``GET /info`` names it for the router).

Endpoints: ``GET /health`` (200 once every rank is up, 503 before and after a rank died),
``GET /info``, ``GET /metrics`` (Prometheus text), ``GET /v1/models``, and
``POST /v1/completions`` / ``POST /v1/chat/completions``. A colocated node answers those
itself; prefill and decode nodes answer the router's paired requests (``kvtransfer.rid``, and
for decode the prefill node's ``bootstrap``): prefill replies once the KV has landed, decode
streams the completion.

Load: a request that fits the pools alone waits for pages (``--max-queue`` of them at most,
past that a 503 with ``Retry-After`` at once; :mod:`kvtransfer.serve.worker` says why nothing
deadlocks). A client that goes away, before or after its first token, streaming or not, has
its request aborted on the ranks as soon as the disconnect arrives.

A rank that dies fails every request in flight with a 503 that names it; the node then exits
(status 1), so that whatever supervises it can restart it. Bad input on the command line (an
unknown model, a TP the heads do not allow, a port in use) is one line and status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import uuid
from typing import Dict, Optional

from kvtransfer._args import HelpFormatter, deprecated_alias, description, positive_int
from kvtransfer.serve.http import DEFAULT_MAX_BODY_BYTES, UsageError, http_server, port_socket
from kvtransfer.serve.node_app import build_app
from kvtransfer.serve.roles import ROLES, role_of

log = logging.getLogger("kvtransfer.serve.node")

RANKS_STOP_S = 15.0  # how long a rank may take to stop after Shutdown before it is killed
EXIT_AFTER_RANK_DEATH_S = 1.0  # time for the failed requests' answers to leave before the node exits


@dataclasses.dataclass(frozen=True)
class EngineDefaults:
    """The engine options whose defaults depend on where it runs."""

    pool_tokens: int
    max_running: int
    chunk_size: int


# On a GPU a prefill step's cost is mostly fixed host work, so larger chunks prefill more per
# second, and one captured decode step serves many requests, whose KV a GPU pool holds with room
# to spare (bench/RESULTS.md, kvtransfer bench serve, "On a GPU"). On the CPU the arithmetic
# dominates, and a smaller chunk lets a colocated node's decode steps run in between.
DEFAULTS = {"cpu": EngineDefaults(pool_tokens=8192, max_running=16, chunk_size=512),
            "cuda": EngineDefaults(pool_tokens=65536, max_running=64, chunk_size=4096)}


def _default_help(field: str) -> str:
    return f"(default: {getattr(DEFAULTS['cuda'], field)} on a GPU, {getattr(DEFAULTS['cpu'], field)} on the CPU)"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtransfer serve", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--model", required=True, help="smollm2, mla-tiny, hybrid-tiny, or a random-weights preset: "
                                                   "smollm2-135m-random, llama3-8b, deepseek-v2-lite-mla")
    ap.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (one process per rank)")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    ap.add_argument("--port", type=int, required=True, help="HTTP port")
    ap.add_argument("--host", default="127.0.0.1", help="address HTTP and the control sockets bind")
    ap.add_argument("--bootstrap-port", type=int, default=None, help="prefill: the bootstrap service's port "
                    "(default: --port + 1000)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is visible)")
    ap.add_argument("--gpu", type=int, default=0, help="CUDA: rank r uses GPU (gpu + r) %% visible GPUs")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--transport", default="auto", choices=("auto", "nixl", "nvlink"),
                    help="auto: nvlink between GPUs of one host when both sides offer it, else nixl "
                         "(nvlink alone where NIXL is not installed)")
    pool = ap.add_argument("--pool-tokens", type=positive_int, default=None,
                           help=f"KV pool size in token slots {_default_help('pool_tokens')}")
    deprecated_alias(ap, "--max-tokens", pool)
    ap.add_argument("--max-running", type=positive_int, default=None,
                    help=f"requests in the engine at once {_default_help('max_running')}")
    ap.add_argument("--chunk-size", type=positive_int, default=None,
                    help=f"prompt tokens per prefill step {_default_help('chunk_size')}")
    ap.add_argument("--layerwise", type=int, default=0, metavar="LAYERS",
                    help="prefill: send each chunk's KV every LAYERS layers that hold KV while its forward computes "
                         "the rest (0: once the prompt is computed); a hybrid model's Mamba state goes after the "
                         "last layer")
    ap.add_argument("--max-queue", type=positive_int, default=128,
                    help="requests that may wait for KV pages at once; past it a new one gets 503 + Retry-After")
    ap.add_argument("--transfer-timeout", type=float, default=60.0, help="seconds a KV transfer may take")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds before a silent peer is lost")
    ap.add_argument("--connect-timeout", type=float, default=10.0,
                    help="seconds to reach a bootstrap service and finish a handshake")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the ranks may take to start")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads per rank (default: the machine's cores / --tp, for a node alone on its "
                         "machine; nodes sharing one should split its cores)")
    ap.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                    help="a request body past this is refused (413)")
    return ap


def resolve(args) -> tuple:
    """(NodeSpec, model config, EngineConfig) from the command line; UsageError on bad input."""
    import torch

    from kvtransfer.models import registry
    from kvtransfer.models.config import DType, EngineConfig
    from kvtransfer.serve.messages import NodeSpec

    try:
        name = registry.parse_name(args.model)
        config = registry.load_config(name)
        config.check_tp(args.tp)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}; expected cpu or cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but no CUDA GPU is visible")
        dtype = DType.parse(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
        if args.transport == "nvlink" and device != "cuda":
            raise ValueError("--transport nvlink needs --device cuda")
        if args.layerwise < 0:
            raise ValueError(f"--layerwise must be 0 (off) or a number of layers, got {args.layerwise}")
        for field in dataclasses.fields(EngineDefaults):
            if getattr(args, field.name) is None:
                setattr(args, field.name, getattr(DEFAULTS[device], field.name))
        ec = EngineConfig(max_tokens=args.pool_tokens, page_size=args.page_size, max_requests=args.max_running,
                          chunk_size=args.chunk_size, dtype=dtype.torch, device=device)
        for name_, v in (("--transfer-timeout", args.transfer_timeout), ("--heartbeat-timeout", args.heartbeat_timeout),
                         ("--connect-timeout", args.connect_timeout), ("--startup-timeout", args.startup_timeout)):
            if not v > 0:
                raise ValueError(f"{name_} must be a positive number of seconds, got {v}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    bootstrap_port = args.bootstrap_port if args.bootstrap_port is not None else args.port + 1000
    control = {"transfer_timeout_s": args.transfer_timeout, "heartbeat_timeout_s": args.heartbeat_timeout,
               "heartbeat_interval_s": min(0.5, args.heartbeat_timeout / 4),
               "bootstrap_timeout_s": args.connect_timeout, "handshake_timeout_s": args.connect_timeout}
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    spec = NodeSpec(role=args.role, model=name.value, tp_size=args.tp, page_size=args.page_size, dtype=dtype.value,
                    device=device, first_gpu=args.gpu, max_tokens=args.pool_tokens, max_requests=args.max_running,
                    chunk_size=args.chunk_size, transport=args.transport, host=args.host,
                    bootstrap=f"tcp://{args.host}:{bootstrap_port}", dist_port=0,
                    threads=threads, instance=f"{args.role}-{uuid.uuid4().hex[:12]}", control=control,
                    max_queue=args.max_queue, layerwise=args.layerwise if args.role == "prefill" else 0)
    return spec, config, ec, bootstrap_port


class Ranks:
    """The node's rank processes: start, commands to rank 0, events back, death noticed."""

    def __init__(self, spec):
        self.spec = spec
        self.children: list = []
        self.ready: list = []
        self.store = None  # the TP group's rendezvous, held while the ranks run

    def start(self, timeout_s: float) -> None:
        from kvtransfer._procs import Child
        from kvtransfer.models.parallel import rendezvous
        from kvtransfer.serve.messages import RankReady
        from kvtransfer.serve.worker import rank_main

        if self.spec.tp_size > 1:
            self.store = rendezvous()
            self.spec = dataclasses.replace(self.spec, dist_port=self.store.port)
        for r in range(self.spec.tp_size):
            self.children.append(Child.spawn(rank_main, (self.spec, r), name=f"{self.spec.role} rank {r}"))
        self.ready = [c.recv(RankReady, "it was up", timeout=timeout_s) for c in self.children]

    def send(self, cmd) -> None:
        self.children[0].send(cmd)

    def dead(self) -> Optional[str]:
        """Why a rank is gone (its report, or how its process ended), or None."""
        from kvtransfer._procs import Failed, exit_text

        for child in self.children:
            if child is not self.children[0] and child.conn.poll(0):
                try:
                    msg = child.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, Failed):
                    return f"{child.name} failed: {msg.error}"
            if not child.proc.is_alive():
                return f"{child.name} died ({exit_text(child.proc)})"
        return None

    def stop(self) -> None:
        from kvtransfer.serve.messages import Shutdown

        for i, child in enumerate(self.children):
            child.stop(Shutdown() if i == 0 else None, timeout=RANKS_STOP_S)
        self.children = []  # stopped once
        self.store = None


class Node:
    """The HTTP side of a node (module docstring)."""

    def __init__(self, spec, model_config, engine_config, tokenizer, bootstrap_port: Optional[int] = None,
                 startup_timeout_s: float = 300.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        from kvtransfer.models.config import ModelName
        from kvtransfer.serve.metrics import NodeMetrics

        self.spec, self.model_config, self.engine_config = spec, model_config, engine_config
        self.tokenizer = tokenizer
        self.bootstrap_port, self.startup_timeout_s = bootstrap_port, startup_timeout_s
        self.max_body_bytes = max_body_bytes
        self.model_name = spec.model
        self.model_names = ModelName(spec.model).names  # what a request's "model" may say
        self.role = role_of(spec.role)  # what this node does differently (kvtransfer.serve.roles)
        self.metrics = NodeMetrics(spec.role, spec.model)
        self.state, self.error = "starting", ""
        self.ranks = Ranks(spec)
        self.pending: Dict[str, asyncio.Queue] = {}
        self.metrics.in_flight.set_function(lambda: len(self.pending))
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.bootstrap_service = None
        self.exit_code = 0
        self.on_fatal = None  # called (from a thread) after a rank died: the server should exit
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # Prompts are tokenized off the event loop on one thread of the node's own, started with
        # the first request and kept: a pool that grows with the load would be a thread count
        # that depends on how requests happened to overlap.
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvt-tokenize")

    # -- life cycle ---------------------------------------------------------------------
    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvt-node-ranks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Start the ranks, then relay their events until the node stops or a rank dies."""
        try:
            if self.role.runs_bootstrap:
                from kvtransfer.control.bootstrap import BootstrapService

                self.bootstrap_service = BootstrapService(self.spec.host, self.bootstrap_port)
            self.ranks.start(self.startup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported, and the node exits
            self._fatal(f"the ranks did not come up: {exc}")
            return
        self.state = "ready"
        log.info("%s node ready: %s", self.spec.role, "; ".join(r.layout for r in self.ranks.ready))
        conn = self.ranks.children[0].conn
        while not self._stop.is_set():
            try:
                if conn.poll(0.05):
                    self._post(conn.recv())
                    continue
            except (EOFError, OSError):
                pass
            why = self.ranks.dead()
            if why and not self._stop.is_set():
                self._fatal(why)
                return
        # The ranks were spawned by this thread and die with it (PR_SET_PDEATHSIG is tied to the
        # thread that forked them, worker._die_with_parent): they are stopped before it ends.
        self.ranks.stop()

    def _post(self, message) -> None:
        """Rank 0's message: a list of events (one half of its loop's), or its failure."""
        from kvtransfer._procs import Failed

        if isinstance(message, Failed):
            self._fatal(f"{self.ranks.children[0].name} failed: {message.error}")
            return
        self.loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, events: list) -> None:
        from kvtransfer.serve.messages import Load

        for event in events:
            if isinstance(event, Load):
                self.metrics.slots_in_use.set(event.slots_in_use)
                self.metrics.slots_total.set(event.slots_total)
                self.metrics.running.set(event.running)
                self.metrics.waiting.set(event.waiting)
                continue
            q = self.pending.get(event.rid)
            if q is not None:
                q.put_nowait(event)

    def _fatal(self, why: str) -> None:
        """A rank is gone: fail everything in flight, say so on /health, and exit."""
        from kvtransfer.serve.messages import RequestFailed

        log.error("%s node: %s", self.spec.role, why)
        self.state, self.error, self.exit_code = "failed", why, 1
        if self.loop is not None:
            def fail_all():
                for rid, q in self.pending.items():
                    q.put_nowait(RequestFailed(rid, f"{self.spec.role} node: {why}"))
            self.loop.call_soon_threadsafe(fail_all)
        if self.on_fatal is not None:
            threading.Timer(EXIT_AFTER_RANK_DEATH_S, self.on_fatal).start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:  # it stops the ranks it relays for (_run)
            self._thread.join(timeout=RANKS_STOP_S * max(1, len(self.ranks.children)) + 5)
        self.ranks.stop()  # those it did not stop (still starting, or one died)
        if self.bootstrap_service is not None:
            self.bootstrap_service.close()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    # -- requests -----------------------------------------------------------------------
    async def submit(self, rid: str, cmd) -> asyncio.Queue:
        if rid in self.pending:
            raise KeyError(rid)
        q = self.pending[rid] = asyncio.Queue()
        self.ranks.send(cmd)
        return q

    def finish(self, rid: str, ended: bool, outcome: str) -> None:
        from kvtransfer.serve.messages import Abort

        self.pending.pop(rid, None)
        if not ended and self.state == "ready":
            self.ranks.send(Abort(rid, "the client went away"))
        self.metrics.requests.labels(outcome).inc()


def main(argv=None) -> int:
    from kvtransfer.models import registry

    args = parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("KVT_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s")
    socks = []
    try:
        spec, config, ec, bootstrap_port = resolve(args)
        socks.append(port_socket(args.host, args.port, "port"))
        if role_of(spec.role).runs_bootstrap:
            port_socket(args.host, bootstrap_port, "bootstrap port").close()
        _, tokenizer = registry.load(registry.parse_name(args.model))
    except (UsageError, RuntimeError) as exc:
        for s in socks:
            s.close()
        print(f"kvtransfer serve: error: {exc}", file=sys.stderr)
        return 2
    node = Node(spec, config, ec, tokenizer, bootstrap_port, args.startup_timeout, args.max_body_bytes)
    app = build_app(node)
    server = http_server(app)

    def stop_server():
        server.should_exit = True

    node.on_fatal = stop_server
    try:
        server.run(sockets=socks)
    finally:
        node.shutdown()
        for s in socks:
            s.close()
    if node.exit_code:
        print(f"kvtransfer serve: error: {node.error}", file=sys.stderr)
    return node.exit_code
