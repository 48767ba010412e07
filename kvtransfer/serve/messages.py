"""What a node's HTTP process and its TP rank processes say to each other (pickled over pipes).

The node sends commands to rank 0, which hands each batch of them to every rank (all ranks
apply the same commands at the same step, so their schedules stay equal). Rank 0 answers with
events, sent as a list (those of one half of its loop: before the engine step, and after it);
every rank sends :class:`RankReady` once it is up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

from kvtransfer.models.engine import Sampling


@dataclass(frozen=True)
class NodeSpec:
    """Everything a rank process needs to come up (the node's command line, resolved)."""

    role: str  # "prefill" | "decode" | "colocated"
    model: str  # ModelName value
    tp_size: int
    page_size: int
    dtype: str  # "float32" | "bfloat16"
    device: str  # "cpu" | "cuda"
    first_gpu: int  # rank r uses cuda:(first_gpu + r) % visible GPUs
    max_tokens: int  # KV pool size in token slots
    max_requests: int
    chunk_size: int
    transport: str  # "auto" | "nixl" | "nvlink"
    host: str  # the address control sockets bind and announce
    bootstrap: str  # prefill: this node's bootstrap service address
    dist_port: int  # the TP group's rendezvous (models.parallel.rendezvous), set as the ranks start
    threads: int  # torch threads per rank
    instance: str  # the node's name in the control plane (decode: every rank of the node shares it)
    control: Dict[str, float] = field(default_factory=dict)  # ControlConfig timeouts
    max_queue: int = 128  # requests that may wait for pages at once; past it new ones are refused (busy)
    layerwise: int = 0  # prefill: a chunk's KV leaves every this many layers of its forward (0: after the prompt)


# -- commands (node -> ranks) ------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    """Colocated: the whole request here."""

    rid: str
    prompt_ids: np.ndarray  # int32 token ids
    max_new_tokens: int
    stop_ids: frozenset
    sampling: Sampling


@dataclass(frozen=True)
class Prefill:
    """Prefill the prompt, sample the first token, send KV (and state) and that token to the
    decode node that asks for request ``rid``."""

    rid: str
    prompt_ids: np.ndarray  # int32 token ids
    sampling: Sampling
    verify: bool = False  # report per-layer KV digests
    layerwise: bool = True  # on a node with --layerwise: send the KV layer by layer (False: after the prompt)


@dataclass(frozen=True)
class Decode:
    """Reserve pages, receive the prompt's KV from the prefill node whose bootstrap service is
    ``bootstrap``, then decode."""

    rid: str
    prompt_ids: np.ndarray  # int32 token ids
    max_new_tokens: int
    stop_ids: frozenset
    sampling: Sampling
    bootstrap: str
    verify: bool = False


@dataclass(frozen=True)
class Connect:
    """Decode: connect to the prefill node at ``bootstrap`` now (before its first request)."""

    bootstrap: str

    @property
    def rid(self) -> str:  # the node waits for the answer under this key
        return f"connect:{self.bootstrap}"


@dataclass(frozen=True)
class Abort:
    rid: str
    reason: str


@dataclass(frozen=True)
class Shutdown:
    pass


# -- events (ranks -> node) --------------------------------------------------------------------
@dataclass(frozen=True)
class RankReady:
    rank: int
    layout: str  # one line: what the rank's pools hold
    transports: Tuple[str, ...]


@dataclass(frozen=True)
class Tokens:
    """New tokens of a request; ``finish`` ("stop" | "length") once it ended."""

    rid: str
    token_ids: Tuple[int, ...]
    logprobs: Tuple[float, ...]
    finish: Optional[str] = None
    queue_s: Optional[float] = None  # colocated, first tokens only: the command arrived -> admitted


@dataclass(frozen=True)
class KVSent:
    """Prefill: every write of the request has landed at decode."""

    rid: str
    first_token: int
    prompt_tokens: int
    transfer_s: float  # the first write posted -> every write done
    wait_s: float  # the KV handed to the KV manager -> the first write posted (decode had not asked yet)
    queue_s: float  # the command arrived -> the engine admitted the request
    compute_s: float  # admitted -> its first token sampled (the prompt's forward passes)
    sampled_at: float  # time.monotonic() when its first token was sampled (after the last layer)
    digests: Optional[Dict[str, str]] = None
    posted_at: Optional[float] = None  # time.monotonic() when the post of its last writes began


@dataclass(frozen=True)
class KVReceived:
    """Decode: the request's KV, state and first token are here; decoding starts."""

    rid: str
    kv_bytes: int  # bytes that landed on this node's ranks
    transfer_s: float  # the receiver asked -> every write counted
    wait_s: float  # the command arrived -> pages reserved
    landed_at: float  # time.monotonic() when every write was counted (its manager's thread)
    digests: Optional[Dict[str, str]] = None
    decoding_at: float = 0.0  # time.monotonic() when the rank's engine took it into its decode batch


@dataclass(frozen=True)
class RequestFailed:
    rid: str
    reason: str
    client_error: bool = False  # the request itself was bad (HTTP 400), not the node
    busy: bool = False  # the node's queue is full: try again later (HTTP 503 with Retry-After)


@dataclass(frozen=True)
class Connected:
    """Decode: the answer to :class:`Connect` (``error`` empty when every rank is connected)."""

    rid: str
    error: str = ""


@dataclass(frozen=True)
class Load:
    """Rank 0's pools and queues, after each step that changed them."""

    slots_in_use: int
    slots_total: int
    running: int
    waiting: int
