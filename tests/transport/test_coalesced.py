"""``StridedBatch.coalesced()``: the same bytes as ``expand()``, whole-slot runs merged."""

from __future__ import annotations

import numpy as np
import pytest

from transport.base import StridedBatch


def _byte_map(batch) -> dict:
    """Reference: (src region, src byte) -> (dst region, dst byte), byte by byte."""
    out = {}
    for sr, so, dr, do, ln in zip(*(getattr(batch, f).tolist() for f in
                                    ("src_region", "src_offset", "dst_region", "dst_offset", "length"))):
        for i in range(ln):
            out[sr, so + i] = (dr, do + i)
    return out


def _kv_like(rng, num_pairs, num_slots, contiguous, partial_every=0):
    """Pairs of whole rows of 8 bytes (every ``partial_every``-th pair a 4-byte head slice),
    slots either one run per side or random distinct slots."""
    if contiguous:
        src_slot = np.arange(5, 5 + num_slots)
        dst_slot = np.arange(20, 20 + num_slots)
    else:
        src_slot = rng.permutation(64)[:num_slots]
        dst_slot = rng.permutation(64)[:num_slots]
    partial = np.zeros(num_pairs, bool) if not partial_every else np.arange(num_pairs) % partial_every == 0
    length = np.where(partial, 4, 8)
    return StridedBatch.of(np.arange(num_pairs), np.where(partial, 4, 0), 8, np.arange(num_pairs) + 100, 0, 8,
                           length, src_slot, dst_slot)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("contiguous", [True, False])
def test_coalesced_writes_the_same_bytes(seed, contiguous):
    rng = np.random.default_rng(seed)
    b = _kv_like(rng, int(rng.integers(1, 6)), int(rng.integers(1, 20)), contiguous, partial_every=seed % 3)
    merged = b.coalesced()
    assert _byte_map(merged) == _byte_map(b.expand())
    assert merged.nbytes == b.nbytes


def test_contiguous_whole_rows_become_one_entry_per_pair():
    b = _kv_like(np.random.default_rng(0), num_pairs=4, num_slots=16, contiguous=True)
    merged = b.coalesced()
    assert len(merged) == 4 and set(merged.length.tolist()) == {16 * 8}


def test_partial_rows_and_strides_that_differ_keep_one_entry_per_slot():
    b = _kv_like(np.random.default_rng(1), num_pairs=3, num_slots=10, contiguous=True, partial_every=1)
    assert len(b.coalesced()) == len(b.expand()) == 30
    # whole rows on the source only (the destination row is wider): no merge either
    c = StridedBatch.of(0, 0, 8, 1, 0, 16, 8, np.arange(6), np.arange(6))
    assert len(c.coalesced()) == 6


def test_random_batches_agree_with_expand():
    rng = np.random.default_rng(7)
    for _ in range(30):
        p, s = int(rng.integers(1, 5)), int(rng.integers(0, 12))
        stride = rng.integers(1, 16, p)
        b = StridedBatch.of(rng.integers(0, 3, p), rng.integers(0, 50, p), stride, rng.integers(0, 3, p),
                            rng.integers(0, 50, p), np.where(rng.random(p) < 0.5, stride, stride + 3),
                            np.where(rng.random(p) < 0.7, stride, 1), rng.permutation(40)[:s] if s else [],
                            np.sort(rng.permutation(40)[:s]) if s else [])
        assert _byte_map(b.coalesced()) == _byte_map(b.expand())
