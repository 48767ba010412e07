"""The two processes of ``kvtransfer bench transfer`` and the paths it times between them.

A :class:`Rig` is this process (prefill rank 0: the source buffers, one transport per backend)
and a receiver process (decode rank 0: the destination buffers, registered with the same
backends; :class:`~kvtransfer.benchmarks._remote.RemoteBuffers`; in another network namespace
with ``receiver_host``), loaded with the buffers of one
:class:`~._cases.Pools` at a time. Memory
is on GPUs (``src_device`` -> ``dst_device``, the same GPU when there is only one) or in host
memory (both None; nixl backends only).

Every path writes one case's bytes and is verified before it is timed: the destination is
reset to a fill byte, the path writes once with a notification, the receiver waits for it,
and the checksum of every destination buffer (computed in the receiver) must equal the
checksum of the expected buffer (:meth:`~._cases.Case.expected`, built here from the source).
Then it is timed end to end: from the batch to the writer seeing every byte landed, with the
receiver polling its notifications meanwhile (as a decode rank does; UCX needs it to progress).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kvtransfer.batches import BufferRegions, write_batch
from kvtransfer.benchmarks._cases import Case, Pools
from kvtransfer.benchmarks._report import Timing, time_cuda, time_wall
from kvtransfer.benchmarks._remote import RemoteBuffers, checksums, digest, make_transport

__all__ = ["FILL", "PathResult", "Rig", "ucx_env"]

FILL = 0x5A  # the destination's bytes before each verified write
WAIT_S = 600.0  # one write of up to tens of GiB through the slowest path
COPY_CHUNK = 1 << 30  # the link baseline copies the case's byte count in pieces of at most this
HOST_TLS = "tcp,self,sm"
CUDA_TLS = HOST_TLS + ",cuda_copy,cuda_ipc"


def ucx_env(gpu: bool) -> None:
    """UCX settings of one host's two processes, before any NIXL agent starts (the receiver
    inherits them): loopback, and UCX's CUDA transports when the buffers are on GPUs. Values
    already set are kept, except that GPU memory adds ``cuda_copy,cuda_ipc`` to ``UCX_TLS``."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    tls = os.environ.setdefault("UCX_TLS", CUDA_TLS if gpu else HOST_TLS)
    if gpu and "cuda_ipc" not in tls:
        os.environ["UCX_TLS"] = tls + ",cuda_copy,cuda_ipc"


@dataclass
class PathResult:
    """One path on one case. ``status``: "ok", "skipped" (``reason`` says why) or "failed"."""

    path: str
    status: str
    reason: str = ""
    nbytes: int = 0
    entries: int = 0  # ranges the path hands its engine (descriptors for NIXL, rows for NVLink)
    verified: bool = False
    timing: Optional[Timing] = None
    prep: Optional[Timing] = None  # host work before the write: planning, or building descriptors
    extra: dict = field(default_factory=dict)


class Rig:
    """The writer (this process) and the receiver: transports and the receiver process live for
    the whole run; :meth:`load` gives both sides the buffers of one :class:`Pools` (replacing
    the previous ones)."""

    def __init__(self, backends: tuple, src_device: Optional[int], dst_device: Optional[int], receiver_host=None):
        import torch

        self.torch, self.backends = torch, backends
        self.src_device, self.dst_device = src_device, dst_device
        self.device = torch.device("cpu") if src_device is None else torch.device("cuda", src_device)
        ucx_env(gpu=src_device is not None)
        if src_device is not None:
            torch.cuda.set_device(self.device)
        self.remote = RemoteBuffers(dst_device, backends, host=receiver_host)
        self.transports, self.peers, self.pools = {}, {}, None
        self._awaiting = False  # a notification wait of the receiver is outstanding
        try:
            self.transports = {b: make_transport(b) for b in backends}
        except BaseException:
            self.close()
            raise

    def load(self, pools: Pools, seed: int) -> None:
        """Random source buffers and fill-byte destination buffers of ``pools``, registered with
        every backend on each side, and the peers connected to them."""
        self.unload()
        kv, state = pools.sizes("dst")
        ids = self.remote.alloc(kv + state, FILL)
        self.pools = pools
        self.dst_ids = np.asarray(ids, dtype=np.int64)
        self.dst_sizes = np.asarray(kv + state, dtype=np.int64)
        self.dst = BufferRegions.of(ids[:len(kv)], ids[len(kv):])
        kv, state = pools.sizes("src")
        self.src_bufs, src_ids = [], []
        for i, n in enumerate(kv + state):
            t = self._random(n, seed * 100_003 + i)  # [n] bytes
            rids = {tr.register_tensor(t) for tr in self.transports.values()}
            if len(rids) > 1:
                raise RuntimeError(f"backends gave one buffer different region ids {rids}")
            self.src_bufs.append(t)
            src_ids.append(rids.pop() if rids else i)  # no backend: only the link runs
        self.src = BufferRegions.of(src_ids[:len(kv)], src_ids[len(kv):])
        exports = self.remote.export()
        self.peers = {b: self.transports[b].connect(exports[b]) for b in self.backends}

    def unload(self) -> None:
        """Forget the loaded buffers: peers closed first (nothing names the receiver's buffers
        any more), then both sides deregister and drop them."""
        if self.pools is None:
            return
        for peer in self.peers.values():
            peer.close()
        self.peers = {}
        for rid in self.src.kv.tolist() + self.src.state.tolist():
            for tr in self.transports.values():
                tr.deregister(rid)
        self.src_bufs = []
        self.remote.free(self.dst_ids)
        self.pools = None

    # -- verification ------------------------------------------------------------------------
    def expected_checksums(self, case: Case) -> list:
        """The fingerprint of every destination buffer as it must be after ``case``'s write:
        SHA-256 in host memory, a position-weighted checksum on GPUs (computed where the bytes are)."""
        out = []
        for i, rid in enumerate(self.dst_ids):
            want = case.expected(self.src_bufs, FILL, i)
            if self.src_device is None:
                out.append(digest(want))
            else:
                out += checksums({int(rid): want}, np.array([rid]), np.array([0]), np.array([want.numel()]))
        return out

    def landed(self, expect: list) -> bool:
        """Whether every destination buffer matches ``expect`` (:meth:`expected_checksums`)."""
        if self.src_device is None:
            return self.remote.digest(self.dst_ids) == expect
        return self.remote.checksum(self.dst_ids, np.zeros_like(self.dst_ids), self.dst_sizes) == expect

    def _random(self, n: int, seed: int):
        """``n`` random bytes on this side's device (numpy's generator on the host: torch's is slow there)."""
        torch = self.torch
        if self.src_device is None:
            return torch.from_numpy(np.frombuffer(bytearray(np.random.default_rng(seed).bytes(n)), dtype=np.uint8))
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return torch.empty(n, dtype=torch.uint8, device=self.device).random_(0, 256, generator=gen)

    # -- paths -------------------------------------------------------------------------------
    def run_write(self, name: str, write: Callable[[Optional[bytes]], list], expect: list, repeats: int,
                  budget_s: float) -> tuple:
        """Verify, then time, ``write(notify)`` (which starts the path's transfers and returns
        them). A verified write that took ``budget_s`` or longer is the one timed sample.
        Returns ``(verified, timing or None, reason)``."""
        self.remote.fill(self.dst_ids, FILL)
        tag = f"verify {name}".encode()
        self._start_wait(tag)
        t0 = time.perf_counter()
        with self._waiting():
            for t in write(tag):
                t.wait(timeout=WAIT_S)
        first = time.perf_counter() - t0
        sender = self._end_wait("the verified write's notification")
        if sender is None:
            return False, None, "its notification never arrived"
        if not self.landed(expect):
            return False, None, "the destination differs from the expected bytes"
        if first >= budget_s:  # a slow path on a long prompt: its verified write is its one sample
            return True, Timing((first,)), ""
        rep = b"timed"

        def once():
            for t in write(rep):
                t.wait(timeout=WAIT_S)

        with self._waiting():
            timing = time_wall(once, repeats, budget_s=budget_s, before=lambda: self._start_wait(rep),
                               after=lambda: self._end_wait("a timed write's notification"))
        return True, timing, ""

    # The receiver polls (UCX progress; a staged NIXL receiver scatters) while a write runs: it
    # waits for the write's notification. A write that fails leaves that wait to be abandoned.
    def _start_wait(self, tag: bytes) -> None:
        self.remote.start_wait_notify(tag, WAIT_S)
        self._awaiting = True

    def _end_wait(self, what: str):
        self._awaiting = False
        return self.remote.result(what)

    @contextlib.contextmanager
    def _waiting(self):
        """On an exception inside, end the receiver's wait so that its pipe is in step again."""
        try:
            yield
        except BaseException:
            if self._awaiting:
                self._awaiting = False
                self.remote.abandon_wait()
            raise

    def nixl_writer(self, backend: str, batches: list) -> Callable:
        peer = self.peers[backend]

        def write(notify):
            return [write_batch(peer, b, notify if i == len(batches) - 1 else None) for i, b in enumerate(batches)]

        return write

    def nvlink_writer(self, engine, batches: list) -> tuple:
        """A writer through the nvlink peer with ``engine``, and the engine it actually took:
        the kernel engine writes a StridedBatch as kvtransfer does, ``write_strided`` (its
        direct path: resident pair tables), where the peer takes ``engine=``; other
        batches and engines through prepared jobs (prepared per write, as a request is)."""
        from transport.base import StridedBatch

        peer = self.peers["nvlink"]
        with peer.prepare(batches[0], engine=engine) as job:
            took = job.engine
        direct = engine.value == "kernel" and hasattr(peer, "pair_plans")

        def write(notify):
            out = []
            for i, b in enumerate(batches):
                note = notify if i == len(batches) - 1 else None
                if direct and isinstance(b, StridedBatch):
                    out.append(peer.write_strided(b, note, engine=engine))
                    continue
                with peer.prepare(b, engine=engine) as j:
                    out.append(j.post(note))
            return out

        return write, took

    def link(self, nbytes: int, repeats: int, budget_s: float) -> tuple:
        """The link baseline over ``nbytes``: a memcpy in host memory, else torch's copy from the
        source GPU to the destination GPU (a device-to-device copy when they are one GPU), in
        pieces of at most ``COPY_CHUNK``. Returns ``(verified, timing)``."""
        torch = self.torch
        chunk = min(nbytes, COPY_CHUNK)
        a = self._random(chunk, 7)
        if self.src_device is None:
            b = torch.empty(chunk, dtype=torch.uint8)
            an, bn = a.numpy(), b.numpy()

            def copy():
                left = nbytes
                while left:
                    n = min(left, chunk)
                    np.copyto(bn[:n], an[:n])  # one memcpy
                    left -= n

            copy()
            return bool(torch.equal(a, b)), time_wall(copy, repeats, budget_s=budget_s)
        b = torch.empty(chunk, dtype=torch.uint8, device=torch.device("cuda", self.dst_device))

        def copy():
            left = nbytes
            while left:
                n = min(left, chunk)
                b[:n].copy_(a[:n], non_blocking=True)
                left -= n

        copy()
        torch.cuda.synchronize(self.device)
        torch.cuda.synchronize(b.device)
        ok = bool(torch.equal(a.to(b.device), b))
        return ok, time_cuda(copy, repeats, warmup=1)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        for tr in self.transports.values():
            tr.close()
        self.remote.close()
