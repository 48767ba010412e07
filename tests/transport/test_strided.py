"""Factored writes (``StridedBatch``, ``Peer.write_strided``): validation, bounds and expansion
against entry-by-entry loops; the strided kernel under Triton's interpreter against the flat
kernel and a byte reference; the ABC's default through a real NIXL loopback pair; the NVLink
kernel path between two processes on two GPUs (marked)."""

from __future__ import annotations


import numpy as np
import pytest

from tests.transport._support import (
    LAYERS,
    SLOTS,
    TOKEN,
    Receiver,
    assert_interpreted_ok,
    assert_same,
    check_landed,
    entries,
    kv_strided,
    local_pair,
    write_landed,
)
from transport.base import Region, StridedBatch, TransferStatus, WriteBatch

PAIR_NAMES = ("src_region", "src_offset", "src_stride", "dst_region", "dst_offset", "dst_stride", "length")


def _random_batch(rng, num_pairs=6, num_slots=9, regions=3):
    return StridedBatch.of(
        rng.integers(0, regions, num_pairs), rng.integers(0, 500, num_pairs), rng.integers(0, 300, num_pairs),
        rng.integers(0, regions, num_pairs), rng.integers(0, 500, num_pairs), rng.integers(0, 300, num_pairs),
        rng.integers(1, 200, num_pairs), rng.integers(0, 40, num_slots), rng.integers(0, 40, num_slots),
    )


# -- the batch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_expand_matches_the_reference_loop(seed):
    rng = np.random.default_rng(seed)
    b = _random_batch(rng, num_pairs=int(rng.integers(1, 8)), num_slots=int(rng.integers(1, 12)))
    flat = b.expand()
    assert isinstance(flat, WriteBatch)
    got = list(zip(*(a.tolist() for a in (flat.src_region, flat.src_offset, flat.dst_region, flat.dst_offset,
                                          flat.length))))
    assert got == entries(b)
    assert len(b) == len(flat) == b.num_pairs * b.num_slots
    assert b.nbytes == flat.nbytes == sum(e[4] for e in entries(b))
    for arr in (*flat.__dict__.values(),):
        assert arr.dtype == np.int64


def test_of_broadcasts_scalars_per_table():
    b = StridedBatch.of(0, [0, 64], 128, 1, 0, [256, 512], 64, [3, 1, 2], 0)
    assert b.num_pairs == 2 and b.num_slots == 3
    np.testing.assert_array_equal(b.src_region, [0, 0])
    np.testing.assert_array_equal(b.dst_slot, [0, 0, 0])
    empty = StridedBatch.of([0], [0], [8], [0], [0], [8], [8], [], [])
    assert len(empty) == 0 and empty.nbytes == 0 and len(empty.expand()) == 0


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(src_offset=[0, -4]), ValueError, r"batch pair 1: src_offset is negative \(-4\)"),
        (dict(dst_stride=[16, -1]), ValueError, r"batch pair 1: dst_stride is negative \(-1\)"),
        (dict(length=[16, 0]), ValueError, "batch pair 1: length is 0"),
        (dict(dst_slot=[0, -2, 1]), ValueError, r"batch slot 1: dst_slot is negative \(-2\)"),
        (dict(dst_offset=[0, 1, 2]), ValueError, "batch arrays differ in length: src_region has 2, dst_offset has 3"),
        (dict(dst_slot=[0, 1]), ValueError, "batch arrays differ in length: src_slot has 3, dst_slot has 2"),
        (dict(src_stride=[[16, 16]]), ValueError, r"src_stride must be 1-D, got shape \(1, 2\)"),
        (dict(src_slot=[0.0, 1.0, 2.0]), TypeError, "src_slot must hold integers, got dtype float64"),
    ],
)
def test_of_rejects_bad_arrays(change, exc, match):
    args = dict(src_region=[0, 1], src_offset=[0, 16], src_stride=[64, 64], dst_region=[0, 0], dst_offset=[0, 32],
                dst_stride=[16, 16], length=[16, 16], src_slot=[0, 1, 2], dst_slot=[2, 0, 1])
    args.update(change)
    with pytest.raises(exc, match=match):
        StridedBatch.of(**args)


def _reference_bounds(b: StridedBatch, local, remote):
    """The first flat entry outside its regions, by a loop (None: all inside)."""
    for src_r, src_o, dst_r, dst_o, n in entries(b):
        for table, r, o in ((local, src_r, src_o), (remote, dst_r, dst_o)):
            if r not in table or o + n > table[r].length:
                return (r, o, n)
    return None


@pytest.mark.parametrize("seed", range(30))
def test_check_bounds_agrees_with_the_entry_loop(seed):
    rng = np.random.default_rng(100 + seed)
    b = _random_batch(rng)
    local = {r: Region(r, 4096 * (r + 1), int(rng.integers(3000, 16000)), 0) for r in range(3)}
    remote = {r: Region(r, 4096 * (r + 1), int(rng.integers(3000, 16000)), 1) for r in range(3) if r != seed % 7}
    bad = _reference_bounds(b, local, remote)
    if bad is None:
        b.check_bounds(local, remote)
    else:
        with pytest.raises(ValueError, match=r"batch pair \d+: (source \(local\)|destination \(peer\)) "
                                             r"(range \[\d+, \d+\) is outside region|region \d+ is not registered)"):
            b.check_bounds(local, remote)


def test_check_bounds_names_the_pair_and_its_furthest_slot():
    local = {0: Region(0, 4096, 1000, 0)}
    remote = {0: Region(0, 4096, 10_000, 1)}
    b = StridedBatch.of([0, 0], [0, 100], [100, 100], [0, 0], [0, 0], [200, 200], [50, 50], [0, 9], [1, 2])
    with pytest.raises(ValueError, match=r"batch pair 1: source \(local\) range \[100, 1050\) is outside region 0 "
                                         r"of 1000 bytes"):
        b.check_bounds(local, remote)
    with pytest.raises(ValueError, match=r"batch pair 0: destination \(peer\) region 0 is not registered"):
        StridedBatch.of(0, 0, 1, 0, 0, 1, 1, 0, 0).check_bounds(local, {})
    huge = StridedBatch.of(0, 0, 1 << 40, 0, 0, 1, 1, [0, 1 << 30], 0)
    with pytest.raises(ValueError, match="batch pair 0: source .* overflows int64 addresses"):
        huge.check_bounds(local, remote)
    StridedBatch.of(0, 0, 1 << 40, 0, 0, 1, 1, [], []).check_bounds(local, remote)  # no entries: nothing to check


# -- the strided kernel under Triton's interpreter -------------------------------------------------

_INTERPRET_SCRIPT = r"""
import torch
from transport.nvlink import kernel as kern
from tests.transport._expected import disjoint_strided_batch, kernel_buffers, landed
rng, src, dst, src_base, dst_base = kernel_buffers(5)
# (alignment unit, stride, config): rows of up to 5 units, some longer than one loop step
for unit, stride, cfg in ((16, 320, kern.KernelConfig(tile_bytes=256, max_block_c_bytes=32)),
                          (8, 200, kern.KernelConfig(tile_bytes=128, max_block_c_bytes=16)),
                          (1, 203, kern.KernelConfig(tile_bytes=64, max_block_c_bytes=16, max_programs=3))):
    P, S = 4, 5
    b = disjoint_strided_batch(rng, unit, stride, P, S)
    length = b.length
    flat = b.expand()
    for d in dst:
        d.random_(0, 256)
    want = landed(src, dst, flat)
    pairs = b.pairs
    table = kern.build_strided_table(src_base, dst_base, pairs, b.src_slot, b.dst_slot)
    path = kern.choose_path(table[:5 * P])
    rows = kern.build_row_table(src_base, flat.src_region, flat.src_offset, dst_base, flat.dst_region,
                                flat.dst_offset, flat.length)
    assert path is kern.choose_path(rows), (path, kern.choose_path(rows))  # O(P) decision == per-row decision
    assert path.value == unit, (path, unit)
    plan = kern.plan_launch(P * S, int(length.max()), path, cfg)
    kern.scatter_strided(torch.from_numpy(table), P, S, plan, "cpu")
    for d, w in zip(dst, want):
        assert torch.equal(d, w), ("strided", unit, (d != w).nonzero()[:5])
    got = [d.clone() for d in dst]
    for d in dst:
        d.zero_()
    kern.scatter_rows(torch.from_numpy(rows), plan, "cpu")  # the flat kernel on the expanded batch
    for sr, so, dr, do, n in zip(flat.src_region, flat.src_offset, flat.dst_region, flat.dst_offset, flat.length):
        assert torch.equal(dst[dr][do:do + n], got[dr][do:do + n]), ("flat vs strided", unit)
print("STRIDED-KERNEL-OK")
"""


def test_strided_kernel_under_triton_interpreter():
    """Every copy path: the strided kernel against a byte reference and the flat kernel."""
    assert_interpreted_ok(_INTERPRET_SCRIPT, "STRIDED-KERNEL-OK")


def test_strided_table_and_its_checks():
    import torch

    from transport.nvlink import kernel as kern

    b = StridedBatch.of([1, 0], [8, 16], [64, 32], [0, 1], [0, 4], [128, 16], [16, 8], [3, 1, 2], [0, 2, 5])
    src_base, dst_base = np.array([1000, 2000]), np.array([5000, 7000])
    pairs = tuple(getattr(b, f) for f in PAIR_NAMES)
    table = kern.build_strided_table(src_base, dst_base, pairs, b.src_slot, b.dst_slot)
    # the table's addresses of every row equal the flat batch's gathered row table
    P, S = b.num_pairs, b.num_slots
    pr, sl = np.repeat(np.arange(P), S), np.tile(np.arange(S), P)
    src = table[pr] + table[5 * P + sl] * table[P + pr]
    dst = table[2 * P + pr] + table[5 * P + S + sl] * table[3 * P + pr]
    flat = b.expand()
    rows = kern.build_row_table(src_base, flat.src_region, flat.src_offset, dst_base, flat.dst_region,
                                flat.dst_offset, flat.length)
    np.testing.assert_array_equal(np.stack([src, dst, table[4 * P + pr]]), rows)
    with pytest.raises(ValueError, match=r"out must be a \[16\] int64 array"):
        kern.build_strided_table(src_base, dst_base, pairs, b.src_slot, b.dst_slot, out=np.empty(15, np.int64))
    t = torch.from_numpy(table)
    kern.check_strided_table(t, P, S, "cpu")
    with pytest.raises(ValueError, match=r"table must have shape \[5 \* 2 \+ 2 \* 4\] = \[18\], got \[16\]"):
        kern.check_strided_table(t, P, 4, "cpu")
    with pytest.raises(TypeError, match="table must have dtype torch.int64, got torch.int32"):
        kern.check_strided_table(t.int(), P, S, "cpu")
    with pytest.raises(ValueError, match="table must be on cuda:0, got cpu"):
        kern.check_strided_table(t, P, S, "cuda:0")


# -- the ABC's default through a real NIXL loopback pair --------------------------------------------


def test_default_write_strided_through_nixl_loopback():
    from transport._nixl_import import load_nixl_api

    try:
        load_nixl_api()
    except ImportError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    from tests.transport import _nixl_peer
    from transport.nixl import NixlConfig, NixlTransport

    dst_sizes = [1 << 16, 1 << 15]
    rx = Receiver(dst_sizes)
    try:
        with NixlTransport(NixlConfig()) as t:
            rng = np.random.default_rng(11)
            srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1 << 15, 1 << 16)]  # [n] bytes each
            sids = [t.register(a.ctypes.data, a.nbytes) for a in srcs]
            peer = t.connect(rx.export)
            # K/V-like: pair p copies a 96 B range of a 256 B (src) / 128 B (dst) slot row
            b = StridedBatch.of(np.asarray(sids)[[0, 1, 1]], [0, 64, 160], 256, [0, 0, 1], [0, 32 * 256, 16],
                                [128, 128, 128], [96, 96, 100], rng.permutation(100)[:40],
                                rng.permutation(60)[:40])
            note = _nixl_peer.payload(3, [(r, 0, n) for r, n in enumerate(dst_sizes)])
            tr = peer.write_strided(b, notify=note)
            tr.wait(60)
            assert tr.status() is TransferStatus.DONE
            want = [np.zeros(n, np.uint8) for n in dst_sizes]
            for sr, so, dr, do, n in entries(b):
                want[dr][do:do + n] = srcs[sids.index(sr)][so:so + n]
            (got_note, _), = rx.wait_notes(1)
            assert got_note == note
            for r in range(len(dst_sizes)):
                assert_same(rx.dump(r), want[r], f"destination region {r}")
            with pytest.raises(TypeError, match="batch must be a StridedBatch, got WriteBatch"):
                peer.write_strided(b.expand())
    finally:
        rx.stop()


# -- two processes on two GPUs: the NVLink strided kernel ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("page_size, head_slice", [(1, False), (16, False), (1, True), (16, True)])
def test_two_processes_strided_write_exact(remote, page_size, head_slice):
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote, 2 * LAYERS, buf_bytes)
    try:
        rng = np.random.default_rng(page_size + 100 * head_slice)
        b = kv_strided(sorted(src), dst_rids, page_size, head_slice, rng)
        write_landed(remote, peer, src, dst_rids, b, buf_bytes, f"strided {page_size} {head_slice}".encode())
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_processes_strided_unaligned_and_out_of_bounds(remote):
    buf_bytes = 1 << 16
    t, peer, src, dst_rids = local_pair(remote, 3, buf_bytes)
    try:
        b = StridedBatch.of(sorted(src), [3, 5, 0], [1001, 997, 1000], dst_rids, [1, 7, 2], [1003, 1003, 1003],
                            [333, 500, 1], np.arange(40) * 1, np.arange(40)[::-1])
        peer.write_strided(b, notify=b"strided odd").wait(timeout=60)
        check_landed(remote, src, dst_rids, b.expand(), buf_bytes, b"strided odd")
        with pytest.raises(ValueError, match=r"batch pair 0: destination \(peer\) range .* is outside region"):
            peer.write_strided(StridedBatch.of(sorted(src)[0], 0, 16, dst_rids[0], 0, 4096, 16, [0], [16]))
    finally:
        t.close()
