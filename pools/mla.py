"""MLA token-to-KV pools: one compressed latent row per token (DeepSeek-style attention).

Layout (one buffer per layer, ``L = layer_num``)::

    kv_buffer[l]   # [size + page_size, 1, kv_cache_dim] of store_dtype
                   # kv_cache_dim = kv_lora_rank + qk_rope_head_dim
                   # row = [kv_lora_rank "nope" | qk_rope_head_dim "rope"]

Slot 0 (page 0) is the padding slot that dummy writes land in. FP8 dtypes are stored as uint8.
The "key" is the whole row; the "value" is a view of its nope part.

Export order (``get_contiguous_buf_infos``): ``[KV_0 .. KV_{L-1}]``, ``item_len`` = row bytes *
page_size.

:class:`MLATokenToKVPoolFP4` stores the row as packed e2m1 (``pools.fp4``) plus one UE8M0 scale
byte per 16 elements::

    kv_buffer[l]        # [size + page_size, 1, kv_cache_dim // 2] uint8
    kv_scale_buffer[l]  # [size + page_size, kv_cache_dim // 16] uint8

and exports ``[KV_0 .. KV_{L-1}, KVscale_0 .. KVscale_{L-1}]``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from pools._checks import check_indices, check_tensor, layer_id_of, tensor_bytes
from pools.fp4 import FP4_BLOCK, dequantize_fp4, quantize_fp4
from pools.describe import KVKind, ShardRule, TensorLayout, TransferLayout
from pools.kv_cache import KVCache, buf_infos, synchronize

__all__ = ["MLATokenToKVPool", "MLATokenToKVPoolFP4"]


# -- helpers shared by the MLA family (NSA imports them too) -----------------------------
def rows_of(name: str, t, n: int, width: int, device: torch.device) -> torch.Tensor:
    """Check a per-token input of ``[n, 1, width]`` (or ``[n, width]``); return ``[n, 1, width]``."""
    check_tensor(name, t, device=device)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() == 2:
        check_tensor(name, t, shape=(n, width))
        return t.unsqueeze(1)  # [n, 1, width]
    check_tensor(name, t, shape=(n, 1, width))
    return t


def gather_chunks(buffers: Sequence[torch.Tensor], idx: torch.Tensor, chunk: int) -> List[List[torch.Tensor]]:
    """``out[b][c]`` = rows ``idx[c*chunk:(c+1)*chunk]`` of ``buffers[b]``, copied to the CPU."""
    out: List[List[torch.Tensor]] = []
    for buf in buffers:
        synchronize(buf.device)
        out.append([buf[idx[i : i + chunk]].to("cpu", non_blocking=True) for i in range(0, len(idx), chunk)])
        synchronize(buf.device)
    return out


def check_chunks(
    name: str, buffers: Sequence[torch.Tensor], cpu, idx: torch.Tensor, chunk: int, label=None
) -> None:
    """Check that ``cpu[b][c]`` matches what :func:`gather_chunks` makes for ``buffers``/``idx``.
    ``label(b, c)`` names a chunk in messages (default ``name[b][c]``)."""
    label = label or (lambda b, c: f"{name}[{b}][{c}]")
    if not isinstance(cpu, (list, tuple)) or len(cpu) != len(buffers):
        got = len(cpu) if isinstance(cpu, (list, tuple)) else type(cpu).__name__
        raise ValueError(f"{name} must be a list of {len(buffers)} per-buffer chunk lists, got {got}")
    starts = range(0, len(idx), chunk)
    for b, (buf, chunks) in enumerate(zip(buffers, cpu)):
        if not isinstance(chunks, (list, tuple)) or len(chunks) != len(starts):
            got = len(chunks) if isinstance(chunks, (list, tuple)) else type(chunks).__name__
            raise ValueError(f"{name}[{b}] must hold {len(starts)} chunks, got {got}")
        for c, start in enumerate(starts):
            n = len(idx[start : start + chunk])
            check_tensor(label(b, c), chunks[c], shape=(n, *buf.shape[1:]), dtype=buf.dtype)


def scatter_chunks(buffers: Sequence[torch.Tensor], cpu, idx: torch.Tensor, chunk: int) -> None:
    """Inverse of :func:`gather_chunks` (check the input with :func:`check_chunks` first)."""
    for buf, chunks in zip(buffers, cpu):
        synchronize(buf.device)
        for c, start in enumerate(range(0, len(idx), chunk)):
            buf[idx[start : start + chunk]] = chunks[c].to(buf.device, non_blocking=True)
        synchronize(buf.device)


class MLATokenToKVPool(KVCache):
    """Token-to-KV pool of MLA latents (see the module docstring for the layout).

    ``enable_memory_saver`` is accepted for signature compatibility and ignored. ``use_nsa`` /
    ``override_kv_cache_dim`` are set by :class:`pools.nsa.NSATokenToKVPool`: with an FP8 e4m3
    dtype and an override, rows hold the packed FP8 NSA format of that width instead of
    ``kv_lora_rank + qk_rope_head_dim`` elements.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool = False,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        use_nsa: bool = False,
        override_kv_cache_dim: Optional[int] = None,
    ):
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        for name, v in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if override_kv_cache_dim is not None and (
            not isinstance(override_kv_cache_dim, int) or override_kv_cache_dim <= 0
        ):
            raise ValueError(f"override_kv_cache_dim must be a positive int or None, got {override_kv_cache_dim!r}")
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.use_nsa = use_nsa
        self.nsa_kv_cache_store_fp8 = bool(
            use_nsa and dtype == torch.float8_e4m3fn and override_kv_cache_dim is not None
        )
        self.kv_cache_dim = (
            override_kv_cache_dim if self.nsa_kv_cache_store_fp8 else kv_lora_rank + qk_rope_head_dim
        )
        self._create_buffers()
        self.data_ptrs = torch.tensor(
            [x.data_ptr() for x in self.kv_buffer], dtype=torch.uint64, device=self.device
        )
        if not use_nsa:  # NSA logs once its index buffers exist
            self._finalize_allocation_log(size)

    def _create_buffers(self) -> None:
        # [size + page_size, 1, kv_cache_dim] per layer; slot 0 is the padding slot.
        self.kv_buffer = [
            torch.zeros((self.size + self.page_size, 1, self.kv_cache_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]

    @property
    def _buf_device(self) -> torch.device:
        return self.kv_buffer[0].device

    def _check_loc(self, loc) -> torch.Tensor:
        return check_indices("loc", loc, self.size + self.page_size, device=self._buf_device)

    def _to_store(self, t: torch.Tensor) -> torch.Tensor:
        """Cast to the cache dtype, then reinterpret as the storage dtype (FP8 -> uint8)."""
        t = t.to(self.dtype)
        return t.view(self.store_dtype) if self.store_dtype != self.dtype else t

    def _from_store(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.dtype) if self.store_dtype != self.dtype else t

    # -- sizes and exports ---------------------------------------------------------------
    def get_kv_size_bytes(self) -> int:
        return tensor_bytes(self.kv_buffer)

    def get_contiguous_buf_infos(self) -> Tuple[list, list, list]:
        """``[KV_0 .. KV_{L-1}]``; item_len = one page of rows."""
        return buf_infos(self.kv_buffer, self.page_size)

    def transfer_layout(self) -> TransferLayout:
        """One latent row per token, the same on every TP rank."""
        return TransferLayout(kv=self._kv_layout(self._transfer_kind, self._transfer_tensors(), self.kv_cache_dim,
                                                 self.kv_cache_dim, self.size + self.page_size))

    _transfer_kind = KVKind.MLA

    def _transfer_tensors(self) -> Tuple[TensorLayout, ...]:
        return (TensorLayout("kv", 0, ShardRule.REPLICATED, 1, self.kv_cache_dim * self.store_dtype.itemsize),)

    # -- getters (wait for the layer first) ----------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The whole latent buffer of a layer, ``[size + page_size, 1, kv_cache_dim]`` of dtype."""
        i = self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self._from_store(self.kv_buffer[i])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The nope part, a view ``[size + page_size, 1, kv_lora_rank]`` of the key buffer."""
        i = self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self._from_store(self.kv_buffer[i][..., : self.kv_lora_rank])

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    # -- setters -------------------------------------------------------------------------
    def _check_plain_rows(self, what: str) -> None:
        if self.nsa_kv_cache_store_fp8:
            raise ValueError(
                f"{what} writes plain rows; this pool stores the packed FP8 NSA format "
                f"(kv_cache_dim={self.kv_cache_dim}): use set_mla_kv_buffer"
            )

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor] = None) -> None:
        """Write whole rows: ``cache_k`` ``[n, 1, kv_cache_dim]`` (``cache_v`` is ignored, as in MLA
        the value is part of the key row)."""
        self._check_plain_rows("set_kv_buffer")
        i = self._local_layer(layer_id_of(layer))
        loc = self._check_loc(loc)
        cache_k = rows_of("cache_k", cache_k, len(loc), self.kv_cache_dim, self._buf_device)
        self.kv_buffer[i][loc] = self._to_store(cache_k)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """Pack ``[n, 1, kv_lora_rank]`` nope and ``[n, 1, qk_rope_head_dim]`` rope into rows ``loc``."""
        self._check_plain_rows("set_mla_kv_buffer")
        i = self._local_layer(layer_id_of(layer))
        loc = self._check_loc(loc)
        nope = rows_of("cache_k_nope", cache_k_nope, len(loc), self.kv_lora_rank, self._buf_device)
        rope = rows_of("cache_k_rope", cache_k_rope, len(loc), self.qk_rope_head_dim, self._buf_device)
        buf = self.kv_buffer[i]
        buf[loc, :, : self.kv_lora_rank] = self._to_store(nope)
        buf[loc, :, self.kv_lora_rank :] = self._to_store(rope)

    def get_mla_kv_buffer(
        self, layer, loc, dst_dtype: Optional[torch.dtype] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Unpack rows ``loc`` into (nope ``[n, 1, kv_lora_rank]``, rope ``[n, 1, qk_rope_head_dim]``),
        cast to ``dst_dtype`` (default: the pool dtype)."""
        self._check_plain_rows("get_mla_kv_buffer")
        layer_id = layer_id_of(layer)
        rows = self.get_key_buffer(layer_id)[self._check_loc(loc)]  # [n, 1, kv_cache_dim]
        dst_dtype = dst_dtype or self.dtype
        nope = rows[..., : self.kv_lora_rank].to(dst_dtype).contiguous()
        rope = rows[..., self.kv_lora_rank :].to(dst_dtype).contiguous()
        return nope, rope

    # -- CPU offload ---------------------------------------------------------------------
    def _cpu_buffers(self) -> List[List[torch.Tensor]]:
        """Per layer, the buffers a CPU copy holds (in this order)."""
        return [[b] for b in self.kv_buffer]

    def get_cpu_copy(self, indices, mamba_indices=None):
        """``out[layer][chunk]``: rows ``indices`` in chunks of ``cpu_offloading_chunk_size``. A chunk
        is one tensor ``[n, 1, kv_cache_dim]``, or for pools with several buffers per layer (FP4) a
        list of one tensor per buffer."""
        idx = self._check_loc(indices)
        out = []
        for bufs in self._cpu_buffers():
            per_buf = gather_chunks(bufs, idx, self.cpu_offloading_chunk_size)  # [buffer][chunk]
            out.append(per_buf[0] if len(bufs) == 1 else [list(c) for c in zip(*per_buf)])
        return out

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None) -> None:
        """Write a :meth:`get_cpu_copy` result back to rows ``indices``; a malformed copy raises
        before anything is written."""
        idx = self._check_loc(indices)
        chunk = self.cpu_offloading_chunk_size
        layers = self._cpu_buffers()
        if not isinstance(kv_cache_cpu, (list, tuple)) or len(kv_cache_cpu) != len(layers):
            got = len(kv_cache_cpu) if isinstance(kv_cache_cpu, (list, tuple)) else type(kv_cache_cpu).__name__
            raise ValueError(f"kv_cache_cpu must hold {len(layers)} layers, got {got}")
        if len(layers[0]) == 1:  # kv_cache_cpu[layer][chunk]: one tensor
            buffers = [bufs[0] for bufs in layers]
            check_chunks("kv_cache_cpu", buffers, kv_cache_cpu, idx, chunk)
            scatter_chunks(buffers, kv_cache_cpu, idx, chunk)
            return
        per_layer = []  # kv_cache_cpu[layer][chunk][buffer] -> [layer][buffer][chunk]
        for l, (bufs, chunks) in enumerate(zip(layers, kv_cache_cpu)):
            if not isinstance(chunks, (list, tuple)) or not all(
                isinstance(c, (list, tuple)) and len(c) == len(bufs) for c in chunks
            ):
                raise ValueError(f"kv_cache_cpu[{l}] must be a list of chunks, each a list of {len(bufs)} tensors")
            per_layer.append([[c[b] for c in chunks] for b in range(len(bufs))])
        for l, (bufs, cpu) in enumerate(zip(layers, per_layer)):
            check_chunks(f"kv_cache_cpu[{l}]", bufs, cpu, idx, chunk, lambda b, c, l=l: f"kv_cache_cpu[{l}][{c}][{b}]")
        for bufs, cpu in zip(layers, per_layer):
            scatter_chunks(bufs, cpu, idx, chunk)


class MLATokenToKVPoolFP4(MLATokenToKVPool):
    """MLA pool whose rows are stored as FP4 (e2m1, 16-element blocks with UE8M0 scales, see
    ``pools.fp4``); the constructor is :class:`MLATokenToKVPool`'s (``dtype`` names the cache
    format, conventionally ``torch.float4_e2m1fn_x2``; storage is always uint8).

    Layout per layer::

        kv_buffer[l]        # [size + page_size, 1, kv_cache_dim // 2] uint8, element 2i low nibble
        kv_scale_buffer[l]  # [size + page_size, kv_cache_dim // 16] uint8 (UE8M0: exponent + 127)

    ``kv_lora_rank`` must be a multiple of 16 (so the nope part is whole blocks: its bytes are
    ``[: kv_lora_rank // 2]`` of the packed row and ``[: kv_lora_rank // 16]`` of the scale row)
    and ``kv_cache_dim`` a multiple of 32. Writes take float tensors and quantize them; reads
    dequantize to ``dequant_dtype`` (bfloat16). Export order:
    ``[KV_0 .. KV_{L-1}, KVscale_0 .. KVscale_{L-1}]``.
    """

    dequant_dtype = torch.bfloat16

    def _create_buffers(self) -> None:
        if self.nsa_kv_cache_store_fp8:
            raise ValueError("MLATokenToKVPoolFP4 cannot hold the packed FP8 NSA format (override_kv_cache_dim)")
        if self.kv_lora_rank % FP4_BLOCK or self.kv_cache_dim % (2 * FP4_BLOCK):
            raise ValueError(
                f"FP4 MLA needs kv_lora_rank % {FP4_BLOCK} == 0 and kv_lora_rank + qk_rope_head_dim "
                f"% {2 * FP4_BLOCK} == 0, got kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        self.store_dtype = torch.uint8
        m = self.size + self.page_size  # slot 0 is the padding slot
        self.kv_buffer = [
            torch.zeros((m, 1, self.kv_cache_dim // 2), dtype=torch.uint8, device=self.device)
            for _ in range(self.layer_num)
        ]
        self.kv_scale_buffer = [
            torch.zeros((m, self.kv_cache_dim // FP4_BLOCK), dtype=torch.uint8, device=self.device)
            for _ in range(self.layer_num)
        ]

    def get_kv_size_bytes(self) -> int:
        return tensor_bytes(self.kv_buffer) + tensor_bytes(self.kv_scale_buffer)

    def get_contiguous_buf_infos(self) -> Tuple[list, list, list]:
        """``[KV_0 .. KV_{L-1}, KVscale_0 .. KVscale_{L-1}]``; item_len = one page of rows."""
        return buf_infos(self.kv_buffer + self.kv_scale_buffer, self.page_size)

    _transfer_kind = KVKind.MLA_FP4

    def _transfer_tensors(self) -> Tuple[TensorLayout, ...]:
        rep = ShardRule.REPLICATED
        return (TensorLayout("kv", 0, rep, 1, self.kv_cache_dim // 2),
                TensorLayout("kv_scale", 1, rep, 1, self.kv_cache_dim // FP4_BLOCK))

    def _dequant(self, i: int, rows, dim: int) -> torch.Tensor:
        """Dequantize the first ``dim`` elements of rows ``rows`` of layer ``i``: ``[n, 1, dim]``."""
        packed = self.kv_buffer[i][rows][..., : dim // 2]  # [n, 1, dim // 2]
        scales = self.kv_scale_buffer[i][rows][:, None, : dim // FP4_BLOCK]  # [n, 1, dim // 16]
        return dequantize_fp4(packed, scales, dtype=self.dequant_dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The whole layer dequantized: ``[size + page_size, 1, kv_cache_dim]`` (a new tensor)."""
        i = self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self._dequant(i, slice(None), self.kv_cache_dim)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The nope part dequantized: ``[size + page_size, 1, kv_lora_rank]`` (a new tensor)."""
        i = self._local_layer(layer_id)
        self._wait_for_layer(layer_id)
        return self._dequant(i, slice(None), self.kv_lora_rank)

    def _write_rows(self, layer, loc, rows: torch.Tensor) -> None:
        i = self._local_layer(layer_id_of(layer))
        packed, scales = quantize_fp4(rows)  # [n, 1, dim // 2], [n, 1, dim // 16]
        self.kv_buffer[i][loc] = packed
        self.kv_scale_buffer[i][loc] = scales[:, 0]

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v: Optional[torch.Tensor] = None) -> None:
        """Quantize and write whole rows ``cache_k`` ``[n, 1, kv_cache_dim]`` (``cache_v`` ignored)."""
        loc = self._check_loc(loc)
        rows = rows_of("cache_k", cache_k, len(loc), self.kv_cache_dim, self._buf_device)
        self._write_rows(layer, loc, rows)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """Quantize nope ``[n, 1, kv_lora_rank]`` | rope ``[n, 1, qk_rope_head_dim]`` into rows ``loc``.
        The nope part is whole blocks, so this equals quantizing the two parts separately."""
        loc = self._check_loc(loc)
        nope = rows_of("cache_k_nope", cache_k_nope, len(loc), self.kv_lora_rank, self._buf_device)
        rope = rows_of("cache_k_rope", cache_k_rope, len(loc), self.qk_rope_head_dim, self._buf_device)
        if nope.dtype != rope.dtype:
            raise TypeError(f"cache_k_nope and cache_k_rope must share a dtype, got {nope.dtype} and {rope.dtype}")
        self._write_rows(layer, loc, torch.cat([nope, rope], dim=-1))  # [n, 1, kv_cache_dim]

    def get_mla_kv_buffer(
        self, layer, loc, dst_dtype: Optional[torch.dtype] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Dequantize rows ``loc`` into (nope ``[n, 1, kv_lora_rank]``, rope ``[n, 1, qk_rope_head_dim]``)
        of ``dst_dtype`` (default bfloat16)."""
        layer_id = layer_id_of(layer)
        i = self._local_layer(layer_id)
        loc = self._check_loc(loc)
        self._wait_for_layer(layer_id)
        rows = self._dequant(i, loc, self.kv_cache_dim).to(dst_dtype or self.dequant_dtype)
        return rows[..., : self.kv_lora_rank].contiguous(), rows[..., self.kv_lora_rank :].contiguous()

    def _cpu_buffers(self) -> List[List[torch.Tensor]]:
        return [[kv, sc] for kv, sc in zip(self.kv_buffer, self.kv_scale_buffer)]
