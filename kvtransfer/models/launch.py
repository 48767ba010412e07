"""Run a job on every rank of a TP group: one process per rank, the same schedule on each.

``run(spec, tp_size, engine_config, job)`` builds, on each rank, that rank's model shard and an
:class:`~kvtransfer.models.engine.Engine` over its own pools, calls ``job(engine)``, and returns
rank 0's result. With ``tp_size == 1`` it runs in this process; otherwise it spawns ``tp_size``
processes (``torch.multiprocessing``, spawn), which join a gloo (CPU) or NCCL (CUDA) group over
loopback. A rank that fails sends its traceback; the caller gets a :class:`RankFailed` naming
the rank, and every process is reaped.

A job is a picklable callable (a frozen dataclass at module level) ``job(engine) -> result``.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as tmp

from kvtransfer.models.config import EngineConfig
from kvtransfer.models.engine import Engine
from kvtransfer.models.parallel import TPGroup, close_tp, init_tp, rank_device, rendezvous
from kvtransfer.models.registry import ModelSpec

RANK_TIMEOUT_S = 600.0
POLL_S = 0.5


class RankFailed(RuntimeError):
    """A rank process raised or died; the message holds its traceback."""


@dataclass(frozen=True)
class RankOutcome:
    """What a rank sends back. ``result`` is pickled to bytes by the rank: tensors must not travel
    as shared-memory handles, which die with the process that made them."""

    rank: int
    result: Optional[bytes] = None
    error: Optional[str] = None  # the rank's traceback, or None on success


def run_rank(spec: ModelSpec, tp: TPGroup, ec: EngineConfig, job: Callable[[Engine], Any]) -> Any:
    model = spec.build(tp, ec.dtype, rank_device(ec.device, tp))
    return job(Engine(model, ec))


def _rank_main(rank: int, size: int, port: int, threads: int, spec, ec, job, results) -> None:
    torch.set_num_threads(threads)
    tp = None
    try:
        tp = init_tp(rank, size, port, ec.device)
        out = run_rank(spec, tp, ec, job)
        results.put(RankOutcome(rank, result=pickle.dumps(out) if rank == 0 else None))
    except BaseException:
        results.put(RankOutcome(rank, error=traceback.format_exc()))
    finally:
        if tp is not None:
            close_tp(tp)


def run(spec: ModelSpec, tp_size: int, ec: EngineConfig, job: Callable[[Engine], Any],
        threads: Optional[int] = None, spawn: Optional[bool] = None) -> Any:
    """Rank 0's ``job(engine)`` result (module docstring). ``spawn`` forces (True) or avoids
    (False, TP 1 only) separate processes; by default only TP > 1 spawns."""
    spec.config.check_tp(tp_size)
    if spawn is False and tp_size > 1:
        raise ValueError(f"TP {tp_size} needs one process per rank: spawn=False allows TP 1 only")
    if tp_size == 1 and not spawn:
        return run_rank(spec, TPGroup(), ec, job)
    threads = threads or max(1, (os.cpu_count() or 1) // tp_size)
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    store = rendezvous()
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, store.port, threads, spec, ec, job, results), daemon=True)
             for r in range(tp_size)]
    for p in procs:
        p.start()
    try:
        outcomes = {}
        waited = 0.0
        while len(outcomes) < tp_size:
            try:
                o = results.get(timeout=POLL_S)
            except queue_mod.Empty:
                waited += POLL_S
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                if dead:
                    raise RankFailed(f"rank(s) {dead} of {tp_size} exited without a result (see their stderr)")
                if waited >= RANK_TIMEOUT_S:
                    raise RankFailed(f"no answer from the ranks in {RANK_TIMEOUT_S:.0f} s")
                continue
            if o.error is not None:
                raise RankFailed(f"rank {o.rank} of {tp_size} failed:\n{o.error}")
            outcomes[o.rank] = o
        return pickle.loads(outcomes[0].result)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
