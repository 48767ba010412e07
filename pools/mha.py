"""Multi-head-attention KV pools: ``MHATokenToKVPool``, ``NoOpMHATokenToKVPool``,
``MHATokenToKVPoolFP4``.

Layout (per layer ``l`` of the pool's layers, ``rows = size + page_size``; row/slot 0 is the
padding slot that dummy writes of padded tokens land in):

- MHA: ``k_buffer[l]`` ``[rows, head_num, head_dim]`` and ``v_buffer[l]``
  ``[rows, head_num, v_head_dim]`` of ``store_dtype`` (uint8 for FP8 dtypes, else ``dtype``).
- FP4: ``k_buffer[l]``/``v_buffer[l]`` ``[rows, head_num, head_dim // 2]`` uint8 (packed
  e2m1, see ``pools.fp4``), ``k_scale_buffer[l]``/``v_scale_buffer[l]``
  ``[rows, head_num * head_dim // 16]`` uint8 (UE8M0 block scales: exponent + 127).

Export order of ``get_contiguous_buf_infos`` (the planner's contract, ``item_len`` = one
page = ``page_size`` rows of that buffer):

- MHA / NoOp: ``[K_0..K_{L-1}, V_0..V_{L-1}]``
- FP4: ``[K_0..K_{L-1}, V_0..V_{L-1}, Kscale_0..Kscale_{L-1}, Vscale_0..Vscale_{L-1}]``

``data_ptrs`` / ``data_strides`` (device tensors, uint64 addresses and int64 row bytes) list
the same buffers in the same order; ``move_kv_cache`` copies rows of all of them in one
kernel launch (``pools.kv_copy``).
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Tuple

import torch

from pools import kv_copy
from pools._checks import check_indices, check_tensor, layer_id_of
from pools.fp4 import FP4_BLOCK, dequantize_fp4, quantize_fp4
from pools.describe import KVKind, ShardRule, TensorLayout, TransferLayout
from pools.kv_cache import KVCache, buf_infos, synchronize
from pools.kv_copy import MoveBackend

logger = logging.getLogger(__name__)

__all__ = ["MHATokenToKVPool", "NoOpMHATokenToKVPool", "MHATokenToKVPoolFP4"]

_FP4_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class MHATokenToKVPool(KVCache):
    """K and V per layer, ``[size + page_size, head_num, head_dim]`` (module docstring).

    ``swa_head_num`` / ``swa_head_dim`` / ``swa_v_head_dim`` override the head shape (the
    sliding-window half of a hybrid pool). ``enable_memory_saver`` and ``enable_alt_stream``
    are accepted and ignored (no memory saver here; K and V are written on the current
    stream). ``enable_kv_cache_copy`` compiles the Triton copy kernel at init on CUDA (the
    pointer tables are always built, so ``move_kv_cache`` works either way).

    Attributes callers may set: ``move_backend`` (a :class:`MoveBackend`, default AUTO:
    Triton on CUDA, torch elsewhere) and ``check_inputs`` (default True: ``set_kv_buffer``
    and ``move_kv_cache`` verify index ranges, which synchronises the device; shapes, dtypes
    and devices are always checked).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool = False,
        v_head_dim: Optional[int] = None,
        swa_head_num: Optional[int] = None,
        swa_head_dim: Optional[int] = None,
        swa_v_head_dim: Optional[int] = None,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        enable_alt_stream: bool = True,
        enable_kv_cache_copy: bool = False,
    ):
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        self.head_num = _positive_int("head_num", swa_head_num if swa_head_num is not None else head_num)
        self.head_dim = _positive_int("head_dim", swa_head_dim if swa_head_dim is not None else head_dim)
        if swa_v_head_dim is not None:
            v_dim = swa_v_head_dim
        else:
            v_dim = v_head_dim if v_head_dim is not None else head_dim
        self.v_head_dim = _positive_int("v_head_dim", v_dim)
        self._device = torch.device(device)
        self.move_backend = MoveBackend.AUTO
        self.check_inputs = True
        self.alt_stream = None

        self._create_buffers()
        self.kv_copy_table = kv_copy.build_copy_table(self._export_buffers())
        self.data_ptrs = self.kv_copy_table.data_ptrs  # [num_buffers] uint64, export order
        self.data_strides = self.kv_copy_table.data_strides  # [num_buffers] int64 row bytes
        self.k_data_ptrs = self.data_ptrs[: self.layer_num]
        self.v_data_ptrs = self.data_ptrs[self.layer_num : 2 * self.layer_num]
        if enable_kv_cache_copy:
            kv_copy.warmup(self.kv_copy_table)
        self._finalize_allocation_log(size)
        self.row_dim = self.head_num * self.head_dim
        self.same_kv_dim = self.head_dim == self.v_head_dim

    # -- buffers -------------------------------------------------------------------------
    def _rows(self) -> int:
        return self.size + self.page_size

    def _create_buffers(self) -> None:
        rows = self._rows()
        kw = dict(dtype=self.store_dtype, device=self._device)
        self.k_buffer = [torch.zeros((rows, self.head_num, self.head_dim), **kw) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros((rows, self.head_num, self.v_head_dim), **kw) for _ in range(self.layer_num)]

    def _clear_buffers(self) -> None:
        del self.k_buffer
        del self.v_buffer

    def _layer_groups(self) -> Tuple[List[torch.Tensor], ...]:
        """Per-layer buffer lists, in export order (one list per group)."""
        return (self.k_buffer, self.v_buffer)

    def _export_buffers(self) -> List[torch.Tensor]:
        return [b for group in self._layer_groups() for b in group]

    def get_kv_size_bytes(self) -> Tuple[int, int]:
        """(K bytes, V bytes) over all layers."""
        return self._bytes(self.k_buffer), self._bytes(self.v_buffer)

    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """(data_ptrs, data_lens, item_lens) in the order ``[K_0..K_{L-1}, V_0..V_{L-1}]``."""
        return buf_infos(self._export_buffers(), self.page_size)

    def transfer_layout(self) -> TransferLayout:
        """K and V rows are this rank's ``head_num`` heads (FP4 adds the scale rows, heads too)."""
        return TransferLayout(kv=self._kv_layout(self._transfer_kind, self._transfer_tensors(), self.head_dim,
                                                 self.v_head_dim, self._rows()))

    _transfer_kind = KVKind.MHA

    def _transfer_tensors(self) -> Tuple[TensorLayout, ...]:
        isz = self.store_dtype.itemsize
        return (TensorLayout("k", 0, ShardRule.HEADS, self.head_num, self.head_dim * isz),
                TensorLayout("v", 1, ShardRule.HEADS, self.head_num, self.v_head_dim * isz))

    def maybe_get_custom_mem_pool(self):
        return None  # custom memory pools are not supported here

    # -- getters ---------------------------------------------------------------------------
    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        buf = self.k_buffer[self._local_layer(layer_id)]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def _get_value_buffer(self, layer_id: int) -> torch.Tensor:
        buf = self.v_buffer[self._local_layer(layer_id)]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """``[rows, head_num, head_dim]`` of ``dtype``, after the layer counter says it is ready."""
        self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self._get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """``[rows, head_num, v_head_dim]`` of ``dtype``, after the layer counter says it is ready."""
        self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self._get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    # -- writes ----------------------------------------------------------------------------
    def _check_set_args(self, loc, cache_k, cache_v) -> torch.Tensor:
        """Validate a set_kv_buffer call; returns ``loc`` as int64 on the pool's device."""
        if not isinstance(loc, torch.Tensor):
            raise TypeError(f"loc must be a torch.Tensor, got {type(loc).__name__}")
        if self.check_inputs:
            loc = check_indices("loc", loc, self._rows(), device=self._device)
        elif loc.dim() != 1:
            raise ValueError(f"loc must be 1-D, got shape {list(loc.shape)}")
        n = loc.shape[0]
        check_tensor("cache_k", cache_k, shape=[n, self.head_num, self.head_dim], device=self._device)
        check_tensor("cache_v", cache_v, shape=[n, self.head_num, self.v_head_dim], device=self._device)
        for name, t in (("cache_k", cache_k), ("cache_v", cache_v)):
            if not t.is_floating_point():
                raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
        return loc

    def _layer_of(self, layer, layer_id_override: Optional[int]) -> int:
        layer_id = layer_id_override if layer_id_override is not None else layer_id_of(layer)
        return self._local_layer(layer_id)

    def _to_store(self, cache: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
        """Cast to ``dtype`` (dividing by ``scale`` first, without touching the caller's
        tensor) and reinterpret as ``store_dtype``."""
        if cache.dtype != self.dtype:
            if scale is not None:
                cache = cache / scale
            cache = cache.to(self.dtype)
        return cache.view(self.store_dtype) if self.store_dtype != self.dtype else cache

    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write ``cache_k`` ``[n, head_num, head_dim]`` / ``cache_v`` ``[n, head_num,
        v_head_dim]`` (any float dtype; cast to ``dtype`` after dividing by ``k_scale`` /
        ``v_scale`` when a cast is needed) into slots ``loc`` ``[n]`` of ``layer``'s buffers."""
        local = self._layer_of(layer, layer_id_override)
        loc = self._check_set_args(loc, cache_k, cache_v)
        for group, rows in zip(self._layer_groups(), self._encode(cache_k, cache_v, k_scale, v_scale)):
            group[local][loc] = rows

    def _encode(self, cache_k, cache_v, k_scale, v_scale) -> Tuple[torch.Tensor, ...]:
        """Rows to store, one tensor per buffer group (``_layer_groups`` order)."""
        return self._to_store(cache_k, k_scale), self._to_store(cache_v, v_scale)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor, backend: Optional[MoveBackend] = None):
        """Rows ``tgt_loc <- src_loc`` in every exported buffer (all layers, K and V and, for
        FP4, the scales). ``backend`` overrides ``self.move_backend``; ``MoveBackend.TRITON``
        forces the kernel (on CPU it needs ``TRITON_INTERPRET=1``). See ``pools.kv_copy`` for
        the overlap contract of the kernel."""
        kv_copy.move_kv_cache(
            self.kv_copy_table, tgt_loc, src_loc, backend or self.move_backend, check=self.check_inputs
        )

    # -- host offload ----------------------------------------------------------------------
    def get_cpu_copy(self, indices, mamba_indices=None) -> List[List[List[torch.Tensor]]]:
        """Host copy of slots ``indices``: ``out[layer][chunk]`` = one CPU tensor per buffer
        group (``[k, v]``; FP4: ``[k, v, k_scale, v_scale]``), chunks of
        ``cpu_offloading_chunk_size`` slots."""
        idx = check_indices("indices", indices, self._rows(), device=self._device)
        groups = self._layer_groups()
        chunk = self.cpu_offloading_chunk_size
        synchronize(self._device)
        out = []
        for layer in range(self.layer_num):
            out.append(
                [
                    [g[layer][idx[i : i + chunk]].to("cpu", non_blocking=True) for g in groups]
                    for i in range(0, idx.numel(), chunk)
                ]
            )
        synchronize(self._device)
        return out

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None) -> None:
        """Inverse of :meth:`get_cpu_copy` for the same ``indices``."""
        idx = check_indices("indices", indices, self._rows(), device=self._device)
        groups = self._layer_groups()
        chunk = self.cpu_offloading_chunk_size
        num_chunks = math.ceil(idx.numel() / chunk)
        if not isinstance(kv_cache_cpu, (list, tuple)) or len(kv_cache_cpu) != self.layer_num:
            got = len(kv_cache_cpu) if isinstance(kv_cache_cpu, (list, tuple)) else type(kv_cache_cpu).__name__
            raise ValueError(f"kv_cache_cpu must be a list of {self.layer_num} layers, got {got}")
        for layer, chunks in enumerate(kv_cache_cpu):
            if len(chunks) != num_chunks:
                raise ValueError(f"kv_cache_cpu[{layer}] must hold {num_chunks} chunks, got {len(chunks)}")
            for c, parts in enumerate(chunks):
                if len(parts) != len(groups):
                    raise ValueError(f"kv_cache_cpu[{layer}][{c}] must hold {len(groups)} tensors, got {len(parts)}")
                n = min(chunk, idx.numel() - c * chunk)
                for g, part in zip(groups, parts):
                    check_tensor(
                        f"kv_cache_cpu[{layer}][{c}]", part, shape=[n, *g[layer].shape[1:]], dtype=g[layer].dtype
                    )
        synchronize(self._device)
        for layer, chunks in enumerate(kv_cache_cpu):
            for c, parts in enumerate(chunks):
                sel = idx[c * chunk : (c + 1) * chunk]
                for g, part in zip(groups, parts):
                    g[layer][sel] = part.to(self._device, non_blocking=True)
        synchronize(self._device)


class NoOpMHATokenToKVPool(MHATokenToKVPool):
    """A pool that reserves no KV memory (prefill-only workloads whose attention never
    touches the cache).

    ``size`` still counts for admission, but each layer holds only a ``[page_size, head_num,
    head_dim]`` placeholder for K and V (so ``view(-1, page_size, ...)`` on a buffer works).
    As in the seed: getters return the placeholders (without waiting on a layer counter),
    ``set_kv_buffer`` raises ``RuntimeError`` (misuse stays visible), ``move_kv_cache`` does
    nothing, ``get_kv_size_bytes`` is ``(0, 0)``, and ``get_contiguous_buf_infos`` exports
    the placeholders in the MHA order (one page each).
    """

    def _rows(self) -> int:
        return self.page_size

    def _finalize_allocation_log(self, num_tokens: int) -> None:
        self.mem_usage = 0.0
        logger.info(
            "KV cache skipped (no-op pool): %d logical tokens, %d placeholder bytes",
            num_tokens,
            self._bytes(self._export_buffers()),
        )

    def get_kv_size_bytes(self) -> Tuple[int, int]:
        return 0, 0

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise RuntimeError(
            "NoOpMHATokenToKVPool.set_kv_buffer was called: this pool holds no KV cache and is "
            "only valid for workloads whose attention never writes the cache"
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[self._local_layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[self._local_layer(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor, backend: Optional[MoveBackend] = None):
        return None


class MHATokenToKVPoolFP4(MHATokenToKVPool):
    """FP4 KV: packed e2m1 K/V plus block-16 UE8M0 scales, SGLang's format (module docstring).

    ``dtype`` names the cache type (e.g. ``torch.float4_e2m1fn_x2``); storage is always
    uint8. ``head_dim`` must be a multiple of 16 (so each head's values are whole bytes of
    the packed row and whole entries of the scale row) and V uses ``head_dim`` too.
    ``set_kv_buffer`` quantizes fp32/bf16/fp16 input with ``pools.fp4.quantize_fp4``; the
    getters return freshly dequantized ``[rows, head_num, head_dim]`` tensors of
    ``dequant_dtype`` (bf16 by default; copies, not views), and
    ``get_fp4_key_buffer`` / ``get_fp4_value_buffer`` return the raw (packed, scales).
    ``get_kv_size_bytes`` counts the scale buffers with K and V respectively; CPU copies
    carry ``[k, v, k_scale, v_scale]`` per chunk. ``get_contiguous_buf_infos`` order:
    ``[K_0..K_{L-1}, V_0..V_{L-1}, Kscale_0..Kscale_{L-1}, Vscale_0..Vscale_{L-1}]``.
    """

    def __init__(self, *args, **kwargs):
        self.dequant_dtype = torch.bfloat16
        super().__init__(*args, **kwargs)

    def _create_buffers(self) -> None:
        if self.head_dim % FP4_BLOCK != 0:
            raise ValueError(f"FP4 pools need head_dim a multiple of {FP4_BLOCK}, got {self.head_dim}")
        if self.v_head_dim != self.head_dim:
            raise ValueError(f"FP4 pools need v_head_dim == head_dim={self.head_dim}, got {self.v_head_dim}")
        self.store_dtype = torch.uint8
        rows, n, d = self._rows(), self.head_num, self.head_dim
        kw = dict(dtype=torch.uint8, device=self._device)
        self.k_buffer = [torch.zeros((rows, n, d // 2), **kw) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros((rows, n, d // 2), **kw) for _ in range(self.layer_num)]
        self.k_scale_buffer = [torch.zeros((rows, n * d // FP4_BLOCK), **kw) for _ in range(self.layer_num)]
        self.v_scale_buffer = [torch.zeros((rows, n * d // FP4_BLOCK), **kw) for _ in range(self.layer_num)]

    def _clear_buffers(self) -> None:
        super()._clear_buffers()
        del self.k_scale_buffer
        del self.v_scale_buffer

    def _layer_groups(self) -> Tuple[List[torch.Tensor], ...]:
        return (self.k_buffer, self.v_buffer, self.k_scale_buffer, self.v_scale_buffer)

    _transfer_kind = KVKind.MHA_FP4

    def _transfer_tensors(self) -> Tuple[TensorLayout, ...]:
        packed, scales = self.head_dim // 2, self.head_dim // FP4_BLOCK  # bytes per head
        per_head = (("k", packed), ("v", packed), ("k_scale", scales), ("v_scale", scales))
        return tuple(TensorLayout(name, i, ShardRule.HEADS, self.head_num, n) for i, (name, n) in enumerate(per_head))

    def get_kv_size_bytes(self) -> Tuple[int, int]:
        """(K + K-scale bytes, V + V-scale bytes) over all layers."""
        return (
            self._bytes(self.k_buffer) + self._bytes(self.k_scale_buffer),
            self._bytes(self.v_buffer) + self._bytes(self.v_scale_buffer),
        )

    def _dequant(self, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows = packed.shape[0]
        flat = packed.view(rows, self.head_num * self.head_dim // 2)  # [rows, head_num * head_dim / 2]
        out = dequantize_fp4(flat, scales, self.dequant_dtype)  # [rows, head_num * head_dim]
        return out.view(rows, self.head_num, self.head_dim)  # [rows, head_num, head_dim]

    def _get_key_buffer(self, layer_id: int) -> torch.Tensor:
        local = self._local_layer(layer_id)
        return self._dequant(self.k_buffer[local], self.k_scale_buffer[local])

    def _get_value_buffer(self, layer_id: int) -> torch.Tensor:
        local = self._local_layer(layer_id)
        return self._dequant(self.v_buffer[local], self.v_scale_buffer[local])

    def get_fp4_key_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Raw ``(packed [rows, head_num, head_dim // 2], scales [rows, head_num * head_dim // 16])``."""
        local = self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self.k_buffer[local], self.k_scale_buffer[local]

    def get_fp4_value_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Raw ``(packed [rows, head_num, head_dim // 2], scales [rows, head_num * head_dim // 16])``."""
        local = self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self.v_buffer[local], self.v_scale_buffer[local]

    def _quantize(self, name: str, cache: torch.Tensor, scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
        if cache.dtype not in _FP4_INPUT_DTYPES:
            raise TypeError(f"{name} must have dtype float32, bfloat16 or float16 to be quantized to FP4, got {cache.dtype}")
        if scale is not None:
            cache = cache / scale
        n = cache.shape[0]
        packed, scales = quantize_fp4(cache.reshape(n, self.head_num * self.head_dim))
        return packed.view(n, self.head_num, self.head_dim // 2), scales  # [n, head_num, head_dim/2], [n, *]

    def _encode(self, cache_k, cache_v, k_scale, v_scale) -> Tuple[torch.Tensor, ...]:
        """Quantize ``cache_k`` / ``cache_v`` ``[n, head_num, head_dim]`` (fp32/bf16/fp16,
        divided by ``k_scale`` / ``v_scale`` first when given): (K, V, K scales, V scales)."""
        k_packed, k_scales = self._quantize("cache_k", cache_k, k_scale)
        v_packed, v_scales = self._quantize("cache_v", cache_v, v_scale)
        return k_packed, v_packed, k_scales, v_scales
