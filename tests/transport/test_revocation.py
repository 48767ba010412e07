"""The revoke messages every backend shares (:mod:`transport.revocation.wire`) and the
writer's revoked-region check (:mod:`transport.revocation.holder`)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from transport.revocation import Revoked
from transport.revocation import wire

MESSAGES = [
    wire.Hello("nvlink-12-abcd", [0, 3, 7]),
    wire.Hold(4, [1, 2], b"agent metadata", 1 << 40),
    wire.HoldAck(4, []),
    wire.HoldAck(0, [2]),
    wire.Revoke(9, [5]),
    wire.RevokeAck(9),
    wire.Release(),
    wire.Closed(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_decodes_to_itself(msg):
    payload = wire.encode(msg)
    assert payload.startswith(wire.MAGIC)
    assert wire.decode(payload) == msg


def test_a_payload_without_the_magic_is_no_revoke_message():
    assert wire.decode(b"a notification") is None
    assert wire.decode(b"") is None


def _framed(kind, values) -> bytes:
    """``values`` framed as a message of ``kind`` (a message class, or a kind number)."""
    index = kind if isinstance(kind, int) else wire._KINDS.index(kind)
    return wire.MAGIC + msgpack.packb([index, values], use_bin_type=True)


@pytest.mark.parametrize("payload, match", [
    (wire.MAGIC + b"\xc1", "does not decode"),
    (wire.MAGIC, "does not decode"),
    (_framed(99, []), "does not decode"),  # no such kind
    (_framed(wire.HoldAck, [1]), r"1 fields, HoldAck has 2"),
    (_framed(wire.Hello, [5, []]), r"Hello.name must be a str of 1 to 1024 characters, got 5"),
    (_framed(wire.Hello, ["", []]), r"Hello.name must be a str"),
    (_framed(wire.Hello, ["x" * 1025, []]), r"Hello.name must be a str"),
    (_framed(wire.Hello, ["w", [0, -1]]), r"Hello.regions must be a list of at most \d+ region ids >= 0"),
    (_framed(wire.Hello, ["w", [True]]), r"Hello.regions must be a list"),
    (_framed(wire.Hello, ["w", "0"]), r"Hello.regions must be a list"),
    (_framed(wire.Revoke, [9, [1.5]]), r"Revoke.regions must be a list"),
    (_framed(wire.HoldAck, [-1, []]), r"HoldAck.seq must be an int >= 0, got -1"),
    (_framed(wire.RevokeAck, ["1"]), r"RevokeAck.seq must be an int >= 0"),
    (_framed(wire.Hold, [1, [0], b"", 4096]), r"Hold.metadata must be non-empty bytes"),
])
def test_a_malformed_message_is_a_protocol_error_naming_what_was_expected(payload, match):
    with pytest.raises(wire.ProtocolError, match=match):
        wire.decode(payload)


def test_a_message_naming_too_many_regions_is_refused(monkeypatch):
    monkeypatch.setattr(wire, "MAX_IDS", 3)
    assert wire.decode(wire.encode(wire.Revoke(1, [0, 1, 2]))) == wire.Revoke(1, [0, 1, 2])
    with pytest.raises(wire.ProtocolError, match="at most 3 region ids"):
        wire.decode(wire.encode(wire.Revoke(1, [0, 1, 2, 3])))


def test_revoked_regions_refuse_the_first_batch_entry_that_names_one():
    revoked = Revoked()
    dst = np.array([4, 2, 9, 2], dtype=np.int64)  # [n]
    assert not revoked and revoked.check("peer", dst) is None
    revoked.drop([9, 2])
    assert revoked and 2 in revoked and 4 not in revoked
    assert revoked.hit(dst) == 2
    assert revoked.hit(np.array([4, 5], dtype=np.int64)) is None
    assert revoked.hit(np.zeros(0, dtype=np.int64)) is None
    assert revoked.check("peer", dst) == ("region 2 of peer 'peer' was revoked: its owner deregistered it "
                                          "(connect to a newer export of the peer; nothing was written)")
