"""Mamba / linear-attention state pool: one state slot per request, every mamba layer.

Layout (``L`` = number of mamba layers held, ``size`` request slots + padding slot 0)::

    conv[i]   # [L, size + 1, conv_dim_i, conv_kernel - 1]       conv_dtype, one per conv shape
    temporal  # [L, size + 1, num_heads, head_dim, state_size]   temporal_dtype

With speculative decoding (``speculative_num_draft_tokens`` = D given) two more buffers hold
per-draft-token intermediates; they have their own slot count ``spec_state_size + 1`` and are
never exported for transfer::

    intermediate_ssm            # [L, spec_state_size + 1, D, num_heads, head_dim, state_size]
    intermediate_conv_window[i] # [L, spec_state_size + 1, D, conv_dim_i, conv_kernel - 1]

Slot 0 is the padding slot dummy writes from padded batches land in: never allocated.
Dimension 2 of every exported state tensor (conv_dim, num_heads) is the one tensor
parallelism cuts; ``get_state_dim_per_tensor`` reports it.

Export order (the layout contract, ``get_contiguous_buf_infos``)::

    [conv[0][l] for l in layers] + [conv[1][l] for l in layers] + ... + [temporal[l] for l in layers]

item_len = bytes of one request slot of that layer's buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Tuple

import torch

from pools._checks import check_indices, check_tensor, tensor_bytes
from pools.describe import Export, ShardRule, StateKind, StateLayout, TensorLayout, TransferLayout

logger = logging.getLogger(__name__)

GB = 1 << 30


def _positive_ints(name: str, values, length: Optional[int] = None) -> Tuple[int, ...]:
    """A tuple of positive ints (optionally of a fixed length), or ValueError/TypeError."""
    try:
        out = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None
    if any(not isinstance(v, int) or isinstance(v, bool) for v in out):
        raise TypeError(f"{name} must hold ints, got {out!r}")
    if any(v <= 0 for v in out) or (length is not None and len(out) != length):
        want = f"{length} positive ints" if length is not None else "positive ints"
        raise ValueError(f"{name} must be {want}, got {out!r}")
    return out


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _layer_ids(name: str, layers) -> Tuple[int, ...]:
    ids = tuple(layers)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ids):
        raise ValueError(f"{name} must be non-negative int layer ids, got {ids!r}")
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"{name} must be a non-empty list of distinct layer ids, got {ids!r}")
    return ids


@dataclass(frozen=True)
class MambaStateParams:
    """Shapes and dtypes of one layer's state for one request (what the seed takes from
    SGLang's ``BaseLinearStateParams`` / ``Mamba2CacheParams``), already divided by TP.

    - ``conv_shapes``: one ``(conv_dim, conv_kernel - 1)`` per conv state tensor (Mamba2 has
      one; gated-delta-net style layers may have several);
    - ``temporal_shape``: ``(num_heads, head_dim, state_size)`` of the SSM state;
    - ``layers``: global ids of the model's mamba layers;
    - ``conv_dtype`` / ``temporal_dtype``: SGLang's defaults are the model dtype (bf16) and fp32.

    Use :meth:`mamba2` to derive it from a Mamba2 model config and a TP size.
    """

    conv_shapes: Tuple[Tuple[int, int], ...]
    temporal_shape: Tuple[int, int, int]
    layers: Tuple[int, ...]
    conv_dtype: torch.dtype = torch.bfloat16
    temporal_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if not isinstance(self.conv_shapes, (list, tuple)) or not self.conv_shapes:
            raise ValueError(
                f"conv_shapes must be a non-empty list of (conv_dim, conv_kernel - 1), got {self.conv_shapes!r}"
            )
        conv = tuple(_positive_ints(f"conv_shapes[{i}]", s, 2) for i, s in enumerate(self.conv_shapes))
        object.__setattr__(self, "conv_shapes", conv)
        object.__setattr__(self, "temporal_shape", _positive_ints("temporal_shape", self.temporal_shape, 3))
        object.__setattr__(self, "layers", _layer_ids("layers", self.layers))
        for name in ("conv_dtype", "temporal_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {type(getattr(self, name)).__name__}")

    @classmethod
    def mamba2(
        cls,
        *,
        tp_world_size: int,
        intermediate_size: int,
        n_groups: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        conv_kernel: int,
        layers: Sequence[int],
        conv_dtype: torch.dtype = torch.bfloat16,
        temporal_dtype: torch.dtype = torch.float32,
    ) -> "MambaStateParams":
        """Per-rank state shapes of a Mamba2 mixer (SGLang's ``Mamba2StateShape.create``).

        Groups that do not divide across ranks are replicated up to ``tp_world_size`` so that
        every head shard carries the groups it needs; then
        ``conv_dim = intermediate_size + 2 * n_groups * state_size`` and heads are split by TP.
        """
        tp, inter, groups, heads, hdim, dstate, kernel = (
            _positive_int(name, value)
            for name, value in (
                ("tp_world_size", tp_world_size), ("intermediate_size", intermediate_size),
                ("n_groups", n_groups), ("num_heads", num_heads), ("head_dim", head_dim),
                ("state_size", state_size), ("conv_kernel", conv_kernel),
            )
        )
        if kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {kernel}")
        if groups % tp:
            groups = tp  # replicate groups so each rank holds the ones its heads use
        conv_dim = inter + 2 * groups * dstate
        for what, n in (("conv_dim", conv_dim), ("num_heads", heads)):
            if n % tp:
                raise ValueError(f"{what}={n} must be divisible by tp_world_size={tp}")
        return cls(
            conv_shapes=((conv_dim // tp, kernel - 1),),
            temporal_shape=(heads // tp, hdim, dstate),
            layers=tuple(layers),
            conv_dtype=conv_dtype,
            temporal_dtype=temporal_dtype,
        )

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one request slot over all layers (conv + temporal, no speculative buffers)."""
        conv = sum(a * b for a, b in self.conv_shapes) * self.conv_dtype.itemsize
        h, d, s = self.temporal_shape
        return len(self.layers) * (conv + h * d * s * self.temporal_dtype.itemsize)


@dataclass(frozen=True, kw_only=True)
class MambaState:
    """The state tensors, all layers: ``conv`` list ``[L, slots, *conv_shape]``, ``temporal``
    ``[L, slots, *temporal_shape]``. :meth:`at_layer_idx` drops the leading layer axis."""

    conv: List[torch.Tensor]
    temporal: torch.Tensor

    def at_layer_idx(self, layer: int) -> "MambaState":
        """The same fields viewed at local layer index ``layer`` (no copy)."""
        kwargs = {}
        for f in fields(self):
            value = getattr(self, f.name)
            kwargs[f.name] = [t[layer] for t in value] if isinstance(value, list) else value[layer]
        return type(self)(**kwargs)

    def mem_usage_bytes(self) -> int:
        return sum(tensor_bytes(getattr(self, f.name)) for f in fields(self))


@dataclass(frozen=True, kw_only=True)
class MambaSpeculativeState(MambaState):
    """:class:`MambaState` plus the per-draft-token intermediates of speculative verify."""

    intermediate_ssm: torch.Tensor
    intermediate_conv_window: List[torch.Tensor]


class MambaPool:
    """Request-slot pool of Mamba state (layout in the module docstring).

    ``alloc`` hands out slots from the front of a FIFO free list and zeroes their state;
    ``free`` appends them back. Slot bookkeeping lives on the host: ``free`` and ``copy_from``
    validate their indices there (one device sync on CUDA), which is what makes a double free a
    ``ValueError`` instead of silent corruption.

    Arguments: ``size`` request slots (plus padding slot 0); ``cache_params`` the per-layer
    shapes/dtypes; ``mamba_layer_ids`` the global ids of the layers this pool holds (default
    ``cache_params.layers``; a pipeline stage passes its own subset); ``device``;
    ``speculative_num_draft_tokens`` (D) adds the speculative buffers of
    ``spec_state_size + 1`` slots (``spec_state_size`` is ignored without it).

    Layer ids are global model layer ids (those in ``mamba_layer_ids``); the seed's
    ``mamba2_layer_cache`` took a local index, here it takes the layer id and raises
    ``KeyError`` for any other id. ``enable_memory_saver`` is accepted and ignored.
    """

    State = MambaState
    SpeculativeState = MambaSpeculativeState

    def __init__(
        self,
        *,
        size: int,
        spec_state_size: int,
        cache_params: MambaStateParams,
        mamba_layer_ids: Optional[Sequence[int]] = None,
        device: str = "cpu",
        enable_memory_saver: bool = False,
        speculative_num_draft_tokens: Optional[int] = None,
    ):
        if not isinstance(cache_params, MambaStateParams):
            raise TypeError(f"cache_params must be a MambaStateParams, got {type(cache_params).__name__}")
        self.size = _positive_int("size", size)
        if mamba_layer_ids is None:
            mamba_layer_ids = cache_params.layers
        self.mamba_layer_ids = _layer_ids("mamba_layer_ids", mamba_layer_ids)
        self.mamba_map = {layer_id: i for i, layer_id in enumerate(self.mamba_layer_ids)}
        self.num_mamba_layers = len(self.mamba_layer_ids)
        self.device = device
        self.cache_params = cache_params
        n, slots = self.num_mamba_layers, self.size + 1
        conv_dtype, ssm_dtype = cache_params.conv_dtype, cache_params.temporal_dtype
        conv = [torch.zeros((n, slots) + s, dtype=conv_dtype, device=device) for s in cache_params.conv_shapes]
        temporal = torch.zeros((n, slots) + cache_params.temporal_shape, dtype=ssm_dtype, device=device)
        if speculative_num_draft_tokens is None:
            self.mamba_cache: MambaState = MambaState(conv=conv, temporal=temporal)
        else:
            draft = _positive_int("speculative_num_draft_tokens", speculative_num_draft_tokens)
            spec_slots = _positive_int("spec_state_size", spec_state_size) + 1
            # [L, spec_state_size + 1, D, num_heads, head_dim, state_size]
            ssm = torch.zeros((n, spec_slots, draft) + cache_params.temporal_shape, dtype=ssm_dtype, device=device)
            # [L, spec_state_size + 1, D, conv_dim, conv_kernel - 1] per conv shape
            window = [
                torch.zeros((n, spec_slots, draft) + s, dtype=conv_dtype, device=device)
                for s in cache_params.conv_shapes
            ]
            self.mamba_cache = MambaSpeculativeState(
                conv=conv, temporal=temporal, intermediate_ssm=ssm, intermediate_conv_window=window
            )
        self.mem_usage = self.mamba_cache.mem_usage_bytes() / GB
        self.clear()
        logger.info(
            "Mamba cache allocated: %d slots, conv %.3f GB, ssm %.3f GB, total %.3f GB",
            self.size, tensor_bytes(conv) / GB, tensor_bytes(temporal) / GB, self.mem_usage,
        )

    # -- layers ----------------------------------------------------------------------
    def layer_idx(self, layer_id: int) -> int:
        """Local index (position in ``mamba_layer_ids``) of a global layer id, else KeyError."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id not in self.mamba_map:
            raise KeyError(
                f"layer {layer_id!r} is not a mamba layer of this pool (mamba layers {list(self.mamba_layer_ids)})"
            )
        return self.mamba_map[layer_id]

    def mamba2_layer_cache(self, layer_id: int) -> MambaState:
        """The state of mamba layer ``layer_id`` (a global layer id): views without layer axis."""
        return self.mamba_cache.at_layer_idx(self.layer_idx(layer_id))

    def get_speculative_mamba2_params_all_layers(self) -> MambaSpeculativeState:
        if not isinstance(self.mamba_cache, MambaSpeculativeState):
            raise ValueError("this MambaPool has no speculative buffers (built without speculative_num_draft_tokens)")
        return self.mamba_cache

    def _state_tensors(self) -> List[torch.Tensor]:
        """Exported state tensors in contract order: conv list, then temporal."""
        return [*self.mamba_cache.conv, self.mamba_cache.temporal]

    # -- slots -----------------------------------------------------------------------
    def _slots(self, name: str, idx, *, allow_padding: bool) -> torch.Tensor:
        """Host int64 1-D view of a slot index (int, list, 0-D or 1-D tensor), range-checked."""
        idx = torch.as_tensor(idx).reshape(-1)
        if idx.numel() == 0:  # [] arrives as float32
            idx = idx.to(torch.int64)
        idx = check_indices(name, idx, self.size + 1, device="cpu")
        if not allow_padding and bool((idx == 0).any()):
            raise ValueError(f"{name} must not contain the padding slot 0, got {idx.tolist()}")
        return idx

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` fresh slots (int64 on ``device``) with zeroed state, or None if exhausted."""
        if not isinstance(need_size, int) or isinstance(need_size, bool):
            raise TypeError(f"need_size must be an int, got {type(need_size).__name__}")
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size > self.available_size():
            return None
        select = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        self._in_use[select] = True
        select = select.to(self.device)
        for t in self._state_tensors():
            t[:, select] = 0
        return select

    def free(self, free_index) -> None:
        """Return slots to the pool. A slot that is not allocated (double free, padding slot,
        never handed out) raises ValueError and frees nothing."""
        idx = self._slots("free_index", free_index, allow_padding=False)
        if idx.numel() == 0:
            return
        if idx.unique().numel() != idx.numel():
            raise ValueError(f"free_index holds a slot twice: {idx.tolist()}")
        if not bool(self._in_use[idx].all()):
            bad = idx[~self._in_use[idx]].tolist()
            raise ValueError(f"double free or foreign slot: slots {bad} are not allocated")
        self._in_use[idx] = False
        self.free_slots = torch.cat((self.free_slots, idx))

    def clear(self) -> None:
        """Every slot free again (state is zeroed lazily, at alloc)."""
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._in_use = torch.zeros(self.size + 1, dtype=torch.bool)

    def copy_from(self, src_index, dst_index) -> None:
        """Copy conv and temporal state of slots ``src_index`` into ``dst_index`` (same length)."""
        src = self._slots("src_index", src_index, allow_padding=True)
        dst = self._slots("dst_index", dst_index, allow_padding=True)
        if src.numel() != dst.numel():
            raise ValueError(f"src_index and dst_index must have the same length, got {src.numel()} and {dst.numel()}")
        src, dst = src.to(self.device), dst.to(self.device)
        for t in self._state_tensors():
            t[:, dst] = t[:, src]

    def fork_from(self, src_index) -> Optional[torch.Tensor]:
        """A new slot holding a copy of slot ``src_index``'s state, or None if exhausted."""
        src = self._slots("src_index", src_index, allow_padding=True)
        if src.numel() != 1:
            raise ValueError(f"fork_from takes one source slot, got {src.tolist()}")
        dst = self.alloc(1)
        if dst is not None:
            self.copy_from(src, dst)
        return dst

    # -- host copies -----------------------------------------------------------------
    def get_cpu_copy(self, indices) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """``(conv_cpu, temporal_cpu)``: conv list ``[L, n, *conv_shape]``, temporal ``[L, n, ...]``."""
        idx = self._slots("indices", indices, allow_padding=True).to(self.device)
        conv = [t[:, idx].to("cpu") for t in self.mamba_cache.conv]
        return conv, self.mamba_cache.temporal[:, idx].to("cpu")

    def load_cpu_copy(self, mamba_cache_cpu, indices) -> None:
        """Write a :meth:`get_cpu_copy` result back into slots ``indices``."""
        idx = self._slots("indices", indices, allow_padding=True)
        if not isinstance(mamba_cache_cpu, (tuple, list)) or len(mamba_cache_cpu) != 2:
            raise TypeError("mamba_cache_cpu must be the (conv_list, temporal) pair get_cpu_copy returns")
        conv_cpu, temporal_cpu = mamba_cache_cpu
        if not isinstance(conv_cpu, (list, tuple)) or len(conv_cpu) != len(self.mamba_cache.conv):
            raise ValueError(f"mamba_cache_cpu conv must be a list of {len(self.mamba_cache.conv)} tensors")
        pairs = [(f"conv[{i}]", t, c) for i, (t, c) in enumerate(zip(self.mamba_cache.conv, conv_cpu))]
        pairs.append(("temporal", self.mamba_cache.temporal, temporal_cpu))
        for name, t, c in pairs:
            check_tensor(name, c, shape=(t.shape[0], idx.numel(), *t.shape[2:]), dtype=t.dtype)
        idx = idx.to(self.device)
        for _, t, c in pairs:
            t[:, idx] = c.to(t.device)

    # -- layout export ---------------------------------------------------------------
    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """(data_ptrs, data_lens, item_lens) per state tensor per layer, contract order (module
        docstring); item = one request slot. Speculative intermediates are excluded."""
        ptrs, lens, items = [], [], []
        for t in self._state_tensors():
            for layer in range(self.num_mamba_layers):
                ptrs.append(t[layer].data_ptr())
                lens.append(t[layer].nbytes)
                items.append(t[layer][0].nbytes)
        return ptrs, lens, items

    def get_state_dim_per_tensor(self) -> List[int]:
        """The TP-sliced dimension (shape[2]: conv_dim or num_heads) of each exported entry, in
        :meth:`get_contiguous_buf_infos` order (so both lists have the same length)."""
        return [t.shape[2] for t in self._state_tensors() for _ in range(self.num_mamba_layers)]

    def transfer_layout(self) -> TransferLayout:
        """State only: per conv tensor its ``conv_dim`` channels of ``(conv_kernel - 1)``
        elements (sub-blocks such as ``[x | B | C]`` are the model's to say), then the
        temporal state's ``num_heads`` heads; one page is one request slot."""
        params = self.cache_params
        tensors = [TensorLayout(f"conv{i}", i, ShardRule.GROUPS, dim, width * params.conv_dtype.itemsize,
                                model_sub_blocks=True) for i, (dim, width) in enumerate(params.conv_shapes)]
        heads, head_dim, state = params.temporal_shape
        tensors.append(TensorLayout("temporal", len(tensors), ShardRule.GROUPS, heads,
                                    head_dim * state * params.temporal_dtype.itemsize))
        return TransferLayout(state=StateLayout(StateKind.MAMBA, Export.CONTIGUOUS, self.mamba_layer_ids, 1,
                                                self.size + 1, tuple(t.units for t in tensors), tensors))
