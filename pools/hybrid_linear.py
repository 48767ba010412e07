"""HybridLinearKVPool: KV cache of a hybrid model whose layers are either full attention or
linear attention / Mamba.

The full-attention layers keep their KV in an inner pool (``full_kv_pool``), an
:class:`pools.mha.MHATokenToKVPool` or, with ``use_mla``, an :class:`pools.mla.MLATokenToKVPool`,
holding one buffer per full-attention layer in the order of ``full_attention_layer_ids``. The
linear layers keep per-request state in a :class:`pools.mamba.MambaPool` (``mamba_pool``).

Callers use global model layer ids; ``full_attention_layer_id_mapping`` maps full-attention layer
``full_attention_layer_ids[i]`` to inner layer ``i``; any other id is a ``KeyError`` naming the
full-attention ids.

Exports:
- ``get_contiguous_buf_infos`` = the inner pool's (MHA ``[K_0..K_{F-1}, V_0..V_{F-1}]``, MLA
  ``[KV_0..KV_{F-1}]``, ``F`` = number of full-attention layers, index ``i`` = inner layer ``i``);
- ``get_state_buf_infos`` = ``mamba_pool.get_contiguous_buf_infos()`` (conv tensors in list order
  then temporal, each per mamba layer; item = one request slot), and
  ``get_state_dim_per_tensor`` = ``mamba_pool.get_state_dim_per_tensor()``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from pools._checks import layer_id_of
from pools.describe import Export, TransferLayout
from pools.kv_cache import GB, KVCache, LayerDoneCounter
from pools.mamba import MambaPool
from pools.mha import MHATokenToKVPool
from pools.mla import MLATokenToKVPool

__all__ = ["HybridLinearKVPool"]


def _full_attention_ids(ids) -> Tuple[int, ...]:
    try:
        out = tuple(ids)
    except TypeError:
        raise TypeError(f"full_attention_layer_ids must be a sequence of ints, got {type(ids).__name__}") from None
    if not out or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in out):
        raise ValueError(f"full_attention_layer_ids must be a non-empty list of layer ids >= 0, got {list(out)!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"full_attention_layer_ids must be distinct, got {list(out)}")
    return out


class HybridLinearKVPool(KVCache):
    """Full-attention KV pool plus Mamba state pool behind global layer ids (module docstring).

    ``enable_kvcache_transpose`` must be False (no transposed pool here); ``enable_memory_saver``
    is passed to the inner pool, which ignores it. With ``use_mla``, ``kv_lora_rank`` and
    ``qk_rope_head_dim`` are required and ``head_num`` / ``head_dim`` are unused.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        page_size: int,
        head_num: int,
        head_dim: int,
        full_attention_layer_ids: Sequence[int],
        enable_kvcache_transpose: bool,
        device: str,
        mamba_pool: MambaPool,
        enable_memory_saver: bool = False,
        use_mla: bool = False,
        kv_lora_rank: Optional[int] = None,
        qk_rope_head_dim: Optional[int] = None,
        start_layer: Optional[int] = None,
    ):
        if enable_kvcache_transpose:
            raise ValueError("enable_kvcache_transpose=True is not supported (no transposed KV pool), got True")
        if not isinstance(mamba_pool, MambaPool):
            raise TypeError(f"mamba_pool must be a MambaPool, got {type(mamba_pool).__name__}")
        ids = _full_attention_ids(full_attention_layer_ids)
        shared = sorted(set(ids) & set(mamba_pool.mamba_layer_ids))
        if shared:
            raise ValueError(
                f"a layer is either full attention or mamba: full_attention_layer_ids {list(ids)} and "
                f"mamba layers {list(mamba_pool.mamba_layer_ids)} share {shared}"
            )
        self.size = size
        self.dtype = dtype
        self.device = device
        self.page_size = page_size
        self.start_layer = start_layer if start_layer is not None else 0
        self.layer_transfer_counter: Optional[LayerDoneCounter] = None
        self.head_num = head_num
        self.head_dim = head_dim
        self.mamba_pool = mamba_pool
        self.use_mla = use_mla
        self.full_layer_nums = len(ids)
        self.full_attention_layer_ids = ids
        self.full_attention_layer_id_mapping = {layer_id: i for i, layer_id in enumerate(ids)}
        if use_mla:
            if kv_lora_rank is None or qk_rope_head_dim is None:
                raise ValueError(
                    f"use_mla needs kv_lora_rank and qk_rope_head_dim, got {kv_lora_rank!r} and {qk_rope_head_dim!r}"
                )
            self.full_kv_pool: KVCache = MLATokenToKVPool(
                size=size, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
                qk_rope_head_dim=qk_rope_head_dim, layer_num=self.full_layer_nums, device=device,
                enable_memory_saver=enable_memory_saver,
            )
        else:
            self.full_kv_pool = MHATokenToKVPool(
                size=size, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
                layer_num=self.full_layer_nums, device=device, enable_memory_saver=enable_memory_saver,
            )
        self.store_dtype = self.full_kv_pool.store_dtype
        self.layer_num = self.full_layer_nums
        self.cpu_offloading_chunk_size = self.full_kv_pool.cpu_offloading_chunk_size
        kv_bytes = self.get_kv_size_bytes()
        self.mem_usage = (sum(kv_bytes) if isinstance(kv_bytes, tuple) else kv_bytes) / GB

    # -- sizes and exports ---------------------------------------------------------------
    def get_kv_size_bytes(self):
        """The inner pool's: ``(K bytes, V bytes)`` for MHA, KV bytes for MLA."""
        return self.full_kv_pool.get_kv_size_bytes()

    def get_contiguous_buf_infos(self) -> Tuple[list, list, list]:
        """The inner full-attention pool's export (module docstring)."""
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """The Mamba pool's export: per state tensor (conv list, then temporal), per layer."""
        return self.mamba_pool.get_contiguous_buf_infos()

    def get_state_dim_per_tensor(self) -> List[int]:
        """The TP-sliced dimension of each :meth:`get_state_buf_infos` entry."""
        return self.mamba_pool.get_state_dim_per_tensor()

    def transfer_layout(self) -> TransferLayout:
        """The inner pool's KV under the global full-attention layer ids, plus the Mamba pool's
        state (exported here by ``get_state_buf_infos``)."""
        kv = replace(self.full_kv_pool.transfer_layout().kv, layer_ids=self.full_attention_layer_ids)
        return TransferLayout(kv, replace(self.mamba_pool.transfer_layout().state, export=Export.STATE))

    def maybe_get_custom_mem_pool(self):
        return None  # custom memory pools are not supported here

    # -- layer ids -----------------------------------------------------------------------
    def _transfer_full_attention_id(self, layer_id: int) -> int:
        """Global full-attention layer id -> inner pool layer, else KeyError naming the known ids."""
        if isinstance(layer_id, bool) or layer_id not in self.full_attention_layer_id_mapping:
            raise KeyError(
                f"layer {layer_id!r} is not a full-attention layer of this pool "
                f"(full-attention layers {list(self.full_attention_layer_ids)})"
            )
        return self.full_attention_layer_id_mapping[layer_id]

    def register_layer_transfer_counter(self, layer_transfer_counter: LayerDoneCounter) -> None:
        """Waits happen here, with global layer ids (``layer_id - start_layer``); the inner pool
        gets no counter so it does not wait a second time."""
        super().register_layer_transfer_counter(layer_transfer_counter)
        self.full_kv_pool.register_layer_transfer_counter(None)

    def _inner(self, layer_id: int) -> int:
        """Map, then wait for the layer: the counter sees only full-attention layers."""
        inner = self._transfer_full_attention_id(layer_id)
        self._wait_for_layer(layer_id)
        return inner

    # -- getters -------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_key_buffer(self._inner(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_value_buffer(self._inner(layer_id))

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.full_kv_pool.get_kv_buffer(self._inner(layer_id))

    def get_v_head_dim(self) -> int:
        return self.full_kv_pool.get_value_buffer(self.full_kv_pool.start_layer).shape[-1]

    # -- setters (``layer``: an int or anything with ``layer_id``; it is never modified) ----
    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> None:
        inner = self._transfer_full_attention_id(layer_id_of(layer))
        if self.use_mla:
            self.full_kv_pool.set_kv_buffer(inner, loc, cache_k, cache_v)
        else:
            self.full_kv_pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=inner)

    def _require_mla(self, what: str) -> None:
        if not self.use_mla:
            raise ValueError(f"{what} needs an MLA pool (use_mla=True), got use_mla=False")

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        self._require_mla("set_mla_kv_buffer")
        inner = self._transfer_full_attention_id(layer_id_of(layer))
        self.full_kv_pool.set_mla_kv_buffer(inner, loc, cache_k_nope, cache_k_rope)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype: Optional[torch.dtype] = None):
        self._require_mla("get_mla_kv_buffer")
        return self.full_kv_pool.get_mla_kv_buffer(self._inner(layer_id_of(layer)), loc, dst_dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        move = getattr(self.full_kv_pool, "move_kv_cache", None)
        if move is None:
            raise NotImplementedError(f"{type(self.full_kv_pool).__name__} has no move_kv_cache")
        move(tgt_loc, src_loc)

    # -- CPU offload ---------------------------------------------------------------------
    def get_cpu_copy(self, indices, mamba_indices=None):
        """``(kv_cpu, mamba_cpu)``; ``mamba_cpu`` is None when ``mamba_indices`` is None."""
        kv_cpu = self.full_kv_pool.get_cpu_copy(indices)
        mamba_cpu = self.mamba_pool.get_cpu_copy(mamba_indices) if mamba_indices is not None else None
        return kv_cpu, mamba_cpu

    def load_cpu_copy(self, cache_cpu, indices, mamba_indices=None) -> None:
        """Inverse of :meth:`get_cpu_copy`; the Mamba part loads when both it and ``mamba_indices``
        are given."""
        if not isinstance(cache_cpu, (list, tuple)) or len(cache_cpu) != 2:
            raise ValueError("cache_cpu must be the (kv_cpu, mamba_cpu) pair get_cpu_copy returns")
        kv_cpu, mamba_cpu = cache_cpu
        self.full_kv_pool.load_cpu_copy(kv_cpu, indices)
        if mamba_cpu is not None and mamba_indices is not None:
            self.mamba_pool.load_cpu_copy(mamba_cpu, mamba_indices)
