"""Control-plane messages: one frozen dataclass per kind, msgpack on the wire.

Every frame is a msgpack map ``{"v": PROTOCOL_VERSION, "kind": KIND, "body": {field: value}}``.
:func:`decode` trusts nothing: a frame that is too large, not msgpack, of another protocol
version, of an unknown kind, or whose body lacks a field, has an extra one or a value of the
wrong type raises :class:`WireError` naming what was expected and what arrived. Receivers
log and drop such frames; the socket and the process carry on. A request of another version
(:class:`VersionMismatch`) is answered all the same, in the receiver's version -- the bootstrap
service's :class:`Registered` and a prefill rank's :class:`HelloAck` with an error -- and a
requester refuses such an answer naming both versions (a decode rank's start-up fails with
``HandshakeError``), instead of waiting out its timeout.

Messages (who sends them):

- bootstrap service: :class:`RegisterPrefill` and :class:`UnregisterPrefill` (prefill rank
  -> service, answered by :class:`Registered`), :class:`GetTopology` (decode -> service, answered by
  :class:`Topology`), :class:`Ping` (anyone -> service, answered by :class:`Pong`);
- decode rank <-> prefill rank: :class:`DecodeHello` (answered by :class:`HelloAck`),
  :class:`TransferRequest` per request, :class:`AbortRequest` either way,
  :class:`Quiesced` after a failure, :class:`Heartbeat` both ways, :class:`Goodbye`
  before a decode rank frees its memory (answered by a Goodbye once the prefill rank
  can no longer write there), :class:`NotConnected` when a prefill rank gets a message from a
  decode rank it holds no hello of (it dropped it as lost); :class:`KVArrived` is the payload of a transport
  notification (it arrives after the bytes it announces).

Field types are the annotations: ``int``, ``str``, ``bytes``, ``bool``, ``float``, ``list``
and ``dict`` (msgpack's own types; ``bytes`` travels as bin), checked on decode.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, Optional

import msgpack

from kvtransfer.control.liveness import ProcessId

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "AbortRequest",
    "DecodeHello",
    "Endpoint",
    "GetTopology",
    "Goodbye",
    "Heartbeat",
    "HelloAck",
    "KVArrived",
    "Message",
    "Ping",
    "Pong",
    "Quiesced",
    "RegisterPrefill",
    "Registered",
    "Topology",
    "TransferRequest",
    "UnregisterPrefill",
    "VersionMismatch",
    "WireError",
    "decode",
    "endpoints_of",
    "process_of",
]

PROTOCOL_VERSION = 2  # 2: hellos and their answers name the sender's process (liveness.ProcessId), acks the backend
MAX_FRAME_BYTES = 64 << 20  # a frame larger than this is refused before it is parsed

_TYPES = {"int": int, "str": str, "bytes": bytes, "bool": bool, "float": (int, float), "list": list, "dict": dict}


class WireError(ValueError):
    """A frame that cannot be trusted; the message says what was expected and what arrived."""


class VersionMismatch(WireError):
    """A well-formed frame of another protocol version. ``version`` is the sender's and ``kind``
    the kind it names, as sent (not checked further). Whoever receives a request of another
    version answers it all the same, in its own version, with an error: the requester's
    :func:`decode` then raises this, and it fails naming both versions instead of waiting out
    its timeout."""

    def __init__(self, version, kind):
        super().__init__(f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
        self.version, self.kind = version, kind


_KINDS: dict = {}


@functools.lru_cache(maxsize=None)
def _schema(cls) -> tuple:
    """``((name, annotation), ...)`` of a message class's fields, read once per class (every
    message is checked on construction and on decoding: a few per request)."""
    return tuple((f.name, str(f.type)) for f in dataclasses.fields(cls))


def _check_value(kind: str, name: str, annotation: str, value) -> None:
    want = _TYPES[annotation]
    ok = isinstance(value, want) and not (annotation in ("int", "float") and isinstance(value, bool))
    if not ok:
        raise WireError(f"{kind}.{name} must be {annotation}, got {type(value).__name__}")


@dataclass(frozen=True)
class Message:
    """Base of every control message. Subclasses set ``KIND`` and declare typed fields."""

    KIND: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.KIND:
            if cls.KIND in _KINDS:
                raise TypeError(f"message kind {cls.KIND!r} defined twice")
            _KINDS[cls.KIND] = cls

    def __post_init__(self):
        for name, annotation in _schema(type(self)):
            _check_value(self.KIND, name, annotation, getattr(self, name))

    def to_msgpack(self) -> bytes:
        body = {name: getattr(self, name) for name, _ in _schema(type(self))}
        return msgpack.packb({"v": PROTOCOL_VERSION, "kind": self.KIND, "body": body}, use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Message":
        """Decode ``data`` and check it is this kind (see :func:`decode`)."""
        msg = decode(data)
        if not isinstance(msg, cls):
            raise WireError(f"expected a {cls.KIND or cls.__name__} message, got {msg.KIND}")
        return msg


def decode(data) -> Message:
    """The message in ``data``, fully checked (see the module docstring)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a frame must be bytes, got {type(data).__name__}")
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(data)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        frame = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"frame of {len(data)} bytes is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(frame, dict) or set(frame) != {"v", "kind", "body"}:
        got = sorted(frame) if isinstance(frame, dict) else type(frame).__name__
        raise WireError(f"a frame must be a map with keys ['body', 'kind', 'v'], got {got}")
    if frame["v"] != PROTOCOL_VERSION:
        raise VersionMismatch(frame["v"], frame["kind"])
    cls = _KINDS.get(frame["kind"]) if isinstance(frame["kind"], str) else None
    if cls is None:
        raise WireError(f"unknown message kind {frame['kind']!r}; known: {sorted(_KINDS)}")
    body = frame["body"]
    if not isinstance(body, dict):
        raise WireError(f"{cls.KIND} body must be a map, got {type(body).__name__}")
    names = [name for name, _ in _schema(cls)]
    if set(body) != set(names):
        missing, extra = sorted(set(names) - set(body)), sorted(set(body) - set(names))
        raise WireError(f"{cls.KIND} fields must be {sorted(names)}: missing {missing}, unexpected {extra}")
    try:
        return cls(**body)
    except WireError:
        raise
    except (TypeError, ValueError) as exc:  # a message's own checks
        raise WireError(f"{cls.KIND}: {exc}") from None


@dataclass(frozen=True)
class Endpoint:
    """One transport of a rank as its peers see it: the backend, the name its notifications
    carry, its export, and the map of the rank's pool buffers to its region ids
    (``BufferRegions.to_wire()``). A rank may offer several (``nixl``, and ``nvlink`` for
    CUDA memory); each pair of ranks picks one."""

    backend: str
    name: str
    export: bytes
    regions: dict

    def to_wire(self) -> dict:
        return {"backend": self.backend, "name": self.name, "export": self.export, "regions": self.regions}

    @classmethod
    def from_wire(cls, item) -> "Endpoint":
        want = {"backend": str, "name": str, "export": bytes, "regions": dict}
        if not isinstance(item, dict) or set(item) != set(want):
            got = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise WireError(f"an endpoint must be a map with keys {sorted(want)}, got {got}")
        for key, typ in want.items():
            if not isinstance(item[key], typ):
                raise WireError(f"endpoint.{key} must be {typ.__name__}, got {type(item[key]).__name__}")
        return cls(**item)


def endpoints_of(msg) -> dict:
    """``{backend: Endpoint}`` of a message's ``endpoints`` (at least one, backends distinct)."""
    out = {}
    for item in msg.endpoints:
        ep = Endpoint.from_wire(item)
        if ep.backend in out:
            raise WireError(f"{msg.KIND}: backend {ep.backend!r} listed twice")
        out[ep.backend] = ep
    if not out:
        raise WireError(f"{msg.KIND}: no endpoint")
    return out


def process_of(msg) -> Optional[ProcessId]:
    """The sender's process named by a hello or its answer (None: it could not name itself)."""
    try:
        return ProcessId.from_wire(msg.process)
    except ValueError as exc:
        raise WireError(f"{msg.KIND}: {exc}") from None


# -- bootstrap ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegisterPrefill(Message):
    """A prefill rank announces itself to the bootstrap service (sent again after a restart:
    the newer registration of a (dp_rank, tp_rank) replaces the older)."""

    KIND: ClassVar[str] = "register_prefill"
    dp_rank: int
    tp_rank: int
    tp_size: int
    control_addr: str  # where decode ranks reach this rank's control socket (tcp://host:port)
    host: str  # host identity: ranks on one host may use the nvlink transport
    endpoints: list  # Endpoint.to_wire() per transport this rank writes through
    layout: bytes  # RankLayout.to_msgpack()
    incarnation: str  # changes on every start of the rank: tells a restart from a retry

    def __post_init__(self):
        super().__post_init__()
        endpoints_of(self)
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size or self.dp_rank < 0:
            raise WireError(f"register_prefill: need 0 <= tp_rank < tp_size and dp_rank >= 0, got tp_rank "
                            f"{self.tp_rank}, tp_size {self.tp_size}, dp_rank {self.dp_rank}")

    @property
    def key(self) -> tuple:
        return (self.dp_rank, self.tp_rank)


@dataclass(frozen=True)
class Registered(Message):
    """The service's answer to :class:`RegisterPrefill`: ``error`` is empty when accepted."""

    KIND: ClassVar[str] = "registered"
    error: str


@dataclass(frozen=True)
class UnregisterPrefill(Message):
    """A prefill rank that shuts down leaves the registry (answered by ``Registered``); only
    the incarnation that registered can remove the entry, so a late goodbye of an old process
    never removes its restarted successor."""

    KIND: ClassVar[str] = "unregister_prefill"
    dp_rank: int
    tp_rank: int
    incarnation: str


@dataclass(frozen=True)
class GetTopology(Message):
    """A decode rank asks for the prefill ranks of one DP group."""

    KIND: ClassVar[str] = "get_topology"
    dp_rank: int


@dataclass(frozen=True)
class Topology(Message):
    """The prefill ranks of one DP group registered so far (each a RegisterPrefill frame),
    and the TP size they declare (0 while none is registered)."""

    KIND: ClassVar[str] = "topology"
    dp_rank: int
    tp_size: int
    ranks: list  # RegisterPrefill.to_msgpack() per registered rank, by tp_rank

    def rank_infos(self) -> list:
        """The registrations, decoded and checked."""
        return [RegisterPrefill.from_msgpack(r) for r in self.ranks]

    @property
    def complete(self) -> bool:
        """Every TP rank of the group has registered."""
        return self.tp_size > 0 and len(self.ranks) == self.tp_size


@dataclass(frozen=True)
class Ping(Message):
    KIND: ClassVar[str] = "ping"
    nonce: int


@dataclass(frozen=True)
class Pong(Message):
    """The answer to :class:`Ping`: the same nonce, and the service's registration count."""

    KIND: ClassVar[str] = "pong"
    nonce: int
    registered: int


# -- decode <-> prefill --------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeHello(Message):
    """A decode rank introduces itself to one prefill rank it will receive from (decode ->
    prefill control socket), answered by :class:`HelloAck`. The prefill rank checks the
    layouts (``RankLayout.check_compatible``) and connects its transport to the export."""

    KIND: ClassVar[str] = "decode_hello"
    instance: str  # the decode node (TP group) this rank belongs to
    dp_rank: int
    tp_rank: int
    tp_size: int
    host: str
    endpoints: list  # Endpoint.to_wire() per transport this rank receives on
    layout: bytes  # RankLayout.to_msgpack()
    incarnation: str
    process: dict  # liveness.ProcessId.to_wire(), {} where it cannot name itself

    def __post_init__(self):
        super().__post_init__()
        endpoints_of(self)
        process_of(self)

    @property
    def key(self) -> tuple:
        return (self.instance, self.tp_rank)


@dataclass(frozen=True)
class HelloAck(Message):
    """A prefill rank's answer to :class:`DecodeHello`: ``error`` empty when the pair can
    exchange data, else why not (a layout mismatch names the field and both values)."""

    KIND: ClassVar[str] = "hello_ack"
    error: str
    incarnation: str  # the prefill rank's: a change tells decode the rank restarted
    process: dict  # liveness.ProcessId.to_wire(), {} where it cannot name itself
    backend: str  # the transport it writes to the decode rank through ("" when refused)

    def __post_init__(self):
        super().__post_init__()
        process_of(self)


@dataclass(frozen=True)
class TransferRequest(Message):
    """Decode -> prefill, per request: where this decode rank wants the request's bytes.

    ``dst_slots`` are int64 token slots (little endian) for the tokens after the first
    ``prefix_tokens`` (which decode already holds); ``state_slot`` is -1 when the model has
    no state."""

    KIND: ClassVar[str] = "transfer_request"
    request_id: str
    instance: str  # the decode node; every decode rank of it sends one to every prefill rank
    decode_tp_rank: int
    dst_slots: bytes
    prefix_tokens: int
    state_slot: int


@dataclass(frozen=True)
class KVArrived(Message):
    """The notification payload of one write (prefill -> decode, through the transport, after
    its bytes): write number ``seq`` of one prefill rank for ``request_id`` to this decode rank
    has landed; ``part`` is ``"kv"`` (a chunk) or ``"state"``. The sender's last write carries
    ``total``, the number of writes it made for the request (0 on the others): the receiver is
    done with a sender once it has counted ``total`` of them, in any order. The aux record
    (the first output token and its logprob) rides on the last notification of the one
    sender that writes it (``aux``; empty elsewhere): a notification arrives after its bytes,
    so the record needs no write of its own."""

    KIND: ClassVar[str] = "kv_arrived"
    request_id: str
    part: str
    seq: int
    total: int
    aux: bytes


@dataclass(frozen=True)
class Quiesced(Message):
    """Prefill -> decode, after a request failed or was aborted: none of this prefill rank's
    writes for ``request_id`` is still in flight, so decode may reuse the request's pages
    once every sender has said so (or was lost)."""

    KIND: ClassVar[str] = "quiesced"
    request_id: str


@dataclass(frozen=True)
class AbortRequest(Message):
    """Either side gives up a request; the other side fails it with ``reason``."""

    KIND: ClassVar[str] = "abort_request"
    request_id: str
    reason: str


@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness between the two control sockets; the answer is a heartbeat with the same
    ``seq`` and the answering rank's incarnation."""

    KIND: ClassVar[str] = "heartbeat"
    seq: int
    incarnation: str


@dataclass(frozen=True)
class Goodbye(Message):
    """Decode -> prefill before a decode rank deregisters its memory: forget my transport
    export. The prefill rank fails its requests to this rank, waits until none of its writes
    to it is in flight, closes its transport peer, and answers with a Goodbye of its own;
    only then may the decode rank free what the prefill rank could address.

    Prefill -> decode, unasked, when a prefill rank closes: its decode ranks stop sending
    it requests at once (instead of after the heartbeat timeout) and look for its successor."""

    KIND: ClassVar[str] = "goodbye"
    incarnation: str


@dataclass(frozen=True)
class NotConnected(Message):
    """Prefill -> decode, the answer to any message but a hello from a socket this prefill rank
    holds no hello of: it dropped that decode rank (``reason``: why; a rank silent for the
    heartbeat timeout is dropped, and a loaded machine can pause a live one that long) or
    never knew it. The decode rank fails what it asked of this prefill rank and says hello
    again: the two are connected anew instead of each waiting for a restart of the other."""

    KIND: ClassVar[str] = "not_connected"
    incarnation: str
    reason: str
