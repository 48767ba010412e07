"""The landed word stored by a thread of C: a notification released without the GIL.

Why
---
A write's notification goes out while its copy runs and the receiver holds it until the
landed word passes its number (:mod:`transport.nvlink.mailbox`). Storing that number was the
progress thread's job (:mod:`transport.nvlink.progress`): wake from the event, take the GIL,
advance the FIFO under its lock, store. That is 10-15 us after the copy on an H200's host when
the process is idle, and up to CPython's switch interval (5 ms) behind a caller that runs pure
Python after posting (a scheduler's loop between layer-wise writes): bench/RESULTS.md.

How
---
:class:`Lander` is one outbox's queue of notifications; one thread of C per process
(``native.c``'s ``lander_*``), which never takes the GIL, serves every lander: it looks at
each queue's front in turn, and once a front's completion event completed it stores that
number into the outbox's word with one release store. It looks without pause while some
front has waited less than 2 ms, then every 20 us, and once all have waited 100 ms every 1 ms
(a new watch ends a pause at once); with nothing to wait on, it looks for new work for 200 us
before it sleeps, so that a write that follows soon finds it awake. A process writing to many
peers thus keeps one core busy while copies run, as the progress thread did, not one per
peer; ``NvlinkConfig.lander_spin_us`` shortens that window (0: it naps from its first look),
trading up to a nap's 20 us on a notification for that core (:func:`ask_spin`: process-wide,
the smallest any transport asked for). The thread starts with the first lander and ends when the last one closes. A caller that
finds the copy already complete (the write call's first look, :mod:`transport.nvlink.pending`)
stores it itself (:meth:`land`): a short copy does not wait for the thread to wake. The rest
stays in Python, in :mod:`transport.nvlink.pending`: transfers are marked DONE from
:meth:`landed`, deadlines and CUDA errors fail them. A notification being withdrawn
(:meth:`withdraw`) stops the thread at it -- nothing past it is stored -- until the receiver
was sent its ``Dropped`` and :meth:`release` lets it go on, the order the mailbox's contract
needs. A notification whose number the thread stored already cannot be withdrawn (the
receiver may have handed it out): :meth:`withdraw` says so and the transfer counts as done.

The events stay Python's objects (``torch.cuda.Event``): :class:`Lander` keeps each alive until
the thread has passed its number. Only where the mailbox has a word (x86-64) and the C steps
load (:mod:`transport.nvlink.native`); elsewhere the progress thread stores the word.
"""

from __future__ import annotations

from collections import deque
from types import ModuleType

from transport.nvlink.word import SharedWord

__all__ = ["Lander", "Passing", "ask_spin"]

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
        (:mod:`transport.nvlink.progress`): the thread passing it, no core kept busy."""
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
