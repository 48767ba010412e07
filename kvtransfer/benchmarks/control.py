"""``kvtransfer bench control``: the control plane's cost per request, under load, and a soak.

Three processes and a bootstrap service on this host: a prefill rank and a decode rank (each
its own MHA pool on the CPU, NIXL over loopback, its KV manager) and this process as the
router, which hands both the same request ids in batches (typed messages) and collects the
outcome and the state times of each request (``RequestStatus.times``: ``time.monotonic``, one
clock for every process of the host).

- **latency**: requests one at a time, decode asking first (it reserves the pages as the
  request is routed), then prefill's engine handing over the computed KV (``sender.send``):
  per request, prefill's sender created -> decode Success (what TTFT waits for), and the
  bytes' own time on prefill (first write posted -> every write done). The control overhead
  is the first minus the second: the plan, the posting, the notification and its polling.
  The decode side's own ask path (receiver -> ask sent) is shown beside it.
- **load**: ``--inflight`` requests in flight at once (1,000 by default), requests/s and the
  latency percentiles.
- **soak**: ``--soak`` requests, every ``--abort-every``-th aborted by decode right after it
  asks, the prefill rank restarted halfway (the old process closes its manager and exits, a
  new one registers; decode reconnects by itself; requests in flight then fail). Afterwards
  both ranks count what leaked:
  pages and aux records not returned, requests still tracked, transport regions, threads
  and file descriptors (sockets included) beyond their counts before the soak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from kvtransfer._args import HelpFormatter, description
from kvtransfer._procs import Child, report_failure
from kvtransfer.control.state import KVPoll

REPLY_TIMEOUT_S = 300.0



# -- messages between the router (this process) and the ranks ---------------------------------
@dataclass(frozen=True)
class RankArgs:
    role: str
    bootstrap: str
    pages: int
    page_size: int
    heartbeat_timeout_s: float = 5.0  # ControlConfig's default: a loaded 2-core machine stalls loops for seconds


@dataclass(frozen=True)
class Issue:
    """Requests to run: ids, token counts, which decode aborts right after asking. With
    ``ack`` the rank answers :class:`Issued` once its handles are out (decode: asked)."""

    ids: tuple
    tokens: tuple
    abort: tuple  # bool per id
    ack: bool = False


@dataclass(frozen=True)
class Issued:
    pass


@dataclass(frozen=True)
class Drain:
    """Finish every issued request; reply :class:`Outcomes`."""


@dataclass(frozen=True)
class Outcomes:
    states: dict  # request id -> final state name
    times: dict  # request id -> {state name: monotonic time}


@dataclass(frozen=True)
class Census:
    """Reply :class:`Counts` (after :class:`Drain`)."""


@dataclass(frozen=True)
class Counts:
    free_pages: int
    aux_free: int
    requests: int
    regions: int
    threads: int
    fds: int


@dataclass(frozen=True)
class Ready:
    """Decode: reply :class:`ReadyRanks`, the prefill ranks connected now."""


@dataclass(frozen=True)
class ReadyRanks:
    ranks: tuple  # DecodeKVManager.ready_senders()


@dataclass(frozen=True)
class Stop:
    pass


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _RankWorker:
    """One rank: pool, transport, manager; runs issued requests with its own pages."""

    def __init__(self, args: RankArgs):
        import numpy as np
        import torch

        from kvtransfer.control.aux_records import pack_first_token
        from kvtransfer.control.config import ControlConfig
        from kvtransfer.layout import RankLayout
        from pools.mha import MHATokenToKVPool
        from transport.nixl import NixlTransport

        self.args, self.np, self.pack = args, np, pack_first_token
        self.pool = MHATokenToKVPool(size=args.pages * args.page_size, page_size=args.page_size, dtype=torch.bfloat16,
                                     head_num=2, head_dim=64, layer_num=2, device="cpu")
        layout = RankLayout.from_pools(self.pool, tp_rank=0, tp_size=1)
        self.transport = NixlTransport()
        config = ControlConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=args.heartbeat_timeout_s,
                               transfer_timeout_s=60.0, aux_slots=4096)
        infos = self.pool.get_contiguous_buf_infos()
        if args.role == "prefill":
            from kvtransfer.control.prefill import PrefillKVManager

            self.manager = PrefillKVManager(layout, self.transport, infos, bootstrap=args.bootstrap, config=config)
        else:
            from kvtransfer.control.decode import DecodeKVManager

            self.manager = DecodeKVManager(layout, self.transport, infos, bootstrap=args.bootstrap, config=config)
        self.free_pages = list(range(1, args.pages + 1))
        self.pages_of: dict = {}
        self.live: dict = {}  # request id -> handle
        self.done: dict = {}  # request id -> handle, ended
        self.baseline = None

    def counts(self) -> Counts:
        return Counts(free_pages=len(self.free_pages), aux_free=self.manager.aux_available if self.args.role == "decode" else 0,
                      requests=self.manager.num_requests, regions=len(self.transport.regions),
                      threads=threading.active_count(), fds=_fds())

    def issue(self, msg: Issue) -> None:
        ps = self.args.page_size
        for rid, n, abort in zip(msg.ids, msg.tokens, msg.abort):
            need = -(-n // ps)
            while len(self.free_pages) < need:  # wait for pages of ended requests
                self.reap(block=True)
            pages, self.free_pages = self.free_pages[:need], self.free_pages[need:]
            self.pages_of[rid] = pages
            slots = (self.np.array(pages)[:, None] * ps + self.np.arange(ps)).reshape(-1)[:n]
            if self.args.role == "prefill":
                sender = self.manager.sender(rid)
                sender.send(slots, last=True, aux=self.pack(n, -1.0))
                self.live[rid] = sender
            else:
                receiver = self.manager.receiver(rid)
                receiver.init(slots)
                if abort:
                    receiver.abort("aborted by the benchmark")
                self.live[rid] = receiver
        if msg.ack and self.args.role == "decode":  # until every ask is out
            while any(h.poll() < KVPoll.WaitingForInput and not h.poll().final for h in self.live.values()):
                time.sleep(0.0002)
        self.reap(block=False)

    def reap(self, block: bool) -> None:
        """Collect ended requests (decode: once their pages are safe to reuse)."""
        while True:
            for rid, handle in list(self.live.items()):
                if not handle.poll().final:
                    continue
                if self.args.role == "decode" and not handle.released:
                    continue
                if self.args.role == "decode":
                    handle.close()
                del self.live[rid]
                self.done[rid] = handle
                self.free_pages += self.pages_of.pop(rid)
                block = False
            if not block:
                return
            time.sleep(0.0005)

    def drain(self) -> Outcomes:
        """Wait until every issued request has ended and the manager has forgotten it."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while (self.live or self.manager.num_requests) and time.monotonic() < deadline:
            self.reap(block=False)
            time.sleep(0.001)
        if self.live or self.manager.num_requests:
            raise TimeoutError(f"{self.args.role}: {len(self.live)} requests still open, {self.manager.num_requests} "
                               f"tracked, after {REPLY_TIMEOUT_S} s")
        done, self.done = self.done, {}
        return Outcomes({rid: h.poll().name for rid, h in done.items()},
                        {rid: {s.name: t for s, t in h.status.times.items()} for rid, h in done.items()})

    def close(self) -> None:
        self.manager.close()
        self.transport.close()


def _rank_main(conn, args: RankArgs) -> None:
    worker = None
    try:
        worker = _RankWorker(args)
        conn.send(worker.counts())
        while True:
            msg = conn.recv()
            if isinstance(msg, Stop):
                break
            if isinstance(msg, Issue):
                worker.issue(msg)
                if msg.ack:
                    conn.send(Issued())
            elif isinstance(msg, Drain):
                conn.send(worker.drain())
            elif isinstance(msg, Census):
                conn.send(worker.counts())
            elif isinstance(msg, Ready):
                conn.send(ReadyRanks(tuple(worker.manager.ready_senders())))
    except Exception as exc:
        report_failure(conn, exc)
    finally:
        if worker is not None:
            worker.close()
        conn.close()


def _start(args: RankArgs) -> Child:
    return Child.spawn(_rank_main, (args,), name=f"{args.role} rank")


def _census(rank: Child) -> Counts:
    rank.send(Census())
    return rank.recv(Counts, "census", REPLY_TIMEOUT_S)


def _issue(ranks: dict, ids: list, tokens: list, aborts: list, batch: int) -> None:
    for i in range(0, len(ids), batch):
        msg = Issue(tuple(ids[i:i + batch]), tuple(tokens[i:i + batch]), tuple(aborts[i:i + batch]))
        for rank in ranks.values():
            rank.send(msg)


def _run(ranks: dict, ids: list, tokens: list, aborts: list, batch: int) -> dict:
    """Issue requests to both ranks in batches, then drain; ``{role: Outcomes}``."""
    _issue(ranks, ids, tokens, aborts, batch)
    for rank in ranks.values():
        rank.send(Drain())
    return {role: rank.recv(Outcomes, "outcomes", REPLY_TIMEOUT_S) for role, rank in ranks.items()}


def _pct(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _latencies(out: dict, ids: list) -> tuple:
    """Per successful request: prefill's sender (the chunk handed over) -> decode Success, prefill's
    write time, the overhead (ms)."""
    total, wire, overhead = [], [], []
    for rid in ids:
        d, p = out["decode"].times[rid], out["prefill"].times[rid]
        if "Success" not in d or "Success" not in p:
            continue
        t = (d["Success"] - p["Bootstrapping"]) * 1e3
        w = (p["Success"] - p["Transferring"]) * 1e3
        total.append(t)
        wire.append(w)
        overhead.append(t - w)
    return total, wire, overhead


def _steps(out: dict, ids: list) -> dict:
    """Where a request's time goes, step by step (ms): both sides' state times on one clock."""
    steps = {"  send -> plan and post": [], "  write done -> decode Success": [],
             "decode: receiver -> ask out": []}
    for rid in ids:
        d, p = out["decode"].times[rid], out["prefill"].times[rid]
        if "Success" not in d or "Success" not in p:
            continue
        steps["  send -> plan and post"].append((p["Transferring"] - p["Bootstrapping"]) * 1e3)
        steps["  write done -> decode Success"].append((d["Success"] - p["Success"]) * 1e3)
        steps["decode: receiver -> ask out"].append((d["WaitingForInput"] - d["Bootstrapping"]) * 1e3)
    return steps


def _line(name: str, values: list) -> str:
    return (f"  {name:<28} median {statistics.median(values):7.3f} ms   p99 {_pct(values, 0.99):7.3f} ms   "
            f"max {max(values):7.3f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransfer bench control", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--latency-requests", type=int, default=300, help="requests run one at a time")
    ap.add_argument("--inflight", type=int, default=1000, help="requests in flight in the load phase")
    ap.add_argument("--soak", type=int, default=10000, help="requests in the soak (0: no soak)")
    ap.add_argument("--abort-every", type=int, default=10, help="decode aborts every N-th soak request")
    ap.add_argument("--max-tokens", type=int, default=16, help="request lengths are 1 .. this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("latency_requests", "inflight", "max_tokens", "abort_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.soak < 0:
        ap.error(f"--soak must be >= 0, got {args.soak}")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import numpy as np

    from kvtransfer.control.bootstrap import BootstrapService

    rng = np.random.default_rng(args.seed)
    page_size = 4
    pages = 2 * args.inflight * -(-args.max_tokens // page_size) + 8
    with BootstrapService() as svc:
        ranks = {}
        try:
            ranks["prefill"] = _start(RankArgs("prefill", svc.address, pages, page_size))
            ranks["decode"] = _start(RankArgs("decode", svc.address, pages, page_size))
            for rank in ranks.values():
                rank.recv(Counts, "start-up", REPLY_TIMEOUT_S)
            return _phases(args, rng, ranks, svc.address, pages, page_size)
        finally:
            for role in ("decode", "prefill"):  # decode says goodbye while prefill still answers
                if role in ranks:
                    ranks[role].stop(Stop(), timeout=30)


def _phases(args, rng, ranks: dict, bootstrap: str, pages: int, page_size: int) -> int:
    print(f"kvtransfer bench control: 1 prefill rank -> 1 decode rank, MHA 2 layers x K,V, 2 x 64 bf16, "
          f"requests of 1..{args.max_tokens} tokens; NIXL over loopback; ZeroMQ control; {os.cpu_count()} CPUs")
    ok = True
    # latency: one at a time; decode asks first (it reserves pages as the request is routed),
    # then prefill's engine hands over the computed KV: what TTFT waits for is send -> Success
    ids = [f"lat-{i}" for i in range(args.latency_requests)]
    tokens = rng.integers(1, args.max_tokens + 1, len(ids)).tolist()
    outs = {"decode": Outcomes({}, {}), "prefill": Outcomes({}, {})}
    for i, rid in enumerate(ids):
        ranks["decode"].send(Issue((rid,), (tokens[i],), (False,), ack=True))
        ranks["decode"].recv(Issued, "ack", REPLY_TIMEOUT_S)
        time.sleep(0.002)  # the ask reaches prefill and waits there
        ranks["prefill"].send(Issue((rid,), (tokens[i],), (False,)))
        for role, rank in ranks.items():
            rank.send(Drain())
            got = rank.recv(Outcomes, "outcomes", REPLY_TIMEOUT_S)
            outs[role].states.update(got.states)
            outs[role].times.update(got.times)
    total, wire, overhead = _latencies(outs, ids)
    print(f"latency, {len(total)} of {len(ids)} requests one at a time (decode asked first):")
    print(_line("prefill send -> decode Success", total))
    print(_line("prefill writes (the bytes)", wire))
    print(_line("control overhead", overhead))
    for name, values in _steps(outs, ids).items():
        print(_line(name, values))
    goal = statistics.median(overhead) < 1.0
    print(f"  control overhead median {statistics.median(overhead):.3f} ms: "
          f"{'meets' if goal else 'misses'} the goal of < 1 ms")
    ok &= len(total) == len(ids)
    # load: --inflight requests at once
    ids = [f"load-{i}" for i in range(args.inflight)]
    tokens = rng.integers(1, args.max_tokens + 1, len(ids)).tolist()
    t0 = time.monotonic()
    out = _run(ranks, ids, tokens, [False] * len(ids), 250)
    wall = time.monotonic() - t0
    total = [(out["decode"].times[r]["Success"] - out["decode"].times[r]["Bootstrapping"]) * 1e3
             for r in ids if out["decode"].states[r] == "Success"]
    print(f"load, {args.inflight} requests in flight: {len(total)} succeeded in {wall:.2f} s = "
          f"{len(total) / wall:,.0f} requests/s")
    print(_line("decode receiver -> Success", total))
    ok &= len(total) == len(ids)
    if args.soak:
        ok &= _soak(args, rng, ranks, bootstrap, pages, page_size)
    return 0 if ok else 1


def _soak(args, rng, ranks: dict, bootstrap: str, pages: int, page_size: int) -> bool:
    before = {role: _census(rank) for role, rank in ranks.items()}
    ids = [f"soak-{i}" for i in range(args.soak)]
    tokens = rng.integers(1, args.max_tokens + 1, len(ids)).tolist()
    aborts = [i % args.abort_every == args.abort_every - 1 for i in range(len(ids))]
    half = len(ids) // 2
    t0 = time.monotonic()
    _issue(ranks, ids[:half], tokens[:half], aborts[:half], 64)
    time.sleep(0.05)
    # the restart, with requests in flight: the old process closes its manager (failing what
    # it still holds) and exits; a new one registers; decode reconnects by itself
    t_restart = time.monotonic()
    ranks["prefill"].stop(Stop(), timeout=30)
    ranks["prefill"] = _start(RankArgs("prefill", bootstrap, pages, page_size))
    ranks["prefill"].recv(Counts, "start-up", REPLY_TIMEOUT_S)
    ranks["decode"].send(Drain())
    first = {"decode": ranks["decode"].recv(Outcomes, "outcomes", REPLY_TIMEOUT_S)}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # decode finds the new process by itself
        ranks["decode"].send(Ready())
        if ranks["decode"].recv(ReadyRanks, "ready ranks", REPLY_TIMEOUT_S).ranks == (0,):
            break
        time.sleep(0.05)
    reconnect = time.monotonic() - t_restart
    prefill_before = _census(ranks["prefill"])  # the new process, once connected to decode
    second = _run(ranks, ids[half:], tokens[half:], aborts[half:], 64)
    wall = time.monotonic() - t0
    after = {role: _census(rank) for role, rank in ranks.items()}
    decode_states = {**first["decode"].states, **second["decode"].states}
    ok_count = sum(s == "Success" for s in decode_states.values())
    failed = [rid for rid, s in decode_states.items() if s == "Failed"]
    expected_failed = sum(aborts)
    print(f"soak, {len(ids):,} requests ({expected_failed:,} aborted by decode), prefill restarted after "
          f"{half:,}: {ok_count:,} succeeded, {len(failed):,} failed, in {wall:.1f} s; decode was connected to "
          f"the new process {reconnect:.1f} s after the old one began to close")
    leaks = {}
    for role, b in (("decode", before["decode"]), ("prefill", prefill_before)):
        a = after[role]
        leaks[role] = {"pages": b.free_pages - a.free_pages, "aux records": b.aux_free - a.aux_free,
                       "requests": a.requests - b.requests, "regions": a.regions - b.regions,
                       "threads": a.threads - b.threads, "fds": a.fds - b.fds}
        print(f"  {role} leaks after the soak: " + ", ".join(f"{k} {v}" for k, v in leaks[role].items()))
    clean = all(v == 0 for counts in leaks.values() for v in counts.values())
    print(f"  leaked slots, registrations, threads, sockets and fds: {'all zero' if clean else 'NOT ZERO'}")
    unexpected = len(failed) - expected_failed
    print(f"  failures beyond the aborts: {unexpected} (requests in flight at the restart)")
    return clean


if __name__ == "__main__":
    sys.exit(main())
