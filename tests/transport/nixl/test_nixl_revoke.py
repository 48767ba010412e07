"""Revocation: no byte of a writer holding an older export lands in memory
its owner deregistered and freed, and deregister never hangs on a peer.

Two processes over loopback UCX (tcp kept in ``UCX_TLS``, ``UCX_NET_DEVICES=lo``), the real
NIXL transport on both sides: a receiver process (``_nixl_peer``) with this process writing, or
this process owning the memory and writer processes (``_writer``) writing into it.
"""

from __future__ import annotations

import os
import re
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
from tests.transport import _nixl_peer, _writer  # noqa: E402
from tests.transport._revoke_clock import LONG_S, answered, holds, revoke_clock  # noqa: E402
from tests.transport._support import assert_same  # noqa: E402
from transport.base import RegionRevoked, RevokeTimeout, TransferStatus, WriteBatch  # noqa: E402
from transport.nixl.staged import StagedNixlConfig  # noqa: E402

MiB = 1 << 20
TCP_ONLY = {"UCX_TLS": "tcp,self"}  # a write stays in flight until the owner progresses it
DIRECT = StagedNixlConfig(enabled=False)


def wb(src_region, src_offset, dst_region, dst_offset, length) -> WriteBatch:
    arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in
                                   (src_region, src_offset, dst_region, dst_offset, length)))
    return WriteBatch.of(*arrays)


def refusal(peer, batch) -> str:
    """Why a write to a revoked region is refused: RegionRevoked at once when this side knew
    already, else a FAILED transfer once the owner's answer to the hold names the region gone
    (which one comes first is a race between the owner's messages)."""
    try:
        tr = peer.write(batch)
    except RegionRevoked as exc:
        return str(exc)
    assert tr.status() is TransferStatus.FAILED, f"a write to a revoked region went through: {tr.status()}"
    return tr.error


def owned(transport, nbytes):
    """A zeroed host region of ``transport``: (array, region id)."""
    data = np.zeros(nbytes, dtype=np.uint8)  # [nbytes]
    return data, transport.register(data.ctypes.data, data.nbytes)


@pytest.mark.parametrize("env", [{}, TCP_ONLY], ids=["tcp-self-sm", "tcp-self"])
def test_a_write_to_a_freed_region_fails_and_lands_nothing(writer, receiver, env):
    """The issue's sequence: the receiver deregisters and frees a 64 MiB region (and
    deregisters a 64 KiB one it keeps) while this writer still holds the export naming them;
    the writer's later writes to them raise RegionRevoked naming the region, the receiver
    stays alive and no byte lands in the kept one; its live region still takes writes.
    (Before revocation, over tcp alone the write into the freed 64 MiB killed the receiver
    with SIGSEGV; with sm, cma failed it as a "remote disconnect".)"""
    rx = receiver([64 * MiB, 64 * 1024, 4096], env=env)
    t = writer(env=env, staged=DIRECT)
    src = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8)  # [64 MiB]
    sid = t.register(src.ctypes.data, src.nbytes)
    peer = t.connect(rx.export)
    for region, size in ((0, 64 * MiB), (1, 64 * 1024)):
        peer.write(wb(sid, 0, region, 0, size)).wait(30)
    rx.deregister(0, pump=t.poll_notifications, free=True)  # t answers the revoke meanwhile
    rx.deregister(1, pump=t.poll_notifications)
    kept = rx.dump(1)
    assert_same(kept, src[:64 * 1024], "region 1 as deregistered")
    for batch, region in ((wb(sid, 0, 0, 0, 64 * MiB), 0), (wb(sid, 0, 1, 0, 64 * 1024), 1),
                          (wb(sid, [0, 0], [2, 0], [0, 0], [4096, 4096]), 0)):
        with pytest.raises(RegionRevoked, match=rf"region {region} of peer '{re.escape(peer.name)}' was revoked: "
                                                r"its owner deregistered it .*nothing was written"):
            peer.write(batch)
    time.sleep(0.3)  # room for a late byte
    assert rx.proc.is_alive(), "the receiver died"
    assert_same(rx.dump(1), kept, "the deregistered region 1 after the refused writes")
    assert_same(rx.dump(2), np.zeros(4096, np.uint8), "region 2 after a refused batch that named it")
    peer.write(wb(sid, 100, 2, 0, 4096)).wait(30)
    assert_same(rx.dump(2), src[100:4196], "the live region 2")


def test_a_connect_to_an_export_older_than_a_deregister_writes_nothing(writer, receiver):
    """The owner deregistered a region before this writer connected with an export naming it:
    the owner's HoldAck names it gone, and the write fails, naming it, without a byte landing."""
    rx = receiver([64 * 1024, 4096])
    stale = rx.export
    rx.deregister(0)  # nobody holds it yet: no wait
    t = writer(staged=DIRECT)
    src = np.random.default_rng(2).integers(0, 256, 64 * 1024, dtype=np.uint8)  # [64 KiB]
    sid = t.register(src.ctypes.data, src.nbytes)
    peer = t.connect(stale)
    tr = peer.write(wb(sid, 0, 0, 0, 64 * 1024))
    assert tr.status() is TransferStatus.FAILED
    assert re.search(r"region 0 of peer '.*' was revoked", tr.error), tr.error
    with pytest.raises(RegionRevoked, match="region 0 of peer"):  # known at once from now on
        peer.write(wb(sid, 0, 0, 0, 64))
    assert_same(rx.dump(0), np.zeros(64 * 1024, np.uint8), "the region deregistered before the connect")
    peer.write(wb(sid, 0, 1, 0, 4096)).wait(30)  # the live region of the same export


def test_a_writer_with_a_write_in_flight_is_waited_for(writer, writer_proc):
    """This process owns a 64 MiB region; a writer process posts a 64 MiB write into it over
    tcp and keeps polling; deregister issued right after the post returns only once the write
    has landed whole (the writer's write ends DONE, the region holds every byte)."""
    owner = writer(env=TCP_ONLY, revoke_timeout_s=20.0)
    mem, rid = owned(owner, 64 * MiB)
    w = writer_proc(3, 64 * MiB, env=TCP_ONLY)
    w.connect(owner.export())
    posted = w.write(1, rid, 0, 64 * MiB, pump=owner.poll_notifications)  # waits for the hold's ack
    assert posted.status == "PENDING", posted
    owner.deregister(rid)
    assert_same(mem, w.source, "the region when deregister returned")
    assert w.wait_finished(1, pump=owner.poll_notifications).status == "DONE"
    assert rid not in owner.regions


def test_a_dead_writer_does_not_hang_deregister(writer, writer_proc):
    """A writer holding the export is killed: deregister finds it dead (a probe write reports
    the disconnect) and releases the region; the revoke's wait never times out (it would
    refuse with RevokeTimeout)."""
    owner = writer(revoke_timeout_s=LONG_S)
    mem, rid = owned(owner, 1 * MiB)
    w = writer_proc(4, 1 * MiB)
    w.connect(owner.export())
    w.write(1, rid, 0, 1 * MiB, pump=owner.poll_notifications)
    assert w.wait_finished(1, pump=owner.poll_notifications).status == "DONE"
    w.kill()
    owner.deregister(rid)
    assert rid not in owner.regions


def gone_within(owner, name: str, timeout_s: float = 10.0):
    """``owner.writer_gone(name)`` asked until it answers (its probes pace themselves), the
    owner's notifications read meanwhile: its answer, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        owner.poll_notifications()
        why = owner.writer_gone(name)
        if why is not None:
            return why
        time.sleep(0.01)
    return None


def test_writer_gone_says_a_killed_writer_is_lost_and_a_closed_one_let_go(writer, writer_proc):
    """What the control plane asks to settle a silent sender's requests: nothing is known of a
    stranger, a writer that holds is not gone, one that closed its peer let go, and a killed one
    is found lost by a probe write that reports the disconnect."""
    owner = writer()
    mem, rid = owned(owner, 1 * MiB)
    assert owner.writer_gone("nobody-we-know") is None
    ws = [writer_proc(seed, 1 * MiB) for seed in (5, 6)]
    for tag, w in enumerate(ws, 1):
        w.connect(owner.export())
        w.write(tag, rid, 0, 1 * MiB, pump=owner.poll_notifications)
        assert w.wait_finished(tag, pump=owner.poll_notifications).status == "DONE"
    assert gone_within(owner, ws[0].name, timeout_s=1.0) is None  # holds, alive: probes answer
    ws[0].close_peer(pump=owner.poll_notifications)
    assert gone_within(owner, ws[0].name) == "let go of this side's export"
    ws[1].kill()
    why = gone_within(owner, ws[1].name)
    assert why is not None and why.startswith("is lost (") and "DISCONNECT" in why.upper(), why
    ws[0].connect(owner.export(), pump=owner.poll_notifications)  # holds again: no longer gone
    ws[0].write(3, rid, 0, 1 * MiB, pump=owner.poll_notifications)
    assert ws[0].wait_finished(3, pump=owner.poll_notifications).status == "DONE"
    assert owner.writer_gone(ws[0].name) is None


def test_writer_gone_never_says_a_stopped_writer_is(writer, writer_proc):
    """A stopped (paused) writer may run again and write: however long it is silent, it is not
    gone."""
    owner = writer()
    mem, rid = owned(owner, 1 * MiB)
    w = writer_proc(7, 1 * MiB)
    w.connect(owner.export())
    w.write(1, rid, 0, 1 * MiB, pump=owner.poll_notifications)
    assert w.wait_finished(1, pump=owner.poll_notifications).status == "DONE"
    stop(w.proc.pid)
    try:
        assert gone_within(owner, w.name, timeout_s=2.0) is None
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)


def test_every_writer_answers_or_deregister_refuses_naming_the_silent_one(writer, writer_proc, monkeypatch):
    """Three writers hold the export and have written; two keep calling their transports, one
    only waits on its pipe (it cannot answer). Once the two answered, the wait times out:
    deregister refuses, naming only the silent one, the region still registered; that writer's
    next write raises RegionRevoked (it sees the revoke before it posts) and, once it runs, a
    second deregister goes through."""
    clock = revoke_clock(monkeypatch)
    owner = writer(revoke_timeout_s=LONG_S)
    mem, rid = owned(owner, 3 * 4096)
    _, other = owned(owner, 4096)
    writers = [writer_proc(10 + i, 4096) for i in range(3)]
    for i, w in enumerate(writers):
        w.connect(owner.export())
        w.write(i, rid, i * 4096, 4096, pump=owner.poll_notifications)
        assert w.wait_finished(i, pump=owner.poll_notifications).status == "DONE"
    for i, w in enumerate(writers):
        assert_same(mem[i * 4096:(i + 1) * 4096], w.source, f"writer {i}'s page")
    silent = writers[2]
    silent.idle(pump=False)  # it waits on its pipe from its answer on
    clock.expire = lambda: answered(owner, {w.name for w in writers[:2]})
    with pytest.raises(RevokeTimeout, match=rf"region {rid} is still held by peer\(s\) \['{silent.name}'\]: "
                                            rf"no acknowledgement .* within {LONG_S:g} s"):
        owner.deregister(rid)
    assert rid in owner.regions  # refused: the memory stays registered
    clock.expire = lambda: False
    posted = silent.write(9, rid, 0, 4096, pump=owner.poll_notifications)
    assert posted.status == "RAISED" and re.search(rf"RegionRevoked: region {rid} of peer .* was revoked",
                                                   posted.error), posted
    silent.idle(pump=True)
    owner.deregister(rid)
    assert rid not in owner.regions
    assert_same(mem[2 * 4096:], writers[2].source, "the silent writer's page (its refused write landed nothing)")
    owner.deregister(other)  # every writer answers the revoke of the other region at once


def test_a_writer_that_connects_while_the_region_is_revoked_gets_it_as_gone(writer, writer_proc, monkeypatch):
    """A hold that reaches the owner while deregister waits for another (silent) holder is
    answered with the region gone: the late writer's write fails naming it and lands nothing,
    and the refusal (the wait ended once the late hold was answered) names only the silent
    holder."""
    clock = revoke_clock(monkeypatch)
    owner = writer(revoke_timeout_s=LONG_S)
    mem, rid = owned(owner, 4096)
    silent = writer_proc(30, 4096)
    silent.connect(owner.export())
    silent.write(1, rid, 0, 4096, pump=owner.poll_notifications)
    assert silent.wait_finished(1, pump=owner.poll_notifications).status == "DONE"
    silent.idle(pump=False)
    late = writer_proc(31, 4096)
    export, before = owner.export(), mem.copy()

    def connect_and_write():  # at the first nap of deregister's wait: the owner is inside it
        if clock.naps == 1:
            late.conn.send(_writer.Connect(export))
            late.conn.send(_writer.Write(2, rid, 0, 4096))

    clock.on_nap = connect_and_write
    clock.expire = lambda: holds(owner, late.name)
    with pytest.raises(RevokeTimeout, match=rf"still held by peer\(s\) \['{silent.name}'\]"):
        owner.deregister(rid)
    late.expect(_writer.Connected, pump=owner.poll_notifications)
    posted = late.expect(_writer.Posted, pump=owner.poll_notifications)
    assert posted.status == "FAILED" and re.search(rf"region {rid} of peer .* was revoked", posted.error), posted
    time.sleep(0.2)
    assert_same(mem, before, "the region after the late writer's write")


def test_force_releases_a_region_a_silent_writer_holds(writer, writer_proc, monkeypatch):
    """``force=True``: a silent holder is given up on after the timeout (documented risk), and
    a holder once silent is not waited for again until it answers."""
    clock = revoke_clock(monkeypatch)
    owner = writer(revoke_timeout_s=LONG_S)
    mem, rid = owned(owner, 4096)
    _, rid2 = owned(owner, 4096)
    w = writer_proc(20, 4096)
    w.connect(owner.export())
    w.write(1, rid, 0, 4096, pump=owner.poll_notifications)
    w.wait_finished(1, pump=owner.poll_notifications)
    w.idle(pump=False)
    clock.expire = lambda: True  # the silent writer's wait times out at its first nap
    owner.deregister(rid, force=True)
    assert clock.naps >= 1 and rid not in owner.regions
    with clock.no_wait(), pytest.raises(RevokeTimeout, match=f"region {rid2} is still held by peer"):
        owner.deregister(rid2)  # silent already: refused without another wait


def test_a_closed_peer_releases_its_hold(writer, receiver):
    """``Peer.close()`` tells the owner to forget this writer: the receiver's deregister then
    waits for nobody, though this process does not call its transport meanwhile (the control
    plane's goodbye relies on it)."""
    rx = receiver([4096, 4096])
    t = writer(staged=DIRECT)
    src = np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8)  # [4096]
    sid = t.register(src.ctypes.data, src.nbytes)
    peer = t.connect(rx.export)
    peer.write(wb(sid, 0, 0, 0, 4096)).wait(30)
    peer.close()
    done = rx.deregistered(0)  # no pump: this process does nothing meanwhile
    assert isinstance(done, _nixl_peer.Exported), done  # waiting for this silent writer ends in RevokeTimeout
    again = t.connect(rx.export)  # an old export: region 0 is gone
    assert re.search(r"region 0 of peer .* was revoked", refusal(again, wb(sid, 0, 0, 0, 64)))
    again.write(wb(sid, 0, 1, 0, 4096)).wait(30)
    assert_same(rx.dump(1), src, "region 1")


def test_a_closed_owner_is_written_to_no_more(writer, writer_proc):
    """The owner closes its transport (waiting for nobody) while its process and memory live
    on: the holder, told so, refuses its next write to it, and the memory does not change."""
    owner = writer()
    mem, rid = owned(owner, 4096)
    w = writer_proc(40, 4096)
    w.connect(owner.export())
    w.write(1, rid, 0, 4096, pump=owner.poll_notifications)
    assert w.wait_finished(1, pump=owner.poll_notifications).status == "DONE"
    mem[:] = 0
    owner.close()  # waits for nobody (the holder is not told to answer anything)
    assert "its owner closed its transport" in w.await_refusal(rid)  # the holder read the owner's message
    posted = w.write(2, rid, 0, 4096)
    assert posted.status == "RAISED" and f"region {rid} of peer" in posted.error \
        and "its owner closed its transport" in posted.error, posted
    time.sleep(0.2)
    assert_same(mem, np.zeros(4096, np.uint8), "the closed owner's memory")


def test_a_close_after_the_owner_closed_sends_it_nothing(writer, receiver, capfd):
    """An orderly shutdown: the writer closes its peer (a Release to the owner), the owner closes
    and its process exits, then the writer closes its transport: nothing goes to the closed
    owner (a Release sent there fails in NIXL with NIXL_ERR_REMOTE_DISCONNECT, which NIXL's
    ``genNotif`` logs as an error)."""
    rx = receiver([4096])
    t = writer(staged=DIRECT)
    src = np.arange(4096, dtype=np.uint32).astype(np.uint8)  # [4096]
    sid = t.register(src.ctypes.data, src.nbytes)
    peer = t.connect(rx.export)
    peer.write(wb(sid, 0, 0, 0, 4096)).wait(30)
    assert_same(rx.dump(0), src, "region 0")
    peer.close()
    rx.stop()
    capfd.readouterr()
    t.close()
    err = capfd.readouterr().err
    assert "genNotif" not in err and "NIXL_ERR" not in err and "send failed" not in err, err
