"""Tensor parallelism: the rank's group (collectives) and the weight-sharding helpers.

One process per rank. :class:`TPGroup` wraps ``torch.distributed`` (gloo on CPU, NCCL on CUDA);
with one rank it makes no collective calls, so a TP-1 model runs without ``init_process_group``.

Sharding follows Megatron: column-parallel projections (Q/K/V, gate/up, Mamba in_proj) split
their output rows, row-parallel ones (o_proj, down, out_proj) split their input columns and
are summed with :meth:`TPGroup.all_reduce`; the LM head splits the vocabulary and the logits
are put back together with :meth:`TPGroup.all_gather_last`. Weights made of sub-blocks that
shard separately (Mamba2's ``[z | x | B | C | dt]`` rows) use :func:`shard_blocks`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its TP group; ``size == 1`` needs no process group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int)
                and 0 <= self.rank < self.size):
            raise ValueError(f"need 0 <= rank < size, got rank={self.rank!r}, size={self.size!r}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place when possible; returns the result). Gloo reduces bf16 in fp32."""
        if self.size == 1:
            return t
        if t.device.type == "cpu" and t.dtype != torch.float32:
            acc = t.float()
            dist.all_reduce(acc)
            return acc.to(t.dtype)
        dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along the last dim, in rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)


def shard(w: torch.Tensor, tp: TPGroup, dim: int = 0) -> torch.Tensor:
    """Rank ``tp.rank``'s contiguous 1/size of ``w`` along ``dim`` (a copy)."""
    n = w.shape[dim]
    if n % tp.size:
        raise ValueError(f"dimension {dim} of size {n} does not split over TP size {tp.size}")
    per = n // tp.size
    return w.narrow(dim, tp.rank * per, per).contiguous()


def shard_blocks(w: torch.Tensor, sizes: Sequence[int], tp: TPGroup, dim: int = 0) -> torch.Tensor:
    """Split ``w`` along ``dim`` into consecutive blocks of ``sizes``, shard each block, and
    concatenate the shards: rank r gets ``[block0_r | block1_r | ...]``."""
    if sum(sizes) != w.shape[dim]:
        raise ValueError(f"block sizes {list(sizes)} must add up to dimension {dim} of size {w.shape[dim]}")
    blocks = torch.split(w, list(sizes), dim=dim)
    return torch.cat([shard(b, tp, dim) for b in blocks], dim=dim)


def rendezvous() -> "dist.TCPStore":
    """Where a TP group meets: a TCPStore on a port the kernel picks, held by the process that
    starts the ranks (keep it alive while they run; its ``port`` goes to :func:`init_tp`). A port
    picked first and bound later by a rank could be taken by another process in between."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def init_tp(rank: int, size: int, port: int, device: str, gpu: Optional[int] = None) -> TPGroup:
    """Join the TP group that meets at the :func:`rendezvous` on ``port``: gloo on CPU, NCCL on
    CUDA (rank ``r`` uses ``cuda:r``, or ``cuda:gpu``)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank if gpu is None else gpu)
    if size == 1:
        return TPGroup(0, 1)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return TPGroup(rank, size)


def rank_device(device: str, tp: TPGroup, gpu: Optional[int] = None) -> torch.device:
    """``cuda`` -> ``cuda:<rank>`` (or ``cuda:<gpu>``); anything else unchanged."""
    if device != "cuda":
        return torch.device(device)
    return torch.device(f"cuda:{tp.rank if gpu is None else gpu}")


def close_tp(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
