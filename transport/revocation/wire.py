"""The revoke protocol's messages (:mod:`transport.revocation`), shared by the backends.

Each is one frozen dataclass, encoded as :data:`MAGIC` + msgpack ``[kind, [fields...]]``
(:mod:`transport.notif_frames`); a payload that does not start with :data:`MAGIC` is not one
of them (a notification, a staged message), and writers may not send notifications that start
with it (``write`` refuses them).

- nixl (:mod:`transport.nixl.revoke`), over NIXL notifications (``send_notif``): writer
  ("holder") -> owner :class:`Hold`, :class:`RevokeAck`, :class:`Release`; owner -> holder
  :class:`HoldAck`, :class:`Revoke`, :class:`Closed`.
- nvlink (:mod:`transport.nvlink.revoke`, :mod:`transport.nvlink.revoke`), as frames of the
  writer's mailbox connection: the writer's first frame is :class:`Hello`, then owner -> writer
  :class:`HoldAck` and :class:`Revoke`, writer -> owner :class:`RevokeAck` and
  :class:`Dropped` among its notifications. The connection's end stands for Release and Closed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

from transport import notif_frames as frames

__all__ = ["MAGIC", "Dropped", "Hello", "Hold", "HoldAck", "Revoke", "RevokeAck", "Release", "Closed", "Message",
           "encode", "decode", "ProtocolError", "MAX_IDS", "MAX_NAME"]

MAGIC = b"\x00kvt-revoke\x01"
MAX_IDS = 1 << 20  # region ids one message may name (a transport's lifetime of ids: base.MAX_REGION_ID)
MAX_NAME = 1024  # characters of a transport's name in a Hello


class ProtocolError(ValueError):
    """A revoke message that cannot be trusted (what was expected, what arrived)."""


@dataclass(frozen=True)
class Hold:
    """Holder -> owner, at ``connect``: this transport loaded an export of yours naming
    ``regions`` and will write into them; ``metadata`` (its NIXL agent metadata) and ``scratch``
    (the address of its 64 notification bytes) let the owner answer and probe it. Hold ``seq``
    of this holder (increasing)."""

    seq: int
    regions: list
    metadata: bytes
    scratch: int


@dataclass(frozen=True)
class HoldAck:
    """Owner -> holder: hold ``seq`` is recorded (revokes of its regions will be sent);
    ``gone``: regions of it already deregistered (the holder treats them as revoked)."""

    seq: int
    gone: list


@dataclass(frozen=True)
class Revoke:
    """Owner -> holder: forget ``regions``; answer with ``RevokeAck(seq)`` once no write of
    yours into them can still land."""

    seq: int
    regions: list


@dataclass(frozen=True)
class RevokeAck:
    """Holder -> owner: revoke ``seq`` is done: its regions are dropped here and no write of
    this holder into them is in flight."""

    seq: int


@dataclass(frozen=True)
class Release:
    """Holder -> owner: forget me; I hold no export of yours and no write of mine to you is in
    flight (a later ``connect`` sends a new Hold)."""


@dataclass(frozen=True)
class Closed:
    """Owner -> holder: this transport closed; every region of it is gone (no answer: its agent
    is gone too)."""


@dataclass(frozen=True)
class Hello:
    """Writer -> owner, the first frame of an nvlink mailbox connection (one per ``connect``):
    I am transport ``name`` and hold an export of yours naming ``regions``. The owner answers
    ``HoldAck(0, gone)``; the writer writes nothing before it."""

    name: str
    regions: list


@dataclass(frozen=True)
class Dropped:
    """Writer -> owner, on an nvlink mailbox connection: the write behind notification number
    ``note`` (announced before its bytes landed) failed; never hand that notification out. Sent
    before the landed word passes ``note`` (:mod:`transport.nvlink.mailbox`)."""

    note: int


Message = Union[Hold, HoldAck, Revoke, RevokeAck, Release, Closed, Hello, Dropped]
_KINDS = (Hold, HoldAck, Revoke, RevokeAck, Release, Closed, Hello, Dropped)


def encode(msg: Message) -> bytes:
    return frames.encode(MAGIC, _KINDS, msg)


def decode(payload: bytes) -> Optional[Message]:
    """The message in ``payload``, None when it is not a revoke message; :class:`ProtocolError`
    for one that does not decode or names impossible values."""
    msg = frames.decode(MAGIC, _KINDS, payload, ProtocolError, "revoke message")
    if msg is not None:
        _check(msg)
    return msg


def _check(msg: Message) -> None:
    """Bound what is read from the wire: ints where ints belong, id lists of ints, not too long."""
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name in ("regions", "gone"):
            if not isinstance(value, list) or len(value) > MAX_IDS or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
                raise ProtocolError(f"{type(msg).__name__}.{f.name} must be a list of at most {MAX_IDS} "
                                    f"region ids >= 0, got {value!r:.80}")
        elif f.name == "name":
            if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
                raise ProtocolError(f"{type(msg).__name__}.name must be a str of 1 to {MAX_NAME} characters, "
                                    f"got {value!r:.60}")
        elif f.name == "metadata":
            if not isinstance(value, bytes) or not value:
                raise ProtocolError(f"{type(msg).__name__}.metadata must be non-empty bytes, got {value!r:.60}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"{type(msg).__name__}.{f.name} must be an int >= 0, got {value!r:.60}")
