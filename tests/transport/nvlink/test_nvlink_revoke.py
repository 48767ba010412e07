"""Revocation in the nvlink backend: no copy of a writer holding an older
export reaches memory its owner deregistered, and deregister never hangs on a writer.

On CPU: the owner is a real :class:`NvlinkTransport` registering host arrays with stand-in IPC
exports; writers are the real writing side of the mailbox with stand-in copies
(:mod:`tests.transport.nvlink._nvlink_cpu`), in this process or in writer processes
(:mod:`tests.transport._writer`, backend ``nvlink-cpu``) that can be stopped and killed. On two
GPUs (marked): real nvlink transports in two processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from tests._stop import stop
from tests.transport._revoke_clock import LONG_S, revoke_clock, silent
from tests.transport.nvlink._nvlink_cpu import CpuWriter, stand_in_ipc, wait_until
from transport.base import Notification, RegionRevoked, RevokeTimeout, TransferStatus, WriteBatch
from transport.nvlink import NvlinkConfig, NvlinkTransport, parse_descriptor
from transport.nvlink import ipc
from transport.nvlink.ipc import PeerMapping
from transport.revocation import wire

FRAME = struct.Struct(">I")  # the mailbox's frame header


def wb(dst_region: int, dst_offset: int = 0, length: int = 64) -> WriteBatch:
    return WriteBatch.of([0], [0], [dst_region], [dst_offset], [length])


@pytest.fixture
def owner(monkeypatch):
    """A factory of owning nvlink transports: ``(transport, region ids)`` of zeroed host arrays
    of ``sizes`` bytes, registered through stand-in IPC exports; closed at teardown."""
    stand_in_ipc(monkeypatch)
    made = []

    def make(sizes, revoke_timeout_s: float = 5.0):
        t = NvlinkTransport(NvlinkConfig(revoke_timeout_s=revoke_timeout_s))
        mem = [np.zeros(n, dtype=np.uint8) for n in sizes]
        made.append((t, mem))
        return t, [t.register(m.ctypes.data, m.nbytes, device=0) for m in mem]

    yield make
    for t, _ in made:
        t.close()


@pytest.fixture
def cpu_writer():
    """A factory of :class:`CpuWriter` s in this process, closed at teardown."""
    made = []

    def make(name: str = "cpu-writer", revoke_timeout_s: float = 5.0) -> CpuWriter:
        made.append(CpuWriter(name, revoke_timeout_s))
        return made[-1]

    yield make
    for w in made:
        w.close()


@contextlib.contextmanager
def polling(transport):
    """``transport.poll_notifications()`` on a thread of its own meanwhile (a receiver's loop,
    which answers holds); yields the notifications it collected."""
    stop, notes = threading.Event(), []

    def loop():
        while not stop.is_set():
            notes.extend(transport.poll_notifications())
            time.sleep(1e-3)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield notes
    finally:
        stop.set()
        thread.join()


def heard_again(transport, name: str) -> None:
    """Read the owner's mailbox until the silent writer ``name`` has been heard from (a silent
    writer that answers again is waited for again once its answers have been read, as in NIXL)."""
    wait_until(f"{name} heard from again", lambda: transport.poll_notifications() is not None
               and not silent(transport, name), timeout=30.0)


# -- one process: the owner's transport, writers on the real mailbox ------------------------------


def test_a_hold_is_acknowledged_before_the_first_copy_and_notifications_still_come(owner, cpu_writer):
    t, rids = owner([4096])
    peer = cpu_writer("w").connect(t.export())
    with polling(t) as notes:
        tr = peer.write(wb(rids[0]), notify=b"one")  # waits for the HoldAck, which the owner's poll sends
        assert peer.hold.acked and tr.status() is TransferStatus.PENDING
        peer.land()
        tr.wait(5)
        wait_until("the notification", lambda: notes)
    assert notes == [Notification("w", b"one")]
    assert peer.mapping.dropped == []


def test_the_owners_notification_fd_rings_once_a_writers_copy_landed(owner, cpu_writer):
    """The owner's bell goes to the writer with the HoldAck; the writer rings it as it settles
    a landed copy (after the word's store), so a receiver asleep on ``notification_fd()``
    wakes then and its next poll has the notification, which clears the bell."""
    t, rids = owner([4096])
    bell = t.notification_fd()
    peer = cpu_writer("w").connect(t.export())
    with polling(t):
        tr = peer.write(wb(rids[0]), notify=b"warm")
        peer.land()
        tr.wait(5)
    wait_until("the writer got the bell", lambda: peer.queue.outbox.rings)
    t.poll_notifications()
    assert not select.select([bell], [], [], 0)[0]
    tr = peer.write(wb(rids[0]), notify=b"rung")
    assert not select.select([bell], [], [], 0.05)[0], "rung before the copy landed"
    peer.land()
    tr.wait(5)  # the stand-in writer settles as its transfers are waited for
    assert select.select([bell], [], [], 30)[0], "the bell did not ring"
    assert t.poll_notifications() == [Notification("w", b"rung")]
    assert not select.select([bell], [], [], 0)[0]


def test_deregister_waits_for_the_copy_in_flight_then_the_writer_refuses_the_region(owner, cpu_writer, monkeypatch):
    clock = revoke_clock(monkeypatch)
    t, rids = owner([4096, 4096], revoke_timeout_s=LONG_S)
    peer = cpu_writer().connect(t.export())
    with polling(t):
        tr = peer.write(wb(rids[0]))
    clock.on_nap = lambda: clock.naps == 1 and peer.land()  # the copy ends while deregister waits for it
    t.deregister(rids[0])
    assert clock.naps >= 1, "deregister returned before the copy into the region ended"
    assert tr.status() is TransferStatus.DONE
    assert rids[0] not in t.regions
    assert peer.mapping.dropped == [{rids[0]}]  # unmapped before the acknowledgement
    with pytest.raises(RegionRevoked, match=rf"region {rids[0]} of peer '{t.name}' was revoked: its owner "
                                            r"deregistered it .*nothing was written"):
        peer.write(WriteBatch.of([0, 0], [0, 0], [rids[1], rids[0]], [0, 64], [64, 64]))
    assert peer.write(wb(rids[1])).status() is TransferStatus.PENDING  # the live region still takes copies


def test_writes_racing_a_revoke_all_end_before_deregister_returns(owner, cpu_writer):
    """A thread writes into the region without pause (each stand-in copy runs 20 ms) while it
    is deregistered: every copy it posted has ended when deregister returns (the revoke's
    snapshot and the writes' check share the hold's lock), and from the revoke on each write
    raises RegionRevoked."""
    t, rids = owner([4096])
    writer = cpu_writer()
    writer.copy_s = 0.02
    peer = writer.connect(t.export())
    with polling(t):
        peer.write(wb(rids[0]))
    refused, stop = [], threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                peer.write(wb(rids[0]))
            except RegionRevoked as exc:
                refused.append(str(exc))

    thread = threading.Thread(target=hammer)
    thread.start()
    wait_until("the thread's copies running", lambda: len(peer.events) > 2)
    t.deregister(rids[0])
    returned = time.monotonic()
    stop.set()
    thread.join()
    assert len(peer.events) > 1 and refused
    late = [e.due - returned for e in peer.events if e.due > returned]
    assert not late, f"{len(late)} copies into the region still ran when deregister returned (up to {max(late):.4f} s)"


def test_a_connect_with_an_export_older_than_a_deregister_cannot_write_the_region(owner, cpu_writer, monkeypatch):
    """The race of a late connect: the region was deregistered (nobody held it: at once) before
    this writer connected with an export naming it; the owner's answer to its Hello names the
    region gone, and the writer posts nothing before that answer."""
    clock = revoke_clock(monkeypatch)
    t, rids = owner([4096, 4096])
    stale = t.export()
    with clock.no_wait():
        t.deregister(rids[0])
    peer = cpu_writer().connect(stale)
    with polling(t):
        with pytest.raises(RegionRevoked, match=rf"region {rids[0]} of peer '{t.name}' was revoked"):
            peer.write(wb(rids[0]))
        assert peer.write(wb(rids[1])).status() is TransferStatus.PENDING
    assert peer.mapping.dropped == [{rids[0]}]  # the gone region's mapping goes at the answer


def test_a_hold_that_comes_while_the_region_is_revoked_gets_it_as_gone(owner, cpu_writer, monkeypatch):
    """A second writer connects (Hello read inside deregister's wait for the first one): its
    answer names the region gone, so it cannot write into it after deregister returns."""
    clock = revoke_clock(monkeypatch)
    t, rids = owner([4096], revoke_timeout_s=LONG_S)
    export = t.export()
    first = cpu_writer("first").connect(export)
    with polling(t):
        first.write(wb(rids[0]))
    late = {}

    def meanwhile():  # inside deregister's wait: the late writer connects; once answered, the first one's copy ends
        if "peer" not in late:
            late["peer"] = cpu_writer("late").connect(export)
        elif late["peer"].hold.acked:
            first.land()

    clock.on_nap = meanwhile
    t.deregister(rids[0])
    assert late["peer"].hold.acked, "deregister returned before the late writer's Hello was answered"
    with pytest.raises(RegionRevoked, match=rf"region {rids[0]} of peer '{t.name}' was revoked"):
        late["peer"].write(wb(rids[0]))


def test_the_first_write_fails_when_the_owner_never_answers_the_hold(owner, cpu_writer):
    t, rids = owner([4096])
    peer = cpu_writer(revoke_timeout_s=0.3).connect(t.export())  # the owner does not poll
    tr = peer.write(wb(rids[0]))
    assert not peer.hold.acked and tr.status() is TransferStatus.FAILED
    assert re.search(rf"peer '{t.name}' did not acknowledge this transport's hold of its export within 0.3 s",
                     tr.error), tr.error


def test_a_closed_peer_lets_go_of_its_hold(owner, cpu_writer):
    """Closing the peer ends its connection: the owner's deregister goes through (it waits at
    most for the connection's end to be read), though the writer's copy never ended and it
    answers no revoke."""
    t, rids = owner([4096], revoke_timeout_s=LONG_S)
    peer = cpu_writer().connect(t.export())
    with polling(t):
        peer.write(wb(rids[0]))
    peer.close()
    t.deregister(rids[0])  # RevokeTimeout if it still counted the closed peer as a holder
    assert rids[0] not in t.regions


def test_an_owner_that_closes_ends_its_writers_connections(owner, cpu_writer):
    t, rids = owner([4096])
    peer = cpu_writer().connect(t.export())
    with polling(t):
        peer.write(wb(rids[0]))
    assert peer.queue.outbox.alive()
    t.close()
    wait_until("the writer seeing the owner's end", lambda: not peer.queue.outbox.alive())


def test_revoke_timeout_and_force_match_nixl(owner, cpu_writer, monkeypatch):
    """A writer whose copy into the region never ends cannot acknowledge: deregister refuses
    at the timeout naming it (the region stays registered), a second revoke of the silent
    writer refuses without waiting, force releases, and once it answers again it is waited for."""
    clock = revoke_clock(monkeypatch)
    t, rids = owner([4096, 4096, 4096], revoke_timeout_s=LONG_S)
    peer = cpu_writer("stuck").connect(t.export())
    with polling(t):
        peer.write(wb(rids[0]))
    clock.expire = lambda: True  # the wait for the stuck writer times out at its first nap
    with pytest.raises(RevokeTimeout, match=rf"region {rids[0]} is still held by peer\(s\) \['stuck'\]: no "
                                            rf"acknowledgement of its revocation within {LONG_S:g} s"):
        t.deregister(rids[0])
    assert rids[0] in t.regions
    clock.expire = lambda: False
    with clock.no_wait():  # silent already: no second wait
        with pytest.raises(RevokeTimeout, match=rf"region {rids[1]} is still held"):
            t.deregister(rids[1])
        t.deregister(rids[1], force=True)
    assert rids[1] not in t.regions
    peer.land()  # now it answers the revokes it missed: it is waited for again
    heard_again(t, "stuck")
    t.deregister(rids[2])
    t.deregister(rids[0])
    assert rids[2] not in t.regions and rids[0] not in t.regions


# -- malformed frames ----------------------------------------------------------------------------------


def test_a_connection_that_does_not_say_hello_is_closed(owner, monkeypatch):
    t, rids = owner([4096])
    mailbox = parse_descriptor(t.export())[0]["mailbox"]
    bad_frames = [b"just a name", wire.encode(wire.RevokeAck(1)), wire.MAGIC + b"\xc1",
                  wire.MAGIC + bytes([0x92, 0x06, 0x92, 0x05, 0x90])]  # Hello(name=5, regions=[])
    for frame in bad_frames:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + mailbox)
        sock.sendall(FRAME.pack(len(frame)) + frame)
        sock.settimeout(5.0)
        wait_until("the inbox reading the frame", lambda: t.poll_notifications() == [] and _ended(sock))
        sock.close()
    with revoke_clock(monkeypatch).no_wait():
        t.deregister(rids[0])  # none of them holds anything


def _ended(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def test_a_malformed_frame_from_a_writer_is_dropped(owner, cpu_writer):
    t, rids = owner([4096], revoke_timeout_s=LONG_S)
    peer = cpu_writer("w").connect(t.export())
    with polling(t) as notes:
        peer.write(wb(rids[0]))
        peer.queue.outbox.send_control(wire.MAGIC + b"\xc1 not msgpack")
        peer.queue.outbox.send(b"after")
        wait_until("the notification after it", lambda: notes)
    assert notes == [Notification("w", b"after")]
    peer.land()
    t.deregister(rids[0])  # the connection still answers (RevokeTimeout otherwise)


def test_malformed_frames_from_an_owner_are_dropped_and_the_next_revoke_answered(cpu_writer):
    """A stand-in owner (a bare socket) answers the Hello among frames that do not decode; the
    writer's mailbox thread drops them and acknowledges the revoke that follows."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"kvt-test-owner-{os.getpid()}"
    listener.bind("\0" + name)
    listener.listen(1)
    from transport.base import Region, pack_descriptor

    export = pack_descriptor("nvlink", [Region(3, 1 << 30, 4096, 0)], name="fake", host="h", pid=1,
                             mailbox=name, ipc=[[3, bytes(ipc.IPC_HANDLE_BYTES), 0, 4096]])
    writer = cpu_writer()
    peer = writer.connect(export)
    conn, _ = listener.accept()
    conn.settimeout(5.0)
    hello = _read_frame(conn)
    assert wire.decode(hello) == wire.Hello(writer.name, [3])
    for frame in (wire.MAGIC + b"\xc1", wire.MAGIC + bytes([0x92, 0x01, 0x91, 0x00]),  # HoldAck of 1 field
                  wire.encode(wire.HoldAck(0, [])), wire.MAGIC + bytes([0x92, 0x7f, 0x90]),  # unknown kind
                  wire.encode(wire.Revoke(7, [3]))):
        conn.sendall(FRAME.pack(len(frame)) + frame)
    assert wire.decode(_read_frame(conn)) == wire.RevokeAck(7)
    assert peer.hold.acked and writer.mailbox.error is None
    with pytest.raises(RegionRevoked, match="region 3 of peer 'fake' was revoked"):
        peer.write(wb(3))
    conn.close()
    listener.close()


def _read_frame(conn: socket.socket) -> bytes:
    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            assert chunk, "the writer closed its end"
            buf += chunk
        return buf

    (n,) = FRAME.unpack(exactly(FRAME.size))
    return exactly(n)


# -- the peer's mapping ----------------------------------------------------------------------------


def test_a_dropped_region_is_unmapped_under_every_gpu_and_never_opened_again(monkeypatch):
    opened, closed = [], []
    monkeypatch.setattr("transport.nvlink.ipc.open_handle",
                        lambda api, handle, device: opened.append((handle, device)) or 1 << 32)
    monkeypatch.setattr("transport.nvlink.ipc.close_handle",
                        lambda api, handle, device: closed.append((handle, device)))
    from transport.base import Region

    regions = {r: Region(r, (1 << 30) + r * 4096, 4096, 1) for r in range(3)}
    handles = {r: (bytes([r]) * ipc.IPC_HANDLE_BYTES, r * 4096, 3 * 4096) for r in range(3)}
    mapping = PeerMapping(None, "peer", regions, handles)
    assert mapping.bases(0).tolist() == [1 << 32, (1 << 32) + 4096, (1 << 32) + 8192]
    mapping.drop({1})
    assert closed == [(handles[1][0], 0)] and mapping.bases(0)[1] == 0
    mapping.bases(5)  # the staged engine opens the peer's regions under another GPU: not the dropped one
    assert [h for h, d in opened if d == 5] == [handles[0][0], handles[2][0]]
    mapping.close()
    assert sorted(closed) == sorted([(handles[r][0], d) for r in (0, 2) for d in (0, 5)] + [(handles[1][0], 0)])


# -- writer processes: stopped, killed --------------------------------------------------------------


def test_a_writer_killed_mid_revoke_counts_as_lost(owner, writer_proc, monkeypatch):
    """The writer's copy into the region never ends, so it cannot acknowledge; it is killed
    while deregister waits: its connection ends and deregister returns (it never times out)."""
    clock = revoke_clock(monkeypatch)
    t, rids = owner([4096], revoke_timeout_s=LONG_S)
    w = writer_proc(1, 4096, backend="nvlink-cpu")
    w.connect(t.export(), pump=t.poll_notifications)
    posted = w.write(1, rids[0], 0, 4096, pump=t.poll_notifications, delay_s=3600.0)
    assert posted.status == "PENDING", posted
    clock.on_nap = lambda: clock.naps == 1 and w.kill()  # while deregister waits for it
    t.deregister(rids[0])
    assert clock.naps >= 1 and not w.proc.is_alive() and rids[0] not in t.regions


def test_writer_gone_follows_the_writers_mailbox_connections(owner, writer_proc):
    """A writer that holds is not gone; once killed (its mailbox connection ends) it is lost."""
    t, rids = owner([4096])
    w = writer_proc(3, 4096, backend="nvlink-cpu")
    w.connect(t.export(), pump=t.poll_notifications)
    w.write(1, rids[0], 0, 4096, pump=t.poll_notifications)
    assert w.wait_finished(1, pump=t.poll_notifications).status == "DONE"
    assert t.writer_gone(w.name) is None and t.writer_gone("nobody-we-know") is None
    w.kill()
    wait_until("the killed writer's connection seen ended",
               lambda: t.poll_notifications() is not None and t.writer_gone(w.name) is not None)
    assert t.writer_gone(w.name) == "let go of this side's export"


def test_a_stopped_writer_is_silent_and_answers_once_it_runs_again(owner, writer_proc, monkeypatch):
    """SIGSTOP: the writer's mailbox thread cannot answer; deregister refuses at the timeout
    naming it and keeps the region; force releases another one without waiting. SIGCONT: it
    answers the revokes it missed, and the region goes; its next write to it raises RegionRevoked."""
    clock = revoke_clock(monkeypatch)
    t, rids = owner([4096, 4096], revoke_timeout_s=LONG_S)
    w = writer_proc(2, 4096, backend="nvlink-cpu")
    w.connect(t.export(), pump=t.poll_notifications)
    w.write(1, rids[0], 0, 4096, pump=t.poll_notifications)
    assert w.wait_finished(1, pump=t.poll_notifications).status == "DONE"
    stop(w.proc.pid)
    try:
        clock.expire = lambda: True  # the stopped writer cannot answer: its wait times out at the first nap
        with pytest.raises(RevokeTimeout, match=rf"region {rids[0]} is still held by peer\(s\) \['{w.name}'\]: "
                                                rf"no acknowledgement of its revocation within {LONG_S:g} s"
                                                r".*stopped or hangs"):
            t.deregister(rids[0])
        assert rids[0] in t.regions
        clock.expire = lambda: False
        with clock.no_wait():
            t.deregister(rids[1], force=True)
        assert rids[1] not in t.regions
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)
    heard_again(t, w.name)  # it answers the revokes it missed
    t.deregister(rids[0])
    assert rids[0] not in t.regions
    posted = w.write(2, rids[0], 0, 4096)
    assert posted.status == "RAISED" and re.search(rf"RegionRevoked: region {rids[0]} of peer .* was revoked",
                                                   posted.error), posted


# -- two processes on two GPUs ---------------------------------------------------------------------

GPU_BUF = 1 << 20


def _full(src_rid: int, dst_rid: int, nbytes: int = GPU_BUF) -> WriteBatch:
    return WriteBatch.of([src_rid], [0], [dst_rid], [0], [nbytes])


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_a_writer_holding_an_older_export_gets_region_revoked(remote):
    """The receiver frees a region this process wrote and allocates a buffer of the same size
    (the caching allocator hands it the freed block): this process still holds the export
    naming the freed region, and its write raises RegionRevoked instead of landing in the new
    buffer. (Before revocation, it landed there, silently.)"""
    from tests.transport._support import local_pair

    t, peer, src, dst_rids = local_pair(remote, 2, GPU_BUF)
    try:
        s = sorted(src)
        peer.write(_full(s[0], dst_rids[0]), notify=b"revoke-before").wait(60)
        assert remote.wait_notify(b"revoke-before", 60.0) == t.name
        remote.free([dst_rids[0]])  # its deregister waits for this process's mailbox thread
        reused = remote.alloc([GPU_BUF], 0x33)
        with pytest.raises(RegionRevoked, match=rf"region {dst_rids[0]} of peer '{re.escape(peer.name)}' was "
                                                r"revoked: its owner deregistered it"):
            peer.write(_full(s[0], dst_rids[0]))
        time.sleep(0.2)
        assert (remote.fetch(reused)[0] == 0x33).all(), "a write through the older export reached the new buffer"
        peer.write(_full(s[1], dst_rids[1]), notify=b"revoke-live").wait(60)  # the live region still takes writes
        assert remote.wait_notify(b"revoke-live", 60.0) == t.name
        remote.free(reused + dst_rids[1:])
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_deregister_waits_for_a_write_in_flight(remote):
    """A write queued behind a kernel of a few seconds is in flight when the receiver deregisters
    its destination: deregister returns only after the write's bytes landed (the region's
    digest as deregister returned is the source's), and nothing lands after it (a later write
    raises RegionRevoked, the digest stays). (Before revocation, deregister returned at once.)"""
    import torch

    from tests.transport._support import gpu_sleep, local_pair
    from kvtransfer.benchmarks._remote import digest

    t, peer, src, dst_rids = local_pair(remote, 1, GPU_BUF)
    try:
        (s0,) = src
        # the same write once first: the hold is acknowledged, the mapping open and the engine
        # built (each can take a good part of a second, or synchronize, on its first use)
        peer.write(_full(s0, dst_rids[0])).wait(60)
        torch.cuda.set_device(0)
        gpu_sleep(4.0)  # calibrated on a GPU that may still be clocking up: it may run half as long
        tr = peer.write(_full(s0, dst_rids[0]), notify=b"in-flight")
        assert tr.status() is TransferStatus.PENDING
        ((_, at_return),) = remote.deregister([dst_rids[0]])
        assert at_return == digest(src[s0]), "the write in flight had not landed when deregister returned"
        tr.wait(60)
        with pytest.raises(RegionRevoked, match=f"region {dst_rids[0]} of peer"):
            peer.write(_full(s0, dst_rids[0]))
        time.sleep(0.2)
        assert remote.digest([dst_rids[0]]) == [at_return]
        remote.free([dst_rids[0]])
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_a_writer_killed_mid_revoke_counts_as_lost(writer_proc, monkeypatch):
    """This process owns the memory; a writer process on cuda:1 queues a write into it behind
    a 30 s kernel, so it cannot acknowledge the revoke; it is killed while deregister waits,
    which then returns (lost; it never times out), the region never written."""
    import torch

    clock = revoke_clock(monkeypatch)
    torch.cuda.set_device(0)
    mem = torch.full((GPU_BUF,), 0x11, dtype=torch.uint8, device="cuda:0")
    warm = torch.zeros(GPU_BUF, dtype=torch.uint8, device="cuda:0")
    owner = NvlinkTransport(NvlinkConfig(revoke_timeout_s=60.0))
    try:
        rid, warm_rid = owner.register_tensor(mem), owner.register_tensor(warm)
        w = writer_proc(5, GPU_BUF, backend="nvlink", device=1)
        w.connect(owner.export(), pump=owner.poll_notifications)
        # a write of the same size first: the hold acknowledged, the export's mappings opened
        # (opening one can wait for the device) and the engine built before the delayed write
        w.write(0, warm_rid, 0, GPU_BUF, pump=owner.poll_notifications)
        assert w.wait_finished(0, pump=owner.poll_notifications).status == "DONE"
        posted = w.write(1, rid, 0, GPU_BUF, pump=owner.poll_notifications, delay_s=30.0)
        assert posted.status == "PENDING", posted
        clock.on_nap = lambda: clock.naps == 1 and w.kill()  # while deregister waits for it
        owner.deregister(rid)
        assert clock.naps >= 1 and not w.proc.is_alive() and rid not in owner.regions
        time.sleep(0.5)
        assert (mem.cpu() == 0x11).all(), "a copy the killed writer had queued landed after deregister"
    finally:
        owner.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_a_late_connect_with_a_stale_export_cannot_write_the_revoked_region(remote):
    """The receiver deregisters a region (keeping its memory) before this process connects with
    an export taken earlier: the write to that region raises RegionRevoked and lands nothing,
    the other region of the export takes writes. (Before revocation, the write landed.)"""
    import torch

    from transport.nvlink import NvlinkTransport as Transport

    dst = remote.alloc([GPU_BUF, GPU_BUF], 0x5A)
    stale = remote.export()["nvlink"]
    remote.deregister([dst[0]])  # nobody holds it
    torch.cuda.set_device(0)
    t = Transport()
    try:
        buf = torch.randint(0, 256, (GPU_BUF,), dtype=torch.uint8, device="cuda:0")
        sid = t.register_tensor(buf)
        peer = t.connect(stale)
        with pytest.raises(RegionRevoked, match=rf"region {dst[0]} of peer '{re.escape(peer.name)}' was revoked"):
            peer.write(_full(sid, dst[0]))  # waits for the receiver's answer to the hold, which names it gone
        with pytest.raises(ValueError, match="reserved for revocation"):
            peer.write(_full(sid, dst[1]), notify=wire.MAGIC + b"x")
        peer.write(_full(sid, dst[1]), notify=b"stale-live").wait(60)
        assert remote.wait_notify(b"stale-live", 60.0) == t.name
        time.sleep(0.2)
        got = remote.fetch(dst)
        assert (got[0] == 0x5A).all(), "the write through the stale export landed in the deregistered region"
        np.testing.assert_array_equal(got[1], buf.cpu().numpy())
    finally:
        t.close()
    remote.free(dst)
