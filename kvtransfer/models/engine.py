"""A colocated engine: the pools, a scheduler with chunked prefill and continuous batching,
greedy sampling.

One engine per TP rank; every rank runs the same schedule (decisions depend only on token ids,
and the all-gathered logits are the same on every rank), so no scheduling messages are needed.

Per step the engine runs either a **prefill step** (while any request has prompt tokens
without KV: up to ``chunk_size`` of them, over as many requests as fit, oldest first) or a
**decode step** over every running request. Requests can be added between steps and leave
when they finish (their pages, row and Mamba slot go back to the pools).

Memory: a request's KV lives in whole pages of the token pool, taken as its sequence grows;
``req_to_token[row, p]`` is the slot of its token ``p``. Slot 0 / page 0 is never used. There is
no preemption, so a request is admitted only when the free pages, less those that running
requests may still take, cover its whole budget (prompt + ``max_new_tokens``).

Admission waits, it never fails: :meth:`Engine.add` refuses (ValueError) only a request that
cannot fit the empty pools; one that fits alone but not beside the requests held now waits,
first come first served, and :meth:`Engine.step` runs what can run (or nothing: then
:meth:`Engine.has_work` is False until a request leaves, finishes, or is released).

Disaggregated serving uses three more moves. A prefill node adds requests with ``hold=True``:
once finished they keep their pages (the KV is being sent) until :meth:`Engine.release`. A
decode node :meth:`Engine.reserve` s a request's row, pages and Mamba slot for KV that another
node computes, and :meth:`Engine.start_decode` s it once the KV has landed, from the first
token prefill sampled. :meth:`Engine.abort` ends a request wherever it is.

Sampling: ``temperature`` 0 is greedy; above 0 the token is drawn from ``softmax(logits / T)``
(over the ``top_k`` largest logits only, when ``top_k`` is set) with a generator seeded by
``(seed, position)``, so every TP rank (whose logits are the same)
draws the same token, and a request sampled on one node continues the same way on another.

On CUDA, a prefill step's chunks (several requests', each after its cached prefix) run in one
forward whose attention reads the pool in place (:mod:`kvtransfer.models.extend_attention`).
On one CUDA device (TP 1, a Llama or hybrid model) decode steps (and, for Llama, prefill steps
of up to a chunk's tokens in up to 16 requests) run as CUDA-graph replays
(:mod:`kvtransfer.models.runner`), sampled on the GPU: greedy is the same argmax; a seeded draw
uses the same ``(seed, position)`` key for the GPU sampler's random numbers
(:mod:`kvtransfer.models.sampler`), a different draw than the CPU's, the same on every GPU node.

Decode steps there overlap the host with the GPU: step n+1 is launched, its token ids taken
from step n's samples on the device, before the engine waits for step n's tokens, so the host
work of a step (bookkeeping, the serving loop) runs while the GPU computes the next one. A
request that finishes in step n has one more token computed for it in step n+1; that token is
dropped, and the request's pages go back only once step n+1 has ended (its KV write lands in
them). Whatever changes the set of running requests (an admission, a start, an abort, a
release, an export) first waits for the step in flight and takes its tokens. Requests that
record their logits, and ``EngineConfig.overlap=False``, wait for every step before the next.
"""

from __future__ import annotations

import enum
import functools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Sequence

import numpy as np
import torch

from kvtransfer.models.batch import ForwardBatch
from kvtransfer.models.config import EngineConfig
from kvtransfer.models.runner import Chunk, Launched, StepOutput, build_runner
from kvtransfer.models.sampler import MAX_TOP_K, top_k_thresholds
from kvtransfer.models.sampler import draw as gpu_draw
from pools import HybridReqToTokenPool, PagedTokenToKVPoolAllocator, ReqToTokenPool
from pools.kv_cache import synchronize


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop token was sampled (it is kept in output_ids)


@dataclass(frozen=True)
class Pools:
    """One rank's pools: request rows, token slots, and the KV (and state) pool."""

    req_to_token: ReqToTokenPool  # HybridReqToTokenPool for hybrid models
    allocator: PagedTokenToKVPoolAllocator  # on the host: its slots are written to the (device) table
    kv: Any  # MHATokenToKVPool, MLATokenToKVPool or HybridLinearKVPool

    @property
    def mamba_pool(self):
        return getattr(self.req_to_token, "mamba_pool", None)


@dataclass(eq=False)
class Request:
    """A request as the pools see it (``req_pool_idx``, ``mamba_pool_idx``, ``is_chunked``,
    ``kv_committed_len`` are the attributes the request pools read and set)."""

    rid: int
    prompt_ids: List[int]
    max_new_tokens: int
    stop_ids: frozenset = frozenset()
    record_logits: bool = False
    sampling: "Sampling" = None  # None: greedy
    hold: bool = False  # keep the pages after finishing, until Engine.release
    layers_out: bool = False  # its prefill steps call Engine.on_layers (layer-wise sending)
    output_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)  # of each sampled token
    logits: List[torch.Tensor] = field(default_factory=list)  # [vocab] fp32 per sampled token
    finish: Optional[FinishReason] = None
    req_pool_idx: Optional[int] = None
    mamba_pool_idx: Optional[torch.Tensor] = None
    is_chunked: int = 0
    kv_committed_len: int = 0  # tokens whose KV / state is in the pools
    slots: Optional[torch.Tensor] = None  # [num_pages * page_size] int64 slots held, on the host
    admitted_at: Optional[float] = None  # time.monotonic() when it got its row and pages

    @property
    def all_ids(self) -> List[int]:
        return self.prompt_ids + self.output_ids

    @property
    def in_prefill(self) -> bool:
        return self.kv_committed_len < len(self.prompt_ids)


@dataclass(frozen=True)
class Sampling:
    """How a request's tokens are drawn (module docstring)."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0  # draw among the top_k most likely tokens only; 0: all of them

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {t!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        k = self.top_k
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an int in [0, {MAX_TOP_K}] (0: no limit), got {k!r}")

    def key(self, position: int) -> int:
        """The key the token at ``position`` is drawn with (seeds the generator here; keys the
        GPU sampler's random numbers in :mod:`kvtransfer.models.sampler`)."""
        return (self.seed * 1_000_003 + position) % 2**63

    def draw(self, logits: torch.Tensor, position: int) -> tuple:
        """``(token, logprob)`` from fp32 ``logits [vocab]`` of the token at ``position``."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        if self.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            gen = torch.Generator().manual_seed(self.key(position))
            x = logits.float().cpu()[None]  # [1, vocab]
            kept = x >= top_k_thresholds(x, torch.tensor([self.top_k]))[:, None]  # [1, vocab]
            probs = torch.softmax(x.masked_fill(~kept, float("-inf"))[0] / self.temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        return token, float(logp[token])


GREEDY = Sampling()


@dataclass(frozen=True)
class RequestState:
    """A request's cached state after prefill, on the host: what a prefill node hands a decode
    node. ``kv`` is the KV pool's ``get_cpu_copy`` of the committed tokens' slots (for a hybrid
    pool, its ``(kv, mamba)`` pair)."""

    token_ids: List[int]  # prompt + sampled tokens; the last one has no KV yet
    prompt_len: int
    kv: Any


def token_capacity(ec: EngineConfig, model_config) -> int:
    """The most tokens (prompt + new) one request may hold: the pool's whole pages, at most the
    model's context."""
    return min((ec.max_tokens // ec.page_size) * ec.page_size, model_config.max_context_len)


def check_request(prompt: Sequence[int], max_new_tokens: int, ec: EngineConfig, model_config) -> None:
    """ValueError unless a request of ``prompt`` (a sequence of ints, or a 1-D integer NumPy
    array) + ``max_new_tokens`` fits an empty engine."""
    if len(prompt) == 0:
        raise ValueError("the prompt must hold at least one token, got none")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    vocab = model_config.vocab_size
    lo, hi = _id_range(prompt)
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}), got [{lo}, {hi}]")
    capacity = token_capacity(ec, model_config)
    need = len(prompt) + max_new_tokens
    if need > capacity:
        raise ValueError(
            f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens = {need} does not fit the "
            f"pool of {capacity} token slots (pool size {ec.max_tokens}, context {model_config.max_context_len})"
        )


def _id_range(ids) -> tuple:
    """``(min, max)`` of token ids; an array in one NumPy pass (a long prompt's ids cross from
    the node to its ranks as one)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be a 1-D integer array, got {ids.dtype} of shape {list(ids.shape)}")
        return int(ids.min()), int(ids.max())
    return min(ids), max(ids)


def _id_list(ids) -> List[int]:
    """Token ids as a list of Python ints."""
    return ids.tolist() if isinstance(ids, np.ndarray) else [int(t) for t in ids]


@dataclass
class EngineStats:
    """Tokens and seconds spent in prefill and decode steps."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def rate(self, tokens: int, seconds: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class _Ahead:
    """A decode step launched before the wait for the one before it: for ``reqs``, in order."""

    reqs: List["Request"]
    launched: Launched


class Engine:
    """Colocated prefill + decode over one rank's pools (module docstring)."""

    def __init__(self, model, config: EngineConfig):
        self.model = model
        self.config = config
        self.pools: Pools = model.make_pools(config)
        # The slots written come from this engine's allocator: skip the per-write range check
        # (a device sync per layer on CUDA). Pools without the switch always check.
        kv = getattr(self.pools.kv, "full_kv_pool", self.pools.kv)
        if hasattr(kv, "check_inputs"):
            kv.check_inputs = False
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.reserved: List[Request] = []  # rows and pages taken for KV another node computes
        self.held: List[Request] = []  # finished with hold=True: pages kept until release()
        self._next_rid = 0
        self.stats = EngineStats()
        self.graphs = (build_runner(model, self.pools, config.max_requests, config.chunk_size, config.layer_group)
                       if config.cuda_graphs else None)
        self._ahead: Optional[_Ahead] = None  # a decode step launched ahead (module docstring)
        self._done_early: List[Request] = []  # finished while the step ahead was taken in
        self._finished_tokens = 0  # output tokens of requests no longer running (decode rate)
        # Layer-wise sending: a prefill step of requests added with ``layers_out`` calls
        # ``on_layers(chunks, end)`` once the K/V of its layers before ``end`` are in the pools
        # (``chunks``: [(request, tokens)] of those requests, each from its ``kv_committed_len``).
        # With ``EngineConfig.layer_group`` such a step replays its prefill graph in parts of that
        # many layers and calls back between them; otherwise it runs eagerly, calling back after
        # every layer.
        self.on_layers: Optional[Callable[[list, int], None]] = None

    # -- requests ----------------------------------------------------------------------
    def add(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids=(), record_logits=False,
            sampling: Optional[Sampling] = None, hold: bool = False, layers_out: bool = False) -> Request:
        """Queue a request; ValueError when it cannot fit the pool even alone. ``layers_out``:
        its prefill steps call :attr:`on_layers` layer by layer."""
        req = self._new(prompt_ids, max_new_tokens, stop_ids, record_logits, sampling, hold)
        req.layers_out = layers_out
        self.waiting.append(req)
        return req

    def _new(self, prompt_ids, max_new_tokens, stop_ids, record_logits, sampling, hold) -> Request:
        check_request(prompt_ids, max_new_tokens, self.config, self.model.config)
        prompt = _id_list(prompt_ids)
        req = Request(self._next_rid, prompt, max_new_tokens, frozenset(stop_ids), record_logits,
                      sampling or GREEDY, hold)
        self._next_rid += 1
        return req

    def reserve(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids=(),
                sampling: Optional[Sampling] = None) -> Optional[Request]:
        """Take a row, the prompt's pages (and a Mamba slot) for a request whose prompt KV
        another node computes; None while the pools cannot admit it (try again later).
        ``req.slots[:len(prompt)]`` are where the KV must land, ``req.mamba_pool_idx`` the state.
        A decode step launched ahead runs on meanwhile: it reads none of what this changes."""
        req = self._new(prompt_ids, max_new_tokens, stop_ids, False, sampling, False)
        if not self._admit(req):
            return None
        req.admitted_at = time.monotonic()
        self.reserved.append(req)
        self._grow(req, len(req.prompt_ids))
        return req

    def start_decode(self, req: Request, first_token: int, logprob: float = 0.0) -> bool:
        """A reserved request's prompt KV has landed: continue it from ``first_token`` (the
        token prefill sampled). Returns True when that token already ends it (released then).
        A decode step launched ahead runs on meanwhile; the next step takes its tokens first."""
        if req not in self.reserved:
            raise ValueError(f"request {req.rid} is not reserved here")
        self.reserved.remove(req)
        self.running.append(req)
        req.kv_committed_len = len(req.prompt_ids)
        if self._accept(req, int(first_token), float(logprob)):
            self._release(req)
            return True
        return False

    def release(self, req: Request) -> None:
        """Free a finished held request's pages (its KV has been sent)."""
        self._take_ahead()
        if req not in self.held:
            raise ValueError(f"request {req.rid} is not held here")
        self.held.remove(req)
        self._free(req)

    def abort(self, req: Request) -> None:
        """End ``req`` wherever it is (waiting, running, reserved or held) and free what it holds."""
        self._take_ahead()
        if req in self.waiting:
            self.waiting.remove(req)
            return
        for where in (self.running, self.reserved, self.held):
            if req in where:
                where.remove(req)
                self._free(req)
                return

    @property
    def slots_in_use(self) -> int:
        """Token slots held by requests (whole pages)."""
        return sum(0 if r.slots is None else r.slots.numel() for r in self.running + self.reserved + self.held)

    def has_work(self) -> bool:
        """Whether :meth:`step` has something to do: a request runs, one finished that no step
        has returned yet, or the oldest waiting one can be admitted now."""
        return bool(self.running or self._done_early) or bool(self.waiting and self._fits(self.waiting[0]))

    def run(self) -> None:
        while self.has_work():
            self.step()

    # -- one step ----------------------------------------------------------------------
    def step(self) -> List[Request]:
        """Run one prefill or decode step; returns the requests that finished in it (or, with a
        decode step launched ahead, since the last call)."""
        chunks = self._schedule_prefill()
        prefill = bool(chunks)
        if prefill or (self._ahead is not None and self._ahead.reqs != self.running):
            self._take_ahead()  # the step ahead decoded the same requests: keep its tokens first
        if not chunks:
            chunks = [(r, 1) for r in self.running]
        if not chunks:
            finished, self._done_early = self._done_early, []
            if finished:
                return finished
            if self.waiting and not (self.reserved or self.held):
                # nothing holds a page or a row, yet the oldest request does not fit: add() checked
                # that it fits the empty pools, so this is a bug in the budget, not load
                raise RuntimeError(f"{len(self.waiting)} request(s) wait with every page free, and the "
                                   f"oldest (prompt {len(self.waiting[0].prompt_ids)} + "
                                   f"{self.waiting[0].max_new_tokens} new tokens) is not admitted")
            return []  # the waiting requests wait for held or reserved pages to come back
        start = time.perf_counter()
        tokens_before = self._tokens_out()
        if not prefill and self._overlaps(chunks):
            finished = self._decode_ahead([r for r, _ in chunks])
        else:
            finished = self._forward(chunks)
            synchronize(self.model.device)
        seconds = time.perf_counter() - start
        if prefill:
            self.stats.prefill_tokens += sum(n for _, n in chunks)
            self.stats.prefill_s += seconds
        else:
            self.stats.decode_tokens += self._tokens_out() - tokens_before
            self.stats.decode_s += seconds
        finished, self._done_early = self._done_early + finished, []
        return finished

    def _tokens_out(self) -> int:
        return sum(len(r.output_ids) for r in self.running) + self._finished_tokens

    def _schedule_prefill(self):
        budget = self.config.chunk_size
        chunks = []
        for req in [r for r in self.running if r.in_prefill]:
            if budget == 0:
                break
            n = min(budget, len(req.prompt_ids) - req.kv_committed_len)
            chunks.append((req, n))
            budget -= n
        while budget and self.waiting:
            req = self.waiting[0]
            if not self._admit(req):
                break
            req.admitted_at = time.monotonic()
            self.waiting.popleft()
            self.running.append(req)
            n = min(budget, len(req.prompt_ids))
            chunks.append((req, n))
            budget -= n
        return chunks

    def _budget_pages(self, req: Request) -> int:
        """Pages ``req`` may still take before it finishes."""
        held = 0 if req.slots is None else req.slots.numel() // self.config.page_size
        return math.ceil((len(req.prompt_ids) + req.max_new_tokens) / self.config.page_size) - held

    def _fits(self, req: Request) -> bool:
        """Whether a row and ``req``'s whole page budget are free now (beside what the running
        and reserved requests may still take)."""
        if len(self.running) + len(self.reserved) + len(self.held) >= self.config.max_requests:
            return False
        promised = sum(self._budget_pages(r) for r in self.running + self.reserved)
        free = self.pools.allocator.available_size() // self.config.page_size
        return free - promised >= self._budget_pages(req)

    def _admit(self, req: Request) -> bool:
        """A row (and Mamba slot) for ``req`` if its whole page budget is free; else False."""
        return self._fits(req) and self.pools.req_to_token.alloc([req]) is not None

    def _grow(self, req: Request, length: int) -> None:
        """Make sure ``req`` holds slots for ``length`` tokens (whole pages)."""
        page = self.config.page_size
        held = 0 if req.slots is None else req.slots.numel()
        if length <= held:
            return
        new = self.pools.allocator.alloc_pages(math.ceil((length - held) / page))
        if new is None:
            raise RuntimeError(
                f"out of KV pages: request {req.rid} needs {length} token slots, "
                f"{self.pools.allocator.available_size()} free (no preemption here)"
            )
        values = new.to(torch.int32)
        table = self.pools.req_to_token.req_to_token
        if table.is_cuda:  # from pinned memory, in stream order: no wait for a step in flight
            values = values.pin_memory().to(table.device, non_blocking=True)
        self.pools.req_to_token.write((req.req_pool_idx, slice(held, held + new.numel())), values)
        req.slots = new if req.slots is None else torch.cat((req.slots, new))

    def _forward(self, chunks) -> List[Request]:
        layered = [(r, n) for r, n in chunks if r.layers_out and r.in_prefill] if self.on_layers is not None else []
        after_layers = functools.partial(self.on_layers, layered) if layered else None
        if self.graphs is not None:
            # a layer-wise step calls on_layers, even a last prompt chunk of one token: never the decode step
            if not layered and all(n == 1 and r.kv_committed_len == len(r.all_ids) - 1 for r, n in chunks):
                return self._forward_decode([r for r, _ in chunks])
            if self.graphs.takes_prefill(sum(n for _, n in chunks), len(chunks), in_parts=bool(layered)):
                return self._forward_prefill(chunks, after_layers)
        device = self.model.device
        ids, positions, locs = [], [], []
        for req, n in chunks:
            start = req.kv_committed_len
            self._grow(req, start + n)
            ids.extend(req.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            locs.append(self.pools.req_to_token.req_to_token[req.req_pool_idx, start : start + n])
        mamba = None
        if self.pools.mamba_pool is not None:
            mamba = tuple(int(r.mamba_pool_idx) for r, _ in chunks)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            out_cache_loc=torch.cat(locs).to(device, torch.int64),
            req_pool_indices=tuple(r.req_pool_idx for r, _ in chunks),
            prefix_lens=tuple(r.kv_committed_len for r, _ in chunks),
            extend_lens=tuple(n for _, n in chunks),
            mamba_slots=mamba,
            after_layer=after_layers,
        )
        logits = self.model.forward(batch, self.pools)  # [B, vocab] fp32
        finished = []
        for (req, n), row in zip(chunks, logits):
            req.kv_committed_len += n
            req.is_chunked = int(req.in_prefill)
            if req.kv_committed_len < len(req.all_ids):
                continue  # a prefill chunk that is not the last
            if self._sample(req, row):
                finished.append(req)
        for req in finished:
            self._release(req)
        return finished

    def _overlaps(self, chunks) -> bool:
        """Whether this decode step may run with the next one launched ahead of its wait."""
        return (self.graphs is not None and self.config.overlap
                and all(n == 1 and r.kv_committed_len == len(r.all_ids) - 1 and not r.record_logits
                        for r, n in chunks))

    def _launch_decode(self, reqs: List[Request], ahead: int) -> Launched:
        """Launch a captured decode step for ``reqs``, ``ahead`` tokens past their last sampled
        one (1: chained to the step launched just before, whose tokens the host has not seen)."""
        positions = [r.kv_committed_len + ahead for r in reqs]
        for req, pos in zip(reqs, positions):
            self._grow(req, pos + 1)
        last = [] if ahead else [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        keys = [r.sampling.key(p + 1) for r, p in zip(reqs, positions)]
        mamba = [int(r.mamba_pool_idx) for r in reqs] if self.pools.mamba_pool is not None else ()
        return self.graphs.decode(last, positions, [r.req_pool_idx for r in reqs], keys,
                                  [float(r.sampling.temperature) for r in reqs], [r.sampling.top_k for r in reqs],
                                  mamba, chained=bool(ahead))

    def _forward_decode(self, reqs: List[Request]) -> List[Request]:
        """One token for each of ``reqs`` through a captured decode step (sampled on the GPU)."""
        return self._take_sampled(reqs, self.graphs.collect(self._launch_decode(reqs, 0)))

    def _decode_ahead(self, reqs: List[Request]) -> List[Request]:
        """This step's tokens, with the next step launched before the wait (module docstring)."""
        now = self._ahead.launched if self._ahead is not None else self._launch_decode(reqs, 0)
        self._ahead = _Ahead(list(reqs), self._launch_decode(reqs, 1))
        finished = self._take_sampled(reqs, self.graphs.collect(now), release=False)
        if finished:  # the step ahead writes into their pages: let it end before they go back
            self._take_ahead(skip=finished)
            for req in finished:
                self._release(req)
        return finished

    def _take_ahead(self, skip=()) -> None:
        """Wait for the decode step launched ahead, if any, and take its tokens (none for the
        requests in ``skip``, which finished the step before); requests it ends are returned
        by the next :meth:`step`."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        out = self.graphs.collect(ahead.launched)
        for i, req in enumerate(ahead.reqs):
            if req in skip or req.finish is not None:
                continue
            req.kv_committed_len = len(req.all_ids)
            if self._accept(req, out.tokens[i], out.logprobs[i]):
                self._release(req)
                self._done_early.append(req)

    def _forward_prefill(self, chunks, after_layers=None) -> List[Request]:
        """A prefill step through a captured graph: every chunk in one forward, and the first
        token of each request whose prompt it ends (``after_layers``: the graph in parts, calling
        back between them)."""
        for req, n in chunks:
            self._grow(req, req.kv_committed_len + n)
        launched = self.graphs.prefill([
            Chunk(req.all_ids[req.kv_committed_len : req.kv_committed_len + n], req.kv_committed_len, req.req_pool_idx,
                  req.sampling.key(len(req.all_ids)), float(req.sampling.temperature), req.sampling.top_k)
            for req, n in chunks], after_layers)
        out = self.graphs.collect(launched)
        finished = []
        for i, (req, n) in enumerate(chunks):
            req.kv_committed_len += n
            req.is_chunked = int(req.in_prefill)
            if req.kv_committed_len < len(req.all_ids):
                continue  # a prefill chunk that is not the last
            if req.record_logits:
                req.logits.append(out.logits[i].cpu())
            if self._accept(req, out.tokens[i], out.logprobs[i]):
                finished.append(req)
        for req in finished:
            self._release(req)
        return finished

    def _take_sampled(self, reqs: List[Request], out: StepOutput, release: bool = True) -> List[Request]:
        finished = []
        for i, req in enumerate(reqs):
            req.kv_committed_len = len(req.all_ids)
            req.is_chunked = 0
            if req.record_logits:
                req.logits.append(out.logits[i].cpu())
            if self._accept(req, out.tokens[i], out.logprobs[i]):
                finished.append(req)
        if release:
            for req in finished:
                self._release(req)
        return finished

    def _sample(self, req: Request, row: torch.Tensor) -> bool:
        """Append the next token; True when ``req`` is done. An engine with a graph runner
        samples every step on the GPU, so a request draws the same tokens whichever step kind
        (captured or not) its prefill and decode ran in."""
        position = len(req.all_ids)
        if self.graphs is not None:
            token, logprob = gpu_draw(row, req.sampling.temperature, req.sampling.key(position), req.sampling.top_k)
        else:
            token, logprob = req.sampling.draw(row, position)
        if req.record_logits:
            req.logits.append(row.cpu())
        return self._accept(req, token, logprob)

    def _accept(self, req: Request, token: int, logprob: float) -> bool:
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if token in req.stop_ids:
            req.finish = FinishReason.STOP
        elif len(req.output_ids) >= req.max_new_tokens:
            req.finish = FinishReason.LENGTH
        return req.finish is not None

    def _release(self, req: Request) -> None:
        self._finished_tokens += len(req.output_ids)
        self.running.remove(req)
        if req.hold:
            self.held.append(req)
        else:
            self._free(req)

    def _free(self, req: Request) -> None:
        if req.slots is not None:
            self.pools.allocator.free(req.slots)
            req.slots = None
        if isinstance(self.pools.req_to_token, HybridReqToTokenPool):
            self.pools.req_to_token.free_mamba_cache(req)
        self.pools.req_to_token.free(req)

    # -- hand-off (what a prefill node sends, what a decode node loads) -----------------
    def _committed_slots(self, req: Request) -> torch.Tensor:
        return self.pools.req_to_token.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)

    def export_state(self, req: Request) -> RequestState:
        """Host copy of a running request's KV (and Mamba state) after its prefill."""
        self._take_ahead()
        if req.in_prefill or req not in self.running:
            raise ValueError(f"request {req.rid} must be running with its prefill done")
        slots = self._committed_slots(req)
        if self.pools.mamba_pool is not None:
            kv = self.pools.kv.get_cpu_copy(slots, torch.as_tensor(req.mamba_pool_idx).reshape(1))
        else:
            kv = self.pools.kv.get_cpu_copy(slots)
        return RequestState(list(req.all_ids), len(req.prompt_ids), kv)

    def import_state(self, state: RequestState, max_new_tokens: int, record_logits=False) -> Request:
        """Start a running request from an exported state: reserve its row, pages and Mamba
        slot here, load the cached state, and continue decoding from its last token."""
        prompt = state.token_ids[: state.prompt_len]
        self._take_ahead()
        req = self.add(prompt, max_new_tokens, record_logits=record_logits)
        self.waiting.remove(req)
        if not self._admit(req):
            raise RuntimeError("no free request row / Mamba slot / page to import the request into")
        self.running.append(req)
        req.output_ids = list(state.token_ids[state.prompt_len :])
        req.kv_committed_len = len(state.token_ids) - 1
        self._grow(req, req.kv_committed_len)
        slots = self._committed_slots(req)
        if self.pools.mamba_pool is not None:
            self.pools.kv.load_cpu_copy(state.kv, slots, torch.as_tensor(req.mamba_pool_idx).reshape(1))
        else:
            self.pools.kv.load_cpu_copy(state.kv, slots)
        return req
