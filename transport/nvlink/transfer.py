"""One NVLink write in flight: its completion event, its notification, its deadline."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from transport.base import Transfer, TransferStatus

if TYPE_CHECKING:
    from transport.nvlink.pending import PendingQueue

__all__ = ["NvlinkTransfer"]


class NvlinkTransfer(Transfer):
    """One batched write: a CUDA event, an optional notification, a deadline.

    Its peer's :class:`~transport.nvlink.pending.PendingQueue` settles it (in posting order):
    DONE once the event has completed and the notification is sent, FAILED on a CUDA error, a
    lost peer, the transfer timeout or :meth:`abort`."""

    # A 640 MiB copy takes 1.7 ms on NVLink: even a 50 us sleep (Linux's timer slack) costs a
    # few percent, so wait() polls yielding the GIL, without sleeping; it keeps one core busy
    # while it waits (poll status() from an event loop to avoid that).
    max_poll_sleep_s = 0.0

    def __init__(self, queue: "PendingQueue", event, notify: Optional[bytes], keep=(), error: Optional[str] = None):
        self._queue = queue
        self._event = event
        self._notify = notify
        self._keep = keep  # tables that must outlive the copy
        self._deadline = time.monotonic() + queue.transfer_timeout_s
        self._status = TransferStatus.FAILED if error else TransferStatus.PENDING
        self._error = error

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

    def abort(self) -> None:
        with self._queue.lock:
            if self._status is TransferStatus.PENDING:
                self._fail("aborted")

    def _fail(self, why: str) -> None:
        self._status, self._error = TransferStatus.FAILED, why
        self._queue.bury(self._event, self._keep)  # the GPU may still read the tables
        self._keep = ()

    def _done(self) -> None:
        self._status, self._keep = TransferStatus.DONE, ()
