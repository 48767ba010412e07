"""The hybrid model's batched decode step (:meth:`Mamba2Mixer.forward_decode`, every index on
the device) against its general forward, on the CPU; and on CUDA its decode steps as CUDA-graph
replays across batch sizes against the CPU path (marked gpu)."""

import pytest
import torch

from kvtransfer.models import launch
from kvtransfer.models.batch import ForwardBatch
from kvtransfer.models.config import ModelName
from kvtransfer.models.engine import Engine
from tests.kvtransfer.models._support import SMALL, engine_config, tiny_spec


def test_batched_mamba_decode_equals_the_general_forward():
    model = tiny_spec(ModelName.TINY_HYBRID).build(launch.TPGroup(), torch.float32, "cpu")
    engine = Engine(model, SMALL)
    layer = next(i for i, w in enumerate(model.layers) if "mamba" in w)
    mixer = model.layers[layer]["mamba"]
    state = engine.pools.req_to_token.mamba2_layer_cache(layer)
    gen = torch.Generator().manual_seed(11)
    for t in (state.conv[0], state.temporal):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    saved = [state.conv[0].clone(), state.temporal.clone()]
    slots = (3, 1, 2)
    x = torch.randn(len(slots), model.config.hidden_size, generator=gen)  # [B, hidden]

    zeros = torch.zeros(len(slots), dtype=torch.int64)
    batch = ForwardBatch(input_ids=zeros, positions=zeros, out_cache_loc=zeros, req_pool_indices=(1, 2, 3),
                         prefix_lens=(4, 4, 4), extend_lens=(1, 1, 1), mamba_slots=slots)
    want = mixer.forward(x, batch, state)
    want_state = [state.conv[0].clone(), state.temporal.clone()]
    state.conv[0].copy_(saved[0])
    state.temporal.copy_(saved[1])
    got = mixer.forward_decode(x, torch.tensor(slots), state)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.conv[0], want_state[0], rtol=0, atol=0)
    torch.testing.assert_close(state.temporal, want_state[1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(state.temporal[list(slots)], saved[1][list(slots)])  # the step changed the states


PROMPTS = ((5, 6, 7), tuple(range(40, 70)), (200, 201), tuple(range(100, 113)))  # ids inside the vocabulary
NEW = (9, 3, 6, 1)  # requests finish at different steps: the decode batch shrinks 4 -> 3 -> 2 -> 1


class _Mixed:
    """Each prompt alone (decode at batch 1), then all of them at once (decode at 4, 3, 2, 1)."""

    def __call__(self, engine):
        alone = []
        for p, n in zip(PROMPTS, NEW):
            alone.append(engine.add(p, n, record_logits=True))
            engine.run()
        reqs = alone + [engine.add(p, n, record_logits=True) for p, n in zip(PROMPTS, NEW)]
        engine.run()
        return [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs], engine.graphs is not None


@pytest.mark.gpu
def test_hybrid_graph_decode_equals_the_cpu_path_across_batch_sizes():
    spec = tiny_spec(ModelName.TINY_HYBRID)
    cpu_ids, cpu_logits, _ = launch.run(spec, 1, engine_config(max_requests=4, chunk_size=16), _Mixed())
    gpu_ids, gpu_logits, graphs = launch.run(spec, 1, engine_config(max_requests=4, chunk_size=16, device="cuda"),
                                             _Mixed())
    assert graphs
    assert gpu_ids == cpu_ids
    for a, b in zip(cpu_logits, gpu_logits):
        assert (a - b).abs().max().item() < 1e-3
