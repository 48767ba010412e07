"""The nvlink backend's staged engine: chunking, the gather/scatter kernels, two-process writes."""

import numpy as np
import pytest

from tests.transport._support import (
    LAYERS,
    SLOTS,
    TOKEN,
    assert_interpreted_ok,
    check_landed,
    kv_batch,
    kv_strided,
    local_pair,
    write_landed,
)
from transport.base import StridedBatch, TransferStatus, WriteBatch
from transport.nvlink import NvlinkConfig, NvlinkEngine
from transport.nvlink import kernel as kern
from transport.nvlink import staged


def _check_chunks(bounds, offsets_of, starts, max_len, n):
    """Bounds start at 0, end at n, strictly increase; chunk ``k`` starts at the last row that
    starts at or before ``starts[k]`` and holds less than its share plus one row."""
    assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) > 0)
    all_off = offsets_of(np.arange(n + 1))
    total = int(all_off[-1])
    want = sorted({int(np.searchsorted(all_off[:-1], t, side="right") - 1) for t in starts} | {n})
    assert bounds.tolist() == want
    share = np.diff(np.append(starts, total))  # bytes the chunk was meant to hold
    got = np.diff(offsets_of(bounds))
    assert got.max() < share.max() + max_len


@pytest.mark.parametrize("total, chunk, edge", [(1, 64, 16), (16, 64, 16), (17, 64, 16), (40, 64, 16), (100, 64, 16),
                                                (1000, 64, 16), (100, 64, 64), (1000, 64, 128), (12345, 100, 7)])
def test_chunk_starts_ramp_up_and_down(total, chunk, edge):
    starts = staged.chunk_starts(total, chunk, edge)
    sizes = np.diff(np.append(starts, total))
    assert starts[0] == 0 and sizes.sum() == total
    assert sizes.max() <= chunk and sizes.min() >= min(edge, chunk // 2, total)
    if total >= 8 * edge and 2 * edge < chunk:  # room for a ramp: edge, 2 edge, ..., mirrored
        assert sizes[0] == sizes[-1] == edge and sizes[1] == sizes[-2] == 2 * edge


@pytest.mark.parametrize("seed", range(6))
def test_row_chunks_cut_at_row_starts(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    length = rng.integers(1, 5000, n)
    offsets = np.concatenate([[0], np.cumsum(length)[:-1]])
    total = int(length.sum())
    starts = staged.chunk_starts(total, int(rng.integers(4, 20)) * 1000, int(rng.integers(1, 4)) * 1000)
    bounds = staged.row_chunks(offsets, total, starts)
    _check_chunks(bounds, lambda r: np.append(offsets, total)[r], starts, int(length.max()), n)


@pytest.mark.parametrize("seed", range(8))
def test_strided_cuts_match_the_expanded_rows(seed):
    """The chunks of a factored batch, cut from its pairs' staging prefixes, against the
    offsets of its rows expanded one by one."""
    rng = np.random.default_rng(seed)
    P, S = int(rng.integers(1, 9)), int(rng.integers(1, 50))
    length = rng.integers(1, 3000, P)
    prefix = np.concatenate([[0], np.cumsum(length)[:-1]])
    total = int((length * S).sum())
    flat_off = np.concatenate([[0], np.cumsum(np.repeat(length, S))])  # [P * S + 1] off(r), pair-major
    chunk, edge = int(rng.integers(1, 30)) * 997, int(rng.integers(1, 4)) * 331
    bounds, offsets = staged.strided_cuts(prefix.tolist(), length.tolist(), S, chunk, edge)
    _check_chunks(bounds, lambda r: flat_off[r], staged.chunk_starts(total, chunk, edge), int(length.max()), P * S)
    np.testing.assert_array_equal(offsets, flat_off[bounds])


def test_auto_wants_large_batches_of_long_rows():
    cfg = staged.StagedConfig(min_bytes=1000, min_row_bytes=100)
    assert cfg.wants(1000, 10) and not cfg.wants(999, 1) and not cfg.wants(1000, 11)
    assert not staged.StagedConfig(enabled=False, min_bytes=0, min_row_bytes=0).wants(1 << 40, 1)


def test_empty_batches_have_one_bound():
    assert staged.row_chunks(np.zeros(0, np.int64), 0, staged.chunk_starts(0, 1 << 16, 1 << 16)).tolist() == [0]
    assert [a.tolist() for a in staged.strided_cuts([], [], 5, 1 << 16, 1 << 16)] == [[0], [0]]


def test_staged_config_and_engine_reject_bad_values():
    with pytest.raises(ValueError, match="buffers must be an int >= 2, got 1"):
        staged.StagedConfig(buffers=1)
    with pytest.raises(ValueError, match=r"buffers must be at most 16 \(the C pipeline's\), got 17"):
        staged.StagedConfig(buffers=17)
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 65536, got 4096"):
        staged.StagedConfig(chunk_bytes=4096)
    with pytest.raises(ValueError, match="edge_bytes must be an int >= 65536, got 0"):
        staged.StagedConfig(edge_bytes=0)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        staged.StagedConfig(enabled="yes")
    with pytest.raises(TypeError, match="staged must be a StagedConfig, got dict"):
        NvlinkConfig(staged={})
    assert NvlinkConfig(engine=NvlinkEngine.STAGED).engine is NvlinkEngine.STAGED
    with pytest.raises(TypeError, match=r"engine must be an NvlinkEngine \(AUTO, KERNEL, STAGED\), got 'fast'"):
        NvlinkConfig(engine="fast")


def test_staged_tables_carry_prefix_offsets():
    src_base, dst_base = np.array([1000, 2000]), np.array([5000, 7000])
    length = np.array([16, 48, 32])
    rows = kern.build_row_table(src_base, np.array([0, 1, 0]), np.array([0, 16, 64]), dst_base,
                                np.array([1, 1, 0]), np.array([0, 64, 0]), length, staged=True)
    assert rows.shape == (4, 3) and rows[3].tolist() == [0, 16, 64]
    b = StridedBatch.of([1, 0], [8, 16], [64, 32], [0, 1], [0, 4], [128, 16], [16, 8], [3, 1, 2], [0, 2, 5])
    pairs = tuple(getattr(b, f) for f in ("src_region", "src_offset", "src_stride", "dst_region", "dst_offset",
                                           "dst_stride", "length"))
    table = kern.build_strided_table(src_base, dst_base, pairs, b.src_slot, b.dst_slot, staged=True)
    assert table.size == kern.strided_table_size(2, 3, staged=True) == 6 * 2 + 2 * 3
    plain = kern.build_strided_table(src_base, dst_base, pairs, b.src_slot, b.dst_slot)
    assert table[10:12].tolist() == [0, 16]  # pair 1's rows follow pair 0's 16 bytes per slot
    np.testing.assert_array_equal(table[:10], plain[:10])  # the five pair sections
    np.testing.assert_array_equal(table[12:], plain[10:])  # the slots, after the sixth


_INTERPRET_SCRIPT = r"""
import numpy as np, torch
from transport.nvlink import kernel as kern, staged
from transport.base import StridedBatch
from tests.transport._expected import landed
rng = np.random.default_rng(5)
src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (4000, 6000)]
dst = [torch.zeros(n, dtype=torch.uint8) for n in (5000, 9000)]
sb, db = np.array([t.data_ptr() for t in src]), np.array([t.data_ptr() for t in dst])
cfg = kern.KernelConfig(tile_bytes=128, max_block_c_bytes=32)
for unit in (16, 1):
    # row table: n rows, disjoint destination slots of 200 bytes
    n = 10
    length = rng.integers(1, 12, n) * unit
    sr, dr = rng.integers(0, 2, n), rng.integers(0, 2, n)
    so = rng.integers(0, 3000 // unit, n) * unit
    do = np.zeros(n, dtype=np.int64)
    for r in range(2):
        idx = np.flatnonzero(dr == r)
        do[idx] = rng.permutation(20)[: idx.size] * 208 + (3 if unit == 1 else 0)
    for d in dst:
        d.zero_()
    want = [d.clone() for d in dst]
    for i in range(n):
        want[dr[i]][do[i]:do[i] + length[i]] = src[sr[i]][so[i]:so[i] + length[i]]
    rows = kern.build_row_table(sb, sr, so, db, dr, do, length, staged=True)
    plan = kern.plan_launch(n, int(length.max()), kern.choose_path(rows), cfg)
    total = int(length.sum())
    bounds = staged.row_chunks(rows[3], total, staged.chunk_starts(total, 48, 16))
    offsets = np.append(rows[3], total)[bounds]
    stage = torch.zeros(int(np.diff(offsets).max()) + 16, dtype=torch.uint8)
    t = torch.from_numpy(rows)
    for k in range(bounds.size - 1):  # one staging buffer, reused by every chunk
        a, b = int(bounds[k]), int(bounds[k + 1])
        kern.scatter_rows(t, plan, "cpu", begin=a, end=b, stage=kern.Stage(kern.StageMode.GATHER, stage.data_ptr(), int(offsets[k])))
        packed = torch.cat([src[sr[i]][so[i]:so[i] + length[i]] for i in range(a, b)])
        assert torch.equal(stage[:packed.numel()], packed), ("gather", unit, k)
        kern.scatter_rows(t, plan, "cpu", begin=a, end=b, stage=kern.Stage(kern.StageMode.SCATTER, stage.data_ptr(), int(offsets[k])))
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("rows", unit)
    # strided: 3 pairs x 4 slots
    P, S = 3, 4
    plen = rng.integers(1, 6, P) * unit
    b = StridedBatch.of(rng.integers(0, 2, P), rng.integers(0, 10, P) * unit, 256, [0, 1, 1], [0, 0, 128], 256, plen,
                        rng.integers(0, 10, S), rng.permutation(15)[:S])
    for d in dst:
        d.zero_()
    flat = b.expand()
    want = landed(src, dst, flat)
    pairs = b.pairs
    table = kern.build_strided_table(sb, db, pairs, b.src_slot, b.dst_slot, staged=True)
    plan = kern.plan_launch(P * S, int(plen.max()), kern.choose_path(table[:5 * P]), cfg)
    bounds, offsets = staged.strided_cuts(table[5 * P:6 * P].tolist(), b.length.tolist(), S, 64, 16)
    stage = torch.zeros(int(np.diff(offsets).max()) + 16, dtype=torch.uint8)
    t = torch.from_numpy(table)
    for k in range(bounds.size - 1):
        a, e = int(bounds[k]), int(bounds[k + 1])
        for mode in (kern.StageMode.GATHER, kern.StageMode.SCATTER):
            kern.scatter_strided(t, P, S, plan, "cpu", begin=a, end=e, stage=kern.Stage(mode, stage.data_ptr(), int(offsets[k])))
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("strided", unit)
print("STAGED-KERNEL-OK")
"""


def test_gather_and_scatter_under_triton_interpreter():
    """Chunks of rows (row table and strided) through one reused staging buffer, every byte."""
    assert_interpreted_ok(_INTERPRET_SCRIPT, "STAGED-KERNEL-OK")


def test_range_and_stage_arguments_are_checked():
    import torch

    rows = torch.zeros((3, 4), dtype=torch.int64)
    plan = kern.plan_launch(4, 16, kern.CopyPath.VEC16, kern.KernelConfig())
    with pytest.raises(ValueError, match=r"row range \[3, 2\) must lie within \[0, 4\]"):
        kern.scatter_rows(rows, plan, "cpu", begin=3, end=2)
    with pytest.raises(ValueError, match=r"rows must have shape \[4, num_rows\], got \[3, 4\]"):
        kern.scatter_rows(rows, plan, "cpu", stage=kern.Stage(kern.StageMode.GATHER, 0, 0))


# -- two processes: on two GPUs, or on one through a loopback lane (the same pipeline inside one GPU) --

# many chunks even for test-sized batches (rows up to 256 KiB), ramping up from 64 KiB and back
SMALL = staged.StagedConfig(chunk_bytes=1 << 18, edge_bytes=1 << 16)


def _staged_pair(remote, num_bufs, buf_bytes):
    return local_pair(remote, num_bufs, buf_bytes, NvlinkConfig(staged=SMALL, engine=NvlinkEngine.STAGED))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, head_slice", [(1, False), (16, False), (64, False), (1, True)])
def test_two_processes_staged_rows_exact(remote_any, page_size, head_slice):
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = _staged_pair(remote_any, 2 * LAYERS, buf_bytes)
    try:
        batch = kv_batch(sorted(src), dst_rids, page_size, head_slice, np.random.default_rng(page_size))
        tag = f"staged {page_size} {head_slice}".encode()
        with peer.prepare(batch) as job:
            assert job.engine is NvlinkEngine.STAGED, peer.staged_error  # it really goes staged
        tr = peer.write(batch, notify=tag)
        tr.wait(timeout=60)
        assert tr.status() is TransferStatus.DONE and peer.staged_error is None
        check_landed(remote_any, src, dst_rids, batch, buf_bytes, tag)
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, head_slice", [(1, False), (16, True)])
def test_two_processes_staged_strided_exact(remote_any, page_size, head_slice):
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = _staged_pair(remote_any, 2 * LAYERS, buf_bytes)
    try:
        b = kv_strided(sorted(src), dst_rids, page_size, head_slice, np.random.default_rng(3))
        write_landed(remote_any, peer, src, dst_rids, b, buf_bytes, f"staged strided {page_size} {head_slice}".encode())
        assert peer.staged_error is None
    finally:
        t.close()


@pytest.mark.gpu
def test_staged_strided_writes_in_flight_with_direct_ones_between(remote_any):
    """Eight strided writes of one pair set in flight, staged and direct in turn, each to its
    own destination pages: the staged ones over the resident staged pairs (built once), the
    first one's pipeline enqueued from Python, the others' in one call of C; each write's span
    of the slot rings held until it completes; every byte lands."""
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = _staged_pair(remote_any, 2 * LAYERS, buf_bytes)
    try:
        rng = np.random.default_rng(8)
        dst_pages = rng.permutation(np.arange(1, SLOTS))[:64].reshape(8, 8)  # [write, slot] disjoint
        batches = [StridedBatch.of(sorted(src), 0, TOKEN, dst_rids, 0, TOKEN, TOKEN,
                                   rng.choice(np.arange(SLOTS), 8, replace=False), d) for d in dst_pages]
        trs = [peer.write_strided(b, notify=b"mix %d" % i,
                                  engine=NvlinkEngine.STAGED if i % 2 == 0 else NvlinkEngine.KERNEL)
               for i, b in enumerate(batches)]
        for tr in trs:
            tr.wait(timeout=60)
            assert tr.status() is TransferStatus.DONE
        for i in range(7):
            assert remote_any.wait_notify(b"mix %d" % i, 60.0) == t.name
        flat = [b.expand() for b in batches]
        union = WriteBatch.of(*(np.concatenate([getattr(f, a) for f in flat])
                                for a in ("src_region", "src_offset", "dst_region", "dst_offset", "length")))
        check_landed(remote_any, src, dst_rids, union, buf_bytes, b"mix 7")
        assert peer.staged_plans.builds == 1 and peer.pair_plans.builds == 1 and peer.staged_error is None
        if t._native_steps() is not None:  # the first staged write kept both launches; the other three ran in C
            assert peer._owner._lanes[peer._route.peer_gpu].native_runs == 3
    finally:
        t.close()


@pytest.mark.gpu
def test_two_processes_staged_back_to_back_writes_and_odd_rows(remote_any):
    """Eight writes in flight reuse the staging buffers (events order them); rows at odd
    offsets and lengths take the byte path through the stage."""
    buf_bytes = 1 << 17
    t, peer, src, dst_rids = _staged_pair(remote_any, 3, buf_bytes)
    try:
        rng = np.random.default_rng(11)
        n, slot = 120, 1000
        length = rng.integers(1, slot - 16, n)
        so = rng.integers(0, buf_bytes - slot, n)
        dr = rng.integers(0, 3, n)
        do = np.zeros(n, dtype=np.int64)
        for r in range(3):
            idx = np.flatnonzero(dr == r)
            do[idx] = rng.permutation(buf_bytes // slot - 1)[: idx.size] * slot + 5
        batch = WriteBatch.of(np.asarray(sorted(src))[rng.integers(0, 3, n)], so, np.asarray(dst_rids)[dr], do, length)
        trs = [peer.write(batch, notify=b"odd %d" % i) for i in range(8)]
        for tr in trs:
            tr.wait(timeout=60)
        for i in range(7):
            assert remote_any.wait_notify(b"odd %d" % i, 60.0) == t.name
        check_landed(remote_any, src, dst_rids, batch, buf_bytes, b"odd 7")
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("enabled, min_bytes, min_row_bytes, staged_used", [
    (True, 1 << 40, 0, False), (False, 0, 0, False), (True, 0, 1 << 30, False), (True, 0, TOKEN, True)])
def test_auto_engine_follows_the_config(remote_any, enabled, min_bytes, min_row_bytes, staged_used):
    buf_bytes = SLOTS * TOKEN
    config = NvlinkConfig(staged=staged.StagedConfig(enabled=enabled, min_bytes=min_bytes, min_row_bytes=min_row_bytes,
                                                     chunk_bytes=1 << 18))
    t, peer, src, dst_rids = local_pair(remote_any, 4, buf_bytes, config)
    try:
        assert config.engine is NvlinkEngine.AUTO
        batch = kv_batch(sorted(src), dst_rids, 16, False, np.random.default_rng(2))
        tag = f"auto {enabled} {min_bytes} {min_row_bytes}".encode()
        loopback = peer._route.peer_gpu == peer.device  # one GPU: AUTO never stages inside it
        with peer.prepare(batch) as job:
            assert (job.engine is NvlinkEngine.STAGED) == (staged_used and not loopback)
            job.post(notify=tag).wait(timeout=60)
        with peer.prepare(batch, engine=NvlinkEngine.KERNEL) as job:  # a per-write override
            assert job.engine is NvlinkEngine.KERNEL
        check_landed(remote_any, src, dst_rids, batch, buf_bytes, tag)
    finally:
        t.close()


@pytest.mark.gpu
def test_a_failed_enqueue_raises_and_the_next_write_lands(remote_any):
    """A launch that fails mid-pipeline raises from write() (after what was queued has run),
    releases the lane, and the next write lands byte for byte."""
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = _staged_pair(remote_any, 2 * LAYERS, buf_bytes)
    try:
        batch = kv_batch(sorted(src), dst_rids, 1, False, np.random.default_rng(5))
        prepare, launches = peer.prepare, []

        def failing_prepare(b, engine=None, **kwargs):
            job = prepare(b, engine, **kwargs)
            real = job.launch

            def launch(*args, **kw):
                launches.append(args[1])
                if len(launches) == 3:
                    raise RuntimeError("injected launch failure")
                real(*args, **kw)

            job.launch = launch
            return job

        peer.prepare = failing_prepare
        with pytest.raises(RuntimeError, match="injected launch failure"):
            peer.write(batch)
        del peer.prepare  # back to the class's method
        assert not peer._owner._lanes[peer._route.peer_gpu]._lock.locked()
        write_landed(remote_any, peer, src, dst_rids, batch, buf_bytes, b"after a failed enqueue")
    finally:
        t.close()
