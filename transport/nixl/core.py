"""The parts of one NIXL transport, and the pump that reads NIXL's notifications for them.

:class:`Core` is the internal interface between the parts: each part is handed the core and uses
only the public members listed in its docstring, never another part's private ones. The
public :class:`~transport.nixl.transport.NixlTransport` owns one core and implements the
contract on it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from transport.base import Notification
from transport.nixl.agent import Agent
from transport.nixl.config import NixlConfig
from transport.nixl.prepped import PreparedLists
from transport.nixl.regions import STAGING, RegionTable, descs
from transport.nixl.remotes import Remotes
from transport.nixl.revoke import Holders, Holds
from transport.nixl.staged import wire as staged_wire
from transport.nixl.staged.receiver import ReceiverLanes
from transport.nixl.staged.lane import SenderLanes
from transport.registry import RegionRegistry
from transport.revocation import wire as revoke_wire

if TYPE_CHECKING:
    from transport.nixl.peer import NixlPeer

__all__ = ["Core"]

# how long one pump keeps reading NIXL's notifications while staged scatters run (so the next
# chunks are handled meanwhile) before it only waits for those scatters and returns: a bound on
# how long a poll holds its caller beyond the scatters themselves
_READ_WHILE_SCATTERING_S = 1e-3


class Core:
    """What the parts of one transport share.

    - ``config``, ``agent`` (:class:`~transport.nixl.agent.Agent`: every NIXL call),
      ``registry`` (this side's regions; :meth:`table` their descriptor table) and ``lists``
      (prepared lists of them, :mod:`transport.nixl.prepped`);
    - ``remotes`` (:class:`~transport.nixl.remotes.Remotes`: peers, losses, loaded entries by
      remote agent);
    - ``lanes`` and ``receiver``: the staged mode's sending and receiving lanes
      (:mod:`transport.nixl.staged`);
    - ``holds`` and ``holders``: revocation, as writer and as owner (:mod:`transport.nixl.revoke`);
    - :meth:`pump` / :meth:`service`: read NIXL's notifications and hand each to its part;
      :meth:`deliver` queues the owner's notifications for ``poll_notifications``.
    """

    def __init__(self, config: NixlConfig):
        self.config = config
        self.agent = Agent(config)
        self.registry = RegionRegistry()  # handles: NIXL's registration of each region
        self.remotes = Remotes(self.agent)
        self.lists = PreparedLists(self.agent, None, lambda: self.registry.view)
        self.lanes = SenderLanes(self)
        self.receiver = ReceiverLanes(self)
        self.holds = Holds(self)
        self.holders = Holders(self)
        self.notes: list[Notification] = []  # the owner's notifications read by pump, not yet polled
        self._pumping = False
        self._last_pump = 0.0

    def table(self) -> RegionTable:
        """This side's live regions as a descriptor table."""
        return self.registry.derived(RegionTable)

    def registered(self) -> list[list[int]]:
        """What this agent's metadata registers, as a peer that loads it from a staged Hello or
        Welcome records it (``Remotes.loaded_too``): each region as :func:`~transport.nixl.regions.descs`
        gives it and each staged lane's memory (region id ``STAGING``); the scratch bytes live as
        long as the agent."""
        stagings = self.lanes.stagings() + self.receiver.stagings()
        return [list(d) for d in descs(self.registry.view)] + [
            [STAGING, s.ptr, s.nbytes, -1 if s.device is None else s.device] for s in stagings]

    def deliver(self, note: Notification) -> None:
        self.notes.append(note)

    # -- notifications ---------------------------------------------------------------------------

    def service(self) -> None:
        """:meth:`pump` at most once a millisecond (what a transfer's ``status()`` calls)."""
        if time.monotonic() - self._last_pump >= 1e-3:
            self.pump()

    def pump(self) -> None:
        """Read NIXL's notifications: revoke messages go to the holds / holders, staged messages
        to the lanes (a receiver scatters here), the owner's are queued (:meth:`deliver`), each
        sender's in order; then answer the revokes whose writes have finished. While scatters of
        staged chunks are in flight, NIXL's notifications are read again for up to
        ``_READ_WHILE_SCATTERING_S`` (the next chunks are handled while the GPU scatters), else
        the oldest scatter is waited for; it returns once every staged answer went out
        (:mod:`transport.nixl.staged.receiver`). Not re-entered (a revoke answer checks
        transfers, whose ``status()`` pumps)."""
        self.agent.check_open()
        if self._pumping:
            return
        self._pumping = True
        receiver = self.receiver
        try:
            self._last_pump = time.monotonic()
            read_until = self._last_pump + _READ_WHILE_SCATTERING_S
            reading = True
            while True:
                notes = self.agent.read() if reading else {}
                for sender, msgs in notes.items():
                    for raw in msgs:
                        self._take(sender, raw)
                receiver.answer()
                if not receiver.in_flight:
                    break
                reading = time.monotonic() < read_until
                if not notes or not reading:
                    receiver.wait_oldest()
            self.holds.answer()
        finally:
            self._pumping = False

    def _take(self, sender: str, raw: bytes) -> None:
        """One notification from ``sender`` (see :meth:`pump`)."""
        try:
            control = revoke_wire.decode(raw)
        except revoke_wire.ProtocolError:
            return  # a revoke message that does not decode carries nothing to act on
        if isinstance(control, (revoke_wire.Hold, revoke_wire.RevokeAck, revoke_wire.Release)):
            self.holders.handle(sender, control)
            return
        if control is not None:
            self.holds.handle(sender, control)
            if isinstance(control, (revoke_wire.Revoke, revoke_wire.Closed)) or (
                    isinstance(control, revoke_wire.HoldAck) and control.gone):
                self.release_lists(sender)  # they name regions of it that are revoked now
            return
        try:
            msg = staged_wire.decode(raw)
        except staged_wire.ProtocolError:
            return  # a staged message that does not decode carries nothing to deliver
        if msg is None:
            self.receiver.deliver(sender, raw)
        elif isinstance(msg, (staged_wire.Hello, staged_wire.Chunk)):
            self.receiver.handle(sender, msg)
        else:
            self.lanes.on_message(sender, msg)

    # -- remote agents ---------------------------------------------------------------------------

    def release_lists(self, name: str) -> None:
        """Release the prepared lists of every snapshot of the remote agent ``name``."""
        for peer in self.remotes.snapshots(name):
            peer.lists.release()

    def remove_remote(self, name: str) -> None:
        """Forget the remote agent ``name`` in NIXL, and its lane (whose lists name its regions)."""
        if self.agent.closed:
            return
        self.lanes.drop(name)
        self.remotes.loaded.pop(name, None)
        self.release_lists(name)
        self.agent.remove(name)

    def forget_peer(self, peer: "NixlPeer") -> None:
        """The current peer of a remote agent closed (a retired snapshot leaves it alone).

        A lost agent (a transfer failed in the backend) is removed from NIXL. A live one stays
        loaded, idle, and a later ``connect`` to it reuses its endpoint: NIXL's
        ``remove_remote_agent`` forgets the metadata but not the UCX connection (over tcp each
        side's UCP worker keeps the endpoint the wire-up created, one socket per connect on both
        sides until a worker is destroyed or the peer process exits), so removing and loading
        again would leak a socket per cycle on both sides."""
        remotes = self.remotes
        if remotes.current.get(peer.name) is not peer:
            return
        del remotes.current[peer.name]
        self.holds.release(peer.name)  # the owner stops counting this transport (if nothing is pending)
        if peer.name in remotes.lost and not remotes.drain(peer.name):
            del remotes.lost[peer.name]
            self.remove_remote(peer.name)
        else:  # live, or its failed requests still run: the next connect drains first
            remotes.idle.add(peer.name)
