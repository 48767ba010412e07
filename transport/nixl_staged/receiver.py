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
"""

from __future__ import annotations

from typing import Optional

from transport.base import Notification
from transport.nixl_staged.copy import Staging, make_staging
from transport.nixl_staged.wire import Chunk, Credit, Hello, ProtocolError, Welcome, encode

__all__ = ["ReceiverLanes"]


class _Lane:
    def __init__(self, staging: Staging, reg, device: Optional[int]):
        self.staging, self.reg, self.device = staging, reg, device
        self.scattered: dict[int, int] = {}  # write seq -> its chunks scattered so far
        self.held: dict[int, bytes] = {}  # write seq -> its notify, until every chunk is scattered

    def landed(self, msg: Chunk) -> Optional[bytes]:
        """Count a scattered chunk; the write's notify once all its chunks are (else None)."""
        if msg.notify:
            self.held[msg.seq] = bytes(msg.notify)
        done = self.scattered[msg.seq] = self.scattered.get(msg.seq, 0) + 1
        if done < msg.chunks:
            return None
        del self.scattered[msg.seq]
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
        if len(self._lanes) >= cfg.max_lanes:
            error = f"this receiver holds {len(self._lanes)} lanes (max_lanes {cfg.max_lanes})"
        elif msg.slots < 2 or msg.slot_bytes < 1 << 16 or msg.slots * msg.slot_bytes > cfg.lane_bytes:
            error = (f"a lane of {msg.slots} x {msg.slot_bytes} bytes; this receiver allows at most "
                     f"{cfg.lane_bytes} bytes per lane")
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
            lane.staging.land(msg.slot, (msg.lane, msg.seq, msg.index), self._t._table())
        except (ProtocolError, ValueError, TypeError) as exc:
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
