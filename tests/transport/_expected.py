"""The byte reference of the kernel tests: what a batch must leave in host tensors, computed
entry by entry from its flat form."""

from __future__ import annotations

from transport.base import StridedBatch


def landed(src: list, dst: list, batch) -> list:
    """Copies of ``dst`` (one torch tensor per region id) with ``batch`` (a WriteBatch, or a
    StridedBatch, expanded) copied into them from ``src``."""
    flat = batch.expand() if isinstance(batch, StridedBatch) else batch
    want = [d.clone() for d in dst]
    for sr, so, dr, do, n in zip(flat.src_region, flat.src_offset, flat.dst_region, flat.dst_offset, flat.length):
        want[dr][do:do + n] = src[sr][so:so + n]
    return want
