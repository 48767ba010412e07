"""NSA (DeepSeek sparse attention) token-to-KV pool: an MLA pool plus a paged indexer-key buffer.

KV rows are those of :class:`pools.mla.MLATokenToKVPool`. With ``dtype=torch.float8_e4m3fn`` and a
``kv_cache_dim`` other than ``kv_lora_rank + qk_rope_head_dim``, each row instead holds the packed
FP8 format (uint8 bytes)::

    row = [kv_lora_rank fp8 e4m3 nope | kv_lora_rank // 128 fp32 scales | qk_rope_head_dim bf16 rope]
    # nope tile t (128 elements) = fp8[t] * scale[t], scale = tile amax / 448 (1.0 for a zero tile,
    # where SGLang stores NaN codes: pools/DEPARTURES.md)
    # fp8[t] = e4m3_rne(clamp(x * (1 / scale), -448, 448)), all in fp32 (SGLang's quantize_k_cache)
    # kv_cache_dim = kv_lora_rank + kv_lora_rank // 128 * 4 + qk_rope_head_dim * 2  (656 for 512/64)

Indexer keys (one head of ``index_head_dim`` = 128 per token, fp8 e4m3 data and one fp32 scale
per token), one buffer per layer, paged::

    index_k_with_scale_buffer[l]   # [num_pages, page_size * index_head_dim + page_size * 4] uint8
    # page p: bytes [0, page_size * index_head_dim) = page_size rows of fp8 data (token slot
    #         p * page_size + j at j * index_head_dim), then page_size fp32 scales (slot j at
    #         page_size * index_head_dim + 4 * j)
    # num_pages = (index_buf_size + page_size + 1) // page_size

Exports: ``get_contiguous_buf_infos`` -> ``[KV_0 .. KV_{L-1}]`` (as MLA);
``get_state_buf_infos`` -> ``[index_k_0 .. index_k_{L-1}]``, item_len = one page.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from pools._checks import check_indices, check_tensor, layer_id_of, tensor_bytes
from pools.describe import Export, KVKind, ShardRule, StateKind, StateLayout, TensorLayout, TransferLayout
from pools.kv_cache import buf_infos
from pools.mla import MLATokenToKVPool, check_chunks, gather_chunks, rows_of, scatter_chunks

__all__ = ["NSATokenToKVPool", "quantize_nsa_k", "dequantize_nsa_k"]

FP8_E4M3_MAX = 448.0
_SCALE_BYTES = 4  # one fp32 scale


def _fp8_layout(kv_lora_rank: int, qk_rope_head_dim: int, tile: int) -> int:
    """Bytes of one packed FP8 NSA row."""
    return kv_lora_rank + kv_lora_rank // tile * _SCALE_BYTES + qk_rope_head_dim * 2


def quantize_nsa_k(nope: torch.Tensor, rope: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """Pack ``nope`` ``[..., kv_lora_rank]`` and ``rope`` ``[..., qk_rope_head_dim]`` (float) into
    packed FP8 NSA rows ``[..., kv_cache_dim]`` uint8 (layout in the module docstring)."""
    r = nope.shape[-1]
    tiles = nope.float().unflatten(-1, (r // tile, tile))  # [..., r // tile, tile]
    amax = tiles.abs().amax(dim=-1, keepdim=True)  # [..., r // tile, 1]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    # As SGLang's kernel: multiply by the fp32 reciprocal (not a division: the two differ by one
    # e4m3 step on ~0.03% of codes) and clamp to +-448 before the round-to-nearest-even cast.
    q = (tiles * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # [..., r // tile, tile]
    data = q.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)  # [..., r]
    scale_bytes = scale.squeeze(-1).contiguous().view(torch.uint8)  # [..., r // tile * 4]
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)  # [..., rope * 2]
    return torch.cat([data, scale_bytes, rope_bytes], dim=-1)


def dequantize_nsa_k(
    packed: torch.Tensor, kv_lora_rank: int, tile: int = 128, dtype: torch.dtype = torch.bfloat16
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`quantize_nsa_k`: (nope ``[..., kv_lora_rank]``, rope) of ``dtype``."""
    n_scale = kv_lora_rank // tile * _SCALE_BYTES
    data = packed[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[..., kv_lora_rank : kv_lora_rank + n_scale].contiguous().view(torch.float32)
    nope = (data.unflatten(-1, (-1, tile)) * scale.unsqueeze(-1)).flatten(-2)
    rope = packed[..., kv_lora_rank + n_scale :].contiguous().view(torch.bfloat16)
    return nope.to(dtype), rope.to(dtype)


class NSATokenToKVPool(MLATokenToKVPool):
    """MLA KV rows plus per-layer paged indexer keys (layout in the module docstring).

    ``page_size`` must be 64 and ``index_head_dim`` 128. ``index_buf_size`` (default ``size``)
    sizes the index buffers. ``enable_memory_saver`` is accepted and ignored.
    """

    quant_block_size = 128
    index_k_with_scale_buffer_dtype = torch.uint8
    rope_storage_dtype = torch.bfloat16  # rope is always stored in bf16 in the packed FP8 rows

    def __init__(
        self,
        size: int,
        page_size: int,
        kv_lora_rank: int,
        dtype: torch.dtype,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        index_head_dim: int,
        enable_memory_saver: bool,
        kv_cache_dim: int,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        index_buf_size: Optional[int] = None,
    ):
        if page_size != 64:
            raise ValueError(f"NSATokenToKVPool needs page_size 64, got {page_size!r}")
        if index_head_dim != self.quant_block_size:
            raise ValueError(f"NSATokenToKVPool needs index_head_dim {self.quant_block_size}, got {index_head_dim!r}")
        plain_dim = kv_lora_rank + qk_rope_head_dim
        override = kv_cache_dim if kv_cache_dim != plain_dim else None
        if override is not None:
            if dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"kv_cache_dim {kv_cache_dim} != kv_lora_rank + qk_rope_head_dim ({plain_dim}) "
                    f"needs dtype torch.float8_e4m3fn (packed FP8 rows), got {dtype}"
                )
            if kv_lora_rank % self.quant_block_size:
                raise ValueError(f"packed FP8 rows need kv_lora_rank % 128 == 0, got {kv_lora_rank}")
            packed = _fp8_layout(kv_lora_rank, qk_rope_head_dim, self.quant_block_size)
            if kv_cache_dim != packed:
                raise ValueError(
                    f"packed FP8 rows of kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim} "
                    f"are {packed} bytes, got kv_cache_dim={kv_cache_dim}"
                )
        super().__init__(
            size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device,
            enable_memory_saver, start_layer, end_layer, use_nsa=True, override_kv_cache_dim=override,
        )
        if index_buf_size is None:
            index_buf_size = size
        if not isinstance(index_buf_size, int) or index_buf_size <= 0:
            raise ValueError(f"index_buf_size must be a positive int, got {index_buf_size!r}")
        self.index_head_dim = index_head_dim
        self.index_buf_size = index_buf_size
        self.num_index_pages = (index_buf_size + page_size + 1) // page_size
        self.index_data_bytes = page_size * index_head_dim  # fp8 rows of a page come first
        self.index_page_bytes = page_size * (
            index_head_dim + index_head_dim // self.quant_block_size * _SCALE_BYTES
        )
        self.index_k_with_scale_buffer = [
            torch.zeros(
                (self.num_index_pages, self.index_page_bytes),
                dtype=self.index_k_with_scale_buffer_dtype,
                device=device,
            )
            for _ in range(layer_num)
        ]
        self._finalize_allocation_log(size)

    # -- sizes and exports ---------------------------------------------------------------
    def get_kv_size_bytes(self) -> int:
        return super().get_kv_size_bytes() + tensor_bytes(self.index_k_with_scale_buffer)

    def get_state_buf_infos(self) -> Tuple[list, list, list]:
        """``[index_k_0 .. index_k_{L-1}]``; item_len = one page of a buffer."""
        return buf_infos(self.index_k_with_scale_buffer, 1)

    _transfer_kind = KVKind.NSA

    def transfer_layout(self) -> TransferLayout:
        """The MLA rows, plus index_k as state: each page is two sections, ``page_size`` fp8
        rows of ``index_head_dim`` bytes, then ``page_size`` fp32 scales."""
        kv = super().transfer_layout().kv
        rep, ps, page = ShardRule.REPLICATED, self.page_size, self.index_page_bytes
        scale_bytes = self.index_head_dim // self.quant_block_size * _SCALE_BYTES
        sections = (TensorLayout("index_k", 0, rep, 1, self.index_head_dim, section_start=0, page_bytes=page),
                    TensorLayout("index_k_scale", 0, rep, 1, scale_bytes, section_start=self.index_data_bytes,
                                 page_bytes=page))
        state = StateLayout(StateKind.NSA_INDEX, Export.STATE, kv.layer_ids, ps, self.num_index_pages * ps,
                            (self.index_head_dim,), sections)
        return TransferLayout(kv, state)

    # -- packed FP8 rows -----------------------------------------------------------------
    def set_mla_kv_buffer(self, layer, loc, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor) -> None:
        """As MLA; for packed FP8 rows the nope part is quantized per 128-element tile and the rope
        part stored as bf16 (module docstring)."""
        if not self.nsa_kv_cache_store_fp8:
            return super().set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope)
        i = self._local_layer(layer_id_of(layer))
        loc = self._check_loc(loc)
        nope = rows_of("cache_k_nope", cache_k_nope, len(loc), self.kv_lora_rank, self._buf_device)
        rope = rows_of("cache_k_rope", cache_k_rope, len(loc), self.qk_rope_head_dim, self._buf_device)
        self.kv_buffer[i][loc] = quantize_nsa_k(nope, rope, self.quant_block_size)

    def get_mla_kv_buffer(
        self, layer, loc, dst_dtype: Optional[torch.dtype] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """As MLA; packed FP8 rows are dequantized (default ``dst_dtype``: bfloat16)."""
        if not self.nsa_kv_cache_store_fp8:
            return super().get_mla_kv_buffer(layer, loc, dst_dtype)
        layer_id = layer_id_of(layer)
        i = self._local_layer(layer_id)
        loc = self._check_loc(loc)
        self._wait_for_layer(layer_id)
        return dequantize_nsa_k(
            self.kv_buffer[i][loc], self.kv_lora_rank, self.quant_block_size, dst_dtype or self.rope_storage_dtype
        )

    # -- indexer keys --------------------------------------------------------------------
    def _index_addrs(self, locs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Byte offsets, in a layer's flattened index buffer, of token slots ``locs``:
        (data ``[n, index_head_dim]``, scale ``[n, 4]``)."""
        page, off = locs // self.page_size, locs % self.page_size
        base = page * self.index_page_bytes  # [n]
        ar = torch.arange(self.index_head_dim, device=locs.device)
        data = (base + off * self.index_head_dim)[:, None] + ar  # [n, index_head_dim]
        ar4 = torch.arange(_SCALE_BYTES, device=locs.device)
        scale = (base + self.index_data_bytes + off * _SCALE_BYTES)[:, None] + ar4  # [n, 4]
        return data, scale

    def _index_buf(self, layer_id: int, wait: bool = True) -> torch.Tensor:
        i = self._local_layer(layer_id)
        if wait:
            self._wait_for_layer(layer_id)
        return self.index_k_with_scale_buffer[i]

    def _page_locs(self, seq_len: int, page_indices) -> torch.Tensor:
        """Token slots of the first ``seq_len`` tokens of a request whose pages are ``page_indices``."""
        if not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
        dev = self.index_k_with_scale_buffer[0].device
        pages = check_indices("page_indices", page_indices, self.num_index_pages, device=dev)
        need = -(-seq_len // self.page_size)
        if len(pages) < need:
            raise ValueError(f"seq_len {seq_len} needs {need} pages, got {len(pages)} page_indices")
        t = torch.arange(seq_len, device=dev)
        return pages[t // self.page_size] * self.page_size + t % self.page_size  # [seq_len]

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        """The raw index buffer of a layer, ``[num_pages, page_bytes]`` uint8."""
        return self._index_buf(layer_id)

    def get_index_k_continuous(self, layer_id: int, seq_len: int, page_indices) -> torch.Tensor:
        """fp8 index keys of ``seq_len`` tokens on pages ``page_indices``: ``[seq_len, index_head_dim]`` uint8."""
        flat = self._index_buf(layer_id).view(-1)
        return flat[self._index_addrs(self._page_locs(seq_len, page_indices))[0]]

    def get_index_k_scale_continuous(self, layer_id: int, seq_len: int, page_indices) -> torch.Tensor:
        """fp32 scales (as bytes) of ``seq_len`` tokens on pages ``page_indices``: ``[seq_len, 4]`` uint8."""
        flat = self._index_buf(layer_id).view(-1)
        return flat[self._index_addrs(self._page_locs(seq_len, page_indices))[1]]

    def get_index_k_scale_buffer(
        self, layer_id: int, seq_len_tensor, page_indices, seq_len_sum: int, max_seq_len: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and scales of a batch, requests concatenated: ``page_indices`` ``[batch, max_pages]``,
        ``seq_len_tensor`` ``[batch]`` -> (``[seq_len_sum, index_head_dim]`` uint8, ``[seq_len_sum, 4]`` uint8)."""
        flat = self._index_buf(layer_id).view(-1)
        dev = flat.device
        check_tensor("page_indices", page_indices, shape=(None, None))
        seq = check_indices("seq_len_tensor", seq_len_tensor, max_seq_len + 1, device=dev)
        batch, max_pages = page_indices.shape
        if len(seq) != batch:
            raise ValueError(f"seq_len_tensor must have {batch} entries (page_indices rows), got {len(seq)}")
        if int(seq.sum()) != seq_len_sum:
            raise ValueError(f"seq_len_sum must equal sum(seq_len_tensor) = {int(seq.sum())}, got {seq_len_sum}")
        pages = check_indices("page_indices", page_indices.reshape(-1), self.num_index_pages, device=dev)
        pages = pages.view(batch, max_pages)  # [batch, max_pages]
        if batch and -(-int(seq.max()) // self.page_size) > max_pages:
            raise ValueError(f"seq_len_tensor needs up to {-(-int(seq.max()) // self.page_size)} pages, got {max_pages}")
        if seq_len_sum == 0:
            return flat.new_empty((0, self.index_head_dim)), flat.new_empty((0, _SCALE_BYTES))
        t = torch.arange(max_seq_len, device=dev)[None, :]  # [1, max_seq_len]
        mask = t < seq[:, None]  # [batch, max_seq_len]
        page_of = pages.gather(1, (t // self.page_size).clamp(max=max_pages - 1).expand(batch, -1))
        locs = (page_of * self.page_size + t % self.page_size)[mask]  # [seq_len_sum], request-major
        data, scale = self._index_addrs(locs)
        return flat[data], flat[scale]

    def set_index_k_scale_buffer(self, layer_id: int, loc, index_k: torch.Tensor, index_k_scale: torch.Tensor) -> None:
        """Write index keys of token slots ``loc``: ``index_k`` ``[n, index_head_dim]`` float8_e4m3fn
        (or its uint8 bytes), ``index_k_scale`` ``[n]`` / ``[n, 1]`` float32 (or ``[n, 4]`` uint8 bytes)."""
        buf = self._index_buf(layer_id, wait=False)
        loc = check_indices("loc", loc, self.num_index_pages * self.page_size, device=buf.device)
        n = len(loc)
        check_tensor("index_k", index_k, shape=(n, self.index_head_dim), device=buf.device)
        if index_k.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise TypeError(f"index_k must be float8_e4m3fn or uint8, got {index_k.dtype}")
        check_tensor("index_k_scale", index_k_scale, device=buf.device)
        if index_k_scale.dtype == torch.float32:
            if index_k_scale.numel() != n or index_k_scale.dim() not in (1, 2):
                raise ValueError(f"index_k_scale must have shape [{n}] or [{n}, 1], got {list(index_k_scale.shape)}")
            scale_bytes = index_k_scale.reshape(n, 1).contiguous().view(torch.uint8)  # [n, 4]
        elif index_k_scale.dtype == torch.uint8:
            check_tensor("index_k_scale", index_k_scale, shape=(n, _SCALE_BYTES))
            scale_bytes = index_k_scale
        else:
            raise TypeError(f"index_k_scale must be float32 or uint8, got {index_k_scale.dtype}")
        data, scale = self._index_addrs(loc)
        flat = buf.view(-1)
        flat[data] = index_k.contiguous().view(torch.uint8)
        flat[scale] = scale_bytes

    # -- CPU offload of both buffers -----------------------------------------------------
    def _pages_of(self, idx: torch.Tensor) -> torch.Tensor:
        """Pages holding token slots ``idx`` (runs of a request's pages, first token of each run
        page-aligned as a paged allocator gives them): ``idx[::page_size] // page_size``."""
        pages = idx[:: self.page_size] // self.page_size
        expect = pages.repeat_interleave(self.page_size)[: len(idx)]
        if not torch.equal(idx // self.page_size, expect):
            raise ValueError(
                f"indices must be runs of whole pages of {self.page_size} slots (slot i on page "
                f"indices[i - i % {self.page_size}] // {self.page_size})"
            )
        if len(pages) and int(pages.max()) >= self.num_index_pages:
            raise ValueError(f"indices must lie on index pages [0, {self.num_index_pages}), got page {int(pages.max())}")
        return pages

    def get_cpu_copy(self, indices, mamba_indices=None) -> dict:
        """``{"kv": MLA copy, "index_k": out[layer][chunk]}``, the index pages of ``indices`` in chunks
        of ``max(1, cpu_offloading_chunk_size // page_size)`` pages."""
        pages = self._pages_of(self._check_loc(indices))
        kv = super().get_cpu_copy(indices)
        chunk = max(1, self.cpu_offloading_chunk_size // self.page_size)
        index_k = [gather_chunks([b], pages, chunk)[0] for b in self.index_k_with_scale_buffer]
        return {"kv": kv, "index_k": index_k}

    def load_cpu_copy(self, kv_cache_cpu_dict, indices, mamba_indices=None) -> None:
        """Write a :meth:`get_cpu_copy` result back; a malformed copy raises before any write."""
        if not isinstance(kv_cache_cpu_dict, dict) or set(kv_cache_cpu_dict) != {"kv", "index_k"}:
            got = sorted(kv_cache_cpu_dict) if isinstance(kv_cache_cpu_dict, dict) else type(kv_cache_cpu_dict).__name__
            raise ValueError(f"kv_cache_cpu_dict must be a dict with keys ['index_k', 'kv'], got {got}")
        pages = self._pages_of(self._check_loc(indices))
        chunk = max(1, self.cpu_offloading_chunk_size // self.page_size)
        index_k = kv_cache_cpu_dict["index_k"]
        check_chunks("index_k", self.index_k_with_scale_buffer, index_k, pages, chunk)
        super().load_cpu_copy(kv_cache_cpu_dict["kv"], indices)
        for buf, chunks in zip(self.index_k_with_scale_buffer, index_k):
            scatter_chunks([buf], [chunks], pages, chunk)
