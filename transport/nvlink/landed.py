"""The landed word: a 64-bit counter two processes map, which says how many of a connection's
notifications have their bytes in place, and the thread of C that stores it.

The mailbox (:mod:`transport.nvlink.mailbox`) sends a write's notification while its copy runs;
the receiver holds it until this word passes its number.

The word (:class:`SharedWord`, :class:`WordView`)
-------------------------------------------------
The writer makes it (an anonymous ``memfd``, nothing on disk and nothing left when both
processes are gone) and hands its file descriptor to the receiver over their Unix socket
(``SCM_RIGHTS``); each maps it. The file is sealed against shrinking before it is sent, and the
receiver maps only a sealed one: a writer cannot take the memory from under the receiver's map
(a read past a shrunk file's end would kill the receiver with SIGBUS). A store is one aligned
8-byte write and a read one aligned 8-byte load (no torn values on any CPU), with no system
call: a receiver can look at it in every poll. The mailbox relies on the writer's store
becoming visible after the socket sends that preceded it, and on the receiver's load of the
word happening before its socket reads that follow it. x86-64's total store order gives both. A
weakly ordered CPU (arm64) would need a fence on each side, which Python cannot issue cheaply:
there (:data:`ORDERED` False) the writer makes no word and sends each notification once its
copy completed; the receiver hands out the notifications of a connection without a word as
they arrive.

The landers' thread (:class:`Lander`)
-------------------------------------
Where the C steps load (:mod:`transport.nvlink.native`), a :class:`Lander` per outbox queues
its announced notifications, and one thread of C per process (``lander.c``), which never takes
the GIL, serves every lander: it looks at each queue's front in turn and, once a front's
completion event completed, stores that number into the outbox's word with one release store.
A caller that runs pure Python after posting (a scheduler's loop between layer-wise writes)
holds the GIL up to CPython's switch interval (5 ms); the thread of C does not need it, so the
notification is not held. The thread looks without pause while some front has waited less
than ``NvlinkConfig.lander_spin_us`` (then every 20 us, and once all have waited 100 ms every
1 ms; a new watch ends a pause at once); with nothing to wait on it looks for new work for 200
us before it sleeps, so that a write that follows soon finds it awake. The window is
process-wide, the smallest any transport asked for (:func:`ask_spin`). The thread starts with
the first lander and ends when the last one closes. A caller that finds the copy already
complete (the write call's first look) stores the word itself (:meth:`Lander.land`). Each
store rings the receiver's doorbell when the outbox got one (:meth:`Lander.ring`; the mailbox's
module doc says why). A
notification being withdrawn (:meth:`Lander.withdraw`) stops the thread at it -- nothing past
it is stored -- until the receiver was sent its ``Dropped`` and :meth:`Lander.release` lets it
go on; one whose number the thread stored already cannot be withdrawn (the receiver may have
handed it out). The events stay Python's objects (``torch.cuda.Event``): the lander keeps each
alive until the thread has passed its number. Without a lander the FIFO
(:mod:`transport.nvlink.completion`) stores the word with :meth:`~transport.nvlink.mailbox.Outbox.settle`.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
from collections import deque
from types import ModuleType

import numpy as np

__all__ = ["Lander", "ORDERED", "Passing", "SharedWord", "WordView", "ask_spin"]


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
        self.address = ctypes.addressof(self._cell)  # where a store from C goes (Lander, lander.c)
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


# -- the landers' thread (lander.c) ------------------------------------------------------


_spin_ns: list = []  # the window set in this process: the smallest any transport asked for


def ask_spin(native: ModuleType, ns: int) -> int:
    """Ask the landers' thread to look without pause for at most ``ns`` nanoseconds at a copy
    in flight before it naps. The thread is one per process, so the window is too: the
    smallest any transport asked for. Returns the window now in force."""
    if not _spin_ns or ns < _spin_ns[0]:
        native.lander_spin(ns)
        _spin_ns[:] = [ns]
    return _spin_ns[0]


class Lander:
    """One outbox's queue: the landers' thread stores ``word`` once each watched copy completed
    (querying each event with its device's primary context current; ``device``: the one of
    events that do not say). Calls come from any thread (each takes the landers' mutex
    briefly); after :meth:`close` nothing more is stored into ``word``."""

    def __init__(self, native: ModuleType, word: SharedWord, device: int):
        self._native = native
        self._word = word  # its memory must outlive the thread's last store
        self._device = device
        self._events: deque = deque()  # [(number, event)] the thread may still query
        self._handle = native.lander_new(word.address)

    def watch(self, number: int, event) -> None:
        """Store ``number`` once ``event`` (a ``torch.cuda.Event`` recorded after the copy)
        completed and every number before it is stored or withdrawn. Numbers come in
        increasing order (``ValueError`` otherwise)."""
        device = getattr(event, "device", None)  # the staged engine's is the peer GPU's
        device = self._device if device is None or device.index is None else device.index
        self._native.lander_watch(self._handle, number, event.cuda_event, device)
        self._events.append((number, event))
        self._forget_passed()

    def ring(self, bell: int) -> None:
        """Ring the eventfd ``bell`` (the receiver's doorbell) after each store from now on: the
        thread keeps its own duplicate of the fd, closed with the lander."""
        self._native.lander_bell(self._handle, bell)

    def land(self) -> None:
        """Store now, from this thread, the watched numbers whose events have completed (in
        order, up to the first still running): a copy that ended before the write call returned
        is released by the call itself, not after the thread's wake-up."""
        self._native.lander_land(self._handle)

    def landed(self, number: int) -> bool:
        """The thread has stored ``number`` (or a later one) into the word."""
        return self._native.lander_landed(self._handle) >= number

    def withdraw(self, number: int) -> bool:
        """Keep the thread from storing ``number`` or anything past it until :meth:`release`;
        False when the word is past ``number`` already (too late: it landed; a number is
        withdrawn once, by the transfer that fails)."""
        return self._native.lander_withdraw(self._handle, number)

    def release(self, number: int) -> None:
        """The receiver was told ``number`` is withdrawn: the thread may go past it."""
        self._native.lander_release(self._handle, number)

    def awaiting(self, number: int, event) -> "Passing":
        """What the progress thread waits on for watched notification ``number``
        (:class:`transport.nvlink.completion.Progress`): the thread passing it, no core kept busy."""
        return Passing(self._native, self._handle, number, event)

    def _forget_passed(self) -> None:
        events = self._events
        passed = self._native.lander_passed(self._handle)
        while events and events[0][0] <= passed:
            events.popleft()

    def close(self) -> None:
        """Store nothing more (the thread lets go of this lander within one of its looks, and
        ends with the last lander); idempotent."""
        handle, native = getattr(self, "_handle", None), getattr(self, "_native", None)
        if handle is not None and native is not None:  # (either may be gone at interpreter exit)
            native.lander_close(handle)
            self._events.clear()

    __del__ = close


class Passing:
    """The landers' thread passing one number (storing it, or skipping it withdrawn), waited
    for like an event: :meth:`synchronize` sleeps (the GIL let go) until then, at most
    ``WAIT_S`` at a time -- the waiter looks at its transfers' deadlines and CUDA errors in
    between -- and on the event itself once the lander is closed."""

    WAIT_S = 0.01
    __slots__ = ("_native", "_handle", "_number", "_event")

    def __init__(self, native: ModuleType, handle, number: int, event):
        self._native, self._handle, self._number, self._event = native, handle, number, event

    def synchronize(self) -> None:
        if self._native.lander_wait(self._handle, self._number, self.WAIT_S) is None:
            self._event.synchronize()
