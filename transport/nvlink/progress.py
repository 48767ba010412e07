"""The nvlink backend's progress thread: advances pending transfers while any exist.

It sleeps until a write wakes it, then calls ``advance()`` (which settles finished transfers:
notification sent, status DONE or FAILED, and returns True while some remain pending) every
200 us, and sleeps again once nothing is pending. ``Transfer.status()`` and ``wait()`` advance
the same FIFOs (:mod:`transport.nvlink.pending`) from the caller's thread; both sides take
the FIFO's lock.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

__all__ = ["Progress"]


class Progress:
    """A daemon thread calling ``advance()`` while it reports pending work."""

    POLL_S = 2e-4

    def __init__(self, advance: Callable[[], bool], name: str = "nvlink-progress"):
        self._advance = advance
        self._name = name
        self._cond = threading.Condition()
        self._stop = False
        self._kicked = False  # a write arrived since the thread last looked
        self._thread: Optional[threading.Thread] = None

    def wake(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._kicked = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                self._kicked = False
            busy = self._advance()
            with self._cond:
                if self._stop:
                    return
                if not self._kicked:
                    self._cond.wait(self.POLL_S if busy else None)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
