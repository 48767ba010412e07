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


def kernel_buffers(seed: int) -> tuple:
    """What the kernel tests under Triton's interpreter copy between: ``(rng, src, dst,
    src_base, dst_base)``, a numpy generator seeded ``seed``, two source and two destination
    regions (random uint8 CPU tensors of 3000 / 5000 and 4000 / 6000 bytes) and their
    ``[2]`` base addresses."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (3000, 5000)]
    dst = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (4000, 6000)]
    return rng, src, dst, np.array([t.data_ptr() for t in src]), np.array([t.data_ptr() for t in dst])


def disjoint_strided_batch(rng, unit: int, stride: int, pairs: int = 4, slots: int = 5) -> StridedBatch:
    """A random factored batch over :func:`kernel_buffers`' regions whose rows are ``unit``-aligned
    (``unit`` 1: none is) and up to 5 units long; destinations: pair ``p`` of region ``r`` owns
    bytes ``[96 * (p % 2), +80)`` of every ``stride``-byte slot (disjoint)."""
    import numpy as np

    length = rng.integers(1, 6, pairs) * unit
    return StridedBatch.of(rng.integers(0, 2, pairs), rng.integers(0, 20, pairs) * unit, stride * 2, [0, 0, 1, 1],
                           np.array([0, 96, 0, 96]) + (3 if unit == 1 else 0), stride, length,
                           rng.integers(0, 6, slots), rng.permutation(12)[:slots])


def one_region_table(pool):
    """A receiver's region table (``sizes``, ``ptr``, ``dev`` by id) holding one host tensor
    ``pool`` as region 0: what the staged receiver's land steps check rows against."""
    from types import SimpleNamespace

    import numpy as np

    from transport.base import Region, RegionSizes

    nbytes = pool.numel() * pool.element_size()
    return SimpleNamespace(sizes=RegionSizes({0: Region(0, pool.data_ptr(), nbytes)}),
                           ptr=np.array([pool.data_ptr()], np.uint64), dev=np.array([-1]))


def assert_refused(call, error: type, text: str, what: str) -> None:
    """``call()`` raises ``error`` whose message holds ``text`` (``what`` names the case)."""
    try:
        call()
    except error as exc:
        assert text in str(exc), exc
        return
    raise AssertionError(f"{what}: not refused")
