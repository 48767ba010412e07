"""Prefill and decode ranks as real processes for the control-plane tests.

Each rank (``multiprocessing`` "spawn") owns an MHA pool on the CPU, a NIXL transport over
loopback and its KV manager; the test drives it with typed commands over a pipe and gets a
:class:`Reply` for each. The KV a prefill rank "computes" for a request is a seeded reference
(:func:`reference_kv`), so a decode rank can check every landed row on its own.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Optional

REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankSpec:
    role: str  # "prefill" | "decode"
    tp_rank: int
    tp_size: int
    page_size: int
    bootstrap: str
    total_heads: int = 4
    head_dim: int = 16
    layers: int = 2
    pages: int = 64
    seed: int = 0
    config: dict = field(default_factory=dict)  # ControlConfig fields
    instance: Optional[str] = None


# -- commands ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefill:
    """Prefill: take slots for ``tokens``, store the reference KV, send it in ``chunks``."""

    request_id: str
    tokens: int
    chunks: tuple  # token counts per chunk, summing to ``tokens``
    first_token: int = 0
    hold_last: bool = False  # send every chunk but the last (the test sends it later)


@dataclass(frozen=True)
class SendLast:
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
class Stats:
    """Reply ``{"free_pages", "requests", "threads"}``."""


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class Reply:
    ok: bool
    value: object = None
    error: str = ""


def reference_kv(request_id: str, layer: int, which: int, tokens: int, heads: int, head_dim: int):
    """The 'model' K (which=0) or V (which=1) of one layer of a request: [tokens, heads, head_dim]."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(request_id.encode()) * 7 + layer * 2 + which)
    return torch.randn(tokens, heads, head_dim, generator=g)


class _Rank:
    def __init__(self, spec: RankSpec):
        import numpy as np

        from kvtransfer.control.common import ControlConfig
        from kvtransfer.layout import RankLayout, shard_units
        from pools.mha import MHATokenToKVPool
        from transport.nixl import NixlTransport

        import torch

        self.spec = spec
        shard = shard_units(spec.total_heads, spec.tp_rank, spec.tp_size)
        self.heads = slice(shard.first, shard.first + shard.count)
        count = shard.count
        size = spec.pages * spec.page_size
        self.pool = MHATokenToKVPool(size=size, page_size=spec.page_size, dtype=torch.float32, head_num=count,
                                     head_dim=spec.head_dim, layer_num=spec.layers, device="cpu")
        self.layout = RankLayout.from_pools(self.pool, tp_rank=spec.tp_rank, tp_size=spec.tp_size,
                                            total_kv_heads=spec.total_heads)
        rng = np.random.default_rng(spec.seed * 1000 + spec.tp_rank * 10 + (spec.role == "decode"))
        self.free_pages = [int(p) for p in rng.permutation(np.arange(1, spec.pages + 1))]
        self.slots: dict = {}  # request id -> [tokens] slots
        self.transport = NixlTransport()
        config = ControlConfig(**spec.config)
        infos = self.pool.get_contiguous_buf_infos()
        if spec.role == "prefill":
            from kvtransfer.control.prefill import PrefillKVManager

            self.manager = PrefillKVManager(self.layout, self.transport, infos, bootstrap=spec.bootstrap, config=config)
        else:
            from kvtransfer.control.decode import DecodeKVManager

            self.manager = DecodeKVManager(self.layout, self.transport, infos, bootstrap=spec.bootstrap,
                                           instance=spec.instance, config=config)
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
        return slots

    def give_back(self, request_id: str) -> None:
        slots = self.slots.pop(request_id)
        ps = self.spec.page_size
        self.free_pages += sorted({int(s) // ps for s in slots})

    def run(self, cmd):
        from kvtransfer.control.common import pack_first_token
        from kvtransfer.control.state import KVPoll

        if isinstance(cmd, Prefill):
            import torch

            slots = self.take(cmd.request_id, cmd.tokens)
            idx = torch.from_numpy(slots)
            for layer in range(self.spec.layers):
                k, v = (reference_kv(cmd.request_id, layer, w, cmd.tokens, self.spec.total_heads, self.spec.head_dim)
                        [:, self.heads] for w in (0, 1))
                self.pool.set_kv_buffer(layer, idx, k, v)
            sender = self.handles[cmd.request_id] = self.manager.sender(cmd.request_id)
            start = 0
            for i, n in enumerate(cmd.chunks):
                last = i == len(cmd.chunks) - 1
                if last and cmd.hold_last:
                    self.held = (sender, slots[start:start + n], pack_first_token(cmd.first_token, -0.5))
                    break
                sender.send(slots[start:start + n], last=last,
                            aux=pack_first_token(cmd.first_token, -0.5) if last else None)
                start += n
            return None
        if isinstance(cmd, SendLast):
            sender, slots, aux = self.held
            sender.send(slots, last=True, aux=aux)
            return None
        if isinstance(cmd, Receive):
            self.requests[cmd.request_id] = (cmd.tokens, cmd.prefix)
            slots = self.take(cmd.request_id, cmd.tokens - cmd.prefix)
            receiver = self.handles[cmd.request_id] = self.manager.receiver(cmd.request_id)
            receiver.init(slots, prefix_tokens=cmd.prefix)
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
        if isinstance(cmd, Stats):
            import threading

            stats = {"free_pages": len(self.free_pages), "requests": self.manager.num_requests,
                     "threads": threading.active_count()}
            if self.spec.role == "decode":
                stats["ready_senders"] = self.manager.ready_senders()
            return stats
        raise TypeError(f"unknown command {type(cmd).__name__}")

    def verify(self, request_id: str):
        import torch

        receiver = self.handles.pop(request_id)
        slots = torch.from_numpy(self.slots[request_id])
        tokens, prefix = self.requests.pop(request_id)
        bad = 0
        for layer in range(self.spec.layers):
            k, v = self.pool.get_kv_buffer(layer)
            for which, buf in ((0, k), (1, v)):
                full = reference_kv(request_id, layer, which, tokens, self.spec.total_heads, self.spec.head_dim)
                want = full[prefix:, self.heads]  # [tokens - prefix, local heads, head_dim]
                bad += int((buf[slots] != want).flatten(1).any(dim=1).sum())
        token = receiver.first_token()[0]
        receiver.close()
        self.give_back(request_id)
        return bad, token

    def close(self):
        self.manager.close()
        self.transport.close()


def rank_main(spec: RankSpec, conn) -> None:
    rank = None
    try:
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
        conn.send(Reply(True, "closed"))
        conn.close()


class RankProcess:
    """A rank in its own process; ``call`` sends a command and returns its reply's value."""

    def __init__(self, spec: RankSpec):
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.name = f"{spec.role} rank {spec.tp_rank}"
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(spec, child), name=self.name, daemon=True)
        self.proc.start()
        child.close()
        self.layout = None

    def started(self):
        self.layout = self._reply("start-up")
        return self

    def _reply(self, what: str):
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"{self.name}: no reply to {what} within {REPLY_TIMEOUT_S:.0f} s "
                               f"(exit code {self.proc.exitcode})")
        try:
            reply = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.name} died (exit code {self.proc.exitcode}) before answering {what}") from None
        if not reply.ok:
            raise RuntimeError(f"{self.name}: {what} failed: {reply.error}")
        return reply.value

    def call(self, cmd):
        self.conn.send(cmd)
        return self._reply(type(cmd).__name__)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(Quit())
                self._reply("quit")
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
        self.conn.close()
