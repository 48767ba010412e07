"""``transport.remote.RemoteBuffers`` with host memory: the receiver of ``bench transfer`` on a CPU."""

from __future__ import annotations

from transport.base import WriteBatch
from transport.remote import RemoteBuffers, digest, make_transport


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
