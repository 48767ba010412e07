"""The transport contract's shared pieces: batch validation and the export envelope."""

import msgpack
import numpy as np
import pytest

import transport.base as base
from transport.base import (
    PeerDescriptorError,
    Region,
    RegionSizes,
    StridedBatch,
    WriteBatch,
    pack_descriptor,
    unpack_descriptor,
)


def _regions(*lengths):
    return {i: Region(i, 4096 * (i + 1), n) for i, n in enumerate(lengths)}


def _reference_in_bounds(batch, table):
    """Entry-by-entry check, the slow obvious way."""
    for r, o, n in zip(batch.src_region, batch.src_offset, batch.length):
        if int(r) not in table or o + n > table[int(r)].length:
            return False
    return True


def test_of_converts_broadcasts_and_rejects():
    b = WriteBatch.of([0, 1], np.array([0, 8], dtype=np.int32), 0, [16, 32], 8)
    assert b.length.dtype == np.int64 and list(b.dst_region) == [0, 0] and len(b) == 2 and b.nbytes == 16
    with pytest.raises(ValueError, match="differ in length: src_region has 2, src_offset has 3"):
        WriteBatch.of([0, 1], [0, 1, 2], 0, 0, 1)
    with pytest.raises(ValueError, match="entry 1: dst_offset is negative"):
        WriteBatch.of(0, [0, 1], 0, [0, -4], 1)
    with pytest.raises(ValueError, match="entry 0: length is 0"):
        WriteBatch.of(0, 0, 0, 0, [0])
    with pytest.raises(TypeError, match="src_offset must hold integers"):
        WriteBatch.of(0, [0.5], 0, 0, 1)
    with pytest.raises(ValueError, match="must be 1-D"):
        WriteBatch.of(0, [[0]], 0, 0, 1)


@pytest.mark.parametrize("seed", range(20))
def test_bounds_check_agrees_with_an_entrywise_reference(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    table = _regions(*rng.integers(1, 1 << 16, size=int(rng.integers(1, 6))))
    if rng.random() < 0.3:  # a deregistered id in the middle
        table.pop(int(rng.integers(0, len(table))), None)
    n = int(rng.integers(1, 200))
    ids = np.array(sorted(table) or [0])
    batch = WriteBatch.of(rng.choice(ids, n) if rng.random() < 0.9 else rng.integers(0, 8, n),
                          rng.integers(0, 1 << 15, n), 0, 0, rng.integers(1, 1 << 12, n))
    remote = _regions(1 << 20)
    for local in (table, RegionSizes(table)):  # the mapping, and the sizes a backend keeps
        if _reference_in_bounds(batch, table):
            batch.check_bounds(local, RegionSizes(remote))
        else:
            with pytest.raises(ValueError, match=r"batch entry \d+: source \(local\)"):
                batch.check_bounds(local, remote)
    # small batches are checked in Python ints, larger ones with numpy: both name the same entry
    said = []
    for small in (0, 1 << 30):
        monkeypatch.setattr(base, "SMALL_BATCH", small)
        try:
            batch.check_bounds(table, remote)
            said.append(None)
        except ValueError as exc:
            said.append(str(exc))
    assert said[0] == said[1]


def test_bounds_errors_name_entry_and_region():
    table = _regions(100, 50)
    with pytest.raises(ValueError, match=r"entry 1: destination \(peer\) range \[40, 60\) is outside region 1 of 50 bytes"):
        WriteBatch.of(0, 0, [0, 1], [0, 40], 20).check_bounds(table, table)
    with pytest.raises(ValueError, match="region 7 is not registered"):
        WriteBatch.of(7, 0, 0, 0, 1).check_bounds(table, table)
    with pytest.raises(ValueError, match=r"region 7 is not registered \(known ids: \[0, 1\]\)"):
        WriteBatch.of(0, 0, 7, 0, 1).check_bounds(RegionSizes(table), RegionSizes(table))
    assert RegionSizes({}).of(np.array([0, 2])).tolist() == [-1, -1]


def test_descriptor_envelope_round_trip_and_errors():
    regs = [Region(0, 4096, 100), Region(1, 8192, 50, device=1)]
    body, table = unpack_descriptor(pack_descriptor("x", regs, extra=b"meta"), "x", required=["extra"])
    assert table == {0: regs[0], 1: regs[1]} and body["extra"] == b"meta"
    data = pack_descriptor("x", regs)
    with pytest.raises(PeerDescriptorError, match="not valid msgpack"):
        unpack_descriptor(data[: len(data) // 2], "x")
    with pytest.raises(PeerDescriptorError, match="for backend 'x', expected 'y'"):
        unpack_descriptor(data, "y")
    with pytest.raises(PeerDescriptorError, match=r"lacks fields \['extra'\]"):
        unpack_descriptor(data, "x", required=["extra"])
    with pytest.raises(PeerDescriptorError, match="version 99"):
        unpack_descriptor(msgpack.packb({"backend": "x", "version": 99, "regions": []}), "x")
    with pytest.raises(PeerDescriptorError, match="repeats region id 0"):
        unpack_descriptor(pack_descriptor("x", [regs[0], regs[0]]), "x")
    with pytest.raises(PeerDescriptorError, match="4 ints"):
        unpack_descriptor(msgpack.packb({"backend": "x", "version": 1, "regions": [[0, 1]]}), "x")
    with pytest.raises(PeerDescriptorError, match="must be bytes"):
        unpack_descriptor("text", "x")


# -- no wrap-around, bounded wire values ------------------------------------------------------


def test_bounds_check_does_not_wrap_in_int64():
    """An entry at offset 2**63-1 of length 1 would end at 2**63, which int64 wraps to a
    negative number below every region's size: it must be refused like any other overflow."""
    table = _regions(4096)
    top = 2**63 - 1
    for side, batch in (("source", WriteBatch.of(0, top, 0, 0, 1)), ("destination", WriteBatch.of(0, 0, 0, top, 1))):
        for t in (table, RegionSizes(table)):
            with pytest.raises(ValueError, match=rf"entry 0: {side} .* range \[{top}, {top + 1}\) is outside region 0"):
                batch.check_bounds(t, t)
    with pytest.raises(ValueError, match="entry 1: source .* is outside region 0 of 4096 bytes"):
        WriteBatch.of(0, [0, 8], 0, 0, [8, top]).check_bounds(table, table)
    strided = StridedBatch.of(0, top, 1, 0, 0, 1, 1, [0], [0])
    with pytest.raises(ValueError, match=r"pair 0: source .* (outside region 0|overflows)"):
        strided.check_bounds(table, table)


@pytest.mark.parametrize("value", [2**64 - 1, 2**63, 2**70])
def test_unsigned_values_past_int64_are_named_not_negative(value):
    arr = np.array([0, value], dtype=np.uint64) if value < 2**64 else [0, value]
    with pytest.raises(ValueError, match=rf"entry 1: dst_offset {value} does not fit int64"):
        WriteBatch.of(0, 0, 0, arr, 1)
    with pytest.raises(ValueError, match=rf"entry 0: length {value} does not fit int64"):
        WriteBatch.of(0, 0, 0, 0, np.array([value], dtype=np.uint64) if value < 2**64 else [value])


def test_an_unknown_huge_region_id_in_a_batch_allocates_nothing():
    table = RegionSizes(_regions(4096))
    with pytest.raises(ValueError, match=r"destination \(peer\) region 1099511627776 is not registered"):
        WriteBatch.of(0, 0, 2**40, 0, 1).check_bounds(table, table)


@pytest.mark.parametrize("entry,match", [
    ([2**26, 4096, 64, -1], r"out of range.*id in \[0, 1048576\)"),
    ([0, 4096, 64, 2**40], r"out of range.*device in \[-1, 65536\)"),
    ([0, 2**64 - 8, 64, -1], "ends past the 64-bit address space"),
])
def test_exports_are_bounded(entry, match):
    """A peer's export cannot make this side allocate a table by a huge region id."""
    with pytest.raises(PeerDescriptorError, match=match):
        unpack_descriptor(msgpack.packb({"backend": "x", "version": 1, "regions": [entry]}), "x")


def test_region_ids_are_bounded_at_registration():
    from transport import base
    from transport.registry import RegionRegistry

    reg = RegionRegistry()
    reg._next_id = base.MAX_REGION_ID - 1
    assert reg.add(4096, 64, None).region_id == base.MAX_REGION_ID - 1
    with pytest.raises(base.TransportError, match=f"region ids exhausted: {base.MAX_REGION_ID} registrations"):
        reg.add(8192, 64, None)
    with pytest.raises(ValueError, match="does not fit a 64-bit address space"):
        reg.add(2**64 - 8, 64, None)


class _Polled(base.Transfer):
    """A transfer DONE at its ``done_at``-th poll."""

    def __init__(self, done_at: int):
        self.polls, self.done_at = 0, done_at

    def status(self):
        self.polls += 1
        return base.TransferStatus.DONE if self.polls >= self.done_at else base.TransferStatus.PENDING

    @property
    def error(self):
        return None

    def abort(self):
        pass


def test_wait_polls_back_to_back_before_it_sleeps(monkeypatch):
    """A write done within ``spin_s`` is waited for without a sleep (a Linux sleep, sleep(0)
    included, lasts at least the timer slack: ~50 us, the whole of a small write); past it,
    wait() backs off in sleeps of at most ``max_poll_sleep_s``."""
    sleeps = []
    monkeypatch.setattr(base.time, "sleep", sleeps.append)
    quick = _Polled(50)
    quick.spin_s = 60.0  # every poll within it, however slow this machine
    quick.wait()
    assert quick.polls == 50 and sleeps == []
    slow = _Polled(30)
    slow.spin_s = 0.0
    slow.wait()
    assert slow.polls == 30 and len(sleeps) == 28 and 0 < max(sleeps) <= slow.max_poll_sleep_s
