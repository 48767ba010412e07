"""Prefill and decode ranks as processes on the two "hosts" of :mod:`kvtransfer.netns`.

Each rank (``multiprocessing`` "spawn", then :func:`kvtransfer.netns.enter` its namespace) owns an MHA
pool on the CPU and a NIXL transport over its veth; the test relays the handshake as
``kvtransfer transfer-demo`` does and drives each rank with one frozen dataclass per command. A prefill
rank stores a request's KV (its head shard of the demo's seeded reference) at random pages and
writes it with the real planner (``plan_kv_transfer`` + ``write_plan``); the decode rank polls
notifications all the time (as a serving loop does) and checks every landed row against the
same reference on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from kvtransfer._procs import report_failure
from kvtransfer.transfer_demo import DemoConfig, local_heads, reference_kv
from kvtransfer.netns import Host, enter

SHAPE = DemoConfig(prefill_tp=2, decode_tp=1, layers=4, tokens=256, prefill_page_size=16, decode_page_size=64)
REQUESTS = 6  # pool room, in requests
PEER_LOSS_S = 2.0  # NixlConfig.peer_loss_timeout_s of every rank
SLOT_BYTES = 256 << 10  # staging slots: a request of 2 MiB per sender is 9 chunks


# -- commands (parent -> rank) and replies ------------------------------------------------------


@dataclass(frozen=True)
class Reserve:  # decode
    request: int


@dataclass(frozen=True)
class Reserved:
    layout: bytes
    export: bytes
    regions: dict
    slots: np.ndarray


@dataclass(frozen=True)
class Await:  # decode: the notifications of ``request`` from ``senders``
    request: int
    senders: tuple
    timeout_s: float


@dataclass(frozen=True)
class Awaited:
    senders: tuple  # the senders whose notification arrived


@dataclass(frozen=True)
class Check:  # decode: rows of ``done`` requests against the reference, nothing outside reserved slots
    done: tuple


@dataclass(frozen=True)
class Checked:
    bad_rows: int  # token rows of ``done`` requests that differ from the reference
    stray_bytes: int  # non-zero bytes in slots no request reserved


@dataclass(frozen=True)
class Store:  # prefill: "run the prompt" of ``request``
    request: int


@dataclass(frozen=True)
class Stored:
    layout: bytes


@dataclass(frozen=True)
class Connect:  # prefill: (again) to the decode rank's export, once NIXL drained a lost one
    export: bytes


@dataclass(frozen=True)
class Connected:
    pass


@dataclass(frozen=True)
class Write:  # prefill: plan and write ``request``; ``wait``: reply when it ended, else once posted
    request: int
    layout: bytes
    regions: dict
    slots: np.ndarray
    wait: bool = True


@dataclass(frozen=True)
class Wait:  # prefill: wait for the write of ``request``
    request: int


@dataclass(frozen=True)
class Written:
    status: str  # TransferStatus name
    error: Optional[str]
    staged: bool
    seconds: float  # spent in wait()
    deadline_s: float  # the transfer's peer-loss deadline


@dataclass(frozen=True)
class Quit:
    pass


def payload(request: int, tp_rank: int) -> bytes:
    return f"{request}:{tp_rank}".encode()


# -- the ranks ------------------------------------------------------------------------------------


class _Rank:
    def __init__(self, role: str, tp_rank: int):
        from kvtransfer.batches import BufferRegions
        from kvtransfer.transfer_demo import _torch_dtype
        from kvtransfer.layout import RankLayout
        from pools.mha import MHATokenToKVPool
        from transport.nixl import NixlConfig, NixlTransport
        from transport.nixl.staged import StagedNixlConfig

        self.tp_size = SHAPE.prefill_tp if role == "prefill" else SHAPE.decode_tp
        self.page = SHAPE.prefill_page_size if role == "prefill" else SHAPE.decode_page_size
        self.heads = local_heads(SHAPE.total_heads, tp_rank, self.tp_size)
        self.num_pages = REQUESTS * -(-SHAPE.tokens // self.page)
        self.pool = MHATokenToKVPool(size=self.num_pages * self.page, page_size=self.page,
                                     dtype=_torch_dtype(SHAPE.dtype), head_num=self.heads.stop - self.heads.start,
                                     head_dim=SHAPE.head_dim, layer_num=SHAPE.layers, device="cpu")
        self.layout = RankLayout.from_pools(self.pool, tp_rank=tp_rank, tp_size=self.tp_size,
                                            total_kv_heads=SHAPE.total_heads)
        self.transport = NixlTransport(NixlConfig(peer_loss_timeout_s=PEER_LOSS_S,
                                                  staged=StagedNixlConfig(slot_bytes=SLOT_BYTES)))
        self.regions = BufferRegions.register(self.transport, self.pool.get_contiguous_buf_infos())
        self._free = list(np.random.default_rng(17 + tp_rank).permutation(np.arange(1, self.num_pages + 1)))
        self.slots: dict[int, np.ndarray] = {}

    def take(self, request: int) -> np.ndarray:
        """Random free pages for ``request``: its token slots ``[tokens]``."""
        need = -(-SHAPE.tokens // self.page)
        pages = np.asarray([self._free.pop() for _ in range(need)], dtype=np.int64)
        slots = (pages[:, None] * self.page + np.arange(self.page)[None, :]).ravel()[: SHAPE.tokens]
        self.slots[request] = slots
        return slots


def _reference(request: int, layer: int, which: int):
    return reference_kv(replace(SHAPE, seed=1000 + request), layer, which)  # [tokens, H, D]


def _prefill(conn, tp_rank: int) -> None:
    import torch

    from kvtransfer.batches import BufferRegions, write_plan
    from kvtransfer.layout import RankLayout
    from kvtransfer.plan import plan_kv_transfer
    from tests.transport._support import connect_once_drained
    from transport.nixl.staged.sender import StagedTransfer, StridedStagedTransfer

    rank = _Rank("prefill", tp_rank)
    peer, transfers = None, {}
    with rank.transport:
        conn.send(Stored(rank.layout.to_msgpack()))
        while True:
            cmd = conn.recv()
            if isinstance(cmd, Quit):
                break
            if isinstance(cmd, Store):
                slots = torch.from_numpy(rank.take(cmd.request))
                for layer in range(SHAPE.layers):
                    rank.pool.set_kv_buffer(layer, slots, _reference(cmd.request, layer, 0)[:, rank.heads],
                                            _reference(cmd.request, layer, 1)[:, rank.heads])
                conn.send(Stored(rank.layout.to_msgpack()))
            elif isinstance(cmd, Connect):
                peer = connect_once_drained(rank.transport, cmd.export, timeout=60.0)
                conn.send(Connected())
            elif isinstance(cmd, (Write, Wait)):
                if isinstance(cmd, Write):
                    plan = plan_kv_transfer(rank.layout, RankLayout.from_msgpack(cmd.layout),
                                            rank.slots[cmd.request], cmd.slots)
                    transfers[cmd.request] = write_plan(peer, plan, rank.regions, BufferRegions.from_wire(cmd.regions),
                                                        notify=payload(cmd.request, tp_rank))
                tr = transfers[cmd.request]
                start = time.monotonic()
                if isinstance(cmd, Wait) or cmd.wait:
                    try:
                        tr.wait(120)
                    except Exception:  # reported through the status
                        pass
                conn.send(Written(tr.status().name, tr.error, isinstance(tr, (StagedTransfer, StridedStagedTransfer)),
                                  time.monotonic() - start, getattr(tr, "_deadline_s", 0.0)))
            else:
                raise TypeError(f"prefill rank: unknown command {type(cmd).__name__}")


def _decode(conn, tp_rank: int) -> None:
    import torch

    rank = _Rank("decode", tp_rank)
    got: set = set()
    with rank.transport:
        conn.send(Stored(rank.layout.to_msgpack()))
        while True:
            got.update(n.payload for n in rank.transport.poll_notifications())
            if not conn.poll(1e-3):
                continue
            cmd = conn.recv()
            if isinstance(cmd, Quit):
                break
            if isinstance(cmd, Reserve):
                slots = rank.take(cmd.request)
                conn.send(Reserved(rank.layout.to_msgpack(), rank.transport.export(), rank.regions.to_wire(), slots))
            elif isinstance(cmd, Await):
                want = {payload(cmd.request, s) for s in cmd.senders}
                deadline = time.monotonic() + cmd.timeout_s
                while not want <= got and time.monotonic() < deadline:
                    got.update(n.payload for n in rank.transport.poll_notifications())
                    time.sleep(1e-3)
                conn.send(Awaited(tuple(s for s in cmd.senders if payload(cmd.request, s) in got)))
            elif isinstance(cmd, Check):
                bad = 0
                for request in cmd.done:
                    slots = torch.from_numpy(rank.slots[request])
                    for layer in range(SHAPE.layers):
                        for which, buf in enumerate(rank.pool.get_kv_buffer(layer)):
                            want = _reference(request, layer, which)[:, rank.heads]  # [tokens, local heads, D]
                            bad += int((buf[slots] != want).any(dim=-1).any(dim=-1).sum())
                untouched = torch.ones(rank.pool.size + rank.pool.page_size, dtype=torch.bool)
                for slots in rank.slots.values():
                    untouched[torch.from_numpy(slots)] = False
                stray = 0
                for layer in range(SHAPE.layers):
                    for buf in rank.pool.get_kv_buffer(layer):
                        stray += int((buf[untouched].view(torch.uint8) != 0).sum())
                conn.send(Checked(bad, stray))
            else:
                raise TypeError(f"decode rank: unknown command {type(cmd).__name__}")


def rank_main(conn, role: str, host: Host, tp_rank: int) -> None:
    """A rank's process: join ``host``, then serve the test's commands."""
    try:
        enter(host)
        (_prefill if role == "prefill" else _decode)(conn, tp_rank)
    except BaseException as exc:  # the parent names it instead of waiting on a dead pipe
        report_failure(conn, exc)
        raise SystemExit(1) from None
