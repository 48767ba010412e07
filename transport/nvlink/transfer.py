"""One NVLink write in flight: its completion event, its notification, its deadline."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Optional

from transport.base import Transfer, TransferStatus

if TYPE_CHECKING:
    from transport.nvlink.pending import PendingQueue

__all__ = ["NvlinkTransfer"]


class NvlinkTransfer(Transfer):
    """One batched write: a CUDA event, an optional notification, a deadline.

    Its peer's :class:`~transport.nvlink.pending.PendingQueue` settles it (in posting order):
    DONE once the event has completed and the notification (sent while the copy ran) is
    released to the peer, FAILED on a CUDA error, a lost peer, the transfer timeout or
    :meth:`abort`."""

    # wait() sleeps until the transfer settles (the progress thread settles it as soon as the
    # copy's event completes: :mod:`transport.nvlink.progress`), waking every WAIT_SLICE_S to
    # advance the FIFO itself, so deadlines hold even if that thread is stuck.
    max_poll_sleep_s = 0.0
    WAIT_SLICE_S = 0.01

    def __init__(self, queue: "PendingQueue", event, notify: Optional[bytes], keep=(), error: Optional[str] = None):
        self._queue = queue
        self._event = event
        self._notify = notify
        self._number: Optional[int] = None  # the notification's number once announced (mailbox)
        self._keep = keep  # tables that must outlive the copy
        self._deadline = time.monotonic() + queue.transfer_timeout_s
        self._status = TransferStatus.FAILED if error else TransferStatus.PENDING
        self._error = error
        self._settled: Optional[threading.Lock] = None  # made by the first wait(), held until settled

    @property
    def event(self):
        """The CUDA event (``torch.cuda.Event``) recorded after the copy: a stream that waits on
        it runs after the bytes are written (None for a transfer that failed at posting)."""
        return self._event

    def status(self) -> TransferStatus:
        if self._status is TransferStatus.PENDING:
            self._queue.advance()
        return self._status

    @property
    def error(self) -> Optional[str]:
        return self._error

    def _pauses(self):
        """:meth:`wait` sleeps on the settled lock -- no core busy -- at most WAIT_SLICE_S at a
        time (then it advances the FIFO itself)."""
        def pause(left: Optional[float]) -> None:
            settled = self._settled_lock()
            if settled.acquire(timeout=self.WAIT_SLICE_S if left is None else min(self.WAIT_SLICE_S, left)):
                self._open(settled)  # open for good: other waiters pass too

        return pause

    def _settled_lock(self) -> threading.Lock:
        """A lock held until :meth:`_done` / :meth:`_fail` release it (a waiter sleeps acquiring
        it), made at the first wait -- a Lock, not a ``threading.Event``, whose making costs
        ten times more. Both run under the queue's lock, so it is made free when the transfer
        settled before."""
        if self._settled is None:
            with self._queue.lock:
                if self._settled is None:
                    lock = threading.Lock()
                    if self._status is TransferStatus.PENDING:
                        lock.acquire()
                    self._settled = lock
        return self._settled

    def abort(self) -> None:
        with self._queue.lock:
            if self._status is TransferStatus.PENDING:
                self._fail("aborted")

    def _fail(self, why: str) -> None:
        if self._number is not None and not self._queue.withdraw(self._number):
            self._done()  # a lander released its notification already: its bytes are in place
            return
        self._status, self._error = TransferStatus.FAILED, why
        self._queue.bury(self._event, self._keep)  # the GPU may still read the tables
        self._keep = ()
        self._open()

    def _done(self) -> None:
        self._status, self._keep = TransferStatus.DONE, ()
        self._open()

    def _open(self, settled: Optional[threading.Lock] = None) -> None:
        settled = self._settled if settled is None else settled
        if settled is not None:
            try:
                settled.release()
            except RuntimeError:  # free already
                pass
