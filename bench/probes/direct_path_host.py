"""Probe (one-off measurement, not a test): the host time of ``write_strided``'s direct path,
step by step, and what happens after the call until the receiver sees the notification.

Usage:
    python3 bench/probes/direct_path_host.py [--tokens T] [--page P] [--reps N]          (no GPU)
    python3 bench/probes/direct_path_host.py --cuda [--tokens T] [--page P] [--reps N]   (two GPUs)

A Llama-3-70B-shaped request: 80 layers x K, V (160 buffer pairs), 2 KiB token rows, ``T``
tokens in pages of ``P`` (slots = T / P); each size is also run with one slot (the fixed part).

Without ``--cuda``: an ``NvlinkPeer`` around stand-ins for what needs CUDA (the runtime calls
and the streams: no-ops; the launch goes through the real relauncher up to a stand-in compiled
kernel; an event completes 100 us after its record, its ``synchronize()`` sleeps), its real
pair cache, ring, queue, progress thread and mailbox, and a receiver process: the Python alone.

With ``--cuda``: a real nvlink transport on GPU 0 and a receiver process on GPU 1
(``kvtransfer.benchmarks._remote.RemoteBuffers``, as ``kvtransfer bench nvlink``). Prints

- ``steps``: the median of each step of ``peer.write_strided`` (the direct path), each timed by
  a wrapper around it (nested steps indented; ``the rest of X``: X's time outside the steps
  listed under it), and the median of the whole call without the wrappers (wall clock and the
  calling thread's CPU time: a gap between them is time spent waiting for the GIL or a core);
- ``after the call``: per write, the medians from the call to its return, to the progress
  thread's ``event.synchronize()`` returning (the kernel included), to the notification's send
  (announced while the copy runs) and its release (the landed word stored) returning, to the
  receiver's poll returning it (the receiver stamps arrivals on the host's monotonic clock,
  polling without sleeping), with the kernel's own time (CUDA events, the GPU kept busy
  before it so that the launch is not timed) and which thread released the notification (the
  caller's ``wait()`` does when the copy was done at its first look);
- raw costs of the CUDA calls the path makes, through each runtime binding (cuda-python, ctypes),
  and how late a thread sees a completed event (spin vs blocking-sync).
"""
import argparse
import cProfile
import contextlib
import pstats
import statistics
import sys
import threading
import time

import numpy as np
import torch

from transport.base import Region, RegionSizes, StridedBatch
from transport.nvlink import kernel as kern
from transport.nvlink import direct
from transport.nvlink.config import NvlinkConfig
from transport.nvlink.direct import PairCache, SlotRing, build_plan
from transport.nvlink.revoke import Hold
from transport.nvlink.mailbox import Inbox, Outbox
from transport.nvlink.transport import NvlinkPeer
from transport.nvlink.completion import PendingQueue
from transport.nvlink.completion import Progress
from transport.nvlink.prepare import EngineRoute
from transport.nvlink.prepare import WriteTables, base_table
from transport.registry import RegionRegistry

LAYERS, TOKEN_BYTES = 80, 2048


def med_us(ns):
    return statistics.median(ns) / 1e3


# -- the batch -------------------------------------------------------------------------------


def make_batch(src_rids, dst_rids, tokens, page, pool_pages, rng):
    row = page * TOKEN_BYTES
    sp = rng.choice(np.arange(1, pool_pages), tokens // page, replace=False)
    dp = rng.choice(np.arange(1, pool_pages), tokens // page, replace=False)
    return StridedBatch.of(np.asarray(src_rids), 0, row, np.asarray(dst_rids), 0, row, row, sp, dp)


def one_slot(batch):
    return StridedBatch(*batch.pairs, batch.src_slot[:1].copy(), batch.dst_slot[:1].copy())


# -- stand-ins for CUDA (CPU mode) -----------------------------------------------------------


class _Api:
    def get_device(self): return 0
    def set_device(self, d): pass
    def event_create(self): return object()
    def event_record(self, e, s): pass
    def stream_wait_event(self, s, e): pass
    def memcpy_async(self, dst, src, n, s): pass


class _Event:
    """A kernel of ``KERNEL_S`` seconds: done that long after ``record``; ``synchronize`` sleeps
    until then (the GIL released, as CUDA's does)."""

    KERNEL_S = 100e-6

    def __init__(self, *a, **k):
        self._done_at = 0.0

    def record(self, stream=None):
        self._done_at = time.monotonic() + self.KERNEL_S

    def query(self):
        return time.monotonic() >= self._done_at

    def synchronize(self):
        time.sleep(max(0.0, self._done_at - time.monotonic()))


class _Stream:
    cuda_stream = 7


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (the launch path reads its dtype, device, data_ptr)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # no subclass dispatch per call

    @staticmethod
    def of(t):
        return torch.Tensor._make_subclass(_OnGpu, t)

    @property
    def device(self):
        return torch.device("cuda", 0)


class _Compiled:
    """What Triton's JIT returns, as far as the relauncher looks: a no-op launcher."""

    function, packed_metadata = 0, None

    class src:
        signature = {}

    @staticmethod
    def run(*args): pass


class _Mapping:
    def __init__(self, bases): self._b = bases
    def bases(self, device): return self._b


class _Owner:
    def __init__(self, registry, ring):
        self._registry, self._ring = registry, ring
        self._progress = None  # set once the peer exists: the transport's progress thread over its queue

    def _slot_ring(self): return self._ring


def _receive(conn):
    """The receiver process of CPU mode: a mailbox, polled without sleeping (arrivals stamped)
    between "watch" and "stamps", else drained every millisecond (a core left to the writer)."""
    inbox = Inbox()
    conn.send(inbox.name)
    while True:
        if not conn.poll(0.001):
            inbox.poll()
            continue
        what = conn.recv()
        if what == "stop":
            return
        inbox.poll()  # what came while nobody watched
        stamps = {}
        while not conn.poll():
            for note in inbox.poll():
                stamps[note.payload] = time.monotonic()
        conn.recv()
        conn.send(stamps)


class _Receiver:
    """A process with a mailbox (CPU mode's peer): ``name`` to connect to; ``watch()`` starts
    polling it (a busy core), ``stamps()`` ends that and returns the arrivals."""

    def __init__(self):
        import multiprocessing

        self._conn, child = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_receive, args=(child,), daemon=True)
        self._proc.start()
        self.name = self._conn.recv()

    def watch(self, tags=None) -> None:
        self._conn.send("watch")

    def stamps(self) -> dict:
        """``{payload: arrival}`` (``time.monotonic()``) since :meth:`watch`."""
        self._conn.send("stamps")
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join(5)


def cpu_setup(tokens, page):
    """A peer over stand-ins: real pair cache, ring, mailbox, queue, progress thread, relauncher."""
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.device = torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    launcher = kern._kernel(False, kern._scatter_strided_body)
    launcher._fn = type("Jit", (), {"__getitem__": lambda self, grid: lambda *a, **k: _Compiled(),
                                    "params": getattr(launcher._fn, "params", [])})()  # the real kernel's
    launcher._keepable = lambda *a: True
    pool = 2 * tokens
    registry = RegionRegistry()
    for i in range(2 * LAYERS):
        registry.add(0x10000000 * (i + 1), pool * TOKEN_BYTES, 0)
    peer_regions = {i: Region(i, 0x900000000 + 0x10000000 * i, pool * TOKEN_BYTES, 1) for i in range(2 * LAYERS)}
    ring = SlotRing(_Api(), 0, torch.zeros(1 << 20, dtype=torch.int64), _OnGpu.of(torch.zeros(1 << 20, dtype=torch.int64)))
    owner, receiver, cfg = _Owner(registry, ring), _Receiver(), NvlinkConfig()
    peer = object.__new__(NvlinkPeer)
    peer._owner, peer._config, peer.name, peer.regions = owner, cfg, "probe", peer_regions
    peer._copy = direct.CopyStream(_Api(), 0, wait_current_stream=True)
    peer._copy._stream = _Stream()
    peer._mapping = _Mapping(np.array([r.ptr for r in peer_regions.values()], dtype=np.int64))
    peer._queue = PendingQueue("probe", Outbox(receiver.name, 1.0, sender="probe"), 60.0)
    owner._progress = Progress(peer._queue.advance, peer._queue.oldest_event)
    peer._hold = Hold("probe", peer._queue, peer._mapping)  # the receiver's answer to the Hello: taken as given
    peer._hold.acked = True
    peer._closed = False
    peer._peer_sizes = RegionSizes(peer_regions)
    peer.tables = WriteTables(registry, peer._peer_sizes, peer._mapping, 0, cfg)
    peer._route = EngineRoute(cfg, "probe", None, None, peer._mapping)
    bind = {} if not hasattr(kern, "SplitLaunch") else {  # (a tree before the bound launch: none)
        "bind": lambda table, p, shape: kern.SplitLaunch(table, ring.dev, p, shape, 0, cfg.kernel.num_warps)}
    peer.pair_plans = PairCache(cfg.pair_plans, lambda: registry.sizes, lambda b: build_plan(
        b, registry.sizes, peer._peer_sizes, registry.derived(base_table), peer._mapping.bases(0),
        _OnGpu.of, cfg.kernel, pin=False, **bind))
    batch = make_batch(range(2 * LAYERS), range(2 * LAYERS), tokens, page, pool // page, np.random.default_rng(0))
    return peer, owner, ring, batch, receiver


# -- step timers -----------------------------------------------------------------------------


class Steps:
    """Wrappers that time named steps (``name`` with dots: nested under its parent)."""

    def __init__(self):
        self.ns: dict[str, list] = {}
        self._undo = []

    def wrap(self, obj, attr: str, name: str):
        fn = getattr(obj, attr)
        out = self.ns.setdefault(name, [])
        clock = time.perf_counter_ns

        def timed(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                out.append(clock() - t)

        had = attr in vars(obj)
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn, had))

    def undo(self):
        for obj, attr, fn, had in reversed(self._undo):
            if had or not hasattr(type(obj), attr):
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)
        self._undo.clear()

    def report(self, title: str):
        print(title)
        order = {n: i for i, n in enumerate(self.ns)}
        names = sorted((n for n in self.ns if self.ns[n]),  # each step under its parent, in the order wrapped
                       key=lambda n: [order.get(n[:i], -1) for i in range(len(n) + 1) if i == len(n) or n[i] == "/"])
        for name in names:
            depth, short = name.count("/"), name.rsplit("/", 1)[-1]
            print(f"  {'  ' * depth + short:<60} {med_us(self.ns[name]):9.2f} us")
            kids = [c for c in names if c.startswith(name + "/") and c.count("/") == depth + 1]
            if kids and all(len(self.ns[c]) == len(self.ns[name]) for c in kids):  # one call each per write
                rest = np.array(self.ns[name], dtype=np.int64) - sum(np.array(self.ns[c], dtype=np.int64) for c in kids)
                print(f"  {'  ' * (depth + 1) + '(the rest of ' + short + ')':<60} {np.median(rest) / 1e3:9.2f} us")


class _TimedCompiled:
    """A compiled kernel whose launcher is timed (``CompiledKernel.run`` is a read-only property)."""

    def __init__(self, compiled, steps: Steps, name: str):
        self.function, self.packed_metadata, self._compiled = compiled.function, compiled.packed_metadata, compiled
        self.run = compiled.run
        steps.wrap(self, "run", name)


def instrument(steps: Steps, peer, owner, ring):
    """Wrap each step of the direct path of ``peer.write_strided`` (module doc)."""
    w = "write_strided"
    native = getattr(peer._copy, "_native", None)  # the C steps (a tree before them: none)
    steps.wrap(peer, "write_strided", w)
    steps.wrap(peer, "_check_notify", f"{w}/_check_notify")
    g, st = f"{w}/pair_plans.get (pair set lookup)", f"{w}/ring.stage (slots to the pinned ring + bounds)"
    steps.wrap(peer.pair_plans, "get", g)
    steps.wrap(peer._route, "lane_for", f"{w}/route.lane_for")
    steps.wrap(ring, "stage", st)
    steps.wrap(ring.space, "take", f"{st}/space.take")
    steps.wrap(peer._queue.outbox, "alive", f"{w}/outbox.alive")
    e = f"{w}/copy.enqueue_split"
    steps.wrap(peer._copy, "enqueue_split", e)
    steps.wrap(peer._copy._api, "get_device", f"{e}/api.get_device")
    steps.wrap(peer._copy, "_wait_caller", f"{e}/_wait_caller (record + wait)")
    steps.wrap(ring, "upload", f"{e}/ring.upload (cudaMemcpyAsync)")
    if native is not None:
        steps.wrap(native, "same_bytes", f"{g}/native.same_bytes")
        steps.wrap(native, "stage", f"{st}/native.stage")
        steps.wrap(native, "current_device", f"{e}/native.current_device")
        steps.wrap(peer._copy, "_caller", f"{e}/_caller (current stream)")
        steps.wrap(native, "upload_after", f"{e}/native.upload_after (upload + order)")
        steps.wrap(native, "launch", f"{e}/SplitLaunch (launch)/native.launch (cuLaunchKernel)")
    if hasattr(kern, "SplitLaunch"):
        steps.wrap(kern.SplitLaunch, "__call__", f"{e}/SplitLaunch (launch)")
    steps.wrap(kern, "scatter_strided_split", f"{e}/scatter_strided_split (unbound launch)")
    steps.wrap(torch.cuda.Event, "record", f"{e}/event.record")
    steps.wrap(ring.space, "hold", f"{e}/space.hold")
    steps.wrap(torch.cuda, "Event", f"{e}/torch.cuda.Event()")
    for plan in list(peer.pair_plans._plans.values()):  # the launcher's own call, inside the launch
        bound = plan.launcher._launch if getattr(plan, "launcher", None) is not None else None
        if bound is not None and bound._compiled is not None:
            proxy = _TimedCompiled(bound._compiled, steps, f"{e}/SplitLaunch (launch)/compiled.run (Triton's launcher)")
            steps._undo.append((bound, "_compiled", bound._compiled, True))
            bound._compiled = proxy
    steps.wrap(peer._queue, "track", f"{w}/queue.track")
    steps.wrap(owner._progress, "wake", f"{w}/progress.wake")


def whole_call_ns(peer, batch, reps, settle):
    """Nanoseconds of each ``write_strided`` call: wall clock, and the calling thread's CPU time
    (what it did, without the time it waited for the GIL or a core)."""
    wall, cpu = [], []
    for i in range(reps):
        c, t = time.thread_time_ns(), time.perf_counter_ns()
        tr = peer.write_strided(batch, b"probe %d" % i)
        wall.append(time.perf_counter_ns() - t)
        cpu.append(time.thread_time_ns() - c)
        settle(tr)
    return wall, cpu


def run_steps(peer, owner, ring, batch, reps, settle, label):
    launcher = kern._kernel(False, kern._scatter_strided_body)
    before = launcher.direct_launches
    wall, cpu = whole_call_ns(peer, batch, reps, settle)
    direct = launcher.direct_launches - before
    steps = Steps()
    instrument(steps, peer, owner, ring)
    try:
        whole_call_ns(peer, batch, reps, settle)
    finally:
        steps.undo()
    steps.report(f"\nsteps of write_strided, {label}: {batch.num_pairs} pairs x {batch.num_slots} slots "
                 f"(median of {reps}; each wrapper adds ~0.1-0.3 us)")
    print(f"  whole call without the wrappers: {med_us(wall):.2f} us wall, {med_us(cpu):.2f} us of this thread's CPU; "
          f"relauncher direct launches {direct} of {reps}")


# -- CUDA mode ---------------------------------------------------------------------------------


def cuda_setup(tokens, page, peer_gpu=1, host_steps="c"):
    from kvtransfer.benchmarks._remote import RemoteBuffers, make_transport

    pool = 2 * tokens
    remote = RemoteBuffers(peer_gpu, ("nvlink",))
    dst = remote.alloc([pool * TOKEN_BYTES] * (2 * LAYERS), 0x5A)
    tr = make_transport("nvlink", native=host_steps == "c")
    keep, src = [], []
    for _ in range(2 * LAYERS):
        t = torch.empty(pool * TOKEN_BYTES, dtype=torch.uint8, device="cuda:0")
        keep.append(t)
        src.append(tr.register_tensor(t))
    peer = tr.connect(remote.export()["nvlink"])
    batch = make_batch(src, dst, tokens, page, pool // page, np.random.default_rng(0))
    return remote, tr, peer, batch, keep


def after_call(progress, peer, batch, reps, start_stamps, stamps, wait=None, behind_cycles=0):
    """Medians (us) from the call to: its return, the progress thread's ``synchronize()`` on the
    write's event returning (the kernel included), the notification's announcement and its
    release (the landed word stored) returning (nan where a lander's thread of C stores it:
    the C steps, :mod:`transport.nvlink.completion`), the receiver seeing it. ``start_stamps(tags)``
    has the receiver watch for them, ``stamps()`` returns ``{tag: time.monotonic() of its
    arrival}``; ``wait(transfer)`` waits for each write (default: ``wait()``).
    ``behind_cycles``: each write is called with that many GPU cycles of work queued before it
    on the caller's stream (which the copy waits for); the GPU time from that work's end to the
    copy's is printed too."""
    sync_at, sent_at, released_at = [], [], []
    senders = []  # True where the progress thread released the notification
    clock, caller = time.monotonic, threading.current_thread()

    class _Seen:
        def __init__(self, event): self._event = event

        def synchronize(self):
            self._event.synchronize()
            sync_at.append(clock())

    outbox = peer._queue.outbox
    oldest, announce, release = progress._oldest_event, outbox.announce, outbox.settle
    copy, enqueue = peer._copy, peer._copy.enqueue_split
    gpu_marks = []  # per write: timing events on the copy stream before and after its work
    cuda = torch.cuda.is_available() and not isinstance(getattr(copy, "stream", None), _Stream)

    def timed_enqueue(*a, **k):  # the write's GPU time: the slots' upload, the launch gap and the kernel
        if not cuda:
            return enqueue(*a, **k)
        a0, b0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a0.record(copy.stream)  # the copy stream is idle: a0 passes as soon as it is recorded
        at = clock()
        event = enqueue(*a, **k)
        b0.record(copy.stream)
        gpu_marks.append((a0, b0, at))
        return event

    def timed_oldest():
        ev = oldest()
        return None if ev is None else _Seen(ev)

    numbers = {}  # notification number -> tag

    def timed_announce(payload, event=None):
        number = announce(payload, event)
        sent_at.append((payload, clock()))
        numbers[number] = payload
        return number

    def timed_settle(number, landed=True):
        release(number, landed)
        released_at.append((numbers.get(number), clock()))
        senders.append(threading.current_thread() is not caller)

    tags = [b"after %d %d" % (batch.num_slots, i) for i in range(reps + 2)]
    start_stamps(tags)
    time.sleep(0.05)  # the receiver is polling
    progress._oldest_event, outbox.announce, outbox.settle = timed_oldest, timed_announce, timed_settle
    copy.enqueue_split = timed_enqueue
    rows, computed = [], []  # computed: per write, an event recorded after the work queued before it
    try:
        for tag in tags:
            sync_at.clear()
            if behind_cycles:
                torch.cuda._sleep(behind_cycles)
                computed.append(torch.cuda.Event(enable_timing=True))
                computed[-1].record()
            t0 = clock()
            t = peer.write_strided(batch, tag)
            t1 = clock()
            (wait or _settle)(t)
            rows.append((tag, t0, t1, sync_at[-1] if sync_at else float("nan")))
    finally:
        progress._oldest_event = oldest
        del copy.enqueue_split, outbox.announce, outbox.settle
        arrived = stamps()
    sent, released = dict(sent_at), dict(released_at)
    out = {"returned": [], "notification sent (announced)": [], "event seen by the progress thread": [],
           "notification released (word stored)": [], "receiver saw it": []}
    for tag, t0, t1, ts in rows[2:]:
        for k, v in zip(out, (t1, sent.get(tag, float("nan")), ts, released.get(tag, float("nan")),
                              arrived.get(tag, float("nan")))):
            out[k].append((v - t0) * 1e6)
    med = {k: float(np.nanmedian(v)) if not np.isnan(v).all() else float("nan") for k, v in out.items()}
    if gpu_marks:  # one mark per write, in order: the copy's end on the host clock (a0 passed at its record)
        ends = [at + a.elapsed_time(b) * 1e-3 for a, b, at in gpu_marks]
        med["GPU time of the write (upload..event)"] = float(np.median([a.elapsed_time(b) * 1e3
                                                                         for a, b, _ in gpu_marks[2:]]))
        med["copy done (record time + GPU span)"] = float(np.median([(e - t0) * 1e6 for e, (_, t0, _, _)
                                                                     in zip(ends[2:], rows[2:])]))
        if computed:
            med["GPU: work before it ends -> copy done"] = float(np.median([c.elapsed_time(b) * 1e3 for c, (_, b, _)
                                                                          in zip(computed[2:], gpu_marks[2:])]))
    med["released by the progress thread (share)"] = sum(senders) / max(1, len(senders))
    return med


def print_after(after: dict, batch, kernel: float, full_kernel: float = float("nan")) -> None:
    print(f"after the call, {batch.num_pairs} x {batch.num_slots} (us from the call, medians; kernel alone "
          f"{kernel:.1f} us, the full-table kernel kvtransfer bench nvlink subtracts {full_kernel:.1f} us):")
    for name, us in after.items():
        print(f"  {name:<36} {us:9.2f}" + ("" if "share" in name else " us"))
    print(f"  fixed cost = receiver saw it - kernel {after['receiver saw it'] - kernel:9.1f} us")
    done = after.get("copy done (record time + GPU span)")
    if done is not None:
        print(f"  receiver saw it - copy done            {after['receiver saw it'] - done:9.1f} us")


def kernel_us(peer, batch, reps=20):
    """The split kernel alone on the resident pairs and ring (CUDA events, median)."""
    plan, ring = peer.pair_plans.get(batch), peer._owner._slot_ring()
    start, fits = ring.stage(batch.src_slot, batch.dst_slot, plan.src_limit, plan.dst_limit)
    if not fits:
        raise ValueError(f"the batch's slots leave the pairs' regions (limits {plan.src_limit}, {plan.dst_limit})")
    stream = torch.cuda.current_stream(0)
    ring.upload(start, 2 * batch.num_slots, stream.cuda_stream)
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)  # the GPU busy: the events time the kernel, not its launch
        a.record()
        kern.scatter_strided_split(plan.device_table, ring.dev, start, plan.num_pairs, batch.num_slots, plan.launch,
                                   0, peer._config.kernel.num_warps, checked=True, stream=stream)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    ring.space.hold(start, None)
    return statistics.median(out)


def full_kernel_us(peer, batch, reps=20):
    """The strided kernel over a full ``[5 * P + 2 * S]`` table (what ``kvtransfer bench nvlink``
    subtracts as "the kernel's own time"), CUDA events, median."""
    table = peer.tables.strided_table(batch, checked=False)
    plan = peer.tables.strided_plan(batch, table)
    table_dev = torch.from_numpy(table).to("cuda:0")
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        a.record()
        kern.scatter_strided(table_dev, batch.num_pairs, batch.num_slots, plan, 0, peer._config.kernel.num_warps)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def raw_costs(reps=300):
    """Median us of each CUDA call the direct path makes, per runtime binding."""
    from transport.nvlink import ipc

    s = torch.cuda.Stream(0)
    h = torch.empty(1 << 15, dtype=torch.int64, pin_memory=True)
    d = torch.empty(1 << 15, dtype=torch.int64, device="cuda:0")
    calls = [("torch.cuda.current_stream(0)", lambda: torch.cuda.current_stream(0)),
             ("torch.cuda.Event() + record(stream)", lambda: torch.cuda.Event().record(s)),
             ("torch event.query() (done)", lambda ev=torch.cuda.Event(): ev.query())]
    for choice in ("cuda-python", "ctypes"):
        try:
            api = ipc.load_api(choice)
        except Exception as exc:  # noqa: BLE001 -- say which binding is missing
            print(f"  {choice}: not loadable ({exc})")
            continue
        ev = api.event_create()
        calls += [(f"{choice} get_device", api.get_device),
                  (f"{choice} cudaMemcpyAsync 8 B H2D", lambda a=api: a.memcpy_async(d.data_ptr(), h.data_ptr(), 8,
                                                                                      s.cuda_stream)),
                  (f"{choice} cudaMemcpyAsync 256 KiB H2D", lambda a=api: a.memcpy_async(
                      d.data_ptr(), h.data_ptr(), 1 << 18, s.cuda_stream)),
                  (f"{choice} cudaEventRecord", lambda a=api, e=ev: a.event_record(e, s.cuda_stream)),
                  (f"{choice} cudaStreamWaitEvent", lambda a=api, e=ev: a.stream_wait_event(s.cuda_stream, e))]
    for name, fn in calls:
        ns = []
        for _ in range(reps):
            t = time.perf_counter_ns()
            fn()
            ns.append(time.perf_counter_ns() - t)
        print(f"  raw {name:<38} {med_us(ns):8.2f} us")
        torch.cuda.synchronize()


def event_lateness():
    """How late a ``synchronize()``-ing thread sees a completed event, after a spinning query
    loop (write_overhead's measurement), for a spin and a blocking-sync event."""
    from write_overhead import event_latency  # a sibling probe (bench/probes is this script's path)

    for name, us in event_latency().items():
        print(f"  a synchronize()-ing thread sees a {name:<22} {us:8.2f} us after a query loop")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuda", action="store_true", help="real transports on GPU 0 -> GPU 1 (else CUDA stand-ins)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of whole writes")
    ap.add_argument("--peer-gpu", type=int, default=1, help="the receiver's GPU (0: one GPU, no NVLink in the copy)")
    ap.add_argument("--spin-wait", choices=("status", "lock"), default=None,
                    help="wait for each write keeping the calling core busy (as a caller streaming writes would "
                         "keep it) instead of sleeping in wait(): status = asking status() in a loop (each look "
                         "queries the event), lock = looking at the transfer's settled lock, the GIL let go "
                         "between looks (the progress thread settles it)")
    ap.add_argument("--behind", type=float, default=0.0, metavar="US",
                    help="call each write with this many microseconds of GPU work queued before it on the caller's "
                         "stream (as a model's layer), which its copy waits for")
    ap.add_argument("--busy", type=float, default=0.0, metavar="US",
                    help="after each write call, keep the calling thread busy this many microseconds before it "
                         "waits (as a model's next layer would), in the way --busy-kind says")
    ap.add_argument("--busy-kind", choices=("torch", "python"), default="torch",
                    help="torch = launching tiny GPU ops one after another (torch lets the GIL go around each), "
                         "python = pure Python (the GIL let go only when the interpreter switches threads)")
    ap.add_argument("--blocking-events", action="store_true",
                    help="completion events made with blocking=True (a waiting thread sleeps instead of spinning)")
    ap.add_argument("--host-steps", choices=("c", "python"), default="c",
                    help="--cuda: the direct path's host steps in C (NvlinkConfig.native) or in Python")
    args = ap.parse_args()
    global _settle
    if args.spin_wait:
        _settle = _spin if args.spin_wait == "status" else _spin_on_lock
    if not args.cuda:
        peer, owner, ring, batch, receiver = cpu_setup(args.tokens, args.page)
        try:
            print(f"direct_path_host (CUDA stand-ins: the Python alone), python {sys.version.split()[0]}, "
                  f"numpy {np.__version__}")
            for b in (one_slot(batch), batch):
                whole_call_ns(peer, b, 50, _settle)
                run_steps(peer, owner, ring, b, args.reps, _settle, "CUDA stand-ins")
                print_after(after_call(owner._progress, peer, b, min(args.reps, 200), receiver.watch,
                                       receiver.stamps), b, _Event.KERNEL_S * 1e6)
            if args.profile:
                profile(peer, batch, args.reps)
        finally:
            owner._progress.stop()
            receiver.close()
        return
    torch.cuda.set_device(0)
    if args.blocking_events:
        plain = torch.cuda.Event

        class _Blocking(plain):
            def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
                return plain.__new__(cls, enable_timing=enable_timing, blocking=True, interprocess=interprocess)

        torch.cuda.Event = _Blocking
    remote, tr, peer, batch, keep = cuda_setup(args.tokens, args.page, args.peer_gpu, args.host_steps)
    try:
        ring = tr._slot_ring()
        print(f"direct_path_host --cuda: {torch.cuda.get_device_name(0)}, ipc api {peer._copy._api.name}, "
              f"triton {__import__('triton').__version__}, torch {torch.__version__}, python {sys.version.split()[0]}, "
              f"numpy {np.__version__}, host steps in "
              f"{'C' if tr.native_unavailable is None else 'Python (' + tr.native_unavailable + ')'}")
        for b in (one_slot(batch), batch):
            whole_call_ns(peer, b, 20, _settle)  # pair set resident, kernel compiled, ring warm
            run_steps(peer, tr, ring, b, args.reps, _settle, "real CUDA")
            after = after_call(tr._progress, peer, b, min(args.reps, 100),
                               lambda tags: remote.start_stamp_notify(tags, 120.0, ("nvlink",)),
                               lambda: {t: v[1] for t, v in remote.result("stamp_notify").items()},
                               wait=_busy_then_settle(args.busy, args.busy_kind) if args.busy else None,
                               behind_cycles=int(args.behind * 1970))  # an H200's ~1.97 GHz
            print_after(after, b, kernel_us(peer, b), full_kernel_us(peer, b))
        if args.profile:
            profile(peer, batch, 50)
        print("\nraw costs")
        raw_costs()
        event_lateness()
    finally:
        tr.close()
        remote.close()
        del keep


def _busy_then_settle(us: float, kind: str):
    """A ``wait`` for :func:`after_call`: the calling thread busy for ``us`` microseconds (tiny
    GPU ops launched one after another, or pure Python), then :func:`_settle`."""
    x = torch.zeros(16, device="cuda") if kind == "torch" else None

    def wait(transfer) -> None:
        end = time.monotonic() + us * 1e-6
        while time.monotonic() < end:
            if x is not None:
                x.add_(1)
            else:
                sum(range(50))
        _settle(transfer)
    return wait


def _settle(transfer) -> None:
    transfer.wait(timeout=60)


def _spin_on_lock(transfer) -> None:
    settled, deadline = transfer._settled_lock(), time.monotonic() + 60
    while settled.locked():
        time.sleep(0)  # lets the GIL go: the progress thread needs it to settle the write
        if time.monotonic() > deadline:
            raise TimeoutError("the write did not settle within 60 s")
    transfer.wait(timeout=60)  # its outcome


def _spin(transfer) -> None:
    from transport.base import TransferStatus

    deadline = time.monotonic() + 60
    while transfer.status() is TransferStatus.PENDING:
        if time.monotonic() > deadline:
            raise TimeoutError("the write did not settle within 60 s")


def profile(peer, batch, reps) -> None:
    prof = cProfile.Profile()
    prof.enable()
    whole_call_ns(peer, batch, reps, _settle)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
