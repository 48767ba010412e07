"""The nvlink owner's side of revocation: the writers' mailbox connections that hold its export.

Each connection to this transport's inbox is one hold (one writer's ``connect``): its Hello
names the regions of the export it connected to. :class:`MailboxHolders` records those still
registered and answers ``HoldAck(0, gone)`` with the others (deregistered already, or being
revoked right now); the writer writes nothing before that answer. ``deregister`` revokes a
region with the loop of :class:`transport.revocation.owner.Holders`: a ``Revoke`` on each
connection that holds it, then reading the inbox until each answered ``RevokeAck`` or its
connection ended (the writer closed that peer, or its process is gone).

Runs on the owner's thread, inside ``deregister`` and ``poll_notifications`` (the inbox's
reads call :meth:`MailboxHolders.hello`, :meth:`~MailboxHolders.message` and
:meth:`~MailboxHolders.closed`).
"""

from __future__ import annotations

from typing import Callable

from transport.registry import RegionRegistry
from transport.revocation import owner as core
from transport.revocation.wire import Hello, Message, RevokeAck, encode

__all__ = ["MailboxHolders"]


class MailboxHolders(core.Holders):
    """The holds of one :class:`~transport.nvlink.NvlinkTransport`'s export, by connection.
    ``read_inbox``: reads the inbox now (what the revoke loop pumps)."""

    SILENCE_HINT = ("an nvlink writer answers from its mailbox thread, whatever its caller does: that process "
                    "is stopped or hangs")

    def __init__(self, registry: RegionRegistry, read_inbox: Callable[[], None]):
        super().__init__()
        self._registry = registry
        self._read_inbox = read_inbox

    def _pump(self) -> None:
        self._read_inbox()

    def _live(self, region_id: int) -> bool:
        return region_id in self._registry.view

    def _send_to(self, holder: core.Holder, msg: Message) -> None:
        holder.key.send(encode(msg))

    # -- the inbox's calls ------------------------------------------------------------------------

    def hello(self, conn, msg: Hello) -> None:
        self._answer_hold(core.Holder(conn, msg.name), 0, msg.regions)

    def message(self, conn, msg: Message) -> None:
        holder = self._heard(conn)
        if isinstance(msg, RevokeAck) and holder is not None:
            self._acked(holder, msg.seq)

    def closed(self, conn) -> None:
        holder = self._holders.get(conn)
        if holder is not None:
            self._forget(holder)
