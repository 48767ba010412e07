"""What the NIXL tests share: a tcp-only UCX setting, batches, seeded host regions, digests,
the reference of a batch's destination bytes and a stopped receiver continued later."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import numpy as np

from transport.base import TransferStatus, WriteBatch

# Over tcp alone a write is asynchronous (with sm, UCX's cma copy finishes inside the post),
# which the abort / stall / kill tests need to catch a transfer in flight.
TCP_ONLY = {"UCX_TLS": "tcp,self"}


def wb(src_region, src_offset, dst_region, dst_offset, length) -> WriteBatch:
    """A WriteBatch with scalars broadcast against the arrays."""
    arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in
                                   (src_region, src_offset, dst_region, dst_offset, length)))
    return WriteBatch.of(*arrays)


def host_region(transport, nbytes, seed):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)  # [nbytes]
    return data, transport.register(data.ctypes.data, data.nbytes)


def sha(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c.tobytes())
    return h.hexdigest()


def reference(srcs, dst_sizes, entries):
    """What the destination regions must hold: zeros, then each entry's source bytes."""
    out = [np.zeros(n, np.uint8) for n in dst_sizes]
    for sr, so, dr, do, n in zip(*entries):
        out[dr][do : do + n] = srcs[sr][so : so + n]
    return out


def resumed_later(rx, delay=0.3) -> threading.Timer:
    """Continue the stopped receiver after ``delay`` s (abort() waits for it meanwhile); the
    timer's ``continued`` is set just before the SIGCONT: an abort() that returns before it is
    set returned while the receiver was still stopped."""
    continued = threading.Event()

    def resume():
        continued.set()
        os.kill(rx.proc.pid, signal.SIGCONT)

    timer = threading.Timer(delay, resume)
    timer.continued = continued
    timer.start()
    return timer


def until_ended(tr, what: str, timeout_s: float = 20.0) -> None:
    """Poll ``tr.status()`` until the transfer is no longer PENDING; fail naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while tr.status() is TransferStatus.PENDING:
        assert time.monotonic() < deadline, f"{what} never ended"
        time.sleep(0.001)
