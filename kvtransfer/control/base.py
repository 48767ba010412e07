"""The contract of a control plane: :class:`BaseKVManager`, :class:`BaseKVSender`,
:class:`BaseKVReceiver`.

An engine holds one manager per rank and one sender (prefill) or receiver (decode) per
request; it calls nothing else, so another control plane can take this one's place behind
these classes. Who calls what:

- prefill: ``sender = manager.sender(request_id)``; ``sender.send(slots, last=...)`` once per
  chunk (the last one with ``state_slot`` and ``aux``); ``sender.poll()`` until a final
  :class:`~kvtransfer.control.state.KVPoll`; ``sender.abort(reason)`` to give up.
- decode: ``receiver = manager.receiver(request_id)`` once the pages are reserved;
  ``receiver.init(dst_slots, prefix_tokens=, state_slot=)``; ``receiver.poll()`` until final;
  ``receiver.first_token()`` after Success; ``receiver.close()`` to forget it. Its pages may be
  reused once ``receiver.released`` is True.
- ``manager.close()`` fails what is in flight and releases sockets, threads and registrations.
- a manager made with ``on_change=f`` calls ``f()`` each time one of its requests changes state
  (on the thread that moved it, mostly the manager's own: ``f`` must be quick and never block),
  so an engine's loop may sleep until a transfer moves instead of polling on a timer.

Every method may be called from any of the owner's threads. A request's state only moves
forward, and Failed wins (:mod:`kvtransfer.control.state`); ``failure`` says why it failed.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

from kvtransfer.control.state import KVPoll

__all__ = ["BaseKVManager", "BaseKVReceiver", "BaseKVSender", "check_on_change"]


class BaseKVManager(abc.ABC):
    """One rank's control plane: its peers, its requests, its transports' registrations."""

    @property
    @abc.abstractmethod
    def num_requests(self) -> int:
        """Requests made and not yet forgotten."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail what is in flight, release everything (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_on_change(on_change: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """A manager's ``on_change`` argument: None or a callable (TypeError otherwise)."""
    if on_change is not None and not callable(on_change):
        raise TypeError(f"on_change must be callable or None, got {type(on_change).__name__}")
    return on_change


class _BaseRequest(abc.ABC):
    request_id: str

    @abc.abstractmethod
    def poll(self) -> KVPoll:
        """Where the request stands."""

    @property
    @abc.abstractmethod
    def failure(self) -> Optional[str]:
        """Why it failed (None unless Failed)."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Fail it here and on its peers."""


class BaseKVSender(_BaseRequest):
    """One request on a prefill rank."""

    @abc.abstractmethod
    def send(self, slots, *, last: bool = False, state_slot: Optional[int] = None,
             aux: Optional[bytes] = None) -> None:
        """Queue one chunk: this rank's token slots of the request's next tokens."""


class BaseKVReceiver(_BaseRequest):
    """One request on a decode rank."""

    @abc.abstractmethod
    def init(self, dst_slots, *, prefix_tokens: int = 0, state_slot: Optional[int] = None) -> None:
        """Tell the senders where the request's bytes go."""

    @property
    @abc.abstractmethod
    def released(self) -> bool:
        """No byte of the request's writes can still land: its pages may be reused."""

    @abc.abstractmethod
    def first_token(self) -> tuple:
        """``(token_id, logprob)`` from the aux record, once Success."""

    @abc.abstractmethod
    def close(self) -> None:
        """Forget the request (aborting it if it has not ended)."""
