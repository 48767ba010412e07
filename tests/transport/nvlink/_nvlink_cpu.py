"""The nvlink backend's mailbox and revocation without CUDA, for the CPU tests.

- :func:`stand_in_ipc`: makes a real :class:`~transport.nvlink.NvlinkTransport` register host
  arrays (their IPC exports stand-ins: no CUDA call), so that its register, export,
  poll_notifications, deregister and close run as they are, the owner's side of revocation
  included;
- :func:`wait_until`: polls a condition with a deadline (what the mailbox thread does next);
- :class:`CpuWriter`: the writing side of the real mailbox (``Outbox``, ``Hold``,
  ``MailboxThread``, ``PendingQueue``, ``NvlinkTransfer``) connected to such an export, whose
  copies are :class:`StandInEvent` s that end when the test says (:meth:`CpuPeer.land`, or
  after ``CpuWriter.copy_s``) and
  whose mapping of the owner's regions records what the revokes drop (:class:`DropRecorder`).
  It has a transport's calls (``register``, ``connect``, ``poll_notifications``, ``close``) and
  its peers a peer's (``write``, ``close``), so the writer process (:mod:`tests.transport._writer`)
  drives it as it drives the real ones;
- :class:`StandInLander`: the lander's contract (:class:`transport.nvlink.landed.Lander`) in
  Python, its copies ended by the test.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Optional

from transport.base import WriteBatch
from transport.nvlink import ipc
from transport.nvlink.ipc import parse_descriptor
from transport.nvlink.revoke import Hold, MailboxThread
from transport.nvlink.mailbox import Outbox
from transport.nvlink.completion import PendingQueue
from transport.nvlink.completion import NvlinkTransfer


def wait_until(what: str, check, timeout: float = 30.0) -> None:
    """Return once ``check()`` is true; fail naming ``what`` after ``timeout`` seconds (a backstop)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(1e-3)


class StandInEvent:
    """Stands in for ``torch.cuda.Event``: ``query()`` is True once ``fired`` or past ``due``
    (a ``time.monotonic()``), and raises ``error`` if given."""

    def __init__(self, error: Optional[Exception] = None, due: float = math.inf):
        self.fired, self.error, self.due = False, error, due

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.fired or time.monotonic() >= self.due


def stand_in_ipc(monkeypatch) -> None:
    """Let :class:`~transport.nvlink.NvlinkTransport` register host memory as if on a GPU: its
    CUDA API and IPC exports are stand-ins (a handle of zeros, the region its own allocation)."""
    from transport.nvlink.transport import NvlinkTransport

    monkeypatch.setattr(NvlinkTransport, "_api", lambda self: None)
    monkeypatch.setattr("transport.nvlink.transport.ipc.export_region",
                        lambda api, ptr, length, device: ipc.IpcExport(bytes(ipc.IPC_HANDLE_BYTES), 0, length))


class DropRecorder:
    """Stands in for a peer's :class:`~transport.nvlink.ipc.PeerMapping`: the region sets
    its revokes dropped, in order."""

    def __init__(self):
        self.dropped: list[set] = []

    def drop(self, regions) -> None:
        self.dropped.append(set(regions))


class CpuPeer:
    """One connection to an nvlink export, writing stand-in copies (module docstring)."""

    def __init__(self, writer: "CpuWriter", name: str, regions, mailbox: str):
        self.name = name
        self._writer = writer
        self.queue = PendingQueue(name, Outbox(mailbox, 5.0, sender=writer.name, regions=regions), 3600.0)
        self.mapping = DropRecorder()
        self.hold = Hold(name, self.queue, self.mapping)
        self.events: list[StandInEvent] = []
        writer.mailbox.add(self.hold)

    def write(self, batch: WriteBatch, notify: Optional[bytes] = None) -> NvlinkTransfer:
        """What ``NvlinkPeer._post`` does around a copy: wait for the hold's acknowledgement,
        refuse revoked regions and track the copy under the hold's lock."""
        why = self.hold.wait_ready(self._writer.revoke_timeout_s)
        if why is not None:
            return NvlinkTransfer(self.queue, None, None, error=why)
        with self.hold.lock:
            self.hold.refuse(batch.dst_region)
            self.events.append(StandInEvent(due=time.monotonic() + self._writer.copy_s))
            return self.queue.track(NvlinkTransfer(self.queue, self.events[-1], notify))

    def land(self) -> None:
        """Every stand-in copy posted so far ends."""
        for event in self.events:
            event.fired = True

    def close(self) -> None:
        self.queue.abort_all("aborted: peer closed")
        self._writer.mailbox.remove(self.hold)


class CpuWriter:
    """A writing transport of stand-in copies over the real mailbox (module docstring)."""

    def __init__(self, name: str = "cpu-writer", revoke_timeout_s: float = 5.0):
        self.name = name
        self.revoke_timeout_s = revoke_timeout_s
        self.copy_s = math.inf  # how long a stand-in copy runs (inf: until its peer's land())
        self.mailbox = MailboxThread()
        self.peers: list[CpuPeer] = []

    def register(self, ptr: int, length: int, device=None) -> int:
        return 0  # stand-in copies read nothing

    def connect(self, export: bytes) -> CpuPeer:
        body, regions, _ = parse_descriptor(export)
        self.peers.append(CpuPeer(self, body["name"], regions, body["mailbox"]))
        return self.peers[-1]

    def poll_notifications(self) -> list:
        return []

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.mailbox.stop()

    def __enter__(self) -> "CpuWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StandInLander:
    """The lander's contract in Python (:class:`transport.nvlink.landed.Lander`), its "events"
    completed by the test (:meth:`complete`): stores into the word in order, never past a
    withdrawn number before its release. The outbox and the inbox around it are real."""

    def __init__(self, word):
        self.word = word
        self.watched: dict[int, str] = {}  # number -> "watching" | "held" | "skip"
        self.done: set[int] = set()
        self.refuse = False
        self.passing = threading.Condition()  # notified whenever a number is passed
        self.awaited = 0  # how often something waited in awaiting()
        self.bell = None  # the receiver's doorbell, rung after each store (ring)

    def ring(self, bell: int) -> None:
        self.bell = os.dup(bell)  # the lander's own, as the C one keeps

    def watch(self, number: int, event) -> None:
        if self.refuse:
            raise ValueError("no event to wait on")
        self.watched[number] = "watching"

    def complete(self, number: int) -> None:
        self.done.add(number)
        self.land()

    def land(self) -> None:
        for number in sorted(self.watched):
            state = self.watched[number]
            if state == "held" or (state == "watching" and number not in self.done):
                return
            if state == "watching":
                self.word.store(number)
                if self.bell is not None:
                    os.eventfd_write(self.bell, 1)
            del self.watched[number]
            with self.passing:
                self.passing.notify_all()

    def landed(self, number: int) -> bool:
        return self.word.value >= number

    def withdraw(self, number: int) -> bool:
        if self.word.value >= number:
            return False
        self.watched[number] = "held"
        return True

    def release(self, number: int) -> None:
        self.watched[number] = "skip"
        self.land()

    def awaiting(self, number: int, event):
        lander = self

        class Passing:
            def synchronize(self) -> None:
                lander.awaited += 1
                with lander.passing:
                    lander.passing.wait_for(lambda: number not in lander.watched, timeout=0.01)

        return Passing()

    def close(self) -> None:
        self.watched.clear()
        if self.bell is not None:
            os.close(self.bell)
            self.bell = None
