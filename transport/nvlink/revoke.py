"""Revocation over the mailbox: the writer's holds of a peer's export and the transport's
mailbox thread, and the owner's record of the writers that hold its export.

A peer that connected to an export opened the CUDA IPC handle of each region's allocation; its
kernel stores go straight to that GPU memory, which the owner cannot refuse: after a plain
``cudaFree`` or a reuse of the caching allocator's block they would land in memory CUDA calls
undefined, or in another tensor. So ``deregister`` first revokes the region from every peer
that holds an export naming it (the revoke loop and its messages are
:mod:`transport.revocation`'s, shared with the nixl backend).

The writer's side (:class:`Hold`, :class:`MailboxThread`)
---------------------------------------------------------
Each :class:`~transport.nvlink.transport.NvlinkPeer` (each ``connect``) opens one mailbox
connection, whose Hello names the regions of the export it connected to; that connection is
its :class:`Hold`:

- the owner answers the Hello with ``HoldAck(0, gone)``: the peer posts no copy before it
  (:meth:`Hold.wait_ready`, at most ``NvlinkConfig.revoke_timeout_s``, then its write FAILS
  naming the receiver), and ``gone`` (regions deregistered already, or being revoked) joins its
  revoked regions, unmapped at once: a writer that connects after a ``deregister`` with an
  older export can never write the region;
- a ``Revoke(seq, regions)`` adds them to the revoked regions at once (a later write naming
  them raises ``RegionRevoked``: :meth:`Hold.refuse`, a truth test while none is revoked) and
  takes a snapshot, under :attr:`Hold.lock`, of the completion events of every copy of this
  peer that may still run (pending transfers and failed ones whose copy has not ended). Writes
  check the revoked regions and post under the same lock, so no copy into those regions can
  start after the snapshot. Once every event of the snapshot has completed, the peer's
  mappings of those regions are closed (:meth:`~transport.nvlink.ipc.PeerMapping.drop`) and
  ``RevokeAck(seq)`` goes back. The snapshot holds the peer's copies into other regions too:
  the copy stream runs in order, so they end no later than a copy posted after them.

:class:`MailboxThread` (one per transport, started at its first ``connect``) blocks in
``poll(2)`` on every hold's connection and reads what comes (:meth:`Hold.read`); while a
revoke waits for copies it looks again every :attr:`MailboxThread.POLL_S`. It also notes the
end of a connection (the owner's process died or its transport closed): the peer's writes
then fail at once (``Outbox.alive``). ``Peer.close()`` ends the connection itself
(:meth:`MailboxThread.remove`: the owner reads the end and forgets the hold).

The owner's side (:class:`MailboxHolders`)
------------------------------------------
Each connection to this transport's inbox is one hold (one writer's ``connect``).
:class:`MailboxHolders` records the regions of its Hello still registered and answers
``HoldAck(0, gone)`` with the others; ``deregister`` revokes a region with the loop of
:class:`transport.revocation.owner.Holders`: a ``Revoke`` on each connection that holds it,
then reading the inbox until each answered ``RevokeAck`` or its connection ended. A writer that
neither answers nor ends within ``revoke_timeout_s`` is silent: ``deregister`` raises
``RevokeTimeout`` naming it and the region stays registered; ``deregister(rid, force=True)``
releases it anyway. ``close()`` ends every connection and waits for nobody. Runs on the owner's
thread, inside ``deregister`` and ``poll_notifications`` (the inbox's reads call
:meth:`MailboxHolders.hello`, :meth:`~MailboxHolders.message` and
:meth:`~MailboxHolders.closed`).

Not proven here: that no copy a killed writer queued can still run once the end of its
connection is read (its process's sockets and CUDA context are both torn down at exit, in an
order this side cannot see).
"""

from __future__ import annotations

import select
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from transport.base import RegionRevoked
from transport.nvlink.completion import PendingQueue, running
from transport.registry import RegionRegistry
from transport.revocation import owner as core
from transport.revocation.holder import Revoked
from transport.revocation.wire import Hello, HoldAck, Message, ProtocolError, Revoke, RevokeAck, decode, encode

__all__ = ["Hold", "MailboxHolders", "MailboxThread"]


# -- the writer's side -----------------------------------------------------------------------------


@dataclass
class _Ask:
    """A revoke not answered yet: its seq, its regions, the events of the copies it waits for."""

    seq: int
    regions: frozenset
    events: list


class Hold:
    """One peer's hold of ``owner``'s export: its revoked regions and unanswered revokes.

    ``queue``: the peer's transfers (and its outbox); ``mapping``: its mapping of the owner's
    regions (anything with ``drop(regions)``)."""

    def __init__(self, owner: str, queue: PendingQueue, mapping):
        self.owner = owner
        self.queue = queue
        self.outbox = queue.outbox
        self.mapping = mapping
        self.lock = threading.Lock()  # held by a write's check and post, and by a revoke's snapshot
        self.revoked = Revoked()
        self.acked = False  # the owner answered the Hello
        self._ready = threading.Event()  # set at the HoldAck, or at the connection's end
        self.asks: list[_Ask] = []  # the mailbox thread's alone
        self.removed = False  # the peer closed: the mailbox thread closes the socket

    # -- the writer's thread ------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> Optional[str]:
        """Block until the owner answered the Hello; why not (after ``timeout_s``, or the
        connection ended), else None."""
        if self.acked:
            return None
        self._ready.wait(timeout_s)
        if self.acked:
            return None
        if self.outbox.lost:
            return f"peer {self.owner!r} lost (its socket closed)"
        return (f"peer {self.owner!r} did not acknowledge this transport's hold of its export within {timeout_s:g} s "
                "(an nvlink receiver answers in poll_notifications() and deregister(); nothing was written)")

    def refuse(self, dst_region: np.ndarray) -> None:
        """``RegionRevoked`` when ``dst_region`` ([n] ids of the owner's) names a revoked region.
        Called under :attr:`lock`, which stays held until the copy is posted and tracked."""
        why = self.revoked.check(self.owner, dst_region) if self.revoked else None
        if why is not None:
            raise RegionRevoked(why)

    # -- the mailbox thread ---------------------------------------------------------------------------

    def read(self) -> None:
        """Take what the owner sent; at the connection's end nobody waits for an answer."""
        for frame in self.outbox.receive():
            try:
                msg = decode(frame)
            except ProtocolError:
                continue  # carries nothing to act on: a revoke this side cannot read stays unanswered
            if isinstance(msg, HoldAck):
                with self.lock:
                    self.revoked.drop(msg.gone)
                if msg.gone:  # no copy went yet: unmap what the export named and the owner no longer has
                    self.mapping.drop(msg.gone)
                self.acked = True
                self._ready.set()
            elif isinstance(msg, Revoke):
                with self.lock:  # no copy can start into these regions after the snapshot
                    self.revoked.drop(msg.regions)
                    events = self.queue.events()
                self.asks.append(_Ask(msg.seq, frozenset(msg.regions), events))
        if self.outbox.lost:
            self.asks.clear()
            self._ready.set()

    def answer(self) -> None:
        """RevokeAck each revoke whose copies have all ended, once its regions are unmapped."""
        left = []
        for ask in self.asks:
            ask.events = [e for e in ask.events if running(e)]
            if ask.events:
                left.append(ask)
                continue
            self.mapping.drop(ask.regions)
            try:
                self.outbox.send_control(encode(RevokeAck(ask.seq)))
            except OSError:
                pass  # the owner is gone: it waits for nobody
        self.asks = left


class MailboxThread:
    """The thread that reads what owners send to this transport's peers (module docstring)."""

    POLL_S = 1e-3  # between looks at the copies a revoke waits for

    def __init__(self, name: str = "nvlink-mailbox"):
        self._name = name
        self._lock = threading.Lock()
        self._new: list[Hold] = []  # added, not picked up by the thread yet
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.error: Optional[str] = None  # the last unexpected error of the thread (it goes on)

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._new.append(hold)
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake()

    def remove(self, hold: Hold) -> None:
        """The peer closes: its connection ends now (the owner reads its end); the thread
        closes the socket."""
        hold.outbox.shutdown()
        hold.removed = True
        self._wake()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout=5)
        for hold in self._new:  # never picked up
            hold.outbox.close()
        self._new.clear()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the thread wakes anyway) or closed
            pass

    def _run(self) -> None:
        poller = select.poll()
        wake = self._wake_r.fileno()
        poller.register(wake, select.POLLIN)
        holds: dict[int, Hold] = {}  # fd -> hold, until the peer closes
        polled: set[int] = set()  # fds whose connection has not ended
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    new, self._new = self._new, []
                for hold in new:
                    fd = hold.outbox.fileno()
                    if fd < 0:  # closed before this thread saw it: nothing to read
                        continue
                    holds[fd] = hold
                    polled.add(fd)
                    poller.register(fd, select.POLLIN)
                for fd, hold in list(holds.items()):
                    if hold.removed:
                        self._forget(poller, polled, fd)
                        del holds[fd]
                        hold.outbox.close()
                waiting = any(hold.asks for hold in holds.values())
                for fd, _ in poller.poll(self.POLL_S * 1e3 if waiting else None):
                    if fd == wake:
                        self._drain_wake()
                    elif fd in polled:
                        self._guard(holds[fd].read)
                        if holds[fd].outbox.lost:
                            self._forget(poller, polled, fd)
                for hold in holds.values():
                    if hold.asks:
                        self._guard(hold.answer)
        finally:
            for hold in holds.values():
                hold.outbox.close()

    @staticmethod
    def _forget(poller, polled: set, fd: int) -> None:
        if fd in polled:
            polled.discard(fd)
            poller.unregister(fd)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _guard(self, step) -> None:
        """Run ``step``; an unexpected error is kept in :attr:`error` and the thread goes on (an
        unanswered revoke leaves the region registered at its owner: RevokeTimeout)."""
        try:
            step()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"


# -- the owner's side ------------------------------------------------------------------------------


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
