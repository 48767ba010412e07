"""NIXL's staged mode: real staged writes between this process and a spawned receiver.

The receiver (``_nixl_peer.serve``) is the same as for the direct path: zeroed regions, a
digest of the ranges a notification names taken when it arrives. Expected bytes come from a
numpy reference built entry by entry here. Slots are kept small (64 KiB) so a write is many
chunks and the slots rotate.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from transport._nixl_import import load_nixl_api

try:
    load_nixl_api()
except ImportError as exc:  # NIXL is an optional extra
    pytest.skip(f"NIXL is not installed: {exc}", allow_module_level=True)

from tests._stop import stop  # noqa: E402
from tests.transport import _nixl_peer  # noqa: E402
from tests.transport._support import (assert_interpreted_ok, assert_same, connect_once_drained, entries,  # noqa: E402
                                      split_deadline, use_deadline)
from tests.transport.nixl._support import (TCP_ONLY, host_region, reference, resumed_later, sha,  # noqa: E402
                                           until_ended, wb)
from transport.base import (  # noqa: E402
    RegionRevoked, StridedBatch, TransferFailed, TransferStatus, TransportError, WriteBatch)
from transport.nixl.staged import StagedNixlConfig  # noqa: E402
from transport.nixl.staged.sender import (  # noqa: E402
    DeferredWrite, LaneState, StagedTransfer, StridedStagedTransfer, chunk_bounds, strided_bounds)
from transport.nixl.staged.wire import (  # noqa: E402
    MAGIC, Chunk, ChunkHeader, DestinationTable, ProtocolError, StridedChunk, StridedHeader, Welcome, data_start,
    decode, encode, registered_entries, strided_data_start)

MiB = 1 << 20
SMALL = StagedNixlConfig(slot_bytes=64 << 10, slots=3, min_rows=64)


def small_rows(rng, num, src_bytes, dst_sizes, lengths=(64, 256, 1000, 1024, 4096)):
    """``num`` rows of the given lengths, random sources, disjoint random destinations over the
    destination regions (a slot of 16 KiB per row, in random order)."""
    length = rng.choice(lengths, num).astype(np.int64)
    src_offset = rng.integers(0, src_bytes - length + 1)
    cells = np.concatenate([np.stack([np.full(n // 16384, r), np.arange(n // 16384) * 16384], 1)
                            for r, n in enumerate(dst_sizes)])
    pick = cells[rng.choice(len(cells), num, replace=False)]
    dst_region, dst_offset = pick[:, 0], pick[:, 1] + rng.integers(0, 16384 - length + 1)
    return np.zeros(num, np.int64), src_offset, dst_region, dst_offset, length


def staged_pair(writer, receiver, dst_sizes, src_bytes=8 * MiB, seed=0, env=None, staged=SMALL, rx_staged=None,
                **config):
    rx = receiver(dst_sizes, env=env, staged=rx_staged)
    t = writer(env=env, staged=staged, **config)
    src, sid = host_region(t, src_bytes, seed)
    return rx, t, src, sid, t.connect(rx.export)


# -- data ----------------------------------------------------------------------------------------


def test_staged_rows_land_byte_for_byte_before_their_notification(writer, receiver):
    dst_sizes = [8 * MiB, 4 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes)
    rng = np.random.default_rng(1)
    entries = small_rows(rng, 600, src.size, dst_sizes)
    batch = wb(sid, *entries[1:])
    note = _nixl_peer.payload(1, [(r, 0, n) for r, n in enumerate(dst_sizes)])
    tr = peer.write(batch, notify=note)
    assert isinstance(tr, StagedTransfer) and tr.num_chunks > SMALL.slots  # the slots rotate
    tr.wait(60)
    want = reference([src], dst_sizes, entries)
    assert rx.wait_notes(1) == [(note, sha(want))], "the notification came before the scatter"
    assert rx.senders == [t.name]
    for r in range(len(dst_sizes)):
        assert_same(rx.dump(r), want[r], f"destination region {r}")
    # a second write reuses the lane (no new Hello): same bytes again, in another order
    order = rng.permutation(len(batch))
    again = WriteBatch.of(*(getattr(batch, f)[order] for f in ("src_region", "src_offset", "dst_region",
                                                               "dst_offset", "length")))
    peer.write(again, notify=_nixl_peer.payload(2, [])).wait(60)
    assert [n for n, _ in rx.wait_notes(2)][1] == _nixl_peer.payload(2, [])
    assert len(t._core.lanes) == 1 and t._core.lanes.get(peer.name).state is LaneState.READY


@pytest.mark.parametrize("case", ["shared", "sender off", "receiver off", "another host", "cannot map"])
def test_a_receiver_on_this_host_shares_its_slots_unless_a_side_cannot(writer, receiver, monkeypatch, case):
    """Two processes of one host: the sender maps the receiver's host slots and gathers into
    them, its own staging released (not in what its metadata registers). A side whose config
    says no, a Hello from another host (its boot or namespaces differ), or a memfd the sender
    cannot open: the slots are written by NIXL as before. The rows land either way."""
    from transport.nixl.staged import lane as lane_module

    off = StagedNixlConfig(slot_bytes=64 << 10, slots=3, min_rows=64, shared_slots=False)
    if case == "another host":
        monkeypatch.setattr(lane_module, "host_key", lambda: "another-boot/1/1")
    if case == "cannot map":
        def refused(slots, slot_bytes, owner):
            raise PermissionError(13, "Permission denied", f"/proc/{owner[0]}/fd/{owner[1]}")
        monkeypatch.setattr(lane_module, "SharedHostStaging", refused)
    dst_sizes = [8 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes, seed=3,
                                        staged=off if case == "sender off" else SMALL,
                                        rx_staged=off if case == "receiver off" else None)
    rng = np.random.default_rng(3)
    want = [np.zeros(dst_sizes[0], np.uint8)]  # what the destination holds, write after write
    for n in (1, 2):  # the lane's first write (it opens) and a later one
        entries = small_rows(rng, 500, src.size, dst_sizes)
        note = _nixl_peer.payload(n, [(0, 0, dst_sizes[0])])
        tr = peer.write(wb(sid, *entries[1:]), notify=note)
        assert isinstance(tr, StagedTransfer) and tr.num_chunks > SMALL.slots
        tr.wait(60)
        for _, so, dr, do, ln in zip(*entries):
            want[dr][do: do + ln] = src[so: so + ln]
        assert rx.wait_notes(n)[-1] == (note, sha(want))
        assert_same(rx.dump(0), want[0], f"destination after write {n}")
    lane = t._core.lanes.get(peer.name)
    assert lane.state is LaneState.READY and lane.shared is (case == "shared")
    staged_entries = [e for e in t._core.registered() if e[0] == -1]
    assert len(staged_entries) == (0 if lane.shared else 1)


def test_writes_behind_a_staged_one_keep_their_order(writer, receiver):
    """A direct write and a second staged write issued while a staged one posts its chunks are
    delivered after it, in the order issued, each notification with its bytes in place (one
    destination region per write: a digest covers its own write's region)."""
    dst_sizes = [8 * MiB, 1 * MiB, 8 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes)
    rng = np.random.default_rng(2)
    first = small_rows(rng, 400, src.size, [8 * MiB], lengths=(1024,))
    third = small_rows(rng, 400, src.size, [8 * MiB], lengths=(1024,))
    third = (third[0], third[1], np.full(400, 2), third[3], third[4])
    notes = [_nixl_peer.payload(i, [(r, 0, dst_sizes[r])]) for i, r in enumerate((0, 1, 2))]
    transfers = [peer.write(wb(sid, *first[1:]), notify=notes[0]),
                 peer.write(wb(sid, 3 * MiB, 1, 0, 1 * MiB), notify=notes[1]),
                 peer.write(wb(sid, *third[1:]), notify=notes[2])]
    assert [type(tr) for tr in transfers] == [StagedTransfer, DeferredWrite, StagedTransfer]
    for tr in reversed(transfers):
        tr.wait(60)
    want = reference([src], dst_sizes, first)[0], src[3 * MiB:4 * MiB], reference([src], dst_sizes, third)[2]
    assert rx.wait_notes(3) == [(note, sha([w])) for note, w in zip(notes, want)]


TOKEN = 2048  # bytes of one token row of a K or V buffer: 8 heads x 128 x bf16


def strided_cases(rng, sid):
    """Strided batches as a KV request makes them, from one 8 MiB source region into destination
    regions 0 (8 MiB) and 1 (4 MiB): (name, batch)."""
    layers2 = 8  # K and V of 4 layers: one buffer of 512 token slots per MiB
    buffers = np.arange(layers2, dtype=np.int64) * MiB
    s_slots, d_slots = rng.permutation(np.arange(1, 512))[:300], rng.permutation(np.arange(1, 512))[:300]
    # MHA at page 1, TP 1 -> 1: a pair per buffer, whole 2 KiB token rows
    page1 = StridedBatch.of(sid, buffers, TOKEN, 0, buffers, TOKEN, TOKEN, s_slots, d_slots)
    # TP 8 -> 1: prefill rank 3 holds head 3 (256 B rows, its pool's token stride); decode
    # buffers hold all 8 heads, head 3 at 768 B into each 2 KiB row
    heads = StridedBatch.of(sid, buffers // 8, 256, 0, buffers + 3 * 256, TOKEN, 256, s_slots, d_slots)
    # pairs of odd lengths, one of them 800 KB (it spans many 64 KiB slots); duplicate and
    # unordered source slots, unordered destination slots
    odd = StridedBatch.of(sid, np.array([3, MiB + 5, 2 * MiB + 7]), 4096, 1, np.array([5, MiB + 13, 2 * MiB + 7]),
                          4096, np.array([24, 1000, 4096]), rng.integers(0, 256, 200), rng.permutation(256)[:200])
    return [("MHA page 1", page1), ("TP 8 -> 1 head slices", heads), ("odd pairs across chunks", odd)]


def test_strided_writes_land_byte_for_byte_before_their_notification(writer, receiver):
    """StridedBatches through ``write_strided`` go staged (O(P + S) per write), each slot
    carrying the write's destination table; every byte as an entry-by-entry reference says,
    before the write's notification; a flat staged write on the same lane still works after."""
    dst_sizes = [8 * MiB, 4 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes)
    rng = np.random.default_rng(21)
    want = [np.zeros(n, np.uint8) for n in dst_sizes]
    whole = [(r, 0, n) for r, n in enumerate(dst_sizes)]
    for i, (name, batch) in enumerate(strided_cases(rng, sid)):
        note = _nixl_peer.payload(i, whole)
        tr = peer.write_strided(batch, notify=note)
        assert isinstance(tr, StridedStagedTransfer), name
        assert tr.num_chunks > SMALL.slots, name  # the slots rotate
        tr.wait(60)
        for sr, so, dr, do, n in entries(batch):
            want[dr][do:do + n] = src[so:so + n]
        assert rx.wait_notes(i + 1)[i] == (note, sha(want)), f"{name}: the notification came before the scatter"
    for r in range(len(dst_sizes)):
        assert_same(rx.dump(r), want[r], f"destination region {r}")
    flat = small_rows(rng, 300, src.size, [8 * MiB])
    note = _nixl_peer.payload(9, [(0, 0, 8 * MiB)])
    peer.write(wb(sid, *flat[1:]), notify=note).wait(60)
    for so, do, n in zip(flat[1], flat[3], flat[4]):
        want[0][do:do + n] = src[so:so + n]
    assert rx.wait_notes(4)[3] == (note, sha([want[0]]))
    assert len(t._core.lanes) == 1 and t._core.lanes.get(peer.name).state is LaneState.READY


def test_strided_batches_outside_the_rule_are_written_coalesced(writer, receiver):
    """Whole-page runs (the coalesced form has 32 KiB ranges) and too few rows go as
    ``write(batch.coalesced())`` would: direct, the same bytes."""
    dst_sizes = [8 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes)
    pages = StridedBatch.of(sid, 0, TOKEN, 0, 0, TOKEN, TOKEN, np.arange(16, 16 + 64 * 16),
                            (np.random.default_rng(22).permutation(np.arange(1, 128))[:64, None] * 16
                             + np.arange(16)).ravel())
    few = StridedBatch.of(sid, 4 * MiB, TOKEN, 0, 4 * MiB, TOKEN, TOKEN, np.arange(0, 40, 2), np.arange(0, 40, 2))
    want = np.zeros(8 * MiB, np.uint8)
    for i, batch in enumerate((pages, few)):
        tr = peer.write_strided(batch, notify=_nixl_peer.payload(i, [(0, 0, 8 * MiB)]))
        assert not isinstance(tr, (StagedTransfer, StridedStagedTransfer, DeferredWrite))
        tr.wait(30)
        for sr, so, dr, do, n in entries(batch):
            want[do:do + n] = src[so:so + n]
        assert rx.wait_notes(i + 1)[i][1] == sha([want])
    assert not len(t._core.lanes)


def test_host_strided_batches_with_long_source_runs_go_flat_for_the_wire_to_gather(writer, receiver):
    """Sources in 32 KiB runs on the host (a TP 2 -> 1 head slice of whole prefill pages of 32
    tokens, ``wire_gather_bytes``): ``write_strided`` hands the flat staged write its coalesced
    form, whose chunks the wire gathers run by run; the same rows with scattered sources go
    strided. Both land byte for byte."""
    dst_sizes = [8 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes)
    rng = np.random.default_rng(23)
    row, page = 1024, 32  # source: 1 KiB rows, 32 to a page; destination: half of a 2 KiB row
    assert row * page == SMALL.wire_gather_bytes
    src_slots = (rng.permutation(np.arange(1, 100))[:8, None] * page + np.arange(page)).ravel()  # [256]
    dst_slots = rng.permutation(src_slots.size)  # [256] each pair's 256 destinations lie in its own MiB
    runs = StridedBatch.of(sid, np.arange(8) * (256 * 1024), row, 0, np.arange(8) * MiB, 2 * row, row,
                           src_slots, dst_slots)
    scattered = StridedBatch.of(sid, np.arange(8) * (256 * 1024), row, 0, np.arange(8) * MiB, 2 * row, row,
                                rng.permutation(src_slots), dst_slots)
    want = np.zeros(8 * MiB, np.uint8)
    for i, (batch, kind) in enumerate(((runs, StagedTransfer), (scattered, StridedStagedTransfer))):
        assert (batch.source_runs() == 8 * 8) is (kind is StagedTransfer)
        tr = peer.write_strided(batch, notify=_nixl_peer.payload(i, [(0, 0, 8 * MiB)]))
        assert isinstance(tr, kind)
        tr.wait(30)
        for sr, so, dr, do, n in entries(batch):
            want[do:do + n] = src[so:so + n]
        assert rx.wait_notes(i + 1)[i][1] == sha([want])


def test_batches_outside_the_rule_go_direct(writer, receiver):
    rx, t, src, sid, peer = staged_pair(writer, receiver, [4 * MiB])
    few = peer.write(wb(sid, np.arange(10) * 4096, 0, np.arange(10) * 4096, 4096))
    big = peer.write(wb(sid, np.arange(100) * 32768, 0, np.arange(100) * 32768, 32768))
    for tr in (few, big):
        assert not isinstance(tr, (StagedTransfer, DeferredWrite))
        tr.wait(30)
    assert not len(t._core.lanes)


def test_a_receiver_that_refuses_a_lane_gets_direct_writes(writer, receiver):
    """The receiver grants lanes of at most 2 x 64 KiB; this writer asks for 4 x 4 MiB."""
    dst_sizes = [8 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes, staged=StagedNixlConfig(min_rows=64),
                                        rx_staged=StagedNixlConfig(slot_bytes=64 << 10, slots=2))
    entries = small_rows(np.random.default_rng(3), 300, src.size, dst_sizes)
    note = _nixl_peer.payload(1, [(0, 0, 8 * MiB)])
    peer.write(wb(sid, *entries[1:]), notify=note).wait(60)
    lane = t._core.lanes.get(peer.name)
    assert lane.state is LaneState.REFUSED and "allows at most 131072 bytes per lane" in lane.error
    assert rx.wait_notes(1) == [(note, sha(reference([src], dst_sizes, entries)))]
    direct = peer.write(wb(sid, *entries[1:]))
    assert not isinstance(direct, (StagedTransfer, DeferredWrite))
    direct.wait(30)


def test_a_region_a_welcome_brought_and_its_memory_laid_out_again_takes_writes(writer, receiver):
    """A lane's Welcome brings the receiver's metadata as it is then, with a region no export
    this writer connected to named (registered since). NIXL keeps that entry; once the receiver
    deregisters the region and lays a new one over part of its memory, a write into the new one
    that starts inside the old entry must still land: the writer loads the newer export afresh
    (in place, NIXL looked the write up in the stale entry and refused it)."""
    rx = receiver([8 * MiB, 64 << 10])  # buffer 1: memory for regions the writer's export does not name
    first = rx.deregister(1)  # an export naming region 0 alone
    t = writer(staged=SMALL)
    src, sid = host_region(t, 8 * MiB, 31)
    peer = t.connect(first)
    small, _ = rx.register(1, 4096, 4096)  # after the export the writer connected to
    rows = small_rows(np.random.default_rng(31), 400, src.size, [8 * MiB])
    tr = peer.write(wb(sid, *rows[1:]), notify=_nixl_peer.payload(1, []))  # into region 0
    assert isinstance(tr, StagedTransfer)
    tr.wait(60)  # its Hello / Welcome went: the writer loaded the metadata that names `small`
    rx.deregister(small, pump=t.poll_notifications)  # nobody holds it: no revoke to wait for
    mid, export = rx.register(1, 2048, 16384)  # over part of small's memory
    # 8 KiB from buffer 1's byte 5001: inside the stale entry [4096, 8192) and past its end
    connect_once_drained(t, export).write(wb(sid, 7, mid, 5001 - 2048, 8192)).wait(30)
    assert_same(rx.dump(mid)[2953:2953 + 8192], src[7:7 + 8192], "the region laid over the stale one")


def test_rows_for_a_region_the_receiver_deregistered_are_refused(writer, receiver, monkeypatch):
    """A stale export: the writer answered the revocation, so a staged write naming the region
    raises RegionRevoked at once; and should a writer not know of it (one the receiver gave up
    on with ``deregister(force=True)``), the receiver checks each chunk's rows against its OWN
    regions, refuses the chunk, lands nothing of it, and the write FAILS naming why."""
    dst_sizes = [4 * MiB, 4 * MiB]
    rx, t, src, sid, peer = staged_pair(writer, receiver, dst_sizes)
    rng = np.random.default_rng(4)
    entries = small_rows(rng, 200, src.size, [4 * MiB])
    peer.write(wb(sid, *entries[1:])).wait(60)  # lane open
    rx.deregister(1, pump=t.poll_notifications)  # t answers the revoke meanwhile
    with pytest.raises(RegionRevoked, match="region 1 of peer .* was revoked"):
        peer.write(wb(sid, entries[1], 1, entries[3], entries[4]))
    monkeypatch.setattr(t._core.holds, "check", lambda owner, dst_region: None)  # a writer that missed the revoke
    never = _nixl_peer.payload(1, [])
    stale = peer.write(wb(sid, entries[1], 1, entries[3], entries[4]), notify=never)
    with pytest.raises(TransferFailed, match=r"refused chunk \d+: batch entry 0: destination \(this "
                                             r"receiver\) region 1 is not registered"):
        stale.wait(60)
    assert_same(rx.dump(0), reference([src], [4 * MiB], entries)[0], "region 0 after the refused write")
    # a strided write's destination table names the region too: refused by the receiver's check
    # of the table (its first chunk), nothing of the write lands (pair 1 is region 0's)
    strided = StridedBatch.of(sid, [0, 4096], 8192, [1, 0], [0, 4096], 8192, 4096, np.arange(256),
                              np.random.default_rng(5).permutation(256))
    stale = peer.write_strided(strided, notify=never)
    assert isinstance(stale, StridedStagedTransfer)
    with pytest.raises(TransferFailed, match=r"refused chunk \d+: batch pair 0: destination \(this "
                                             r"receiver\) region 1 is not registered"):
        stale.wait(60)
    assert_same(rx.dump(0), reference([src], [4 * MiB], entries)[0], "region 0 after the refused strided write")
    after = _nixl_peer.payload(2, [])
    peer.write(wb(sid, *entries[1:]), notify=after).wait(60)  # the lane still works
    assert [n for n, _ in rx.wait_notes(1)] == [after]


def test_reserved_payloads_are_refused(writer, receiver):
    rx, t, src, sid, peer = staged_pair(writer, receiver, [1 * MiB])
    with pytest.raises(ValueError, match="reserved for staged writes"):
        peer.write(wb(sid, 0, 0, 0, 64), notify=MAGIC + b"x")


# -- failures ------------------------------------------------------------------------------------


def stalled_staged(writer, receiver, nbytes, seed, strided=False, **config):
    """tcp only, the lane open and warm; then the receiver is stopped and a staged write of
    ``nbytes`` of 4 KiB rows is posted (its first slots are surely in flight): flat, or
    (``strided``) as one pair of 4 KiB rows x slots in random order through ``write_strided``
    (in source order it would go flat: one source run, gathered by the wire)."""
    deadline = split_deadline(config)
    rx, t, src, sid, peer = staged_pair(writer, receiver, [nbytes], src_bytes=nbytes, seed=seed, env=TCP_ONLY,
                                        staged=StagedNixlConfig(slot_bytes=1 * MiB, slots=4), **config)
    n = nbytes // 4096
    rng = np.random.default_rng(seed)
    offs = np.arange(n, dtype=np.int64) * 4096
    peer.write(wb(sid, offs, 0, rng.permutation(offs), 4096)).wait(60)
    use_deadline(t, deadline)
    stop(rx.proc.pid)
    if strided:
        tr = peer.write_strided(StridedBatch.of(sid, 0, 4096, 0, 0, 4096, 4096, rng.permutation(n), rng.permutation(n)))
    else:
        tr = peer.write(wb(sid, offs, 0, rng.permutation(offs), 4096))
    kind = StridedStagedTransfer if strided else StagedTransfer
    assert isinstance(tr, kind) and tr.status() is TransferStatus.PENDING and tr.posted >= 1
    return rx, t, src, sid, peer, tr


STRIDED_OR_FLAT = pytest.mark.parametrize("strided", [False, True], ids=["flat", "strided"])


@STRIDED_OR_FLAT
def test_no_byte_of_an_aborted_staged_write_lands_after_abort_returns(writer, receiver, strided):
    rx, t, src, sid, peer, tr = stalled_staged(writer, receiver, 16 * MiB, 5, peer_loss_timeout_s=20.0, strided=strided)
    resume = resumed_later(rx, 0.3)
    tr.abort()
    assert resume.continued.is_set(), "abort() returned before the stopped receiver could answer"
    resume.join()
    assert tr.status() is TransferStatus.FAILED and tr.error == "aborted"
    assert tr.credited == tr.posted < tr.num_chunks
    nothing_lands_later(rx, t, peer, tr, 6, "aborted")


def nothing_lands_later(rx, t, peer, tr, seed, how: str) -> None:
    """After the staged write ``tr`` (16 MiB into region 0) ended: the region no longer changes,
    and the lane's next write, a staged rewrite of all of it, lands."""
    ended = rx.dump(0)
    time.sleep(0.3)  # room for a late byte
    assert_same(rx.dump(0), ended, f"destination after the {how} write ended")
    fresh, fresh_id = host_region(t, 16 * MiB, seed)
    offs = np.arange(16 * MiB // 4096, dtype=np.int64) * 4096
    again = peer.write(wb(fresh_id, offs, 0, offs, 4096))
    assert isinstance(again, StagedTransfer) and again.lane is tr.lane
    again.wait(60)
    assert_same(rx.dump(0), fresh, f"destination after the {how} write and the lane's next one")


@STRIDED_OR_FLAT
def test_a_cancelled_staged_write_ends_once_its_posted_chunks_are_answered(writer, receiver, strided):
    """``cancel()`` returns while the stopped receiver holds the posted chunks; the write stays
    PENDING, posts nothing more, and ends FAILED ("aborted") once the receiver has answered
    every chunk posted; nothing lands after that, and the lane takes the next write."""
    rx, t, src, sid, peer, tr = stalled_staged(writer, receiver, 16 * MiB, 15, peer_loss_timeout_s=20.0,
                                               strided=strided)
    posted = tr.posted
    tr.cancel()  # returns at once: the receiver is stopped
    assert tr.status() is TransferStatus.PENDING and tr.posted == posted
    os.kill(rx.proc.pid, signal.SIGCONT)
    until_ended(tr, "a cancelled staged write")
    assert tr.status() is TransferStatus.FAILED and tr.error == "aborted"
    assert tr.credited == tr.posted == posted < tr.num_chunks
    nothing_lands_later(rx, t, peer, tr, 16, "cancelled")


@STRIDED_OR_FLAT
def test_chunks_gathered_ahead_of_the_receivers_answers_never_land_once_aborted(writer, receiver, strided):
    """The receiver's owner reads nothing for a while, its NIXL progress thread completes the
    writes: local slots come free (NIXL read them) before any Credit, so the sender gathers
    the next chunks ahead. An abort then: no gathered chunk is posted, nothing lands after
    abort() returns, and every local slot is back (the lane's next write lands in full).
    Slots of its own, written by NIXL: a lane sharing the receiver's slots gathers only into
    slots the receiver has answered."""
    nbytes, slots = 16 * MiB, 4
    rx = receiver([nbytes], env=TCP_ONLY, progress_thread=True)
    t = writer(env=TCP_ONLY, staged=StagedNixlConfig(slot_bytes=1 * MiB, slots=slots, shared_slots=False),
               peer_loss_timeout_s=20.0)
    src, sid = host_region(t, nbytes, 8)
    peer = t.connect(rx.export)
    n = nbytes // 4096
    rng = np.random.default_rng(8)
    offs = np.arange(n, dtype=np.int64) * 4096
    peer.write(wb(sid, offs, 0, rng.permutation(offs), 4096)).wait(60)  # the lane open and warm
    rx.pause()
    if strided:
        tr = peer.write_strided(StridedBatch.of(sid, 0, 4096, 0, 0, 4096, 4096, rng.permutation(n), rng.permutation(n)))
    else:
        tr = peer.write(wb(sid, offs, 0, rng.permutation(offs), 4096))
    deadline = time.monotonic() + 30
    while tr.gathered <= tr.posted:
        assert time.monotonic() < deadline, f"no chunk gathered ahead: {(tr.credited, tr.posted, tr.gathered)}"
        tr.status()
        time.sleep(0.01)
    assert tr.credited == 0 and tr.posted == slots and tr.gathered > tr.posted, (tr.credited, tr.posted, tr.gathered)
    # the receiver answers from now on; this process reads its answers only inside abort(),
    # which posts nothing more from its start
    rx.resume()
    tr.abort()  # returns once the receiver answered what was posted
    assert tr.status() is TransferStatus.FAILED and tr.error == "aborted"
    assert tr.credited == tr.posted == slots  # the gathered chunks were never posted
    nothing_lands_later(rx, t, peer, tr, 9, "aborted")


@STRIDED_OR_FLAT
def test_a_stalled_receiver_fails_the_staged_write_at_its_deadline(writer, receiver, strided):
    rx, t, src, sid, peer, tr = stalled_staged(writer, receiver, 8 * MiB, 7, peer_loss_timeout_s=1.0, strided=strided)
    with pytest.raises(TransferFailed, match=r"not done after .* s \(peer lost or stalled\)"):
        tr.wait(30)  # the transfer's deadline failed it, not wait()'s own timeout
    later = peer.write(wb(sid, np.arange(100) * 4096, 0, np.arange(100) * 4096, 4096))
    assert later.status() is TransferStatus.FAILED and "was lost earlier" in later.error
    with pytest.raises(TransportError, match=r"failed request\(s\) in flight"):
        t.connect(rx.export)
    os.kill(rx.proc.pid, signal.SIGCONT)
    again = connect_once_drained(t, rx.export)
    n = 8 * MiB // 4096
    offs = np.arange(n, dtype=np.int64) * 4096
    note = _nixl_peer.payload(3, [])
    fresh = again.write(wb(sid, offs, 0, offs, 4096), notify=note)
    assert isinstance(fresh, StagedTransfer)  # a new lane (a new Hello on the new endpoint)
    fresh.wait(60)
    assert rx.wait_notes(1)[-1][0] == note
    assert_same(rx.dump(0), src, "destination after reconnecting")


def test_a_receiver_that_never_answers_the_hello_fails_the_write_at_its_deadline(writer, receiver):
    """Stopped before the first staged write: the lane never opens, the write FAILS at its
    deadline; once the receiver runs again a new connect opens a fresh lane."""
    rx, t, src, sid, peer = staged_pair(writer, receiver, [4 * MiB], src_bytes=4 * MiB, seed=9, env=TCP_ONLY)
    peer.write(wb(sid, 0, 0, 0, 4096)).wait(30)  # connection up, no lane yet
    use_deadline(t, {"peer_loss_timeout_s": 1.0})
    stop(rx.proc.pid)
    offs = np.arange(1024, dtype=np.int64) * 4096
    tr = peer.write(wb(sid, offs, 0, offs, 4096))
    assert isinstance(tr, StagedTransfer) and t._core.lanes.get(peer.name).state is LaneState.OPENING
    with pytest.raises(TransferFailed, match=r"not done after .* s \(peer lost or stalled\)"):
        tr.wait(30)
    os.kill(rx.proc.pid, signal.SIGCONT)
    again = connect_once_drained(t, rx.export)
    again.write(wb(sid, offs, 0, offs, 4096)).wait(60)
    assert_same(rx.dump(0), src, "destination after reconnecting")


@STRIDED_OR_FLAT
def test_a_killed_receiver_fails_the_staged_write(writer, receiver, strided):
    rx, t, src, sid, peer, tr = stalled_staged(writer, receiver, 16 * MiB, 8, peer_loss_timeout_s=5.0, strided=strided)
    os.kill(rx.proc.pid, signal.SIGKILL)
    rx.proc.join(5)
    with pytest.raises(TransferFailed, match="peer '.*'.*(DISCONNECT|not done after)"):
        tr.wait(20)  # the disconnect or the transfer's deadline failed it, not wait()'s own timeout


# -- pieces --------------------------------------------------------------------------------------


def test_config_rule_and_validation():
    cfg = StagedNixlConfig()
    def rows(length):
        return WriteBatch.of(0, np.arange(len(length)) * 65536, 0, np.arange(len(length)) * 65536, length)

    assert cfg.wants(rows(np.full(1024, 1024))) and not cfg.wants(rows(np.full(1023, 1024)))
    assert not cfg.wants(rows(np.append(np.full(2000, 256), 32768)))
    assert not StagedNixlConfig(enabled=False).wants(rows(np.full(4096, 256)))
    assert cfg.lane_bytes == 16 * MiB
    with pytest.raises(ValueError, match="slots must be an int >= 2, got 1"):
        StagedNixlConfig(slots=1)
    with pytest.raises(ValueError, match="cannot hold one row of max_row_bytes"):
        StagedNixlConfig(slot_bytes=1 << 16, max_row_bytes=1 << 16)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        StagedNixlConfig(enabled=1)
    with pytest.raises(TypeError, match="shared_slots must be a bool"):
        StagedNixlConfig(shared_slots="yes")


class _Scatters:
    """A lane's staging whose queued scatters pass when the test says (``passed``); ``ready``
    records the slots it was asked to wait for and lets them pass. Slots in ``refuse`` fail
    their checks."""

    slots = 4

    def __init__(self):
        self.passed, self.waited, self.refuse = set(), [], set()

    def land(self, k, expect, table):
        if k in self.refuse:
            raise ProtocolError(f"slot {k} refused")
        self.passed.discard(k)  # a scatter queued now

    def queued(self, k):
        pass

    def is_ready(self, k):
        return k in self.passed

    def ready(self, k=None):
        for slot in range(self.slots) if k is None else (k,):
            self.waited.append(slot)
            self.passed.add(slot)

    def close(self):
        pass


class _Owner:
    """What the receiver's lanes use of their transport's core (``transport.nixl.core.Core``):
    the owner's notifications, the answers sent (decoded), released registrations."""

    def __init__(self):
        self.notes, self.sent, self.released = [], [], []
        self.agent = self

    def send(self, name, payload):
        self.sent.append((name, decode(payload)))
        return True

    def deliver(self, note):
        self.notes.append(note)

    def table(self):
        return None

    def deregister(self, reg):
        self.released.append(reg)


def test_gpu_chunk_answers_wait_for_their_scatter_and_keep_each_senders_order():
    """The receiver's answer FIFO (receiver.py, "Answers wait for the scatter"): a chunk's
    Credit and its write's notification go once its scatter has passed, in arrival order; an
    owner's notification from the same sender queues behind them, another sender's does not; a
    refused chunk's answer waits its turn too; a dropped lane waits for its scatters and
    answers them."""
    from transport.nixl.staged.receiver import ReceiverLanes, _Lane

    owner, staging = _Owner(), _Scatters()
    lanes = ReceiverLanes(owner)
    lanes._lanes["A", 1] = _Lane(staging, "reg-a", 0)
    lanes.handle("A", Chunk(1, 7, 0, 2, 0, None))  # write 7: chunk 0 of 2 in slot 0
    lanes.handle("A", Chunk(1, 7, 1, 2, 1, b"kv"))  # its last chunk, in slot 1
    lanes.deliver("A", b"direct")  # a direct write of A's, behind write 7
    lanes.deliver("B", b"other")  # another sender's: at once
    assert lanes.in_flight and owner.sent == []
    assert [n.payload for n in owner.notes] == [b"other"]

    staging.passed.add(1)  # slot 1's scatter passed before slot 0's: nothing may overtake slot 0
    lanes.answer()
    assert owner.sent == [] and [n.payload for n in owner.notes] == [b"other"]
    lanes.wait_oldest()  # waits for the oldest scatter only
    assert staging.waited == [0]
    lanes.answer()
    assert [(name, m.index, m.slot, m.error) for name, m in owner.sent] == [("A", 0, 0, ""), ("A", 1, 1, "")]
    assert [(n.sender, n.payload) for n in owner.notes] == [("B", b"other"), ("A", b"kv"), ("A", b"direct")]
    assert not lanes.in_flight

    owner.sent.clear()
    staging.refuse.add(3)
    lanes.handle("A", Chunk(1, 8, 0, 2, 2, None))  # write 8: chunk 0 scatters
    lanes.handle("A", Chunk(1, 8, 1, 2, 3, b"kv8"))  # chunk 1 is refused: its error waits its turn
    assert owner.sent == [] and lanes.in_flight
    lanes.close()  # the lane goes: its scatters are waited for and answered first
    assert staging.waited[1:] == [0, 1, 2, 3] and owner.released == ["reg-a"]
    assert [(m.index, bool(m.error)) for _, m in owner.sent] == [(0, False), (1, True)]
    assert [n.payload for n in owner.notes][-1] == b"direct", "a refused write never notifies"
    assert not lanes.in_flight


def test_chunks_fit_their_slots():
    rng = np.random.default_rng(9)
    length = rng.integers(1, 16385, 5000)
    bounds = chunk_bounds(length, 1 << 16)
    assert bounds[0] == 0 and bounds[-1] == length.size and (np.diff(bounds) > 0).all()
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert data_start(b - a) + int(length[a:b].sum()) <= 1 << 16


def test_messages_and_headers_round_trip_and_refuse_garbage():
    msg = Chunk(3, 7, 1, 2, 2, b"note")
    assert decode(encode(msg)) == msg and decode(b"owner payload") is None
    with pytest.raises(ProtocolError, match="does not decode"):
        decode(MAGIC + b"\xc1")
    welcome = Welcome(3, 4096, b"meta", "", [[0, 8192, 100, -1], [-1, 1 << 20, 1 << 16, 0]])
    assert registered_entries(decode(encode(welcome)).registered) == [(0, 8192, 100, -1), (-1, 1 << 20, 1 << 16, 0)]
    for bad in ([[0, 1, 2]], [[0, 0, 100, -1]], [[0, 8192, -5, -1]], [["a", 1, 2, 3]], [[0, 1.5, 2, 3]], 7):
        with pytest.raises(ProtocolError, match="registered ranges that does not decode"):
            registered_entries(bad)
    slot = np.zeros(1 << 16, np.uint8)
    ChunkHeader(3, 7, 1, 2, 100).write(slot, np.array([0, 64]), np.array([0, 1]), np.array([50, 50]))
    head = ChunkHeader.parse(slot, slot.size)
    assert head == ChunkHeader(3, 7, 1, 2, 100)
    assert [a.tolist() for a in head.table(slot)] == [[0, 64], [0, 1], [50, 50]]
    with pytest.raises(ProtocolError, match="does not fit a 200-byte slot"):
        ChunkHeader.parse(slot, 200)
    slot[0] = 0
    with pytest.raises(ProtocolError, match="expected b'KVTSTG01'"):
        ChunkHeader.parse(slot, slot.size)


def test_strided_chunks_fit_their_slots_and_cover_every_row():
    rng = np.random.default_rng(14)
    for slots in (1, 7, 300):
        length = rng.integers(1, 4097, 9)
        room = 1 << 16
        bounds = strided_bounds(length, slots, room)
        assert bounds[0] == 0 and bounds[-1] == length.size * slots and (np.diff(bounds) > 0).all()
        row_len = np.repeat(length, slots)  # [P * S] pair-major rows
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert int(row_len[a:b].sum()) <= room
            assert b == row_len.size or int(row_len[a:b + 1].sum()) > room  # each chunk is full
    with pytest.raises(ValueError, match="a row of 70000 bytes does not fit a chunk of 65536 bytes"):
        strided_bounds(np.array([70000]), 2, 1 << 16)


def strided_slot(header: StridedHeader, dest: DestinationTable, size=1 << 16) -> np.ndarray:
    slot = np.zeros(size, np.uint8)
    slot[:128] = header.pack()
    table = dest.pack()
    slot[128:128 + table.size] = table
    return slot


def test_strided_headers_and_tables_round_trip_and_refuse_garbage():
    dest = DestinationTable(np.array([0, 1]), np.array([8, 0]), np.array([64, 100]), np.array([24, 100]),
                            np.array([3, 0, 2]))
    head = StridedHeader(1, 7, 0, 2, 1, 5, 24 * 2 + 100 * 2, 2, 3)  # rows 1..4: two of 24 B, two of 100 B
    slot = strided_slot(head, dest)
    assert StridedHeader.parse(slot, slot.size) == head and head.data_start == strided_data_start(2, 3) == 256
    got = DestinationTable.parse(slot, head)
    assert [a.tolist() for a in (got.region, got.offset, got.stride, got.length, got.slot)] == [
        [0, 1], [8, 0], [64, 100], [24, 100], [3, 0, 2]]
    assert (got.offset_of(1), got.offset_of(3), got.offset_of(6)) == (24, 72, 372)
    with pytest.raises(ProtocolError, match="rows \\[1, 5\\) hold 248 bytes, the header says 249"):
        DestinationTable.parse(slot, StridedHeader(1, 7, 0, 2, 1, 5, 249, 2, 3))
    for bad, why in ((StridedHeader(1, 7, 0, 2, 4, 4, 10, 2, 3), "holding rows \\[4, 4\\)"),
                     (StridedHeader(1, 7, 2, 2, 0, 1, 24, 2, 3), "chunk 2 of 2"),
                     (StridedHeader(1, 7, 0, 2, 0, 7, 24, 2, 3), "rows \\[0, 7\\) of a 2 x 3 write"),
                     (StridedHeader(1, 7, 0, 2, 0, 1, 1 << 16, 2, 3), "does not fit a 65536-byte slot"),
                     (StridedHeader(1, 7, 0, 2, 0, 1, 24, 0, 3), "a strided write of 0 pairs")):
        with pytest.raises(ProtocolError, match=why):
            StridedHeader.parse(bad.pack(), 1 << 16)
    with pytest.raises(ProtocolError, match="does not fit a 65536-byte slot"):
        StridedHeader.parse(StridedHeader(1, 7, 0, 1, 0, 1, 24, 1, 1 << 14).pack(), 1 << 16)  # its table alone
    with pytest.raises(ProtocolError, match="expected at least"):
        StridedHeader.parse(slot[:40], slot.size)
    with pytest.raises(ProtocolError, match="expected b'KVTSTR01'"):
        StridedHeader.parse(np.concatenate([ChunkHeader(1, 7, 0, 2, 10).pack(), slot[64:128]]), slot.size)
    with pytest.raises(ProtocolError, match="its table needs"):
        DestinationTable.parse(slot[:200], head)
    for field, value, why in (("offset", -8, "negative"), ("length", 0, "has length 0"), ("slot", -1, "negative")):
        broken = DestinationTable(*(np.where(np.arange(a.size) == 0, value, a) if f == field else a
                                    for f, a in zip(("region", "offset", "stride", "length", "slot"),
                                                    (dest.region, dest.offset, dest.stride, dest.length, dest.slot))))
        with pytest.raises(ProtocolError, match=why):
            DestinationTable.parse(strided_slot(head, broken), head)
    assert decode(encode(StridedChunk(1, 7, 0, 2, 1, b"n"))) == StridedChunk(1, 7, 0, 2, 1, b"n")


def test_a_strided_table_is_checked_against_the_receivers_regions():
    from types import SimpleNamespace

    from transport.base import Region, RegionSizes

    regions = {0: Region(0, 1 << 20, 4096), 1: Region(1, 1 << 21, 8192, device=0)}
    table = SimpleNamespace(sizes=RegionSizes(regions), dev=np.array([-1, 0]))

    def dest(region=0, offset=0, stride=64, length=64, slot=(0, 63)):
        return DestinationTable(np.array([region]), np.array([offset]), np.array([stride]), np.array([length]),
                                np.array(slot))

    dest().check(table, None)  # slot 63 ends at byte 4096: inside
    with pytest.raises(ValueError, match="batch pair 0: destination \\(this receiver\\) range \\[8, 4104\\) is "
                                         "outside region 0 of 4096 bytes"):
        dest(offset=8).check(table, None)
    with pytest.raises(ValueError, match="region 5 is not registered"):
        dest(region=5).check(table, None)
    with pytest.raises(ProtocolError, match="not on the lane's memory \\(host\\)"):
        dest(region=1).check(table, None)
    with pytest.raises(ProtocolError, match="overflows int64"):
        dest(stride=1 << 60, slot=(0, 1 << 10)).check(table, None)
    dest(region=1, slot=(0, 127)).check(table, 0)


def test_a_region_deregistered_between_two_chunks_of_a_strided_write_is_not_written():
    """The receiver keeps a strided write's checked table from its first chunk; when its
    regions change before the next chunk (the destination deregistered), that chunk's table
    is checked again and refused, and none of its bytes land."""
    from transport.base import Region
    from transport.nixl.regions import RegionTable
    from transport.nixl.staged.copy import HostStaging

    rng = np.random.default_rng(16)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    slots = rng.permutation(256)  # [S] one pair of 64 B rows, two chunks of 128 rows
    dest = DestinationTable(np.array([0]), np.array([0]), np.array([64]), np.array([64]), slots)
    staging = HostStaging(2, 1 << 16)
    rows = staging.strided_rows(np.array([src.ctypes.data]), np.array([64]), np.array([64]), np.arange(256))
    at = strided_data_start(1, 256)
    for k, (begin, end) in enumerate(((0, 128), (128, 256))):
        staging.write_strided_head(k, StridedHeader(1, 7, k, 2, begin, end, 64 * (end - begin), 1, 256), dest.pack())
        staging.gather_strided(k, at, rows, begin, end)
    live = RegionTable({0: Region(0, dst.ctypes.data, dst.nbytes)})
    _, known = staging.land_strided(0, (1, 7, 0), 2, live, None)
    want = np.zeros_like(dst)
    for s in range(128):
        want[slots[s] * 64:][:64] = src[s * 64:][:64]
    assert_same(dst, want, "the first chunk")
    with pytest.raises(ValueError, match="region 0 is not registered"):
        staging.land_strided(1, (1, 7, 1), 2, RegionTable({}), known)
    assert_same(dst, want, "after the refused second chunk")
    staging.land_strided(1, (1, 7, 1), 2, live, known)  # the same regions: the kept table serves
    for s in range(128, 256):
        want[slots[s] * 64:][:64] = src[s * 64:][:64]
    assert_same(dst, want, "the second chunk, regions unchanged")


@pytest.mark.parametrize("flat_slots", [0, 1 << 20], ids=["per-pair", "flat-rows"])
def test_host_staging_gathers_and_scatters_strided_rows(flat_slots, monkeypatch):
    """Rows ``[begin, end)`` of a strided batch (a range that starts and ends inside pairs),
    gathered into a slot back to back and scattered out again, against plain loops: one view
    per pair part, and the range expanded to flat rows (``FLAT_SLOTS``)."""
    from transport.nixl.staged import copy
    from transport.nixl.staged.copy import HostStaging

    monkeypatch.setattr(copy, "FLAT_SLOTS", flat_slots)

    rng = np.random.default_rng(15)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    addr = np.array([3, 100_000, 300_000, 600_000])  # [P] slot 0 of each pair, odd and aligned
    stride, length = np.array([1024, 2048, 64, 0]), np.array([1000, 2048, 64, 8])
    s_slot = rng.integers(0, 64, 20)  # duplicates: a row read twice
    d_slot = rng.permutation(64)[:20]
    d_addr = np.array([8, 200_000, 400_000, 700_000 + 3])
    d_stride = np.array([1024, 2048, 64, 8])
    staging = HostStaging(2, 1 << 20)
    base = src.ctypes.data
    rows = staging.strided_rows(base + addr, stride, length, s_slot)
    begin, end, at = 13, 75, 256
    staging.gather_strided(1, at, rows, begin, end)
    p, s = np.divmod(np.arange(begin, end), 20)
    packed = np.concatenate([src[addr[i] + s_slot[j] * stride[i]:][:length[i]] for i, j in zip(p, s)])
    assert_same(staging.buf[(1 << 20) + at:][:packed.size], packed, "gathered strided rows")
    staging.scatter_strided(1, at, staging.strided_rows(dst.ctypes.data + d_addr, d_stride, length, d_slot), begin,
                            end)
    want = np.zeros_like(dst)
    for i, j in zip(p, s):
        o = d_addr[i] + d_slot[j] * d_stride[i]
        want[o:o + length[i]] = src[addr[i] + s_slot[j] * stride[i]:][:length[i]]
    assert_same(dst, want, "scattered strided rows")


def test_shared_host_staging_is_one_memory_seen_from_both_sides():
    """The receiver's memfd staging, mapped again through /proc/<pid>/fd (here by this same
    process): a chunk gathered through one mapping is scattered from the other; a mapping of
    another size is refused; the mapping outlives the owner's close; close is idempotent."""
    from transport.nixl.staged.shared import SharedHostStaging, host_key

    assert host_key() and host_key() == host_key()
    owner = SharedHostStaging(2, 1 << 16)
    other = SharedHostStaging(2, 1 << 16, owner.shared)
    assert other.ptr != owner.ptr and not owner.buf.any()
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    rows = rng.permutation(64)[:40].astype(np.int64) * 1024  # [40] offsets of 1 KiB rows
    length = np.full(40, 1024, np.int64)
    other.gather(1, 256, src.ctypes.data + rows, length)
    owner.scatter(1, 256, dst.ctypes.data + rows[::-1].copy(), length)  # the rows in reverse
    for i, r in enumerate(rows[::-1]):
        assert_same(dst[r: r + 1024], src[rows[i]: rows[i] + 1024], f"row {i}")
    with pytest.raises(ValueError, match="holds 131072 bytes, not 65536"):
        SharedHostStaging(1, 1 << 16, owner.shared)
    owner.close()
    owner.close()
    other.gather(0, 0, src.ctypes.data + rows[:4], length[:4])  # still mapped
    other.close()


def test_host_staging_gathers_and_scatters_rows_of_any_alignment():
    from transport.nixl.staged.copy import HostStaging

    rng = np.random.default_rng(10)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    length = np.sort(rng.choice([1, 8, 24, 1000, 1024], 300))  # runs of equal lengths
    src_off = rng.integers(0, src.size - 1024, 300)
    src_off[10:20] = src_off[10] + np.cumsum(np.append(0, length[10:19]))  # a contiguous source run
    dst_off = rng.permutation(np.arange(1, 1000))[:300] * 1024
    staging = HostStaging(2, 1 << 20)
    at = data_start(300)
    staging.gather(1, at, src.ctypes.data + src_off, length)
    packed = np.concatenate([src[o:o + n] for o, n in zip(src_off, length)])
    assert_same(staging.buf[(1 << 20) + at:(1 << 20) + at + packed.size], packed, "gathered rows")
    staging.scatter(1, at, dst.ctypes.data + dst_off, length)
    want = np.zeros_like(dst)
    for so, do, n in zip(src_off, dst_off, length):
        want[do:do + n] = src[so:so + n]
    assert_same(dst, want, "scattered rows")


KERNEL_SCRIPT = """
import numpy as np, torch
from transport.nixl.staged.kernel import KernelStaging
from transport.nixl.staged.wire import data_start
rng = np.random.default_rng(11)
src = torch.from_numpy(rng.integers(0, 256, 8192, dtype=np.uint8))
dst = torch.zeros(8192, dtype=torch.uint8)
length = np.array([16, 16, 48, 256, 8, 24], dtype=np.int64)
src_off = np.array([0, 16, 512, 1024, 4000, 7000], dtype=np.int64)
dst_off = np.array([4096, 64, 2048, 6000, 8000, 100], dtype=np.int64)
staging = KernelStaging(2, 1 << 16, "cpu")
at = data_start(6)
staging.gather(1, at, src.data_ptr() + src_off, length)
s = src.numpy()
packed = np.concatenate([s[o:o + n] for o, n in zip(src_off, length)])
got = staging.buf.numpy()[(1 << 16) + at:(1 << 16) + at + packed.size]
assert (got == packed).all(), "gather"
staging.scatter(1, at, dst.data_ptr() + dst_off, length)
want = np.zeros(8192, np.uint8)
for so, do, n in zip(src_off, dst_off, length):
    want[do:do + n] = s[so:so + n]
assert (dst.numpy() == want).all(), "scatter"
# land(): the header and row table in the slot, checked and turned into the kernel's table here
from tests.transport._expected import assert_refused, one_region_table
from transport.nixl.staged.wire import ChunkHeader, ProtocolError
pool = torch.zeros(8192, dtype=torch.uint8)
table = one_region_table(pool)
staging.write_head(0, ChunkHeader(1, 2, 0, 6, int(length.sum())), dst_off, np.zeros(6, np.int64), length)
staging.gather(0, at, src.data_ptr() + src_off, length)
assert staging.land(0, (1, 2, 0), table) == ChunkHeader(1, 2, 0, 6, int(length.sum()))
assert (pool.numpy() == want).all(), "land"
assert_refused(lambda: staging.land(0, (1, 2, 1), table), ProtocolError, "holds chunk 0 of write 2",
               "a chunk other than the one named")
bad = dst_off.copy()
bad[3] = 8000  # 256 bytes from 8000 leave the 8192-byte region
staging.write_head(0, ChunkHeader(1, 3, 0, 6, int(length.sum())), bad, np.zeros(6, np.int64), length)
pool.zero_()
assert_refused(lambda: staging.land(0, (1, 3, 0), table), ValueError,
               "batch entry 3: destination (this receiver) range [8000, 8256) is outside region 0",
               "a row outside its region")
assert not pool.any(), "bytes of a refused chunk landed"
print("KERNEL STAGING OK")
"""


def test_kernel_staging_gathers_and_scatters_in_tritons_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_ok(KERNEL_SCRIPT, "KERNEL STAGING OK")


STRIDED_KERNEL_SCRIPT = """
import numpy as np, torch
from tests.transport._expected import assert_refused, one_region_table
from transport.nixl.staged.kernel import KernelStaging
from transport.nixl.staged.wire import DestinationTable, StridedHeader, strided_data_start
rng = np.random.default_rng(16)
src = torch.from_numpy(rng.integers(0, 256, 8192, dtype=np.uint8))
s = src.numpy()
addr, stride, length = np.array([0, 1024, 4003]), np.array([64, 128, 24]), np.array([64, 48, 24])
s_slot, d_slot = np.array([3, 0, 3, 7, 1]), np.array([4, 0, 2, 7, 5])  # a duplicate source slot
d_off, d_stride = np.array([0, 2048, 6001]), np.array([256, 64, 24])
P, S = 3, 5
staging = KernelStaging(2, 1 << 16, "cpu")
rows = staging.strided_rows(src.data_ptr() + addr, stride, length, s_slot)
at = strided_data_start(P, S)
begin, end = 3, 12  # starts inside pair 0, ends inside pair 2
staging.gather_strided(1, at, rows, begin, end)
staging.ready()
p, q = np.divmod(np.arange(begin, end), S)
packed = np.concatenate([s[addr[i] + s_slot[j] * stride[i]:][:length[i]] for i, j in zip(p, q)])
got = staging.buf.numpy()[(1 << 16) + at:][:packed.size]
assert (got == packed).all(), "strided gather"
# the receiver's step: header and destination table in the slot, checked, then one scatter
pool = torch.zeros(8192, dtype=torch.uint8)
table = one_region_table(pool)
dest = DestinationTable(np.zeros(P, np.int64), d_off, d_stride, length, d_slot)
header = StridedHeader(1, 2, 0, 1, begin, end, packed.size, P, S)
staging.write_strided_head(1, header, staging.strided_table(dest.pack()))
got, known = staging.land_strided(1, (1, 2, 0), 1, table, None)
assert got == header
want = np.zeros(8192, np.uint8)
for i, j in zip(p, q):
    o = d_off[i] + d_slot[j] * d_stride[i]
    want[o:o + length[i]] = s[addr[i] + s_slot[j] * stride[i]:][:length[i]]
assert (pool.numpy() == want).all(), "strided land"
# a later chunk of the same write reuses the checked table: its header only
pool.zero_()
staging.write_strided_head(1, header, staging.strided_table(np.zeros(32 * P + 8 * S, np.uint8)))  # table wiped
assert staging.land_strided(1, (1, 2, 0), 1, table, known)[1] is known
assert (pool.numpy() == want).all(), "strided land from the kept table"
bad = DestinationTable(np.zeros(P, np.int64), np.array([0, 2048, 8100]), d_stride, length, d_slot)
staging.write_strided_head(1, StridedHeader(1, 3, 0, 1, begin, end, packed.size, P, S),
                           staging.strided_table(bad.pack()))
pool.zero_()
assert_refused(lambda: staging.land_strided(1, (1, 3, 0), 1, table, known), ValueError,
               "batch pair 2: destination (this receiver) range [8100, 8292) is outside region 0",
               "a table that leaves its region")
assert not pool.any(), "bytes of a refused chunk landed"
print("STRIDED KERNEL STAGING OK")
"""


def test_kernel_staging_strided_gather_and_scatter_in_tritons_interpreter():
    """The CUDA lane's strided copies (the NVLink strided kernel in its GATHER / SCATTER modes
    over a row range that starts and ends inside pairs), the receiver's table check and its
    reuse for a later chunk, on CPU tensors in Triton's interpreter."""
    pytest.importorskip("triton")
    assert_interpreted_ok(STRIDED_KERNEL_SCRIPT, "STRIDED KERNEL STAGING OK")


CUDA_ENV = {"UCX_TLS": "tcp,self,sm,cuda_copy,cuda_ipc"}
CUDA_SMALL = StagedNixlConfig(cuda_slot_bytes=256 << 10, slots=3, min_rows=64)
# the receiver's GPU: cuda:1 (two GPUs), or cuda:0 beside the writer (two processes on one GPU)
RECEIVER_GPUS = [pytest.param(1, marks=[pytest.mark.gpu, pytest.mark.multigpu], id="two-gpus"),
                 pytest.param(0, marks=pytest.mark.gpu, id="one-gpu")]


def cuda_pair(writer, receiver, rx_gpu, dst_sizes, seed, staged=SMALL, rx_staged=None):
    """A receiver with ``dst_sizes`` regions on cuda:``rx_gpu``, a writer with an 8 MiB random
    source region on cuda:0: (receiver, writer, the source on the host, its region id, peer)."""
    import torch

    rx = receiver(dst_sizes, env=CUDA_ENV, cuda_device=rx_gpu, staged=rx_staged)
    torch.cuda.set_device(0)
    src = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    src_cuda = src.to("cuda:0")
    torch.cuda.synchronize()
    t = writer(env=CUDA_ENV, staged=staged)
    sid = t.register_tensor(src_cuda)
    return rx, t, src.numpy(), sid, t.connect(rx.export)


@pytest.mark.parametrize("rx_gpu", RECEIVER_GPUS)
def test_staged_cuda_to_cuda_between_two_processes(writer, receiver, rx_gpu):
    """cuda:0 -> cuda:``rx_gpu``: the Triton gather on cuda:0, one cuda_ipc write per slot, the
    scatter kernel in the receiver, then its notification."""
    dst_sizes = [8 * MiB, 8 * MiB]
    rx, t, src, sid, peer = cuda_pair(writer, receiver, rx_gpu, dst_sizes, 12)
    entries = small_rows(np.random.default_rng(13), 1000, 8 * MiB, dst_sizes, lengths=(256, 2048, 1000))
    note = _nixl_peer.payload(1, [(r, 0, n) for r, n in enumerate(dst_sizes)])
    tr = peer.write(wb(sid, *entries[1:]), notify=note)
    assert isinstance(tr, StagedTransfer)
    tr.wait(120)
    want = reference([src], dst_sizes, entries)
    assert rx.wait_notes(1) == [(note, sha(want))]
    for r in range(len(dst_sizes)):
        assert_same(rx.dump(r), want[r], f"CUDA destination region {r}")


@pytest.mark.parametrize("rx_gpu", RECEIVER_GPUS)
def test_strided_staged_cuda_to_cuda_between_two_processes(writer, receiver, rx_gpu):
    """cuda:0 -> cuda:``rx_gpu`` through ``write_strided``: the strided GATHER launch on cuda:0
    (its table uploaded once per write), one cuda_ipc write per slot, the strided SCATTER launch
    in the receiver, then its notification; the cases of the host test."""
    dst_sizes = [8 * MiB, 4 * MiB]
    rx, t, host, sid, peer = cuda_pair(writer, receiver, rx_gpu, dst_sizes, 17, staged=CUDA_SMALL,
                                       rx_staged=StagedNixlConfig(cuda_slot_bytes=256 << 10))
    want = [np.zeros(n, np.uint8) for n in dst_sizes]
    whole = [(r, 0, n) for r, n in enumerate(dst_sizes)]
    for i, (name, batch) in enumerate(strided_cases(np.random.default_rng(18), sid)):
        note = _nixl_peer.payload(i, whole)
        tr = peer.write_strided(batch, notify=note)
        assert isinstance(tr, StridedStagedTransfer), name
        tr.wait(120)
        for sr, so, dr, do, n in entries(batch):
            want[dr][do:do + n] = host[so:so + n]
        assert rx.wait_notes(i + 1)[i] == (note, sha(want)), name
    for r in range(len(dst_sizes)):
        assert_same(rx.dump(r), want[r], f"CUDA destination region {r}")


@pytest.mark.parametrize("rx_gpu", RECEIVER_GPUS)
def test_a_direct_write_behind_a_strided_staged_one_on_gpus_is_notified_after_it(writer, receiver, rx_gpu):
    """The receiver answers a GPU chunk once its scatter has passed, handling the next
    notifications meanwhile; a direct write issued behind a staged one (its notification may
    reach the receiver while the staged write's last scatter still runs) is delivered after
    it, each notification with its bytes in place. Three rounds, so the race is tried."""
    dst_sizes = [8 * MiB, 4 * MiB]
    rx, t, host, sid, peer = cuda_pair(writer, receiver, rx_gpu, dst_sizes, 21, staged=CUDA_SMALL,
                                       rx_staged=CUDA_SMALL)
    (_, batch), = [c for c in strided_cases(np.random.default_rng(22), sid) if c[0] == "MHA page 1"]
    want = [np.zeros(n, np.uint8) for n in dst_sizes]
    for sr, so, dr, do, n in entries(batch):
        want[dr][do:do + n] = host[so:so + n]
    staged_note = _nixl_peer.payload(0, [(0, 0, dst_sizes[0])])
    expect = []
    for i in range(3):
        direct = wb(sid, (i + 1) * MiB, 1, 0, MiB)  # region 1, a whole MiB: one range, direct
        direct_note = _nixl_peer.payload(1 + i, [(1, 0, MiB)])
        first = peer.write_strided(batch, notify=staged_note)
        second = peer.write(direct, notify=direct_note)
        assert isinstance(first, StridedStagedTransfer) and isinstance(second, DeferredWrite)
        second.wait(120)
        first.wait(120)
        want[1][:MiB] = host[(i + 1) * MiB:(i + 2) * MiB]
        expect += [(staged_note, sha([want[0]])), (direct_note, sha([want[1][:MiB]]))]
        assert rx.wait_notes(2 * i + 2) == expect
    for r in range(len(dst_sizes)):
        assert_same(rx.dump(r), want[r], f"CUDA destination region {r}")
