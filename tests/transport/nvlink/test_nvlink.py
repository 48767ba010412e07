"""The nvlink backend: pure parts on CPU (row tables, paths, validation, descriptors, the
mailbox, the kernel under Triton's interpreter); two processes on two GPUs (marked)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tests.transport._support import (
    LAYERS,
    SLOTS,
    TOKEN,
    assert_interpreted_ok,
    check_landed,
    kv_batch,
    kv_strided,
    local_pair,
    write_landed,
)
from tests.transport.nvlink._nvlink_cpu import DropRecorder, wait_until
from tests.transport.nvlink._nvlink_cpu import StandInEvent as _Event
from transport.base import (
    Notification,
    PeerDescriptorError,
    Region,
    TransferFailed,
    TransferStatus,
    TransferTimeout,
    TransportClosed,
    WriteBatch,
    pack_descriptor,
)
from transport.nvlink import (
    NvlinkConfig,
    NvlinkEngine,
    NvlinkTransport,
    NvlinkUnsupported,
    parse_descriptor,
)
from transport.nvlink import kernel as kern
from transport.nvlink.revoke import Hold, MailboxThread
from transport.nvlink.mailbox import Inbox as _Inbox
from transport.nvlink.mailbox import MailboxUnreachable
from transport.nvlink.mailbox import Outbox as _Outbox
from transport.nvlink.mailbox import host_id
from transport.nvlink.completion import PendingQueue
from transport.nvlink.completion import NvlinkTransfer

HANDLE = bytes(range(64))


def _rows_reference(src_base, src_region, src_offset, dst_base, dst_region, dst_offset, length):
    return np.array(
        [
            [src_base[r] + o for r, o in zip(src_region, src_offset)],
            [dst_base[r] + o for r, o in zip(dst_region, dst_offset)],
            list(length),
        ],
        dtype=np.int64,
    ).reshape(3, len(length))


# -- row tables, paths, launch plans ----------------------------------------------------------


def test_build_row_table_matches_reference():
    rng = np.random.default_rng(1)
    src_base = rng.integers(1, 2**40, 5) * 256
    dst_base = rng.integers(1, 2**40, 7) * 256
    n = 50
    args = (
        src_base, rng.integers(0, 5, n), rng.integers(0, 10**6, n),
        dst_base, rng.integers(0, 7, n), rng.integers(0, 10**6, n), rng.integers(1, 5000, n),
    )
    np.testing.assert_array_equal(kern.build_row_table(*args), _rows_reference(*args))
    out = np.empty((3, n), dtype=np.int64)
    assert kern.build_row_table(*args, out=out) is out
    with pytest.raises(ValueError, match=r"out must be a \[3, 50\] int64 array"):
        kern.build_row_table(*args, out=np.empty((3, n), dtype=np.int32))


@pytest.mark.parametrize(
    "addr_mult, len_mult, want",
    [(16, 16, kern.CopyPath.VEC16), (16, 8, kern.CopyPath.VEC8), (8, 32, kern.CopyPath.VEC8),
     (16, 3, kern.CopyPath.BYTES), (2, 16, kern.CopyPath.BYTES)],
)
def test_choose_path_takes_the_widest_alignment_every_row_allows(addr_mult, len_mult, want):
    rng = np.random.default_rng(2)
    rows = np.stack([rng.integers(1, 1000, 9) * addr_mult, rng.integers(1, 1000, 9) * 16, rng.integers(1, 9, 9) * len_mult])
    rows[:, 0] = [4096, 4096, 16]  # one fully aligned row does not decide the path
    if addr_mult % 16 or len_mult % 16:  # make sure one row really is misaligned
        rows[0, 3] = 4096 + addr_mult if addr_mult % 16 else rows[0, 3]
        rows[2, 3] = len_mult if len_mult % 16 else rows[2, 3]
    assert kern.choose_path(rows) is want


@pytest.mark.parametrize("path", list(kern.CopyPath))
@pytest.mark.parametrize("n, max_len", [(1, 16), (1000, 256), (77, 2048), (5, 131072)])
def test_plan_launch_covers_every_row_and_its_length(path, n, max_len):
    cfg = kern.KernelConfig()
    plan = kern.plan_launch(n, max_len, path, cfg)
    assert plan.num_tiles * plan.block_r >= n > (plan.num_tiles - 1) * plan.block_r
    assert plan.num_programs == plan.num_tiles
    assert kern.plan_launch(n, max_len, path, kern.KernelConfig(max_programs=3)).num_programs == min(3, plan.num_tiles)
    assert plan.block_c & (plan.block_c - 1) == 0 and plan.block_r & (plan.block_r - 1) == 0
    assert plan.block_r * plan.block_c * path.elem_bytes <= max(cfg.tile_bytes, plan.block_c * path.elem_bytes)
    if max_len <= cfg.max_block_c_bytes:  # a short row is one step
        assert plan.block_c * path.elem_bytes >= max_len


def test_kernel_config_rejects_bad_values():
    with pytest.raises(ValueError, match="tile_bytes must be a power of two >= 16, got 1000"):
        kern.KernelConfig(tile_bytes=1000)
    with pytest.raises(ValueError, match="num_warps must be one of"):
        kern.KernelConfig(num_warps=3)
    with pytest.raises(ValueError, match="max_programs must be an int >= 0, got -1"):
        kern.KernelConfig(max_programs=-1)
    with pytest.raises(ValueError, match="store_cache must be one of"):
        kern.KernelConfig(store_cache=".lu")


def test_check_row_table_names_what_was_expected():
    import torch

    good = torch.zeros((3, 4), dtype=torch.int64)
    kern.check_row_table(good, "cpu")
    with pytest.raises(TypeError, match="rows must be a torch.Tensor, got ndarray"):
        kern.check_row_table(good.numpy(), "cpu")
    with pytest.raises(TypeError, match="rows must have dtype torch.int64, got torch.int32"):
        kern.check_row_table(good.int(), "cpu")
    with pytest.raises(ValueError, match=r"rows must have shape \[3, num_rows\], got \[4, 3\]"):
        kern.check_row_table(torch.zeros((4, 3), dtype=torch.int64), "cpu")
    with pytest.raises(ValueError, match="rows must be contiguous"):
        kern.check_row_table(torch.zeros((4, 3), dtype=torch.int64).t(), "cpu")
    with pytest.raises(ValueError, match="rows must be on cuda:0, got cpu"):
        kern.check_row_table(good, "cuda:0")


_INTERPRET_SCRIPT = r"""
import numpy as np, torch
from transport.nvlink import kernel as kern
rng = np.random.default_rng(3)
src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (3000, 5000)]
dst = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (4000, 9000, 7000)]
for unit, cfg in ((16, kern.KernelConfig(tile_bytes=256, max_block_c_bytes=64)),
                  (8, kern.KernelConfig(tile_bytes=128, max_block_c_bytes=32)),
                  (1, kern.KernelConfig(tile_bytes=64, max_block_c_bytes=32, max_programs=2))):
    for d in dst:
        d.random_(0, 256)
    want = [d.clone() for d in dst]
    n = 12
    length = rng.integers(1, 40, n) * unit  # rows of different lengths, some longer than one step
    sr, dr = rng.integers(0, 2, n), rng.integers(0, 3, n)
    so = np.array([rng.integers(0, (src[r].numel() - l) // unit) * unit for r, l in zip(sr, length)])
    # destinations: disjoint slots per region so rows never overlap
    slot = 320 if unit > 1 else 40
    do = np.zeros(n, dtype=np.int64)
    for r in range(3):
        idx = np.flatnonzero(dr == r)
        do[idx] = rng.permutation(dst[r].numel() // slot)[: idx.size] * slot
    length = np.minimum(length, slot)
    for i in range(n):
        want[dr[i]][do[i]:do[i] + length[i]] = src[sr[i]][so[i]:so[i] + length[i]]
    rows = kern.build_row_table(np.array([t.data_ptr() for t in src]), sr, so,
                                np.array([t.data_ptr() for t in dst]), dr, do, length)
    path = kern.choose_path(rows)
    assert path.value == unit or (unit == 16 and path.value == 16), (path, unit)
    kern.scatter_rows(torch.from_numpy(rows), kern.plan_launch(n, int(length.max()), path, cfg), "cpu")
    for d, w in zip(dst, want):
        assert torch.equal(d, w), (unit, (d != w).nonzero()[:5])
print("KERNEL-OK")
"""


def test_cpu_launch_without_the_interpreter_says_how_to_get_it(monkeypatch):
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = torch.zeros((3, 1), dtype=torch.int64)
    plan = kern.plan_launch(1, 16, kern.CopyPath.VEC16, kern.KernelConfig())
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 before importing triton"):
        kern.scatter_rows(rows, plan, "cpu")


def test_kernel_indexing_under_triton_interpreter():
    """Every path, rows of several lengths across regions, against a Python reference."""
    assert_interpreted_ok(_INTERPRET_SCRIPT, "KERNEL-OK")


# -- configuration, registration, descriptors ---------------------------------------------------


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="peer_timeout_s must be a positive number of seconds, got 0"):
        NvlinkConfig(peer_timeout_s=0)
    with pytest.raises(ValueError, match="ipc_api must be one of"):
        NvlinkConfig(ipc_api="cupy")
    with pytest.raises(TypeError, match="kernel must be a KernelConfig, got dict"):
        NvlinkConfig(kernel={})
    with pytest.raises(TypeError, match="config must be an NvlinkConfig, got dict"):
        NvlinkTransport({})
    with pytest.raises(TypeError, match=r"engine must be an NvlinkEngine \(AUTO, KERNEL, STAGED\), got 'staged'"):
        NvlinkConfig(engine="staged")
    assert NvlinkConfig().engine is NvlinkEngine.AUTO


@pytest.fixture
def transport():
    t = NvlinkTransport(name="test")
    yield t
    t.close()


def test_register_refuses_host_memory_and_bad_arguments(transport):
    with pytest.raises(NvlinkUnsupported, match="GPU memory only; register host memory with the nixl backend"):
        transport.register(4096, 100, device=None)
    with pytest.raises(TypeError, match="ptr must be a positive int address"):
        transport.register(-1, 100, device=0)
    with pytest.raises(ValueError, match="length must be a positive int"):
        transport.register(4096, 0, device=0)
    with pytest.raises(ValueError, match=r"region 3 is not registered \(live ids: \[\]\)"):
        transport.deregister(3)


def test_register_memory_without_an_ipc_handle_is_unsupported(transport):
    """No CUDA here (or, on a GPU machine, an address no allocation holds): NIXL's job."""
    with pytest.raises(NvlinkUnsupported, match=r"cannot export \[0x100000, \+4096\) on cuda:0 by CUDA IPC"):
        transport.register(1 << 20, 4096, device=0)
    assert transport.regions == {}


def _descriptor(**over):
    fields = dict(name="peer", host=host_id(), pid=os.getpid() + 1, mailbox="nowhere", ipc=[[0, HANDLE, 0, 1 << 20]])
    regions = over.pop("regions", [Region(0, 1 << 30, 4096, 1)])
    fields.update(over)
    return pack_descriptor("nvlink", regions, **fields)


def test_parse_descriptor_accepts_a_well_formed_export():
    body, regions, ipc = parse_descriptor(_descriptor())
    assert regions == {0: Region(0, 1 << 30, 4096, 1)}
    assert ipc == {0: (HANDLE, 0, 1 << 20)}
    assert body["name"] == "peer"


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\xc1garbage", "not valid msgpack"),
        (pack_descriptor("nixl", [], agent="a", metadata=b""), "for backend 'nixl', expected 'nvlink'"),
        (pack_descriptor("nvlink", [], name="p"), "lacks fields"),
        (_descriptor(pid="12"), "field 'pid' must be int"),
        (_descriptor(regions=[Region(0, 4096, 4096, None)]), "lists host regions"),
        (_descriptor(ipc=[[0, b"short", 0, 1 << 20]]), "ipc entry must be"),
        (_descriptor(ipc=[[0, HANDLE, -1, 1 << 20]]), "ipc entry must be"),
        (_descriptor(ipc=[]), r"ipc entries cover regions \[\], the region table lists \[0\]"),
    ],
)
def test_parse_descriptor_errors(data, match):
    with pytest.raises(PeerDescriptorError, match=match):
        parse_descriptor(data)


def test_connect_refuses_other_host_and_same_process(transport):
    with pytest.raises(NvlinkUnsupported, match="is on host 'elsewhere'"):
        transport.connect(_descriptor(host="elsewhere"))
    with pytest.raises(NvlinkUnsupported, match="the peer is this process"):
        transport.connect(_descriptor(pid=os.getpid()))
    with pytest.raises(PeerDescriptorError, match="must be bytes"):
        transport.connect("text")


def test_closed_transport_refuses_calls():
    t = NvlinkTransport()
    t.close()
    t.close()
    with pytest.raises(TransportClosed, match="is closed"):
        t.poll_notifications()
    with pytest.raises(TransportClosed, match="is closed"):
        t.export()


# -- the mailbox --------------------------------------------------------------------------------


def test_mailbox_delivers_whole_frames_in_order():
    inbox = _Inbox()
    out = _Outbox(inbox.name, timeout_s=5.0, sender="writer")
    payloads = [b"", b"a", os.urandom(3 << 20), b"tail"]  # one frame larger than the socket buffer
    sender = threading.Thread(target=lambda: [out.send(p) for p in payloads])
    sender.start()
    got, deadline = [], time.monotonic() + 20
    while len(got) < len(payloads) and time.monotonic() < deadline:
        got += inbox.poll()
    sender.join()
    assert got == [Notification("writer", p) for p in payloads]
    assert out.alive()
    inbox.close()  # closes its end of every connection before it returns
    assert out.receive() == [] and not out.alive()  # the end, as the mailbox thread reads it
    out.close()


def test_outbox_send_is_bounded_when_the_receiver_reads_nothing():
    """A receiver that stops reading fills the socket; the send then waits for room at most the
    outbox's timeout and raises (the pending queue fails the transfer: peer lost). Part of the
    frame may have gone, so the outbox ends the connection: the receiver reads every whole
    frame sent before, then the end, and the outbox refuses to send or release more."""
    inbox = _Inbox()
    out = _Outbox(inbox.name, timeout_s=0.3, sender="writer")
    sent = 0
    with pytest.raises(TimeoutError):
        for _ in range(100000):
            out.send(b"x" * 1024)
            sent += 1
    assert not out.alive()
    got = _drain(inbox, sent)
    assert got == [Notification("writer", b"x" * 1024)] * sent and inbox._conns == []  # the end read
    with pytest.raises(OSError):
        out.announce(b"more")
    out.close(), inbox.close()


def test_outbox_alive_from_several_threads_while_the_mailbox_thread_reads_the_end():
    """The caller's thread (a write checks the peer before launching) and the progress thread
    (before a notification without payload) ask alive() while the transport's mailbox thread
    reads the connection: none raises, each sees True until the mailbox thread has read the
    end, then False and never True again; alive() reads nothing itself (the owner's answer to
    the Hello still reaches the mailbox thread)."""
    transport = NvlinkTransport(NvlinkConfig())  # an owner: its inbox answers the Hello
    out = _Outbox(transport._inbox.name, timeout_s=5.0, sender="writer")
    hold = Hold("owner", PendingQueue("owner", out, 60.0), DropRecorder())
    mailbox = MailboxThread()
    mailbox.add(hold)
    start, stop, errors, seen = threading.Barrier(9), threading.Event(), [], []

    def ask():
        first = last = out.alive()
        flips = 0
        start.wait()
        try:
            while True:
                done = stop.is_set()  # set once alive() is False: this last look must see it
                now = out.alive()
                flips, last = flips + (now != last), now
                if done:
                    break
        except Exception as exc:  # noqa: BLE001 -- the test reports what a thread raised
            errors.append(exc)
        seen.append((first, flips, last))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        start.wait()
        wait_until("the owner's answer to the Hello", lambda: transport.poll_notifications() == [] and hold.acked)
        assert out.alive()
        transport.close()  # its inbox closes the connection
        wait_until("the mailbox thread reading the end", lambda: not out.alive())
    finally:
        stop.set()
        for t in threads:
            t.join()
        mailbox.stop()  # closes the outbox
        transport.close()
    assert errors == [] and seen == [(True, 1, False)] * 8


def test_outbox_to_a_missing_mailbox_is_unreachable():
    # NvlinkPeer turns this into NvlinkUnsupported (the caller falls back to NIXL).
    with pytest.raises(MailboxUnreachable, match="cannot reach the peer's notification socket"):
        _Outbox("kvtransfer-nvlink-does-not-exist", timeout_s=1.0, sender="x")


def test_mailbox_tells_senders_apart():
    """Two writers into one inbox, interleaved: each notification names its writer, and each
    writer's arrive in the order it sent them."""
    inbox = _Inbox()
    a, b = _Outbox(inbox.name, 5.0, sender="prefill-0"), _Outbox(inbox.name, 5.0, sender="prefill-1")
    sent = []
    for i in range(6):
        out, name = (a, "prefill-0") if i % 2 else (b, "prefill-1")
        out.send(b"req-%d" % i)
        sent.append(Notification(name, b"req-%d" % i))
    got = _drain(inbox, len(sent))
    assert sorted(got, key=lambda n: n.payload) == sent
    for name in ("prefill-0", "prefill-1"):
        assert [n for n in got if n.sender == name] == [n for n in sent if n.sender == name]
    a.close(), b.close(), inbox.close()


def test_transports_have_distinct_names():
    with NvlinkTransport() as a, NvlinkTransport() as b:
        assert a.name != b.name and a.name.startswith("nvlink-")
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        NvlinkTransport(name="")


# -- two processes on two GPUs --------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("page_size, head_slice", [(1, False), (16, False), (64, False), (1, True), (16, True)])
def test_two_processes_kv_rows_exact(remote, page_size, head_slice):
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote, 2 * LAYERS, buf_bytes)
    try:
        rng = np.random.default_rng(page_size + 100 * head_slice)
        batch = kv_batch(sorted(src), dst_rids, page_size, head_slice, rng)
        write_landed(remote, peer, src, dst_rids, batch, buf_bytes, f"kv {page_size} {head_slice}".encode())
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("unit", [1, 8])
def test_two_processes_unaligned_rows(remote, unit):
    """Rows at odd (or only 8-byte aligned) offsets and lengths take the slower paths."""
    buf_bytes = 1 << 16
    t, peer, src, dst_rids = local_pair(remote, 3, buf_bytes)
    try:
        rng = np.random.default_rng(unit)
        n, slot = 40, 1000
        length = rng.integers(1, (slot - 16) // unit, n) * unit
        so = rng.integers(0, (buf_bytes - slot) // unit, n) * unit + (3 if unit == 1 else 0)
        dr = rng.integers(0, 3, n)
        do = np.zeros(n, dtype=np.int64)
        for r in range(3):
            idx = np.flatnonzero(dr == r)
            do[idx] = rng.permutation(buf_bytes // slot - 1)[: idx.size] * slot + (5 if unit == 1 else 8)
        batch = WriteBatch.of(np.asarray(sorted(src))[rng.integers(0, 3, n)], so, np.asarray(dst_rids)[dr], do, length)
        assert kern.choose_path(peer.tables.row_table(batch)).value == unit
        peer.write(batch, notify=b"unaligned %d" % unit).wait(timeout=60)
        check_landed(remote, src, dst_rids, batch, buf_bytes, b"unaligned %d" % unit)
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_processes_ctypes_ipc_api(remote):
    """The libcudart fallback exports and opens handles as cuda-python does, and runs the
    direct path's calls (the caller's stream recorded and waited for, the slots' upload)."""
    import torch

    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote, 4, buf_bytes, NvlinkConfig(ipc_api="ctypes"))
    try:
        batch = kv_batch(sorted(src), dst_rids, 16, False, np.random.default_rng(7))
        peer.write(batch, notify=b"ctypes").wait(timeout=60)
        check_landed(remote, src, dst_rids, batch, buf_bytes, b"ctypes")
        strided = kv_strided(sorted(src), dst_rids, 1, False, np.random.default_rng(8))
        remote.fill(dst_rids, 0x5A)
        with torch.cuda.stream(torch.cuda.Stream(peer.device)):  # a caller's stream that is not the copy stream
            peer.write_strided(strided, notify=b"ctypes direct").wait(timeout=60)
        assert peer.pair_plans.builds == 1
        check_landed(remote, src, dst_rids, strided.expand(), buf_bytes, b"ctypes direct")
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_out_of_bounds_batch_is_refused_before_launch(remote):
    t, peer, src, dst_rids = local_pair(remote, 1, 4096)
    try:
        with pytest.raises(ValueError, match="is outside region"):
            peer.write(WriteBatch.of([sorted(src)[0]], [0], [dst_rids[0]], [4000], [200]))
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_prepared_write_posts_again_and_again_until_released(remote):
    buf_bytes = SLOTS * TOKEN
    t, peer, src, dst_rids = local_pair(remote, 4, buf_bytes)
    try:
        batch = kv_batch(sorted(src), dst_rids, 16, False, np.random.default_rng(9))
        with peer.prepare(batch, engine=NvlinkEngine.KERNEL) as job:
            assert job.engine is NvlinkEngine.KERNEL and job.nbytes == batch.nbytes
            for i in range(3):  # each post writes the whole batch again
                remote.fill(dst_rids, 0x5A)
                tr = job.post(notify=b"prepared %d" % i)
                tr.wait(timeout=60)
                assert tr.status() is TransferStatus.DONE
                check_landed(remote, src, dst_rids, batch, buf_bytes, b"prepared %d" % i, sender=t.name)
        assert job.released
        with pytest.raises(ValueError, match="was released"):
            job.post()
        with pytest.raises(TypeError, match="engine must be an NvlinkEngine"):
            peer.prepare(batch, engine="kernel")
        with pytest.raises(ValueError, match="is outside region"):
            peer.prepare(WriteBatch.of([sorted(src)[0]], [0], [dst_rids[0]], [buf_bytes - 8], [16]))
    finally:
        t.close()
    with pytest.raises(TransportClosed):
        job.post()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_receiver_tells_two_writing_transports_apart(remote):
    """Two nvlink transports of this process write into one receiver: each notification
    reaches it from the transport that posted it."""
    buf_bytes = SLOTS * TOKEN
    pairs = [local_pair(remote, 2, buf_bytes) for _ in range(2)]
    try:
        assert pairs[0][0].name != pairs[1][0].name
        for i, (t, peer, src, dst_rids) in enumerate(pairs * 2):
            batch = kv_batch(sorted(src), dst_rids, 1, False, np.random.default_rng(i))
            remote.fill(dst_rids, 0x5A)
            peer.write(batch, notify=b"from %d" % i).wait(timeout=60)
            check_landed(remote, src, dst_rids, batch, buf_bytes, b"from %d" % i, sender=t.name)
    finally:
        for t, *_ in pairs:
            t.close()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_dead_peer_does_not_hang_the_writer():
    from kvtransfer.benchmarks._remote import RemoteBuffers

    victim = RemoteBuffers(device=1)
    t = None
    try:
        t, peer, src, dst_rids = local_pair(victim, 2, 1 << 20, NvlinkConfig(peer_timeout_s=2.0))
        batch = WriteBatch.of(sorted(src), [0, 4096], dst_rids, [0, 4096], [4096, 4096])
        peer.write(batch, notify=b"alive").wait(timeout=30)
        victim.proc.kill()
        victim.proc.join(timeout=30)
        tr = peer.write(batch, notify=b"dead")
        with pytest.raises(TransferFailed, match="lost"):
            tr.wait(timeout=30)  # a backstop: the peer's loss ends it (peer_timeout_s 2 s)
        assert tr.status() is TransferStatus.FAILED
    finally:
        if t is not None:
            t.close()
        victim.close()


# -- transfer progress: a real mailbox, a stand-in for the CUDA event (no GPU here) -------------


@pytest.fixture
def cpu_peer():
    """A peer's pending queue (FIFO, lock, outbox to a real inbox) without CUDA; its copies time
    out after 30 s (a test of the timeout sets ``transfer_timeout_s`` before it submits)."""
    inbox = _Inbox()
    queue = PendingQueue("cpu-peer", _Outbox(inbox.name, 1.0, sender="cpu-writer"), transfer_timeout_s=30.0)
    yield queue, inbox
    queue.outbox.close()
    inbox.close()


def _submit(queue, notify, event=None):
    return queue.track(NvlinkTransfer(queue, event or _Event(), notify))


def _drain(inbox, want: int, timeout: float = 30.0) -> list[Notification]:
    """What ``inbox`` got until ``want`` notifications came or ``timeout`` passed (a backstop;
    a short one looks for notifications that must not come)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += inbox.poll()
    return got


def test_notification_only_after_the_event_and_in_order(cpu_peer):
    peer, inbox = cpu_peer
    t1, t2 = _submit(peer, b"one"), _submit(peer, b"two")
    t2._event.fired = True
    assert t2.status() is TransferStatus.PENDING  # t1 still runs: nothing may overtake it
    assert _drain(inbox, 1, timeout=0.1) == []
    t1._event.fired = True
    assert t2.status() is TransferStatus.DONE and t1.status() is TransferStatus.DONE
    assert _drain(inbox, 2) == [Notification("cpu-writer", b"one"), Notification("cpu-writer", b"two")]
    t1.wait(timeout=30)


def test_abort_fails_the_transfer_and_suppresses_its_notification(cpu_peer):
    peer, inbox = cpu_peer
    t = _submit(peer, b"aborted")
    t.abort()
    t._event.fired = True
    assert t.status() is TransferStatus.FAILED and t.error == "aborted"
    with pytest.raises(TransferFailed, match="aborted"):
        t.wait(timeout=1)
    assert _drain(inbox, 1, timeout=0.1) == []


def test_the_notification_travels_while_the_copy_runs_and_comes_out_when_it_ends(cpu_peer):
    queue, inbox = cpu_peer
    t = queue.track(NvlinkTransfer(queue, _Event(), b"kv"))
    assert t.status() is TransferStatus.PENDING and t._number == 1
    inbox.read()
    assert len(inbox._conns[0].held) == 1  # at the receiver already
    assert _drain(inbox, 1, timeout=0.2) == []
    t._event.fired = True
    assert t.status() is TransferStatus.DONE
    assert inbox.poll() == [Notification("cpu-writer", b"kv")]  # one poll: the bytes landed before DONE


def test_an_aborted_or_timed_out_copy_never_notifies_and_the_next_one_does(cpu_peer):
    queue, inbox = cpu_peer
    queue.transfer_timeout_s = 0.2
    aborted = queue.track(NvlinkTransfer(queue, _Event(), b"aborted"))
    late = queue.track(NvlinkTransfer(queue, _Event(), b"late"))
    fine = queue.track(NvlinkTransfer(queue, _Event(), b"fine"))
    assert queue.advance() and (aborted._number, late._number, fine._number) == (1, 2, 3)
    aborted.abort()
    fine._event.fired = True
    time.sleep(0.25)  # past the transfer timeout: late fails at its next look
    assert fine.status() is TransferStatus.DONE
    assert aborted.status() is TransferStatus.FAILED and late.status() is TransferStatus.FAILED
    assert "did not complete" in late.error
    late._event.fired = True  # ends after all: its notification stays withdrawn
    assert _drain(inbox, 3, timeout=0.5) == [Notification("cpu-writer", b"fine")]


def test_a_cancelled_transfer_is_pending_until_its_copy_ends_and_never_notifies(cpu_peer):
    """cancel(): the transfer fails at once (its notification withdrawn), but says PENDING while
    its copy, queued on the GPU, may still write into the destination; FAILED ("aborted") once
    the copy's event has completed. A done transfer stays done."""
    queue, inbox = cpu_peer
    cancelled = queue.track(NvlinkTransfer(queue, _Event(), b"cancelled"))
    after = queue.track(NvlinkTransfer(queue, _Event(), b"after"))
    cancelled.cancel()
    assert cancelled.status() is TransferStatus.PENDING
    with pytest.raises(TransferTimeout):
        cancelled.wait(timeout=0.05)
    cancelled._event.fired = True
    assert cancelled.status() is TransferStatus.FAILED and cancelled.error == "aborted"
    after._event.fired = True
    assert after.status() is TransferStatus.DONE
    after.cancel()
    assert after.status() is TransferStatus.DONE
    assert _drain(inbox, 2, timeout=0.5) == [Notification("cpu-writer", b"after")]


def test_a_cancelled_transfer_wait_ends_failed_once_its_copy_ends(cpu_peer):
    queue, _ = cpu_peer
    t = queue.track(NvlinkTransfer(queue, _Event(), b"cancelled"))
    t.cancel()
    threading.Timer(0.05, lambda: setattr(t._event, "fired", True)).start()
    with pytest.raises(TransferFailed, match="aborted"):
        t.wait(timeout=5)
    assert t._event.query()  # it ended before wait() did


def test_failed_transfers_hold_their_tables_until_the_copy_ends(cpu_peer):
    """An aborted or timed-out copy may still be reading its tables on the GPU: they are
    released only once its event completes (or errors), not at the failure."""
    peer, _ = cpu_peer
    tables = [object(), object()]
    running, broken = _Event(), _Event()
    for event in (running, broken):
        t = NvlinkTransfer(peer, event, None, keep=tuple(tables))
        peer.track(t)
        t.abort()
        assert t.status() is TransferStatus.FAILED and t._keep == ()
    assert [k for _, k in peer.buried] == [tuple(tables)] * 2
    broken.error = RuntimeError("illegal memory access")
    peer.advance()
    assert [e for e, _ in peer.buried] == [running]
    running.fired = True
    peer.advance()
    assert peer.buried == []


def test_copy_that_never_completes_fails_after_the_timeout(cpu_peer):
    peer, _ = cpu_peer
    peer.transfer_timeout_s = 0.2
    t = _submit(peer, None)
    with pytest.raises(TransferFailed, match="did not complete within 0.2 s"):
        t.wait(timeout=5)


def test_cuda_error_and_lost_peer_fail_the_transfer(cpu_peer):
    peer, inbox = cpu_peer
    bad = _submit(peer, b"x", _Event(RuntimeError("illegal memory access")))
    assert bad.status() is TransferStatus.FAILED and "illegal memory access" in bad.error
    t = _submit(peer, b"late")
    inbox.close()  # closes its end of the connection before it returns
    t._event.fired = True
    with pytest.raises(TransferFailed, match="lost"):
        t.wait(timeout=5)


# -- the CUDA runtime bindings' hot calls (stand-in runtimes: their return conventions) ----------------


class _CudaError(int):
    """cuda-python's cudaError_t: an int enum (members compared by identity on success)."""

    cudaSuccess = None  # set below
    value = property(int)


_CudaError.cudaSuccess = _CudaError(0)


class _FakeCudaPythonRuntime:
    """cuda-python's runtime module as the hot calls see it: each call returns ``(err, *out)``."""

    cudaError_t = _CudaError

    def __init__(self, fail: int = 0):
        self.calls, self._err = [], _CudaError.cudaSuccess if fail == 0 else _CudaError(fail)

    @staticmethod
    def cudaMemcpyKind(v):
        return ("kind", v)

    def cudaMemcpyAsync(self, *a):
        self.calls.append(("memcpy", *a))
        return (self._err,)

    def cudaEventRecord(self, *a):
        self.calls.append(("record", *a))
        return (self._err,)

    def cudaStreamWaitEvent(self, *a):
        self.calls.append(("wait", *a))
        return (self._err,)

    def cudaGetDevice(self):
        return (self._err, 3)


def _cuda_python_api(rt):
    from transport.nvlink import ipc

    api = object.__new__(ipc._CudaPythonApi)
    api.rt, api.drv = rt, None
    api._success, api._kind_default = rt.cudaError_t.cudaSuccess, rt.cudaMemcpyKind(4)
    return api


def test_cuda_python_hot_calls_pass_their_arguments_and_name_a_failure():
    from transport.nvlink.ipc import CudaIpcError

    rt = _FakeCudaPythonRuntime()
    api = _cuda_python_api(rt)
    api.memcpy_async(0x1000, 0x2000, 64, 7)
    api.event_record("ev", 7)
    api.stream_wait_event(8, "ev")
    assert api.get_device() == 3
    assert rt.calls == [("memcpy", 0x1000, 0x2000, 64, ("kind", 4), 7), ("record", "ev", 7), ("wait", 8, "ev", 0)]
    bad = _cuda_python_api(_FakeCudaPythonRuntime(fail=700))
    with pytest.raises(CudaIpcError, match=r"cudaMemcpyAsync\(0x1000, 0x2000, 64\) failed"):
        bad.memcpy_async(0x1000, 0x2000, 64, 7)
    for call, args in (("event_record", ("ev", 7)), ("stream_wait_event", (8, "ev")), ("get_device", ())):
        with pytest.raises(CudaIpcError, match=r"cuda(EventRecord|StreamWaitEvent|GetDevice) failed"):
            getattr(bad, call)(*args)
