"""The NIXL writer's side of the revoke protocol: the exports it holds, by owner.

For each remote agent whose export this transport connected to, a :class:`_Hold` keeps

- the seq of the last :class:`~transport.revocation.wire.Hold` sent (at each ``connect``) and of
  the last one the owner acknowledged: a direct write through a snapshot is posted only once the
  owner has recorded its hold (:meth:`Holds.wait_ready`), so the owner knows every transport that
  can write into its memory before any byte of it can land;
- the owner's regions revoked here (from a Revoke, or named ``gone`` in a HoldAck), a
  :class:`~transport.revocation.holder.Revoked`: writes naming them fail at once
  (:meth:`Holds.check`), through every snapshot of that owner;
- the revokes not answered yet: a RevokeAck goes back once no direct write of this transport
  into those regions is pending and no failed request to that owner can still run in NIXL
  (:meth:`Holds.answer`, run whenever this transport reads notifications or a transfer ends).

Everything runs on the owner's thread, inside calls into the transport (``write``, a transfer's
``status``/``wait``, ``poll_notifications``, ``connect``, ``Peer.close``): a transport that holds
an export answers revokes only while it is called (see :mod:`transport.nixl.revoke`).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from transport.base import TransferStatus
from transport.revocation.holder import Revoked
from transport.revocation.wire import Closed, Hold, HoldAck, Release, Revoke, RevokeAck, encode

__all__ = ["Holds"]


class _Hold:
    def __init__(self, owner: str):
        self.owner = owner
        self.sent = 0  # seq of the last Hold sent to the owner; 0 once released
        self.acked = 0  # seq of the last HoldAck from it
        self.revoked = Revoked()
        self.asks: list[tuple[int, frozenset]] = []  # (revoke seq, regions) not answered yet
        self.closed = False  # the owner closed its transport: every region of it is gone


class Holds:
    """The exports one NIXL transport holds, by owner agent name."""

    def __init__(self, core):
        self._core = core  # transport.nixl.core.Core: agent, remotes, pump()
        self._holds: dict[str, _Hold] = {}
        self._seq = 0
        self._answering = False  # answer() checks transfers, whose status() may end them and answer again

    def _send(self, owner: str, msg) -> None:
        """``send_notif``: delivered without this side's later progress once the endpoint is up
        (a write-carried notification would wait for this side to progress its flush)."""
        self._core.agent.send(owner, encode(msg))  # False: the owner is gone or unloaded, it waits for nobody

    # -- calls from the transport --------------------------------------------------------------

    def hold(self, owner: str, regions) -> int:
        """A ``connect`` to ``owner``'s export naming ``regions``: tell it; the Hold's seq."""
        hold = self._holds.setdefault(owner, _Hold(owner))
        # What is revoked starts afresh with each snapshot: its HoldAck names what of it is gone
        # (or being revoked), and until then no direct write goes (wait_ready); a restarted owner
        # under the same agent name numbers its regions from 0 again. Unanswered revokes stay.
        hold.revoked, hold.closed = Revoked(), False
        self._seq += 1
        hold.sent = self._seq
        agent = self._core.agent
        self._send(owner, Hold(self._seq, sorted(int(r) for r in regions), agent.metadata(), agent.scratch_ptr))
        return self._seq

    def check(self, owner: str, dst_region: np.ndarray) -> Optional[str]:
        """Why a write naming ``dst_region`` ([n] ids) of ``owner`` is refused, or None."""
        hold = self._holds.get(owner)
        if hold is None or dst_region.size == 0:
            return None
        if hold.closed:
            return (f"region {int(dst_region[0])} of peer {owner!r} was revoked: its owner closed its transport "
                    "(nothing was written)")
        return hold.revoked.check(owner, dst_region)

    def wait_ready(self, owner: str, seq: int, timeout_s: float) -> Optional[str]:
        """Block until ``owner`` acknowledged hold ``seq`` (reading notifications meanwhile);
        why not, after ``timeout_s``, else None."""
        hold = self._holds.get(owner)
        if hold is not None and hold.acked >= seq:
            return None
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        while True:
            self._core.pump()
            hold = self._holds.get(owner)
            if hold is not None and hold.acked >= seq:
                return None
            if time.monotonic() > deadline:
                return (f"peer {owner!r} did not acknowledge this transport's hold of its export within "
                        f"{timeout_s:g} s (an exporting transport answers in poll_notifications(); nothing was "
                        "written)")
            time.sleep(sleep)
            sleep = min(1e-3, sleep * 2 or 1e-5)

    def handle(self, owner: str, msg) -> None:
        hold = self._holds.get(owner)
        if hold is None:  # not (or no longer) held here: a revoke is answered at once, nothing to drop
            if isinstance(msg, Revoke):
                self._send(owner, RevokeAck(msg.seq))
            return
        if isinstance(msg, Closed):
            hold.closed, hold.asks = True, []
        elif isinstance(msg, HoldAck):
            hold.acked = max(hold.acked, msg.seq)
            if msg.gone:
                hold.revoked.drop(msg.gone)
        elif isinstance(msg, Revoke):
            hold.revoked.drop(msg.regions)
            hold.asks.append((msg.seq, frozenset(msg.regions)))

    @property
    def asking(self) -> bool:
        """Some revoke waits for an answer."""
        return any(h.asks for h in self._holds.values())

    def answer(self) -> None:
        """RevokeAck each revoke none of whose regions a pending direct write targets; while a
        failed request to the owner may still run in NIXL (a lost peer), none."""
        if self._answering or not self.asking:
            return
        self._answering = True
        try:
            self._answer()
        finally:
            self._answering = False

    def _answer(self) -> None:
        for hold in list(self._holds.values()):
            if not hold.asks:
                continue
            if self._core.remotes.drain(hold.owner):
                continue  # a failed request's bytes may still land: wait until NIXL lets it go
            busy = self._busy(hold.owner)
            left = []
            for seq, regions in hold.asks:
                if regions & busy:
                    left.append((seq, regions))
                else:
                    self._send(hold.owner, RevokeAck(seq))
            hold.asks = left

    def release(self, owner: str) -> None:
        """The current snapshot of ``owner`` closed: if no write to it is pending through any
        other snapshot, tell the owner to forget this transport (a later connect holds again)."""
        hold = self._holds.get(owner)
        if hold is None or hold.closed or self._busy(owner) or self._core.remotes.drain(owner):
            return
        hold.asks.clear()  # Release answers them all: nothing of this side can land there
        hold.acked = hold.sent = 0
        self._send(owner, Release())

    def close(self) -> None:
        """The transport closes (its pending writes are cancelled): release every owner that
        still counts this transport. One released already (:meth:`release`, ``sent`` 0) or
        closed gets nothing: it may have closed meanwhile, and a send to a closed agent fails
        in NIXL with a logged error (NIXL_ERR_REMOTE_DISCONNECT)."""
        for owner, hold in list(self._holds.items()):
            if not hold.closed and hold.sent:
                self._send(owner, Release())
        self._holds.clear()

    def _busy(self, owner: str) -> set:
        """Destination regions of the direct writes to ``owner`` still pending, every snapshot."""
        busy: set = set()
        for t in self._core.remotes.pending(owner):
            dst = getattr(t, "dst_region", None)  # direct writes only (a queued one is checked when posted)
            if dst is not None and t.status() is TransferStatus.PENDING:
                busy.update(np.unique(dst).tolist())
        return busy
