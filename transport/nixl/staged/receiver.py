"""The receiving side of the staged mode: lanes opened by senders, scatter, then notify.

Runs inside the owner's ``poll_notifications()`` (and any other call that reads NIXL's
notifications), on the owner's thread:

- :class:`~transport.nixl.staged.wire.Hello`: a sender's earlier lanes are dropped (its
  notifications arrive in order, so none of their chunks is still to come), a lane of
  ``slots`` x ``slot_bytes`` is allocated on the asked memory (host memory a sender on this
  host may share: :mod:`~transport.nixl.staged.shared`) and registered, the sender's
  metadata loaded, and a Welcome sent back (or one with ``error``: too many lanes, a lane
  larger than this side's ``StagedNixlConfig`` allows, no memory).
- :class:`~transport.nixl.staged.wire.Chunk`: its slot's header and row table are checked
  (the chunk the notification names, every row inside a registered region of the lane's
  memory), the rows scattered, a Credit sent; once every chunk of a write is scattered (in
  whatever order they came), its ``notify`` is queued for the owner, so a notification still
  means the bytes are in place. A chunk that fails the checks lands nothing and is answered
  with the error (the write then never notifies).
- :class:`~transport.nixl.staged.wire.StridedChunk`: the same for a chunk of a strided write,
  except that the rows are named by the write's destination table (every chunk carries it):
  it is read and checked (every pair inside a registered region of the lane's memory for its
  furthest slot, O(P + S)) at the write's first chunk here and kept, with the table the scatter
  uses (on a GPU: uploaded once), until the write's last chunk is scattered, a later write
  starts on the lane (a lane's writes run one after the other), or the lane is dropped; later
  chunks are checked against it by their header alone and scattered in one step.

Answers wait for the scatter, not the receiver (GPU lanes): a chunk's scatter is queued on the
lane's stream and its answers (the Credit, and the write's notification after its last chunk)
wait in the lane's FIFO until the slot's event has passed, while the next chunks' headers are
read and their scatters queued. The transport's pump (:meth:`transport.nixl.core.Core.pump`)
reads NIXL's notifications again while scatters are in flight (for at most ~1 ms a call) and
returns only once every answer went out: the owner's thread is held about as long as
synchronous scatters would hold it, and nothing is in flight between two calls (``deregister``
and ``close`` find every scatter done). An owner's notification from a sender whose answers
wait joins the same FIFO: one sender's notifications keep their order. Host lanes scatter
synchronously; their answers go out at once.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from transport.base import Notification
from transport.nixl.staged import shared
from transport.nixl.staged.copy import Landed, Staging, make_staging
from transport.nixl.staged.wire import (Chunk, Credit, Hello, ProtocolError, StridedChunk, Welcome, encode,
                                        registered_entries)

__all__ = ["ReceiverLanes"]


class _Lane:
    def __init__(self, staging: Staging, reg, device: Optional[int]):
        self.staging, self.reg, self.device = staging, reg, device
        self.scattered: dict[int, int] = {}  # write seq -> its chunks scattered so far
        self.held: dict[int, bytes] = {}  # write seq -> its notify, until every chunk is scattered
        self.strided: dict[int, Landed] = {}  # write seq -> its checked destination table (strided writes)
        # (slot whose queued scatter must pass first or None, Credit or None, owner's payload or None), in order
        self.answers: deque[tuple] = deque()

    def known(self, seq: int) -> Optional[Landed]:
        """The strided write ``seq``'s table from an earlier chunk; tables of earlier writes are
        dropped (a lane's writes run one after the other: none of their chunks is still to come)."""
        for old in [q for q in self.strided if q < seq]:
            del self.strided[old]
        return self.strided.get(seq)

    def landed(self, msg: Chunk) -> Optional[bytes]:
        """Count a scattered chunk; the write's notify once all its chunks are (else None)."""
        if msg.notify:
            self.held[msg.seq] = bytes(msg.notify)
        done = self.scattered[msg.seq] = self.scattered.get(msg.seq, 0) + 1
        if done < msg.chunks:
            return None
        del self.scattered[msg.seq]
        self.strided.pop(msg.seq, None)
        return self.held.pop(msg.seq, None)


class ReceiverLanes:
    """The lanes senders opened to one transport, by (sender name, lane id)."""

    def __init__(self, core):
        self._core = core  # transport.nixl.core.Core: agent, remotes, config, registry, table(), registered(), deliver()
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._waiting: dict[str, _Lane] = {}  # sender -> its lane whose answers wait for a scatter

    @property
    def in_flight(self) -> bool:
        """Some lane's answers wait for a scatter queued on its stream."""
        return bool(self._waiting)

    def deliver(self, sender: str, payload: bytes) -> None:
        """An owner's notification from ``sender``: to the owner, behind the sender's answers
        that wait for a scatter (module doc)."""
        lane = self._waiting.get(sender)
        if lane is None:
            self._core.deliver(Notification(sender, payload))
        else:
            lane.answers.append((None, None, payload))

    def answer(self) -> None:
        """Send every answer whose scatter has passed, in each lane's order (never blocks)."""
        for sender, lane in list(self._waiting.items()):
            self._answer_ready(sender, lane)

    def wait_oldest(self) -> None:
        """Block until the scatter the first waiting lane's oldest answer waits for has passed
        (a waiting lane's first answer always names one: :meth:`_answer_ready` sends the rest)."""
        lane = next(iter(self._waiting.values()), None)
        if lane is not None:
            lane.staging.ready(lane.answers[0][0])

    def _answer_ready(self, sender: str, lane: _Lane) -> None:
        answers = lane.answers
        while answers and (answers[0][0] is None or lane.staging.is_ready(answers[0][0])):
            _, credit, payload = answers.popleft()
            if payload is not None:
                self._core.deliver(Notification(sender, payload))
            if credit is not None:
                self._answer(sender, credit)
        if answers:
            self._waiting[sender] = lane
        elif self._waiting.get(sender) is lane:
            del self._waiting[sender]

    def __len__(self) -> int:
        return len(self._lanes)

    def stagings(self) -> list[Staging]:
        """The staging memory of every lane (registered with this transport's agent)."""
        return [lane.staging for lane in self._lanes.values()]

    def handle(self, sender: str, msg) -> None:
        if isinstance(msg, Hello):
            self._hello(sender, msg)
        elif isinstance(msg, Chunk):
            self._chunk(sender, msg)

    def _answer(self, sender: str, msg) -> None:
        self._core.agent.send(sender, encode(msg))  # False: the sender is gone, its transfer fails at its deadline

    def _hello(self, sender: str, msg: Hello) -> None:
        cfg = self._core.config.staged
        for key in [k for k in self._lanes if k[0] == sender]:
            self._drop(key)
        try:  # the sender must be known to answer it (its own connect may load it too: NIXL updates in place)
            registered = registered_entries(msg.registered)
            self._core.agent.load(msg.metadata)
        except Exception:
            return  # cannot answer: the sender's write fails at its deadline
        self._core.remotes.loaded_too(sender, registered)
        device = None if msg.device == -1 else msg.device
        error = ""
        held = sum((lane.device is None) == (device is None) for lane in self._lanes.values())
        most = cfg.slots * cfg.slot_bytes_for(device)
        kind = "host" if device is None else "CUDA"
        if held >= cfg.lanes_for(device):
            error = (f"this receiver holds {held} {kind} lanes "
                     f"({'max_lanes' if device is None else 'max_cuda_lanes'} {cfg.lanes_for(device)})")
        elif msg.slots < 2 or msg.slot_bytes < 1 << 16 or msg.slots * msg.slot_bytes > most:
            error = (f"a lane of {msg.slots} x {msg.slot_bytes} bytes; this receiver allows at most "
                     f"{most} bytes per lane on {kind} memory")
        elif device is not None and not any(r.device == device for r in self._core.registry.view.values()):
            error = f"no region of this receiver is on cuda:{device}"
        if not error:
            staging = None
            try:
                staging = self._staging(msg, device)
                reg = self._core.agent.register(staging.ptr, staging.nbytes, device)
            except Exception as exc:
                if staging is not None:
                    staging.close()
                error = f"staging of {msg.slots * msg.slot_bytes} bytes: {type(exc).__name__}: {exc}"
        if error:
            self._answer(sender, Welcome(msg.lane, 0, b"", error))
            return
        self._lanes[sender, msg.lane] = _Lane(staging, reg, device)
        self._answer(sender, Welcome(msg.lane, staging.ptr, self._core.agent.metadata(), "", self._core.registered(),
                                     staging.shared))

    def _staging(self, msg: Hello, device: Optional[int]) -> Staging:
        """The lane's staging: host slots the sender can share when it runs on this host and
        both sides allow it (:mod:`~transport.nixl.staged.shared`), else this side's own."""
        if (device is None and self._core.config.staged.shared_slots and msg.host
                and msg.host == shared.host_key()):
            try:
                return shared.SharedHostStaging(msg.slots, msg.slot_bytes)
            except OSError:  # no memfd here: slots of its own, which NIXL writes
                pass
        return make_staging(msg.slots, msg.slot_bytes, device)

    def _chunk(self, sender: str, msg: Chunk) -> None:
        lane = self._lanes.get((sender, msg.lane))
        if lane is None:
            return  # a lane dropped by a newer Hello: its sender no longer waits for it
        try:
            if not 0 <= msg.slot < lane.staging.slots:
                raise ProtocolError(f"slot {msg.slot} of a {lane.staging.slots}-slot lane")
            expect = (msg.lane, msg.seq, msg.index)
            if isinstance(msg, StridedChunk):
                _, lane.strided[msg.seq] = lane.staging.land_strided(msg.slot, expect, msg.chunks, self._core.table(),
                                                                     lane.known(msg.seq))
            else:
                lane.staging.land(msg.slot, expect, self._core.table())
        except (ProtocolError, ValueError, TypeError) as exc:
            lane.strided.pop(msg.seq, None)  # a later chunk of it checks its own table again
            lane.answers.append((None, Credit(msg.lane, msg.seq, msg.index, msg.slot, str(exc)), None))
            self._answer_ready(sender, lane)
            return
        lane.staging.queued(msg.slot)  # the scatter's event: the answers wait for it
        lane.answers.append((msg.slot, Credit(msg.lane, msg.seq, msg.index, msg.slot), lane.landed(msg)))
        self._answer_ready(sender, lane)

    def _drop(self, key) -> None:
        lane = self._lanes.pop(key)
        lane.staging.ready()  # its scatters are done before its memory goes; their answers go out
        self._answer_ready(key[0], lane)
        self._core.agent.deregister(lane.reg)
        lane.staging.close()

    def close(self) -> None:
        for key in list(self._lanes):
            try:
                self._drop(key)
            except Exception:  # keep releasing the rest; the agent's teardown frees it too
                pass
