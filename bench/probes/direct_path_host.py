"""Probe (one-off measurement, not a test): the host time of the direct path's Python, no GPU.

Usage: python3 bench/probes/direct_path_host.py [TOKENS] [PAGE]

Builds an ``NvlinkPeer`` around stand-ins for what needs CUDA (the runtime calls, the stream,
the event, the kernel launch: each a no-op) and a real mailbox, then times
``peer.write_strided(batch)`` for a Llama-3-70B-shaped request (80 layers x K, V; 2 KiB token
rows) and profiles it. What it leaves out: the CUDA calls themselves (about six per write:
get device, record + wait for the caller's stream, the slots' copy, the launch, the event)."""
import cProfile
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from transport.base import Region, RegionSizes, StridedBatch
from transport.nvlink import kernel as kern
from transport.nvlink import stream as stream_mod
from transport.nvlink.config import NvlinkConfig
from transport.nvlink.fastpath import PairCache, SlotRing
from transport.nvlink.mailbox import Inbox, Outbox
from transport.nvlink.peer import NvlinkPeer
from transport.nvlink.pending import PendingQueue
from transport.nvlink.progress import Progress
from transport.nvlink.route import EngineRoute
from transport.nvlink.tables import WriteTables
from transport.registry import RegionRegistry


class Api:
    def get_device(self): return 0
    def set_device(self, d): pass
    def event_create(self): return object()
    def event_record(self, e, s): pass
    def stream_wait_event(self, s, e): pass
    def memcpy_async(self, dst, src, n, s): pass


class Event:
    def record(self, stream): pass
    def query(self): return True
    def synchronize(self): pass


class Stream:
    cuda_stream = 7


class Mapping:
    def __init__(self, bases): self._b = bases
    def bases(self, device): return self._b


class Owner:
    def __init__(self, registry, ring):
        self._registry, self._ring = registry, ring
        self._progress = Progress(lambda: False)

    def _slot_ring(self): return self._ring


def build(tokens, page, layers=80, token_bytes=2048):
    pool = 2 * tokens
    registry = RegionRegistry()
    for i in range(2 * layers):
        registry.add(0x10000000 * (i + 1), pool * token_bytes, 0)
    peer_regions = {i: Region(i, 0x900000000 + 0x10000000 * i, pool * token_bytes, 1) for i in range(2 * layers)}
    ring = SlotRing(Api(), 0, torch.zeros(1 << 20, dtype=torch.int64), torch.zeros(1 << 20, dtype=torch.int64))
    owner = Owner(registry, ring)
    inbox = Inbox()
    peer = object.__new__(NvlinkPeer)
    cfg = NvlinkConfig()
    peer._owner, peer._config, peer.name, peer.regions = owner, cfg, "probe", peer_regions
    copy = stream_mod.CopyStream(Api(), 0, wait_current_stream=True)
    copy._stream = Stream()
    peer._copy = copy
    peer._mapping = Mapping(np.array([r.ptr for r in peer_regions.values()], dtype=np.int64))
    peer._queue = PendingQueue("probe", Outbox(inbox.name, 1.0, sender="probe"), 60.0)
    peer._closed = False
    peer._peer_sizes = RegionSizes(peer_regions)
    peer.tables = WriteTables(registry, peer._peer_sizes, peer._mapping, 0, cfg)
    peer._route = EngineRoute(cfg, "probe", None, None, peer._mapping)
    peer.pair_plans = PairCache(cfg.pair_plans, lambda: registry.sizes, lambda b: _plan(peer, b))
    rng = np.random.default_rng(0)
    row = page * token_bytes
    sp = rng.choice(np.arange(1, pool // page), tokens // page, replace=False)
    dp = rng.choice(np.arange(1, pool // page), tokens // page, replace=False)
    ids = np.arange(2 * layers)
    batch = StridedBatch(*(np.ascontiguousarray(a, dtype=np.int64) for a in (
        ids, np.zeros(2 * layers), np.full(2 * layers, row), ids, np.zeros(2 * layers), np.full(2 * layers, row),
        np.full(2 * layers, row))), sp.astype(np.int64), dp.astype(np.int64))
    return peer, batch, inbox


def _plan(peer, batch):
    from transport.nvlink.fastpath import build_plan
    from transport.nvlink.tables import base_table

    return build_plan(batch, peer._owner._registry.sizes, peer._peer_sizes, peer._owner._registry.derived(base_table),
                      peer._mapping.bases(0), lambda h: h, peer._config.kernel, pin=False)


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    page = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.cuda.Event = Event
    torch.cuda.current_stream = lambda device=None: Stream()
    kern.scatter_strided_split = lambda *a, **k: None
    peer, batch, inbox = build(tokens, page)
    for _ in range(50):
        peer.write_strided(batch, b"x").wait(1)
        inbox.poll()
    ts = []
    for _ in range(2000):
        t0 = time.perf_counter()
        peer.write_strided(batch, b"x")
        ts.append(time.perf_counter() - t0)
        peer._queue.advance()
        inbox.poll()
    print(f"direct path host time (no CUDA calls), {batch.num_pairs} pairs x {batch.num_slots} slots: "
          f"median {statistics.median(ts) * 1e6:.1f} us")
    ts = []
    for _ in range(2000):
        peer.write_strided(batch, b"x")
        t0 = time.perf_counter()
        peer._queue.advance()
        ts.append(time.perf_counter() - t0)
        inbox.poll()
    print(f"settling one transfer (query, alive, send): median {statistics.median(ts) * 1e6:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        peer.write_strided(batch, b"x")
        peer._queue.advance()
        inbox.poll()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
