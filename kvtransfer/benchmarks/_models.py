"""Model shapes of ``kvtransfer bench transfer``: presets, their layouts, and what moves.

A :class:`ModelShape` holds the numbers of a model's KV cache (and Mamba-style state) that a
transfer sees. :meth:`ModelShape.layout` builds one rank's :class:`~kvtransfer.layout.RankLayout`
with the explicit builders (as ``bench plan`` and the tests do); the planner works from it.

:meth:`ModelShape.row_slices` says the same thing a second way, from the raw numbers and not
through the layout's tensor specs: which bytes of a slot row prefill rank 0 sends to decode
rank 0. The benchmark builds its expected destination bytes and the peers' descriptor lists
from it, so a planner bug shows as a verification failure, not as a figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from kvtransfer.layout import KVKind, RankLayout, dtype_itemsize

__all__ = ["MambaShape", "ModelShape", "PRESETS", "RowSlice"]


@dataclass(frozen=True)
class MambaShape:
    """Linear-attention state per layer and request: a conv state ``[conv channels, K-1]`` whose
    channels are the unsharded sub-blocks ``conv_blocks`` (each cut by TP on its own), and a
    temporal state of ``temporal_heads`` heads of ``temporal_head_bytes``."""

    layer_ids: tuple
    conv_blocks: tuple  # unsharded channels of each sub-block, e.g. (q, k, v)
    conv_kernel: int
    conv_dtype: str
    temporal_heads: int
    temporal_head_bytes: int

    @property
    def conv_unit_bytes(self) -> int:
        return (self.conv_kernel - 1) * dtype_itemsize(self.conv_dtype)


@dataclass(frozen=True)
class RowSlice:
    """``length`` bytes at ``src_offset`` of a prefill row go to ``dst_offset`` of a decode row."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    kind: KVKind  # MHA (GQA) or MLA (one latent row, replicated on every TP rank)
    layer_ids: tuple  # attention layers
    kv_heads: int  # total KV heads (MLA: 1)
    head_dim: int  # MHA head dim; MLA latent width (kv_lora_rank + rope dim)
    dtype: str = "bfloat16"
    mamba: Optional[MambaShape] = None

    def overridden(self, layers: Optional[int] = None, kv_heads: Optional[int] = None,
                   head_dim: Optional[int] = None) -> "ModelShape":
        """The shape with some numbers overridden. ``layers``: the first that many attention
        layers (more than it has: layers 0..layers-1) and, for a hybrid, state layers."""
        out = self
        if layers is not None:
            ids = self.layer_ids[:layers] if layers <= len(self.layer_ids) else tuple(range(layers))
            out = replace(out, layer_ids=tuple(ids))
            if self.mamba is not None:
                out = replace(out, mamba=replace(self.mamba, layer_ids=self.mamba.layer_ids[:layers]))
        if kv_heads is not None:
            if self.kind is not KVKind.MHA:
                raise ValueError(f"{self.name} is {self.kind.value}: its latent row has no KV heads to override")
            out = replace(out, kv_heads=kv_heads)
        if head_dim is not None:
            out = replace(out, head_dim=head_dim)
        return out

    # -- the layout the planner reads ---------------------------------------------------
    def layout(self, tp_rank: int, tp_size: int, page_size: int, num_slots: int, state_slots: int) -> RankLayout:
        base = RankLayout.attention(self.kind, tp_rank=tp_rank, tp_size=tp_size, page_size=page_size,
                                    layer_ids=self.layer_ids, dtype=self.dtype, head_dim=self.head_dim,
                                    num_slots=num_slots, total_heads=self.kv_heads)
        m = self.mamba
        if m is None:
            return base
        return base.with_mamba(layer_ids=m.layer_ids, num_slots=state_slots,
                               conv_dims=[sum(m.conv_blocks) // tp_size], conv_unit_bytes=[m.conv_unit_bytes],
                               temporal_heads=m.temporal_heads // tp_size, temporal_head_bytes=m.temporal_head_bytes,
                               conv_shard_groups=list(m.conv_blocks))

    # -- the same bytes from the raw numbers (pair: prefill rank 0 -> decode rank 0) -----
    def kv_rows(self, tp_size: int) -> int:
        """Bytes of one token's row of one K/V buffer on a rank of ``tp_size``."""
        isz = dtype_itemsize(self.dtype)
        if self.kind is KVKind.MLA:
            return self.head_dim * isz
        return max(self.kv_heads // tp_size, 1) * self.head_dim * isz

    def row_slices(self, prefill_tp: int, decode_tp: int) -> tuple:
        """``(kv, state)``: the :class:`RowSlice` list of a KV row and of each state tensor's row
        (conv, then temporal) that prefill rank 0 writes into decode rank 0. Rank 0 holds the
        first share of every sharded block (the first heads, the first channels of each conv
        sub-block), so the two ranks share the first ``min`` of the two shares of each block."""
        isz = dtype_itemsize(self.dtype)
        if self.kind is KVKind.MLA:
            kv = [RowSlice(0, 0, self.head_dim * isz)]  # the whole latent row, on every rank
        else:
            kv = [RowSlice(0, 0, min(self.kv_rows(prefill_tp), self.kv_rows(decode_tp)))]
        m = self.mamba
        if m is None:
            return kv, []
        conv, src_at, dst_at = [], 0, 0
        for block in m.conv_blocks:
            src_share, dst_share = block // prefill_tp, block // decode_tp
            conv.append(RowSlice(src_at * m.conv_unit_bytes, dst_at * m.conv_unit_bytes,
                                 min(src_share, dst_share) * m.conv_unit_bytes))
            src_at, dst_at = src_at + src_share, dst_at + dst_share
        heads = min(m.temporal_heads // prefill_tp, m.temporal_heads // decode_tp)
        temporal = [RowSlice(0, 0, heads * m.temporal_head_bytes)]
        return kv, [conv, temporal]

    def state_rows(self, tp_size: int) -> list:
        """Bytes of one request's row of each state tensor (conv, temporal) on a rank of ``tp_size``."""
        m = self.mamba
        if m is None:
            return []
        return [sum(m.conv_blocks) // tp_size * m.conv_unit_bytes, m.temporal_heads // tp_size * m.temporal_head_bytes]


# Qwen3-Next-80B-A3B: 48 layers, every fourth full attention (2 KV heads x 256), the others Gated
# DeltaNet: conv over [q | k | v] = 16 x 128, 16 x 128, 32 x 128 channels (kernel 4, bf16) and a
# recurrent state of 32 value heads x 128 x 128 fp32.
_QWEN3_NEXT_MAMBA = MambaShape(layer_ids=tuple(i for i in range(48) if i % 4 != 3), conv_blocks=(2048, 2048, 4096),
                               conv_kernel=4, conv_dtype="bfloat16", temporal_heads=32,
                               temporal_head_bytes=128 * 128 * 4)

PRESETS = {
    "llama3-8b": ModelShape("Llama-3-8B", KVKind.MHA, tuple(range(32)), kv_heads=8, head_dim=128),
    "llama3-70b": ModelShape("Llama-3-70B", KVKind.MHA, tuple(range(80)), kv_heads=8, head_dim=128),
    "deepseek-v3": ModelShape("DeepSeek-V3", KVKind.MLA, tuple(range(61)), kv_heads=1, head_dim=512 + 64),
    "qwen3-next": ModelShape("Qwen3-Next-80B-A3B", KVKind.MHA, tuple(range(3, 48, 4)), kv_heads=2, head_dim=256,
                             mamba=_QWEN3_NEXT_MAMBA),
}
