"""The receiving process of the NIXL loopback tests (started with multiprocessing "spawn").

It owns a :class:`NixlTransport` with zeroed regions, sends its export through the pipe, then
loops: poll notifications (which also drives UCX progress) and answer commands. For every
notification it immediately hashes the byte ranges the payload names, so the parent can check
that the data was already in place when the notification was seen.

Notification payload (msgpack): ``[tag, [[region, offset, length], ...]]``.
The pipe carries one frozen dataclass per message: to the parent :class:`Ready`,
:class:`Notified`, :class:`Dumped`, :class:`Exported`, :class:`Refused`, :class:`Paused`, :class:`Bye`; from the
parent :class:`Dump`, :class:`Deregister`, :class:`Register`, :class:`Pause` (until :class:`Resume`),
:class:`Quit`. A deregistered region can be freed (``Deregister.free``): its memory goes back to
the allocator (a 64 MiB one is unmapped), as a pool's would; dumping it afterwards is an error.
:class:`Register` registers a range of a buffer as a new region (a pool laid out again over
memory a deregistered region held).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import msgpack

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm"}


@dataclass(frozen=True)
class Ready:
    export: bytes  # the receiver's transport export


@dataclass(frozen=True)
class Notified:
    sender: str
    payload: bytes
    digest: str  # sha256 of the ranges the payload names, read when the notification arrived


@dataclass(frozen=True)
class Dumped:
    data: bytes  # one whole region


@dataclass(frozen=True)
class Exported:
    export: bytes  # a fresh export (after a deregister)
    digest: str = ""  # sha256 of the region as deregister left it (before any free)
    seconds: float = 0.0  # how long deregister took


@dataclass(frozen=True)
class Refused:
    error: str  # deregister raised: "<exception type>: <message>" (the region stays registered)


@dataclass(frozen=True)
class Bye:
    pass


@dataclass(frozen=True)
class Dump:
    region: int


@dataclass(frozen=True)
class Deregister:
    region: int
    free: bool = False  # release the region's memory once deregistered
    force: bool = False  # deregister(force=True)


@dataclass(frozen=True)
class Register:
    buffer: int  # index of one of the buffers the receiver was started with
    offset: int
    length: int


@dataclass(frozen=True)
class Registered:
    region: int
    export: bytes  # the export naming it


@dataclass(frozen=True)
class Paused:
    pass


@dataclass(frozen=True)
class Pause:
    """Read no notification until the next command, a :class:`Resume` (NIXL's progress thread,
    if on, still runs)."""


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class Quit:
    pass


def payload(tag: int, ranges) -> bytes:
    """Notification payload naming the destination ranges ``[(region, offset, length), ...]``."""
    return msgpack.packb([tag, [[int(r), int(o), int(n)] for r, o, n in ranges]])


def digest(views) -> str:
    h = hashlib.sha256()
    for v in views:
        h.update(memoryview(v))
    return h.hexdigest()


class _Buffers:
    """Zeroed regions on host (numpy) or on one CUDA device (torch), readable as bytes."""

    def __init__(self, sizes, cuda_device):
        self.cuda_device = cuda_device
        if cuda_device is None:
            import numpy as np

            self.arrays = [np.zeros(n, dtype=np.uint8) for n in sizes]  # [n] bytes each
        else:
            import torch

            torch.cuda.set_device(cuda_device)
            self.arrays = [torch.zeros(n, dtype=torch.uint8, device=f"cuda:{cuda_device}") for n in sizes]
            torch.cuda.synchronize()

    def register(self, transport) -> list[int]:
        if self.cuda_device is None:
            return [transport.register(a.ctypes.data, a.nbytes) for a in self.arrays]
        return [transport.register_tensor(t) for t in self.arrays]

    def view(self, index: int, offset: int, length: int) -> int:
        """Append ``length`` bytes of buffer ``index`` from ``offset`` as a buffer of its own; its index."""
        self.arrays.append(self.arrays[index][offset:offset + length])
        return len(self.arrays) - 1

    def free(self, index: int) -> None:
        self.arrays[index] = None  # the only reference: the allocator takes the memory back

    def read(self, index: int, offset: int = 0, length: int | None = None) -> bytes:
        a = self.arrays[index]
        end = len(a) if length is None else offset + length
        if self.cuda_device is None:
            return a[offset:end].tobytes()
        return a[offset:end].cpu().numpy().tobytes()


def serve(conn, sizes, env=None, cuda_device=None, progress_thread=False, staged=None) -> None:
    """``staged``: the receiver's StagedNixlConfig (what lanes it grants), None: the default."""
    for key, value in {**LOOPBACK_ENV, **(env or {})}.items():
        os.environ[key] = value
    from transport.nixl import NixlConfig, NixlTransport

    buffers = _Buffers(sizes, cuda_device)
    config = NixlConfig(progress_thread=progress_thread) if staged is None else \
        NixlConfig(progress_thread=progress_thread, staged=staged)
    with NixlTransport(config) as transport:
        ids = buffers.register(transport)
        conn.send(Ready(transport.export()))
        while True:
            for note in transport.poll_notifications():
                _, ranges = msgpack.unpackb(note.payload)
                got = digest(buffers.read(ids.index(r), o, n) for r, o, n in ranges)
                conn.send(Notified(note.sender, note.payload, got))
            if not conn.poll(0):
                time.sleep(1e-4)
                continue
            cmd = conn.recv()
            if isinstance(cmd, Quit):
                break
            if isinstance(cmd, Dump):
                conn.send(Dumped(buffers.read(ids.index(cmd.region))))
            elif isinstance(cmd, Pause):
                conn.send(Paused())
                resume = conn.recv()  # the owner waits on its pipe alone meanwhile
                if not isinstance(resume, Resume):
                    raise TypeError(f"a paused receiver takes Resume, got {type(resume).__name__}")
            elif isinstance(cmd, Register):
                view = buffers.view(cmd.buffer, cmd.offset, cmd.length)
                a = buffers.arrays[view]
                rid = transport.register(a.ctypes.data, a.nbytes) if buffers.cuda_device is None \
                    else transport.register_tensor(a)
                ids.append(rid)  # ids[i]: the region of buffers.arrays[i]
                conn.send(Registered(rid, transport.export()))
            elif isinstance(cmd, Deregister):
                start = time.monotonic()
                try:
                    transport.deregister(cmd.region, force=cmd.force)
                except Exception as exc:  # RevokeTimeout: reported, the receiver keeps serving
                    conn.send(Refused(f"{type(exc).__name__}: {exc}"))
                    continue
                seconds = time.monotonic() - start
                index = ids.index(cmd.region)
                held = digest([buffers.read(index)])
                if cmd.free:
                    buffers.free(index)
                conn.send(Exported(transport.export(), held, seconds))
            else:
                raise TypeError(f"unknown command {type(cmd).__name__}")
    conn.send(Bye())
