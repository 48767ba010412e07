"""Prefill and decode ranks as real processes for the control-plane tests.

Each rank (``multiprocessing`` "spawn") owns its pools on the CPU (:mod:`._pools`: MHA, MLA or
hybrid Mamba), a NIXL transport over loopback and its KV manager; the test drives it with
typed commands over a pipe and gets a :class:`Reply` for each. The KV and state a prefill rank
"computes" for a request are seeded reference rows, so a decode rank checks every landed
byte on its own. A prefill rank counts the writes it posts through its NIXL peers and its
connects, and can make one of those writes fail in NIXL, in its post or after it
(:class:`WriteFaults`).
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from kvtransfer._procs import Child

REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankSpec:
    role: str  # "prefill" | "decode"
    tp_rank: int
    tp_size: int
    page_size: int
    bootstrap: str
    kind: str = "mha"  # _pools.KINDS
    pages: int = 64
    device: int = -1  # CUDA ordinal of the pools (-1: host memory)
    backends: tuple = ("nixl",)  # the rank's transports ("nvlink" needs a CUDA pool)
    seed: int = 0
    config: dict = field(default_factory=dict)  # ControlConfig fields
    instance: Optional[str] = None
    netns: Optional[object] = None  # a kvtransfer.netns.Host: the rank runs on that "host"
    names_process: bool = True  # False: it cannot name its process (as where /proc is another pid namespace's)


# -- commands ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefill:
    """Prefill: take slots for ``tokens``, store the reference KV, send it in ``chunks``."""

    request_id: str
    tokens: int
    chunks: tuple  # token counts per chunk, summing to ``tokens``
    first_token: int = 0
    hold_last: int = 0  # hold the last this many sends (True: the last one; layer groups count): SendLast sends them
    late_cycles: int = 0  # GPU pools: the KV queued on a side stream behind a busy wait, sent unfinished
    layer_groups: int = 0  # each chunk sent in this many consecutive layer groups (0: whole)
    fail_write: int = 0  # the fail_write-th write this rank posts from now on fails in NIXL's post (WriteFaults)
    lose_write: int = 0  # the lose_write-th write posted from now on fails after its post (WriteFaults.lose; 0: none)
    stall_s: float = 0.0  # with lose_write: NIXL still runs the failed write this long after it failed


@dataclass(frozen=True)
class SendLast:
    """Prefill: send what ``Prefill.hold_last`` held, in order."""

    request_id: str


@dataclass(frozen=True)
class Receive:
    """Decode: reserve slots for tokens ``prefix..tokens`` and ask the senders."""

    request_id: str
    tokens: int
    prefix: int = 0


@dataclass(frozen=True)
class Wait:
    """Either side: wait for a final state; reply ``(state name, reason)``."""

    request_id: str
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Verify:
    """Decode: ``(bad rows, first token)`` of a successful request; frees its slots."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str = "test abort"


@dataclass(frozen=True)
class Released:
    """Decode: wait until the request's pages may be reused, free them; reply the wait in s."""

    request_id: str
    timeout_s: float = 30.0


@dataclass(frozen=True)
class IsReleased:
    """Decode: whether the request's pages may be reused now (nothing is freed)."""

    request_id: str


@dataclass(frozen=True)
class HoldLoop:
    """Either side: one turn of the manager's loop runs its tick (after 0.3 s: a heartbeat is
    due by then), is held ``seconds``, and runs the tick again, as a turn slowed by a loaded
    machine would: what arrives meanwhile (the heartbeat's answer) is not read yet. Reply once
    it has run. ``send_last``: prefill sends its held last chunk while the turn is held (the
    send waits for the next turn); ``tick_after`` False: no tick at the end of the held turn
    (the next turn runs the send before its own tick)."""

    seconds: float
    send_last: bool = False
    tick_after: bool = True


@dataclass(frozen=True)
class Rows:
    """Either side: ``{layer position: [tokens, row bytes] uint8}``, the request's KV token rows
    in its slots now (host pools), the buffers of a layer side by side (MHA: K | V)."""

    request_id: str
    layers: tuple


@dataclass(frozen=True)
class Stats:
    """Reply ``{"free_pages", "requests", "threads", "changes", "moves"}`` (the manager's
    ``on_change`` calls, and the state changes its requests' statuses stamped, of the requests
    still held here), and on prefill ``"writes"`` and ``"connects"``: the writes posted through
    its NIXL peers and the connects of its NIXL transport so far (:class:`WriteFaults`)."""


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class Reply:
    ok: bool
    value: object = None
    error: str = ""


class WriteFaults:
    """The writes a prefill rank posts through its NIXL peers, counted (``posted``), its NIXL
    transport's connects, counted (``connects``), and the write made to fail in one of two ways
    a UCX error surfaces:

    - in its post (:meth:`fail`): NIXL's ``transfer`` raises its ``nixlBackendError``; the
      transport reports the write FAILED ("NIXL reported ERR (...) when posting") and counts
      the peer lost until a new connect (part of a request whose post failed may be in flight;
      here nothing of it is sent);
    - after its post (:meth:`lose`), as when the connection to the peer broke under it: NIXL's
      ``transfer`` takes the write ("PROC") but nothing of it goes out, and ``check_xfer_state``
      of it raises ``nixlRemoteDisconnectError``; the transport then reports it FAILED and
      counts the peer lost until a new connect, which waits until NIXL no longer runs the failed
      write (``stall_s``: the check says it is in progress that long, then raises again).

    A transport is used from one thread at a time, so one flag says which post is that write's."""

    def __init__(self):
        self.posted = 0
        self.connects = 0
        self._fail_at = 0  # the value of ``posted`` whose write fails in its post (0: none)
        self._lose_at = 0  # the value of ``posted`` whose write fails after its post (0: none)
        self._stall_s = 0.0
        self._failing = False  # the write failing in its post is in the transport now
        self._losing = False  # the write failing after its post is in the transport now
        self._lost: dict = {}  # id(handle) -> [handle, when its state check first failed (None: not yet)]
        self._hooked = False  # NIXL's post and state check go through _hook's (from the first fault on)

    def fail(self, nth: int) -> None:
        """The ``nth`` write posted from now on fails in its post (0: none)."""
        if nth and not self._hooked:
            self._hook()
        self._fail_at = self.posted + nth if nth else 0

    def lose(self, nth: int, stall_s: float = 0.0) -> None:
        """The ``nth`` write posted from now on fails after its post (0: none); NIXL reports it
        in progress for ``stall_s`` after its first failed check."""
        if nth and not self._hooked:
            self._hook()
        self._lose_at = self.posted + nth if nth else 0
        self._stall_s = stall_s

    def _hook(self) -> None:
        """NIXL's post raises while the write failing there is in the transport; its state
        check raises for the request of the write failing after its post (this process's
        agents: the rank's one NIXL transport)."""
        from transport._nixl_import import load_nixl_api

        api = load_nixl_api()
        transfer, check = api.nixl_agent.transfer, api.nixl_agent.check_xfer_state
        refused, disconnected = api.nixlBind.nixlBackendError, api.nixlBind.nixlRemoteDisconnectError

        def post(agent, handle, notif_msg=b""):
            if self._failing:
                raise refused("NIXL_ERR_BACKEND")
            if self._losing:  # the handle is kept: its id names no other request while it lives
                self._lost[id(handle)] = [handle, None]
                return "PROC"
            return transfer(agent, handle, notif_msg)

        def state(agent, handle):
            lost = self._lost.get(id(handle))
            if lost is None:
                return check(agent, handle)
            now = time.monotonic()
            if lost[1] is None:
                lost[1] = now
            elif now - lost[1] < self._stall_s:
                return "PROC"
            else:  # the transport releases it now
                del self._lost[id(handle)]
            raise disconnected("NIXL_ERR_REMOTE_DISCONNECT")
        api.nixl_agent.transfer = post
        api.nixl_agent.check_xfer_state = state
        self._hooked = True

    def counted(self, connect):
        """``connect`` of a NIXL transport whose connects and peers' writes are counted here."""
        def counted_connect(export):
            peer = _CountedPeer(connect(export), self)
            self.connects += 1
            return peer
        return counted_connect

    def write(self, write, batch, notify):
        self.posted += 1
        self._failing = self.posted == self._fail_at
        self._losing = self.posted == self._lose_at
        try:
            return write(batch, notify)
        finally:
            self._failing = self._losing = False


class _CountedPeer:
    """A NIXL peer whose writes go through :class:`WriteFaults`; the rest is the peer's own."""

    def __init__(self, peer, faults: WriteFaults):
        self._peer, self._faults = peer, faults

    def write(self, batch, notify=None):
        return self._faults.write(self._peer.write, batch, notify)

    def write_strided(self, batch, notify=None):
        return self._faults.write(self._peer.write_strided, batch, notify)

    def __getattr__(self, name):
        return getattr(self._peer, name)


class _Count:
    """A callable that counts its calls (from any thread)."""

    def __init__(self):
        self.n = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.n += 1


class _Rank:
    def __init__(self, spec: RankSpec):
        import numpy as np

        from kvtransfer.control.config import ControlConfig
        from tests.kvtransfer.control._pools import PoolKit
        from transport.nixl import NixlTransport

        self.spec = spec
        self.kit = PoolKit(spec.kind, spec.tp_rank, spec.tp_size, spec.page_size, spec.pages, device=spec.device)
        self.layout = self.kit.layout
        rng = np.random.default_rng(spec.seed * 1000 + spec.tp_rank * 10 + (spec.role == "decode"))
        self.free_pages = [int(p) for p in rng.permutation(np.arange(1, spec.pages + 1))]
        self.free_state = list(range(1, 32)) if spec.kind == "hybrid" else []
        self.state_slot: dict = {}  # request id -> state slot (hybrid)
        self.slots: dict = {}  # request id -> [tokens] slots
        self.transports = []
        self.faults = WriteFaults() if spec.role == "prefill" else None
        for backend in spec.backends:
            if backend == "nixl":
                transport = NixlTransport()
                if self.faults is not None:
                    transport.connect = self.faults.counted(transport.connect)
                self.transports.append(transport)
            else:
                from transport.nvlink import NvlinkTransport

                self.transports.append(NvlinkTransport())
        device = None if spec.device < 0 else spec.device
        config = ControlConfig(**spec.config)
        infos, state_infos = self.kit.kv_infos, self.kit.state_infos
        self.changes = _Count()  # the manager's on_change calls
        if spec.role == "prefill":
            from kvtransfer.control.prefill import PrefillKVManager

            self.manager = PrefillKVManager(self.layout, self.transports, infos, state_infos,
                                            bootstrap=spec.bootstrap, config=config, device=device,
                                            on_change=self.changes)
        else:
            from kvtransfer.control.decode import DecodeKVManager

            self.manager = DecodeKVManager(self.layout, self.transports, infos, state_infos, bootstrap=spec.bootstrap,
                                           instance=spec.instance, config=config, device=device,
                                           on_change=self.changes)
        self.handles: dict = {}
        self.requests: dict = {}  # decode: request id -> (tokens, prefix)

    def take(self, request_id: str, tokens: int):
        import numpy as np

        ps = self.spec.page_size
        need = -(-tokens // ps)
        if need > len(self.free_pages):
            raise RuntimeError(f"rank out of pages: need {need}, {len(self.free_pages)} free")
        pages, self.free_pages = self.free_pages[:need], self.free_pages[need:]
        slots = (np.array(pages)[:, None] * ps + np.arange(ps)).reshape(-1)[:tokens]
        self.slots[request_id] = slots
        if self.free_state:
            self.state_slot[request_id] = self.free_state.pop(0)
        return slots

    def give_back(self, request_id: str) -> None:
        slots = self.slots.pop(request_id)
        ps = self.spec.page_size
        self.free_pages += sorted({int(s) // ps for s in slots})
        if request_id in self.state_slot:
            self.free_state.append(self.state_slot.pop(request_id))

    def run(self, cmd):
        from kvtransfer.control.aux_records import pack_first_token
        from kvtransfer.control.state import KVPoll

        if isinstance(cmd, Prefill):
            self.faults.fail(cmd.fail_write)
            self.faults.lose(cmd.lose_write, cmd.stall_s)
            slots = self.take(cmd.request_id, cmd.tokens)
            state_slot = self.state_slot.get(cmd.request_id)
            if not cmd.late_cycles:
                self.kit.fill(cmd.request_id, slots, state_slot or 0)
                return self._prefill(cmd, slots, state_slot)
            import torch

            with torch.cuda.stream(torch.cuda.Stream(self.spec.device)):  # as an engine's compute stream
                self.kit.fill(cmd.request_id, slots, state_slot or 0, late_cycles=cmd.late_cycles)
                return self._prefill(cmd, slots, state_slot)
        if isinstance(cmd, SendLast):
            self._send_held()
            return None
        if isinstance(cmd, Receive):
            self.requests[cmd.request_id] = (cmd.tokens, cmd.prefix)
            slots = self.take(cmd.request_id, cmd.tokens - cmd.prefix)
            receiver = self.handles[cmd.request_id] = self.manager.receiver(cmd.request_id)
            receiver.init(slots, prefix_tokens=cmd.prefix, state_slot=self.state_slot.get(cmd.request_id))
            return None
        if isinstance(cmd, Wait):
            handle = self.handles[cmd.request_id]
            deadline = time.monotonic() + cmd.timeout_s
            while not handle.poll().final and time.monotonic() < deadline:
                time.sleep(0.001)
            if handle.poll() is KVPoll.Success and self.spec.role == "prefill":
                self.give_back(cmd.request_id)
            return handle.poll().name, handle.failure
        if isinstance(cmd, Verify):
            return self.verify(cmd.request_id)
        if isinstance(cmd, Abort):
            self.handles[cmd.request_id].abort(cmd.reason)
            return None
        if isinstance(cmd, Released):
            handle = self.handles.pop(cmd.request_id)
            t0 = time.monotonic()
            while not handle.released and time.monotonic() - t0 < cmd.timeout_s:
                time.sleep(0.001)
            if not handle.released:
                raise RuntimeError(f"{cmd.request_id}: not released after {cmd.timeout_s} s")
            handle.close()
            self.give_back(cmd.request_id)
            return time.monotonic() - t0
        if isinstance(cmd, IsReleased):
            return self.handles[cmd.request_id].released
        if isinstance(cmd, HoldLoop):
            loop, done, holding = self.manager._loop, threading.Event(), threading.Event()
            tick = loop._tick

            def held():
                loop._tick = tick
                try:
                    time.sleep(0.3)
                    tick()
                    holding.set()
                    time.sleep(cmd.seconds)
                    return tick() if cmd.tick_after else 0.0
                finally:
                    done.set()
            loop._tick = held
            loop.wake()
            if cmd.send_last:
                if not holding.wait(30):
                    raise RuntimeError("the held tick did not run")
                self._send_held()  # queued: the turn is held
            if not done.wait(cmd.seconds + 30):
                raise RuntimeError("the held tick did not run")
            return None
        if isinstance(cmd, Rows):
            return self.rows(cmd.request_id, cmd.layers)
        if isinstance(cmd, Stats):
            stats = {"free_pages": len(self.free_pages), "requests": self.manager.num_requests,
                     "threads": threading.active_count(),
                     "changes": self.changes.n,
                     "moves": sum(len(h.status.times) - 1 for h in self.handles.values())}
            if self.spec.role == "decode":
                stats["ready_senders"] = self.manager.ready_senders()
            else:
                stats["decode_peers"] = self.manager.decode_peers()
                stats["backends"] = self.manager.decode_backends()
                stats["writes"] = self.faults.posted
                stats["connects"] = self.faults.connects
            return stats
        raise TypeError(f"unknown command {type(cmd).__name__}")

    def _prefill(self, cmd: Prefill, slots, state_slot) -> None:
        from kvtransfer.control.aux_records import pack_first_token

        import numpy as np

        sender = self.handles[cmd.request_id] = self.manager.sender(cmd.request_id)
        layers = len(self.manager.layout.layer_ids)
        cuts = np.linspace(0, layers, min(cmd.layer_groups, layers) + 1).round().astype(int).tolist()
        groups = list(zip(cuts, cuts[1:])) if cmd.layer_groups else [None]
        sends = []  # send()'s arguments, in order: (slots, last, state_slot, aux, layers)
        start = 0
        for i, n in enumerate(cmd.chunks):
            for group in groups:
                final = i == len(cmd.chunks) - 1 and (group is None or group[1] == layers)
                sends.append((slots[start:start + n], final, state_slot if final else None,
                              pack_first_token(cmd.first_token, -0.5) if final else None,
                              None if group is None else tuple(group)))
            start += n
        cut = len(sends) - int(cmd.hold_last)
        self.held = (sender, sends[cut:])
        for send in sends[:cut]:
            self._send(sender, send)

    @staticmethod
    def _send(sender, send) -> None:
        slots, last, state_slot, aux, layers = send
        sender.send(slots, last=last, state_slot=state_slot, aux=aux, layers=layers)

    def _send_held(self) -> None:
        sender, sends = self.held
        for send in sends:
            self._send(sender, send)

    def rows(self, request_id: str, layers: tuple) -> dict:
        """:class:`Rows`: read from the pools' exported buffers (buffer b holds layer position
        b % layers, as they are exported)."""
        import ctypes

        import numpy as np

        if self.kit.device is not None:
            raise ValueError(f"Rows reads host pools, this rank's are on CUDA device {self.kit.device}")
        slots = self.slots[request_id]
        count = len(self.layout.layer_ids)
        picked = {position: [] for position in layers}
        for b, (ptr, length, item) in enumerate(zip(*self.kit.kv_infos)):
            if b % count in picked:
                view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(ptr))  # [length]
                picked[b % count].append(view.reshape(-1, item // self.spec.page_size)[slots])  # [tokens, row bytes]
        return {position: np.concatenate(rows, axis=1) for position, rows in picked.items()}

    def verify(self, request_id: str):
        receiver = self.handles.pop(request_id)
        tokens, prefix = self.requests.pop(request_id)
        bad = self.kit.mismatches(request_id, self.slots[request_id], tokens, prefix,
                                  self.state_slot.get(request_id, 0))
        token = receiver.first_token()[0]
        receiver.close()
        self.give_back(request_id)
        return bad, token

    def close(self):
        self.manager.close()
        for transport in self.transports:
            transport.close()


def rank_main(conn, spec: RankSpec) -> None:
    rank = None
    try:
        if spec.netns is not None:
            from kvtransfer.netns import enter

            enter(spec.netns)
        if not spec.names_process:  # its hellos then carry no process: peers cannot read its death in /proc
            from kvtransfer.control.liveness import ProcessId

            ProcessId.mine = classmethod(lambda cls: None)
        rank = _Rank(spec)
        conn.send(Reply(True, rank.layout.to_msgpack()))
        while True:
            cmd = conn.recv()
            if isinstance(cmd, Quit):
                break
            try:
                conn.send(Reply(True, rank.run(cmd)))
            except Exception as exc:
                conn.send(Reply(False, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    except Exception as exc:
        conn.send(Reply(False, None, f"{spec.role} rank {spec.tp_rank}: {exc!r}\n{traceback.format_exc()}"))
    finally:
        if rank is not None:
            rank.close()
        conn.close()


class RankProcess:
    """A rank in its own process; ``call`` sends a command and returns its reply's value."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.name = f"{spec.role} rank {spec.tp_rank}"
        self.child = Child.spawn(rank_main, (spec,), name=self.name)
        self.layout = None

    def started(self):
        self.layout = self._reply("start-up")
        return self

    def _reply(self, what: str):
        reply = self.child.recv(Reply, f"its answer to {what}", REPLY_TIMEOUT_S)
        if not reply.ok:
            raise RuntimeError(f"{self.name}: {what} failed: {reply.error}")
        return reply.value

    def call(self, cmd):
        self.child.send(cmd)
        return self._reply(type(cmd).__name__)

    def kill(self) -> None:
        self.child.proc.kill()
        self.child.proc.join(10)

    def close(self) -> None:
        self.child.stop(Quit(), timeout=10)


def until_state(rank, rid, state, timeout_s=20.0):
    """Poll a request until it reaches ``state`` (a name), or fail naming where it stands."""
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = rank.call(Wait(rid, timeout_s=0.05))[0]
        if got == state:
            return
    raise AssertionError(f"{rank.name}: request {rid} is {got}, not {state}, after {timeout_s} s")


def wait_forgotten(rank, timeout_s: float = 10.0) -> None:
    """Assert that ``rank``'s manager holds no request within ``timeout_s``. A manager forgets
    an ended request on its loop thread, in the turn that ended it, which may come just after a
    caller saw the final state: under load that turn can lag by milliseconds."""
    deadline = time.monotonic() + timeout_s
    while (held := rank.call(Stats())["requests"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held == 0, f"{rank.name} still holds {held} request(s) {timeout_s} s after they ended"
