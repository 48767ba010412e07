"""``kvtransfer bench transfer --layerwise``: one request's KV streamed layer by layer while the
writer still computes, against one write after the last layer, through NIXL in host memory.

This process plays a prefill rank: its main thread runs each layer's compute (``--layer-ms`` of
float32 matrix products on one torch thread, the count calibrated once per run: the other cores
are the writes' and the receiver's) and hands the layer over; a second thread plays the rank's
KV manager loop: it posts what it was handed and polls the writes in flight every
``BUSY_POLL_S`` (UCX progresses inside those polls, as in the serving path). Streamed (``on``),
layer i's part of the request's plan (a selection of the one cached plan, ``plan.select``; the
state plans go with the last layer) is posted as soon as layer i's compute ends, while layer
i+1 computes; whole (``off``), one write of the plan follows the last layer. Every write carries a notification and the receiver stamps each one's arrival
on this host's monotonic clock. With ``--layer-group G`` the streamed mode also runs as
``on/G``: one write per G consecutive layers (their pairs selected together from the plan),
posted after the last of them. The streamed writes are verified first: the destination reset
to the fill byte, one streamed round, every destination buffer against the expected bytes. The
modes alternate, round by round (after one warm-up round of each); per mode, medians:

    compute   first layer's start -> last layer's end (streamed: stretched by the writes sharing
              the CPU with it)
    tail      last layer's end -> the last notification seen by the receiver
    layer     one layer's writes alone, nothing computing: post -> its notifications seen
              (what a streamed tail compares with: at best within one layer's write)
"""

from __future__ import annotations

import itertools
import queue
import statistics
import threading
import time
from typing import List

import numpy as np

from kvtransfer.batches import plan_batch, write_batch
from kvtransfer.benchmarks._rig import FILL
from kvtransfer.control.config import BUSY_POLL_S
from transport.base import TransferStatus

__all__ = ["LayerCompute", "layer_batches", "mode_names", "run_layerwise"]

WAIT_S = 120.0  # one round's notifications


class LayerCompute:
    """About ``ms`` milliseconds of CPU work per call: products of two [256, 256] float32
    matrices on one torch thread, their count measured once."""

    SIZE = 256

    def __init__(self, ms: float):
        import torch

        self._torch = torch
        self._a = torch.randn(self.SIZE, self.SIZE)
        self._out = torch.empty(self.SIZE, self.SIZE)
        self.reps = 20
        per = min(self._timed() for _ in range(3)) / self.reps  # seconds per product
        self.reps = max(1, round(ms / 1e3 / per))

    def _timed(self) -> float:
        t0 = time.perf_counter()
        self()
        return time.perf_counter() - t0

    def __call__(self) -> None:
        threads = self._torch.get_num_threads()
        self._torch.set_num_threads(1)
        try:
            for _ in range(self.reps):
                self._torch.mm(self._a, self._a, out=self._out)
        finally:
            self._torch.set_num_threads(threads)


def layer_batches(case, src, dst, group: int = 1) -> List[list]:
    """The batches of each group of ``group`` consecutive layers of ``case``'s request, in layer
    order: its KV plan restricted to those layers' buffer pairs (buffer = export * layers +
    layer position), one batch per group; the state plans with the last group."""
    kv, *state = case.plans()
    layers = len(case.pools.layouts(case.page_size)[0].layer_ids)
    position = kv.src_buf % layers  # [B]
    out = [[plan_batch(kv.select((position >= first) & (position < first + group)), src, dst)]
           for first in range(0, layers, group)]
    out[-1] += [plan_batch(p, src, dst) for p in state]
    return [[b for b in batches if b.nbytes] for batches in out]


def mode_names(modes: tuple, groups: tuple) -> list:
    """The measured modes: ``on`` per layer group size (``on`` for 1, ``on/G`` for G), ``off``."""
    out = []
    for mode in modes:
        out += [f"on/{g}" if g > 1 else "on" for g in groups] if mode == "on" else [mode]
    return out


class _Manager:
    """The KV manager loop's part: post the batch lists queued to it (each write with its own
    notification tag) and poll every write in flight until it is done."""

    def __init__(self, peer):
        self._peer, self._jobs = peer, queue.Queue()
        self._error: List[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="kvt-bench-layerwise", daemon=True)
        self._thread.start()

    def post(self, batches: list, tags: list) -> None:
        self._jobs.put((batches, tags))

    def drain(self) -> None:
        """Wait until everything queued so far is posted and done; raise what failed."""
        done = threading.Event()
        self._jobs.put(done)
        if not done.wait(WAIT_S):
            raise RuntimeError(f"the writes were not done after {WAIT_S:g} s")
        if self._error:
            raise self._error.pop()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        inflight, waiters = [], []
        while True:
            try:
                job = self._jobs.get(timeout=BUSY_POLL_S) if inflight else self._jobs.get()
            except queue.Empty:
                job = False
            while job is not False:
                if job is None:
                    return
                if isinstance(job, threading.Event):
                    waiters.append(job)
                else:
                    for batch, tag in zip(*job):
                        try:
                            inflight.append(write_batch(self._peer, batch, tag))
                        except BaseException as exc:  # reported by drain()
                            self._error.append(exc)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = False
            still = []
            for t in inflight:
                status = t.status()
                if status is TransferStatus.PENDING:
                    still.append(t)
                elif status is TransferStatus.FAILED:
                    self._error.append(RuntimeError(f"a write failed: {t.error}"))
            inflight = still
            if not inflight:
                for w in waiters:
                    w.set()
                waiters = []


def run_layerwise(rig, case, modes: tuple, groups: tuple, compute: LayerCompute, warmup: int, reps: int,
                  backend: str = "nixl") -> dict:
    """The figures of ``modes`` (``on``, ``off`` or both; ``on`` once per size in ``groups``,
    :func:`mode_names`) on ``case`` (module docstring) through the rig's ``backend`` (``nixl``:
    staged mode off; ``nixl-staged``: on), alternated round by round:
    ``{"layers", "layer_bytes", "layer_s", mode name: {"compute_s", "tail_s"}}``;
    ``{"failed": why}`` when the streamed bytes are not the expected ones."""
    by_size = {g: layer_batches(case, rig.src, rig.dst, g) for g in {1, *groups}}
    layers = by_size[1]
    grouped = {name: (g, by_size[g]) for name, g in
               zip(mode_names(("on",), groups), groups)}  # streamed mode -> (layers per write, batches per write)
    whole = [b for b in case.planned(rig.src, rig.dst) if b.nbytes]  # off: the plan as kvtransfer writes it whole
    manager = _Manager(rig.peers[backend])
    rounds = itertools.count()

    def tags_for(label: str, count: int) -> list:
        n = next(rounds)
        return [f"layerwise {label} {n} {i}".encode() for i in range(count)]

    def last_arrival(tags: list, run):
        """``run()``'s result and the receiver's time of the last of ``tags`` to arrive."""
        out, arrivals = rig.remote.stamped(tags, run, (backend,), WAIT_S)
        return out, max(arrivals.values())

    def one_round(mode: str) -> tuple:
        """``(compute, tail)`` seconds of one round of ``mode``."""
        per, streamed = grouped.get(mode, (0, None))  # off: None
        tags = tags_for(mode, sum(len(g) for g in streamed) if streamed else len(whole))

        def run() -> tuple:
            start, given = time.monotonic(), 0
            for i in range(len(layers)):
                compute()
                if streamed and ((i + 1) % per == 0 or i == len(layers) - 1):
                    group = streamed[i // per]
                    manager.post(group, tags[given:given + len(group)])
                    given += len(group)
            end = time.monotonic()
            if not streamed:
                manager.post(whole, tags)
            manager.drain()
            return start, end

        (start, end), arrival = last_arrival(tags, run)
        return end - start, arrival - end

    def one_layer() -> float:
        group = layers[len(layers) // 2]
        tags = tags_for("layer", len(group))

        def run() -> float:
            t0 = time.monotonic()
            manager.post(group, tags)
            manager.drain()
            return t0

        t0, arrival = last_arrival(tags, run)
        return arrival - t0

    try:
        expect = rig.expected_checksums(case)
        for name in grouped:
            rig.remote.fill(rig.dst_ids, FILL)
            one_round(name)
            if not rig.landed(expect):
                return {"failed": f"the destination differs from the expected bytes after a streamed write ({name})"}
        names = mode_names(modes, groups)
        samples = {m: [] for m in names}
        alone = []
        for i in range(warmup + reps):
            for mode in names:
                figures = one_round(mode)
                if i >= warmup:
                    samples[mode].append(figures)
            got = one_layer()
            if i >= warmup:
                alone.append(got)
    finally:
        manager.close()
    out = {"layers": len(layers), "layer_bytes": int(np.median([sum(b.nbytes for b in g) for g in layers])),
           "layer_s": statistics.median(alone)}
    for mode, got in samples.items():
        out[mode] = {"compute_s": statistics.median(c for c, _ in got), "tail_s": statistics.median(t for _, t in got)}
    return out
