"""One peer rank's session, as either manager sees it: :class:`PeerSession`.

Prefill and decode ranks keep a session per peer: its state (hello sent, ready, refused, lost,
gone), the incarnation and process its hello named, and its silence. Decode sends the
heartbeats and counts a peer's silence from the first heartbeat it left unanswered (while
this rank's own loop was paused and sent none, the silence is not the peer's); prefill answers
them and counts silence from the last message it read. Either way, a peer silent past the
heartbeat timeout is lost only after what came on its socket meanwhile has been read
(:func:`confirm_silent`): a long turn of this rank's loop is its own pause, not the peer's.
A peer silent for two heartbeat intervals is *suspect*, and one whose process is seen to have
ended (one host, :mod:`kvtransfer.control.liveness`) is lost without waiting for the timeout.

:class:`Fences` hold the failed requests of a peer lost to silence: it may have been only
paused, so their pages wait for proof that none of its writes can still land.

Loop thread only, like the managers' other bookkeeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from kvtransfer.control.config import ControlConfig
from kvtransfer.control.liveness import ProcessId, ended
from kvtransfer.control.wire import Heartbeat

__all__ = ["Fences", "PeerSession", "PeerState", "confirm_silent"]


class PeerState(enum.Enum):
    CONNECTING = "connecting"  # hello sent, no answer yet
    READY = "ready"
    REFUSED = "refused"  # the hello was refused: the session's error says why
    LOST = "lost"  # silent past the timeout, or closed; waiting for it to come back
    GONE = "gone"  # said goodbye and was answered: it can no longer write here


@dataclass
class PeerSession:
    """A peer rank's session (module docstring). ``sends_heartbeats``: this side sends them
    (decode), and silence counts from the first unanswered one; else (prefill) from the last
    message read."""

    config: ControlConfig
    sends_heartbeats: bool
    state: PeerState
    since: float  # when the state was entered
    silent_since: Optional[float] = None  # None: nothing is awaited from the peer
    incarnation: str = ""  # the one its hello (ack) named
    process: Optional[ProcessId] = None  # the process its hello (ack) named (None: it could not)
    error: str = ""  # why it was refused or lost
    heartbeat_seq: int = 0
    last_heartbeat: float = 0.0

    @classmethod
    def answering(cls, config: ControlConfig, now: float, process: Optional[ProcessId]) -> "PeerSession":
        """The session of a peer that sent its hello (prefill's side: it answers heartbeats)."""
        return cls(config, False, PeerState.READY, now, silent_since=now, process=process)

    @classmethod
    def calling(cls, config: ControlConfig, now: float) -> "PeerSession":
        """The session of a peer this rank said hello to (decode's side: it sends heartbeats)."""
        return cls(config, True, PeerState.CONNECTING, now)

    def enter(self, state: PeerState, now: float, error: str = "") -> None:
        self.state, self.since = state, now
        if error:
            self.error = error

    def heard(self, now: float) -> None:
        """A message came from the peer."""
        self.silent_since = None if self.sends_heartbeats else now

    def heartbeat(self, now: float, incarnation: str) -> Optional[Heartbeat]:
        """The heartbeat to send now, if one is due (ready or lost peers: a lost one that
        answers was alive after all); silence counts from the first one unanswered."""
        if self.state not in (PeerState.READY, PeerState.LOST) or \
                now - self.last_heartbeat < self.config.heartbeat_interval_s:
            return None
        self.heartbeat_seq += 1
        self.last_heartbeat = now
        if self.silent_since is None:
            self.silent_since = now
        return Heartbeat(seq=self.heartbeat_seq, incarnation=incarnation)

    def silence(self, now: float) -> float:
        return 0.0 if self.silent_since is None else now - self.silent_since

    def timed_out(self, now: float) -> bool:
        """Ready, and silent past the heartbeat timeout."""
        return self.state is PeerState.READY and self.silence(now) > self.config.heartbeat_timeout_s

    def suspect(self, now: float) -> bool:
        """Ready, and silent for two heartbeat intervals (not lost yet)."""
        return self.state is PeerState.READY and self.silence(now) > 2 * self.config.heartbeat_interval_s

    def process_ended(self, mine: ProcessId) -> Optional[str]:
        """Why the peer's process is known to have ended (one host), else None."""
        if ended(self.process, mine):
            return f"its process (pid {self.process.pid}) has exited"
        return None


def confirm_silent(candidates: Iterable, session_of: Callable, now: float, read: Callable[[list], object],
                   current: Callable[[object], bool]) -> list:
    """The peers among ``candidates`` still silent past the timeout after ``read(silent)`` has
    read what came from them meanwhile (and still ``current``: a message may have replaced or
    dropped one)."""
    silent = [p for p in candidates if session_of(p).timed_out(now)]
    if not silent:
        return []
    read(silent)
    return [p for p in silent if current(p) and session_of(p).timed_out(now)]


class Fences:
    """The fences of peers lost to their silence, by peer: each holds the failed requests whose
    pages wait for proof that none of that peer's writes for them can still land."""

    def __init__(self):
        self._by_peer: dict = {}  # peer -> (since, set of request ids)

    def __contains__(self, peer) -> bool:
        return peer in self._by_peer

    def add(self, peer, now: float, request_ids) -> None:
        """Fence ``request_ids`` on ``peer`` (a fence already up keeps its start)."""
        self._by_peer.setdefault(peer, (now, set()))[1].update(request_ids)

    def holds(self, peer, request_id: str) -> bool:
        entry = self._by_peer.get(peer)
        return entry is not None and request_id in entry[1]

    def discard(self, peer, request_id: str) -> None:
        """The peer itself said the request is quiet: proof for that request."""
        entry = self._by_peer.get(peer)
        if entry is not None:
            entry[1].discard(request_id)

    def lift(self, peer) -> set:
        """Take the peer's fence down; the request ids it held (empty if none was up)."""
        entry = self._by_peer.pop(peer, None)
        return set() if entry is None else entry[1]

    def older_than(self, when: float) -> list:
        """The peers whose fence went up before ``when``."""
        return [p for p, (since, _) in self._by_peer.items() if since < when]
