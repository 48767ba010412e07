"""One request's progress on a decode rank: :class:`DecodeRequest`.

A request is asked of the prefill ranks once they are ready (WaitingForInput), counts each
sender's writes as their notifications land (:meth:`DecodeRequest.arrived`: Transferring,
then Success once every sender's count reaches the total its last write named), and keeps the
aux record the last write carries. Its pages may be reused -- ``released`` -- once it
succeeded, or failed and every sender is quiet for it (:meth:`~DecodeRequest.quiesce`: said
``Quiesced``, or lost in a way that proves it writes nothing more). The manager keeps these
records and owns the sockets; a record changes only its own state. Loop thread only, except
``released``, ``has_aux`` and ``aux_slot``, which the owner's :class:`KVReceiver` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvtransfer.control.aux_records import AuxRecords
from kvtransfer.control.state import KVPoll, RequestStatus
from kvtransfer.control.wire import KVArrived

__all__ = ["DecodeRequest"]


@dataclass
class DecodeRequest:
    """A request's progress on this rank (module docstring)."""

    request_id: str
    status: RequestStatus  # shared with the owner's KVReceiver
    senders: tuple  # the prefill ranks it reads from
    since: float  # when the engine made it
    deadline: float
    counts: dict = field(default_factory=dict)  # prefill rank -> writes landed
    totals: dict = field(default_factory=dict)  # prefill rank -> writes it made (from its last one)
    quiesced: set = field(default_factory=set)  # prefill ranks with nothing in flight for it
    asked: bool = False
    request: Optional[tuple] = None  # (dst_slots bytes, prefix_tokens, state_slot) until asked
    aux_slot: Optional[int] = None  # its aux record, from init() until close()
    has_aux: bool = False  # the aux record arrived
    released: bool = False  # no byte of its writes can still land

    def arrived(self, rank: int, note: KVArrived, aux: AuxRecords) -> None:
        """A write of prefill rank ``rank`` landed (an ended request's late one means nothing)."""
        if self.status.state.final:
            return
        self.counts[rank] = self.counts.get(rank, 0) + 1
        if note.total:
            self.totals[rank] = note.total
        if note.aux and self.aux_slot is not None:
            aux.write(self.aux_slot, note.aux)
            self.has_aux = True
        self.status.advance(KVPoll.Transferring)
        if all(self.totals.get(r) is not None and self.counts.get(r, 0) >= self.totals[r] for r in self.senders):
            if self.status.advance(KVPoll.Success):
                self.released = True

    def waiting_for(self) -> list:
        """The senders whose writes have not all landed."""
        return [r for r in self.senders if self.counts.get(r, 0) < self.totals.get(r, 1 << 62)]

    def quiesce(self, *ranks: int) -> None:
        """``ranks`` write nothing more for this request; a failed one is released once all do."""
        self.quiesced.update(ranks)
        if self.status.state is KVPoll.Failed and self.quiesced >= set(self.senders):
            self.released = True
