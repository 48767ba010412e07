"""Control messages a backend sends over its own notifications (NIXL's staged lanes and
revocation): a magic prefix, then msgpack of ``[kind index, field values]``. Each protocol keeps
its message dataclasses, its kinds tuple and its error type; this is their one framing."""

from __future__ import annotations

from dataclasses import astuple, fields
from typing import Optional

import msgpack

__all__ = ["decode", "encode"]


def encode(magic: bytes, kinds: tuple, msg) -> bytes:
    return magic + msgpack.packb([kinds.index(type(msg)), list(astuple(msg))], use_bin_type=True)


def decode(magic: bytes, kinds: tuple, payload: bytes, error: type, what: str) -> Optional[object]:
    """The message in ``payload``, None when it does not start with ``magic`` (not this
    protocol's); ``error`` naming ``what`` for one that does not decode."""
    if not payload.startswith(magic):
        return None
    try:
        kind, values = msgpack.unpackb(payload[len(magic):], raw=False)
        cls = kinds[kind]
        if len(values) != len(fields(cls)):
            raise ValueError(f"{len(values)} fields, {cls.__name__} has {len(fields(cls))}")
        return cls(*values)
    except Exception as exc:
        raise error(f"{what} of {len(payload)} bytes does not decode: {exc}") from None
