"""What one NIXL transport knows of each remote agent it connected to.

By agent name: the current :class:`~transport.nixl.peer.NixlPeer` and the snapshots a newer
connect retired (their pending writes still run), whether NIXL keeps the agent loaded while no
peer uses it, why it is lost and the failed requests NIXL may still run for it, and the entries
NIXL was given for it (what its exports named and what its staged Hello or Welcome registered).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable, Optional

from transport.nixl.agent import Agent

if TYPE_CHECKING:
    from transport.nixl.peer import NixlPeer

__all__ = ["Remotes"]


class Remotes:
    def __init__(self, agent: Agent):
        self._agent = agent
        self.current: dict[str, "NixlPeer"] = {}  # the current peer per remote agent name
        self.retired: "weakref.WeakSet[NixlPeer]" = weakref.WeakSet()  # snapshots a newer connect replaced
        self.idle: set[str] = set()  # agents still loaded in NIXL whose peer closed (a later connect reuses them)
        self.lost: dict[str, str] = {}  # agent -> why it is lost (a transfer failed or stalled)
        self.loaded: dict[str, set] = {}  # agent -> (region id, ptr, length, device) NIXL was given for it
        self._draining: dict[str, list] = {}  # agent -> handles of its failed requests NIXL may still run

    def peers(self) -> list:
        """Every peer, retired snapshots first."""
        return [*self.retired, *self.current.values()]

    def snapshots(self, name: str) -> list:
        """Every peer (current and retired snapshots) of the remote agent ``name``."""
        return [p for p in self.peers() if p.name == name]

    def pending(self, name: Optional[str] = None) -> list:
        """The writes (direct and queued) of every snapshot of ``name`` (None: of every agent)
        not yet known to have ended."""
        peers = self.peers() if name is None else self.snapshots(name)
        return [t for p in peers for t in p.pending()]

    def loaded_too(self, name: str, entries: Iterable) -> None:
        """Record ``entries`` (``(region id, ptr, length, device)``) as given to NIXL for ``name``."""
        self.loaded.setdefault(name, set()).update(entries)

    def lose(self, name: str, error: str, handles=()) -> None:
        """The remote agent ``name`` is lost (first ``error`` kept): writes to it fail until a
        new connect, which waits until NIXL no longer runs ``handles`` (its failed requests)."""
        self.lost.setdefault(name, error)
        if handles:
            self._draining.setdefault(name, []).extend(handles)

    def drain(self, name: str) -> int:
        """Release the failed requests of ``name`` that NIXL no longer progresses; how many it
        still does."""
        left = []
        for handle in self._draining.pop(name, []):
            try:
                busy = self._agent.state(handle) == "PROC"
            except Exception:  # the peer died: nothing more of it lands
                busy = False
            if busy:
                left.append(handle)
            else:
                self._agent.release(handle)
        if left:
            self._draining[name] = left
        return len(left)

    def take_draining(self) -> list:
        """Every failed request still kept, for release at close."""
        handles = [h for hs in self._draining.values() for h in hs]
        self._draining.clear()
        return handles
