"""Per-request status on either side: :class:`KVPoll` and :class:`RequestStatus`.

A request's status only moves forward through ``Bootstrapping -> WaitingForInput ->
Transferring -> Success``; ``Failed`` may replace any state that is not final and then stays
(it "wins" over progress reported later, from any thread). ``Success`` and ``Failed`` are
final. The reason of a failure is kept and readable, and ``times`` holds when each state was
entered (``time.monotonic()``: one clock for every process of a host), for latency metrics. :class:`RequestTable` holds the live
requests of one manager and refuses a request id while it is in use.

Thread safety: a manager's background thread advances and fails requests while the owner
polls them; every method here takes the object's lock. A status may carry ``on_change``, called
(on the thread that moved it, after the lock is released) each time its state changes: an
engine's loop may sleep until one of its transfers moves instead of polling on a timer.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Callable, Generic, Iterator, Optional, TypeVar

__all__ = ["DuplicateRequest", "KVPoll", "RequestStatus", "RequestTable"]


class KVPoll(enum.IntEnum):
    """Where a request stands (the values are SGLang's, so engines can compare them)."""

    Failed = 0
    Bootstrapping = 1  # the peer ranks are not yet known / connected
    WaitingForInput = 2  # decode: waiting for the destination; prefill: for the request's slots
    Transferring = 3  # bytes are in flight
    Success = 4  # every expected byte has landed (decode) / every write is done (prefill)

    @property
    def final(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class DuplicateRequest(ValueError):
    """A request id that is still in use was given again."""


class RequestStatus:
    """One request's status and, once failed, why."""

    def __init__(self, request_id: str, on_change: Optional[Callable[[], None]] = None):
        self.request_id = request_id
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        self._lock = threading.Lock()
        self._on_change = on_change
        self.times = {KVPoll.Bootstrapping: time.monotonic()}  # state -> time.monotonic() it was entered
        self.last_posted_at: Optional[float] = None  # prefill: time.monotonic() its last chunk's post began

    @property
    def state(self) -> KVPoll:
        return self._state

    @property
    def reason(self) -> Optional[str]:
        """Why the request failed (None unless Failed)."""
        return self._reason

    def advance(self, to: KVPoll) -> bool:
        """Move forward to ``to``; a move backwards or out of a final state is ignored.
        Returns whether the state changed. ``Failed`` goes through :meth:`fail`."""
        if to is KVPoll.Failed:
            raise ValueError("a request fails through fail(reason), not advance(Failed)")
        with self._lock:
            if self._state.final or to <= self._state:
                return False
            self._state = to
            self.times[to] = time.monotonic()
        self._changed()
        return True

    def fail(self, reason: str) -> bool:
        """Fail the request unless it already ended; the first reason is kept."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"a failure needs a reason, got {reason!r}")
        with self._lock:
            if self._state.final:
                return False
            self._state, self._reason = KVPoll.Failed, reason
            self.times[KVPoll.Failed] = time.monotonic()
        self._changed()
        return True

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def __repr__(self) -> str:
        why = f", reason={self._reason!r}" if self._reason else ""
        return f"RequestStatus({self.request_id!r}, {self._state.name}{why})"


T = TypeVar("T")


class RequestTable(Generic[T]):
    """Live requests of one manager by id; an id can be reused only after :meth:`pop`."""

    def __init__(self):
        self._items: dict = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, item: T) -> T:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        with self._lock:
            if request_id in self._items:
                raise DuplicateRequest(f"request id {request_id!r} is already in use on this rank")
            self._items[request_id] = item
        return item

    def get(self, request_id: str) -> Optional[T]:
        with self._lock:
            return self._items.get(request_id)

    def pop(self, request_id: str) -> Optional[T]:
        with self._lock:
            return self._items.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __iter__(self) -> Iterator[T]:
        with self._lock:
            return iter(list(self._items.values()))
