"""One request's progress on a prefill rank: :class:`PrefillRequest`, and its :class:`Chunk`.

A request waits for every decode rank of its instance to ask (:meth:`PrefillRequest.attach`:
then WaitingForInput, and its deadline starts), has its chunks posted as writes to the decode
ranks that read from this rank (:meth:`~PrefillRequest.post`: Transferring), and succeeds once
every write of its last chunk is done (:meth:`~PrefillRequest.poll_writes`). Failing it
(:meth:`~PrefillRequest.fail`) cancels its writes; they stay in flight until nothing of them
can land. The manager keeps these records and owns the sockets; a record changes only its own
state and its writes. Loop thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kvtransfer.batches import write_batch
from kvtransfer.control.state import KVPoll, RequestStatus
from kvtransfer.control.wire import KVArrived, TransferRequest
from kvtransfer.layout import RankLayout, StateKind
from kvtransfer.plan import plan_kv_transfer, plan_state_transfer
from transport.base import TransferStatus
from transport.batch import WriteBatch

__all__ = ["Chunk", "PrefillRequest"]

# The KV write of a chunk with no tokens to send (the last chunk after a prompt sent layer by
# layer, or tokens decode holds already): no bytes, its notification alone.
_NO_KV = WriteBatch.of([], [], [], [], [])


@dataclass(frozen=True)
class Chunk:
    slots: np.ndarray  # [n] this rank's token slots
    last: bool
    state_slot: Optional[int]
    aux: Optional[bytes]
    computed: object = None  # CUDA event recorded after the chunk's KV on the sender's stream (None: host KV)
    layers: Optional[tuple] = None  # (first, end) layer positions sent (None: every layer)


@dataclass
class PrefillRequest:
    """A request's progress on this rank (module docstring)."""

    request_id: str
    status: RequestStatus  # shared with the owner's KVSender
    since: float  # when sender() made it
    deadline: float = float("inf")  # set once every decode rank asked
    instance: Optional[str] = None
    expected: frozenset = frozenset()  # decode keys that will ask: every rank of the instance
    dests: dict = field(default_factory=dict)  # decode key -> (TransferRequest, dst slots [m])
    chunks: list = field(default_factory=list)  # queued until every decode rank has asked
    tokens_sent: int = 0
    chunk_plans: dict = field(default_factory=dict)  # decode key -> (src, dst, plan) of the chunk being sent
    writes: dict = field(default_factory=dict)  # decode key -> writes posted
    inflight: list = field(default_factory=list)  # [(Transfer, decode key)]

    @property
    def last_posted(self) -> bool:
        """Whether the last chunk's writes were posted (its post stamps ``status.last_posted_at``)."""
        return self.status.last_posted_at is not None

    @property
    def ready(self) -> bool:
        return bool(self.expected) and set(self.dests) == self.expected

    def attach(self, key: tuple, req: TransferRequest, askers_of: Callable[[str], frozenset], now: float,
               timeout_s: float) -> Optional[str]:
        """Record decode rank ``key``'s ask; why the request must fail, else None. Once every
        rank of the instance has asked the deadline starts and the request waits for input."""
        if self.instance is None:
            self.instance = req.instance
            self.expected = askers_of(req.instance)
        elif self.instance != req.instance:
            return f"decode instances {self.instance!r} and {req.instance!r} both asked"
        if len(req.dst_slots) % 8:
            return f"decode rank {key}: dst_slots of {len(req.dst_slots)} bytes is not int64 slots"
        self.dests[key] = (req, np.frombuffer(req.dst_slots, dtype="<i8").astype(np.int64))
        if self.ready:
            self.deadline = now + timeout_s
            self.status.advance(KVPoll.WaitingForInput)
        return None

    def post(self, chunk: Chunk, mine: RankLayout, peers: dict) -> None:
        """Post ``chunk``'s writes to each decode rank that reads from this one (``peers``: key
        -> DecodePeer), each with its notification; Transferring. ValueError where the decode
        rank's destination does not fit the tokens sent."""
        if chunk.last:  # (decode may count its notifications before this call returns)
            self.status.last_posted_at = time.monotonic()
        new = chunk.layers is None or chunk.layers[0] == 0  # a new chunk of tokens: planned once, whatever its groups
        if new:
            first, self.tokens_sent = self.tokens_sent, self.tokens_sent + chunk.slots.size
            self.chunk_plans = {}
        layers = len(mine.layer_ids)
        closes = chunk.layers is None or chunk.layers[1] == layers  # the chunk's last layers go now
        for key in sorted(self.dests):
            req, dst_all = self.dests[key]
            peer = peers[key]
            if not peer.reads_from_me:  # it asked so that this rank does not wait; nothing to write
                continue
            if new:
                self.chunk_plans[key] = self._plan(key, peer, chunk.slots, first, mine)
            src, dst, plan = self.chunk_plans[key]
            if plan is None:  # no tokens to send: nothing planned, nothing to batch
                writes = [("kv", _NO_KV)]
            else:
                if chunk.layers is not None:  # buffer b holds layer position b % layers (export order)
                    position = plan.src_buf % layers
                    plan = plan.select((position >= chunk.layers[0]) & (position < chunk.layers[1]))
                writes = [("kv", peer.batch(plan))]
            if mine.state_kind is StateKind.NSA_INDEX and closes:
                writes.append(("state", peer.batch(plan_state_transfer(mine, peer.layout, src, dst))))
            if chunk.last:
                if self.tokens_sent != req.prefix_tokens + dst_all.size:
                    raise ValueError(f"the request has {self.tokens_sent} tokens, decode rank {key} expects "
                                     f"{req.prefix_tokens} held + {dst_all.size} sent")
                writes += _state_writes(mine, peer, req, chunk)
            for i, (part, batch) in enumerate(writes):
                seq = self.writes.get(key, 0)
                self.writes[key] = seq + 1
                final = chunk.last and i == len(writes) - 1
                aux = chunk.aux if final and peer.writes_aux and chunk.aux is not None else b""
                note = KVArrived(request_id=self.request_id, part=part, seq=seq, total=seq + 1 if final else 0,
                                 aux=bytes(aux)).to_msgpack()
                self.inflight.append((write_batch(peer.peer, batch, note), key))
        self.status.advance(KVPoll.Transferring)

    def _plan(self, key: tuple, peer, slots: np.ndarray, first: int, mine: RankLayout) -> tuple:
        """``(src, dst, plan)`` of a chunk of ``slots`` from token ``first`` to decode rank ``key``;
        tokens decode already holds are skipped (plan None when none is left to send: a plan
        of nothing costs a request's last chunk more than its write of no bytes). ValueError
        where its destination does not fit the tokens sent."""
        req, dst_all = self.dests[key]
        skip = min(slots.size, max(0, req.prefix_tokens - first))  # tokens decode already holds
        src = slots[skip:]
        start = first + skip - req.prefix_tokens
        dst = dst_all[start:start + src.size]
        if dst.size != src.size:
            raise ValueError(f"decode rank {key} reserved {dst_all.size} slots after a prefix of "
                             f"{req.prefix_tokens}, prefill sends token {first + slots.size}")
        return src, dst, plan_kv_transfer(mine, peer.layout, src, dst) if src.size else None

    def poll_writes(self, failed: Callable[[tuple, str], None]) -> bool:
        """Poll the writes; ``failed(key, error)`` for each that failed; Success once the last
        chunk's writes are all done. True while some are in flight."""
        still = []
        for transfer, key in self.inflight:
            status = transfer.status()
            if status is TransferStatus.PENDING:
                still.append((transfer, key))
            elif status is TransferStatus.FAILED:
                failed(key, transfer.error)
        self.inflight = still
        if self.last_posted and not still:
            self.status.advance(KVPoll.Success)
        return bool(still)

    def fail(self, reason: str) -> bool:
        """Fail the request unless it ended; its writes are cancelled (they stay in flight until
        nothing of them can land). Whether it failed now."""
        if not self.status.fail(reason):
            return False
        for transfer, _ in self.inflight:
            transfer.cancel()
        return True

    def describe(self) -> str:
        """Where it waits, for a timeout's message."""
        if not self.ready:
            missing = sorted(self.expected - set(self.dests)) if self.expected else "every decode rank"
            return f"waiting for the destination from {missing}"
        if self.chunks:
            return f"{self.tokens_sent} tokens sent, the next chunk's KV not computed yet"
        if not self.last_posted:
            return f"{self.tokens_sent} tokens sent, waiting for the last chunk"
        return f"{len(self.inflight)} writes in flight"


def _state_writes(mine: RankLayout, peer, req: TransferRequest, chunk: Chunk) -> list:
    """The Mamba state write that goes with the last chunk to one decode rank."""
    if mine.state_kind is not StateKind.MAMBA or req.state_slot <= 0:
        return []
    plan = plan_state_transfer(mine, peer.layout, int(chunk.state_slot), req.state_slot)
    return [] if plan.empty else [("state", peer.batch(plan))]
