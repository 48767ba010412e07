"""A writing process for the revocation tests (started with multiprocessing "spawn").

It owns a writing transport (``backend``: ``nixl``, host memory; ``nvlink``, its source on
CUDA ``device``; ``nvlink-cpu``, the nvlink mailbox with stand-in copies,
:class:`tests.transport.nvlink._nvlink_cpu.CpuWriter`) with one source region of seeded random
bytes, connects to the export the parent sends and writes what it is told. Between commands it either
keeps calling its transport (``Idle(pump=True)``: ``poll_notifications`` and the status of its
pending writes, as a live serving process does) or only waits on its pipe (``pump=False``: a
NIXL holder that does not answer revokes; an nvlink one still does, from its mailbox thread).
A pending write's end is reported when it comes.

The pipe carries one frozen dataclass per message: from the parent :class:`Connect`,
:class:`Write`, :class:`Idle`, :class:`AwaitRefusal`, :class:`ClosePeer`, :class:`Quit`; to the parent :class:`Ready`,
:class:`Connected`, :class:`Idling` (an Idle taken: from now on it pumps, or not), :class:`Posted` (a
write started, or refused at once), :class:`Refusing` (the answer to AwaitRefusal),
:class:`Finished` (a pending write ended), :class:`Bye`.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

import numpy as np

from tests.transport._nixl_peer import LOOPBACK_ENV


def source_bytes(seed: int, nbytes: int) -> np.ndarray:
    """The writer's source region: ``nbytes`` random bytes of ``seed`` (what a write copies)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)  # [nbytes]


@dataclass(frozen=True)
class Ready:
    name: str  # the writer transport's name (its agent)


@dataclass(frozen=True)
class Connect:
    export: bytes


@dataclass(frozen=True)
class Connected:
    pass


@dataclass(frozen=True)
class Write:
    tag: int
    region: int  # the owner's region id
    offset: int  # byte offset in it (the source is read from byte 0)
    length: int
    delay_s: float = 0.0  # nvlink: the copy starts this long after the post; nvlink-cpu: the stand-in ends then
    notify: bytes = b""  # the write's notification (none when empty)
    hold_gil_s: int = 0  # after the post, hold the GIL this many seconds (one C call) before answering


@dataclass(frozen=True)
class Posted:
    tag: int
    status: str  # TransferStatus name right after the post, or "RAISED"
    error: str  # the transfer's error, or "<exception type>: <message>" when write() raised


@dataclass(frozen=True)
class Finished:
    tag: int
    status: str  # DONE or FAILED
    error: str


@dataclass(frozen=True)
class Idle:
    pump: bool  # keep calling the transport between commands


@dataclass(frozen=True)
class Idling:
    pass


@dataclass(frozen=True)
class AwaitRefusal:
    """Call the transport until a write into ``region`` of the connected owner would be
    refused (what the owner told this side was read: NIXL only), at most ``timeout_s``."""
    region: int
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Refusing:
    why: str  # why a write would be refused; empty: not within the timeout


@dataclass(frozen=True)
class ClosePeer:
    pass


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class Bye:
    pass


def _open(backend: str, src: np.ndarray, device):
    """(the writing transport, its source region id, what must outlive the transport)."""
    if backend == "nixl":
        from transport.nixl import NixlConfig, NixlTransport
        from transport.nixl.staged import StagedNixlConfig

        transport = NixlTransport(NixlConfig(staged=StagedNixlConfig(enabled=False)))
        return transport, transport.register(src.ctypes.data, src.nbytes), src
    if backend == "nvlink":
        import torch

        from transport.nvlink import NvlinkTransport

        torch.cuda.set_device(device)
        buf = torch.from_numpy(src).to(f"cuda:{device}")  # [nbytes]
        transport = NvlinkTransport()
        return transport, transport.register_tensor(buf), buf
    if backend == "nvlink-cpu":
        from tests.transport.nvlink._nvlink_cpu import CpuWriter

        transport = CpuWriter()
        return transport, transport.register(src.ctypes.data, src.nbytes), src
    raise ValueError(f"unknown backend {backend!r}")


def _delay(backend: str, transport, seconds: float) -> None:
    """The next copy starts ``seconds`` after its post (nvlink: a kernel that spins that long on
    the current stream, which the copy stream waits for); a stand-in copy ends then."""
    if backend == "nvlink-cpu":
        transport.copy_s = seconds
        return
    if not seconds:
        return
    if backend != "nvlink":
        raise ValueError(f"a delayed copy needs the nvlink backend, not {backend!r}")
    from tests.transport._support import gpu_sleep  # not at the top: _support imports this module

    gpu_sleep(seconds)


def _await_refusal(transport, owner: str, cmd: AwaitRefusal) -> str:
    deadline = time.monotonic() + cmd.timeout_s
    while time.monotonic() < deadline:
        transport.poll_notifications()
        why = transport._core.holds.check(owner, np.array([cmd.region], dtype=np.int64))
        if why is not None:
            return why
        time.sleep(1e-3)
    return ""


def serve(conn, seed: int, nbytes: int, env=None, backend: str = "nixl", device=None) -> None:
    for key, value in {**LOOPBACK_ENV, **(env or {})}.items():
        os.environ[key] = value
    from transport.base import TransferStatus, WriteBatch

    transport, sid, keep = _open(backend, source_bytes(seed, nbytes), device)
    with transport:
        conn.send(Ready(transport.name))
        peer, pending, pump = None, {}, True
        while True:
            if pump:
                transport.poll_notifications()
                for tag, tr in list(pending.items()):
                    if tr.status() is not TransferStatus.PENDING:
                        conn.send(Finished(tag, tr.status().name, tr.error or ""))
                        del pending[tag]
                if not conn.poll(1e-3):
                    continue
            cmd = conn.recv()
            if isinstance(cmd, Quit):
                break
            if isinstance(cmd, Idle):
                pump = cmd.pump
                conn.send(Idling())
            elif isinstance(cmd, Connect):
                peer = transport.connect(cmd.export)
                conn.send(Connected())
            elif isinstance(cmd, AwaitRefusal):
                conn.send(Refusing(_await_refusal(transport, peer.name, cmd)))
            elif isinstance(cmd, ClosePeer):
                peer.close()
                conn.send(Connected())
            elif isinstance(cmd, Write):
                _delay(backend, transport, cmd.delay_s)
                try:
                    tr = peer.write(WriteBatch.of([sid], [0], [cmd.region], [cmd.offset], [cmd.length]),
                                    notify=cmd.notify or None)
                except Exception as exc:
                    conn.send(Posted(cmd.tag, "RAISED", f"{type(exc).__name__}: {exc}"))
                    continue
                if cmd.hold_gil_s:
                    ctypes.PyDLL(None).sleep(cmd.hold_gil_s)  # libc's sleep(3), called with the GIL held
                conn.send(Posted(cmd.tag, tr.status().name, tr.error or ""))
                pending[cmd.tag] = tr
            else:
                raise TypeError(f"unknown command {type(cmd).__name__}")
    del keep
    conn.send(Bye())
