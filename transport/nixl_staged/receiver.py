"""The receiving side of the staged mode: lanes opened by senders, scatter, then notify.

Runs inside the owner's ``poll_notifications()`` (and any other call that reads NIXL's
notifications), on the owner's thread:

- :class:`~transport.nixl_staged.wire.Hello`: a sender's earlier lanes are dropped (its
  notifications arrive in order, so none of their chunks is still to come), a lane of
  ``slots`` x ``slot_bytes`` is allocated on the asked memory and registered, the sender's
  metadata loaded, and a Welcome sent back (or one with ``error``: too many lanes, a lane
  larger than this side's ``StagedNixlConfig`` allows, no memory).
- :class:`~transport.nixl_staged.wire.Chunk`: its slot's header and row table are checked
  (the chunk the notification names, every row inside a registered region of the lane's
  memory), the rows scattered, a Credit sent; once every chunk of a write is scattered (in
  whatever order they came), its ``notify`` is queued for the owner, so a notification still
  means the bytes are in place. A chunk that fails the checks lands nothing and is answered
  with the error (the write then never notifies).
- :class:`~transport.nixl_staged.wire.StridedChunk`: the same for a chunk of a strided write,
  except that the rows are named by the write's destination table (every chunk carries it):
  it is read and checked (every pair inside a registered region of the lane's memory for its
  furthest slot, O(P + S)) at the write's first chunk here and kept, with the table the scatter
  uses (on a GPU: uploaded once), until the write's last chunk is scattered, a later write
  starts on the lane (a lane's writes run one after the other), or the lane is dropped; later
  chunks are checked against it by their header alone and scattered in one step.
"""

from __future__ import annotations

from typing import Optional

from transport.base import Notification
from transport.nixl_staged.copy import Landed, Staging, make_staging
from transport.nixl_staged.wire import Chunk, Credit, Hello, ProtocolError, StridedChunk, Welcome, encode

__all__ = ["ReceiverLanes"]


class _Lane:
    def __init__(self, staging: Staging, reg, device: Optional[int]):
        self.staging, self.reg, self.device = staging, reg, device
        self.scattered: dict[int, int] = {}  # write seq -> its chunks scattered so far
        self.held: dict[int, bytes] = {}  # write seq -> its notify, until every chunk is scattered
        self.strided: dict[int, Landed] = {}  # write seq -> its checked destination table (strided writes)

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

    def __init__(self, transport):
        self._t = transport
        self._lanes: dict[tuple[str, int], _Lane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    def handle(self, sender: str, msg) -> None:
        if isinstance(msg, Hello):
            self._hello(sender, msg)
        elif isinstance(msg, Chunk):
            self._chunk(sender, msg)

    def _answer(self, sender: str, msg) -> None:
        try:
            self._t._agent_checked().send_notif(sender, encode(msg))
        except Exception:  # the sender is gone: its transfer fails at its deadline
            pass

    def _hello(self, sender: str, msg: Hello) -> None:
        cfg = self._t.config.staged
        for key in [k for k in self._lanes if k[0] == sender]:
            self._drop(key)
        try:  # the sender must be known to answer it (its own connect may load it too: NIXL updates in place)
            self._t._agent_checked().add_remote_agent(msg.metadata)
        except Exception:
            return  # cannot answer: the sender's write fails at its deadline
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
        elif device is not None and not any(r.device == device for r in self._t.regions.values()):
            error = f"no region of this receiver is on cuda:{device}"
        if not error:
            try:
                staging = make_staging(msg.slots, msg.slot_bytes, device)
                reg = self._t._register_raw(staging.ptr, staging.nbytes, device)
            except Exception as exc:
                error = f"staging of {msg.slots * msg.slot_bytes} bytes: {type(exc).__name__}: {exc}"
        if error:
            self._answer(sender, Welcome(msg.lane, 0, b"", error))
            return
        self._lanes[sender, msg.lane] = _Lane(staging, reg, device)
        self._answer(sender, Welcome(msg.lane, staging.ptr, bytes(self._t._agent_checked().get_agent_metadata())))

    def _chunk(self, sender: str, msg: Chunk) -> None:
        lane = self._lanes.get((sender, msg.lane))
        if lane is None:
            return  # a lane dropped by a newer Hello: its sender no longer waits for it
        try:
            if not 0 <= msg.slot < lane.staging.slots:
                raise ProtocolError(f"slot {msg.slot} of a {lane.staging.slots}-slot lane")
            expect = (msg.lane, msg.seq, msg.index)
            if isinstance(msg, StridedChunk):
                _, lane.strided[msg.seq] = lane.staging.land_strided(msg.slot, expect, msg.chunks, self._t._table(),
                                                                     lane.known(msg.seq))
            else:
                lane.staging.land(msg.slot, expect, self._t._table())
        except (ProtocolError, ValueError, TypeError) as exc:
            lane.strided.pop(msg.seq, None)  # a later chunk of it checks its own table again
            self._answer(sender, Credit(msg.lane, msg.seq, msg.index, msg.slot, str(exc)))
            return
        notify = lane.landed(msg)
        if notify:
            self._t._notes.append(Notification(sender, notify))
        self._answer(sender, Credit(msg.lane, msg.seq, msg.index, msg.slot))

    def _drop(self, key) -> None:
        lane = self._lanes.pop(key)
        self._t._deregister_raw(lane.reg)
        lane.staging.close()

    def close(self) -> None:
        for key in list(self._lanes):
            try:
                self._drop(key)
            except Exception:  # keep releasing the rest; the agent's teardown frees it too
                pass
