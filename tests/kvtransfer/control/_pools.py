"""The pools a test rank owns, and the bytes a request should leave in them.

A :class:`PoolKit` builds one rank's pools (MHA, MLA, or hybrid: MHA full attention beside
Mamba2 state), its layout and exports, and reads and writes the pools' memory as raw bytes.
The expected bytes of a rank come from a seeded *full* (unsharded) row per (request, tensor,
layer, token), cut by this module's own statement of the sharding rule (KV heads split or
replicated, MLA rows whole, Mamba2 conv ``[x | B | C]`` with groups split or replicated,
SSM heads split) - not by the planner's, so a planner mistake shows as a mismatch.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

KINDS = ("mha", "mla", "hybrid")

# model shapes, unsharded; head counts divisible by 1, 2 and 4
HEADS, HEAD_DIM = 4, 8  # MHA KV heads x dims (float32)
KV_LORA, ROPE = 16, 8  # MLA latent row (float32)
MAMBA = dict(intermediate=16, n_groups=2, heads=4, head_dim=2, state=4, kernel=3)
FULL_LAYERS, MAMBA_LAYERS = (0, 2), (1, 3)
ITEM = 4  # float32


def _split(units: int, tp_rank: int, tp_size: int) -> tuple:
    """(first, count) of ``units`` on one rank: split when TP <= units, else one replicated."""
    if tp_size <= units:
        return tp_rank * units // tp_size, units // tp_size
    return tp_rank // (tp_size // units), 1


def _view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class PoolKit:
    def __init__(self, kind: str, tp_rank: int, tp_size: int, page_size: int, pages: int, state_slots: int = 32,
                 device: int = -1):
        import torch

        from kvtransfer.layout import RankLayout
        from pools.hybrid_linear import HybridLinearKVPool
        from pools.mamba import MambaPool, MambaStateParams
        from pools.mha import MHATokenToKVPool
        from pools.mla import MLATokenToKVPool

        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if device >= 0 and kind != "mha":
            raise ValueError(f"CUDA pools are MHA here, got {kind!r}")
        self.device = None if device < 0 else device  # CUDA ordinal, None: host memory
        where = "cpu" if device < 0 else f"cuda:{device}"
        self.kind, self.tp_rank, self.tp_size = kind, tp_rank, tp_size
        size = pages * page_size
        first, count = _split(HEADS, tp_rank, tp_size)
        self.heads = (first, count)
        conv_groups = None
        if kind == "mha":
            self.pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, head_num=count,
                                         head_dim=HEAD_DIM, layer_num=2, device=where)
        elif kind == "mla":
            self.pool = MLATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, kv_lora_rank=KV_LORA,
                                         qk_rope_head_dim=ROPE, layer_num=2, device="cpu")
        else:
            m = MAMBA
            params = MambaStateParams.mamba2(
                tp_world_size=tp_size, intermediate_size=m["intermediate"], n_groups=m["n_groups"],
                num_heads=m["heads"], head_dim=m["head_dim"], state_size=m["state"], conv_kernel=m["kernel"],
                layers=MAMBA_LAYERS, conv_dtype=torch.float32, temporal_dtype=torch.float32)
            mamba = MambaPool(size=state_slots, spec_state_size=0, cache_params=params, device="cpu")
            self.pool = HybridLinearKVPool(size=size, dtype=torch.float32, page_size=page_size, head_num=count,
                                           head_dim=HEAD_DIM, full_attention_layer_ids=FULL_LAYERS,
                                           enable_kvcache_transpose=False, device="cpu", mamba_pool=mamba)
            conv_groups = [m["intermediate"], (m["n_groups"], m["state"]), (m["n_groups"], m["state"])]
        self.layout = RankLayout.from_pools(self.pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=HEADS,
                                            conv_shard_groups=conv_groups)
        self.kv_infos = self.pool.get_contiguous_buf_infos()
        self.state_infos = self.pool.get_state_buf_infos() if kind == "hybrid" else None
        self.page_size = page_size

    # -- bytes --------------------------------------------------------------------------
    def _kv_buffers(self):
        """``[(view, row bytes, full row bytes, local piece)]`` per exported KV buffer; a view
        is ``[rows, row bytes]`` uint8 (numpy on the host, torch on a GPU)."""
        ptrs, lens, items = self.kv_infos
        if self.device is None:
            views = [_view(ptr, length).reshape(-1, item // self.page_size)
                     for ptr, length, item in zip(ptrs, lens, items)]
        else:  # MHA on a GPU: the pool's own K, then V tensors, in export order
            views = [t.view(-1).view(__import__("torch").uint8).reshape(t.shape[0], -1)
                     for t in [*self.pool.k_buffer, *self.pool.v_buffer]]
        out = []
        for view, item in zip(views, items):
            row = item // self.page_size
            if self.kind == "mla":
                full, pieces = row, [(0, row)]
            else:
                hb = HEAD_DIM * ITEM
                first, count = self.heads
                full, pieces = HEADS * hb, [(first * hb, count * hb)]
            out.append((view, row, full, pieces))
        return out

    def _state_buffers(self):
        """The same for the Mamba state buffers: conv (one per layer), then temporal."""
        m, t, r = MAMBA, self.tp_size, self.tp_rank
        ptrs, lens, items = self.state_infos
        per_layer = len(MAMBA_LAYERS)
        k1 = (m["kernel"] - 1) * ITEM  # bytes of one conv channel
        x0, xn = _split(m["intermediate"], r, t)
        g0, gn = _split(m["n_groups"], r, t)
        gb = m["state"] * k1  # bytes of one group's channels
        xb = m["intermediate"] * k1
        conv_pieces = [(x0 * k1, xn * k1), (xb + g0 * gb, gn * gb), (xb + m["n_groups"] * gb + g0 * gb, gn * gb)]
        conv_full = xb + 2 * m["n_groups"] * gb
        hb = m["head_dim"] * m["state"] * ITEM
        h0, hn = _split(m["heads"], r, t)
        out = []
        for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items)):
            conv = i < per_layer
            out.append((_view(ptr, length), item, conv_full if conv else m["heads"] * hb,
                        conv_pieces if conv else [(h0 * hb, hn * hb)]))
        return out

    @staticmethod
    def _full_rows(request_id: str, tag: str, index: int, n: int, full: int) -> np.ndarray:
        seed = zlib.crc32(f"{request_id}/{tag}/{index}".encode())
        return np.random.default_rng(seed).integers(0, 256, (n, full), dtype=np.uint8)  # [n, full row bytes]

    @staticmethod
    def _local(rows: np.ndarray, pieces) -> np.ndarray:
        return np.concatenate([rows[:, a:a + n] for a, n in pieces], axis=1)  # [n, local row bytes]

    def fill(self, request_id: str, slots: np.ndarray, state_slot: int = 0, late_cycles: int = 0) -> None:
        """Write the request's reference rows (tokens 0..len(slots)) at ``slots``; state too.
        ``late_cycles`` (GPU pools, KV only): the rows are queued on the current stream behind a
        busy wait of that many GPU cycles and not waited for, as an engine's compute would be."""
        late = []  # GPU pools: (view, slots, rows) on the GPU, written after every upload
        for b, (view, row, full, pieces) in enumerate(self._kv_buffers()):
            rows = self._local(self._full_rows(request_id, "kv", b, slots.size, full), pieces)
            assert rows.shape[1] == row, (rows.shape, row)
            if self.device is None:
                view[slots] = rows
            else:
                import torch

                late.append((view, torch.from_numpy(slots).to(view.device), torch.from_numpy(rows).to(view.device)))
        if late:
            import torch

            torch.cuda.synchronize(self.device)  # the uploads (each waited for the host anyway) are done
            if late_cycles:
                torch.cuda._sleep(late_cycles)
            for view, idx, src in late:
                view[idx] = src  # on the current stream
            if not late_cycles:
                torch.cuda.synchronize(self.device)
        if self.kind == "hybrid":
            for b, (view, item, full, pieces) in enumerate(self._state_buffers()):
                rows = self._local(self._full_rows(request_id, "state", b, 1, full), pieces)
                assert rows.shape[1] == item, (rows.shape, item)
                view.reshape(-1, item)[state_slot] = rows[0]

    def mismatches(self, request_id: str, slots: np.ndarray, tokens: int, prefix: int, state_slot: int = 0) -> int:
        """Rows (KV token rows, state rows) that differ from the reference."""
        bad = 0
        for b, (view, row, full, pieces) in enumerate(self._kv_buffers()):
            want = self._local(self._full_rows(request_id, "kv", b, tokens, full), pieces)[prefix:]
            got = view[slots] if self.device is None else view.cpu().numpy()[slots]
            bad += int((got != want).any(axis=1).sum())
        if self.kind == "hybrid":
            for b, (view, item, full, pieces) in enumerate(self._state_buffers()):
                want = self._local(self._full_rows(request_id, "state", b, 1, full), pieces)[0]
                bad += int(not np.array_equal(view.reshape(-1, item)[state_slot], want))
        return bad
