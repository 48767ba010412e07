"""What a pool holds, as plain data: every pool's ``transfer_layout()`` returns one of these.

A transfer moves a request's rows from one rank's pools into another's; to plan it, the other
side needs to know what each exported buffer holds: which tensor kind, how tensor parallelism
cuts its rows, how many bytes a unit of a row is, how pages are split into sections. The
pools say so here, next to their layout exports, in terms of THIS rank's pool (the pool knows
nothing of the TP size). ``kvtransfer.layout.RankLayout.from_pools`` reads it; nothing here
imports ``kvtransfer``.

Buffers are numbered as the pools export them, tensor-major then layer: buffer
``export_index * len(layer_ids) + layer_position`` of the export named by ``export``.
A slot row of a tensor is ``units * unit_bytes`` bytes; a page holds ``page_size`` rows, so an
exported ``item_len`` is ``page_size * units * unit_bytes``, except for sectioned pages (NSA's
index_k: ``page_size`` fp8 rows, then ``page_size`` fp32 scales), which state ``page_bytes``
and each section's ``section_start``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["Export", "KVKind", "KVLayout", "ShardRule", "StateKind", "StateLayout", "TensorLayout",
           "TransferLayout", "dtype_name"]


class KVKind(enum.Enum):
    """What the KV buffers hold."""

    MHA = "mha"  # [K_0.., V_0..]: heads of head_dim / v_head_dim
    MHA_FP4 = "mha_fp4"  # [K_0.., V_0.., Kscale_0.., Vscale_0..]: packed e2m1 and block-16 scales
    MLA = "mla"  # [KV_0..]: one latent row per token
    MLA_FP4 = "mla_fp4"  # [KV_0.., KVscale_0..]
    NSA = "nsa"  # MLA rows, plus index_k as state


class StateKind(enum.Enum):
    """What the state buffers hold (``NONE``: a rank without state buffers)."""

    NONE = "none"
    MAMBA = "mamba"  # one slot per request: conv tensors, then the temporal (SSM) state
    NSA_INDEX = "nsa_index"  # NSA index_k: paged like the KV, addressed by token slots


class ShardRule(enum.Enum):
    """How tensor parallelism cuts a row (the rule itself: ``kvtransfer.layout.shard_units``)."""

    REPLICATED = "replicated"  # every rank holds the whole row (MLA latent rows, NSA index_k)
    HEADS = "heads"  # the row is this rank's share of the KV heads
    GROUPS = "groups"  # the row is this rank's share of state dim 2, cut per sub-block


class Export(enum.Enum):
    """The pool method that exports the buffers, ``(data_ptrs, data_lens, item_lens)``."""

    CONTIGUOUS = "get_contiguous_buf_infos"
    STATE = "get_state_buf_infos"


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _positive(owner: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class TensorLayout:
    """One exported tensor kind (repeated per layer), or one section of its pages.

    ``units`` are what this rank holds of the row: heads (HEADS), channels of state dim 2
    (GROUPS: conv channels, SSM heads), 1 (REPLICATED). ``model_sub_blocks``: the row is
    sub-blocks that TP cuts one by one, and only the model knows them (Mamba conv ``[x | B |
    C]``); the layout takes them from its caller, else one evenly cut block.
    """

    name: str
    export_index: int
    shard: ShardRule
    units: int
    unit_bytes: int  # bytes of one unit in a slot row
    model_sub_blocks: bool = False
    section_start: int = 0  # bytes from a page's start to this section (sectioned pages)
    page_bytes: Optional[int] = None  # bytes of a whole page when sectioned; None: page_size * row_bytes

    def __post_init__(self):
        _positive(f"TensorLayout {self.name!r}", units=self.units, unit_bytes=self.unit_bytes)
        if not isinstance(self.shard, ShardRule):
            raise TypeError(f"TensorLayout {self.name!r}.shard must be a ShardRule, got {type(self.shard).__name__}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot row of this tensor (or section) on this rank."""
        return self.units * self.unit_bytes


@dataclass(frozen=True)
class KVLayout:
    """The KV buffers: ``tensors`` in export order, each repeated over ``layer_ids``.

    ``num_slots`` token rows per buffer (page 0, the padding page, included); ``head_dim`` is
    the K head dim (MHA) or the latent row width (MLA / NSA, where ``v_head_dim`` equals it).
    """

    kind: KVKind
    export: Export
    layer_ids: tuple  # global layer ids, in export order
    page_size: int
    num_slots: int
    dtype: str  # the cache dtype's name (fp8 is stored as uint8, FP4 packs two per byte)
    head_dim: int
    v_head_dim: int
    tensors: tuple  # TensorLayout per tensor kind, export order

    def __post_init__(self):
        _positive("KVLayout", page_size=self.page_size, num_slots=self.num_slots, head_dim=self.head_dim,
                  v_head_dim=self.v_head_dim)
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        object.__setattr__(self, "tensors", tuple(self.tensors))


@dataclass(frozen=True)
class StateLayout:
    """The state buffers: ``tensors`` in export order, each repeated over ``layer_ids``.

    Mamba: a page is one request slot (``page_size`` 1), ``num_slots`` includes padding slot 0.
    NSA index_k: paged like the KV, ``num_slots`` = pages * ``page_size``. ``dims``: the
    TP-sliced dimension per tensor kind, as ``get_state_dim_per_tensor()`` reports it.
    """

    kind: StateKind
    export: Export
    layer_ids: tuple
    page_size: int
    num_slots: int
    dims: tuple
    tensors: tuple

    def __post_init__(self):
        if not isinstance(self.kind, StateKind) or self.kind is StateKind.NONE:
            raise ValueError(f"StateLayout.kind must be a StateKind other than NONE, got {self.kind!r}")
        _positive("StateLayout", page_size=self.page_size, num_slots=self.num_slots)
        for name in ("layer_ids", "dims", "tensors"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class TransferLayout:
    """A pool's description: its KV buffers, its state buffers, or both (None where absent)."""

    kv: Optional[KVLayout] = None
    state: Optional[StateLayout] = None
