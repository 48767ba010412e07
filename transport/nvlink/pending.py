"""A peer's FIFO of pending transfers and the tables of failed ones (deferred cleanup).

A write's notification is *announced* at the first look after it was posted, which the write
call itself makes before it returns (sent to the peer, who holds it:
:mod:`transport.nvlink.mailbox`; a socket send bounded by ``peer_timeout_s``, refused when the
peer is gone), so that it travels while the copy runs
(with an outbox whose ``early`` is False, a CPU the landed word is not safe on, it is sent
once the copy completed).
Transfers settle in posting order, so notifications are released in the order their writes
were posted: a finished copy waits for the ones before it. Settling a transfer: query its
event; on completion release its notification (one store into the landed word) or, without
one, check the peer is alive; then mark it DONE. A failed transfer's announced notification
is withdrawn when the FIFO reaches it. With a lander (:mod:`transport.nvlink.lander`: the
outbox's ``watching``) its thread stores the word once each event completed, a transfer is
DONE once the lander passed its number, and a failing one is withdrawn at once
(:meth:`PendingQueue.withdraw`; too late once the lander released it: then it is DONE). A
copy whose event has not completed after ``transfer_timeout_s`` is FAILED. A failed or aborted transfer's copy may still be running on
the GPU, reading its tables: they are *buried* with its event and released only once that
event has completed (or errored).

Both the caller's thread (``Transfer.status()``/``wait()``) and the transport's progress
thread (:mod:`transport.nvlink.progress`) call :meth:`PendingQueue.advance`; both take
:attr:`PendingQueue.lock`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

from transport.base import TransferStatus
from transport.nvlink.mailbox import Outbox
from transport.nvlink.transfer import NvlinkTransfer

__all__ = ["PendingQueue", "running"]


def running(event) -> bool:
    """The copy behind ``event`` may still run (a CUDA error: nothing will run any more)."""
    try:
        return not event.query()
    except Exception:
        return False


class PendingQueue:
    """Pending transfers of one peer, settled in order; notifications go out through ``outbox``."""

    def __init__(self, name: str, outbox: Optional[Outbox], transfer_timeout_s: float):
        self.name = name  # the peer's, for messages
        self.outbox = outbox
        self.transfer_timeout_s = transfer_timeout_s
        self.lock = threading.RLock()
        self._pending: deque[NvlinkTransfer] = deque()
        self._unannounced: deque[NvlinkTransfer] = deque()  # posted with a notification not sent yet
        self._graveyard: list = []  # [(event, tables)] of failed transfers whose copy may still run

    def track(self, transfer: NvlinkTransfer) -> NvlinkTransfer:
        with self.lock:
            self._pending.append(transfer)
            if transfer._notify is not None and self.outbox.early:
                self._unannounced.append(transfer)
        return transfer

    def oldest_event(self):
        """What to wait on (``synchronize()``) for the oldest transfer still pending (None: none):
        its completion event, or with a lander and a notification, the lander passing its
        number (:meth:`Outbox.awaiting`)."""
        with self.lock:
            for t in self._pending:
                if t._status is TransferStatus.PENDING and t._event is not None:
                    return t._event if t._number is None else self.outbox.awaiting(t._number, t._event)
        return None

    def bury(self, event, keep: tuple) -> None:
        """Hold ``keep`` until ``event`` completes (a failed or aborted transfer's tables)."""
        if keep and event is not None:
            with self.lock:
                self._graveyard.append((event, keep))

    @property
    def buried(self) -> list:
        """``[(event, tables)]`` still held for copies that may be running."""
        return list(self._graveyard)

    def events(self) -> list:
        """The completion events of every copy of this peer that may still run: the pending
        transfers' and the buried ones' (what a revoke waits for, :mod:`transport.nvlink.holds`)."""
        with self.lock:
            return [t._event for t in self._pending if t._event is not None] + [e for e, _ in self._graveyard]

    def _dig(self) -> None:
        """Release the tables of failed transfers whose copy has finished (or errored)."""
        self._graveyard = [(e, k) for e, k in self._graveyard if running(e)]

    def advance(self) -> bool:
        """Announce the new notifications, move the FIFO forward; True while some transfers
        remain pending."""
        with self.lock:
            if self._graveyard:
                self._dig()
            if self._unannounced:
                self._announce()
            while self._pending:
                t = self._pending[0]
                if t._status is TransferStatus.PENDING and not self._settle(t):
                    return True
                self._pending.popleft()
                if t._number is not None and t._status is not TransferStatus.DONE:
                    self._withdraw(t._number)
            return False

    def _announce(self) -> None:
        """Send the notifications of the transfers posted since the last look, in order."""
        while self._unannounced:
            t = self._unannounced.popleft()
            if t._status is not TransferStatus.PENDING:  # failed or aborted before: never sent
                continue
            try:
                t._number = self.outbox.announce(t._notify, t._event)
            except OSError as exc:  # a peer gone refuses the send (EPIPE): no separate look first
                t._fail(f"peer {self.name!r} lost while sending the notification: {exc}")

    def withdraw(self, number: int) -> bool:
        """A transfer failing with announced notification ``number``: with a lander, it is
        withdrawn now (False: the lander released it already, the transfer is done); without
        one, when the FIFO reaches it (:meth:`_withdraw`), and True."""
        return self.outbox.withdraw(number) if self.outbox.watching else True

    def _withdraw(self, number: int) -> None:
        """A failed transfer's announced notification, in FIFO order: the peer never hands it
        out (with a lander, :meth:`withdraw` did it when the transfer failed)."""
        if self.outbox.watching:
            return
        try:
            self.outbox.settle(number, landed=False)
        except OSError:  # the connection ended: the peer drops every notification it holds
            pass

    def _settle(self, t: NvlinkTransfer) -> bool:
        """Settle ``t`` if its copy finished or timed out; False while it is still running."""
        if t._number is not None and self.outbox.landed(t._number):  # the lander released it
            t._done()
            return True
        try:
            finished = t._event.query()
        except Exception as exc:  # a CUDA error surfaces here (illegal address, ...)
            t._fail(f"CUDA error in the copy kernel: {exc}")
            return True
        if not finished:
            if time.monotonic() > t._deadline:
                t._fail(f"copy did not complete within {self.transfer_timeout_s} s")
                return True
            return False
        if t._number is None and t._notify is not None:  # an outbox without a landed word: sent now
            try:  # a peer gone refuses the send (EPIPE): no separate look first
                self.outbox.send(t._notify)
            except OSError as exc:
                t._fail(f"peer {self.name!r} lost while sending the notification: {exc}")
                return True
        elif t._number is None or self.outbox.watching:
            if not self.outbox.alive():
                t._fail(f"peer {self.name!r} lost by the time the copy completed")
                return True
            # with a lander: released from here, or by its thread within microseconds
            if t._number is not None and not self.outbox.landed(t._number, look=True):
                return False
        else:
            try:
                self.outbox.settle(t._number)
            except OSError as exc:
                t._fail(f"peer {self.name!r} lost by the time the copy completed: {exc}")
                return True
        t._done()
        return True

    def abort_all(self, why: str) -> None:
        """Fail every pending transfer (the peer closes)."""
        with self.lock:
            for t in self._pending:
                if t._status is TransferStatus.PENDING:
                    t._fail(why)
            self._pending.clear()

    def forget_buried(self) -> None:
        """Drop the buried tables (the caller has waited for every copy)."""
        with self.lock:
            self._graveyard.clear()
