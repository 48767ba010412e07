"""Random requests against the reference (hypothesis): any kind, heads, TP mix, page sizes,
request length and slot pattern."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.plan import KVKind
from tests.kvtransfer._support import HEADS, PAGE_SIZES, TP, Ref, mha_refs, run_attention


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from([KVKind.MHA, KVKind.MHA_FP4, KVKind.MLA]),
    heads=st.sampled_from(HEADS),
    p=st.sampled_from(TP),
    d=st.sampled_from(TP),
    src_ps=st.sampled_from(PAGE_SIZES + [4]),
    dst_ps=st.sampled_from(PAGE_SIZES + [4]),
    n=st.integers(1, 90),
    mode=st.sampled_from(["random", "contiguous"]),
    seed=st.integers(0, 2**31),
)
def test_random_requests(kind, heads, p, d, src_ps, dst_ps, n, mode, seed):
    rng = np.random.default_rng(seed)
    if kind is KVKind.MLA:
        refs, kw = [Ref(1, 96 * 2, "replicated")], dict(dtype="bfloat16", head_dim=96)
    else:
        refs, kw = mha_refs(kind, heads, 64, "bfloat16"), dict(dtype="bfloat16", head_dim=64, total_heads=heads)
    run_attention(kind, p, d, refs, rng, n=n, layers=1, src_ps=src_ps, dst_ps=dst_ps, mode=mode, **kw)
