"""What every decoder here shares: weight placement, the MLP and embedding shards, the logits."""

from __future__ import annotations

from typing import Dict

import torch

from kvtransfer.layout import RankLayout
from kvtransfer.models.batch import ForwardBatch
from kvtransfer.models.layers import lm_head, rms_norm, swiglu_mlp
from kvtransfer.models.parallel import TPGroup, shard


def layer_weights(weights: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """The entries under ``prefix`` (e.g. ``"layers.3."``), with the prefix removed."""
    return {k[len(prefix):]: weights[k] for k in weights if k.startswith(prefix)}


class Decoder:
    """Base of the models: ``embed`` (replicated), ``norm``, the vocab shard of the LM head
    (``lm_head`` or, tied, ``embed``), and per-layer MLP shards. Subclasses set ``layers``."""

    def __init__(self, config, weights: Dict[str, torch.Tensor], tp: TPGroup, dtype: torch.dtype, device):
        config.check_tp(tp.size)
        self.config, self.tp, self.dtype, self.device = config, tp, dtype, torch.device(device)
        self.embed = self.put(weights["embed"])  # [vocab, hidden]
        self.norm = self.put(weights["norm"])  # [hidden]
        self.lm_head = self.put(shard(weights.get("lm_head", weights["embed"]), tp))  # [vocab / tp, hidden]

    def rank_layout(self, pools) -> RankLayout:
        """What this rank's pools hold, for the KV managers and the planner."""
        return RankLayout.from_pools(pools.kv, tp_rank=self.tp.rank, tp_size=self.tp.size, **self.layout_facts())

    def layout_facts(self) -> dict:
        """What the pools cannot know of the model (``RankLayout.from_pools`` keywords)."""
        return {}

    def put(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A contiguous copy on this rank's device, in the model dtype unless given."""
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def mlp_weights(self, w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Norms and the SwiGLU shard of one layer."""
        return {
            "attn_norm": self.put(w["attn_norm"]),
            "ffn_norm": self.put(w["ffn_norm"]),
            "gate_up": self.put(torch.cat([shard(w["gate"], self.tp), shard(w["up"], self.tp)])),  # [2 * ffn / tp, hidden]
            "down": self.put(shard(w["down"], self.tp, 1)),  # [hidden, ffn / tp]
        }

    def qkv_weights(self, w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """This rank's fused Q/K/V rows and O columns (GQA attention)."""
        tp = self.tp
        qkv = torch.cat([shard(w["q"], tp), shard(w["k"], tp), shard(w["v"], tp)])
        return {"qkv": self.put(qkv), "o": self.put(shard(w["o"], tp, 1))}

    def mlp(self, h: torch.Tensor, w: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``h + mlp(norm(h))``."""
        eps = self.config.rms_eps
        return h + swiglu_mlp(rms_norm(h, w["ffn_norm"], eps), w["gate_up"], w["down"], self.tp)

    def logits(self, h: torch.Tensor, batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        """Fp32 logits ``[B, vocab]`` of each request's last token, or ``[T, vocab]``."""
        h = rms_norm(h, self.norm, self.config.rms_eps)
        if not all_logits:
            h = h[batch.last_token_index()]  # [B, hidden]
        return lm_head(h, self.lm_head, self.tp)
