"""Jobs the launcher runs on every rank (picklable, module level): generation, and the
prefill / continue-from-state pair that moves a request's cached state between processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from kvtransfer.models.engine import Engine, EngineStats, Request, RequestState


@dataclass(frozen=True)
class Generated:
    """What rank 0 reports: per request, its new tokens (and fp32 logits ``[n, vocab]``)."""

    output_ids: List[List[int]]
    logits: List[Optional[torch.Tensor]]
    stats: EngineStats


@dataclass(frozen=True)
class Generate:
    """Greedy generation of all ``prompts`` as one continuous batch. ``warmup`` first runs the
    same prompts for two tokens and then zeroes the engine's stats (so they show steady-state
    speed, with the kernels for these shapes already loaded)."""

    prompts: Tuple[Tuple[int, ...], ...]
    max_new_tokens: int
    stop_ids: frozenset = frozenset()
    record_logits: bool = False
    warmup: bool = False

    def __call__(self, engine: Engine) -> Generated:
        if self.warmup:
            for p in self.prompts:
                engine.add(p, 2)
            engine.run()
            engine.stats = EngineStats()
        reqs = [engine.add(p, self.max_new_tokens, self.stop_ids, self.record_logits) for p in self.prompts]
        engine.run()
        return _report(engine, reqs, self.record_logits)


@dataclass(frozen=True)
class PrefillAndExport:
    """Prefill ``prompt``, sample its first token, export the cached state; then (for the
    reference) keep decoding ``max_new_tokens - 1`` more tokens in this process."""

    prompt: Tuple[int, ...]
    max_new_tokens: int

    def __call__(self, engine: Engine) -> Tuple[RequestState, Generated]:
        req = engine.add(self.prompt, self.max_new_tokens, record_logits=True)
        while req.in_prefill:
            engine.step()
        state = engine.export_state(req)
        engine.run()
        return state, _report(engine, [req], True)


@dataclass(frozen=True)
class ContinueFromState:
    """Load an exported state and decode to ``max_new_tokens``. ``offset_pages`` pages and a
    request row (and Mamba slot) are taken first, so the state lands in other slots than the
    exporter's."""

    state: RequestState
    max_new_tokens: int
    offset_pages: int = 0

    def __call__(self, engine: Engine) -> Generated:
        if self.offset_pages:
            engine.pools.allocator.alloc_pages(self.offset_pages)
            engine.pools.req_to_token.alloc([Request(rid=-1, prompt_ids=[0], max_new_tokens=1)])
        req = engine.import_state(self.state, self.max_new_tokens, record_logits=True)
        while req.finish is None:
            engine.step()
        return _report(engine, [req], True)


def _report(engine: Engine, reqs, record_logits: bool) -> Generated:
    logits = [torch.stack(r.logits) if record_logits and r.logits else None for r in reqs]
    return Generated([list(r.output_ids) for r in reqs], logits, engine.stats)
