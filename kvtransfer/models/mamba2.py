"""A Mamba2 mixer whose conv and SSM state live in a :class:`pools.MambaPool` slot per request.

Shapes (full model; ``I = heads * head_dim`` inner size, ``G`` groups of B/C, ``N`` state size,
``K`` conv kernel)::

    in_proj   [I | I + 2GN | heads, hidden]  rows [z | x | B | C | dt]
    conv_w    [I + 2GN, K], conv_b [I + 2GN]  depthwise causal conv over [x | B | C]
    dt_bias, A_log, D  [heads]
    gnorm     [I]      gated RMSNorm, one group of I / G channels per B/C group
    out_proj  [hidden, I]

Pool state per request slot (this rank's shard)::

    conv      [conv_dim / tp, K - 1]    the last K-1 inputs of the conv, channels [x_r | B_r | C_r]
    temporal  [heads / tp, head_dim, N] fp32 SSM state

Tensor parallel: x, B and C are separate sub-blocks that shard separately (rank ``r`` keeps
heads ``r*heads/tp ..`` of x and groups ``r*G/tp ..`` of B and C), as the conv state's channel
order shows; the out projection is row-parallel. ``G`` must divide by TP (no group replication).

The scan is sequential over a request's new tokens: prefill chunks and decode steps both start
from the pool's state and leave the updated state in it. :meth:`Mamba2Mixer.forward_decode`
steps a whole decode batch at once with every index on the device (for CUDA graphs).
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from kvtransfer.models.batch import ForwardBatch
from kvtransfer.models.config import HybridConfig
from kvtransfer.models.parallel import TPGroup, shard, shard_blocks
from kvtransfer.models.seeded import WeightMaker


def add_seeded_mixer(mk: WeightMaker, prefix: str, cfg: HybridConfig) -> None:
    inner, gn = cfg.mamba_intermediate, cfg.n_groups * cfg.state_size
    mk.normal(f"{prefix}.in_proj", (2 * inner + 2 * gn + cfg.mamba_heads, cfg.hidden_size))
    mk.normal(f"{prefix}.conv_w", (inner + 2 * gn, cfg.conv_kernel), std=cfg.conv_kernel ** -0.5)
    mk.normal(f"{prefix}.conv_b", (inner + 2 * gn,), std=0.1)
    mk.uniform(f"{prefix}.dt_bias", (cfg.mamba_heads,), -2.0, 0.0)
    mk.uniform(f"{prefix}.A_log", (cfg.mamba_heads,), 0.0, 1.5)
    mk.normal(f"{prefix}.D", (cfg.mamba_heads,), std=1.0)
    mk.ones(f"{prefix}.gnorm", inner)
    mk.normal(f"{prefix}.out_proj", (cfg.hidden_size, inner))


class Mamba2Mixer:
    """One layer's mixer, this rank's shard (module docstring)."""

    def __init__(self, cfg: HybridConfig, w: Dict[str, torch.Tensor], tp: TPGroup, dtype, device):
        inner, gn = cfg.mamba_intermediate, cfg.n_groups * cfg.state_size
        self.cfg, self.tp = cfg, tp
        self.heads = cfg.mamba_heads // tp.size
        self.groups = cfg.n_groups // tp.size
        self.inner = inner // tp.size
        self.gn = gn // tp.size

        def put(t, dt=dtype):
            return t.to(device=device, dtype=dt).contiguous()

        self.in_proj = put(shard_blocks(w["in_proj"], [inner, inner, gn, gn, cfg.mamba_heads], tp))
        self.conv_w = put(shard_blocks(w["conv_w"], [inner, gn, gn], tp))  # [conv_dim / tp, K]
        self.conv_b = put(shard_blocks(w["conv_b"], [inner, gn, gn], tp))  # [conv_dim / tp]
        self.dt_bias = put(shard(w["dt_bias"], tp), torch.float32)
        self.A = put(-torch.exp(shard(w["A_log"], tp)), torch.float32)  # [heads / tp]
        self.D = put(shard(w["D"], tp), torch.float32)
        self.gnorm = put(shard(w["gnorm"], tp))
        self.out_proj = put(shard(w["out_proj"], tp, 1))  # [hidden, inner / tp]

    def _conv(self, xbc: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv of ``xbc`` ``[n, conv_dim]`` after the cached inputs
        ``conv_state`` ``[conv_dim, K - 1]`` (updated in place)."""
        k = self.cfg.conv_kernel
        seq = torch.cat((conv_state.t().to(xbc.dtype), xbc))  # [K - 1 + n, conv_dim]
        windows = seq.unfold(0, k, 1)  # [n, conv_dim, K]
        out = (windows * self.conv_w).sum(-1) + self.conv_b  # [n, conv_dim]
        conv_state.copy_(seq[-(k - 1):].t())
        return F.silu(out)

    def _scan(self, x, b, c, dt, ssm: torch.Tensor) -> torch.Tensor:
        """SSM recurrence over ``n`` tokens; ``ssm`` ``[heads, head_dim, N]`` fp32 (in place).
        ``x`` ``[n, heads, head_dim]``, ``b``/``c`` ``[n, heads, N]``, ``dt`` ``[n, heads]``."""
        h = ssm.clone()
        ys = []
        for t in range(x.shape[0]):
            decay = torch.exp(dt[t] * self.A)[:, None, None]  # [heads, 1, 1]
            h = h * decay + (dt[t][:, None, None] * x[t][:, :, None]) * b[t][:, None, :]  # [heads, head_dim, N]
            ys.append((h * c[t][:, None, :]).sum(-1) + self.D[:, None] * x[t])  # [heads, head_dim]
        ssm.copy_(h)
        return torch.stack(ys)  # [n, heads, head_dim]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (normed) -> all-reduced ``[T, hidden]``; ``state`` is the layer's
        :class:`pools.MambaState` (``conv[0]`` ``[slots, conv_dim, K-1]``, ``temporal``)."""
        cfg = self.cfg
        hd, n_state = cfg.mamba_head_dim, cfg.state_size
        proj = F.linear(x, self.in_proj)  # [T, 2 * inner + 2 * gn + heads] (this rank's)
        z, xbc, dt_raw = proj.split([self.inner, self.inner + 2 * self.gn, self.heads], dim=-1)
        y = torch.empty_like(z)  # [T, inner]
        per_group = self.heads // self.groups
        for i, start, stop in batch.spans():
            slot = batch.mamba_slots[i]
            n = stop - start
            conv_state = state.conv[0][slot]  # [conv_dim, K - 1], a view into the pool
            act = self._conv(xbc[start:stop], conv_state)
            xs, bs, cs = act.float().split([self.inner, self.gn, self.gn], dim=-1)
            bs = bs.view(n, self.groups, n_state).repeat_interleave(per_group, dim=1)  # [n, heads, N]
            cs = cs.view(n, self.groups, n_state).repeat_interleave(per_group, dim=1)
            dt = F.softplus(dt_raw[start:stop].float() + self.dt_bias)  # [n, heads]
            ys = self._scan(xs.view(n, self.heads, hd), bs, cs, dt, state.temporal[slot])
            y[start:stop] = ys.reshape(n, self.inner).to(y.dtype)
        return self._out(y, z, x.dtype)

    def forward_decode(self, x: torch.Tensor, slots: torch.Tensor, state) -> torch.Tensor:
        """:meth:`forward` for one new token per request, batched and with no host
        synchronisation (the step a CUDA graph captures): ``x`` ``[B, hidden]`` (normed),
        ``slots`` ``[B]`` int64 Mamba slots on the device (padding rows use padding slot 0).
        The states are gathered by slot, stepped once, and written back with ``index_copy_``."""
        cfg, b = self.cfg, x.shape[0]
        hd, n_state = cfg.mamba_head_dim, cfg.state_size
        proj = F.linear(x, self.in_proj)  # [B, 2 * inner + 2 * gn + heads] (this rank's)
        z, xbc, dt_raw = proj.split([self.inner, self.inner + 2 * self.gn, self.heads], dim=-1)
        conv = state.conv[0]  # [slots, conv_dim, K - 1]
        seq = torch.cat((conv[slots].to(xbc.dtype), xbc[:, :, None]), dim=2)  # [B, conv_dim, K]
        act = F.silu((seq * self.conv_w).sum(-1) + self.conv_b)  # [B, conv_dim]
        conv.index_copy_(0, slots, seq[:, :, 1:].to(conv.dtype))
        xs, bs, cs = act.float().split([self.inner, self.gn, self.gn], dim=-1)
        per_group = self.heads // self.groups
        bs = bs.view(b, self.groups, n_state).repeat_interleave(per_group, dim=1)  # [B, heads, N]
        cs = cs.view(b, self.groups, n_state).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt_raw.float() + self.dt_bias)  # [B, heads]
        xs = xs.view(b, self.heads, hd)  # [B, heads, head_dim]
        decay = torch.exp(dt * self.A)[:, :, None, None]  # [B, heads, 1, 1]
        h = state.temporal[slots] * decay + (dt[:, :, None, None] * xs[:, :, :, None]) * bs[:, :, None, :]
        state.temporal.index_copy_(0, slots, h)  # h: [B, heads, head_dim, N]
        y = (h * cs[:, :, None, :]).sum(-1) + self.D[None, :, None] * xs  # [B, heads, head_dim]
        return self._out(y.reshape(b, self.inner).to(z.dtype), z, x.dtype)

    def _out(self, y: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """Gated group RMSNorm of the scan's output ``y`` ``[T, inner]`` and the out projection
        (all-reduced ``[T, hidden]``)."""
        gated = (y * F.silu(z)).view(-1, self.groups, self.inner // self.groups).float()  # [T, groups, I / G]
        gated = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        out = self.gnorm * gated.view(-1, self.inner).to(dtype)  # [T, inner]
        return self.tp.all_reduce(F.linear(out, self.out_proj))
