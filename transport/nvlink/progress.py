"""The nvlink backend's progress thread: settles pending transfers as their copies complete.

It sleeps (on a lock, the "bell") until a write wakes it, then calls ``advance()`` (which settles finished transfers:
notification sent, status DONE or FAILED, and returns True while some remain pending). While
some remain, it waits on the oldest one (``oldest_event()``, its ``synchronize()``, which
releases the GIL): the completion event, so that the notification goes out as soon as the copy
ends, without a caller polling and without a Python loop spinning; or, where a lander stores
the landed word (:mod:`transport.nvlink.lander`), the lander passing the transfer's
notification, asleep until then (at most 10 ms at a time): the lander's thread is the one
that watches the copy, and a second core spinning on the same event would only mark the
transfer DONE a few microseconds sooner. One thread per transport, whatever the number of
transfers. It sleeps again once nothing is pending.

``Transfer.status()`` and ``wait()`` advance the same FIFOs (:mod:`transport.nvlink.pending`)
from the caller's thread; both sides take the FIFO's lock, and no lock is held while the thread
waits. Without a lander, a copy that never completes keeps this thread in the event's
``synchronize()``; callers' ``status()`` / ``wait()`` still fail it at its deadline
(``transfer_timeout_s``). With one, the thread looks at least every 10 ms and fails it itself.

Where the C steps load, the landed word is stored by a lander (:mod:`transport.nvlink.lander`)
and this thread only marks transfers DONE. Without one it stores the word too, and needs the
GIL for it: a caller that runs pure Python after posting a write (no torch op, no blocking
call) holds it up to CPython's switch interval (5 ms) per turn, and the notification with it:
~2 ms late behind 3 ms of Python on one H200, 20-30 us behind a stream of torch ops, which let
the GIL go (bench/RESULTS.md).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

__all__ = ["Progress"]


class Progress:
    """A daemon thread calling ``advance()`` while it reports pending work, waiting between
    calls on ``oldest_event()``, an object with ``synchronize()`` (None: nothing to wait on; it
    then polls every ``POLL_S``)."""

    POLL_S = 2e-4

    def __init__(self, advance: Callable[[], bool], oldest_event: Callable[[], object] = lambda: None,
                 name: str = "nvlink-progress"):
        self._advance = advance
        self._oldest_event = oldest_event
        self._name = name
        self._start_lock = threading.Lock()
        self._bell = threading.Lock()  # held while nothing rang: the sleeping thread blocks acquiring it
        self._bell.acquire()
        self._stop = False
        self._kicked = False  # a write arrived since the thread last looked
        self._idle = False  # the thread is (about to be) asleep on the bell: a wake must ring it
        self._thread: Optional[threading.Thread] = None

    def wake(self) -> None:
        """Have the thread call ``advance()`` again (started by the first call). While the thread
        runs or waits on an event, a flag it reads before it would sleep; only a sleeping
        thread is woken (the bell released: one futex wake, no Python lock)."""
        self._kicked = True  # before reading _idle; the thread sets _idle before reading _kicked
        if self._idle:
            self._ring()
        elif self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._stop:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()

    def _ring(self) -> None:
        try:
            self._bell.release()
        except RuntimeError:  # rung already, not yet heard: once is enough
            pass

    def _run(self) -> None:
        # A write tracks its transfer, then sets _kicked, then reads _idle; this thread sets
        # _idle, then reads _kicked, then sleeps on the bell (each under the GIL, in that
        # order). If it read _kicked unset, the write's read of _idle came later and saw it
        # set: the write rings, before or while the thread sleeps, and either way the bell's
        # acquire returns. So no write is left pending with the thread asleep. A ring nobody
        # waited for costs one more look.
        while not self._stop:
            self._kicked = False
            busy = self._advance()
            event = self._oldest_event() if busy else None
            if event is not None:
                try:
                    event.synchronize()  # the GIL is released while the copy runs
                    continue
                except Exception:  # a CUDA error (the next advance() fails the transfer): poll
                    pass
            if self._stop:
                return
            self._idle = True
            if not self._kicked:
                self._bell.acquire(timeout=self.POLL_S if busy else -1)
            self._idle = False

    def stop(self) -> None:
        self._stop = True
        self._ring()
        if self._thread is not None:
            self._thread.join(timeout=5)
