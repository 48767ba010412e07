"""Run by ``test_nvlink_lander_c.py`` in a fresh Python whose ``libcuda.so.1`` is the stand-in
of ``fake_cuda/libcuda.c``, logging the calls that enqueue work: ``native.c``'s ``pipeline`` (the
staged engine's chunks in one call) and ``launch`` with 8-byte integers, each against the calls
written out here step by step from ``StagedLane.run``'s order; a failed call midway; arguments
refused. Each case prints its name; an assertion names what went wrong."""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from transport.nvlink import native

CTX, WAIT, RECORD, COPY, LAUNCH = 1, 2, 3, 4, 5


class Entry(ctypes.Structure):
    _fields_ = [("call", ctypes.c_uint64), ("a", ctypes.c_uint64 * 16)]


class Fake:
    """The stand-in's log and switches."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        assert hasattr(self.lib, "fake_log"), "libcuda.so.1 is not the stand-in: LD_LIBRARY_PATH"
        self.log = (Entry * 4096).in_dll(self.lib, "fake_log")
        self.sizes = (ctypes.c_int * 16).in_dll(self.lib, "fake_param_sizes")

    def start(self, sizes, fail_at: int = 0) -> None:
        for i in range(16):
            self.sizes[i] = sizes[i] if i < len(sizes) else 0
        ctypes.c_int.in_dll(self.lib, "fake_logged").value = 0
        ctypes.c_int.in_dll(self.lib, "fake_fail_at").value = fail_at
        ctypes.c_int.in_dll(self.lib, "fake_logging").value = 1

    def calls(self) -> list[tuple]:
        n = ctypes.c_int.in_dll(self.lib, "fake_logged").value
        ctypes.c_int.in_dll(self.lib, "fake_logging").value = 0
        width = {CTX: 1, WAIT: 2, RECORD: 2, COPY: 4, LAUNCH: 16}
        return [(e.call, *[int(v) for v in e.a[: width[e.call]]]) for e in self.log[:n]]


def expected_pipeline(local_ctx, peer_ctx, streams, events, buffers, nxt, gather, scatter, ints, bounds, offsets,
                      upload, sizes) -> list[tuple]:
    """The calls of one pipeline, chunk by chunk as ``StagedLane.run`` makes them."""
    g, c, s = streams
    n = len(buffers) // 2
    slot_base, num_pairs, num_slots, block_r, programs = ints
    pad = [0] * (11 - len(sizes))

    def launch(spec, stream, grid, a, b, tiles, stage, origin):
        function, block, shared, trailing, _wide, table, slots = spec
        params = [table, slots, slot_base, num_pairs, num_slots, a, b, tiles, stage, origin, 0][: len(sizes)]
        return (LAUNCH, function, grid, block, shared, stream, *params, *pad)

    out = [(CTX, peer_ctx), (COPY, *upload, s)]
    for k in range(len(bounds) - 1):
        a, b, origin = bounds[k], bounds[k + 1], offsets[k]
        slot = (nxt + k) % n
        gathered, copied, scattered = events[slot], events[n + slot], events[2 * n + slot]
        mine, theirs = buffers[slot], buffers[n + slot]
        tiles = -(-(b - a) // block_r)
        grid = min(programs, tiles) if programs else tiles
        out += [(CTX, local_ctx), (WAIT, g, copied), launch(gather, g, grid, a, b, tiles, mine, origin),
                (RECORD, gathered, g), (WAIT, c, gathered), (WAIT, c, scattered),
                (COPY, theirs, mine, offsets[k + 1] - origin, c), (RECORD, copied, c),
                (CTX, peer_ctx), (WAIT, s, copied), launch(scatter, s, grid, a, b, tiles, theirs, origin),
                (RECORD, scattered, s)]
    return out + [(CTX, 0)]  # the context current before (none, in the stand-in)


def main() -> None:
    fake = Fake()
    steps = native.build()
    steps.load_driver()
    sizes = [8, 8, 4, 4, 4, 4, 4, 4, 8, 8, 8]  # table, slots, six int32s, stage and origin int64, one scratch
    wide = 0b11000000  # of the eight integers, stage and origin
    streams, events = (11, 12, 13), (101, 102, 201, 202, 301, 302)  # gathered, copied, scattered per buffer
    buffers = (0x1000, 0x2000, 0x3000, 0x4000)  # mine per buffer, then theirs
    gather = (0xF1, 128, 1024, 1, wide, 0xA1, 0xA2)
    scatter = (0xF2, 256, 0, 1, wide, 0xB1, 0xB2)
    ints = (40, 3, 5, 4, 2)  # slot base, pairs, slots, rows per tile, programs
    bounds = np.array([0, 4, 9, 15], dtype=np.int64)
    offsets = np.array([0, 400, (1 << 32) + 900, (1 << 32) + 1500], dtype=np.int64)  # an origin past int32
    upload = (0x5000, 0x6000, 80)

    fake.start(sizes)
    nxt = steps.pipeline(0, 1, streams, events, buffers, 1, gather, scatter, ints, bounds, offsets, upload)
    got = fake.calls()
    want = expected_pipeline(1, 2, streams, events, buffers, 1, gather, scatter, ints, bounds.tolist(),
                             offsets.tolist(), upload, sizes)
    assert nxt == 4, nxt
    assert got == want, "\n".join(f"{g}\n{w}\n" for g, w in zip(got, want) if g != w) or (len(got), len(want))
    print("pipeline in order")

    first_scatter_chunk_1 = 2 + 12 + 11  # the upload, chunk 0, then chunk 1 up to its scatter launch
    fake.start(sizes, fail_at=first_scatter_chunk_1)
    try:
        steps.pipeline(0, 1, streams, events, buffers, 0, gather, scatter, ints, bounds, offsets, upload)
    except RuntimeError as exc:
        assert "cuLaunchKernel failed: CUresult 1" in str(exc), exc
    else:
        raise AssertionError("a failed launch raised nothing")
    got = fake.calls()
    assert len(got) == first_scatter_chunk_1 + 1 and got[-1] == (CTX, 0), got[-3:]  # stopped, context put back
    print("pipeline failed midway")

    for bad, error in (((bounds[::-1].copy(), offsets), ValueError), ((bounds, offsets[:2].copy()), ValueError),
                       ((bounds.astype(np.int32), offsets), TypeError)):
        fake.start(sizes)
        try:
            steps.pipeline(0, 1, streams, events, buffers, 0, gather, scatter, ints, *bad, upload)
        except error:
            pass
        else:
            raise AssertionError(f"pipeline took {bad}")
        assert fake.calls() == [], "a refused pipeline enqueued something"
    for args in ((0, 1, streams[:2], events, buffers, 0, gather, scatter, ints, bounds, offsets, upload),
                 (0, 1, streams, events[:4], buffers, 0, gather, scatter, ints, bounds, offsets, upload),
                 (0, 1, streams, events, buffers, 0, gather[:6], scatter, ints, bounds, offsets, upload)):
        try:
            steps.pipeline(*args)
        except TypeError:
            pass
        else:
            raise AssertionError("pipeline took a malformed tuple")
    print("pipeline refused")

    fake.start(sizes)
    steps.launch(0xF3, 64, 0, 14, 3, (0xC1, 0xC2), (1, -2, 3, 4, 5, 6, 1 << 40, 7), 1, wide)
    assert fake.calls() == [(LAUNCH, 0xF3, 3, 64, 0, 14, 0xC1, 0xC2, 1, (-2) & (2**64 - 1), 3, 4, 5, 6, 1 << 40, 7,
                             0)], "launch with int64s"
    try:
        steps.launch(0xF3, 64, 0, 14, 3, (0xC1, 0xC2), (1 << 40,), 0)
    except OverflowError:
        pass
    else:
        raise AssertionError("an int32 past its range was launched")
    print("launch widths")
    print("pipeline ok")


if __name__ == "__main__":
    main()
    sys.exit(0)
