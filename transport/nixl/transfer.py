"""One direct NIXL write request: progress, deadline and abort in ``status()``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from transport.base import Transfer, TransferStatus

if TYPE_CHECKING:
    from transport.nixl.core import Core

__all__ = ["NixlTransfer"]


class NixlTransfer(Transfer):
    """One NIXL transfer request. Progress and peer-loss detection happen in ``status()``."""

    def __init__(self, core: "Core", name: str, handle, nbytes: int, deadline_s: float, src_region=None,
                 dst_region=None):
        self._core = core
        self.name = name  # the remote agent written to
        self.src_region = src_region  # [n] the batch's local region ids (what deregister must not pull)
        self.dst_region = dst_region  # [n] the peer's region ids (what a revoke of them waits for)
        self._handle = handle  # nixl_xfer_handle, None once released
        self._status = TransferStatus.PENDING
        self._error: Optional[str] = None
        self._deadline_s = deadline_s
        self._deadline = time.monotonic() + deadline_s
        self._cancelled = False  # cancel() asked: FAILED ("aborted") once NIXL no longer runs it
        self.nbytes = nbytes

    @classmethod
    def finished(cls, core: "Core", name: str, status: TransferStatus, error: Optional[str] = None) -> "NixlTransfer":
        """A transfer that ended before anything was posted."""
        t = cls(core, name, None, 0, 0.0)
        t._status, t._error = status, error
        return t

    @property
    def error(self) -> Optional[str]:
        return self._error

    @property
    def ended(self) -> bool:
        """DONE or FAILED already (read without driving progress)."""
        return self._status is not TransferStatus.PENDING

    def status(self) -> TransferStatus:
        if self._status is not TransferStatus.PENDING:
            return self._status
        core = self._core
        if core.agent.closed:
            self.finish(TransferStatus.FAILED, "transport closed")
            return self._status
        core.service()  # revokes are answered while the owner waits on transfers
        if self._status is not TransferStatus.PENDING:
            return self._status
        aborted = "aborted; " if self._cancelled else ""
        try:
            state = core.agent.state(self._handle)
        except Exception as exc:  # nixlRemoteDisconnectError and other backend errors
            self.lose(f"{aborted}peer {self.name!r}: {type(exc).__name__}: {exc}")
            return self._status
        if self._cancelled and state != "PROC":
            self.finish(TransferStatus.FAILED, "aborted")
        elif state == "DONE":
            self.finish(TransferStatus.DONE)
        elif state != "PROC":  # an error NIXL reports without raising: failed in the backend too
            self.lose(f"{aborted}peer {self.name!r}: NIXL reported {state}")
        elif time.monotonic() > self._deadline:
            self.lose(f"{aborted}peer {self.name!r}: {self.nbytes} bytes not done after {self._deadline_s:.1f} s "
                       "(peer lost or stalled)")
        return self._status

    def cancel(self) -> None:
        """:meth:`abort` without waiting: the transfer stays PENDING until NIXL no longer runs
        it (no byte of it can land after that), then ends FAILED ("aborted"); at its deadline
        the peer is lost, as for abort. ``status()`` moves it on."""
        if self._status is TransferStatus.PENDING:
            self._cancelled = True
            self.status()

    def abort(self) -> None:
        """Cancel if still pending, and return only once no byte of it can still land: NIXL's
        cancel (releasing an active request) does not stop bytes already handed to UCX (over
        tcp, megabytes of an aborted write landed after it), so abort waits until NIXL reports
        the request no longer in progress, at most until the transfer's deadline. A peer that
        does not progress it by then is lost (:mod:`transport.nixl`, "Aborts and failures")."""
        self.cancel()
        sleep = 0.0
        while self.status() is TransferStatus.PENDING:
            time.sleep(sleep)
            sleep = min(self.max_poll_sleep_s, sleep * 2 or 1e-5)

    def cancel_now(self) -> None:
        """Fail and release now, without waiting (the transport is closing: its agent goes)."""
        if self._status is TransferStatus.PENDING:
            self.finish(TransferStatus.FAILED, "transport closed")

    def lose(self, error: str) -> None:
        """FAILED, and the remote agent is lost: this transport refuses further writes to it
        until a new ``connect`` to it, which waits until NIXL no longer progresses this request
        (its bytes may still land until then: releasing it does not stop them)."""
        self._status, self._error = TransferStatus.FAILED, error
        handle, self._handle = self._handle, None
        self._core.remotes.lose(self.name, error, [] if handle is None else [handle])
        self._core.holds.answer()

    def finish(self, status: TransferStatus, error: Optional[str] = None) -> None:
        """Enter a terminal state and release the NIXL request (cancelling it if still active)."""
        self._status, self._error = status, error
        handle, self._handle = self._handle, None
        if handle is not None:
            self._core.agent.release(handle)
            self._core.holds.answer()  # a revoke may have waited for this write
