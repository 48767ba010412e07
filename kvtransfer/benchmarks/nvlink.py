"""``kvtransfer bench nvlink``: the NVLink backend against torch's peer copy, two processes.

Default: a Llama-3-70B-shaped request: 80 layers, K and V (160 per-layer buffers), 8 KV heads
x 128 dims bf16 (2 KiB per token row), 16,384 tokens at random pages of a pool twice that
size, written by this process (GPU 0) into a receiver process's pool (GPU 1). Cases:

    page 1 / 16 / 64   whole pages as rows (2 KiB / 32 KiB / 128 KiB), all 160 buffers
    head slice         one 256 B head of each token (decode TP 8: the receiver's pool holds
                       one KV head), page size 1, all 160 buffers

For each case, in the same run: ``kernel`` = the copy kernel alone on a resident row table
(CUDA events, median; its launch's host time not timed), ``staged`` = the staged engine's pipeline alone (gather, copy engine,
scatter; one prepared write, :meth:`NvlinkPeer.prepare`, posted again and again with its
tables resident on both GPUs; CUDA events, median), ``write()`` = ``peer.write(batch).wait()``
wall time including the bounds check, the row-table gather and its host-to-device copy
(median), ``write_strided()`` = the same rows as buffer pairs x slots (``StridedBatch``;
O(pairs + slots) host work, the addresses computed on the GPU), wall time, median, once with
the direct kernel and once with the staged engine (a prepared write with that
``NvlinkEngine``, :mod:`transport.nvlink.staged`), and torch's peer copy of the same byte
count between two contiguous tensors on GPU 0 and GPU 1 of this process (CUDA events,
median). The first write of each case is verified: the receiver waits for its notification
(from this transport), then both sides checksum the rows (position-weighted); so is the first
``write_strided()`` with each engine (``verified``: write/kernel/staged). ``write_strided()``
with either engine takes the direct path (``transport.nvlink.direct``) where the transport
has one (the staged engine's since its pairs went resident too), else a prepared write.

Fixed cost per write (second table): ``write_strided()`` (kernel engine) call to the
notification seen by the receiver process, which polls without sleeping and stamps arrivals on
the host's monotonic clock (``RemoteBuffers.start_stamp_notify``), median; minus the strided
kernel's own time for the same batch (CUDA events, resident table, the GPU kept busy while it
is launched so that the launch's host time is not counted as the kernel's: it is part of the
fixed cost). ``ns/slot``: what a case's fixed cost adds to that of a one-row write (1 pair x
1 slot), per slot. ``behind us``: the same write called while the caller's current stream still
has ~1 ms of GPU work queued, which the copy waits for (as a prefill model's layer would be when
layer-wise streaming posts that layer's write): from the end of that work (on the host clock: a
timing event recorded on an idle stream once the call returned, plus the GPU time from it to
the work's end) to the notification seen, minus the kernel. The call's host time
is then hidden; what is left is the copy's start after the wait and the notification's path.
Layer-wise streaming (third table): ``--layers`` layers of a bf16 matmul of ``--layer-us`` each on
the writer's GPU (it takes the SMs, as a layer's compute does), each followed by a
``write_strided()`` of that layer's buffers (the pairs cut into ``--layers`` consecutive groups,
every slot, the last write notifying), against the same layers followed by one write of the
whole request: from the last layer's end to the notification seen (``tail``), the layers' GPU
time with and without the copies beside them (``stretch``), the caller's time per write call,
and the pair plans built and slot-ring waits while streaming (what a request's many pair sets
and in-flight writes cost the direct path).
The one-row write's fixed cost is also measured through NIXL when it is importable (one
descriptor, the receiver progressing NIXL as it polls).
With ``transport.nixl`` importable, page size 1 also runs through NIXL (one descriptor per
page) on a slice of the batch.

Figures: bench/RESULTS.md (``kvtransfer bench nvlink --record`` rewrites its record).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass

import numpy as np

from kvtransfer._args import HelpFormatter, description
from kvtransfer.benchmarks._report import time_cuda
from transport.base import StridedBatch
from kvtransfer.benchmarks._remote import RemoteBuffers, checksums, make_transport

BACKENDS = ("nvlink", "nixl")
BEHIND_CYCLES = 2_000_000  # GPU clock cycles queued before a write posted behind compute (~1 ms on an H200)


# -- the benchmark -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    src_region: np.ndarray  # [n]
    src_offset: np.ndarray  # [n]
    dst_region: np.ndarray  # [n]
    dst_offset: np.ndarray  # [n]
    length: np.ndarray  # [n]
    strided: tuple = ()  # the same rows as StridedBatch.of arguments: 7 pair arrays [P], 2 slot arrays [S]

    def batch(self, rows: slice = slice(None)):
        from transport.base import WriteBatch

        return WriteBatch.of(
            self.src_region[rows], self.src_offset[rows], self.dst_region[rows], self.dst_offset[rows], self.length[rows]
        )

    def strided_batch(self):
        """The rows as buffer pairs x slots; raises unless it expands to exactly :meth:`batch`."""
        from transport.base import StridedBatch

        sb = StridedBatch.of(*self.strided)
        flat, want = sb.expand(), self.batch()
        for name in ("src_region", "src_offset", "dst_region", "dst_offset", "length"):
            if not np.array_equal(getattr(flat, name), getattr(want, name)):
                raise RuntimeError(f"{self.name}: the strided form's {name} differs from the flat rows")
        return sb


def build_cases(args, src_rids, dst_rids, head_rids, rng) -> list[Case]:
    """Rows of the request for each page size, then the head-slice rows."""
    token_bytes = args.heads * args.head_dim * 2  # bf16
    num_bufs = len(src_rids)
    cases = []
    for page in args.page_sizes:
        num_pages, req_pages = args.pool_tokens // page, args.tokens // page
        src_pages = rng.choice(np.arange(1, num_pages), req_pages, replace=False)  # page 0: padding
        dst_pages = rng.choice(np.arange(1, num_pages), req_pages, replace=False)
        row = page * token_bytes
        cases.append(Case(
            f"page {page}",
            np.repeat(np.asarray(src_rids), req_pages), np.tile(src_pages * row, num_bufs),
            np.repeat(np.asarray(dst_rids), req_pages), np.tile(dst_pages * row, num_bufs),
            np.full(num_bufs * req_pages, row, dtype=np.int64),
            (np.asarray(src_rids), 0, row, np.asarray(dst_rids), 0, row, row, src_pages, dst_pages),
        ))
    head_bytes = args.head_dim * 2
    src_slots = rng.choice(np.arange(1, args.pool_tokens), args.tokens, replace=False)
    dst_slots = rng.choice(np.arange(1, args.pool_tokens), args.tokens, replace=False)
    head = 0  # decode TP 8, rank 0 holds KV head 0
    cases.append(Case(
        "head slice",
        np.repeat(np.asarray(src_rids), args.tokens), np.tile(src_slots * token_bytes + head * head_bytes, num_bufs),
        np.repeat(np.asarray(head_rids), args.tokens), np.tile(dst_slots * head_bytes, num_bufs),
        np.full(num_bufs * args.tokens, head_bytes, dtype=np.int64),
        (np.asarray(src_rids), head * head_bytes, token_bytes, np.asarray(head_rids), 0, head_bytes, head_bytes,
         src_slots, dst_slots),
    ))
    return cases


BUSY_CYCLES = 1_000_000  # ~0.5 ms of GPU clock queued before a timed launch: its host time is not timed


def _median_ms_events(fn, reps: int, warmup: int, one_launch: bool = False) -> float:
    """Median milliseconds of the GPU work ``fn`` enqueues (CUDA events). ``one_launch``: ``fn``
    is one kernel launch, timed with the GPU kept busy while it enqueues (the kernel alone,
    not the host time of its launch, which a one-row write would otherwise be mostly)."""
    return time_cuda(fn, reps, warmup, busy_cycles=BUSY_CYCLES if one_launch else 0).median * 1e3


def _has_direct(peer, engine) -> bool:
    """The peer takes ``write_strided(..., engine=)`` and its direct path with ``engine`` (issue
    18's code: the kernel's first, then the staged engine's, with its resident staged pairs)."""
    return hasattr(peer, "pair_plans") and (engine.value == "kernel" or hasattr(peer, "staged_plans"))


def _strided_write(peer, batch, engine, notify=None):
    """``write_strided`` with ``engine``: the direct path where the peer has one for that
    engine; else a prepared write with that engine, posted once and released (the same host
    work as ``write_strided`` before the direct path)."""
    if engine is not None and _has_direct(peer, engine):
        return peer.write_strided(batch, notify, engine=engine)
    with peer.prepare(batch, engine=engine) as job:
        return job.post(notify)


def _write_times(peer, batch, reps: int, engine=None) -> tuple[float, float]:
    """Median seconds for a write to return (host-side preparation) and to complete: with
    ``engine`` None, ``peer.write`` (``write_strided`` for a StridedBatch) as a caller runs it;
    else :func:`_strided_write` with that engine."""
    prep, total = [], []

    def write(b):
        if engine is None:
            return (peer.write_strided if isinstance(b, StridedBatch) else peer.write)(b)
        return _strided_write(peer, b, engine)

    for _ in range(reps):
        t0 = time.perf_counter()
        tr = write(batch)
        t1 = time.perf_counter()
        tr.wait(timeout=120)
        total.append(time.perf_counter() - t0)
        prep.append(t1 - t0)
    return statistics.median(prep), statistics.median(total)


def _sweep_configs(kern, sweep: bool, num_sms: int, programs: list, max_programs: int = 0) -> list:
    """The kernel configurations timed alone: the transport's first (``--max-programs``), then
    the ``--programs`` and ``--sweep`` variants."""
    configs = [kern.KernelConfig(max_programs=max_programs)] + [kern.KernelConfig(max_programs=p) for p in programs]
    if sweep:
        configs += [
            kern.KernelConfig(tile_bytes=4096),
            kern.KernelConfig(tile_bytes=16384, num_warps=8),
            kern.KernelConfig(load_cache=".cg", store_cache=".cs"),
            kern.KernelConfig(max_programs=8 * num_sms),
            kern.KernelConfig(max_programs=4 * num_sms, tile_bytes=16384, num_warps=8),
        ]
    return configs


def _config_name(cfg) -> str:
    extra = (f" p{cfg.max_programs}" if cfg.max_programs else "") + (f" {cfg.load_cache}{cfg.store_cache}" if cfg.load_cache or cfg.store_cache else "")
    return f"t{cfg.tile_bytes // 1024}K w{cfg.num_warps}{extra}"


class _Bench:
    """The two processes, the pools, the cases and the measurements of one run."""

    def __init__(self, args):
        import torch

        from transport.nvlink import NvlinkEngine
        from transport.nvlink import kernel as kern

        self.args, self.torch, self.kern, self.engines = args, torch, kern, NvlinkEngine
        self.not_hidden = 0  # writes posted behind compute whose call outlasted it (landed_s)
        self._clock_stream = None  # an idle stream for landed_s's timing marks
        nixl_ok = _nixl_importable()
        self.backends = ("nvlink", "nixl") if nixl_ok else ("nvlink",)
        self.src_dev = torch.device("cuda", args.src_device)
        self.dst_dev = torch.device("cuda", args.dst_device)
        torch.cuda.set_device(self.src_dev)
        self.remote = RemoteBuffers(args.dst_device, self.backends)
        # (only when asked: older trees' make_transport takes no NvlinkConfig fields)
        nvlink = {"kernel": kern.KernelConfig(max_programs=args.max_programs)} if args.max_programs else {}
        self.transports = {b: make_transport(b, native=args.host_steps == "c", **(nvlink if b == "nvlink" else {}))
                           for b in self.backends}

    def setup(self) -> None:
        args, torch = self.args, self.torch
        token_bytes = args.heads * args.head_dim * 2
        num_bufs = 2 * args.layers
        dst_rids = self.remote.alloc([args.pool_tokens * token_bytes] * num_bufs, 0x5A)
        head_rids = self.remote.alloc([args.pool_tokens * args.head_dim * 2] * num_bufs, 0x5A)
        self.src = {}
        for _ in range(num_bufs):
            t = torch.empty(args.pool_tokens * token_bytes // 4, dtype=torch.int32, device=self.src_dev)
            t.random_(-(2**31), 2**31 - 1)
            t = t.view(torch.uint8)  # [pool_tokens * token_bytes] bytes
            ids = {tr.register_tensor(t) for tr in self.transports.values()}
            self.src[ids.pop()] = t
        self.exports = self.remote.export()
        self.peers = {b: self.transports[b].connect(self.exports[b]) for b in self.backends}
        self.cases = build_cases(args, sorted(self.src), dst_rids, head_rids, np.random.default_rng(0))
        max_bytes = max(int(c.length.sum()) for c in self.cases)
        self.pc_src = torch.empty(max_bytes, dtype=torch.uint8, device=self.src_dev).random_(0, 255)
        self.pc_dst = torch.empty(max_bytes, dtype=torch.uint8, device=self.dst_dev)
        num_sms = torch.cuda.get_device_properties(self.src_dev).multi_processor_count
        self.configs = _sweep_configs(self.kern, args.sweep, num_sms, args.programs, args.max_programs)

    def verify(self, case: Case, engine=None) -> bool:
        """One write with a notification: ``peer.write`` (engine None), else the strided form
        prepared with ``engine``; the receiver checks its rows once the notification came from
        this transport."""
        peer = self.peers["nvlink"]
        self.remote.fill(sorted(set(case.dst_region.tolist())), 0x5A)
        tag = f"verify {case.name} {'flat' if engine is None else 'strided ' + engine.value}".encode()
        if engine is None:
            peer.write(case.batch(), notify=tag).wait(timeout=120)
        else:
            _strided_write(peer, case.strided_batch(), engine, tag).wait(timeout=120)
        sender = self.remote.wait_notify(tag, 60.0)
        if sender != self.transports["nvlink"].name:
            raise RuntimeError(f"{case.name}: notification from {sender!r}, expected {self.transports['nvlink'].name!r}")
        want = checksums(self.src, case.src_region, case.src_offset, case.length)
        return want == self.remote.checksum(case.dst_region, case.dst_offset, case.length)

    def kernel_ms(self, rows_dev, case: Case, cfg, device) -> float:
        kern, args = self.kern, self.args
        path = kern.choose_path(rows_dev.cpu().numpy())
        plan = kern.plan_launch(rows_dev.shape[1], int(case.length.max()), path, cfg)
        with self.torch.cuda.device(device):
            return _median_ms_events(lambda: kern.scatter_rows(rows_dev, plan, device, cfg.num_warps), args.reps, args.warmup,
                                     one_launch=True)

    def strided_kernel_ms(self, sb) -> tuple[float, float]:
        """The strided kernel alone on a resident table (CUDA events, median), and the host
        time of its bounds check and table build (median of ``reps``)."""
        peer, kern, args = self.peers["nvlink"], self.kern, self.args
        host = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            sb.check_bounds(self.transports["nvlink"].regions, peer.regions)
            table = peer.tables.strided_table(sb, checked=True)
            host.append(time.perf_counter() - t0)
        plan = peer.tables.strided_plan(sb, table)
        table_dev = self.torch.from_numpy(table).to(self.src_dev)
        cfg = self.configs[0]
        with self.torch.cuda.device(self.src_dev):
            ms = _median_ms_events(lambda: kern.scatter_strided(table_dev, sb.num_pairs, sb.num_slots, plan, self.src_dev,
                                                                cfg.num_warps), args.reps, args.warmup, one_launch=True)
        return ms, statistics.median(host)

    def staged_ms(self, sb) -> float:
        """The staged engine's pipeline alone (gather, copy engine, scatter) on resident tables:
        one prepared write posted again and again, the current stream waiting on each post's
        completion event; CUDA events, median; NaN when the engine cannot run here."""
        peer, torch = self.peers["nvlink"], self.torch
        with peer.prepare(sb, engine=self.engines.STAGED) as job:
            if job.engine is not self.engines.STAGED:
                return float("nan")
            job.post().wait(timeout=120)  # uploads the tables: later posts find them resident
            with torch.cuda.device(self.src_dev):
                return _median_ms_events(lambda: torch.cuda.current_stream().wait_event(job.post().event),
                                         self.args.reps, self.args.warmup)

    def landed_s(self, write, reps: int, warmup: int = 2, backend: str = "nvlink", behind: bool = False) -> list[float]:
        """Seconds from each ``write(tag)`` call to its notification seen by the receiver, which
        polls ``backend``'s transport without sleeping and stamps arrivals on the host's
        monotonic clock; the writes one after the other (each waited for), the first ``warmup``
        left out.

        ``behind``: each write is called while the caller's current stream still has
        :data:`BEHIND_CYCLES` of GPU work queued (which the copy waits for), as a model's layer
        would be, and the seconds count from the end of that work, so that the call's host time
        is hidden (writes whose call returned after that work ended are counted in
        :attr:`not_hidden`). That end on the host clock: once the call returned, a timing event
        is recorded on an idle stream of the busy GPU (it passes as it is recorded, within a few
        microseconds) and the host time of that record plus the GPU time from it to an event
        recorded after the work."""
        late = 0

        def one(tag: bytes) -> float:
            nonlocal late
            if not behind:
                t0 = time.monotonic()
                write(tag).wait(timeout=120)
                return t0
            torch = self.torch
            with torch.cuda.device(self.src_dev):
                done = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(BEHIND_CYCLES)
                done.record()
                transfer = write(tag)
                late += bool(done.query())
                return self._host_time_of(done, lambda: transfer.wait(timeout=120))

        arrivals = self._stamped("landed", warmup + reps, one, backend)
        self.not_hidden += late
        return arrivals[warmup:]

    def _stamped(self, label: str, count: int, run, backend: str = "nvlink") -> list[float]:
        """``run(tag)`` for ``count`` fresh tags, one after the other, while the receiver stamps
        the notifications carrying them (polling ``backend``'s transport without sleeping, on
        the host's monotonic clock); ``run`` returns the host time to count each arrival from.
        Returns the seconds from that time to the arrival, per tag; ``RuntimeError`` when a
        notification did not come."""
        self._stamps = getattr(self, "_stamps", 0) + 1
        tags = [f"{label} {self._stamps} {i}".encode() for i in range(count)]
        starts, arrivals = self.remote.stamped(tags, lambda: [run(tag) for tag in tags], (backend,))
        return [arrivals[t] - t0 for t, t0 in zip(tags, starts)]

    def _host_time_of(self, event, wait) -> float:
        """The host's monotonic time at which ``event`` (recorded on the writer's GPU, still to
        pass) passes: a timing event recorded on an idle stream now passes within microseconds,
        and the GPU time from it to ``event`` is added; ``wait()`` runs in between (whatever
        must finish before ``event`` is read)."""
        torch = self.torch
        if self._clock_stream is None:
            self._clock_stream = torch.cuda.Stream(self.src_dev)
        mark = torch.cuda.Event(enable_timing=True)
        t_mark = time.monotonic()
        mark.record(self._clock_stream)
        wait()
        event.synchronize()
        return t_mark + mark.elapsed_time(event) / 1e3

    def tiny_fixed(self) -> dict:
        """Fixed cost of a write of one 2 KiB row (1 pair x 1 slot) per backend, microseconds:
        call to notification seen by the receiver, minus (nvlink) the kernel's own time."""
        args, out = self.args, {}
        token_bytes = args.heads * args.head_dim * 2
        case = self.cases[0]
        src_rid, dst_rid = int(case.src_region[0]), int(case.dst_region[0])
        sb = StridedBatch.of(src_rid, 0, token_bytes, dst_rid, 0, token_bytes, token_bytes, [1], [1])
        kernel_ms, _ = self.strided_kernel_ms(sb)
        peer = self.peers["nvlink"]
        engine = self.engines.KERNEL
        write = functools.partial(_strided_write, peer, sb, engine)  # write(tag)
        landed = self.landed_s(write, self.args.fixed_reps)
        behind = self.landed_s(write, self.args.fixed_reps, behind=True)
        out["nvlink"] = (statistics.median(landed) * 1e6 - kernel_ms * 1e3, kernel_ms * 1e3,
                         statistics.median(behind) * 1e6 - kernel_ms * 1e3)
        if "nixl" in self.peers:
            from transport.base import WriteBatch

            wb = WriteBatch.of([src_rid], [token_bytes], [dst_rid], [token_bytes], [token_bytes])
            try:
                landed = self.landed_s(lambda tag: self.peers["nixl"].write(wb, notify=tag), self.args.fixed_reps,
                                       backend="nixl")
                out["nixl"] = (statistics.median(landed) * 1e6, 0.0)
            except Exception as exc:  # NIXL's figure must not cost the table
                out["nixl"] = f"failed: {type(exc).__name__}: {exc}"
        return out

    def layer_compute(self):
        """``(fn, us)``: a square bf16 matmul on the writer's GPU sized to take about
        ``--layer-us`` (a model layer's compute: it takes the SMs, as a layer does, and the
        kernel engine's copies share them), and its measured time."""
        torch, args = self.torch, self.args

        def matmul(n: int):
            a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=self.src_dev) for _ in range(2))
            out = torch.empty_like(a)
            return lambda: torch.mm(a, b, out=out)

        with torch.cuda.device(self.src_dev):
            probe = 2048
            rate = 2 * probe**3 / time_cuda(matmul(probe), 5, 2).median  # FLOP/s at the probe's size
            n = int(min(16384, max(128, round((args.layer_us * 1e-6 * rate / 2) ** (1 / 3) / 128) * 128)))
            fn = matmul(n)
            return fn, time_cuda(fn, 5, 2).median * 1e6

    def layerwise(self, case: Case, compute) -> dict:
        """Layer-wise streaming of ``case``'s request, against writing it whole. Each round runs
        ``--layers`` layers of ``compute`` on the caller's stream; streamed, each layer is
        followed by a ``write_strided`` (kernel engine) of that layer's buffers (the case's
        pairs cut into ``--layers`` consecutive groups, every slot; the last layer's write
        carries the notification), which waits for that layer's compute and runs beside the
        next; whole, one write of every pair follows the last layer. Per mode, medians over
        ``--layerwise-reps`` rounds (after ``--warmup``): ``tail`` = from the last layer's
        compute end to the notification seen by the receiver; ``compute`` = the layers' GPU
        time, first layer's start to last layer's end (streamed: stretched by the copies
        sharing the GPU); ``call`` = a streamed ``write_strided`` call on the caller's thread.
        ``builds`` / ``ring waits``: pair plans built and slot-ring waits during the timed
        streamed rounds (direct path only)."""
        torch, args, peer = self.torch, self.args, self.peers["nvlink"]
        sb = case.strided_batch()
        fields = ("src_region", "src_offset", "src_stride", "dst_region", "dst_offset", "dst_stride", "length")
        # (the fields by name, not StridedBatch.pairs: a transport without the direct path, as
        # bench/before_after_nvlink.sh runs one, has no such property)
        layers = [StridedBatch(*(getattr(sb, f)[g] for f in fields), sb.src_slot, sb.dst_slot)
                  for g in np.array_split(np.arange(sb.num_pairs), args.layers) if g.size]
        engine, warmup = self.engines.KERNEL, args.warmup
        ring = getattr(self.transports["nvlink"], "_slot_ring", lambda: None)()
        out = {"layer_bytes": layers[-1].nbytes, "layers": len(layers)}
        for mode in ("whole", "streamed"):
            compute_s, calls, counters = [], [], []

            def run(tag: bytes) -> float:
                with torch.cuda.device(self.src_dev):
                    if mode == "streamed" and len(compute_s) == warmup:  # the first timed round starts
                        counters.append((getattr(peer, "pair_plans", None) and peer.pair_plans.builds,
                                         None if ring is None else ring.space.waits))
                    start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    posted = []
                    for i, layer in enumerate(layers):
                        compute()
                        if i == len(layers) - 1:
                            done.record()  # the last layer's end, before its write's call
                        if mode == "streamed":
                            t0 = time.perf_counter()
                            posted.append(_strided_write(peer, layer, engine, tag if i == len(layers) - 1 else None))
                            calls.append(time.perf_counter() - t0)
                    if mode == "whole":
                        posted.append(_strided_write(peer, sb, engine, tag))
                    end = self._host_time_of(done, lambda: [t.wait(timeout=120) for t in posted])
                    compute_s.append(start.elapsed_time(done) / 1e3)
                    return end

            tails = self._stamped(f"layerwise {mode}", warmup + args.layerwise_reps, run)[warmup:]
            out[mode] = dict(tail_s=statistics.median(tails), compute_s=statistics.median(compute_s[warmup:]))
            if mode == "streamed":
                builds0, waits0 = counters[0]
                out[mode].update(call_s=statistics.median(calls[warmup * len(layers):]),
                                 builds=None if builds0 is None else peer.pair_plans.builds - builds0,
                                 ring_waits=None if waits0 is None else ring.space.waits - waits0)
        return out

    def copy_ms(self, nbytes: int) -> float:
        a, b = self.pc_src[:nbytes], self.pc_dst[:nbytes]
        return _median_ms_events(lambda: b.copy_(a, non_blocking=True), self.args.reps, self.args.warmup)

    def measure(self) -> list[dict]:
        out = []
        peer = self.peers["nvlink"]
        for case in self.cases:
            batch = case.batch()
            verified = self.verify(case)
            rows_dev = self.torch.from_numpy(peer.tables.row_table(batch)).to(self.src_dev)
            kernel = {cfg: self.kernel_ms(rows_dev, case, cfg, self.src_dev) for cfg in self.configs}
            reps = max(3, self.args.reps // 2)
            prep_s, write_s = _write_times(peer, batch, reps)
            strided = case.strided_batch()
            engines = {}  # engine -> (verified, prep s, total s) of write_strided()
            for engine in (self.engines.KERNEL, self.engines.STAGED):
                ok = self.verify(case, engine=engine)
                engines[engine.value] = (ok, *_write_times(peer, strided, reps, engine=engine))
            skernel_ms, shost_s = self.strided_kernel_ms(strided)
            staged_ms = self.staged_ms(strided)
            kernel_engine = self.engines.KERNEL
            write = functools.partial(_strided_write, peer, strided, kernel_engine)  # write(tag)
            landed = self.landed_s(write, self.args.fixed_reps)
            behind = self.landed_s(write, self.args.fixed_reps, behind=True)
            checks = [verified] + [v[0] for v in engines.values()]
            out.append(dict(case=case, nbytes=batch.nbytes, verified=all(checks),
                            checks="/".join("ok" if c else "BAD" for c in checks), kernel=kernel, prep_s=prep_s,
                            write_s=write_s, engines=engines, strided_kernel_ms=skernel_ms, strided_host_s=shost_s,
                            staged_ms=staged_ms, landed_s=statistics.median(landed), behind_s=statistics.median(behind),
                            strided_shape=(strided.num_pairs, strided.num_slots),
                            copy_ms=self.copy_ms(batch.nbytes), rows_dev=rows_dev))
        return out

    def together(self, res: dict) -> str:
        """The kernel and a copy-engine peer copy of as many bytes, at once, on two streams."""
        torch, kern = self.torch, self.kern
        case, nbytes, rows_dev = res["case"], res["nbytes"], res["rows_dev"]
        cfg = self.configs[0]
        plan = kern.plan_launch(rows_dev.shape[1], int(case.length.max()), kern.choose_path(rows_dev.cpu().numpy()), cfg)
        sa, sb = torch.cuda.Stream(self.src_dev), torch.cuda.Stream(self.src_dev)
        a, b = self.pc_src[:nbytes], self.pc_dst[:nbytes]

        def both():
            cur = torch.cuda.current_stream()
            go = torch.cuda.Event()
            go.record(cur)
            for s, fn in ((sa, lambda: kern.scatter_rows(rows_dev, plan, self.src_dev, cfg.num_warps)),
                          (sb, lambda: b.copy_(a, non_blocking=True))):
                s.wait_event(go)
                with torch.cuda.stream(s):
                    fn()
                cur.wait_stream(s)

        ms = _median_ms_events(both, self.args.reps, self.args.warmup)
        return (f"SM kernel + copy engine at once ({case.name}): {2 * nbytes / ms / 1e6:.1f} GB/s together "
                f"({2 * nbytes / 2**30:.1f} GiB in {ms:.1f} ms)")

    def pull(self, res: dict) -> str:
        """The same kernel launched on the DESTINATION GPU (reads cross NVLink, stores are local)."""
        torch = self.torch
        from transport.nvlink import ipc as cuda_ipc, parse_descriptor

        from cuda.bindings import runtime as rt

        dst = self.args.dst_device
        with torch.cuda.device(dst):
            rt.cudaSetDevice(dst)
            rt.cudaDeviceEnablePeerAccess(self.args.src_device, 0)  # "already enabled" is fine
            rt.cudaGetLastError()
        api = cuda_ipc.load_api()
        _, regions, ipc = parse_descriptor(self.exports["nvlink"])
        base = np.zeros(max(regions) + 1, dtype=np.int64)
        opened = []
        try:
            for rid, (handle, offset, _) in ipc.items():
                base[rid] = cuda_ipc.open_handle(api, handle, dst) + offset
                opened.append(handle)
            case = res["case"]
            rows = res["rows_dev"].cpu().numpy().copy()
            rows[1] = base[case.dst_region] + case.dst_offset
            rows_dev = torch.from_numpy(rows).to(self.dst_dev)
            ms = self.kernel_ms(rows_dev, case, self.configs[0], self.dst_dev)
        finally:
            for handle in opened:
                cuda_ipc.close_handle(api, handle, dst)
        return f"pull kernel on cuda:{dst} ({case.name}): {res['nbytes'] / ms / 1e6:.1f} GB/s (push: see table)"

    def close(self) -> None:
        for tr in self.transports.values():
            tr.close()
        self.remote.close()


def _host_steps(transport) -> str:
    """Where the direct path's host steps ran: "C", or "Python" and why."""
    why = getattr(transport, "native_unavailable", "an older transport, before the C steps")
    return "C" if why is None else f"Python ({why})"


def _rate_cells(rate: float, copy: float, width: int = 7) -> str:
    """A GB/s column ``width`` wide and its ratio to the peer copy; ``n/a`` where the path did
    not run (NaN: the staged engine was off for the peer)."""
    return f"{rate:>{width}.1f} {rate / copy:>6.1%}" if rate == rate else f"{'n/a':>{width}} {'':>6}"


def _print_table(bench: _Bench, results: list[dict]) -> None:
    args, torch = bench.args, bench.torch
    gbs = lambda nbytes, sec: nbytes / sec / 1e9  # noqa: E731
    print(f"\nnvlink bench: {args.layers} layers x K,V, {args.heads} heads x {args.head_dim} bf16, "
          f"{args.tokens} tokens, cuda:{args.src_device} -> cuda:{args.dst_device} (two processes), "
          f"{torch.cuda.get_device_name(bench.src_dev)}"
          + (f"; the copy kernel at most {args.max_programs} programs (--max-programs)" if args.max_programs else ""))
    if len(bench.configs) > 1:
        print("kernel sweep, GB/s:  " + " | ".join(_config_name(c) for c in bench.configs))
        for r in results:
            print(f"  {r['case'].name:<11}", "  ".join(f"{gbs(r['nbytes'], r['kernel'][c] / 1e3):8.1f}" for c in bench.configs))
    print("GB/s, each beside torch's peer copy of the same bytes in the same run; kernel = the direct push kernel "
          "alone, staged = the staged engine's pipeline alone (CUDA events, tables resident); write() = engine auto, "
          "end to end; write_strided() end to end with each engine")
    head = (f"{'case':<11} {'rows':>8} {'row B':>6} {'MiB':>5} {'peer copy':>9} {'kernel':>7} {'ratio':>6} "
            f"{'staged':>7} {'ratio':>6} "
            f"{'write()':>7} {'ratio':>6} {'strided kernel':>14} {'ratio':>6} {'strided staged':>14} {'ratio':>6} "
            f"{'prep ms':>7} {'verified':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        case, nbytes = r["case"], r["nbytes"]
        k = gbs(nbytes, r["kernel"][bench.configs[0]] / 1e3)
        st = gbs(nbytes, r["staged_ms"] / 1e3)
        c = gbs(nbytes, r["copy_ms"] / 1e3)
        w = gbs(nbytes, r["write_s"])
        sk = gbs(nbytes, r["engines"]["kernel"][2])
        sg = gbs(nbytes, r["engines"]["staged"][2])
        print(f"{case.name:<11} {len(case.length):>8} {int(case.length[0]):>6} {nbytes / 2**20:>5.0f} {c:>9.1f} "
              f"{_rate_cells(k, c)} {_rate_cells(st, c)} {_rate_cells(w, c)} {_rate_cells(sk, c, 14)} "
              f"{_rate_cells(sg, c, 14)} "
              f"{r['engines']['staged'][1] * 1e3:>7.2f} {r['checks']:>12}")
    fixed = bench.tiny_fixed()
    print(f"\nfixed cost per write = write_strided() call -> notification seen by the receiver (it polls without "
          f"sleeping), minus the strided kernel's own time for the same batch; median of {args.fixed_reps}; "
          f"{'direct path' if _has_direct(bench.peers['nvlink'], bench.engines.KERNEL) else 'prepared write'}, "
          f"host steps in {_host_steps(bench.transports['nvlink'])}, "
          "kernel engine; behind us = the same write called while the caller's stream still runs ~1 ms of work "
          "that the copy waits for (a model's layer): from that work's end to the notification seen, minus the "
          "kernel, the call's host time hidden (what layer-wise streaming pays)")
    head = (f"{'case':<11} {'pairs':>6} {'slots':>6} {'MiB':>5} {'peer copy':>9} {'landed':>7} {'ratio':>6} "
            f"{'kernel us':>9} {'landed us':>9} {'fixed us':>8} {'ns/slot':>7} {'behind us':>9}")
    print(head)
    print("-" * len(head))
    tiny = fixed["nvlink"]
    for r in results:
        pairs, slots = r["strided_shape"]
        nbytes, c = r["nbytes"], gbs(r["nbytes"], r["copy_ms"] / 1e3)
        landed_us, kernel_us = r["landed_s"] * 1e6, r["strided_kernel_ms"] * 1e3
        fixed_us = landed_us - kernel_us
        per_slot = (fixed_us - tiny[0]) / slots * 1e3 if slots else float("nan")
        lg = gbs(nbytes, r["landed_s"])
        print(f"{r['case'].name:<11} {pairs:>6} {slots:>6} {nbytes / 2**20:>5.0f} {c:>9.1f} {lg:>7.1f} {lg / c:>6.1%} "
              f"{kernel_us:>9.1f} {landed_us:>9.1f} {fixed_us:>8.1f} {per_slot:>7.1f} "
              f"{r['behind_s'] * 1e6 - kernel_us:>9.1f}")
    print(f"one-row write (1 pair x 1 slot, 2 KiB): nvlink fixed cost {tiny[0]:.1f} us, behind compute "
          f"{tiny[2]:.1f} us (kernel {tiny[1]:.1f} us); "
          + (f"nixl fixed cost {fixed['nixl'][0]:.1f} us" if isinstance(fixed.get("nixl"), tuple)
             else f"nixl {fixed.get('nixl', 'not importable here, skipped')}"))
    if bench.not_hidden:
        print(f"behind us: {bench.not_hidden} write calls returned after the work queued before them had ended "
              "(their host time partly counted)")
    compute, layer_us = bench.layer_compute()
    print(f"\nlayer-wise streaming: {args.layers} layers, each {layer_us:.0f} us of bf16 matmul on the writer's GPU "
          f"(--layer-us {args.layer_us:g}); streamed = each layer followed by a write_strided() of its buffers (kernel "
          "engine, the last one notifying), whole = one write of the request after the last layer; tail = last "
          "layer's end -> notification seen; compute = the layers' GPU time; call = one streamed write_strided() "
          f"on the caller's thread; builds / ring waits in the streamed rounds; medians of {args.layerwise_reps}")
    head = (f"{'case':<11} {'layer MiB':>9} {'tail streamed us':>16} {'tail whole us':>13} {'compute ms':>10} "
            f"{'streamed ms':>11} {'stretch':>7} {'call us':>7} {'builds':>6} {'ring waits':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        lw = bench.layerwise(r["case"], compute)
        st, wh = lw["streamed"], lw["whole"]
        count = lambda v: "n/a" if v is None else str(v)  # noqa: E731
        print(f"{r['case'].name:<11} {lw['layer_bytes'] / 2**20:>9.2f} {st['tail_s'] * 1e6:>16.1f} "
              f"{wh['tail_s'] * 1e6:>13.1f} {wh['compute_s'] * 1e3:>10.2f} {st['compute_s'] * 1e3:>11.2f} "
              f"{st['compute_s'] / wh['compute_s'] - 1:>+7.1%} {st['call_s'] * 1e6:>7.1f} {count(st['builds']):>6} "
              f"{count(st['ring_waits']):>10}")
    for r in results:
        sb_pairs, sb_slots = r["strided_shape"]
        print(f"write_strided {r['case'].name}: {sb_pairs} pairs x {sb_slots} slots; strided kernel alone "
              f"{gbs(r['nbytes'], r['strided_kernel_ms'] / 1e3):.1f} GB/s (row-table kernel "
              f"{gbs(r['nbytes'], r['kernel'][bench.configs[0]] / 1e3):.1f}); the general path's host bounds + "
              f"table {r['strided_host_s'] * 1e3:.2f} ms; write_strided() (kernel engine) returned after "
              f"{r['engines']['kernel'][1] * 1e3:.3f} ms")


def record_variant(argv) -> str:
    """The kind of a ``--record`` run in bench/RESULTS.md: two GPUs, or one (its ratios are not NVLink's)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--src-device", type=int, default=0)
    ap.add_argument("--dst-device", type=int, default=1)
    args, _ = ap.parse_known_args(argv)
    return "one GPU" if args.src_device == args.dst_device else "two GPUs"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransfer bench nvlink", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--src-device", type=int, default=0)
    ap.add_argument("--dst-device", type=int, default=1, help="the receiver's GPU (the writer's too: one GPU)")
    ap.add_argument("--sweep", action="store_true", help="also time other kernel shapes and cache policies")
    ap.add_argument("--programs", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="also time the kernel limited to these many programs (grid stride), e.g. 16,32,66")
    ap.add_argument("--experiments", action="store_true", help="SM + copy engine at once; pull from the destination GPU")
    ap.add_argument("--nixl-layers", type=int, default=4, help="layers of the NIXL page-1 slice")
    ap.add_argument("--fixed-reps", type=int, default=21, help="writes timed for the fixed cost per write")
    ap.add_argument("--max-programs", type=int, default=0,
                    help="the nvlink transport's KernelConfig.max_programs (its writes and the kernel timed alone; "
                         "0: one program per tile): fewer leave more of the GPU to a layer's compute")
    ap.add_argument("--layer-us", type=float, default=300.0,
                    help="GPU time of one layer's compute in the layer-wise streaming table (a bf16 matmul)")
    ap.add_argument("--layerwise-reps", type=int, default=7, help="rounds timed per mode in the layer-wise table")
    ap.add_argument("--host-steps", choices=("c", "python"), default="c",
                    help="the direct path's host steps in C (NvlinkConfig.native, the default) or in Python")
    args = ap.parse_args(argv)
    args.pool_tokens = 2 * args.tokens

    import torch

    found = torch.cuda.device_count()
    if not 0 <= min(args.src_device, args.dst_device) <= max(args.src_device, args.dst_device) < found:
        print(f"kvtransfer bench nvlink: needs CUDA GPUs {args.src_device} and {args.dst_device}, found {found}"
              + (" (one GPU: --dst-device 0 puts the receiver on it too)" if found == 1 else ""))
        return 1
    if args.src_device == args.dst_device:
        print(f"one GPU: the receiver process writes into GPU {args.dst_device} too, so 'peer copy' is a copy "
              "inside it and no byte crosses NVLink (the staged engine's copy too: a loopback lane); the ratios "
              "are not NVLink's, the fixed costs are this host's")
    bench = _Bench(args)
    try:
        bench.setup()
        results = bench.measure()
        _print_table(bench, results)
        if "nixl" in bench.peers:
            print(_nixl_page1(args, bench.cases[0], bench.peers, bench.remote))
        else:
            print("nixl: not importable here, skipped")
        if args.experiments:
            whole = [r for r in results if r["case"].name != "head slice"]
            for fn in (bench.together, bench.pull):
                try:
                    print(fn(whole[len(whole) // 2]))
                except Exception as exc:  # an experiment must not cost the table above
                    print(f"{fn.__name__}: failed: {type(exc).__name__}: {exc}")
    finally:
        bench.close()
    return 0 if all(r["verified"] for r in results) else 2


def _nixl_importable() -> bool:
    from transport._nixl_import import load_nixl_api

    try:
        load_nixl_api()
    except ImportError:
        return False
    return True


def _nixl_page1(args, case: Case, peers, remote) -> str:
    """NIXL's one-descriptor-per-page path on the first ``nixl_layers`` layers of page size 1."""
    per_buf = args.tokens
    n = per_buf * 2 * args.nixl_layers
    sel = np.r_[0 : per_buf * args.nixl_layers, per_buf * args.layers : per_buf * (args.layers + args.nixl_layers)][:n]
    batch = case.batch(sel)
    _, nvl = _write_times(peers["nvlink"], batch, 3)
    tag = b"nixl page 1"
    # The receiver polls while the write runs: NIXL's progress thread is off by default,
    # and UCX's rendezvous needs the receiving worker to make progress.
    remote.start_wait_notify(tag, 300.0)
    t0 = time.perf_counter()
    peers["nixl"].write(batch, notify=tag).wait(timeout=300)
    nixl_s = time.perf_counter() - t0
    arrived = remote.result("wait_notify") is not None
    nb = batch.nbytes
    return (f"nixl page 1 ({len(batch)} rows, {nb / 2**20:.0f} MiB): nixl {nb / nixl_s / 1e9:.2f} GB/s, "
            f"nvlink write() {nb / nvl / 1e9:.1f} GB/s, x{nixl_s / nvl:.0f}, notification {arrived}")
