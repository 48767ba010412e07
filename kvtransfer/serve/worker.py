"""One TP rank of a node: its model shard, engine, pools, transports and KV manager.

Every rank runs the same loop; rank 0 also talks to the node's HTTP process over its pipe::

    commands  = rank 0 drains its pipe, every rank gets the batch (a broadcast)
    apply them (new requests, aborts) in order
    transfers = each rank polls its senders / receivers; the ranks agree (one all-reduce) on
                which ended, and how, and act on them together
    rank 0 sends the node what they ended (failures, received KV and first tokens), as one message
    one engine step (prefill or decode), when there is work
    rank 0 sends the step's new tokens and its load, as one message

With no step to run, rank 0 waits for a command or for one of its own transfers to change state
(its KV managers' ``on_change`` writes to a pipe), whichever comes first, so a reservation or a
request's last landed write is acted on as it happens, not at the next poll.

The ranks' schedules must stay equal (they run one model over torch.distributed), so anything
that changes the pools happens on every rank in the same iteration: that is why transfer
outcomes are agreed before they are acted on, and why decode reservations are retried in
command order. Control collectives use a gloo group of their own, beside the model's group.

Roles: **colocated** generates whole requests. **prefill** waits until the decode node has
reserved the request's pages and sent where the KV goes (its sender leaves ``Bootstrapping``),
then adds the request with ``hold=True``, sends its prompt KV (and Mamba state, and the first
token as the aux record) through its :class:`~kvtransfer.control.prefill.PrefillKVManager` once
sampled, and frees the pages when the transfer ended. **decode** reserves the prompt's pages,
asks the prefill node through a :class:`~kvtransfer.control.decode.DecodeKVManager` (one per
prefill node, made on first use, each with transports of its own), and starts decoding from the
first token once every rank has its bytes. A failed transfer frees decode pages only once no
write of it can land (``receiver.released``).

Admission, and why it cannot deadlock. Decode reserves first: prefill does not compute a
request before decode holds room for all of its KV. So every wait is on something that ends by
itself, for any pool sizes on either side:

- a decode request waits (first come, first served) for pages that its *running* requests hold;
  each of those decodes to its end without waiting for anything, then frees them;
- a *reserved* decode request waits for its KV; prefill computes it (below) and writes it into
  pages that already wait for it;
- a prefill request waits first for decode's destination (the point above), then in the
  engine's queue (first come, first served) for pages that prefill's *running* and *held*
  requests hold: a running one finishes its prompt by itself, and a held one only waits for its
  writes, whose destination is already reserved -- never for room on decode.

No chain of waits comes back to where it started, so a request that fits each node's empty
pools alone (checked when it arrives: 400 otherwise) always completes; the engine waits rather
than fails when its oldest request does not fit beside the others. What waits for pages is
bounded: a new request is refused with ``RequestFailed(busy=True)`` (HTTP 503 with
``Retry-After``) while ``spec.max_queue`` requests already wait on this node -- on decode those
without a reservation, on prefill and colocated nodes the engine's queue (a prefill request
that waits for decode's destination counts on the decode node). The check is made as each
command is applied, on every rank alike, so the ranks refuse the same requests.

A rank that fails reports the exception on its pipe and exits; a rank whose parent dies is
killed with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Dict, List, Optional

import torch

from kvtransfer._procs import report_failure
from kvtransfer.control.event_loop import WakePipe
from kvtransfer.serve import messages as m
from kvtransfer.serve.rank_managers import RankManagers

log = logging.getLogger("kvtransfer.serve.worker")

IDLE_WAIT_S = 0.2  # rank 0 waits this long for a command when nothing is in flight
BUSY_WAIT_S = 0.001  # ... and at most this long while transfers are pending but no step can run
# transfer outcomes, agreed by MAX over the ranks
OK, PENDING, FAILED = 1, 2, 3


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class _Sending:
    """Prefill: a request whose KV is being sent."""

    req: object
    sender: object
    verify: bool
    arrived: float
    layerwise: bool  # its KV leaves layer group by layer group as the forward computes it
    sent_at: float = 0.0  # its first token was sampled and the last send went


@dataclass
class _Bootstrapping:
    """Prefill: a request whose decode node has not yet sent where its KV goes (the engine has
    not taken it)."""

    cmd: m.Prefill
    sender: object
    arrived: float


@dataclass
class _Receiving:
    """Decode: a request whose KV is on its way (or failed and draining)."""

    cmd: m.Decode
    arrived: float
    req: object = None
    receiver: object = None
    manager: object = None
    asked_at: float = 0.0
    failed: bool = False


@dataclass
class _Group:
    """The control collectives of the TP group (gloo, whatever the model's backend)."""

    size: int
    group: object = None

    def broadcast(self, obj):
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, codes: List[int]) -> List[int]:
        if self.size == 1 or not codes:
            return codes
        t = torch.tensor(codes, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def gather(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out


def _ended(handle) -> float:
    """When a sender / receiver reached its final state (its manager's thread saw it; this
    loop may notice later, after an engine step)."""
    from kvtransfer.control.state import KVPoll

    return handle.status.times.get(KVPoll.Success, time.monotonic())


class RankWorker:
    """The rank's state and loop (module docstring)."""

    def __init__(self, spec: m.NodeSpec, rank: int, conn):
        from kvtransfer.models import registry
        from kvtransfer.models.config import DType, EngineConfig
        from kvtransfer.models.engine import Engine
        from kvtransfer.models.parallel import init_tp, rank_device

        self.spec, self.rank, self.conn = spec, rank, conn
        cuda = spec.device == "cuda"
        self.gpu = (spec.first_gpu + rank) % torch.cuda.device_count() if cuda else None
        tp = init_tp(rank, spec.tp_size, spec.dist_port, spec.device, self.gpu)
        self.ctl = _Group(spec.tp_size, torch.distributed.new_group(backend="gloo") if spec.tp_size > 1 else None)
        model_spec, _ = registry.load(registry.parse_name(spec.model))
        model = model_spec.build(tp, DType.parse(spec.dtype).torch, rank_device(spec.device, tp, self.gpu))
        ec = EngineConfig(max_tokens=spec.max_tokens, page_size=spec.page_size, max_requests=spec.max_requests,
                          chunk_size=spec.chunk_size, dtype=DType.parse(spec.dtype).torch, device=spec.device,
                          layer_group=spec.layerwise if spec.role == "prefill" else 0)
        self.engine = Engine(model, ec)
        pools = self.engine.pools
        self.layout = model.rank_layout(pools)
        self.kv_infos = pools.kv.get_contiguous_buf_infos()
        self.state_infos = pools.kv.get_state_buf_infos() if self.layout.is_hybrid else None
        lay = self.layout  # bytes this rank receives per token, and per request of state
        self.token_bytes = sum(t.row_bytes for t in lay.kv_tensors) * len(lay.layer_ids)
        self.state_bytes = sum(t.row_bytes for t in lay.state_tensors) * len(lay.state_layer_ids)
        self.requests: Dict[str, object] = {}  # rid -> engine Request (generating here)
        self.rids: Dict[int, str] = {}  # engine request id -> rid
        self.reported: Dict[str, int] = {}  # rid -> tokens reported
        self.arrived: Dict[str, float] = {}  # colocated: rid -> when its command was applied
        self.bootstrapping: Dict[str, _Bootstrapping] = {}  # prefill: waiting for decode's destination
        self.sending: Dict[str, _Sending] = {}
        self.receiving: Dict[str, _Receiving] = {}  # in command order: reservations go first come first served
        # rank 0 (which alone waits for commands) wakes when one of its transfers changes state
        self.wakeup = WakePipe() if rank == 0 else None
        self.managers = RankManagers(spec, self.layout, self.kv_infos, self.state_infos, self.gpu,
                                     all_up=lambda ok: self.ctl.agree([OK if ok else FAILED])[0] == OK,
                                     on_change=self.wakeup.set if self.wakeup is not None else None)
        self.stopping = False
        self._load = None
        self._outbox: list = []  # events for the node, sent together once per loop half (_flush)
        self._commands_by_type = {m.Shutdown: self._stop, m.Generate: self._generate, m.Prefill: self._prefill,
                                  m.Decode: self._decode, m.Abort: lambda cmd: self._abort(cmd.rid, cmd.reason),
                                  m.Connect: self._connect}
        if spec.role == "prefill":
            self.managers.start_prefill()
            if spec.layerwise:
                self.engine.on_layers = self._layers_computed

    # -- set-up -----------------------------------------------------------------------
    def describe(self) -> str:
        lay = self.layout
        state = f", state {lay.state_kind.value} x {len(lay.state_layer_ids)} layers" if lay.is_hybrid else ""
        where = f"cuda:{self.gpu}" if self.gpu is not None else "cpu"
        graphs = f", {self.engine.graphs.describe()}" if self.engine.graphs is not None else ""
        return (f"{lay.kind.value} {len(lay.layer_ids)} layers, {lay.num_slots} slots, page {lay.page_size}, "
                f"{lay.dtype}{state}, on {where}{graphs}")

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            for cmd in self.ctl.broadcast(self._commands() if self.rank == 0 else None):
                self._apply(cmd)
            if self.stopping:
                break
            self._reserve()
            self._progress()
            self._flush()  # what the commands and transfers ended (first tokens too) before the step
            if self.engine.has_work():
                for req in self.engine.step():
                    self._finished(req)
                self._report_tokens()
            self._report_load()
            self._flush()
        self._flush()

    def _busy(self) -> bool:
        return bool(self.engine.has_work() or self.bootstrapping or self.sending or self.receiving)

    def _commands(self) -> list:
        """Rank 0: every command waiting on the pipe. With no step to run it first waits for a
        command or a transfer of its own that changes state, at most a little: the other ranks'
        transfers do not wake it."""
        wait = 0.0 if self.engine.has_work() else (BUSY_WAIT_S if self._busy() else IDLE_WAIT_S)
        cmds = []
        try:
            if wait:
                mp_connection.wait([self.conn, self.wakeup.fd], wait)
                self.wakeup.clear()
            while self.conn.poll(0):
                cmds.append(self.conn.recv())
        except (EOFError, OSError):
            cmds.append(m.Shutdown())  # the node is gone
        return cmds

    def _emit(self, event) -> None:
        """Queue an event for the node (rank 0); :meth:`_flush` sends what is queued as one message."""
        if self.rank == 0:
            self._outbox.append(event)

    def _flush(self) -> None:
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.conn.send(events)

    # -- commands ---------------------------------------------------------------------
    def _apply(self, cmd) -> None:
        handler = self._commands_by_type.get(type(cmd))
        if handler is None:
            raise TypeError(f"unknown command {type(cmd).__name__}")
        handler(cmd)

    def _stop(self, cmd: m.Shutdown) -> None:
        self.stopping = True

    def _connect(self, cmd: m.Connect) -> None:
        _, error = self.managers.decode_for(cmd.bootstrap)
        self._emit(m.Connected(cmd.rid, error or ""))

    def _generate(self, cmd: m.Generate) -> None:
        """Colocated: a new request into the engine's queue."""
        if not self._full(cmd.rid) and self._add(cmd.rid, cmd.prompt_ids, cmd.max_new_tokens, cmd.stop_ids,
                                                 cmd.sampling, hold=False) is not None:
            self.arrived[cmd.rid] = time.monotonic()

    def _prefill(self, cmd: m.Prefill) -> None:
        """Prefill: a new request waits for decode's destination."""
        if not self._full(cmd.rid):
            self.bootstrapping[cmd.rid] = _Bootstrapping(cmd, self.managers.prefill.sender(cmd.rid),
                                                         time.monotonic())

    def _decode(self, cmd: m.Decode) -> None:
        """Decode: a new request waits for its reservation."""
        if not self._full(cmd.rid):
            self.receiving[cmd.rid] = _Receiving(cmd, time.monotonic())

    def _queued(self) -> int:
        """Requests waiting for this node's pages (module docstring: what counts where)."""
        if self.spec.role == "decode":
            return sum(1 for r in self.receiving.values() if r.req is None)
        return len(self.engine.waiting)

    def _full(self, rid: str) -> bool:
        """Refuse ``rid`` (busy) when the queue is at its bound; True if it was refused."""
        queued = self._queued()
        if queued < self.spec.max_queue:
            return False
        self._emit(m.RequestFailed(rid, f"the {self.spec.role} node is full: {queued} requests wait for KV pages "
                                        f"(--max-queue {self.spec.max_queue}); try again later", busy=True))
        return True

    def _add(self, rid, prompt, max_new, stop_ids, sampling, hold: bool, layers_out: bool = False):
        try:
            req = self.engine.add(prompt, max_new, stop_ids, sampling=sampling, hold=hold, layers_out=layers_out)
        except ValueError as exc:
            self._emit(m.RequestFailed(rid, str(exc), client_error=True))
            return None
        self._track(rid, req)
        return req

    def _abort(self, rid: str, reason: str) -> None:
        b = self.bootstrapping.pop(rid, None)
        if b is not None:  # the engine never had it; decode's pages are released once prefill says Quiesced
            b.sender.abort(reason)
            return
        s = self.sending.get(rid)
        if s is not None:
            s.sender.abort(reason)
            if not s.sent_at:  # still computing: nothing was written
                del self.sending[rid]
                self._forget(rid)
                self.engine.abort(s.req)
            return  # else it ends in _progress, on every rank alike
        rec = self.receiving.get(rid)
        if rec is not None:
            if rec.receiver is None:  # not reserved yet
                del self.receiving[rid]
            elif not rec.failed:
                rec.receiver.abort(reason)
            return
        req = self._forget(rid)
        if req is not None:
            self.engine.abort(req)

    def _track(self, rid: str, req) -> None:
        self.requests[rid] = req
        self.rids[req.rid] = rid
        self.reported[rid] = 0

    def _forget(self, rid: str):
        req = self.requests.pop(rid, None)
        if req is not None:
            self.rids.pop(req.rid, None)
            self.reported.pop(rid, None)
            self.arrived.pop(rid, None)
        return req

    # -- decode: reservations ---------------------------------------------------------
    def _reserve(self) -> None:
        for rid, rec in list(self.receiving.items()):
            if rec.req is not None:
                continue
            mgr, error = self.managers.decode_for(rec.cmd.bootstrap)
            if error:
                del self.receiving[rid]
                self._emit(m.RequestFailed(rid, error))
                continue
            cmd = rec.cmd
            try:
                req = self.engine.reserve(cmd.prompt_ids, cmd.max_new_tokens, cmd.stop_ids, sampling=cmd.sampling)
            except ValueError as exc:
                del self.receiving[rid]
                self._emit(m.RequestFailed(rid, str(exc), client_error=True))
                continue
            if req is None:
                break  # first come, first served: later requests wait too
            rec.req, rec.manager, rec.asked_at = req, mgr, time.monotonic()
            rec.receiver = mgr.receiver(rid)
            state_slot = int(req.mamba_pool_idx) if self.layout.is_hybrid else None
            rec.receiver.init(req.slots[:len(req.prompt_ids)].numpy(), state_slot=state_slot)

    # -- transfers --------------------------------------------------------------------
    @staticmethod
    def _code(poll) -> int:
        from kvtransfer.control.state import KVPoll

        return OK if poll is KVPoll.Success else FAILED if poll is KVPoll.Failed else PENDING

    @staticmethod
    def _destination(poll) -> int:
        """A bootstrapping sender's code: OK once every decode rank said where to write."""
        from kvtransfer.control.state import KVPoll

        return FAILED if poll is KVPoll.Failed else OK if poll >= KVPoll.WaitingForInput else PENDING

    def _progress(self) -> None:
        boot = list(self.bootstrapping.items())
        sending = [(rid, s) for rid, s in self.sending.items() if s.sent_at]
        receiving = [(rid, r) for rid, r in self.receiving.items() if r.receiver is not None]
        codes = [self._destination(b.sender.poll()) for _, b in boot]
        codes += [self._code(s.sender.poll()) for _, s in sending]
        codes += [(OK if r.receiver.released else PENDING) if r.failed else self._code(r.receiver.poll())
                  for _, r in receiving]
        agreed = self.ctl.agree(codes)
        for (rid, b), code in zip(boot, agreed):
            if code != PENDING:
                self._bootstrapped(rid, b, code == OK)
        agreed = agreed[len(boot):]
        for (rid, s), code in zip(sending, agreed):
            if code != PENDING:
                self._sent(rid, s, code == OK)
        for (rid, r), code in zip(receiving, agreed[len(sending):]):
            if r.failed:
                if code == OK:  # every rank's receiver is released: the pages may be reused
                    del self.receiving[rid]
                    r.receiver.close()
                    self.engine.abort(r.req)
            elif code == OK:
                self._received(rid, r)
            elif code == FAILED:
                reason = r.receiver.failure or "the transfer failed on another rank of this node"
                r.receiver.abort(reason)
                r.failed = True
                self._emit(m.RequestFailed(rid, f"KV transfer failed: {reason}"))

    def _digests(self, slots, state_slot) -> Optional[dict]:
        """Per-layer digests over every rank (rank 0 gets them; the others None)."""
        from kvtransfer.digest import layer_digests, rank_digests

        mine = rank_digests(self.layout, self.kv_infos, self.state_infos, slots, state_slot, self.gpu)
        parts = self.ctl.gather(mine)
        return layer_digests(parts) if self.rank == 0 else None

    def _state_slot(self, req) -> Optional[int]:
        return int(req.mamba_pool_idx) if self.layout.is_hybrid else None

    def _bootstrapped(self, rid: str, b: _Bootstrapping, ok: bool) -> None:
        """Decode has reserved ``rid``'s pages (every rank agreed), or the request failed first."""
        del self.bootstrapping[rid]
        if not ok:
            self._emit(m.RequestFailed(rid, f"KV transfer failed: {b.sender.failure or 'on another rank'}"))
            return
        cmd = b.cmd
        layerwise = bool(self.spec.layerwise) and cmd.layerwise
        req = self._add(rid, cmd.prompt_ids, 1, frozenset(), cmd.sampling, hold=True, layers_out=layerwise)
        if req is None:  # refused (and answered): decode's pages go back once prefill says Quiesced
            b.sender.abort("the prefill node refused the request")
            return
        self.sending[rid] = _Sending(req, b.sender, cmd.verify, b.arrived, layerwise)

    def _sent(self, rid: str, s: _Sending, ok: bool) -> None:
        del self.sending[rid]
        req = self._forget(rid)
        if ok:
            digests = None
            if s.verify:
                digests = self._digests(req.slots[:len(req.prompt_ids)].numpy(), self._state_slot(req))
            from kvtransfer.control.state import KVPoll

            posted = max(s.sent_at, s.sender.status.times.get(KVPoll.Transferring, s.sent_at))
            admitted = req.admitted_at or s.arrived
            self._emit(m.KVSent(rid, req.output_ids[0], len(req.prompt_ids), _ended(s.sender) - posted,
                                posted - s.sent_at, admitted - s.arrived, s.sent_at - admitted, s.sent_at, digests,
                                s.sender.status.last_posted_at))
        else:
            self._emit(m.RequestFailed(rid, f"KV transfer failed: {s.sender.failure or 'on another rank'}"))
        self.engine.release(req)

    def _received(self, rid: str, r: _Receiving) -> None:
        del self.receiving[rid]
        req = r.req
        digests = None
        if r.cmd.verify:
            digests = self._digests(req.slots[:len(req.prompt_ids)].numpy(), self._state_slot(req))
        token, logprob = r.receiver.first_token()
        r.receiver.close()
        kv_bytes = len(req.prompt_ids) * self.token_bytes + self.state_bytes
        landed = _ended(r.receiver)
        self._track(rid, req)
        decoding = time.monotonic()
        self._emit(m.KVReceived(rid, kv_bytes * self.spec.tp_size, landed - r.asked_at, r.asked_at - r.arrived,
                                landed, digests, decoding))
        if self.engine.start_decode(req, token, logprob):
            self._finished(req)
        self._report_tokens()

    # -- engine results ---------------------------------------------------------------
    def _finished(self, req) -> None:
        rid = self.rids.get(req.rid)
        if rid is None:
            return
        s = self.sending.get(rid)
        if s is not None:  # prefill: the first token is sampled; send KV (unless its layers went), state, token
            from kvtransfer.control.aux_records import pack_first_token

            s.sent_at = time.monotonic()
            slots = req.slots[:0 if s.layerwise else len(req.prompt_ids)].numpy()
            s.sender.send(slots, last=True, state_slot=self._state_slot(req),
                          aux=pack_first_token(req.output_ids[0], req.logprobs[0]))
            return
        self._report(rid, req)
        self._forget(rid)

    def _layers_computed(self, chunks, end: int) -> None:
        """Prefill, ``--layerwise``: the K/V of layers before ``end`` of this step's chunks (of
        requests sent layer-wise) are in the pools (on a GPU: queued on the stream, which the
        send's event waits for). Every ``spec.layerwise`` layers, and at the last, each chunk's
        new group of layers leaves."""
        layers, group = len(self.layout.layer_ids), self.spec.layerwise
        if end % group and end != layers:
            return
        first = (end - 1) // group * group
        for req, n in chunks:
            s = self.sending.get(self.rids.get(req.rid, ""))
            if s is not None:
                start = req.kv_committed_len
                s.sender.send(req.slots[start:start + n].numpy(), layers=(first, end))

    def _report(self, rid: str, req) -> None:
        done = self.reported.get(rid, 0)
        new = req.output_ids[done:]
        finish = req.finish.value if req.finish is not None else None
        if new or finish:
            arrived = self.arrived.pop(rid, None)
            queue_s = None if arrived is None else req.admitted_at - arrived
            self._emit(m.Tokens(rid, tuple(new), tuple(req.logprobs[done:]), finish, queue_s))
            self.reported[rid] = len(req.output_ids)

    def _report_tokens(self) -> None:
        for rid, req in self.requests.items():
            if rid not in self.sending and req.finish is None:
                self._report(rid, req)

    def _report_load(self) -> None:
        e = self.engine
        load = m.Load(e.slots_in_use, e.config.max_tokens, len(e.running),
                      len(e.waiting) + len(self.receiving) + len(self.bootstrapping))
        if load != self._load:
            self._load = load
            self._emit(load)

    # -- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        self.managers.close()
        if self.wakeup is not None:
            self.wakeup.close()


def rank_main(conn, spec: m.NodeSpec, rank: int) -> None:
    """A rank process (``kvtransfer._procs.Child.spawn`` target)."""
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the node stops its ranks (Ctrl-C reaches the whole group)
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    logging.basicConfig(level=os.environ.get("KVT_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s {spec.role}[{rank}] %(levelname)s %(name)s: %(message)s")
    worker = None
    try:
        worker = RankWorker(spec, rank, conn)
        conn.send(m.RankReady(rank, worker.describe(), worker.managers.prefill_backends()))
        worker.run()
    except BaseException as exc:  # noqa: BLE001 - reported to the node, which names this rank
        report_failure(conn, exc)
        raise SystemExit(1)
    finally:
        if worker is not None:
            worker.close()
        from kvtransfer.models.parallel import close_tp, TPGroup

        if spec.tp_size > 1:
            close_tp(TPGroup(rank, spec.tp_size))
