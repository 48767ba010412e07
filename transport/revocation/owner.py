"""The owner's side of revocation, common to the backends: who holds this transport's export,
and revoking a region from them before it is deregistered.

A backend subclasses :class:`Holders` and records each remote transport that announced a
hold of its export (a :class:`Holder`: the regions of this side it can address) with
:meth:`Holders._answer_hold`. ``deregister`` calls :meth:`Holders.revoke` before it releases a
region:

1. every holder that can address the region is sent a :class:`~transport.revocation.wire.Revoke`;
2. this side then reads the holders' messages (:meth:`Holders._pump`, which for NIXL also
   drives its UCX progress, so holders' writes into the region keep landing) until each of
   them answered with a RevokeAck, let go (NIXL's Release, the end of nvlink's mailbox
   connection: :meth:`Holders._forget`), or is *lost* (:meth:`Holders._probe` found it dead);
3. a holder that neither answered nor was lost within ``timeout_s`` is *silent*: it may still
   write into the region, so ``revoke`` raises :class:`~transport.base.RevokeTimeout` naming it
   and the region stays registered -- unless ``force``, which gives up on it for this region.
   A silent holder's later revokes wait no more (they fail at once, or go ahead with ``force``)
   until it answers anything again (:meth:`Holders._heard`).

A hold that arrives while a region is being revoked is answered with that region gone.
Runs on the owner's thread, inside ``deregister`` and the calls that read its messages.
"""

from __future__ import annotations

import abc
import time
from typing import Hashable, Iterable, Optional

from transport.errors import RevokeTimeout
from transport.revocation.wire import HoldAck, Message, Revoke

__all__ = ["Holder", "Holders"]

LET_GO_KEPT = 1024  # holders that let go or were lost, remembered for Holders.gone


class Holder:
    """One hold of this side's export: a remote transport that can address some of its regions."""

    def __init__(self, key: Hashable, name: str):
        self.key = key  # the backend's handle on it (NIXL: its agent name; nvlink: its mailbox connection)
        self.name = name  # the remote transport's name, for messages
        self.regions: set[int] = set()  # this side's regions it can address
        self.acked = 0  # seq of the last RevokeAck from it
        self.silent_since: Optional[float] = None  # a revoke went unanswered past its timeout
        self.lost: Optional[str] = None  # why it is known dead


class Holders(abc.ABC):
    """The holds of one transport's export, by :attr:`Holder.key`; see the module docstring."""

    # Why a silent holder may be silent, for RevokeTimeout's message.
    SILENCE_HINT = "a holder answers in its calls into its transport"

    def __init__(self):
        self._holders: dict[Hashable, Holder] = {}
        self._seq = 0
        self._revoking: set[int] = set()  # regions a deregister is revoking: gone for a hold that comes now
        self._let_go: dict[str, str] = {}  # holder name -> how it went (let go or lost), until it holds again

    # -- what a backend provides -----------------------------------------------------------------

    @abc.abstractmethod
    def _pump(self) -> None:
        """Read the holders' messages that came (they arrive here as :meth:`_answer_hold`,
        :meth:`_heard` and :meth:`_forget`)."""

    @abc.abstractmethod
    def _live(self, region_id: int) -> bool:
        """``region_id`` is registered here."""

    @abc.abstractmethod
    def _send_to(self, holder: Holder, msg: Message) -> None:
        """Send ``msg`` to ``holder``; a failure is silent (the holder then stays silent or is lost)."""

    def _probe(self, holder: Holder) -> None:
        """Find out whether ``holder``, which has not answered a revoke, died (set ``holder.lost``).
        Here nothing: the backend's :meth:`_pump` forgets a holder whose connection ended."""

    def _done_waiting(self, holder: Holder) -> None:
        """A revoke no longer waits for ``holder`` (release what its probes hold)."""

    def _forget(self, holder: Holder) -> None:
        """``holder`` let go, or is lost: it holds nothing of this side any more."""
        if self._holders.get(holder.key) is holder:
            del self._holders[holder.key]
            self._let_go.pop(holder.name, None)  # newest last: the oldest go first past the bound
            self._let_go[holder.name] = f"is lost ({holder.lost})" if holder.lost else "let go of this side's export"
            while len(self._let_go) > LET_GO_KEPT:
                del self._let_go[next(iter(self._let_go))]

    @property
    def seq(self) -> int:
        """The seq of the latest revoke sent (0 before the first)."""
        return self._seq

    def holding(self) -> list[Holder]:
        """The holders recorded now, a snapshot (for inspection; the protocol reads its own)."""
        return list(self._holders.values())

    def gone(self, name: str) -> Optional[str]:
        """Why the holder named ``name`` can write nothing more here (it let go, or is lost),
        else None (it holds, or was never heard of). A holder that holds is probed
        (:meth:`_probe`, which paces itself): its loss shows on a later call."""
        holder = next((h for h in self._holders.values() if h.name == name), None)
        if holder is None:
            return self._let_go.get(name)
        if holder.lost is None:
            self._probe(holder)
        if holder.lost is None:
            return None
        self._forget(holder)
        return self._let_go[name]

    # -- holds -----------------------------------------------------------------------------------

    def _heard(self, key: Hashable) -> Optional[Holder]:
        """The holder under ``key``, which just said something (so it runs: not silent), or None."""
        holder = self._holders.get(key)
        if holder is not None:
            holder.silent_since = None
        return holder

    def _answer_hold(self, holder: Holder, seq: int, regions: Iterable[int]) -> None:
        """Record ``holder`` (under its key) as holding those of ``regions`` that are live and not
        being revoked, and answer ``HoldAck(seq, the others)``."""
        regions = list(regions)
        self._holders[holder.key] = holder
        self._let_go.pop(holder.name, None)  # it holds again
        live = {r for r in regions if self._live(r) and r not in self._revoking}
        holder.regions |= live
        self._send_to(holder, HoldAck(seq, sorted({r for r in regions if r not in live})))

    def _acked(self, holder: Holder, seq: int) -> None:
        holder.acked = max(holder.acked, seq)

    # -- revoking --------------------------------------------------------------------------------

    def revoke(self, region_id: int, timeout_s: float, force: bool) -> None:
        """Return once no holder can write into ``region_id`` any more (each acknowledged its
        revoke, let go or is lost), or, with ``force``, once the silent ones were given up on;
        :class:`RevokeTimeout` naming the silent holders otherwise. A hold that arrives
        meanwhile is answered with the region gone."""
        self._revoking.add(region_id)
        try:
            self._revoke(region_id, timeout_s, force)
        finally:
            self._revoking.discard(region_id)

    def _revoke(self, region_id: int, timeout_s: float, force: bool) -> None:
        self._pump()  # holds, releases and acks that already came
        targets = [h for h in self._holders.values() if region_id in h.regions]
        if not targets:
            return
        self._seq += 1
        seq = self._seq
        for h in targets:
            self._send_to(h, Revoke(seq, [region_id]))
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        while True:
            self._pump()
            waiting = [h for h in targets if self._waits(h, seq)]
            for h in waiting:
                self._probe(h)
            waiting = [h for h in waiting if h.lost is None]
            if not waiting or all(h.silent_since is not None for h in waiting) or time.monotonic() > deadline:
                break
            time.sleep(sleep)
            sleep = min(1e-3, sleep * 2 or 1e-5)
        for h in targets:
            if h.lost is not None:
                self._forget(h)
            elif not self._waits(h, seq):
                h.regions.discard(region_id)
            self._done_waiting(h)
        if not waiting:
            return
        now = time.monotonic()
        for h in waiting:
            h.silent_since = h.silent_since or now
        if force:
            for h in waiting:
                h.regions.discard(region_id)
            return
        names = sorted({h.name for h in waiting})
        raise RevokeTimeout(
            f"region {region_id} is still held by peer(s) {names}: no acknowledgement of its revocation within "
            f"{timeout_s:g} s, and they are not known dead ({self.SILENCE_HINT}); "
            "the region stays registered: keep its memory, deregister again later, or deregister(force=True) "
            "to release it anyway (a silent holder could then still write into it)")

    def _waits(self, h: Holder, seq: int) -> bool:
        """``h`` has neither answered revoke ``seq`` nor let go nor been lost."""
        return self._holders.get(h.key) is h and h.acked < seq and h.lost is None
