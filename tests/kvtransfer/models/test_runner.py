"""Batched decode under CUDA graphs (kvtransfer.models.runner) and GPU sampling
(kvtransfer.models.sampler): the GPU path's greedy float32 tokens equal the CPU path's across
batch sizes, seeded draws depend only on (seed, position); CPU parts run everywhere."""

import pytest
import torch

from kvtransfer.models import launch, registry
from kvtransfer.models.config import ModelName
from kvtransfer.models.engine import Engine, Sampling
from kvtransfer.models.registry import ModelSpec
from kvtransfer.models.runner import build_runner, capture_sizes, layer_parts, prefill_buckets, prefill_request_sizes
from tests.kvtransfer.models._support import SMALL, engine_config, run_interpreted


def test_capture_sizes_cover_every_batch_up_to_the_maximum():
    for top in (1, 3, 8, 20, 64):
        sizes = capture_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        assert all(any(s >= n for s in sizes) for n in range(1, top + 1))
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_no_runner_on_cpu():
    spec = registry.load(ModelName.TINY_MLA)[0]
    model = spec.build(launch.TPGroup(), torch.float32, "cpu")
    engine = Engine(model, SMALL)
    assert engine.graphs is None and build_runner(model, engine.pools, 4, 64) is None


def test_prefill_buckets_reach_the_chunk_size_within_the_context():
    assert prefill_buckets(512, 8192) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(1000, 8192)[-1] == 1024
    assert prefill_buckets(4096, 256) == [16, 32, 64, 128, 256]


def test_prefill_request_sizes_are_powers_of_two_up_to_the_batch_and_sixteen():
    assert prefill_request_sizes(1) == [1]
    assert prefill_request_sizes(6) == [1, 2, 4, 6]
    assert prefill_request_sizes(64) == [1, 2, 4, 8, 16]


def _random_smollm2():
    """SmolLM2's shape with its random weights drawn once on the CPU (a device draws other
    numbers from the same seed), so the CPU and GPU runs share them."""
    spec = registry.load(ModelName.SMOLLM2_RANDOM)[0]
    return ModelSpec(spec.name, spec.config, dict(spec.weights))


PROMPTS = ((5, 6, 7), tuple(range(40, 70)), (300, 301), tuple(range(1000, 1013)))
NEW = (9, 3, 6, 1)  # requests finish at different steps: the batch shrinks 4 -> 3 -> 2 -> 1


class _Mixed:
    """Each prompt alone first (a captured prefill of one request, then decode at batch 1), then
    all of them in one continuous batch (a captured prefill of four, then decode at 4, 3, 2, 1)."""

    def __call__(self, engine):
        alone = []
        for p, n in zip(PROMPTS, NEW):
            alone.append(engine.add(p, n, record_logits=True))
            engine.run()
        reqs = alone + [engine.add(p, n, record_logits=True) for p, n in zip(PROMPTS, NEW)]
        engine.run()
        return [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs]


def _assert_gpu_equals_cpu(scenario, **config) -> None:
    """Greedy float32 tokens the same on the GPU (graphs) as on the CPU, logits within 1e-3."""
    spec = _random_smollm2()
    cpu_ids, cpu_logits = launch.run(spec, 1, engine_config(**config), scenario)
    gpu_ids, gpu_logits = launch.run(spec, 1, engine_config(**config, device="cuda"), scenario)
    assert gpu_ids == cpu_ids
    for a, b in zip(cpu_logits, gpu_logits):
        assert (a - b).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_graph_decode_tokens_equal_the_cpu_path_across_batch_sizes():
    _assert_gpu_equals_cpu(_Mixed(), max_requests=4)


@pytest.mark.gpu
def test_graph_decode_equals_the_eager_gpu_path_in_bfloat16():
    spec = _random_smollm2()
    graphs = launch.run(spec, 1, engine_config(max_requests=4, device="cuda", dtype=torch.bfloat16), _Mixed())
    eager = launch.run(spec, 1, engine_config(max_requests=4, device="cuda", dtype=torch.bfloat16,
                                              cuda_graphs=False), _Mixed())
    for a, b in zip(graphs[1], eager[1]):  # the first tokens' logits (later ones may follow other tokens)
        assert torch.nn.functional.cosine_similarity(a[0], b[0], dim=0) > 0.99


def _step_through(engine, at: dict) -> int:
    """Step the engine until it has no work, calling ``at[k]()`` after step k; the pages its
    requests still hold then."""
    steps, free = 0, engine.pools.allocator.available_size()
    while engine.has_work():
        engine.step()
        steps += 1
        if steps in at:
            at[steps]()
    return free - engine.pools.allocator.available_size()


def _ahead_and_each(scenario, max_requests: int) -> tuple:
    """``scenario``'s results with decode launched ahead of each wait, and waiting for each step."""
    spec = _random_smollm2()
    return tuple(launch.run(spec, 1, engine_config(max_requests=max_requests, device="cuda", overlap=overlap),
                            scenario) for overlap in (True, False))


class _Interleaved:
    """Steps driven one by one: four requests finishing at different steps, a fifth added while
    they decode (its prefill takes in the step launched ahead), the third aborted mid-way; then
    what the pools still hold."""

    def __call__(self, engine):
        reqs = [engine.add(p, n) for p, n in zip(PROMPTS, (12, 5, 8, 3))]
        late = []
        held = _step_through(engine, {3: lambda: late.append(engine.add(PROMPTS[1], 6)),
                                      5: lambda: engine.abort(reqs[2])})
        return [r.output_ids for r in reqs + late], held


@pytest.mark.gpu
def test_decode_launched_ahead_gives_the_tokens_of_waiting_for_each_step():
    (ahead, held), (each, held_each) = _ahead_and_each(_Interleaved(), max_requests=5)
    # the aborted request may have taken one more token ahead; everything else is the same
    assert ahead[:2] + ahead[3:] == each[:2] + each[3:]
    assert ahead[2] == each[2][: len(ahead[2])] or each[2] == ahead[2][: len(each[2])]
    assert held == held_each == 0


class _Reserved:
    """Two requests decode, a step launched ahead of each wait, while a third is reserved (as a
    decode node reserves a request whose KV prefill sends) and, three steps later, started from a
    given first token; its pages are fresh (zeros) in every run. Then what the pools still hold."""

    def __call__(self, engine):
        reqs = [engine.add(p, n) for p, n in zip(PROMPTS[:2], (9, 12))]
        reserved = []

        def start():
            assert not engine.start_decode(reserved[0], 7)

        held = _step_through(engine, {2: lambda: reserved.append(engine.reserve(PROMPTS[3], 5)), 5: start})
        return [r.output_ids for r in reqs + reserved], held


@pytest.mark.gpu
def test_reserving_and_starting_a_request_leave_the_step_launched_ahead_running():
    (ahead, held), (each, held_each) = _ahead_and_each(_Reserved(), max_requests=4)
    assert ahead == each and len(ahead[2]) == 5 and ahead[2][0] == 7
    assert held == held_each == 0


class _Chunked:
    """Every prompt at once through chunks of 8 tokens: prefill steps mix a request's later
    chunks (after a cached prefix) with other requests' first ones, then decode."""

    def __call__(self, engine):
        reqs = [engine.add(p, n, record_logits=True) for p, n in zip(PROMPTS, NEW)]
        engine.run()
        return [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chunked_prefill_on_the_gpu_equals_the_cpu_path(page_size):
    spec = _random_smollm2()
    cfg = dict(max_requests=4, chunk_size=8, page_size=page_size)
    cpu_ids, cpu_logits = launch.run(spec, 1, engine_config(**cfg), _Chunked())
    for graphs in (True, False):
        gpu_ids, gpu_logits = launch.run(spec, 1, engine_config(**cfg, device="cuda", cuda_graphs=graphs), _Chunked())
        assert gpu_ids == cpu_ids
        for a, b in zip(cpu_logits, gpu_logits):
            assert (a - b).abs().max().item() < 1e-3


class _Many:
    """Twenty short prompts at once: one prefill step of more requests than any captured one
    (it runs eagerly, sampled on the GPU), then decode at 20 down to 1."""

    def __call__(self, engine):
        reqs = [engine.add((7 + i, 40 + i, 300 + 5 * i), 2 + i % 5, record_logits=True) for i in range(20)]
        engine.run()
        return [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs]


@pytest.mark.gpu
def test_a_prefill_of_more_requests_than_captured_equals_the_cpu_path():
    _assert_gpu_equals_cpu(_Many(), max_requests=20)


class _Seeded:
    """One seeded request alone (a captured prefill of one), then the same request among others
    (a captured prefill of five, padded to six requests): the same tokens."""

    def __call__(self, engine):
        s = Sampling(temperature=0.8, seed=7)
        alone = engine.add(PROMPTS[1], 8, sampling=s)
        engine.run()
        others = [engine.add(p, 8, sampling=Sampling(temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)]
        again = engine.add(PROMPTS[1], 8, sampling=s)
        engine.run()
        other = engine.add(PROMPTS[1], 8, sampling=Sampling(temperature=0.8, seed=8))
        engine.run()
        return alone.output_ids, again.output_ids, other.output_ids, [r.output_ids for r in others]


@pytest.mark.gpu
def test_seeded_draws_depend_on_seed_and_position_not_the_batch():
    alone, again, other, _ = launch.run(_random_smollm2(), 1, engine_config(max_requests=6, device="cuda"), _Seeded())
    assert alone == again
    assert other != alone


@pytest.mark.gpu
def test_sampler_greedy_is_argmax_and_draws_follow_softmax():
    from kvtransfer.models.sampler import sample

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50000, generator=gen)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins
    logits = logits.cuda()
    zeros = torch.zeros(6, device="cuda")
    keys = torch.arange(6, dtype=torch.int64, device="cuda")
    no_limit = torch.zeros(6, dtype=torch.int64, device="cuda")
    tokens, logprobs = sample(logits, zeros, keys, no_limit)
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[2].item() == 7
    ref = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, ref, atol=1e-5)

    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -2.0, 0.2], device="cuda")
    n, temp = 40000, 0.7
    keys = torch.randint(0, 2**62, (n,), generator=gen).cuda()
    no_limit = torch.zeros(n, dtype=torch.int64, device="cuda")
    tokens, _ = sample(row.expand(n, -1).contiguous(), torch.full((n,), temp, device="cuda"), keys, no_limit)
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq - torch.softmax(row / temp, -1)).abs().max().item() < 0.015
    again, _ = sample(row.expand(n, -1).contiguous(), torch.full((n,), temp, device="cuda"), keys, no_limit)
    assert torch.equal(tokens, again)


class _Prompts:
    """``prompts`` each alone, then all in one step, ``max_new`` tokens each (layer-wise when
    ``layers_out``): per request the ``on_layers`` calls it had as (tokens, end layer), its
    sampled tokens and its logits; and the runner's graphs (None without)."""

    def __init__(self, prompts: tuple, max_new: int, layers_out: bool = True):
        self.prompts, self.max_new, self.layers_out = prompts, max_new, layers_out

    def __call__(self, engine):
        calls = {}
        engine.on_layers = lambda chunks, end: [calls.setdefault(r.rid, []).append((n, end)) for r, n in chunks]

        def add(prompt):
            return engine.add(prompt, self.max_new, layers_out=self.layers_out, record_logits=True)

        reqs = []
        for prompt in self.prompts:
            reqs.append(add(prompt))
            engine.run()
        reqs += [add(p) for p in self.prompts]
        engine.run()
        return ([calls.get(r.rid, []) for r in reqs], [r.output_ids for r in reqs],
                [torch.stack(r.logits) for r in reqs], engine.graphs and engine.graphs.describe())


# layer-wise prompts ending in a chunk of one token when chunks are 8 tokens (8 + 1; 8 + 8 + 1)
ONE_TOKEN_TAILS = (tuple(range(40, 49)), tuple(range(300, 317)))


def test_layer_parts_cover_every_layer_once_in_groups():
    assert layer_parts(30, 1) == [range(i, i + 1) for i in range(30)]
    assert layer_parts(30, 7) == [range(0, 7), range(7, 14), range(14, 21), range(21, 28), range(28, 30)]
    assert layer_parts(3, 8) == [range(0, 3)]


def print_layers_in_parts() -> None:
    """Under the interpreter: a small Llama's prefill through ``extend_layers`` in parts of
    layers, the residual stream carried between them in one buffer as the runner's parts carry
    it, against all layers at once: ``dtype equal`` per dtype."""
    from kvtransfer.models.batch import ForwardBatch
    from kvtransfer.models.config import LlamaConfig
    from kvtransfer.models.llama import LlamaModel
    from kvtransfer.models.parallel import TPGroup
    from kvtransfer.models.seeded import RandomWeights, llama_shapes

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=5, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_eps=1e-5, max_context_len=64)
    t = 12
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaModel(cfg, RandomWeights(llama_shapes(cfg), 3), TPGroup(), dtype, "cpu")
        pools = model.make_pools(engine_config(max_tokens=64, page_size=1, max_requests=2, dtype=dtype))
        pools.req_to_token.req_to_token[1, :t] = torch.arange(1, t + 1)
        batch = ForwardBatch(input_ids=torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(0)),
                             positions=torch.arange(t), out_cache_loc=torch.arange(1, t + 1), req_pool_indices=(1,),
                             prefix_lens=(0,), extend_lens=(t,))
        whole = model.extend_layers(batch, pools, range(cfg.num_layers))
        stream = torch.zeros(2, t, cfg.hidden_size, dtype=dtype)
        for layers in layer_parts(cfg.num_layers, 2):
            h, delta = model.extend_layers(batch, pools, layers, stream)
        print(str(dtype).split(".")[-1], torch.equal(whole[0], h) and torch.equal(whole[1], delta))


def test_a_prefill_in_parts_of_layers_computes_what_all_layers_at_once_compute():
    assert run_interpreted("tests.kvtransfer.models.test_runner", "print_layers_in_parts") == [
        ["float32", "True"], ["bfloat16", "True"]]


@pytest.mark.parametrize("group", [-1, True, 1.5])
def test_a_layer_group_is_a_count_of_layers(group):
    with pytest.raises(ValueError, match="layer_group"):
        engine_config(layer_group=group)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 1, 7])
def test_a_layer_wise_prompt_streams_its_layers_under_graphs(group):
    """Eagerly (group 0: a callback after every layer, as on the CPU) or through prefill graphs
    replayed in parts of ``group`` layers (a callback after each part), a last chunk of one token
    included: every prompt token is announced at the last layer, and the tokens and logits are
    the CPU path's."""
    spec = _random_smollm2()
    cfg = dict(max_requests=4, chunk_size=8)
    cpu_calls, cpu_ids, cpu_logits, _ = launch.run(spec, 1, engine_config(**cfg), _Prompts(ONE_TOKEN_TAILS, 3))
    gpu_calls, gpu_ids, gpu_logits, _ = launch.run(spec, 1, engine_config(**cfg, device="cuda", layer_group=group),
                                                   _Prompts(ONE_TOKEN_TAILS, 3))
    layers = spec.config.num_layers
    ends = [r.stop for r in layer_parts(layers, group)] if group else list(range(1, layers + 1))
    for calls, prompt_len in zip(gpu_calls, (9, 17, 9, 17)):
        assert sorted({end for _, end in calls}) == ends
        # every prompt token's K/V is announced once its last layer is in the pools
        assert sum(n for n, end in calls if end == layers) == prompt_len
    assert [[c for c in calls if c[1] in ends] for calls in cpu_calls] == gpu_calls
    assert gpu_ids == cpu_ids
    for a, b in zip(cpu_logits, gpu_logits):
        assert (a - b).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_a_prefill_graph_in_parts_computes_what_the_whole_graph_computes_in_bfloat16():
    """The residual stream crosses from part to part as it is: the same bits as the one-graph
    step."""
    spec = _random_smollm2()
    cfg = dict(max_requests=4, chunk_size=16, device="cuda", dtype=torch.bfloat16, layer_group=4)
    prompts = (tuple(range(40, 49)), tuple(range(300, 330)))
    *_, whole, _ = launch.run(spec, 1, engine_config(**cfg), _Prompts(prompts, 2, layers_out=False))
    *_, parts, captured = launch.run(spec, 1, engine_config(**cfg), _Prompts(prompts, 2))
    assert "prefill (and in 8 parts of <= 4 layers)" in captured  # SmolLM2's 30 layers
    for a, b in zip(whole, parts):
        assert torch.equal(a, b), (a - b).abs().max().item()
