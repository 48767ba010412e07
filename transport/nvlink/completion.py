"""Completion: a write in flight (:class:`NvlinkTransfer`), each peer's FIFO of them
(:class:`PendingQueue`) and the transport's progress thread (:class:`Progress`).

The FIFO
--------
A write's notification is *announced* at the first look after it was posted, which the write
call itself makes before it returns (sent to the peer, who holds it: :mod:`transport.nvlink.mailbox`;
a socket send bounded by ``peer_timeout_s``, refused when the peer is gone), so that it travels
while the copy runs (with an outbox whose ``early`` is False, a CPU the landed word is not safe
on, it is sent once the copy completed). Transfers settle in posting order, so notifications
are released in the order their writes were posted: a finished copy waits for the ones before
it. Settling a transfer: query its event; on completion release its notification (one store
into the landed word) or, without one, check the peer is alive; then mark it DONE. A failed
transfer's announced notification is withdrawn when the FIFO reaches it. A copy whose event has
not completed after ``transfer_timeout_s`` is FAILED. A failed or aborted transfer's copy may
still be running on the GPU, reading its tables: they are *buried* with its event and released
only once that event has completed (or errored). Both the caller's thread
(``Transfer.status()``/``wait()``) and the progress thread call :meth:`PendingQueue.advance`;
both take :attr:`PendingQueue.lock`, and no lock is held while the thread waits.

Who stores the landed word
--------------------------
One completion path, with one step that runs in C where it can. Where the C steps load
(:mod:`transport.nvlink.native`) and the mailbox has a word (x86-64), the outbox's
:class:`~transport.nvlink.landed.Lander` stores it from a thread of C without the GIL: a
transfer is DONE once the lander passed its number, and a failing one is withdrawn at once
(:meth:`PendingQueue.withdraw`; too late once the lander released it: then it is DONE).
Elsewhere (no C compiler, no Python headers or driver library to build ``native.c`` against,
``NvlinkConfig.native`` False) the FIFO stores the word as it settles, from the caller's thread
or the progress thread: the same contract without the GIL-free store, kept so that the backend
is correct on every machine the Python steps run on. A weakly ordered CPU has no word at all
(:mod:`transport.nvlink.mailbox`): the FIFO sends each notification once its copy completed.

The progress thread
-------------------
One per transport, whatever the number of transfers. It sleeps (on a lock, the "bell") until a
write wakes it, then calls ``advance()`` (which settles finished transfers and returns True
while some remain pending). While some remain, it waits on the oldest one
(``oldest_event()``): without a lander, the completion event's ``synchronize()`` (the GIL
released), so that the notification goes out as soon as the copy ends; with one, the lander
passing the transfer's notification, asleep until then (at most 10 ms at a time): the lander's
thread is the one that watches the copy, and the progress thread only marks transfers DONE and
fails them at their deadline. Without a lander, a copy that never completes keeps the thread in
the event's ``synchronize()``; callers' ``status()`` / ``wait()`` still fail it at its deadline
(``transfer_timeout_s``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

from transport.base import Transfer, TransferStatus
from transport.nvlink.mailbox import Outbox

__all__ = ["NvlinkTransfer", "PendingQueue", "Progress", "running"]


class NvlinkTransfer(Transfer):
    """One batched write: a CUDA event, an optional notification, a deadline.

    Its peer's :class:`PendingQueue` settles it (in posting order):
    DONE once the event has completed and the notification (sent while the copy ran) is
    released to the peer, FAILED on a CUDA error, a lost peer, the transfer timeout or
    :meth:`abort`."""

    # wait() sleeps until the transfer settles (the progress thread settles it as soon as the
    # copy's event completes: :class:`Progress`), waking every WAIT_SLICE_S to
    # advance the FIFO itself, so deadlines hold even if that thread is stuck.
    max_poll_sleep_s = 0.0
    WAIT_SLICE_S = 0.01
    DRAIN_PAUSE_S = 1e-4  # wait() of a cancelled transfer: the pause between looks at its copy's event

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
        self._draining = False  # cancelled: PENDING until the aborted copy's event completed (cancel)

    @property
    def event(self):
        """The CUDA event (``torch.cuda.Event``) recorded after the copy: a stream that waits on
        it runs after the bytes are written (None for a transfer that failed at posting)."""
        return self._event

    def status(self) -> TransferStatus:
        if self._status is TransferStatus.PENDING:
            self._queue.advance()
        if self._draining:
            if running(self._event):
                return TransferStatus.PENDING
            self._draining = False
        return self._status

    @property
    def error(self) -> Optional[str]:
        return self._error

    def _pauses(self):
        """:meth:`wait` sleeps on the settled lock -- no core busy -- at most WAIT_SLICE_S at a
        time (then it advances the FIFO itself)."""
        def pause(left: Optional[float]) -> None:
            if self._draining:  # settled already: the aborted copy's end is only seen by a query
                time.sleep(self.DRAIN_PAUSE_S if left is None else min(self.DRAIN_PAUSE_S, left))
                return
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
        """Fail the transfer now ("aborted"; its notification is withdrawn, never handed out).
        Its copy, queued on the GPU, may still run and write until its event completes:
        :meth:`cancel` says when it no longer can."""
        with self._queue.lock:
            if self._status is TransferStatus.PENDING:
                self._fail("aborted")

    def cancel(self) -> None:
        """:meth:`abort`, and ``status()`` PENDING until the aborted copy's event has completed
        (or errored): until then its bytes may still land, so its destination is not free yet."""
        self.abort()
        self._draining = self._status is TransferStatus.FAILED and self._event is not None

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


# -- a peer's FIFO of pending transfers ------------------------------------------------------------


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
        transfers' and the buried ones' (what a revoke waits for, :mod:`transport.nvlink.revoke`)."""
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


# -- the progress thread ---------------------------------------------------------------------------


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
