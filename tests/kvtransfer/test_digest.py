"""Per-layer KV digests do not depend on how TP cut the request: the same reference request
written into TP 1, 2 and 4 pools (by the control tests' own sharding statement, not the
layout's) gives the same digests; one changed byte changes exactly its layer's."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.digest import DigestMismatch, layer_digests, rank_digests
from tests.kvtransfer.control._pools import PoolKit

TOKENS = 21


def _digests(kind: str, tp: int, page: int, seed: int, corrupt=None) -> dict:
    rng = np.random.default_rng(seed)
    slots = rng.choice(np.arange(page, 40 * page), TOKENS, replace=False)  # page 0 is padding
    parts = []
    for r in range(tp):
        kit = PoolKit(kind, r, tp, page, pages=40)
        kit.fill("req", slots, state_slot=3)
        if corrupt is not None and corrupt[0] == r:
            view = kit._kv_buffers()[corrupt[1]][0]
            view[slots[5], 0] ^= 1
        parts.append(rank_digests(kit.layout, kit.kv_infos, kit.state_infos, slots, 3 if kind == "hybrid" else None))
    return layer_digests(parts)


@pytest.mark.parametrize("kind", ["mha", "mla", "hybrid"])
def test_digests_are_the_same_for_every_tp_and_page_size(kind):
    one = _digests(kind, 1, 16, seed=1)
    layers = 2 if kind != "hybrid" else 4
    assert len(one) == layers
    for tp, page in ((2, 64), (4, 1)):
        assert _digests(kind, tp, page, seed=tp) == one


def test_one_flipped_byte_changes_only_its_layer():
    clean = _digests("mha", 2, 16, seed=0)
    dirty = _digests("mha", 2, 16, seed=0, corrupt=(1, 1))  # rank 1, buffer 1 = K of layer 1
    assert [k for k in clean if clean[k] != dirty[k]] == ["kv.1"]


def test_replicas_that_disagree_are_named():
    kits = [PoolKit("mla", r, 2, 16, pages=8) for r in range(2)]
    slots = np.arange(16, 16 + TOKENS)
    for k in kits:
        k.fill("req", slots)
    kits[1]._kv_buffers()[0][0][slots[0], 3] ^= 0xFF
    parts = [rank_digests(k.layout, k.kv_infos, None, slots) for k in kits]
    with pytest.raises(DigestMismatch, match="replicas of kv layer 0 kv at byte 0 differ"):
        layer_digests(parts)
