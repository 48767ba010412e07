"""The landed word stored from C (:mod:`transport.nvlink.completion`), on a GPU: a notification is
released while the writing process holds the GIL, an aborted or timed-out write's notification
is withdrawn and the next one still comes, with the lander and with the progress thread."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.transport import _writer
from tests.transport._support import SLOTS, TOKEN, check_landed, gpu_sleep, kv_batch, local_pair
from transport.base import TransferFailed, TransferStatus
from transport.nvlink.config import NvlinkConfig

pytestmark = pytest.mark.gpu


class _Notes:
    """What ``owner.poll_notifications`` returned, kept (the writer's waits pump it too)."""

    def __init__(self, owner):
        self.owner = owner
        self.payloads: list[bytes] = []

    def pump(self) -> None:
        self.payloads += [n.payload for n in self.owner.poll_notifications()]

    def wait(self, want: bytes, timeout: float, while_=lambda: True) -> bool:
        """Pump until ``want`` came (True), ``timeout`` passed or ``while_()`` turned False."""
        deadline = time.monotonic() + timeout
        while want not in self.payloads and time.monotonic() < deadline and while_():
            self.pump()
            time.sleep(1e-3)
        return want in self.payloads


def _warm_writer(writer_proc, seed: int, nbytes: int = 1 << 20):
    """An owning transport in this process with ``nbytes`` of zeroed GPU memory registered, and
    a writer process connected to it whose first write (notification ``warm``) has landed:
    ``(owner, memory, region id, notes, writer)``; the memory zeroed again. The caller closes
    the owner."""
    import torch

    from transport.nvlink import NvlinkTransport

    torch.cuda.set_device(0)
    mem = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    owner = NvlinkTransport()
    try:
        rid = owner.register_tensor(mem)
        notes = _Notes(owner)
        w = writer_proc(seed, nbytes, backend="nvlink", device=0)
        w.connect(owner.export(), pump=notes.pump)
        w.write(0, rid, 0, nbytes, pump=notes.pump, notify=b"warm")
        assert w.wait_finished(0, pump=notes.pump).status == "DONE"
        assert notes.wait(b"warm", 30.0)
        mem.zero_()
        torch.cuda.synchronize()
    except BaseException:
        owner.close()
        raise
    return owner, mem, rid, notes, w


def test_a_writer_holding_the_gil_does_not_hold_its_notification(writer_proc):
    """A writer process posts a write whose copy starts 0.3 s later, then holds its GIL for 3 s
    in one C call: the notification comes out while the writer still holds it (the lander's
    thread stored the word; the progress thread could not have run), then the bytes are
    checked."""
    owner, mem, rid, notes, w = _warm_writer(writer_proc, 11)
    try:
        w.conn.send(_writer.Write(1, rid, 0, mem.numel(), delay_s=0.3, notify=b"held", hold_gil_s=3))
        came = notes.wait(b"held", 30.0, while_=lambda: not w.conn.poll())
        assert came, "the notification did not come out while the writer held its GIL"
        posted = w.expect(_writer.Posted, pump=notes.pump)
        assert posted.status in ("PENDING", "DONE"), posted
        assert w.wait_finished(1, pump=notes.pump).status == "DONE"
        np.testing.assert_array_equal(mem.cpu().numpy(), w.source)
    finally:
        owner.close()


def test_the_receivers_notification_fd_turns_readable_once_a_write_landed(writer_proc):
    """A receiver that sleeps on ``notification_fd()`` (select) wakes when a writer process's
    notification lands -- its copy queued 0.3 s late -- and finds it in the next poll: the
    lander rang the bell after it stored the word. The poll clears the bell."""
    import select

    owner, mem, rid, notes, w = _warm_writer(writer_proc, 12)
    try:
        bell = owner.notification_fd()
        assert bell is not None
        notes.pump()
        assert not select.select([bell], [], [], 0)[0], "the bell is rung after the poll that cleared it"
        w.conn.send(_writer.Write(1, rid, 0, mem.numel(), delay_s=0.3, notify=b"rung"))
        assert select.select([bell], [], [], 30)[0], "the bell did not ring"
        assert [n.payload for n in owner.poll_notifications()] == [b"rung"]
        assert not select.select([bell], [], [], 0)[0]
        assert w.expect(_writer.Posted, pump=notes.pump).status in ("PENDING", "DONE")
        assert w.wait_finished(1, pump=notes.pump).status == "DONE"
        np.testing.assert_array_equal(mem.cpu().numpy(), w.source)
    finally:
        owner.close()


@pytest.mark.parametrize("native", [True, False], ids=["lander", "progress-thread"])
def test_aborted_and_timed_out_writes_never_notify_and_the_next_ones_do(remote_any, native):
    """A write queued behind 0.5 s of GPU work and aborted at once, then a write behind 3 s that
    times out (1 s): neither notification ever comes; the write after each lands and notifies,
    every byte checked. With the C steps the lander stores the word, without them the progress
    thread does."""
    import torch

    buf_bytes = SLOTS * TOKEN
    config = NvlinkConfig(native=native, transfer_timeout_s=1.0)
    t, peer, src, dst_rids = local_pair(remote_any, 2, buf_bytes, config)
    try:
        assert peer._queue.outbox.watching is native
        batch = kv_batch(sorted(src), dst_rids, 1, False, np.random.default_rng(3), tokens=32)
        tr = peer.write(batch, notify=b"warm")
        tr.wait(timeout=60)
        check_landed(remote_any, src, dst_rids, batch, buf_bytes, b"warm", sender=t.name)

        gpu_sleep(0.5)
        aborted = peer.write(batch, notify=b"aborted")
        aborted.abort()
        assert aborted.status() is TransferStatus.FAILED and aborted.error == "aborted"
        after = peer.write(batch, notify=b"after abort")
        after.wait(timeout=60)
        assert after.status() is TransferStatus.DONE, after.error
        check_landed(remote_any, src, dst_rids, batch, buf_bytes, b"after abort", sender=t.name)

        gpu_sleep(3.0)
        late = peer.write(batch, notify=b"timed out")
        with pytest.raises(TransferFailed, match=r"copy did not complete within 1\.0 s"):
            late.wait(timeout=60)
        torch.cuda.synchronize()
        t._copy_stream().synchronize()  # the late copy has ended
        after = peer.write(batch, notify=b"after timeout")
        after.wait(timeout=60)
        assert after.status() is TransferStatus.DONE, after.error
        check_landed(remote_any, src, dst_rids, batch, buf_bytes, b"after timeout", sender=t.name)
        assert remote_any.wait_notify(b"aborted", 0.5) is None
        assert remote_any.wait_notify(b"timed out", 0.5) is None
    finally:
        t.close()


@pytest.mark.parametrize("native", [True, False], ids=["lander", "progress-thread"])
def test_a_write_of_no_bytes_notifies_after_the_writes_before_it_without_a_copy(remote_any, native, monkeypatch):
    """A request's last notification rides a write of no bytes (its KV went layer by layer):
    no table is built and nothing launched; the notification comes after that of the write
    posted before it, whose copy waits behind 0.5 s of GPU work, and both transfers are DONE.
    Row and strided forms alike."""
    import transport.nvlink.transport as nvlink_transport
    from transport.batch import StridedBatch, WriteBatch

    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote_any, 2, buf_bytes, NvlinkConfig(native=native))
    built = []
    build = nvlink_transport.build
    monkeypatch.setattr(nvlink_transport, "build", lambda *a, **k: built.append(a[1]) or build(*a, **k))
    try:
        batch = kv_batch(sorted(src), dst_rids, 1, False, np.random.default_rng(4), tokens=32)
        none = np.zeros(0, dtype=np.int64)
        nothing = {"rows": WriteBatch.of(none, none, none, none, none),
                   "strided": StridedBatch.of([sorted(src)[0]], [0], [TOKEN], [dst_rids[0]], [0], [TOKEN], [TOKEN],
                                              none, none)}
        for form, empty in nothing.items():
            remote_any.fill(dst_rids, 0x5A)
            gpu_sleep(0.5)
            before = peer.write(batch, notify=b"before " + form.encode())
            write = peer.write_strided if form == "strided" else peer.write
            last = write(empty, notify=b"last " + form.encode())
            remote_any.start_stamp_notify((b"before " + form.encode(), b"last " + form.encode()), 60.0)
            got = remote_any.result()
            assert got[b"before " + form.encode()][1] <= got[b"last " + form.encode()][1], got
            last.wait(timeout=60)
            assert before.status() is last.status() is TransferStatus.DONE
            assert all(b.nbytes for b in built), "a table was built for a write of no bytes"
            remote_any.fill(dst_rids, 0x5A)
            peer.write(batch, notify=b"after " + form.encode()).wait(timeout=60)
            check_landed(remote_any, src, dst_rids, batch, buf_bytes, b"after " + form.encode(), sender=t.name)
    finally:
        t.close()
