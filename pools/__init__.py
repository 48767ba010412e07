"""Memory pools: own the KV / state tensors and export their memory layout.

Standalone: imports neither ``transport`` nor ``kvtransfer``. The layout exports
(``get_contiguous_buf_infos``, ``get_state_buf_infos``, ``get_state_dim_per_tensor``) are the
contract the rest of the system plans transfers from; each module documents its order. Each pool's
``transfer_layout()`` says what those buffers hold, as plain data (``pools.describe``).

The pools follow the seed (SGLang's ``mem_cache/memory_pool.py``); every place they depart from
it, and why, is listed in ``pools/DEPARTURES.md``.
"""

from pools.allocator import PagedTokenToKVPoolAllocator
from pools.describe import (Export, KVKind, KVLayout, ShardRule, StateKind, StateLayout, TensorLayout,
                            TransferLayout)
from pools.fp4 import FP4_BLOCK, dequantize_fp4, quantize_fp4
from pools.hybrid_linear import HybridLinearKVPool
from pools.kv_cache import KVCache, LayerDoneCounter
from pools.kv_copy import KVCopyTable, MoveBackend, build_copy_table, move_kv_cache_native
from pools.mamba import MambaPool, MambaSpeculativeState, MambaState, MambaStateParams
from pools.mha import MHATokenToKVPool, MHATokenToKVPoolFP4, NoOpMHATokenToKVPool
from pools.mla import MLATokenToKVPool, MLATokenToKVPoolFP4
from pools.nsa import NSATokenToKVPool
from pools.req_to_token import HybridReqToTokenPool, ReqToTokenPool

__all__ = [
    "Export",
    "FP4_BLOCK",
    "HybridLinearKVPool",
    "HybridReqToTokenPool",
    "KVCache",
    "KVCopyTable",
    "KVKind",
    "KVLayout",
    "LayerDoneCounter",
    "MHATokenToKVPool",
    "MHATokenToKVPoolFP4",
    "MLATokenToKVPool",
    "MLATokenToKVPoolFP4",
    "MambaPool",
    "MambaSpeculativeState",
    "MambaState",
    "MambaStateParams",
    "MoveBackend",
    "NSATokenToKVPool",
    "NoOpMHATokenToKVPool",
    "PagedTokenToKVPoolAllocator",
    "ReqToTokenPool",
    "ShardRule",
    "StateKind",
    "StateLayout",
    "TensorLayout",
    "TransferLayout",
    "build_copy_table",
    "dequantize_fp4",
    "move_kv_cache_native",
    "quantize_fp4",
]
