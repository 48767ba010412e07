"""The owner's side of the revoke protocol: who holds this transport's export, and revoking.

:class:`Holders` records each remote transport that announced a hold (:class:`~transport.
nixl_revoke.wire.Hold`): its agent metadata (loaded, so this side can answer it), its scratch
address (for liveness probes) and the regions of this side it can address. ``deregister``
calls :meth:`Holders.revoke` before it releases a region:

1. every holder that can address the region is sent a :class:`~transport.nixl_revoke.wire.
   Revoke` (``send_notif``);
2. this side then reads its notifications (which also drives its UCX progress, so holders'
   writes into the region keep landing) until each of them answered with a RevokeAck or a
   Release, or is *lost*: a 1-byte probe write into its scratch fails with a disconnect (the
   process died; nothing more of it can come);
3. a holder that neither answered nor was lost within ``timeout_s`` is *silent*: it may still
   write into the region, so ``revoke`` raises :class:`~transport.base.RevokeTimeout` naming it
   and the region stays registered -- unless ``force``, which gives up on it for this region.
   A silent holder's later revokes wait no more (they fail at once, or go ahead with ``force``)
   until it answers anything again.

Runs on the owner's thread, inside ``deregister`` and the calls that read notifications.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from transport.base import RevokeTimeout
from transport.nixl_revoke.wire import Closed, Hold, HoldAck, Release, Revoke, RevokeAck, encode

__all__ = ["Holders"]

PROBE_INTERVAL_S = 0.2  # between liveness probes of a holder that has not answered a revoke


class _Holder:
    def __init__(self, name: str):
        self.name = name
        self.metadata = b""  # its agent metadata, loaded into this side's NIXL agent
        self.scratch = 0  # its 64 notification bytes (probes write one)
        self.regions: set[int] = set()  # this side's regions it can address
        self.acked = 0  # seq of the last RevokeAck from it
        self.silent_since: Optional[float] = None  # a revoke went unanswered past its timeout
        self.probe = None  # the NIXL handle of a liveness probe in flight
        self.probe_at = 0.0
        self.lost: Optional[str] = None  # why it is known dead


class Holders:
    """The remote transports holding an export of one :class:`~transport.nixl.NixlTransport`."""

    def __init__(self, transport):
        self._t = transport
        self._holders: dict[str, _Holder] = {}
        self._seq = 0
        self._revoking: set[int] = set()  # regions a deregister is revoking: gone for a Hold that comes now

    def _send(self, name: str, msg) -> bool:
        try:
            self._t._agent_checked().send_notif(name, encode(msg))
            return True
        except Exception:
            return False

    # -- messages from holders -------------------------------------------------------------------

    def handle(self, sender: str, msg) -> None:
        holder = self._holders.get(sender)
        if holder is not None:
            holder.silent_since = None  # it runs
        if isinstance(msg, Hold):
            self._hold(sender, msg, holder)
        elif isinstance(msg, RevokeAck) and holder is not None:
            holder.acked = max(holder.acked, msg.seq)
        elif isinstance(msg, Release) and holder is not None:
            self._forget(holder)

    def _hold(self, sender: str, msg: Hold, holder: Optional[_Holder]) -> None:
        agent = self._t._agent_checked()
        if holder is None or holder.metadata != msg.metadata:
            try:  # to answer it (NIXL updates an agent it already knows in place)
                agent.add_remote_agent(msg.metadata)
            except Exception:
                return  # cannot answer: its writes wait for the HoldAck and fail, naming this side
        if holder is None:
            holder = self._holders[sender] = _Holder(sender)
        holder.metadata, holder.scratch = msg.metadata, msg.scratch
        live = {r for r in msg.regions if r in self._t._registry.view and r not in self._revoking}
        holder.regions |= live
        self._send_to(holder, HoldAck(msg.seq, sorted(r for r in msg.regions if r not in live)))

    def _forget(self, holder: _Holder) -> None:
        self._drop_probe(holder)
        self._holders.pop(holder.name, None)

    # -- revoking --------------------------------------------------------------------------------

    def revoke(self, region_id: int, timeout_s: float, force: bool) -> None:
        """Return once no holder can write into ``region_id`` any more (each acknowledged its
        revoke or is lost), or, with ``force``, once the silent ones were given up on;
        :class:`RevokeTimeout` naming the silent holders otherwise. A hold that arrives
        meanwhile is answered with the region gone."""
        self._revoking.add(region_id)
        try:
            self._revoke(region_id, timeout_s, force)
        finally:
            self._revoking.discard(region_id)

    def _revoke(self, region_id: int, timeout_s: float, force: bool) -> None:
        self._t._pump()  # holds, releases and acks that already came
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
            self._t._pump()
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
            self._drop_probe(h)
        if not waiting:
            return
        now = time.monotonic()
        for h in waiting:
            h.silent_since = h.silent_since or now
        if force:
            for h in waiting:
                h.regions.discard(region_id)
            return
        names = sorted(h.name for h in waiting)
        raise RevokeTimeout(
            f"region {region_id} is still held by peer(s) {names}: no acknowledgement of its revocation within "
            f"{timeout_s:g} s, and they are not known dead (a holder answers in its calls into its transport); "
            "the region stays registered: keep its memory, deregister again later, or deregister(force=True) "
            "to release it anyway (a silent holder could then still write into it)")

    def _waits(self, h: _Holder, seq: int) -> bool:
        """``h`` has neither answered revoke ``seq`` nor released nor been lost."""
        return self._holders.get(h.name) is h and h.acked < seq and h.lost is None

    def _send_to(self, h: _Holder, msg) -> None:
        """Send, loading ``h``'s metadata again if NIXL no longer knows it (this side removed
        that agent after a failed write of its own to it)."""
        if self._send(h.name, msg):
            return
        try:
            self._t._agent_checked().add_remote_agent(h.metadata)
        except Exception:
            return  # not answered: a hold's writes fail at their wait, a revoke's holder stays silent
        self._send(h.name, msg)

    def _probe(self, h: _Holder) -> None:
        """Post or check a 1-byte write into ``h``'s scratch: a disconnect means it died."""
        agent = self._t._agent_checked()
        if h.probe is None:
            if time.monotonic() < h.probe_at:
                return
            local = np.array([[self._t._scratch.ctypes.data, 1, 0]], dtype=np.uint64)  # [1, 3]
            remote = np.array([[h.scratch, 1, 0]], dtype=np.uint64)  # [1, 3]
            try:
                h.probe, _ = self._t._post(h.name, local, "DRAM", remote, "DRAM", b"")
            except Exception as exc:
                self._judge(h, exc)
                h.probe_at = time.monotonic() + PROBE_INTERVAL_S
                return
        try:
            state = agent.check_xfer_state(h.probe)
        except Exception as exc:
            self._judge(h, exc)
            self._drop_probe(h)
            return
        if state != "PROC":  # it answered the probe (or NIXL gave up on it): probe again later
            self._drop_probe(h)
            h.probe_at = time.monotonic() + PROBE_INTERVAL_S

    @staticmethod
    def _judge(h: _Holder, exc: Exception) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if "DISCONNECT" in text.upper():
            h.lost = text

    def _drop_probe(self, h: _Holder) -> None:
        if h.probe is not None:
            probe, h.probe = h.probe, None
            self._t._release_handle(probe)

    def revoke_all(self) -> None:
        """The transport closes: tell every holder its regions are gone; wait for nobody."""
        for h in list(self._holders.values()):
            self._send(h.name, Closed())
            self._forget(h)
