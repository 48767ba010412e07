"""A 64-bit counter in memory shared by two processes: the writer stores, the receiver reads.

The writer makes it (an anonymous ``memfd``, nothing on disk and nothing left when both
processes are gone) and hands its file descriptor to the receiver over their Unix socket
(``SCM_RIGHTS``); each maps it. The file is sealed against shrinking before it is sent, and
the receiver maps only a sealed one: a writer cannot take the memory from under the receiver's
map (a read past a shrunk file's end would kill the receiver with SIGBUS). A store is one
aligned 8-byte write and a read one aligned 8-byte load (no torn values on any CPU), a read
costs ~0.1 us (this VM) and involves no system call: a receiver can look at it in every poll.
The mailbox (:mod:`transport.nvlink.mailbox`) uses it to say how many notifications' bytes are
in place.

Ordering: the mailbox relies on the writer's store becoming visible after the socket sends
that preceded it, and on the receiver's load of the word happening before its socket reads
that follow it. x86-64's total store order gives both (stores are seen in program order, loads
are not reordered with loads). A weakly ordered CPU (arm64) would need a fence on each side,
which Python cannot issue cheaply: there (:data:`ORDERED` False) the mailbox makes no word and
sends each notification once its bytes are in place.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform

import numpy as np

__all__ = ["ORDERED", "SharedWord", "WordView"]

ORDERED = platform.machine().lower() in ("x86_64", "amd64")  # total store order: the word is safe here

_BYTES = 8
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL  # the size can only grow; the seals stay as they are


class SharedWord:
    """The writer's side: a new counter at 0; :meth:`store` sets it, :attr:`fd` is what the
    receiver maps (:class:`WordView`); :meth:`close` closes the fd and lets the map go."""

    def __init__(self):
        self.fd = os.memfd_create("kvtransfer-nvlink-word", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, _BYTES)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, _BYTES)
        except OSError:
            os.close(self.fd)
            raise
        self._cell = ctypes.c_uint64.from_buffer(self._map)  # one typed 8-byte store per write
        self.address = ctypes.addressof(self._cell)  # where a store from C goes (transport.nvlink.lander)
        self.value = 0

    def store(self, value: int) -> None:
        """Set the counter (never lower than it was: readers take it as a high-water mark);
        after :meth:`close`, nothing."""
        if value < self.value:
            raise ValueError(f"the counter only goes up: {value} < {self.value}")
        cell = self._cell
        if cell is not None:
            cell.value = value
            self.value = value

    def close(self) -> None:
        """Close the fd and let the map go (unmapped with its last reference: a store racing
        with the close writes into it, not into freed memory). Idempotent."""
        if self._cell is None:
            return
        self._cell = self._map = None
        os.close(self.fd)


class WordView:
    """The receiver's side of a :class:`SharedWord` it got the fd of (the fd is not kept: the
    mapping outlives it; the caller closes its fd)."""

    def __init__(self, fd: int):
        """``ValueError`` unless ``fd`` is a memfd sealed against shrinking, of 8 bytes or more."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # not a memfd (a pipe, a socket, a plain file)
            raise ValueError("the shared counter's fd is not a memfd") from None
        if seals & fcntl.F_SEAL_SHRINK == 0:
            raise ValueError("the shared counter's memfd is not sealed against shrinking")
        if os.fstat(fd).st_size < _BYTES:
            raise ValueError("the shared counter's file is shorter than 8 bytes")
        self._map = mmap.mmap(fd, _BYTES, prot=mmap.PROT_READ)
        self._cell = np.frombuffer(self._map, dtype=np.uint64, count=1)  # [1] read-only view

    def read(self) -> int:
        return int(self._cell[0])

    def close(self) -> None:
        """Let the map go (unmapped with its last reference). Idempotent."""
        self._cell = self._map = None
