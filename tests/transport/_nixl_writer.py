"""A writing NIXL process for the revocation tests (started with multiprocessing "spawn").

It owns a :class:`NixlTransport` with one host source region of seeded random bytes, connects
to the export the parent sends and writes what it is told. Between commands it either keeps
calling its transport (``Idle(pump=True)``: ``poll_notifications`` and the status of its
pending writes, as a live serving process does) or only waits on its pipe (``pump=False``: a
holder that does not answer revokes). A pending write's end is reported when it comes.

The pipe carries one frozen dataclass per message: from the parent :class:`Connect`,
:class:`Write`, :class:`Idle`, :class:`ClosePeer`, :class:`Quit`; to the parent :class:`Ready`,
:class:`Connected`, :class:`Posted` (a write started, or refused at once), :class:`Finished` (a
pending write ended), :class:`Bye`.
"""

from __future__ import annotations

import os
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
class ClosePeer:
    pass


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class Bye:
    pass


def serve(conn, seed: int, nbytes: int, env=None) -> None:
    for key, value in {**LOOPBACK_ENV, **(env or {})}.items():
        os.environ[key] = value
    from transport.base import TransferStatus, WriteBatch
    from transport.nixl import NixlConfig, NixlTransport
    from transport.nixl_staged import StagedNixlConfig

    src = source_bytes(seed, nbytes)
    with NixlTransport(NixlConfig(staged=StagedNixlConfig(enabled=False))) as transport:
        sid = transport.register(src.ctypes.data, src.nbytes)
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
            elif isinstance(cmd, Connect):
                peer = transport.connect(cmd.export)
                conn.send(Connected())
            elif isinstance(cmd, ClosePeer):
                peer.close()
                conn.send(Connected())
            elif isinstance(cmd, Write):
                try:
                    tr = peer.write(WriteBatch.of([sid], [0], [cmd.region], [cmd.offset], [cmd.length]))
                except Exception as exc:
                    conn.send(Posted(cmd.tag, "RAISED", f"{type(exc).__name__}: {exc}"))
                    continue
                conn.send(Posted(cmd.tag, tr.status().name, tr.error or ""))
                pending[cmd.tag] = tr
            else:
                raise TypeError(f"unknown command {type(cmd).__name__}")
    conn.send(Bye())
