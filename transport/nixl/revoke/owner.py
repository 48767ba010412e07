"""The NIXL owner's side of the revoke protocol: holders over NIXL notifications.

:class:`Holders` records each remote transport that announced a hold (:class:`~transport.
revocation.wire.Hold`): its agent metadata (loaded, so this side can answer it), its scratch
address (for liveness probes) and the regions of this side it can address. The revoke loop
itself is :class:`transport.revocation.owner.Holders`'s (``deregister`` calls
:meth:`~transport.revocation.owner.Holders.revoke`); here are NIXL's parts of it: a holder that
has not answered is *lost* once a 1-byte probe write into its scratch fails with a disconnect
(the process died; nothing more of it can come), and a ``Release`` is its letting go.

Runs on the owner's thread, inside ``deregister`` and the calls that read notifications.
"""

from __future__ import annotations

import time

from transport.revocation import owner as core
from transport.revocation.wire import Closed, Hold, Release, RevokeAck, encode

__all__ = ["Holders"]

PROBE_INTERVAL_S = 0.2  # between liveness probes of a holder that has not answered a revoke


class _Holder(core.Holder):
    def __init__(self, name: str):
        super().__init__(name, name)
        self.metadata = b""  # its agent metadata, loaded into this side's NIXL agent
        self.scratch = 0  # its 64 notification bytes (probes write one)
        self.probe = None  # the NIXL handle of a liveness probe in flight
        self.probe_at = 0.0


class Holders(core.Holders):
    """The remote transports holding an export of one NIXL transport."""

    def __init__(self, core):
        super().__init__()
        self._core = core  # transport.nixl.core.Core: agent, registry, pump()

    def _send(self, name: str, msg) -> bool:
        return self._core.agent.send(name, encode(msg))

    def _pump(self) -> None:
        self._core.pump()

    def _live(self, region_id: int) -> bool:
        return region_id in self._core.registry.view

    # -- messages from holders -------------------------------------------------------------------

    def handle(self, sender: str, msg) -> None:
        holder = self._heard(sender)
        if isinstance(msg, Hold):
            self._hold(sender, msg, holder)
        elif isinstance(msg, RevokeAck) and holder is not None:
            self._acked(holder, msg.seq)
        elif isinstance(msg, Release) and holder is not None:
            self._forget(holder)

    def _hold(self, sender: str, msg: Hold, holder) -> None:
        if holder is None or holder.metadata != msg.metadata:
            try:  # to answer it (NIXL updates an agent it already knows in place)
                self._core.agent.load(msg.metadata)
            except Exception:
                return  # cannot answer: its writes wait for the HoldAck and fail, naming this side
        if holder is None:
            holder = _Holder(sender)
        holder.metadata, holder.scratch = msg.metadata, msg.scratch
        self._answer_hold(holder, msg.seq, msg.regions)

    def _forget(self, holder: _Holder) -> None:
        self._drop_probe(holder)
        super()._forget(holder)

    # -- revoking --------------------------------------------------------------------------------

    def _send_to(self, h: _Holder, msg) -> None:
        """Send, loading ``h``'s metadata again if NIXL no longer knows it (this side removed
        that agent after a failed write of its own to it)."""
        if self._send(h.name, msg):
            return
        try:
            self._core.agent.load(h.metadata)
        except Exception:
            return  # not answered: a hold's writes fail at their wait, a revoke's holder stays silent
        self._send(h.name, msg)

    def _probe(self, h: _Holder) -> None:
        """Post or check a 1-byte write into ``h``'s scratch: a disconnect means it died."""
        agent = self._core.agent
        agent.check_open()
        if h.probe is None:
            if time.monotonic() < h.probe_at:
                return
            try:
                h.probe, state = agent.post_byte(h.name, h.scratch, b"")
            except Exception as exc:
                state = f"{type(exc).__name__}: {exc}"
            if h.probe is None or state.startswith("ERR"):  # NIXL refused it, or its posting failed
                self._judge(h, state)
                self._drop_probe(h)
                h.probe_at = time.monotonic() + PROBE_INTERVAL_S
                return
        try:
            state = agent.state(h.probe)
        except Exception as exc:
            self._judge(h, f"{type(exc).__name__}: {exc}")
            self._drop_probe(h)
            return
        if state != "PROC":  # it answered the probe (or NIXL gave up on it): probe again later
            self._drop_probe(h)
            h.probe_at = time.monotonic() + PROBE_INTERVAL_S

    def _done_waiting(self, h: _Holder) -> None:
        self._drop_probe(h)

    @staticmethod
    def _judge(h: _Holder, text: str) -> None:
        """A failed probe (``text`` says why): a disconnect means the holder died."""
        if "DISCONNECT" in text.upper():
            h.lost = text

    def _drop_probe(self, h: _Holder) -> None:
        if h.probe is not None:
            probe, h.probe = h.probe, None
            self._core.agent.release(probe)

    def revoke_all(self) -> None:
        """The transport closes: tell every holder its regions are gone; wait for nobody."""
        for h in list(self._holders.values()):
            self._send(h.name, Closed())
            self._forget(h)
