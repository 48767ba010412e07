"""NIXL backend: real transfers between this process and a spawned receiver over loopback UCX.

The receiver (tests/transport/_nixl_peer.py, driven by ``_support.Receiver``) owns zeroed
regions; this process writes into them and then reads them back through the pipe. Expected bytes come from a numpy reference built
entry by entry here, independent of the transport's descriptor building.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import time

import msgpack
import numpy as np
import pytest

from transport._nixl_import import load_nixl_api

try:
    load_nixl_api()
except ImportError as exc:  # NIXL is an optional extra
    pytest.skip(f"NIXL is not installed: {exc}", allow_module_level=True)

from tests._stop import stop  # noqa: E402
from tests.transport import _nixl_peer  # noqa: E402
from tests.transport._support import assert_same, connect_once_drained, split_deadline, use_deadline  # noqa: E402
from tests.transport.nixl._support import (TCP_ONLY, host_region, reference, resumed_later, sha,  # noqa: E402
                                           until_ended, wb)
from transport.base import (  # noqa: E402
    PeerDescriptorError,
    PeerDraining,
    TransferFailed,
    TransferStatus,
    TransportClosed,
    TransportError,
    WriteBatch,
    pack_descriptor,
)
from transport.nixl import NixlConfig, NixlTransport  # noqa: E402
from transport.nixl.staged import StagedNixlConfig  # noqa: E402

MiB = 1 << 20


def mixed_batch(rng, num, src_sizes, dst_sizes, big=4):
    """``num`` entries of 64 B .. 4 MiB (``big`` of them 4 MiB) to randomly permuted, disjoint
    destinations spread over the destination regions; sources are random and may overlap."""
    sizes, weights = [64, 100, 1000, 4096, 16384, 65536], [0.2, 0.2, 0.2, 0.2, 0.15, 0.05]
    length = rng.choice(sizes, size=num, p=weights).astype(np.int64)
    length[rng.choice(num, big, replace=False)] = 4 * MiB
    length[rng.choice(num, 4, replace=False)] = 64
    src_region = rng.integers(0, len(src_sizes), num)
    src_offset = rng.integers(0, np.asarray(src_sizes)[src_region] - length + 1)
    order = rng.permutation(num)  # destination layout order
    dst_region = np.empty(num, np.int64)
    dst_offset = np.empty(num, np.int64)
    region, cursor = 0, 0
    for i in order:  # pack destinations, with random gaps, region after region
        gap = int(rng.integers(0, 64))
        if cursor + gap + length[i] > dst_sizes[region]:
            region, cursor = region + 1, 0
        dst_region[i], dst_offset[i] = region, cursor + gap
        cursor += gap + int(length[i])
    return src_region, src_offset, dst_region, dst_offset, length


# -- data --------------------------------------------------------------------------------------


def test_mixed_batch_lands_byte_for_byte(writer, receiver):
    src_sizes, dst_sizes = [16 * MiB, 12 * MiB], [32 * MiB, 32 * MiB]
    rx = receiver(dst_sizes)
    t = writer()
    srcs, ids = zip(*(host_region(t, n, seed) for seed, n in enumerate(src_sizes)))
    peer = t.connect(rx.export)
    assert sorted(peer.regions) == [0, 1]
    rng = np.random.default_rng(7)
    entries = mixed_batch(rng, 4000, src_sizes, dst_sizes)
    sr, so, dr, do, n = entries
    batch = wb(np.asarray(ids)[sr], so, dr, do, n)
    note = _nixl_peer.payload(1, [(r, 0, size) for r, size in enumerate(dst_sizes)])
    peer.write(batch, notify=note).wait(60)
    want = reference(srcs, dst_sizes, entries)
    (got_note, got_digest), = rx.wait_notes(1)
    assert got_note == note and rx.senders == [t.name]
    assert got_digest == sha(want), "the notification was seen before the data landed"
    for r in range(len(dst_sizes)):
        assert_same(rx.dump(r), want[r], f"destination region {r}")


def test_sequential_notifications_arrive_in_order_after_their_data(writer, receiver):
    rx = receiver([4 * MiB])
    t = writer()
    src, sid = host_region(t, 4 * MiB, 3)
    peer = t.connect(rx.export)
    rng = np.random.default_rng(11)
    want = []
    for seq in range(20):
        size = int(rng.integers(1, 64)) * 4096
        start = int(rng.integers(0, 4 * MiB - size))
        # the range as 16 entries in shuffled order
        parts = np.array_split(np.arange(start, start + size, 256), 16)
        offs = np.array([p[0] for p in parts], np.int64)
        lens = np.array([len(p) * 256 for p in parts], np.int64)
        perm = rng.permutation(16)
        note = _nixl_peer.payload(seq, [(0, start, size)])
        peer.write(wb(sid, offs[perm], 0, offs[perm], lens[perm]), notify=note).wait(30)
        want.append((note, sha([src[start : start + size]])))
    assert rx.wait_notes(20) == want


def test_many_transfers_in_flight(writer, receiver):
    num, chunk = 64, 64 * 1024
    rx = receiver([num * chunk])
    t = writer()
    src, sid = host_region(t, num * chunk, 5)
    peer = t.connect(rx.export)
    rng = np.random.default_rng(13)
    dst_slot = rng.permutation(num)
    transfers, want = [], {}
    for i in range(num):  # transfer i: source chunk i -> destination slot dst_slot[i], in 32 pieces
        piece = np.arange(32, dtype=np.int64) * (chunk // 32)
        note = _nixl_peer.payload(i, [(0, dst_slot[i] * chunk, chunk)])
        batch = wb(sid, i * chunk + piece, 0, dst_slot[i] * chunk + piece, chunk // 32)
        transfers.append(peer.write(batch, notify=note))
        want[note] = sha([src[i * chunk : (i + 1) * chunk]])
    for tr in transfers:
        tr.wait(30)
    assert all(tr.status() is TransferStatus.DONE for tr in transfers)
    notes = rx.wait_notes(num)
    assert dict(notes) == want and len(notes) == num
    expected = np.empty(num * chunk, np.uint8)
    for i in range(num):
        expected[dst_slot[i] * chunk : (dst_slot[i] + 1) * chunk] = src[i * chunk : (i + 1) * chunk]
    assert_same(rx.dump(0), expected, "destination")


def test_empty_batch_still_notifies(writer, receiver):
    rx = receiver([4096])
    t = writer()
    peer = t.connect(rx.export)
    note = _nixl_peer.payload(0, [])
    tr = peer.write(WriteBatch.of([], [], [], [], []), notify=note)
    tr.wait(30)
    assert peer.write(WriteBatch.of([], [], [], [], [])).status() is TransferStatus.DONE
    assert rx.wait_notes(1)[0][0] == note


def test_notifications_name_their_sender(writer, receiver):
    """Two writing agents, one receiver: each notification says which agent sent it."""
    rx = receiver([1 * MiB])
    a, b = writer(), writer()
    assert a.name != b.name
    sends, sources = [], []  # sources stay alive: a freed array's bytes may be reallocated
    for i, t in enumerate((a, b, a, b)):  # while its region is still registered
        src, sid = host_region(t, 4096, 20 + i)
        sources.append(src)
        note = _nixl_peer.payload(i, [(0, i * 4096, 4096)])
        t.connect(rx.export).write(wb(sid, 0, 0, i * 4096, 4096), notify=note).wait(30)
        sends.append((note, t.name))
    rx.wait_notes(4)
    got = dict(zip((n for n, _ in rx.notes), rx.senders))
    assert got == dict(sends)
    # each sender's notifications in the order it posted them
    for t in (a, b):
        assert [n for (n, _), s in zip(rx.notes, rx.senders) if s == t.name] == [n for n, s in sends if s == t.name]


def test_deregister_of_an_unknown_region_is_a_value_error(writer):
    t = writer()
    data, rid = host_region(t, 4096, 30)
    t.deregister(rid)
    for bad in (rid, 99, -1, "0"):
        with pytest.raises(ValueError, match=r"is not registered \(live ids: \[\]\)"):
            t.deregister(bad)
    _, again = host_region(t, 4096, 31)
    assert again == rid + 1  # ids are never reused
    assert list(t.regions) == [again]
    with pytest.raises(TypeError):
        t.regions[5] = None  # a read-only view


# -- failures ----------------------------------------------------------------------------------


def big_batch(sid, nbytes, block, rng):
    n = nbytes // block
    offs = np.arange(n, dtype=np.int64) * block
    return wb(sid, offs, 0, rng.permutation(offs), block)


# The direct path's failure tests: their 4 KiB-block batches would go staged (tests of the
# staged mode's failures: test_nixl_staged.py).
DIRECT = StagedNixlConfig(enabled=False)


def tcp_pair(writer, receiver, nbytes, seed, **config):
    """A tcp-only receiver of ``nbytes``, a writer with as much random source (direct writes
    unless ``staged`` says otherwise), connected and warm."""
    return tcp_pair_and_writer(writer, receiver, nbytes, seed, **config)[:5]


def tcp_pair_and_writer(writer, receiver, nbytes, seed, **config):
    """:func:`tcp_pair` and the writing transport."""
    deadline = split_deadline(config)
    rx = receiver([nbytes], env=TCP_ONLY)
    t = writer(env=TCP_ONLY, **{"staged": DIRECT, **config})
    src, sid = host_region(t, nbytes, seed)
    peer = t.connect(rx.export)
    rng = np.random.default_rng(seed)
    peer.write(big_batch(sid, 1 * MiB, 4096, rng)).wait(30)  # connection up
    use_deadline(t, deadline)
    return rx, src, sid, peer, rng, t


def stalled_write(rx, peer, sid, nbytes, rng):
    """A write that is surely in flight: the receiver is stopped (SIGSTOP) before the post, and
    over tcp the bytes beyond the socket buffers wait for it."""
    stop(rx.proc.pid)
    tr = peer.write(big_batch(sid, nbytes, 4096, rng))
    assert tr.status() is TransferStatus.PENDING, f"a {nbytes}-byte write to a stopped receiver ended: {tr.error}"
    return tr


def test_receiver_killed_mid_transfer_fails_within_bound(writer, receiver):
    rx, src, sid, peer, rng = tcp_pair(writer, receiver, 64 * MiB, 1, peer_loss_timeout_s=5.0)
    inflight = [stalled_write(rx, peer, sid, 64 * MiB, rng)]
    os.kill(rx.proc.pid, signal.SIGKILL)
    rx.proc.join(5)
    later = peer.write(big_batch(sid, 1 * MiB, 4096, rng))  # posted after the death
    for tr in (*inflight, later):
        # UCX reports the closed socket (NIXL_ERR_REMOTE_DISCONNECT, ~15 ms here); the
        # transfer deadline (peer_loss_timeout_s) is the backstop
        with pytest.raises(TransferFailed, match="peer '.*'.*(DISCONNECT|not done after)"):
            tr.wait(15)
        assert tr.status() is TransferStatus.FAILED and tr.error


def test_stalled_receiver_fails_at_the_deadline(writer, receiver):
    rx, src, sid, peer, rng = tcp_pair(writer, receiver, 16 * MiB, 2, peer_loss_timeout_s=1.0)
    tr = stalled_write(rx, peer, sid, 16 * MiB, rng)
    with pytest.raises(TransferFailed, match="not done after .* s \\(peer lost or stalled\\)"):
        tr.wait(20)  # the transfer's deadline failed it, not wait()'s own timeout


def test_abort_in_flight_then_write_again(writer, receiver):
    rx, src, sid, peer, rng = tcp_pair(writer, receiver, 32 * MiB, 4)
    tr = stalled_write(rx, peer, sid, 32 * MiB, rng)
    resume = resumed_later(rx)
    tr.abort()
    resume.join()
    assert tr.status() is TransferStatus.FAILED and tr.error == "aborted"
    with pytest.raises(TransferFailed, match="aborted"):
        tr.wait(1)
    tr.abort()  # no-op now
    # the transport stays usable: a fresh write lands and notifies
    note = _nixl_peer.payload(9, [(0, 0, 1 * MiB)])
    done = peer.write(wb(sid, 0, 0, 0, 1 * MiB), notify=note)
    done.wait(30)
    done.abort()  # no-op on a finished transfer
    assert done.status() is TransferStatus.DONE
    notes = rx.wait_notes(1)
    assert notes[-1] == (note, sha([src[: 1 * MiB]]))


def test_bad_peer_descriptors(writer):
    t = writer()
    other = writer()
    good = other.export()
    with pytest.raises(PeerDescriptorError, match="not valid msgpack"):
        t.connect(good[: len(good) // 2])
    with pytest.raises(PeerDescriptorError, match="must be bytes"):
        t.connect("not bytes")
    with pytest.raises(PeerDescriptorError, match="backend 'nvlink'"):
        t.connect(pack_descriptor("nvlink", [], agent="x", metadata=b"x", scratch=1))
    with pytest.raises(PeerDescriptorError, match="lacks fields"):
        t.connect(pack_descriptor("nixl", []))
    with pytest.raises(PeerDescriptorError, match="'metadata' must be non-empty bytes"):
        t.connect(pack_descriptor("nixl", [], agent="x", metadata="str", scratch=1))
    with pytest.raises(PeerDescriptorError, match="'scratch' must be a positive address"):
        t.connect(pack_descriptor("nixl", [], agent="x", metadata=b"x", scratch=-4))
    body = msgpack.unpackb(good)
    body["metadata"] = body["metadata"][: len(body["metadata"]) // 2]
    with pytest.raises(PeerDescriptorError, match="NIXL rejected the metadata"):
        t.connect(msgpack.packb(body))
    body = msgpack.unpackb(good)
    body["agent"] = "someone-else"
    with pytest.raises(PeerDescriptorError, match="metadata is of"):
        t.connect(msgpack.packb(body))
    with pytest.raises(PeerDescriptorError, match="own export"):
        t.connect(t.export())
    peer = t.connect(good)  # the failures above left nothing half-connected
    assert peer.name == other.name


def test_bad_batches_and_deregistered_regions(writer, receiver):
    rx = receiver([1 * MiB, 1 * MiB])
    t = writer()
    src, sid = host_region(t, 1 * MiB, 6)
    spare, spare_id = host_region(t, 4096, 7)
    peer = t.connect(rx.export)
    with pytest.raises(ValueError, match=r"batch entry 1: destination \(peer\) range .* outside region 1"):
        peer.write(wb(sid, [0, 0], [0, 1], [0, 1 * MiB - 10], 64))
    with pytest.raises(ValueError, match="batch entry 0: source .* region 9 is not registered"):
        peer.write(wb(9, 0, 0, 0, 64))
    with pytest.raises(TypeError, match="notify must be non-empty bytes"):
        peer.write(wb(sid, 0, 0, 0, 64), notify=b"")
    with pytest.raises(TypeError, match="WriteBatch"):
        peer.write((sid, 0, 0, 0, 64))
    t.deregister(spare_id)
    with pytest.raises(ValueError, match=f"region {spare_id} is not registered"):
        peer.write(wb(spare_id, 0, 0, 0, 64))
    with pytest.raises(ValueError, match=f"region {spare_id} is not registered"):
        t.deregister(spare_id)
    # the receiver drops its region 1 and re-exports; the new snapshot replaces the old peer,
    # and what was posted through the old one still completes
    before = peer.write(wb(sid, 4096, 0, 4096, 4096))
    fresh = t.connect(rx.deregister(1, pump=t.poll_notifications))  # t answers the revoke meanwhile
    before.wait(30)
    with pytest.raises(TransportClosed, match="closed"):
        peer.write(wb(sid, 0, 0, 0, 64))
    with pytest.raises(ValueError, match="destination \\(peer\\) region 1 is not registered"):
        fresh.write(wb(sid, 0, 1, 0, 64))
    fresh.write(wb(sid, 0, 0, 0, 4096)).wait(30)  # region 0 still works
    assert_same(rx.dump(0)[:8192], src[:8192], "region 0")


def test_a_newer_export_whose_regions_overlap_deregistered_ones_is_loaded_afresh(writer, receiver):
    """NIXL keeps an entry for every region of a remote agent it was ever given and looks a
    range up in the entry at or just before its address: once the receiver lays a region out
    over memory a deregistered one held, writes there must still land (loaded in place, NIXL
    refused this one with NIXL_ERR_NOT_FOUND), and the fresh load waits for the writes in flight."""
    rx = receiver([1 * MiB, 8 * MiB], env=TCP_ONLY)  # regions 0 and 1
    t = writer(env=TCP_ONLY, staged=DIRECT)
    src, sid = host_region(t, 8 * MiB, 41)
    t.connect(rx.export).write(wb(sid, 0, 0, 0, 4096)).wait(30)
    rx.deregister(0, pump=t.poll_notifications)
    small, export = rx.register(0, 4096, 4096)  # inside what region 0 was
    peer = t.connect(export)
    peer.write(wb(sid, 0, small, 10, 100)).wait(30)
    assert_same(rx.dump(small)[10:110], src[:100], "the small region")
    rx.deregister(small, pump=t.poll_notifications)
    whole, export = rx.register(0, 0, 1 * MiB)  # over the small one
    stop(rx.proc.pid)
    inflight = peer.write(wb(sid, 0, 1, 0, 8 * MiB))  # region 1 is untouched throughout
    assert inflight.status() is TransferStatus.PENDING, inflight.error
    with pytest.raises(PeerDraining, match="deregistered regions that overlap .* connect again once they end"):
        t.connect(export)
    os.kill(rx.proc.pid, signal.SIGCONT)
    inflight.wait(30)
    # 8 KiB from an odd offset: more blocks than a prepared list serves, so one descriptor,
    # which NIXL looked up in the small region's stale entry
    t.connect(export).write(wb(sid, 1, whole, 6001, 8192)).wait(30)
    assert_same(rx.dump(whole)[6001:6001 + 8192], src[1:8193], "the region over the small one")
    assert_same(rx.dump(1), src, "region 1, written while the new export waited")


def test_close_is_idempotent_and_final(writer):
    with NixlTransport() as t:
        other = writer()
        data, rid = host_region(t, 4096, 8)
        peer = t.connect(other.export())
        assert dict(t.regions)[rid].length == 4096
    t.close()
    with pytest.raises(TransportClosed):
        t.export()
    with pytest.raises(TransportClosed):
        peer.write(wb(rid, 0, 0, 0, 64))
    with pytest.raises(TransportClosed):
        t.register(data.ctypes.data, 64)
    peer.close()


@pytest.mark.parametrize("small", [0, 1 << 30], ids=["numpy", "python"])
def test_descriptor_arrays_per_memory_kind(small, monkeypatch):
    import transport.nixl.regions as regions
    from transport.base import Region

    monkeypatch.setattr(regions, "SMALL_BATCH", small)  # the two ways a batch's descriptors are built

    table = regions.RegionTable({0: Region(0, 4096, 100), 1: Region(1, 1 << 20, 100, 1), 2: Region(2, 1 << 30, 100, 0)})
    descs, mem = table.descs(np.array([1, 2, 1]), np.array([5, 0, 7]), np.array([3, 4, 5]), "source")
    assert mem == "VRAM"
    assert descs.dtype == np.uint64
    assert descs.tolist() == [[(1 << 20) + 5, 3, 1], [1 << 30, 4, 0], [(1 << 20) + 7, 5, 1]]
    descs, mem = table.descs(np.array([0]), np.array([9]), np.array([1]), "source")
    assert mem == "DRAM" and descs.tolist() == [[4105, 1, 0]]
    with pytest.raises(ValueError, match="mixes host and CUDA destination regions .* entry 1: region 1"):
        table.descs(np.array([0, 1]), np.array([0, 0]), np.array([1, 1]), "destination")


def test_missing_nixl_names_the_pip_extras(monkeypatch):
    import transport._nixl_import as lazy

    monkeypatch.setattr(lazy, "_api", None)
    monkeypatch.setattr(lazy, "CANDIDATES", ("no_such_nixl._api", "no_such_nixl_cu12._api"))
    with pytest.raises(ImportError, match=r"kvtransfer\[nixl-cu12\].*kvtransfer\[nixl-cu13\].*no_such_nixl_cu12"):
        lazy.load_nixl_api()


def test_config_is_validated():
    with pytest.raises(ValueError, match="peer_loss_timeout_s must be > 0"):
        NixlConfig(peer_loss_timeout_s=0)
    with pytest.raises(ValueError, match="backends must be a non-empty tuple"):
        NixlConfig(backends=["UCX"])
    with pytest.raises(TypeError, match="NixlConfig"):
        NixlTransport({"progress_thread": True})


# -- CUDA ---------------------------------------------------------------------------------------

CUDA_ENV = {"UCX_TLS": "tcp,self,sm,cuda_copy,cuda_ipc"}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_cuda_to_cuda_between_two_processes_on_two_gpus(writer, receiver):
    import torch

    sizes = [12 * MiB, 12 * MiB]
    rx = receiver(sizes, env=CUDA_ENV, cuda_device=1)
    # the CUDA context exists before the NIXL agent (UCX probes CUDA when it starts)
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(21)
    src = torch.randint(0, 256, (16 * MiB,), dtype=torch.uint8, generator=gen)  # [bytes] host copy
    src_cuda = src.to("cuda:0")
    torch.cuda.synchronize()
    t = writer(env=CUDA_ENV)
    sid = t.register_tensor(src_cuda)
    assert t.regions[sid].device == 0
    peer = t.connect(rx.export)
    assert all(r.device == 1 for r in peer.regions.values())
    rng = np.random.default_rng(3)
    entries = mixed_batch(rng, 1000, [16 * MiB], sizes, big=2)
    sr, so, dr, do, n = entries
    note = _nixl_peer.payload(1, [(r, 0, size) for r, size in enumerate(sizes)])
    peer.write(wb(np.full(len(n), sid), so, dr, do, n), notify=note).wait(60)
    want = reference([src.numpy()], sizes, entries)
    assert rx.wait_notes(1)[0] == (note, sha(want))
    for r in range(len(sizes)):
        assert_same(rx.dump(r), want[r], f"CUDA destination region {r}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_connect_close_cycles_leave_fd_counts_flat(writer, receiver):
    """A serving process connects and closes peers for days: 500 ``connect`` + ``close``
    cycles (each with a write) leave the writer's and the receiver's open files as they were."""
    rx = receiver([4096])
    t = writer()
    src, sid = host_region(t, 4096, 40)

    def cycle():
        peer = t.connect(rx.export)
        peer.write(wb(sid, 0, 0, 0, 64)).wait(30)
        peer.close()

    cycle()  # warm: the connection and its lazily opened files
    rx.dump(0)
    gc.collect()  # files of earlier tests in this process that only a collection closes: not counted here
    before = open_fds(os.getpid()), open_fds(rx.proc.pid)
    for _ in range(500):
        cycle()
    rx.dump(0)  # the receiver has run its loop since
    after = open_fds(os.getpid()), open_fds(rx.proc.pid)
    assert after == before, f"open files (writer, receiver): {before} before 500 cycles, {after} after"


# -- registration, deregistration, agent start ------------------------------------------------


def test_register_refuses_overlaps_and_impossible_ranges(writer):
    t = writer()
    data = np.zeros(8192, np.uint8)
    rid = t.register(data.ctypes.data, 4096)
    for ptr, length in ((data.ctypes.data, 4096), (data.ctypes.data + 100, 10), (data.ctypes.data - 10, 20)):
        with pytest.raises(ValueError, match=rf"overlaps region {rid} .*register each byte range once"):
            t.register(ptr, length)
    with pytest.raises(ValueError, match="lies in the first 4096 bytes"):
        t.register(16, 64)
    with pytest.raises(ValueError, match="does not fit a 64-bit address space"):
        t.register(2**64 - 4096, 8192)
    assert t.register(data.ctypes.data + 4096, 4096) == rid + 1  # the neighbouring range is free
    assert list(t.regions) == [rid, rid + 1]


def test_deregister_of_a_source_in_flight_is_refused(writer, receiver):
    """A writer that frees its source during a write would see REMOTE_DISCONNECT, blaming the
    peer: deregistering a region that a pending transfer reads from is refused, named."""
    rx, src, sid, peer, rng, t = tcp_pair_and_writer(writer, receiver, 16 * MiB, 12)
    spare, spare_id = host_region(t, 4096, 13)
    tr = stalled_write(rx, peer, sid, 16 * MiB, rng)
    try:
        with pytest.raises(TransportError, match=rf"region {sid} is the source of 1 transfer\(s\) still pending "
                                                 rf"\(to \['{peer.name}'\]\); wait for or abort them"):
            t.deregister(sid)
        t.deregister(spare_id)  # a region no pending transfer reads is free to go
        tr.abort()
        t.deregister(sid)
    finally:
        os.kill(rx.proc.pid, signal.SIGCONT)


def test_agent_start_errors_say_why(writer):
    with pytest.raises(TransportError, match="UCX_TLS='self,sm' lacks tcp: keep tcp in UCX_TLS, also on one host"):
        writer(env={"UCX_TLS": "self,sm"})


def test_agent_names_must_be_unique(writer, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm")
    first = writer(agent_name="kvt-test-dup")
    with pytest.raises(TransportError, match="agent name 'kvt-test-dup' is taken by a live NixlTransport"):
        NixlTransport(NixlConfig(agent_name="kvt-test-dup"))
    other = writer()
    body = msgpack.unpackb(other.export())
    body["agent"] = first.name
    with pytest.raises(PeerDescriptorError, match="peer agent 'kvt-test-dup' has this transport's name"):
        first.connect(msgpack.packb(body))
    first.close()
    writer(agent_name="kvt-test-dup")  # free again once closed


# -- what abort() and FAILED guarantee ---------------------------------------------------------


def nothing_lands_later(rx, peer, fresh, fresh_id, how: str) -> None:
    """After an ended write: the receiver's region 0 no longer changes, and a rewrite of all of
    it from ``fresh`` waited DONE is what it holds afterwards."""
    ended = rx.dump(0)
    time.sleep(0.3)  # room for a late byte of the ended write
    assert_same(rx.dump(0), ended, f"destination after the {how} write ended")
    peer.write(wb(fresh_id, 0, 0, 0, fresh.nbytes)).wait(30)
    time.sleep(0.3)
    assert_same(rx.dump(0), fresh, f"destination after the {how} write and a DONE rewrite")


@pytest.mark.parametrize("num_threads", [0, 2, 4])
def test_no_byte_of_an_aborted_write_lands_after_abort_returns(writer, receiver, num_threads):
    """Receiver stopped with a 16 MiB write of 4 KiB ranges in flight; ``abort()`` (the
    receiver continues while it runs): once abort returns, the destination no longer changes,
    and a rewrite of the same destination waited DONE is what it holds afterwards."""
    nbytes = 16 * MiB
    rx, src, sid, peer, rng, t = tcp_pair_and_writer(writer, receiver, nbytes, 20 + num_threads,
                                                     num_threads=num_threads,
                                       peer_loss_timeout_s=20.0)
    fresh, fresh_id = host_region(t, nbytes, 30 + num_threads)
    tr = stalled_write(rx, peer, sid, nbytes, rng)
    resume = resumed_later(rx)
    tr.abort()
    # while the receiver is stopped, the request cannot be finished: bytes of it would land later
    assert resume.continued.is_set(), "abort() returned while the receiver was still stopped"
    resume.join()
    assert tr.status() is TransferStatus.FAILED and tr.error == "aborted"
    nothing_lands_later(rx, peer, fresh, fresh_id, "aborted")


def test_cancel_returns_at_once_and_the_write_ends_once_nothing_of_it_can_land(writer, receiver):
    """``cancel()`` is abort() for a loop that serves others meanwhile: it returns while the
    stopped receiver still holds the write back, the write stays PENDING until NIXL no longer
    runs it, then ends FAILED ("aborted"), and after that no byte of it lands."""
    nbytes = 16 * MiB
    rx, src, sid, peer, rng, t = tcp_pair_and_writer(writer, receiver, nbytes, 27, peer_loss_timeout_s=20.0)
    fresh, fresh_id = host_region(t, nbytes, 37)
    tr = stalled_write(rx, peer, sid, nbytes, rng)
    tr.cancel()  # it returns while the receiver is stopped (resumed only below)
    assert tr.status() is TransferStatus.PENDING  # the stopped receiver still holds bytes of it back
    os.kill(rx.proc.pid, signal.SIGCONT)
    until_ended(tr, "a cancelled write")
    assert tr.status() is TransferStatus.FAILED and tr.error == "aborted"
    nothing_lands_later(rx, peer, fresh, fresh_id, "cancelled")


def test_a_peer_stalled_past_the_deadline_is_lost_until_connected_again(writer, receiver):
    """FAILED at the deadline: bytes of the request may still land, so this transport refuses
    further writes to that agent (a later write must not be overtaken by them) until a new
    connect to it, which tears the old endpoint down first. ``Peer.lost`` says so meanwhile."""
    rx, src, sid, peer, rng, t = tcp_pair_and_writer(writer, receiver, 8 * MiB, 5, peer_loss_timeout_s=0.5)
    assert peer.lost is None
    tr = stalled_write(rx, peer, sid, 8 * MiB, rng)
    with pytest.raises(TransferFailed, match="not done after"):
        tr.wait(20)
    assert peer.lost == tr.error
    later = peer.write(wb(sid, 0, 0, 0, 4096))
    assert later.status() is TransferStatus.FAILED
    assert re.search(r"was lost earlier \(connect to a new export first\): .*not done after", later.error)
    with pytest.raises(PeerDraining, match=r"still has 1 failed request\(s\) in flight \(it stalled\)"):
        t.connect(rx.export)
    os.kill(rx.proc.pid, signal.SIGCONT)
    again = connect_once_drained(t, rx.export)
    assert again.lost is None
    again.write(wb(sid, 0, 0, 0, 4096)).wait(30)
    time.sleep(0.3)  # room for a late byte of the failed write
    assert_same(rx.dump(0)[:4096], src[:4096], "first page after reconnecting")


@pytest.mark.parametrize("where", ["state check", "post"])
def test_an_error_nixl_reports_without_raising_loses_the_peer(writer, receiver, monkeypatch, where):
    """NIXL reports a request's backend failure as the state "ERR" (its state check), or its
    post raises after the request was made: part of the request may be in flight either way, so
    the write fails and the agent is lost until a new connect, as for a disconnect; the new
    connection then writes what it is given."""
    rx, src, sid, peer, rng, t = tcp_pair_and_writer(writer, receiver, 8 * MiB, 6)
    api = load_nixl_api()
    if where == "state check":
        agent = t._core.agent
        real, asked = agent.state, []
        tr = stalled_write(rx, peer, sid, 8 * MiB, rng)
        bad = tr._handle

        def state(handle):  # the failing request's first check says ERR; NIXL's own after that
            if handle is bad and not asked:
                asked.append(handle)
                return "ERR"
            return real(handle)
        monkeypatch.setattr(agent, "state", state)
        with pytest.raises(TransferFailed, match=r"NIXL reported ERR$"):
            tr.wait(20)
        os.kill(rx.proc.pid, signal.SIGCONT)  # the request NIXL still runs ends; connect waits for it
    else:
        refused = api.nixlBind.nixlBackendError

        def transfer(agent, handle, notif_msg=b""):
            raise refused("NIXL_ERR_BACKEND")
        monkeypatch.setattr(api.nixl_agent, "transfer", transfer)
        tr = peer.write(big_batch(sid, 1 * MiB, 4096, rng))
        assert tr.status() is TransferStatus.FAILED
        assert tr.error.endswith("NIXL reported ERR (nixlBackendError: NIXL_ERR_BACKEND) when posting"), tr.error
        monkeypatch.undo()
    assert peer.lost == tr.error
    later = peer.write(wb(sid, 0, 0, 0, 4096))
    assert later.status() is TransferStatus.FAILED and "was lost earlier" in later.error
    again = connect_once_drained(t, rx.export)
    assert again.lost is None
    again.write(wb(sid, 0, 0, 0, 4096)).wait(30)
    assert_same(rx.dump(0)[:4096], src[:4096], "first page after reconnecting")
