"""Engine steps as CUDA-graph replays: no host synchronisation inside a step, one small copy in
and one out.

Two kinds of step are captured at build time:

- **decode**, one graph per batch size in :func:`capture_sizes` (up to the engine's
  ``max_requests``): one batched forward and GPU sampling for every running request. A step of
  ``n`` requests replays the smallest captured size ``>= n``.
- **prefill**, one graph per (token count, request count) in :func:`prefill_buckets` x
  :func:`prefill_request_sizes`: the chunks of several requests, each after its cached prefix
  (first chunks, later chunks of a long prompt, any mix), in one forward through the paged
  extend-attention kernel, and the draw of each request's next token. The tokens are padded to
  the token bucket, the requests to the request bucket (padding requests have no tokens). A
  step with more tokens or requests than the largest buckets runs eagerly.
- **prefill in parts**, with a ``layer_group``, for layer-wise sending: each prefill graph is
  captured a second time as one graph per group of that many layers (:func:`layer_parts`; the
  first part embeds the tokens, the last computes the logits and the draw). Between the parts'
  replays the host calls back with the layers done, so their K/V can leave while the later parts
  compute; the residual stream ``(h, delta)`` passes from part to part through static buffers
  (which a part's last layer writes, :meth:`LlamaModel.extend_layers`), so the next part's first
  fused add computes what the one-graph step computes.

Padding rows and tokens point at the pools' padding row and slot (row 0 of ``req_to_token``,
slot 0), which no request uses. Each graph reads static input buffers (token ids, positions,
request rows, Mamba slots, sampling keys and top-k; for prefill each request's row, prefix
length, chunk offsets and the index of the token whose logits are sampled); the KV slot of each
token and the sequence lengths are derived on the device (``req_to_token[row, position]``,
``position + 1``). Sampled tokens and log-probabilities come back in one ``[B, 2]`` float64 copy
(token ids are exact in float64).

A step is launched, then collected (:meth:`GraphRunner.launch`, :meth:`GraphRunner.collect`), so
the engine can launch decode step n+1 before it waits for step n: a *chained* launch takes its
token ids from the previous replay's samples on the device (the host never sees them first), and
the host and result buffers alternate between two pinned sets, so the host fills step n+1's
inputs while step n's are still being read.


The runner needs a model with ``forward_decode`` on one CUDA device (TP 1); prefill steps are
captured for models with ``forward_extend`` too (:class:`~kvtransfer.models.llama.LlamaModel`).
A hybrid model's decode graph steps the Mamba states of the requests' slots (padding rows use
the Mamba pool's padding slot 0). :func:`build_runner` returns None otherwise and the engine
runs every step through the model's general forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvtransfer.models.batch import DecodeInputs, ExtendIndex, ExtendInputs
from kvtransfer.models.decode_attention import num_splits
from kvtransfer.models.sampler import sample

MIN_BUCKET = 16
MAX_PREFILL_REQUESTS = 16  # the most requests a captured prefill step takes
# rows of the int64 input buffers: per token (ids, positions, request rows), per request (sampling
# keys, index of the last token, top-k, Mamba slots, request rows, prefix lengths, cumulative
# chunk lengths)
IDS, POSITIONS, ROWS, KEYS, LAST, TOP_KS, MAMBA, REQ_ROWS, PREFIX, CU = range(10)


def capture_sizes(max_batch: int) -> List[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def prefill_request_sizes(max_batch: int) -> List[int]:
    """Powers of two up to ``max_batch`` (included) and :data:`MAX_PREFILL_REQUESTS`."""
    top = min(max_batch, MAX_PREFILL_REQUESTS)
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i < top} | {top})


def layer_parts(num_layers: int, group: int) -> List[range]:
    """The layers of each part of a prefill step captured in parts: ``group`` at a time, the last
    part the rest."""
    return [range(a, min(a + group, num_layers)) for a in range(0, num_layers, group)]


def prefill_buckets(chunk_size: int, max_context_len: int) -> List[int]:
    """Powers of two from ``MIN_BUCKET`` up to the first one ``>= chunk_size``, none past the
    context length."""
    out, b = [], MIN_BUCKET
    while b <= max_context_len:
        out.append(b)
        if b >= chunk_size:
            break
        b *= 2
    return out


@dataclass(frozen=True)
class Launched:
    """A replay in flight: its first ``n`` rows' results land in host set ``buf`` once ``done``
    has fired (the logits: those of graph ``key``)."""

    key: tuple
    n: int
    buf: int
    done: torch.cuda.Event


@dataclass(frozen=True)
class StepOutput:
    """What one replay returns, for the first ``n`` (real) rows."""

    tokens: List[int]
    logprobs: List[float]
    logits: torch.Tensor  # [>= n, vocab] fp32 on the device; valid until the next step


@dataclass(frozen=True)
class Chunk:
    """One request's part of a prefill step: ``ids`` at positions ``start ..`` (their slots
    already in ``req_to_token[row, start : start + len(ids)]``), and how its next token is drawn
    (used when the chunk ends the request's prompt)."""

    ids: Sequence[int]
    start: int
    row: int
    key: int
    temperature: float
    top_k: int


class GraphRunner:
    """Captured decode and prefill steps over one model and its pools (module docstring)."""

    def __init__(self, model, pools, max_batch: int, chunk_size: int, layer_group: int = 0):
        self.model, self.pools = model, pools
        self.device = model.device
        self.decode_sizes = capture_sizes(max_batch)
        prefill = hasattr(model, "forward_extend")
        self.prefill_tokens = prefill_buckets(chunk_size, model.config.max_context_len) if prefill else []
        self.prefill_requests = prefill_request_sizes(max_batch) if prefill else []
        in_parts = layer_group > 0 and hasattr(model, "extend_layers")
        self.parts = layer_parts(model.config.num_layers, layer_group) if in_parts else []
        # the residual stream (h, delta) between parts: [2, tokens, hidden] of the largest prefill bucket
        self._stream = (torch.zeros(2, self.prefill_tokens[-1], model.config.hidden_size, dtype=model.dtype,
                                    device=self.device) if self.parts else None)
        n = max(self.decode_sizes[-1], self.prefill_tokens[-1] if prefill else 0,
                self.prefill_requests[-1] + 1 if prefill else 0)
        # two host sets, used by alternate launches (module docstring)
        self._host_ints = torch.zeros(2, 10, n, dtype=torch.int64).pin_memory()
        self._host_temps = torch.zeros(2, n, dtype=torch.float32).pin_memory()
        self._host_result = torch.zeros(2, n, 2, dtype=torch.float64).pin_memory()
        self._buf = 0
        self._ints = torch.zeros(10, n, dtype=torch.int64, device=self.device)
        self._temps = torch.zeros(n, dtype=torch.float32, device=self.device)
        self._result = torch.zeros(n, 2, dtype=torch.float64, device=self.device)  # [B, (token, logprob)]
        self._sampled = torch.zeros(n, dtype=torch.int64, device=self.device)  # a chained launch's ids
        self._logits: Dict[tuple, torch.Tensor] = {}
        self._graphs: Dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._capture_stream = torch.cuda.Stream(self.device)
        start = time.perf_counter()
        for size in reversed(self.decode_sizes):  # largest first: the others reuse its memory
            self._capture(("decode", size))
        for tokens in reversed(self.prefill_tokens):
            for reqs in reversed(self.prefill_requests):
                if reqs <= tokens:
                    self._capture(("prefill", tokens, reqs))
                    for part in range(len(self.parts)):
                        self._capture(("prefill", tokens, reqs, part))
        self.capture_s = time.perf_counter() - start

    # -- capture -------------------------------------------------------------------------
    def _inputs(self, size: int) -> DecodeInputs:
        ids, positions, rows = (self._ints[i, :size] for i in (IDS, POSITIONS, ROWS))  # [size] each
        r2t = self.pools.req_to_token.req_to_token
        return DecodeInputs(input_ids=ids, positions=positions, out_cache_loc=r2t[rows, positions].to(torch.int64),
                            req_rows=rows, seq_lens=(positions + 1).to(torch.int32),
                            splits=num_splits(size, self.model.kv_heads, self.model.config.max_context_len),
                            mamba_slots=self._ints[MAMBA, :size])

    def _extend_inputs(self, tokens: int, reqs: int) -> ExtendInputs:
        ids, positions, rows = (self._ints[i, :tokens] for i in (IDS, POSITIONS, ROWS))  # [tokens] each
        r2t = self.pools.req_to_token.req_to_token
        index = ExtendIndex(req_rows=self._ints[REQ_ROWS, :reqs], prefix_lens=self._ints[PREFIX, :reqs].to(torch.int32),
                            cu_seqlens=self._ints[CU, : reqs + 1].to(torch.int32), max_extend=tokens,
                            max_len=self.model.config.max_context_len)
        return ExtendInputs(input_ids=ids, positions=positions, out_cache_loc=r2t[rows, positions].to(torch.int64),
                            extend_index=index, last=self._ints[LAST, :reqs])

    def _body(self, key: tuple) -> Optional[torch.Tensor]:
        """What graph ``key`` runs: a decode step, a prefill step, or part ``key[3]`` of one
        (None: a part before the last, which leaves the residual stream in ``_stream``, where
        the next part reads it)."""
        if key[0] == "decode":
            b = key[1]
            logits = self.model.forward_decode(self._inputs(b), self.pools)  # [b, vocab] fp32
        elif len(key) == 3:
            b = key[2]
            logits = self.model.forward_extend(self._extend_inputs(key[1], b), self.pools)  # [b, vocab] fp32
        else:
            _, tokens, b, part = key
            inputs = self._extend_inputs(tokens, b)
            h, delta = self.model.extend_layers(inputs, self.pools, self.parts[part], self._stream[:, :tokens])
            if part < len(self.parts) - 1:
                return None
            logits = self.model.extend_logits(inputs, h, delta)  # [b, vocab] fp32
        tokens, logprobs = sample(logits, self._temps[:b], self._ints[KEYS, :b], self._ints[TOP_KS, :b])
        self._result[:b, 0] = tokens.to(torch.float64)
        self._result[:b, 1] = logprobs.to(torch.float64)
        self._sampled[:b] = tokens.to(torch.int64)
        return logits

    @torch.inference_mode()
    def _capture(self, key: tuple) -> None:
        stream = self._capture_stream  # one for every capture: cuBLAS keeps a workspace per stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._body(key)  # compiles the kernels and warms the allocator outside capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._logits[key] = self._body(key)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = graph

    def describe(self) -> str:
        """What was captured, for a node's start-up line."""
        prefill = sum(1 for k in self._graphs if k[0] == "prefill" and len(k) == 3)
        parts = f" (and in {len(self.parts)} parts of <= {len(self.parts[0])} layers)" if self.parts else ""
        return (f"CUDA graphs: {len(self.decode_sizes)} decode, {prefill} prefill{parts}, "
                f"captured in {self.capture_s:.1f} s")

    # -- steps -----------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return self.decode_sizes[-1]

    def takes_prefill(self, num_tokens: int, num_requests: int, in_parts: bool = False) -> bool:
        """Whether a prefill step of these many tokens and requests has a captured graph (with
        ``in_parts``: captured in parts)."""
        return (bool(self.prefill_tokens) and 1 <= num_tokens <= self.prefill_tokens[-1]
                and 1 <= num_requests <= self.prefill_requests[-1] and (bool(self.parts) or not in_parts))

    def decode(self, ids: Sequence[int], positions: Sequence[int], rows: Sequence[int], keys: Sequence[int],
               temperatures: Sequence[float], top_ks: Sequence[int], mamba_slots: Sequence[int] = (),
               chained: bool = False) -> Launched:
        """Launch one decode step for ``n = len(positions)`` requests: request ``i`` adds token
        ``ids[i]`` at ``positions[i]`` (its slot already in ``req_to_token[rows[i], positions[i]]``;
        its Mamba state, for a hybrid model, in slot ``mamba_slots[i]``). ``chained``: the ids are
        the tokens the previous launch sampled, row for row (``ids`` is ignored); that launch was
        a decode of the same requests in the same order."""
        n = len(positions)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a decode step takes 1..{self.max_batch} requests, got {n}")
        size = next(s for s in self.decode_sizes if s >= n)
        ints = {POSITIONS: positions, ROWS: rows, KEYS: keys, TOP_KS: top_ks, MAMBA: mamba_slots}
        if not chained:
            ints[IDS] = ids
        return self.launch(("decode", size), n, ints, temperatures, chained)

    def prefill(self, chunks: Sequence[Chunk], after_layers: Optional[Callable[[int], None]] = None) -> Launched:
        """Launch one prefill step of ``chunks`` (several requests' chunks in one forward) and the
        draw of each request's next token, row ``i`` of the results for ``chunks[i]``. With
        ``after_layers`` the step replays in parts, each followed by ``after_layers(end)``: the
        K/V of the layers before ``end`` are queued on the current stream (the runner needs a
        ``layer_group``)."""
        lengths = [len(c.ids) for c in chunks]
        if not all(lengths) or not self.takes_prefill(sum(lengths), len(chunks), after_layers is not None):
            top = (self.prefill_tokens or [0])[-1], (self.prefill_requests or [0])[-1]
            raise ValueError(f"a prefill step takes 1..{top[0]} tokens in 1..{top[1]} requests (none empty), "
                             f"got chunks of {lengths} tokens")
        total = sum(lengths)
        tokens = next(s for s in self.prefill_tokens if s >= total)
        reqs = next(s for s in self.prefill_requests if s >= len(chunks))
        ids, positions, rows, cu = [], [], [], [0]
        for c, n in zip(chunks, lengths):
            ids.extend(c.ids)
            positions.extend(range(c.start, c.start + n))
            rows.extend([c.row] * n)
            cu.append(cu[-1] + n)
        cu += [total] * (reqs - len(chunks))  # padding requests: no tokens
        ints = {IDS: ids, POSITIONS: positions, ROWS: rows, REQ_ROWS: [c.row for c in chunks],
                PREFIX: [c.start for c in chunks], CU: cu, LAST: [end - 1 for end in cu[1: len(chunks) + 1]],
                KEYS: [c.key for c in chunks], TOP_KS: [c.top_k for c in chunks]}
        return self.launch(("prefill", tokens, reqs), len(chunks), ints, [c.temperature for c in chunks],
                           after_layers=after_layers)

    def launch(self, key: tuple, n: int, ints: dict, temperatures: Sequence[float], chained: bool = False,
               after_layers: Optional[Callable[[int], None]] = None) -> Launched:
        """Copy the inputs in, replay ``key``'s graph (with ``after_layers``: its parts, calling
        back after each) and start the copy of its results out; no wait."""
        size = key[1] if key[0] == "decode" else max(key[1], key[2] + 1)  # the columns its inputs use
        buf = self._buf
        self._buf ^= 1
        host, temps = self._host_ints[buf].numpy(), self._host_temps[buf].numpy()
        host[:, :size] = 0
        for row, values in ints.items():
            host[row, : len(values)] = values
        temps[:size] = 0
        temps[: len(temperatures)] = temperatures
        self._ints[:, :size].copy_(self._host_ints[buf, :, :size], non_blocking=True)
        if chained:
            self._ints[IDS, :n].copy_(self._sampled[:n])
        self._temps[:size].copy_(self._host_temps[buf, :size], non_blocking=True)
        if after_layers is None:
            self._graphs[key].replay()
        else:
            for part, layers in enumerate(self.parts):
                self._graphs[key + (part,)].replay()
                after_layers(layers.stop)
            key += (len(self.parts) - 1,)  # whose logits the step returns
        self._host_result[buf, :n].copy_(self._result[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return Launched(key, n, buf, done)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched step (the step's only wait) and read its sampled rows. The logits
        in the output are valid until the next launch."""
        launched.done.synchronize()
        result = self._host_result[launched.buf, : launched.n].numpy()
        return StepOutput(result[:, 0].astype(int).tolist(), result[:, 1].tolist(), self._logits[launched.key])


def build_runner(model, pools, max_batch: int, chunk_size: int, layer_group: int = 0) -> Optional[GraphRunner]:
    """A runner when the model and device support one (module docstring), else None."""
    if model.device.type != "cuda" or not hasattr(model, "forward_decode") or model.tp.size != 1:
        return None
    return GraphRunner(model, pools, max_batch, chunk_size, layer_group)
