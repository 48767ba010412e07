"""Helpers shared by the transport tests (fixtures are in conftest.py).

- :func:`assert_interpreted_ok`: run a script under Triton's interpreter in a fresh Python;
- :class:`Receiver`: the NIXL loopback receiver process (``_nixl_peer.serve``) and its pipe;
- :class:`Writer`: a writer process (``_writer.serve``: NIXL over loopback, nvlink, or nvlink's
  mailbox with stand-in copies) and its pipe;
- byte references: :func:`assert_same`, :func:`entries`;
- the two-GPU helpers: KV-shaped batches (:func:`kv_batch`, :func:`kv_strided`), a local
  nvlink transport connected to a :class:`~kvtransfer.benchmarks._remote.RemoteBuffers`
  (:func:`local_pair`), the check that a write landed (:func:`write_landed`) and a copy held
  back on the GPU (:func:`gpu_sleep`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvtransfer._procs import exit_text
from tests.transport import _nixl_peer, _writer
from transport.base import StridedBatch, TransferStatus, WriteBatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# -- Triton's interpreter ------------------------------------------------------------------------


def run_interpreted(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``script`` under Triton's interpreter, from the repository root; stdout and stderr as text."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# Triton <= 3.6's interpreter under NumPy 2 cannot bound range() by a tensor (int() of a
# 1-element array); Triton 3.9 can. A script that meets it cannot say anything about the kernel.
_INTERPRETER_LIMIT = "only 0-dimensional arrays can be converted"


def assert_interpreted_ok(script: str, marker: str) -> None:
    """Run ``script`` under the interpreter and require ``marker`` in its output; skip when this
    Triton's interpreter cannot run the kernel's loop at all."""
    out = run_interpreted(script)
    if _INTERPRETER_LIMIT in out.stderr:
        pytest.skip("this Triton's interpreter cannot bound range() by a tensor under this NumPy (fixed in 3.9)")
    assert marker in out.stdout, out.stdout + out.stderr


# -- byte references --------------------------------------------------------------------------------


def assert_same(got, want, what):
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at {bad[0]} (got {got[bad[0]]}, want {want[bad[0]]})")


def entries(b: StridedBatch) -> list[tuple]:
    """Reference: a strided batch's flat entries, by two plain loops (pair-major)."""
    out = []
    for p in range(b.num_pairs):
        for s in range(b.num_slots):
            out.append((int(b.src_region[p]), int(b.src_offset[p] + b.src_slot[s] * b.src_stride[p]),
                        int(b.dst_region[p]), int(b.dst_offset[p] + b.dst_slot[s] * b.dst_stride[p]),
                        int(b.length[p])))
    return out


# -- the NIXL receiver process ------------------------------------------------------------------------


def _next_message(proc, conn, who: str, kind, timeout: float, pump, take):
    """The next message of type ``kind`` (a type or a tuple of them) from a child process;
    ``take(msg)`` keeps what it collects (True: not the answer). ``pump()`` (a local transport's
    ``poll_notifications``: a side answers revokes only while it is called) runs between polls."""
    deadline = time.monotonic() + timeout
    names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    while time.monotonic() < deadline:
        if pump is not None:
            pump()
        if conn.poll(0 if pump is not None else 0.05):
            msg = conn.recv()
            if take(msg):
                continue
            if not isinstance(msg, kind):
                raise AssertionError(f"expected {names} from the {who}, got {msg!r:.200}")
            return msg
        if not proc.is_alive() and not conn.poll(0):
            raise AssertionError(f"{who} died before its {names} ({exit_text(proc)})")
        if pump is not None:
            time.sleep(1e-3)
    raise AssertionError(f"no {names} from the {who} within {timeout} s ({exit_text(proc)})")


class Receiver:
    """A spawned NIXL receiver process and its pipe; notifications are collected as they come:
    ``notes`` holds (payload, digest seen at arrival), ``senders`` the sender of each."""

    def __init__(self, sizes, env=None, cuda_device=None, staged=None, progress_thread=False):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_nixl_peer.serve, args=(child, list(sizes)),
            kwargs={"env": env, "cuda_device": cuda_device, "staged": staged, "progress_thread": progress_thread},
        )
        self.proc.start()
        child.close()
        self.notes: list[tuple[bytes, str]] = []
        self.senders: list[str] = []
        self.export = self._expect(_nixl_peer.Ready, 60.0).export

    def _take(self, msg) -> bool:
        if not isinstance(msg, _nixl_peer.Notified):
            return False
        self.senders.append(msg.sender)
        self.notes.append((msg.payload, msg.digest))
        return True

    def _expect(self, kind, timeout, pump=None):
        """The next message of type ``kind`` (a type or a tuple of them); notifications are
        collected meanwhile and ``pump()`` (a local transport's ``poll_notifications``: a
        writer answers the receiver's revokes only while it is called) runs between polls."""
        return _next_message(self.proc, self.conn, "receiver", kind, timeout, pump, self._take)

    def wait_notes(self, count, timeout=30.0):
        deadline = time.monotonic() + timeout
        while len(self.notes) < count and time.monotonic() < deadline:
            if self.conn.poll(0.05):
                self._take(self.conn.recv())
            elif not self.proc.is_alive() and not self.conn.poll(0):
                raise AssertionError(f"receiver died after {len(self.notes)} of {count} notifications "
                                     f"({exit_text(self.proc)})")
        assert len(self.notes) >= count, f"{len(self.notes)} of {count} notifications within {timeout} s"
        return self.notes

    def pause(self) -> None:
        """The receiver reads no notification from now until :meth:`resume` (its owner waits on
        its pipe)."""
        self.conn.send(_nixl_peer.Pause())
        self._expect(_nixl_peer.Paused, 30.0)

    def resume(self) -> None:
        self.conn.send(_nixl_peer.Resume())

    def dump(self, region) -> np.ndarray:
        self.conn.send(_nixl_peer.Dump(region))
        return np.frombuffer(self._expect(_nixl_peer.Dumped, 30.0).data, dtype=np.uint8)

    def deregister(self, region, pump=None, free=False, force=False, timeout=30.0) -> bytes:
        """The receiver deregisters ``region`` (and frees it: ``free``); its fresh export.
        ``pump``: what keeps the local writers answering meanwhile (see :meth:`_expect`)."""
        msg = self.deregistered(region, pump, free, force, timeout)
        if isinstance(msg, _nixl_peer.Refused):
            raise AssertionError(f"the receiver could not deregister region {region}: {msg.error}")
        return msg.export

    def deregistered(self, region, pump=None, free=False, force=False, timeout=30.0):
        """Deregister as :meth:`deregister`; the receiver's answer: ``Exported`` (with the
        region's digest as deregister left it and how long it took) or ``Refused``."""
        self.conn.send(_nixl_peer.Deregister(region, free, force))
        return self._expect((_nixl_peer.Exported, _nixl_peer.Refused), timeout, pump)

    def register(self, buffer: int, offset: int, length: int) -> tuple[int, bytes]:
        """The receiver registers ``length`` bytes of its buffer ``buffer`` from ``offset`` as a
        new region; ``(region id, fresh export)``."""
        self.conn.send(_nixl_peer.Register(buffer, offset, length))
        msg = self._expect(_nixl_peer.Registered, 30.0)
        return msg.region, msg.export

    def stop(self):
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # in case a test stopped it
                self.conn.send(_nixl_peer.Quit())
                self._expect(_nixl_peer.Bye, 10.0)
            except (AssertionError, OSError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class Writer:
    """A spawned writer process (:mod:`tests.transport._writer`, of ``backend`` on CUDA
    ``device``) and its pipe.

    Every wait takes ``pump``, the local owner transport's ``poll_notifications``: the owner
    records the writer's hold and answers in its calls, so it must be called meanwhile."""

    def __init__(self, seed: int, nbytes: int, env=None, backend: str = "nixl", device=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_writer.serve, args=(child, seed, nbytes),
                                kwargs={"env": env, "backend": backend, "device": device})
        self.proc.start()
        child.close()
        self.source = _writer.source_bytes(seed, nbytes)
        self.finished: dict[int, _writer.Finished] = {}
        self.name = self.expect(_writer.Ready, 60.0).name

    def expect(self, kind, timeout=30.0, pump=None):
        """The next message of type ``kind``; ``Finished`` reports are collected meanwhile."""
        def take(msg) -> bool:
            if isinstance(msg, _writer.Finished) and kind is not _writer.Finished:
                self.finished[msg.tag] = msg
                return True
            return False

        return _next_message(self.proc, self.conn, "writer", kind, timeout, pump, take)

    def connect(self, export: bytes, pump=None) -> None:
        self.conn.send(_writer.Connect(export))
        self.expect(_writer.Connected, pump=pump)

    def write(self, tag: int, region: int, offset: int, length: int, pump=None,
              delay_s: float = 0.0, notify: bytes = b"") -> "_writer.Posted":
        """Start a write (its first one waits for the owner's hold acknowledgement: ``pump``;
        ``delay_s``: nvlink's copy starts that long after the post; ``notify``: its
        notification)."""
        self.conn.send(_writer.Write(tag, region, offset, length, delay_s, notify))
        return self.expect(_writer.Posted, pump=pump)

    def wait_finished(self, tag: int, timeout=30.0, pump=None) -> "_writer.Finished":
        deadline = time.monotonic() + timeout
        while tag not in self.finished:
            msg = self.expect(_writer.Finished, max(0.0, deadline - time.monotonic()), pump)
            self.finished[msg.tag] = msg
        return self.finished[tag]

    def idle(self, pump: bool) -> None:
        """From its answer on the writer calls its transport between commands (``pump``), or
        only waits on its pipe."""
        self.conn.send(_writer.Idle(pump))
        self.expect(_writer.Idling)

    def await_refusal(self, region: int) -> str:
        """Once the writer has read what makes it refuse a write into ``region`` (NIXL): why."""
        self.conn.send(_writer.AwaitRefusal(region))
        why = self.expect(_writer.Refusing, 60.0).why
        assert why, f"the writer would still write into region {region}"
        return why

    def close_peer(self, pump=None) -> None:
        self.conn.send(_writer.ClosePeer())
        self.expect(_writer.Connected, pump=pump)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.conn.send(_writer.Quit())
                self.expect(_writer.Bye, 10.0)
            except (AssertionError, OSError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def connect_once_drained(transport, export: bytes, timeout: float = 20.0):
    """``transport.connect(export)``, retried while the lost peer's failed requests still run in
    NIXL (connect refuses until they are done: they finish once the receiver runs again)."""
    from transport.base import TransportError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return transport.connect(export)
        except TransportError:
            assert time.monotonic() < deadline, "the failed requests never left NIXL"
            time.sleep(0.05)


# -- two processes on two GPUs ------------------------------------------------------------------------

HEADS, HEAD_DIM, LAYERS, SLOTS = 8, 128, 32, 256
TOKEN = HEADS * HEAD_DIM * 2  # bytes of one bf16 token row


def gpu_sleep(seconds: float) -> None:
    """Queue a kernel that spins about ``seconds`` on the current stream (an nvlink copy stream
    waits for it: the next write's copy starts that much later)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    torch.cuda._sleep(int(10**7 * seconds * 1e3 / start.elapsed_time(end)))


def local_pair(remote, num_bufs, buf_bytes, config=None):
    """A transport on cuda:0 with random source buffers, connected to fresh remote buffers."""
    import torch

    from transport.nvlink import NvlinkTransport

    torch.cuda.set_device(0)
    t = NvlinkTransport(config)
    src = {}
    for _ in range(num_bufs):
        buf = torch.randint(0, 256, (buf_bytes,), dtype=torch.uint8, device="cuda:0")
        src[t.register_tensor(buf)] = buf
    dst_rids = remote.alloc([buf_bytes] * num_bufs, 0x5A)
    peer = t.connect(remote.export()["nvlink"])
    return t, peer, src, dst_rids


def check_landed(remote, src, dst_rids, batch, buf_bytes, tag, sender=None):
    """Notification first (from ``sender`` when given), then every byte of every destination
    buffer against a reference."""
    got_sender = remote.wait_notify(tag, 60.0)
    assert got_sender is not None, "notification did not arrive"
    assert sender is None or got_sender == sender, f"notification from {got_sender!r}, expected {sender!r}"
    got = dict(zip(dst_rids, remote.fetch(dst_rids)))
    want = {r: np.full(buf_bytes, 0x5A, dtype=np.uint8) for r in dst_rids}
    host = {r: b.cpu().numpy() for r, b in src.items()}
    for sr, so, dr, do, n in zip(batch.src_region, batch.src_offset, batch.dst_region, batch.dst_offset, batch.length):
        want[dr][do:do + n] = host[sr][so:so + n]
    for r in dst_rids:
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"destination region {r}")


def kv_batch(src_rids, dst_rids, page_size, head_slice, rng, tokens=64):
    """Rows for the K and V buffers of LAYERS layers: whole pages, or one head per token
    (head h -> head 7 - h, so no two rows are adjacent on both sides)."""
    src_rids, dst_rids = np.asarray(src_rids), np.asarray(dst_rids)
    if head_slice:
        s = rng.choice(np.arange(1, SLOTS), tokens, replace=False)
        d = rng.choice(np.arange(1, SLOTS), tokens, replace=False)
        h = np.arange(HEADS)
        so = (s[:, None] * TOKEN + h[None, :] * HEAD_DIM * 2).ravel()
        do = (d[:, None] * TOKEN + (HEADS - 1 - h)[None, :] * HEAD_DIM * 2).ravel()
        row = HEAD_DIM * 2
    else:
        pages = SLOTS // page_size
        k = max(1, min(tokens // page_size, pages - 1))
        so = rng.choice(np.arange(1, pages), k, replace=False) * page_size * TOKEN
        do = rng.choice(np.arange(1, pages), k, replace=False) * page_size * TOKEN
        row = page_size * TOKEN
    m = so.size
    return WriteBatch.of(
        np.repeat(src_rids, m), np.tile(so, src_rids.size), np.repeat(dst_rids, m), np.tile(do, dst_rids.size),
        np.full(m * src_rids.size, row),
    )


def kv_strided(src_rids, dst_rids, page_size, head_slice, rng, tokens=64) -> StridedBatch:
    """K and V of LAYERS layers as pairs x slots, a slot per page. Whole pages: a pair per
    buffer. Head slices: a pair per (buffer, token in page, head h) copying head h of the
    token into head 7 - h of the destination token."""
    src_rids, dst_rids = np.asarray(src_rids), np.asarray(dst_rids)
    pages = SLOTS // page_size
    k = max(1, min(tokens // page_size, pages - 1))
    slots = (rng.choice(np.arange(1, pages), k, replace=False), rng.choice(np.arange(1, pages), k, replace=False))
    page = page_size * TOKEN
    if not head_slice:
        return StridedBatch.of(src_rids, 0, page, dst_rids, 0, page, page, *slots)
    hb = HEAD_DIM * 2
    tok, h = np.meshgrid(np.arange(page_size), np.arange(HEADS), indexing="ij")  # [page_size, HEADS]
    so = (tok * TOKEN + h * hb).ravel()
    do = (tok * TOKEN + (HEADS - 1 - h) * hb).ravel()
    return StridedBatch.of(np.repeat(src_rids, so.size), np.tile(so, src_rids.size), page,
                           np.repeat(dst_rids, do.size), np.tile(do, dst_rids.size), page, hb, *slots)


def write_landed(remote, peer, src, dst_rids, batch, buf_bytes, tag: bytes) -> None:
    """Write ``batch`` (a WriteBatch, or a StridedBatch through ``write_strided``) with
    notification ``tag``, wait for it, check the bytes on the receiver."""
    strided = isinstance(batch, StridedBatch)
    tr = (peer.write_strided if strided else peer.write)(batch, notify=tag)
    tr.wait(timeout=60)
    assert tr.status() is TransferStatus.DONE
    check_landed(remote, src, dst_rids, batch.expand() if strided else batch, buf_bytes, tag)


def split_deadline(config: dict) -> dict:
    """Take a test's ``peer_loss_timeout_s`` out of a transport's ``config``: the transport is
    made and warmed up with the default deadline (on a loaded machine a warm-up write can take
    longer than a deadline of a second), and :func:`use_deadline` gives it the test's own for
    the writes the test stalls."""
    return {k: config.pop(k) for k in ("peer_loss_timeout_s",) if k in config}


def use_deadline(transport, deadline: dict) -> None:
    """From now on ``transport``'s transfers get ``deadline`` (from :func:`split_deadline`)."""
    transport.config = dataclasses.replace(transport.config, **deadline)
