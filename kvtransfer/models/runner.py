"""Decode steps as CUDA-graph replays: one batched forward and sampling for every running
request, with no host synchronisation inside the step.

At build time a graph is captured per batch size in :func:`capture_sizes` (up to the engine's
``max_requests``); a step of ``n`` requests replays the smallest captured size ``>= n``, the
padding rows pointing at the pools' padding row and slot (row 0 of ``req_to_token``, slot 0),
which no request uses. Each graph reads static input buffers (token ids, positions, request
rows, sampling keys and temperatures); the KV slot of each new token and the sequence lengths
are derived on the device (``req_to_token[row, position]``, ``position + 1``), so a step
copies two small host buffers in, replays, and copies the sampled tokens and log-probabilities
out in one ``[B, 2]`` float64 copy (token ids are exact in float64).

The runner needs a model with ``forward_decode`` (:class:`~kvtransfer.models.llama.LlamaModel`)
on one CUDA device (TP 1) over pools without Mamba state; :func:`build_decode_runner` returns
None otherwise and the engine runs decode steps through the model's general forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from kvtransfer.models.batch import DecodeInputs
from kvtransfer.models.decode_attention import num_splits
from kvtransfer.models.sampler import sample


def capture_sizes(max_batch: int) -> List[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


@dataclass(frozen=True)
class DecodeOutput:
    """What one replay returns, for the first ``n`` (real) rows."""

    tokens: List[int]
    logprobs: List[float]
    logits: torch.Tensor  # [>= n, vocab] fp32 on the device; valid until the next step


class DecodeGraphRunner:
    """Captured decode steps over one model and its pools (module docstring)."""

    def __init__(self, model, pools, max_batch: int):
        self.model, self.pools = model, pools
        self.device = model.device
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        dev = self.device
        # rows of the int64 inputs: token ids, positions, request rows, sampling keys
        self._host_ints = torch.zeros(4, n, dtype=torch.int64).pin_memory()
        self._host_temps = torch.zeros(n, dtype=torch.float32).pin_memory()
        self._ints = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self._temps = torch.zeros(n, dtype=torch.float32, device=dev)
        self._result = torch.zeros(n, 2, dtype=torch.float64, device=dev)  # [B, (token, logprob)]
        self._logits: Dict[int, torch.Tensor] = {}
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        for size in reversed(self.sizes):  # largest first: the others reuse its memory pool
            self._capture(size)

    def _step_body(self, size: int) -> torch.Tensor:
        ids, positions, rows, keys = (self._ints[i, :size] for i in range(4))  # [size] each
        r2t = self.pools.req_to_token.req_to_token
        inputs = DecodeInputs(
            input_ids=ids, positions=positions, out_cache_loc=r2t[rows, positions].to(torch.int64),
            req_rows=rows, seq_lens=(positions + 1).to(torch.int32),
            splits=num_splits(size, self.model.kv_heads, self.model.config.max_context_len),
        )
        logits = self.model.forward_decode(inputs, self.pools)  # [size, vocab] fp32
        tokens, logprobs = sample(logits, self._temps[:size], keys)
        self._result[:size, 0] = tokens.to(torch.float64)
        self._result[:size, 1] = logprobs.to(torch.float64)
        return logits

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step_body(size)  # compiles the kernels and warms the allocator outside capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._logits[size] = self._step_body(size)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = graph

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def step(self, ids: Sequence[int], positions: Sequence[int], rows: Sequence[int], keys: Sequence[int],
             temperatures: Sequence[float]) -> DecodeOutput:
        """Run one decode step for ``n = len(ids)`` requests: request ``i`` adds token ``ids[i]``
        at ``positions[i]`` (its slot already in ``req_to_token[rows[i], positions[i]]``)."""
        n = len(ids)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode step takes 1..{self.max_batch} requests, got {n}")
        size = next(s for s in self.sizes if s >= n)
        host = self._host_ints
        host.zero_()
        for i, values in enumerate((ids, positions, rows, keys)):
            host[i, :n] = torch.as_tensor(values, dtype=torch.int64)
        self._host_temps.zero_()
        self._host_temps[:n] = torch.as_tensor(temperatures, dtype=torch.float32)
        self._ints[:, :size].copy_(host[:, :size], non_blocking=True)
        self._temps[:size].copy_(self._host_temps[:size], non_blocking=True)
        self._graphs[size].replay()
        result = self._result[:n].cpu()  # the one device -> host copy; waits for the replay
        return DecodeOutput(result[:, 0].long().tolist(), result[:, 1].tolist(), self._logits[size])


def build_decode_runner(model, pools, max_batch: int) -> Optional[DecodeGraphRunner]:
    """A runner when the model and device support one (module docstring), else None."""
    if (model.device.type != "cuda" or not hasattr(model, "forward_decode") or model.tp.size != 1
            or getattr(pools, "mamba_pool", None) is not None):
        return None
    return DecodeGraphRunner(model, pools, max_batch)
