"""``kvtransfer.benchmarks._remote.RemoteBuffers`` with host memory: the receiver of ``bench transfer`` on a CPU."""

from __future__ import annotations

from transport.base import WriteBatch
from kvtransfer.benchmarks._remote import RemoteBuffers, digest, make_transport


def test_host_receiver_writes_digests_frees_and_abandons_a_wait():
    import torch

    remote = RemoteBuffers(None, ("nixl",))
    writer = make_transport("nixl")
    try:
        (rid,) = remote.alloc([4096], 0x5A)
        src = torch.arange(4096, dtype=torch.int64).to(torch.uint8)  # [4096] bytes
        sid = writer.register_tensor(src)
        peer = writer.connect(remote.export()["nixl"])
        remote.start_wait_notify(b"done", 60.0)
        peer.write(WriteBatch.of([sid], [0], [rid], [1024], [2048]), notify=b"done").wait(timeout=60)
        assert remote.result() == writer.name
        want = torch.full((4096,), 0x5A, dtype=torch.uint8)
        want[1024:3072] = src[:2048]
        assert remote.digest([rid]) == [digest(want)]
        # a write that never comes: the wait is abandoned, and the pipe stays in step
        remote.start_wait_notify(b"never", 60.0)
        assert remote.abandon_wait() is None
        remote.fill([rid], 0)
        assert remote.digest([rid]) == [digest(torch.zeros(4096, dtype=torch.uint8))]
        peer.close()
        remote.free([rid])
        assert remote.alloc([64], 1) != [rid]  # ids are never reused
    finally:
        writer.close()
        remote.close()


def test_receiver_stamps_notifications_on_the_hosts_monotonic_clock():
    """``start_stamp_notify``: the arrival of each payload on the monotonic clock this process
    reads too (what ``bench nvlink`` subtracts a write's start from); no GPU needed: the
    notifications go straight into the receiver's nvlink mailbox."""
    import time

    from transport.nvlink import parse_descriptor
    from transport.nvlink.mailbox import Outbox

    remote = RemoteBuffers(None, ("nvlink",))
    try:
        body, _, _ = parse_descriptor(remote.export()["nvlink"])
        out = Outbox(body["mailbox"], 5.0, sender="stamper")
        try:
            remote.start_stamp_notify([b"a", b"b"], 30.0, ("nvlink",))
            t0 = time.monotonic()
            out.send(b"other")  # not asked for: kept for a later wait
            out.send(b"a")
            t1 = time.monotonic()
            out.send(b"b")
            stamps = remote.result()
            t2 = time.monotonic()
            assert set(stamps) == {b"a", b"b"}
            assert stamps[b"a"][0] == stamps[b"b"][0] == "stamper"
            # each arrival after its send, before the result came back, in the order sent
            assert t0 <= stamps[b"a"][1] <= stamps[b"b"][1] <= t2 and t1 <= stamps[b"b"][1]
            assert remote.wait_notify(b"other", 5.0) == "stamper"
        finally:
            out.close()
    finally:
        remote.close()
