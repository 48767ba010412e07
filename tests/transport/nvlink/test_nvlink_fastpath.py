"""The direct path of ``write_strided`` (``transport.nvlink.direct``): slot limits against the
full bounds check, the pair cache, the ring's bookkeeping, the split strided kernel under
Triton's interpreter, the progress thread waiting on events; and, on two GPUs (marked), many
direct writes of changing slots, bounds refused, the ring wrapping, regions changing."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from tests.transport._support import (
    LAYERS,
    SLOTS,
    TOKEN,
    assert_interpreted_ok,
    check_landed,
    kv_strided,
    local_pair,
)
from tests.transport.nvlink._nvlink_cpu import DropRecorder, StandInLander, stand_in_ipc, wait_until
from transport.base import Notification, Region, RegionRevoked, RegionSizes, StridedBatch, TransferStatus
from transport.nvlink import NvlinkTransport, parse_descriptor
from transport.nvlink.config import NvlinkConfig
from transport.nvlink.direct import NO_LIMIT, PairCache, RingSpace, check_slots, pair_key, slot_limits
from transport.nvlink.revoke import Hold, MailboxThread
from transport.nvlink.mailbox import Inbox, Outbox
from transport.nvlink.completion import PendingQueue
from transport.nvlink.completion import Progress
from transport.nvlink.completion import NvlinkTransfer


def _random_batch(rng, num_pairs=5, num_slots=7, regions=3, zero_stride=False):
    stride = rng.integers(0 if zero_stride else 1, 300, num_pairs)
    return StridedBatch.of(
        rng.integers(0, regions, num_pairs), rng.integers(0, 500, num_pairs), stride,
        rng.integers(0, regions, num_pairs), rng.integers(0, 500, num_pairs), rng.integers(0, 300, num_pairs),
        rng.integers(1, 200, num_pairs), rng.integers(0, 40, num_slots), rng.integers(0, 40, num_slots),
    )


def _in_bounds(b, local, remote) -> bool:
    try:
        b.check_bounds(local, remote)
    except ValueError:
        return False
    return True


# -- slot limits: one pass over the slots, the full check's verdict --------------------------------


@pytest.mark.parametrize("seed", range(60))
def test_slot_limits_agree_with_the_full_bounds_check(seed):
    rng = np.random.default_rng(1000 + seed)
    b = _random_batch(rng, num_pairs=int(rng.integers(1, 7)), num_slots=int(rng.integers(1, 9)),
                      zero_stride=seed % 3 == 0)
    local = {r: Region(r, 4096 * (r + 1), int(rng.integers(2000, 16000)), 0) for r in range(3)}
    remote = {r: Region(r, 4096 * (r + 1), int(rng.integers(2000, 16000)), 1) for r in range(3) if r != seed % 5}
    src_limit, dst_limit = slot_limits(b, RegionSizes(local), RegionSizes(remote))
    assert check_slots(b, src_limit, dst_limit) == _in_bounds(b, local, remote)
    # the limits are tight: one slot more on a side is refused by the full check too
    for side, limit in (("src", src_limit), ("dst", dst_limit)):
        if 0 <= limit < NO_LIMIT:
            slots = {"src_slot": b.src_slot, "dst_slot": b.dst_slot}
            other = "dst" if side == "src" else "src"
            slots[f"{other}_slot"] = np.zeros(1, dtype=np.int64)
            slots[f"{side}_slot"] = np.array([limit], dtype=np.int64)
            at = StridedBatch(*b.pairs, **slots)
            beyond = StridedBatch(*b.pairs, **{**slots, f"{side}_slot": np.array([limit + 1])})
            zero_ok = _in_bounds(StridedBatch(*b.pairs, np.zeros(1, np.int64),
                                              np.zeros(1, np.int64)), local, remote)
            assert _in_bounds(at, local, remote) == zero_ok
            assert not _in_bounds(beyond, local, remote)




def test_slot_limits_name_unknown_regions_and_zero_strides():
    local = RegionSizes({0: Region(0, 4096, 1000, 0)})
    remote = RegionSizes({0: Region(0, 4096, 1000, 1)})
    assert slot_limits(StridedBatch.of(0, 100, 100, 0, 0, 0, 50, [1], [1]), local, remote) == (8, NO_LIMIT)
    assert slot_limits(StridedBatch.of(0, 0, 10, 3, 0, 10, 50, [1], [1]), local, remote)[1] == -1  # unknown id
    assert slot_limits(StridedBatch.of(0, 990, 10, 0, 0, 10, 50, [1], [1]), local, remote)[0] == -1  # past it
    assert slot_limits(StridedBatch.of([], [], [], [], [], [], [], [1], [1]), local, remote) == (NO_LIMIT, NO_LIMIT)
    ok = StridedBatch.of(0, 100, 100, 0, 0, 10, 50, [1], [1])
    for name, bad in (("src_offset", -8), ("src_stride", -100)):  # past of()'s checks: no slot fits
        assert slot_limits(dataclasses.replace(ok, **{name: np.array([bad])}), local, remote)[0] == -1


def test_check_slots_refuses_negative_slots_even_past_of():
    b = StridedBatch.of(0, 0, 8, 0, 0, 8, 8, [1, 2], [3, 4])
    assert check_slots(b, 4, 4) and not check_slots(b, 1, 4) and not check_slots(b, 4, 3)
    neg = StridedBatch(*b.pairs, np.array([1, -1]), b.dst_slot)  # not through of()
    assert not check_slots(neg, 10, 10)
    assert check_slots(StridedBatch.of(0, 0, 8, 0, 0, 8, 8, [], []), -1, -1)  # no slots, nothing to check


# -- the pair cache -------------------------------------------------------------------------------


def test_pair_key_leaves_the_slots_out():
    a = StridedBatch.of([0, 1], 0, 64, [2, 3], 0, 64, 64, [1, 2], [3, 4])
    b = StridedBatch.of([0, 1], 0, 64, [2, 3], 0, 64, 64, [5, 6, 7], [1, 1, 1])
    c = StridedBatch.of([0, 1], 0, 64, [2, 3], 8, 64, 64, [1, 2], [3, 4])
    assert pair_key(a) == pair_key(b) != pair_key(c)


def test_pair_cache_builds_once_per_pair_set_and_forgets_on_region_change():
    gen = [object()]
    built = []

    def build(batch):
        built.append(pair_key(batch))
        return None if batch.length[0] == 13 else ("plan", len(built))

    cache = PairCache(2, lambda: gen[0], build)
    a = StridedBatch.of([0, 1], 0, 64, [2, 3], 0, 64, 64, [1, 2], [3, 4])
    a2 = StridedBatch.of([0, 1], 0, 64, [2, 3], 0, 64, 64, [9], [9])
    b = StridedBatch.of([0, 1], 0, 64, [2, 3], 0, 64, 32, [1], [1])
    c = StridedBatch.of([0], 0, 64, [2], 0, 64, 16, [1], [1])
    assert cache.get(a) == cache.get(a2) == ("plan", 1) and cache.builds == 1
    cache.get(b)
    cache.get(a)  # a most recent: c evicts b
    cache.get(c)
    assert len(cache) == 2 and cache.builds == 3
    cache.get(a)
    assert cache.builds == 3
    cache.get(b)
    assert cache.builds == 4
    gen[0] = object()  # the local regions changed: every plan is stale
    cache.get(a)
    assert cache.builds == 5
    bad = StridedBatch.of([0], 0, 64, [2], 0, 64, 13, [1], [1])
    assert cache.get(bad) is None and cache.get(bad) is None and cache.builds == 5  # never cached


def test_pair_cache_goes_by_the_bytes_not_the_arrays():
    """A read-only view of an array that changes is a new pair set (identity would be stale)."""
    built = []
    cache = PairCache(4, lambda: None, lambda b: built.append(1) or len(built))
    offsets = np.array([0, 64], dtype=np.int64)
    view = offsets.view()
    view.flags.writeable = False
    b = StridedBatch(np.array([0, 1]), view, np.array([64, 64]), np.array([2, 3]), np.array([0, 0]),
                     np.array([64, 64]), np.array([64, 64]), np.array([1]), np.array([2]))
    assert cache.get(b) == 1
    offsets[1] = 128  # the same read-only view now says something else
    assert cache.get(b) == 2 and len(built) == 2


# -- the ring's bookkeeping -------------------------------------------------------------------------


class _Fence:
    def __init__(self):
        self.passed = False


def _ring(capacity):
    waited = []

    def wait(f):
        waited.append(f)
        f.passed = True

    return RingSpace(capacity, lambda f: f.passed, wait), waited


def test_ring_hands_out_spans_in_order_and_wraps():
    ring, waited = _ring(100)
    fences = []
    starts = []
    for n in (30, 30, 30):
        starts.append(ring.take(n))
        fences.append(_Fence())
        ring.hold(starts[-1], fences[-1])
    assert starts == [0, 30, 60]
    fences[0].passed = True
    assert ring.take(20) == 0  # 10 left at the end: wraps to 0, span 0 has passed
    assert waited == [] and ring.waits == 0
    ring.hold(0, None)
    assert ring.take(20) == 20  # overlaps span [30, 60), still held: waits for its fence
    assert waited == [fences[1]] and ring.waits == 1
    ring.hold(20, _Fence())
    assert ring.take(0) == 40 and ring.live <= 4


def test_ring_starts_again_at_0_once_nothing_is_held():
    """Writes waited for one by one reuse the start of the ring (memory the last ones left in
    the cache) instead of walking through all of it; while a span is held, spans follow it."""
    ring, _ = _ring(100)
    first = ring.take(30)
    fence = _Fence()
    ring.hold(first, fence)
    assert ring.take(10) == 30  # the first still held: after it
    ring.hold(30, None)
    fence.passed = True
    assert ring.take(30) == 0 and ring.live == 1  # both passed: from 0 again


def test_ring_refuses_what_it_cannot_hold():
    ring, _ = _ring(10)
    assert ring.fits(10) and not ring.fits(11)
    with pytest.raises(ValueError, match="a span of 11 elements does not fit a ring of 10"):
        ring.take(11)
    start = ring.take(6)
    with pytest.raises(RuntimeError, match="taken again before its fence was given"):
        ring.take(6)  # wraps onto the span just taken, which has no fence yet
    ring.hold(start, None)
    assert ring.take(6) == 0
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        RingSpace(0, bool, print)


def test_ring_renews_only_its_newest_fenced_span_and_gives_back_the_old_fence():
    """A renewed span is held by its new fence, or, given None, by its old one again; only the
    newest span with a fence can be renewed."""
    ring, waited = _ring(100)
    a = ring.take(20)
    assert not ring.renew(a, a + 20)  # taken, no fence yet
    old = _Fence()
    ring.hold(a, old)
    assert not ring.renew(a, a + 10) and ring.renew(a, a + 20)
    assert not ring.renew(a, a + 20)  # taken again, not yet fenced
    ring.hold(a, None)  # the write that renewed it failed: the old fence holds it again
    assert ring.take(90) == 0 and waited == [old]  # wraps onto it: waits for that fence
    ring.hold(0, None)
    b = ring.take(20)
    first, second = _Fence(), _Fence()
    ring.hold(b, first)
    assert ring.renew(b, b + 20)
    ring.hold(b, second)  # the new fence replaces the old one
    c = ring.take(50)
    assert not ring.renew(b, b + 20)  # a span was taken since
    ring.hold(c, None)
    waited.clear()
    ring.take(100)
    assert waited == [second]


def test_ring_never_hands_out_a_span_whose_fence_is_pending():
    """Random sizes, fences passing in order at random times: no two live spans overlap."""
    rng = np.random.default_rng(4)
    ring, _ = _ring(64)
    live = []  # (start, end, fence)
    for _ in range(2000):
        n = int(rng.integers(0, 40))
        start = ring.take(n)
        pending = [(s, e) for s, e, f in live if not f.passed and e > s]
        assert all(e <= start or start + n <= s for s, e in pending) or n == 0
        f = _Fence()
        ring.hold(start, f)
        live.append((start, start + n, f))
        for s, e, g in live[: int(rng.integers(0, 3))]:
            g.passed = True
        live = [x for x in live if not x[2].passed][-40:]


# -- the split strided kernel under Triton's interpreter --------------------------------------------

_SPLIT_SCRIPT = r"""
import numpy as np, torch
from transport.nvlink import kernel as kern
from tests.transport._expected import disjoint_strided_batch, kernel_buffers, landed
rng, src, dst, src_base, dst_base = kernel_buffers(8)
ring = torch.full((64,), -7, dtype=torch.int64)  # the slots of other writes around this one's
for unit, stride, cfg in ((16, 320, kern.KernelConfig(tile_bytes=256, max_block_c_bytes=32)),
                          (1, 203, kern.KernelConfig(tile_bytes=64, max_block_c_bytes=16, max_programs=3))):
    P, S = 4, 5
    b = disjoint_strided_batch(rng, unit, stride, P, S)
    length = b.length
    for d in dst:
        d.random_(0, 256)
    want = landed(src, dst, b)
    pairs = b.pairs
    empty = np.zeros(0, dtype=np.int64)
    pair_table = torch.from_numpy(kern.build_strided_table(src_base, dst_base, pairs, empty, empty))
    base = 17
    ring[base:base + S] = torch.from_numpy(b.src_slot)
    ring[base + S:base + 2 * S] = torch.from_numpy(b.dst_slot)
    path = kern.choose_path(pair_table.numpy())
    assert path.value == unit, (path, unit)
    plan = kern.plan_shape(int(length.max()), path, cfg)  # as the direct path launches: any number of rows
    kern.scatter_strided_split(pair_table, ring, base, P, S, plan, "cpu")
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("split", unit, (d != w).nonzero()[:5])
    # the staged form: [6 P] resident, each chunk gathered into a staging buffer and scattered from it
    for d in dst:
        d.random_(0, 256)
    want = landed(src, dst, b)
    staged_table = torch.from_numpy(kern.build_strided_table(src_base, dst_base, pairs, empty, empty, staged=True))
    stage = torch.zeros(int(length.sum()) * S + 16, dtype=torch.uint8)
    flat_off = np.concatenate([[0], np.cumsum(np.repeat(length, S))])  # [P * S + 1] off(r), pair-major
    for a, e in ((0, 7), (7, 8), (8, P * S)):  # chunks of rows, each from the buffer's start
        for mode in (kern.StageMode.GATHER, kern.StageMode.SCATTER):
            kern.scatter_strided_split(staged_table, ring, base, P, S, plan, "cpu", begin=a, end=e,
                                       stage=kern.Stage(mode, stage.data_ptr(), int(flat_off[a])))
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("staged split", unit, (d != w).nonzero()[:5])
print("SPLIT-KERNEL-OK")
"""


def test_split_strided_kernel_under_triton_interpreter():
    """The pair part and the slot part apart (the slots at an offset of a ring): the same bytes
    as the reference; and in the staged form, chunks through a staging buffer."""
    assert_interpreted_ok(_SPLIT_SCRIPT, "SPLIT-KERNEL-OK")


@pytest.mark.parametrize("max_programs", [0, 3, 132])
@pytest.mark.parametrize("max_len", [1, 16, 256, 2048, 32768, 131072])
def test_plan_shape_launches_any_row_count_as_plan_launch_does(max_programs, max_len):
    from transport.nvlink import kernel as kern

    cfg = kern.KernelConfig(max_programs=max_programs)
    for path in kern.CopyPath:
        shape = kern.plan_shape(max_len, path, cfg)
        for rows in (1, 7, 160, 1000, 163840, 2_621_440):
            full = kern.plan_launch(rows, max_len, path, cfg)
            tiles = -(-rows // shape.block_r)
            grid = min(shape.num_programs, tiles) if shape.num_programs else tiles
            assert (shape.block_r, shape.block_c, tiles, grid) == (full.block_r, full.block_c, full.num_tiles,
                                                                    full.num_programs)


_ENQUEUE_SCRIPT = r"""
import ctypes, numpy as np, torch
from transport.base import RegionSizes, Region, StridedBatch
from tests.transport._expected import landed
from transport.nvlink import kernel as kern
from transport.nvlink import direct
from transport.nvlink.direct import SlotRing, build_plan, check_slots

class Api:  # the CUDA runtime calls of the direct path, on host memory (copies at once)
    copies = 0
    def get_device(self): return 0
    def set_device(self, d): raise AssertionError("the device is current already")
    def event_create(self): return object()
    def event_record(self, e, s): pass
    def stream_wait_event(self, s, e): pass
    def memcpy_async(self, dst, src, n, s):
        Api.copies += 1
        ctypes.memmove(dst, src, n)

class Event:  # torch.cuda.Event: the copy ran at once
    def record(self, stream): self.stream = stream
    def query(self): return True
    def synchronize(self): pass

class Stream:
    cuda_stream = 7

torch.cuda.Event = Event
api = Api()
copy = direct.CopyStream(api, 0, wait_current_stream=False)
copy._stream = Stream()
ring = SlotRing(api, 0, torch.zeros(48, dtype=torch.int64), torch.full((48,), -1, dtype=torch.int64))
rng = np.random.default_rng(2)
src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (4096, 4096)]
dst = [torch.randint(0, 256, (4096,), dtype=torch.uint8) for _ in range(3)]
sizes_src = RegionSizes({i: Region(i, t.data_ptr(), t.numel(), 0) for i, t in enumerate(src)})
sizes_dst = RegionSizes({i: Region(i, t.data_ptr(), t.numel(), 1) for i, t in enumerate(dst)})
src_base = np.array([t.data_ptr() for t in src]); dst_base = np.array([t.data_ptr() for t in dst])
cfg = kern.KernelConfig(tile_bytes=256, max_block_c_bytes=64)
# three pairs of 64 B rows in 256 B slots (pair p writes bytes [64 p, +64) of each destination slot)
pairs = dict(src_region=[0, 1, 1], src_offset=[0, 64, 128], src_stride=256, dst_region=[0, 2, 1],
             dst_offset=[0, 64, 128], dst_stride=256, length=64)
plans = []
for i in range(12):  # slots change per write; the ring (48) wraps every few writes
    S = int(rng.integers(1, 9))
    b = StridedBatch.of(*pairs.values(), rng.choice(16, S, replace=False), rng.choice(16, S, replace=False))
    if not plans:
        plans.append(build_plan(b, sizes_src, sizes_dst, src_base, dst_base, lambda h: h.clone(), cfg, pin=False))
    plan = plans[0]
    assert check_slots(b, plan.src_limit, plan.dst_limit), (plan.src_limit, plan.dst_limit)
    want = landed(src, dst, b)
    start, fits = ring.stage(b.src_slot, b.dst_slot, plan.src_limit, plan.dst_limit)
    assert fits
    event = copy.enqueue_split(plan, S, ring, start, 4)
    assert isinstance(event, Event) and event.stream is copy._stream
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("enqueue_split", i, (d != w).nonzero()[:5])
assert plan.src_limit == 15 and plan.dst_limit == 15
assert Api.copies == 12 and ring.space.live <= 12
# layer by layer: other pair sets, the same slots; the first write's span serves the next ones
layer_pairs = [dict(pairs, src_region=[1, 0, 0], src_offset=[192, 0, 64], dst_region=[2, 1, 0],
                    dst_offset=[192, 0, 64]), dict(pairs, dst_region=[1, 1, 2])]
slots = rng.choice(16, 6, replace=False), rng.choice(16, 6, replace=False)
start = None
for i, lp in enumerate([pairs] + layer_pairs):
    b = StridedBatch.of(*lp.values(), *slots)
    plan = build_plan(b, sizes_src, sizes_dst, src_base, dst_base, lambda h: h.clone(), cfg, pin=False)
    want = landed(src, dst, b)
    again = ring.reuse(b.src_slot, b.dst_slot, plan.src_limit, plan.dst_limit)
    assert (again is None) == (i == 0), (i, again)
    if again is None:
        start, fits = ring.stage(b.src_slot, b.dst_slot, plan.src_limit, plan.dst_limit)
        ring.dev[start:start + 12] = -1  # what the upload must replace
    else:
        assert again == start
        ring.host[start:start + 12] = 99  # the kernel reads the GPU's ring, uploaded by the first write
    copy.enqueue_split(plan, 6, ring, start, 4, upload=again is None)
    ring.host[start:start + 12] = torch.from_numpy(np.concatenate(slots))  # as the host ring holds them
    ring.keep(start, 6, plan.src_limit, plan.dst_limit)
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("layer", i, (d != w).nonzero()[:5])
assert Api.copies == 13
too_far = StridedBatch.of(*pairs.values(), [16], [0])
assert not check_slots(too_far, plan.src_limit, plan.dst_limit)
for src, dst, fits in (([3, -1], [2, 5], False), ([3, 1], [2, -5], False),  # negative: past any limit
                       ([15, 1], [2, 5], True), ([16, 1], [2, 5], False), ([1], [15], True), ([1], [16], False)):
    start, ok = ring.stage(np.array(src), np.array(dst), plan.src_limit, plan.dst_limit)
    assert ok is fits, (src, dst)
    ring.space.hold(start, None)
    start, ok = ring.stage(np.array(src), np.array(dst), plan.src_limit, plan.dst_limit + 1000)  # limits differ
    assert ok is (fits or (max(dst) >= 16 and min(dst) >= 0 and 0 <= min(src) and max(src) <= 15)), (src, dst)
    ring.space.hold(start, None)
long = np.arange(40) % 16  # past the short lists: a ufunc reduction
start, ok = ring.stage(long[:20], long[20:], plan.src_limit, plan.dst_limit)
assert ok
ring.space.hold(start, None)
start, ok = ring.stage(long[:20], np.concatenate([long[20:39], [16]]), plan.src_limit, plan.dst_limit)
assert not ok
ring.space.hold(start, None)
print("ENQUEUE-OK")
"""


def test_direct_enqueue_on_host_memory_under_triton_interpreter():
    """The direct path's enqueue (``CopyStream.enqueue_split``: the ring, the slot upload, the
    split kernel, the event) with the CUDA calls standing in on host memory: every write of
    changing slots lands exactly, the ring wrapping."""
    assert_interpreted_ok(_ENQUEUE_SCRIPT, "ENQUEUE-OK")


def test_split_tables_checks_name_what_was_expected():
    import torch

    from transport.nvlink import kernel as kern

    pairs = torch.zeros(10, dtype=torch.int64)
    ring = torch.zeros(16, dtype=torch.int64)
    kern.check_split_tables(pairs, ring, 2, 4, 6, "cpu")
    with pytest.raises(ValueError, match=r"slot part \[6, \+12\) runs past slots of 16 elements"):
        kern.check_split_tables(pairs, ring, 2, 6, 6, "cpu")
    with pytest.raises(ValueError, match="slots must be a contiguous 1-D int64 tensor"):
        kern.check_split_tables(pairs, ring.int(), 2, 0, 1, "cpu")
    with pytest.raises(TypeError, match="slots must be a torch.Tensor, got ndarray"):
        kern.check_split_tables(pairs, ring.numpy(), 2, 0, 1, "cpu")
    with pytest.raises(ValueError, match=r"table must have shape \[5 \* 3 \+ 2 \* 0\] = \[15\], got \[10\]"):
        kern.check_split_tables(pairs, ring, 3, 0, 1, "cpu")


def test_config_checks_the_direct_path_settings():
    assert NvlinkConfig(slot_ring_bytes=0).slot_ring_bytes == 0
    with pytest.raises(ValueError, match="slot_ring_bytes must be a multiple of 8"):
        NvlinkConfig(slot_ring_bytes=12)
    with pytest.raises(ValueError, match="pair_plans must be an int >= 1, got 0"):
        NvlinkConfig(pair_plans=0)


# -- the progress thread waits on the oldest event, and wait() sleeps until settled ------------------


class _BlockingEvent:
    """Stands in for ``torch.cuda.Event``: ``synchronize()`` blocks until ``fire()``."""

    def __init__(self):
        self._fired = threading.Event()
        self.synchronized = 0

    def fire(self):
        self._fired.set()

    def query(self) -> bool:
        return self._fired.is_set()

    def synchronize(self) -> None:
        self.synchronized += 1
        self._fired.wait(10)


@pytest.fixture
def settling():
    """A mailbox, a pending queue writing to it and a progress thread over the queue."""
    inbox = Inbox()
    queue = PendingQueue("cpu-peer", Outbox(inbox.name, 1.0, sender="cpu-writer"), transfer_timeout_s=30)
    progress = Progress(queue.advance, queue.oldest_event)
    yield inbox, queue, progress
    progress.stop()
    queue.outbox.close()
    inbox.close()


def test_progress_sends_the_notification_once_the_event_fires_without_polling(settling):
    inbox, queue, progress = settling
    event = _BlockingEvent()
    t = queue.track(NvlinkTransfer(queue, event, b"landed"))
    progress.wake()
    wait_until("the progress thread waiting on the event", lambda: event.synchronized > 0)
    assert t._status is TransferStatus.PENDING and event.synchronized == 1  # one wait, no polling loop
    waiter = threading.Thread(target=t.wait, kwargs={"timeout": 30})
    waiter.start()
    event.fire()
    waiter.join(30)
    assert not waiter.is_alive() and t.status() is TransferStatus.DONE
    got, deadline = [], time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = inbox.poll()
    assert [n.payload for n in got] == [b"landed"]


def test_with_a_lander_progress_sleeps_until_it_passes_the_number_not_on_the_event(settling):
    """Where a lander stores the landed word, its thread watches the copy: the progress thread
    waits for the lander to pass the notification's number and never spins on the event."""
    inbox, queue, progress = settling
    lander = StandInLander(None)
    queue.outbox.land_with(lambda word: setattr(lander, "word", word) or lander)
    event = _BlockingEvent()
    t = queue.track(NvlinkTransfer(queue, event, b"landed"))
    progress.wake()
    wait_until("the progress thread waiting on the lander", lambda: lander.awaited > 0)
    waiter = threading.Thread(target=t.wait, kwargs={"timeout": 30})
    waiter.start()
    time.sleep(0.03)  # room for a wrong early end (the next line would see it)
    assert t._status is TransferStatus.PENDING
    event.fire()
    lander.complete(1)
    waiter.join(30)
    assert not waiter.is_alive() and t.status() is TransferStatus.DONE
    assert event.synchronized == 0
    got, deadline = [], time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = inbox.poll()
    assert [n.payload for n in got] == [b"landed"]


def test_every_waiter_wakes_when_the_transfer_settles(settling):
    _, queue, progress = settling
    event = _BlockingEvent()
    t = queue.track(NvlinkTransfer(queue, event, b"landed"))
    progress.wake()
    woke = []
    waiters = [threading.Thread(target=lambda: (t.wait(timeout=30), woke.append(1))) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.05)  # room for a wrong early wake (the next line would see it)
    assert woke == []
    event.fire()
    for w in waiters:
        w.join(30)
    assert woke == [1, 1, 1]
    t.wait(timeout=0.01)  # settled: returns at once, however often
    t.wait(timeout=0.01)


def test_a_peer_lost_before_completion_fails_the_transfer_with_or_without_a_notification():
    """The peer's inbox closes while three copies run; the transport's mailbox thread reads the
    end of the connection (as in production): the copy whose notification was announced before
    fails at its release, the one whose notification was not yet sent at the send, the one
    without at the look at the peer."""
    inbox = Inbox()
    queue = PendingQueue("cpu-peer", Outbox(inbox.name, 1.0, sender="cpu-writer"), transfer_timeout_s=5)
    mailbox = MailboxThread()
    mailbox.add(Hold("cpu-peer", queue, DropRecorder()))
    try:
        announced = queue.track(NvlinkTransfer(queue, _BlockingEvent(), b"announced"))
        assert queue.advance() and announced._number == 1
        tagged = queue.track(NvlinkTransfer(queue, _BlockingEvent(), b"landed"))
        silent = queue.track(NvlinkTransfer(queue, _BlockingEvent(), None))
        inbox.close()
        wait_until("the mailbox thread reading the end", lambda: not queue.outbox.alive())
        for t in (announced, tagged, silent):
            t._event.fire()
        assert [t.status() for t in (announced, tagged, silent)] == [TransferStatus.FAILED] * 3
        assert announced.error.startswith("peer 'cpu-peer' lost by the time the copy completed")
        assert "peer 'cpu-peer' lost while sending the notification" in tagged.error
        assert silent.error == "peer 'cpu-peer' lost by the time the copy completed"
    finally:
        mailbox.stop()  # closes the outbox


def test_wait_times_out_and_fails_at_the_deadline_without_the_progress_thread():
    """A wait shorter than the copy's deadline raises TransferTimeout (the transfer still
    pending); a longer one ends when the deadline fails the transfer."""
    inbox = Inbox()
    queue = PendingQueue("cpu-peer", Outbox(inbox.name, 1.0, sender="cpu-writer"), transfer_timeout_s=30.0)
    try:
        from transport.base import TransferFailed, TransferTimeout

        t = queue.track(NvlinkTransfer(queue, _BlockingEvent(), None))
        with pytest.raises(TransferTimeout, match="still pending after 0.05 s"):
            t.wait(timeout=0.05)
        assert t.status() is TransferStatus.PENDING
        queue.transfer_timeout_s = 0.2
        t = queue.track(NvlinkTransfer(queue, _BlockingEvent(), None))
        with pytest.raises(TransferFailed, match="did not complete within 0.2 s"):
            t.wait(timeout=30)  # a backstop: the copy's deadline ends it
    finally:
        queue.outbox.close()
        inbox.close()


class _Yielding(Progress):
    """Progress whose flags hand the GIL over at every read and write: the writer's and the
    thread's steps interleave at exactly the points where a wake could be lost."""

    def _flag(name):  # noqa: N805 -- a property factory in the class body
        def get(self):
            time.sleep(0)
            return self.__dict__[name]

        def put(self, value):
            time.sleep(0)
            self.__dict__[name] = value

        return property(get, put)

    _idle = _flag("idle")
    _kicked = _flag("kicked")


def test_progress_wake_is_never_lost_while_the_thread_goes_to_sleep():
    """A write wakes the thread with a flag while it runs and a notify only while it sleeps: a
    wake that comes while the thread is on its way to sleep is still seen. Each write comes as
    soon as the one before was seen (the thread then heads for sleep), the GIL changing hands at
    each flag; a lost wake leaves its write unseen."""
    lock, pending, seen = threading.Lock(), [], []

    def advance():
        with lock:
            seen.extend(pending)
            pending.clear()
        return False

    progress = _Yielding(advance)
    try:
        for i in range(2000):
            with lock:
                pending.append(i)
            progress.wake()
            deadline = time.monotonic() + 30  # a backstop: a lost wake is never seen
            while len(seen) <= i and time.monotonic() < deadline:
                time.sleep(0)
            assert len(seen) == i + 1, f"write {i} not seen: its wake was lost"
    finally:
        progress.stop()


# -- two processes on two GPUs: the direct path ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.multigpu
def test_direct_path_writes_changing_slots_exactly(remote):
    """Many writes of one pair set with different slots: one plan, every write's bytes exact,
    its notification after them; page 16 and head slices (a second plan)."""
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote, 2 * LAYERS, buf_bytes)
    try:
        peer.plan_pairs(kv_strided(sorted(src), dst_rids, 1, False, np.random.default_rng(0)))  # as at handshake
        assert peer.pair_plans.builds == 1
        with pytest.raises(ValueError, match=r"batch pair 0: destination \(peer\) range \[522240, 526336\) is outside"):
            peer.plan_pairs(StridedBatch.of(sorted(src)[0], 0, TOKEN, dst_rids[0], buf_bytes - 2048, TOKEN, 4096,
                                            [1], [1]))
        for i, (page, head) in enumerate([(1, False), (1, False), (1, False), (16, False), (1, True), (1, True)]):
            b = kv_strided(sorted(src), dst_rids, page, head, np.random.default_rng(50 + i), tokens=32 + 8 * i)
            remote.fill(dst_rids, 0x5A)
            tr = peer.write_strided(b, notify=b"direct %d" % i)
            tr.wait(timeout=60)
            assert tr.status() is TransferStatus.DONE
            check_landed(remote, src, dst_rids, b.expand(), buf_bytes, b"direct %d" % i, sender=t.name)
        assert peer.pair_plans.builds == 3  # page 1, page 16, head slices: one plan each
        from transport.nvlink import kernel as kern

        assert kern._KERNELS[(False, "_scatter_strided_body")].direct_launches > 0  # past the JIT
        with pytest.raises(ValueError, match=r"batch pair \d+: destination \(peer\) range .* is outside region"):
            peer.write_strided(StridedBatch.of(sorted(src), 0, TOKEN, dst_rids, 0, TOKEN, TOKEN, [1], [SLOTS]))
        with pytest.raises(ValueError, match=r"batch pair 0: source \(local\) region 999 is not registered"):
            peer.write_strided(StridedBatch.of(999, 0, TOKEN, dst_rids[0], 0, TOKEN, TOKEN, [1], [1]))
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_direct_path_ring_wraps_under_many_writes_in_flight(remote):
    """A ring of 64 slots and writes of 10: it wraps many times with writes in flight; every
    notification arrives in order and the last write's bytes are exact."""
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote, 4, buf_bytes, NvlinkConfig(slot_ring_bytes=64 * 8))
    try:
        rng = np.random.default_rng(3)
        transfers, batches = [], []
        for i in range(40):
            b = StridedBatch.of(sorted(src), 0, TOKEN, dst_rids, 0, TOKEN, TOKEN,
                                rng.choice(np.arange(1, SLOTS), 5, replace=False),
                                rng.choice(np.arange(1, SLOTS), 5, replace=False))
            transfers.append(peer.write_strided(b, notify=b"ring %d" % i))
            batches.append(b)
        for tr in transfers:
            tr.wait(timeout=60)
        assert t._ring.space.waits > 0 or t._ring.space.live <= 6
        remote.fill(dst_rids, 0x5A)
        tr = peer.write_strided(batches[-1], notify=b"ring last")
        tr.wait(timeout=60)
        check_landed(remote, src, dst_rids, batches[-1].expand(), buf_bytes, b"ring last", sender=t.name)
        for i in range(40):
            assert remote.wait_notify(b"ring %d" % i, 10.0) == t.name
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_direct_path_follows_region_changes_and_can_be_off(remote):
    """A region registered after a plan was built empties the cache (its bases may move); with
    ``slot_ring_bytes=0`` writes take the general path, with the same bytes."""
    import torch

    buf_bytes = SLOTS * TOKEN
    for config in (NvlinkConfig(), NvlinkConfig(slot_ring_bytes=0)):
        t, peer, src, dst_rids = local_pair(remote, 2, buf_bytes, config)
        try:
            b = StridedBatch.of(sorted(src), 0, TOKEN, dst_rids, 0, TOKEN, TOKEN, [1, 2, 3], [4, 5, 6])
            peer.write_strided(b, notify=b"before").wait(timeout=60)
            extra = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
            t.register_tensor(extra)
            remote.fill(dst_rids, 0x5A)
            peer.write_strided(b, notify=b"after").wait(timeout=60)
            check_landed(remote, src, dst_rids, b.expand(), buf_bytes, b"after", sender=t.name)
            assert peer.pair_plans.builds == (2 if config.slot_ring_bytes else 0)
        finally:
            t.close()


# -- the peer's direct path with CUDA standing in (no GPU): what it launches, when it steps aside -------


class _Api:
    def get_device(self): return 0
    def set_device(self, d): raise AssertionError("the device is current already")
    def event_create(self): return object()
    def event_record(self, e, s): pass
    def stream_wait_event(self, s, e): pass
    def memcpy_async(self, dst, src, n, s): self.copies.append((dst, src, n, s))


class _DoneEvent:
    def record(self, stream): pass
    def query(self): return True
    def synchronize(self): pass


class _Stream:
    cuda_stream = 7


class _Owner:
    def __init__(self, registry, ring):
        self._registry, self._ring = registry, ring
        self._progress = Progress(lambda: False)
        self._mailbox = MailboxThread()  # reads the peer owner's answers and the end of the connection

    def _slot_ring(self):
        return self._ring


class _Mapping(DropRecorder):
    """The peer's regions as mapped: their bases; the regions its revokes unmapped."""

    def __init__(self, bases):
        super().__init__()
        self._bases = bases

    def bases(self, device):
        return self._bases


@pytest.fixture
def fake_peer(monkeypatch):
    """An ``NvlinkPeer`` over stand-ins for CUDA (runtime calls, stream, event, launch: recorded)
    connected as in production to a real owner: an ``NvlinkTransport`` named "fake" exporting 4
    host arrays of 64 KiB through stand-in IPC (:mod:`tests.transport.nvlink._nvlink_cpu`), whose
    mailbox answered the peer's Hello; the peer's hold is read by a real mailbox thread. 4 local
    regions of 64 KiB, a ring of 64 slots. Yields the peer, the launches, the batches the
    general path took, the owner and the runtime stand-in."""
    import torch

    from transport.nvlink import kernel as kern
    from transport.nvlink import direct
    from transport.nvlink.direct import SlotRing, build_plan
    from transport.nvlink.transport import NvlinkPeer
    from transport.nvlink.prepare import EngineRoute
    from transport.nvlink.prepare import WriteTables, base_table
    from transport.registry import RegionRegistry

    launches = []
    monkeypatch.setattr(torch.cuda, "Event", _DoneEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(kern, "scatter_strided_split", lambda *a, **k: launches.append(a))
    registry = RegionRegistry()
    for i in range(4):
        registry.add(0x100000 * (i + 1), 1 << 16, 0)
    stand_in_ipc(monkeypatch)
    remote = NvlinkTransport(NvlinkConfig(), name="fake")
    memory = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(4)]
    assert [remote.register(m.ctypes.data, m.nbytes, device=0) for m in memory] == [0, 1, 2, 3]
    body, regions, _ = parse_descriptor(remote.export())
    api = _Api()
    api.copies = []
    ring = SlotRing(api, 0, torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64))
    peer = object.__new__(NvlinkPeer)
    cfg = NvlinkConfig()
    peer._owner, peer._config, peer.name, peer.regions = _Owner(registry, ring), cfg, body["name"], regions
    peer._copy = direct.CopyStream(api, 0, wait_current_stream=True)
    peer._copy._stream = _Stream()
    peer._mapping = _Mapping(np.array([regions[i].ptr for i in range(4)], dtype=np.int64))
    peer._queue = PendingQueue("fake", Outbox(body["mailbox"], 1.0, sender="fake-writer", regions=regions), 60.0)
    peer._hold = Hold("fake", peer._queue, peer._mapping)
    peer._owner._mailbox.add(peer._hold)
    peer._closed = False
    peer._peer_sizes = RegionSizes(regions)
    peer.tables = WriteTables(registry, peer._peer_sizes, peer._mapping, 0, cfg)
    peer._route = EngineRoute(cfg, "fake", None, None, peer._mapping)
    peer.pair_plans = PairCache(cfg.pair_plans, lambda: registry.sizes, lambda b: build_plan(
        b, registry.sizes, peer._peer_sizes, registry.derived(base_table), peer._mapping.bases(0), lambda h: h,
        cfg.kernel, pin=False))
    general = []
    monkeypatch.setattr(peer, "_write", lambda batch, notify, engine=None: general.append(batch) or "general")
    wait_until("the owner's answer to the hold", lambda: remote.poll_notifications() == [] and peer._hold.acked)
    yield peer, launches, general, remote, api
    peer._owner._mailbox.remove(peer._hold)
    peer._owner._mailbox.stop()
    remote.close()
    peer._owner._progress.stop()


def _kv(slots_src, slots_dst, pairs=4, row=1024):
    return StridedBatch.of(np.arange(pairs), 0, row, np.arange(pairs), 0, row, row, slots_src, slots_dst)


def test_direct_path_launches_once_over_the_resident_pairs_and_notifies(fake_peer):
    peer, launches, general, remote, api = fake_peer
    for i, (s, d) in enumerate((([1, 5, 9], [2, 3, 4]), ([7], [63]), ([0, 1], [10, 11]))):
        tr = peer.write_strided(_kv(s, d), b"n%d" % i)
        tr.wait(timeout=5)
        assert tr.status() is TransferStatus.DONE
    assert general == [] and peer.pair_plans.builds == 1
    pairs_table, ring_dev, start, num_pairs, num_slots, plan = launches[-1][:6]
    assert (num_pairs, num_slots) == (4, 2) and plan.block_r >= 1
    assert [n for _, _, n, _ in api.copies] == [8 * 6, 8 * 2, 8 * 4]  # 2 S slots each, nothing else per write
    np.testing.assert_array_equal(pairs_table[:4], 0x100000 * np.arange(1, 5))  # source bases of slot 0
    got, deadline = [], time.monotonic() + 30
    while len(got) < 3 and time.monotonic() < deadline:
        got += remote.poll_notifications()
    assert got == [Notification("fake-writer", b"n%d" % i) for i in range(3)]


def test_a_request_written_layer_by_layer_builds_each_layers_plan_once(fake_peer):
    """80 layers' pair sets in turn, three requests over them: with the default config each
    plan is built at its first write and found after (a cache smaller than the cycle, 64 as
    before, rebuilt every write of it). A request's slots go up once for all its layers: each
    layer's write reads the span of the one before (other slots: a span and an upload again)."""
    peer, launches, general, remote, api = fake_peer
    layers = [StridedBatch.of([k % 4, (k + 1) % 4], 0, 1024, [k % 4, (k + 2) % 4], 0, 1024, 8 * (k + 1), [1, 2],
                              [3, 4]) for k in range(80)]  # as a model's layers: one layout, so one slot limit
    assert len({pair_key(b) for b in layers}) == 80 and peer._config.pair_plans >= 80
    ring = peer._owner._slot_ring()
    for r in range(3):
        slots = (np.array([1, 2]), np.array([3, 4])) if r < 2 else (np.array([5, 2]), np.array([3, 4]))
        transfers = [peer.write_strided(StridedBatch(*b.pairs, *slots)) for b in layers]
    for t in transfers:
        t.wait(timeout=5)
    assert general == [] and len(launches) == 240 and peer.pair_plans.builds == 80
    assert [n for _, _, n, _ in api.copies] == [32, 32]  # the first request's slots, the third's
    assert len({a[2] for a in launches[:160]}) == len({a[2] for a in launches[160:]}) == 1  # every layer: one span
    assert ring.host[launches[-1][2]:][:4].tolist() == [5, 2, 3, 4] and ring.space.live <= 2
    small = PairCache(64, lambda: None, lambda b: object())
    for _ in range(3):
        for b in layers:
            small.get(b)
    assert small.builds == 240


def test_a_write_announces_before_it_returns_and_settles_a_copy_already_done(fake_peer, monkeypatch):
    """The call makes the first look at the FIFO: a copy that ended before the call returns is
    DONE with its notification released and no progress thread woken; a copy still running has
    its notification announced (the receiver holds it) and the progress thread woken."""
    import torch

    peer, _, _, remote, _ = fake_peer
    tr = peer.write_strided(_kv([1], [2]), b"short")
    assert tr._status is TransferStatus.DONE and peer._owner._progress._thread is None
    wait_until("the short write's notification", lambda: remote.poll_notifications() == [
        Notification("fake-writer", b"short")])

    ended = threading.Event()

    class _Running(_DoneEvent):
        def query(self): return ended.is_set()

    monkeypatch.setattr(torch.cuda, "Event", _Running)
    tr = peer.write_strided(_kv([3], [4]), b"long")
    assert tr._status is TransferStatus.PENDING and peer._queue.outbox._announced == 2
    assert peer._owner._progress._thread is not None  # woken for what is pending
    assert remote.poll_notifications() == []  # announced, held until the copy lands
    ended.set()
    tr.wait(timeout=5)
    assert tr.status() is TransferStatus.DONE
    wait_until("the long write's notification", lambda: remote.poll_notifications() == [
        Notification("fake-writer", b"long")])


def test_direct_path_launches_through_the_plans_bound_launch(fake_peer):
    """A plan built with a launcher (the GPU peer's: ``kernel.SplitLaunch`` over the ring) is
    launched through it with the ring span's start and the slot count, nothing else."""
    from transport.nvlink.direct import build_plan
    from transport.nvlink.prepare import base_table

    peer, launches, general, _, _ = fake_peer
    bound = []
    registry = peer._owner._registry
    peer.pair_plans = PairCache(4, lambda: registry.sizes, lambda b: build_plan(
        b, registry.sizes, peer._peer_sizes, registry.derived(base_table), peer._mapping.bases(0), lambda h: h,
        peer._config.kernel, pin=False, bind=lambda table, p, shape: lambda start, n, stream: bound.append(
            (table is not None, p, start, n, stream.cuda_stream))))
    peer.write_strided(_kv([1, 2, 3], [4, 5, 6]), b"a").wait(timeout=5)
    peer.write_strided(_kv([7], [8]), b"b").wait(timeout=5)
    # the first write is done when the second comes: nothing held, so its span starts at 0 again
    assert bound == [(True, 4, 0, 3, 7), (True, 4, 0, 1, 7)] and launches == [] and general == []


def test_direct_path_refuses_slots_out_of_bounds_with_the_pair_named(fake_peer):
    peer, launches, general, _, _ = fake_peer
    with pytest.raises(ValueError, match=r"batch pair 0: destination \(peer\) range \[0, 66560\) is outside region 0 of 65536"):
        peer.write_strided(_kv([1], [64]))  # 64 x 1 KiB: one slot past the 64 KiB region
    neg = _kv([1], [2])
    neg = StridedBatch(*neg.pairs, np.array([-3]), neg.dst_slot)  # past of()'s check
    with pytest.raises(ValueError, match=r"batch source slots must lie in \[0, 63\] .*, got \[-3, -3\]"):
        peer.write_strided(neg)
    with pytest.raises(ValueError, match=r"batch pair 0: source \(local\) region 9 is not registered"):
        peer.write_strided(StridedBatch.of(9, 0, 1024, 0, 0, 1024, 1024, [1], [1]))
    assert launches == [] and general == []
    peer.write_strided(_kv(np.arange(30), np.arange(30))).wait(timeout=5)  # the refused spans were freed
    assert len(launches) == 1


def test_direct_path_steps_aside_for_the_general_path(fake_peer, monkeypatch):
    peer, launches, general, _, _ = fake_peer
    assert peer.write_strided(_kv(np.arange(33), np.arange(33))) == "general"  # 66 slots: past the ring of 64
    assert peer.write_strided(_kv([], [])) == "general"  # nothing to launch
    monkeypatch.setattr(peer._owner, "_slot_ring", lambda: None)  # slot_ring_bytes=0
    assert peer.write_strided(_kv([1], [1])) == "general"
    assert launches == [] and len(general) == 3


class _StandInLane:
    """A staged lane to GPU 1 standing in for CUDA: its ring of slots on the peer GPU (a CPU
    tensor) and :meth:`run`, which records the pipeline's chunks and upload and calls the
    gather and scatter launches of each chunk as the real lane does."""

    peer = 1
    scatter_stream = _Stream()

    def __init__(self):
        self.runs, self.launched, self.slots = [], [], None

    def peer_slots(self, capacity):
        import torch

        if self.slots is None:
            self.slots = torch.zeros(capacity, dtype=torch.int64)
        return self.slots

    def run(self, gather_stream, bounds, offsets, gather, scatter, upload=None):
        from transport.nvlink.kernel import Stage, StageMode

        self.runs.append((bounds.tolist(), offsets.tolist(), upload))
        for k in range(bounds.size - 1):
            a, b = int(bounds[k]), int(bounds[k + 1])
            gather(a, b, Stage(StageMode.GATHER, 0xA000, int(offsets[k])), gather_stream)
            scatter(a, b, Stage(StageMode.SCATTER, 0xB000, int(offsets[k])), self.scatter_stream)
        return _DoneEvent()

    def synchronize(self):
        pass


@pytest.fixture
def staged_peer(fake_peer):
    """``fake_peer`` whose peer sits on GPU 1 behind a stand-in lane (:class:`_StandInLane`),
    the staged engine's chunks cut at 2 KiB; its staged plans are built as the peer builds
    them, tables kept on the host and launches recorded as ``(mode, slot base, slots, rows,
    stage)``."""
    from transport.nvlink import staged
    from transport.nvlink.direct import StagedPart, build_plan
    from transport.nvlink.prepare import EngineRoute
    from transport.nvlink.prepare import base_table

    peer, launches, general, remote, api = fake_peer
    lane = _StandInLane()
    peer._config = dataclasses.replace(peer._config, staged=staged.StagedConfig(
        chunk_bytes=1 << 16, edge_bytes=1 << 16))
    peer._route = EngineRoute(peer._config, "fake", 1, lambda gpu: lane, peer._mapping)
    registry = peer._owner._registry

    def recorder(mode):
        def launch(slot_base, num_slots, stream, begin, end, stage):
            assert stage.mode.name == mode
            lane.launched.append((mode, slot_base, num_slots, (begin, end), stage.origin))
        return launch

    def stage(host, table, shape):
        return StagedPart(lane, host, recorder("GATHER"), recorder("SCATTER"))

    peer.staged_plans = PairCache(peer._config.pair_plans, lambda: registry.sizes, lambda b: build_plan(
        b, registry.sizes, peer._peer_sizes, registry.derived(base_table), peer._mapping.bases(1), lambda h: h,
        peer._config.kernel, pin=False, stage=stage))
    yield peer, lane, launches, general, api


def test_a_staged_write_takes_the_direct_path_over_its_resident_staged_pairs(staged_peer):
    """``engine=STAGED``: the pairs' staged form is built once per pair set (``[6 * P]``: the
    pair part and each pair's staging prefix); a write brings only its slots, staged once in
    the host ring and uploaded to both GPUs' rings at the same offset; the lane runs the chunks
    cut from the resident prefixes, which match the expanded rows' offsets; no direct launch,
    no general path."""
    from transport.nvlink.config import NvlinkEngine

    peer, lane, launches, general, api = staged_peer
    row, pairs = 1024, 4
    for src_slots, dst_slots in (([3, 1, 2], [0, 5, 9]), ([7, 8], [10, 11])):
        batch = _kv(src_slots, dst_slots, pairs, row)
        tr = peer.write_strided(batch, b"staged", engine=NvlinkEngine.STAGED)
        tr.wait(timeout=5)
        assert tr.status() is TransferStatus.DONE
        n = len(src_slots)
        bounds, offsets, upload = lane.runs[-1]
        start = (upload[1] - peer._owner._ring.addresses(0)[1]) // 8
        assert upload == (lane.slots.data_ptr() + 8 * start, peer._owner._ring.addresses(start)[1], 16 * n)
        flat = np.arange(pairs * n + 1) * row  # every row is 1 KiB: row r starts at r KiB
        assert bounds[0] == 0 and bounds[-1] == pairs * n and offsets == flat[bounds].tolist()
        assert [c[3] for c in lane.launched[-2 * (len(bounds) - 1):]] == [
            (a, b) for a, b in zip(bounds[:-1], bounds[1:]) for _ in range(2)]
        assert {c[1:3] for c in lane.launched[-2 * (len(bounds) - 1):]} == {(start, n)}  # the slots' place
        ring = peer._owner._ring
        assert ring.host[start: start + 2 * n].tolist() == src_slots + dst_slots
        assert api.copies[-1] == (*ring.addresses(start), 16 * n, _Stream.cuda_stream)  # up to the local ring
    plan = peer.staged_plans.get(batch)
    assert peer.staged_plans.builds == 1 and plan.host_table.numel() == 6 * pairs
    assert plan.host_table[5 * pairs:].tolist() == [0, row, 2 * row, 3 * row]  # the staging prefixes
    assert launches == [] and general == []


def test_a_staged_write_neither_reuses_nor_leaves_a_span_to_reuse(staged_peer):
    """The same slots written direct, staged, direct: the staged write stages and uploads its
    own (the lane's ring has only its own), and the direct write after it does too (the staged
    span's fence is the lane's, on another stream); two direct writes in a row share one."""
    from transport.nvlink.config import NvlinkEngine

    peer, lane, launches, general, api = staged_peer
    batch = _kv([1, 2], [3, 4])
    for engine in (NvlinkEngine.KERNEL, NvlinkEngine.STAGED, NvlinkEngine.KERNEL, NvlinkEngine.KERNEL):
        peer.write_strided(batch, engine=engine).wait(timeout=5)
    assert [n for _, _, n, _ in api.copies] == [32, 32, 32]  # the fourth write read the third's span
    assert len(lane.runs) == 1 and lane.runs[0][2] is not None and len(launches) == 3
    assert launches[1][2] == launches[2][2] and general == []


def test_a_reused_span_refused_for_a_lost_peer_keeps_the_fence_it_had(fake_peer, monkeypatch):
    """A write that found its slots in the ring, then its peer gone: it fails, launching
    nothing, and the span is held again by the fence of the write that uploaded it."""
    peer, launches, _, remote, api = fake_peer
    first = peer.write_strided(_kv([1, 2], [3, 4]))
    ring = peer._owner._ring
    held = ring.space._live[-1]
    assert held[2] is first._event
    monkeypatch.setattr(peer._queue.outbox, "alive", lambda: False)
    lost = peer.write_strided(_kv([1, 2], [3, 4]))
    assert lost.status() is TransferStatus.FAILED and len(launches) == 1
    assert ring.space._live[-1] is held and held[2] is first._event and len(api.copies) == 1


def test_a_staged_write_whose_pipeline_fails_raises_frees_its_span_and_the_next_one_runs(staged_peer, monkeypatch):
    """The lane fails midway (a launch's CUDA error): the write raises it, after waiting for
    what was queued (the lane and the copy stream synchronized), and its span of the ring is
    free again; the next write runs."""
    from transport.nvlink.config import NvlinkEngine

    peer, lane, launches, general, api = staged_peer
    real_run, synced = lane.run, []

    def failing_run(*args, **kw):
        real_run(*args, **kw)  # every chunk enqueued, then the failure
        raise RuntimeError("injected pipeline failure")

    monkeypatch.setattr(lane, "run", failing_run)
    monkeypatch.setattr(lane, "synchronize", lambda: synced.append("lane"))
    with pytest.raises(RuntimeError, match="injected pipeline failure"):
        peer.write_strided(_kv([1, 2], [3, 4]), b"fails", engine=NvlinkEngine.STAGED)
    assert synced == ["lane"]
    ring = peer._owner._ring
    assert ring.space.take(64) == 0  # nothing of the ring is still held for it
    ring.space.hold(0, None)
    monkeypatch.setattr(lane, "run", real_run)
    tr = peer.write_strided(_kv([1, 2], [3, 4]), b"after", engine=NvlinkEngine.STAGED)
    tr.wait(timeout=5)
    assert tr.status() is TransferStatus.DONE and len(lane.runs) == 2 and general == []


def test_a_staged_write_out_of_bounds_runs_nothing(staged_peer):
    from transport.nvlink.config import NvlinkEngine

    peer, lane, launches, general, api = staged_peer
    with pytest.raises(ValueError, match=r"batch pair 0: destination \(peer\) range \[0, 66560\) is outside region 0"):
        peer.write_strided(_kv([0], [64]), engine=NvlinkEngine.STAGED)  # 64 KiB regions: slots 0..63
    assert lane.runs == [] and launches == [] and general == []
    assert peer._owner._ring.space.take(64) == 0  # the refused write holds nothing of the ring


def test_direct_path_to_a_lost_peer_fails_without_launching(fake_peer):
    """The owner's transport closes: once the peer's mailbox thread has read the end of the
    connection, a direct write fails at once, launching nothing, and frees its ring span."""
    peer, launches, _, remote, api = fake_peer
    remote.close()
    wait_until("the mailbox thread reading the end", lambda: not peer._queue.outbox.alive())
    tr = peer.write_strided(_kv([1], [1]), b"lost")
    assert tr.status() is TransferStatus.FAILED and tr.error == "peer 'fake' lost (its socket closed)"
    assert launches == [] and api.copies == []
    assert peer._owner._ring.space.take(64) == 0  # nothing of the ring is still held for it


def test_direct_path_refuses_a_revoked_region_and_launches_nothing(fake_peer):
    """The owner deregisters region 2, which the peer's mailbox thread acknowledges (unmapping
    it): a direct write naming it raises RegionRevoked, staging and launching nothing; one that
    names only live regions still launches, from the ring's first span."""
    peer, launches, general, remote, api = fake_peer
    remote.deregister(2)
    assert peer._mapping.dropped == [{2}]
    with pytest.raises(RegionRevoked, match=r"region 2 of peer 'fake' was revoked: its owner deregistered it"):
        peer.write_strided(_kv([1], [1]), b"revoked")
    with pytest.raises(RegionRevoked, match="region 2 of peer 'fake' was revoked"):
        peer.write_strided(StridedBatch.of([0, 1], 0, 1024, [3, 2], 0, 1024, 1024, [1], [1]))  # one pair of two
    assert launches == [] and api.copies == [] and general == []
    peer.write_strided(StridedBatch.of([0, 1], 0, 1024, [0, 3], 0, 1024, 1024, [4], [5])).wait(timeout=5)
    assert len(launches) == 1 and launches[0][2] == 0  # the refused writes took no span of the ring


def test_plan_pairs_makes_the_pair_set_resident_before_the_first_write(fake_peer):
    peer, launches, _, _, _ = fake_peer
    peer.plan_pairs(_kv([1], [1]))
    assert peer.pair_plans.builds == 1
    peer.write_strided(_kv([3, 4], [5, 6])).wait(timeout=5)
    assert peer.pair_plans.builds == 1 and len(launches) == 1
    with pytest.raises(ValueError, match=r"batch pair 0: destination \(peer\) range \[65000, 66024\) is outside"):
        peer.plan_pairs(StridedBatch.of(0, 0, 1024, 0, 65000, 1024, 1024, [5], [5]))
    with pytest.raises(TypeError, match="batch must be a StridedBatch, got list"):
        peer.plan_pairs([])
