"""The KV-cache base class every token-to-KV pool derives from."""

from __future__ import annotations

import abc
import logging
from typing import Optional, Sequence, Tuple

import torch

from pools._checks import tensor_bytes
from pools.describe import Export, KVKind, KVLayout, TransferLayout, dtype_name

logger = logging.getLogger(__name__)

GB = 1 << 30

FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


def buf_infos(buffers: Sequence[torch.Tensor], page_size: int) -> Tuple[list, list, list]:
    """(data_ptrs, data_lens, item_lens) of per-slot buffers; an item is ``page_size`` rows."""
    return (
        [b.data_ptr() for b in buffers],
        [b.nbytes for b in buffers],
        [b[0].nbytes * page_size for b in buffers],
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class LayerDoneCounter(abc.ABC):
    """What ``register_layer_transfer_counter`` takes: ``wait_until(layer_id)`` blocks until
    that layer's data is in the pool (decode uses it to start attention before all layers
    have arrived). Any object with a ``wait_until(int)`` method will do."""

    @abc.abstractmethod
    def wait_until(self, layer_id: int) -> None: ...


class KVCache(abc.ABC):
    """Base of the token-to-KV pools.

    ``size`` token slots plus ``page_size`` padding rows; slot 0 is the padding slot dummy
    writes land in. FP8 dtypes are stored as uint8 (``store_dtype``) because index_put is not
    implemented for them. ``start_layer``/``end_layer`` (inclusive) let a pipeline stage hold
    a contiguous range of the model's layers; layer ids passed to the getters are global.
    """

    @abc.abstractmethod
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str,
        enable_memory_saver: bool = False,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
    ):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(layer_num, int) or layer_num <= 0:
            raise ValueError(f"layer_num must be a positive int, got {layer_num!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        self.layer_num = layer_num
        self.start_layer = start_layer or 0
        self.end_layer = end_layer if end_layer is not None else self.start_layer + layer_num - 1
        if self.end_layer - self.start_layer + 1 != layer_num:
            raise ValueError(
                f"start_layer..end_layer must span layer_num={layer_num} layers, "
                f"got {self.start_layer}..{self.end_layer}"
            )
        self.mem_usage = 0.0
        self.cpu_offloading_chunk_size = 8192
        self.layer_transfer_counter: Optional[LayerDoneCounter] = None

    # -- layer ids -------------------------------------------------------------------
    def _local_layer(self, layer_id: int) -> int:
        """Global layer id -> index into this pool's per-layer buffers (KeyError if absent)."""
        if not isinstance(layer_id, int) or not self.start_layer <= layer_id <= self.end_layer:
            raise KeyError(
                f"layer {layer_id!r} is not held by this pool (layers {self.start_layer}..{self.end_layer})"
            )
        return layer_id - self.start_layer

    def _wait_for_layer(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)

    def _finalize_allocation_log(self, num_tokens: int) -> None:
        size = self.get_kv_size_bytes()
        if isinstance(size, tuple):
            k, v = size
            logger.info("KV cache allocated: %d tokens, K %.2f GB, V %.2f GB", num_tokens, k / GB, v / GB)
            self.mem_usage = (k + v) / GB
        else:
            logger.info("KV cache allocated: %d tokens, KV %.2f GB", num_tokens, size / GB)
            self.mem_usage = size / GB

    @staticmethod
    def _bytes(t) -> int:
        return tensor_bytes(t)

    # -- the interface ---------------------------------------------------------------
    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def get_kv_size_bytes(self): ...

    @abc.abstractmethod
    def get_contiguous_buf_infos(self) -> Tuple[list, list, list]:
        """(data_ptrs, data_lens, item_lens): one entry per per-layer buffer; item = one page."""

    def transfer_layout(self) -> TransferLayout:
        """What the exported buffers hold, as plain data (``pools.describe``): the input of
        transfer planning. Every pool that exports buffers for transfer defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its transfer layout")

    def _kv_layout(self, kind: KVKind, tensors, head_dim: int, v_head_dim: int, num_slots: int) -> KVLayout:
        """This pool's :class:`KVLayout` (layers ``start_layer..end_layer``, exported by
        ``get_contiguous_buf_infos``)."""
        return KVLayout(kind, Export.CONTIGUOUS, tuple(range(self.start_layer, self.start_layer + self.layer_num)),
                        self.page_size, num_slots, dtype_name(self.dtype), head_dim, v_head_dim, tuple(tensors))

    def register_layer_transfer_counter(self, layer_transfer_counter: Optional[LayerDoneCounter]) -> None:
        """Register (or, with None, remove) the counter the getters wait on."""
        if layer_transfer_counter is not None and not callable(getattr(layer_transfer_counter, "wait_until", None)):
            raise TypeError("layer_transfer_counter must have a wait_until(layer_id) method or be None")
        self.layer_transfer_counter = layer_transfer_counter

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError(f"{type(self).__name__} has no CPU copy")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError(f"{type(self).__name__} has no CPU copy")
