"""One prompt's prefill on one GPU, the Llama-3-8B-shaped preset (random weights, bf16): a
captured prefill step (its tokens padded to the power-of-two bucket), the same step replayed in
parts of one layer with a layer-wise hook recording a CUDA event after each, an eager step, and
an eager step with the hook after each layer (what a ``--layerwise 1`` prefill node's steps cost
before any write):

    PYTHONPATH=. python3 bench/probes/prefill_graph.py [TOKENS,TOKENS,...]

Each prompt (default 256 ... 4,096 tokens, around the buckets' edges) goes through two engines
sharing the weights (graphs on, also captured in parts of one layer, and off; 4,096-token
chunks), one prompt of one token out, timed between two synchronisations; the four ways
alternate, five rounds, the first dropped; medians in ms.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvtransfer.models import launch, registry
from kvtransfer.models.config import EngineConfig, ModelName
from kvtransfer.models.engine import Engine

COUNTS = [256, 512, 1024, 1025, 2048, 2049, 3072, 4096]
ROUNDS = 5


def main() -> None:
    counts = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else COUNTS
    spec = registry.load(ModelName.LLAMA3_8B)[0]
    model = spec.build(launch.TPGroup(), torch.bfloat16, "cuda")
    engines = {graphs: Engine(model, EngineConfig(max_tokens=20000, page_size=16, max_requests=4, chunk_size=4096,
                                                  dtype=torch.bfloat16, device="cuda", cuda_graphs=graphs,
                                                  layer_group=1 if graphs else 0))
               for graphs in (True, False)}
    events = []

    def on_layers(chunks, end):
        event = torch.cuda.Event()
        event.record()
        events.append(event)

    def once(engine: Engine, n: int, layered: bool) -> float:
        engine.on_layers = on_layers if layered else None
        prompt = [(7 * i + 11) % 50000 + 100 for i in range(n)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add(prompt, 1, layers_out=layered)
        engine.run()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    ways = {"graph": (True, False), "graph parts": (True, True), "eager": (False, False),
            "eager+layers": (False, True)}
    print(f"tokens  {'  '.join(f'{w:>12}' for w in ways)}   parts / graph  (ms, medians of {ROUNDS - 1})")
    for n in counts:
        times = {w: [] for w in ways}
        for round_ in range(ROUNDS):
            for way, (graphs, layered) in ways.items():
                ms = once(engines[graphs], n, layered)
                if round_:
                    times[way].append(ms)
        events.clear()
        med = {w: statistics.median(t) for w, t in times.items()}
        print(f"{n:6d}  {'  '.join(f'{med[w]:12.2f}' for w in ways)}   {med['graph parts'] / med['graph']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
