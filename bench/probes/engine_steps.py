"""Engine speed on one GPU with SmolLM2-135M's shape and random weights, in a form that runs on
trees with and without the decode runner (so one call measures before and after):

    PYTHONPATH=<tree> python3 bench/probes/engine_steps.py [--profile]

Prints decode tok/s for one request (32-token prompt, 200 new tokens), the median of five
1,000-token prefills (one chunk), and decode tok/s for 64 requests (32-token prompts, 128 new
tokens each, ``--new64``). ``--profile`` adds the kernels of one eager batch-1 decode forward (torch
profiler) and the replay time of the captured batch-1 and batch-64 steps (CUDA events).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtransfer.models import launch
from kvtransfer.models.config import EngineConfig, LlamaConfig, ModelName
from kvtransfer.models.engine import Engine, EngineStats
from kvtransfer.models.registry import ModelSpec

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
             num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5, max_context_len=8192)


def spec() -> ModelSpec:
    cfg = LlamaConfig(**SHAPE)
    g = torch.Generator().manual_seed(0)
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    w = {"embed": torch.randn(cfg.vocab_size, h, generator=g), "norm": torch.ones(h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name, shape in (("q", (cfg.num_heads * d, h)), ("k", (cfg.num_kv_heads * d, h)),
                            ("v", (cfg.num_kv_heads * d, h)), ("o", (h, cfg.num_heads * d)),
                            ("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
            w[p + name] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        w[p + "attn_norm"], w[p + "ffn_norm"] = torch.ones(h), torch.ones(h)
    return ModelSpec(ModelName.SMOLLM2, cfg, w)


class Measure:
    def __init__(self, profile: bool, new64: int):
        self.profile, self.new64 = profile, new64

    def __call__(self, engine: Engine) -> dict:
        gen = torch.Generator().manual_seed(1)

        def prompt(n):
            return torch.randint(0, 49000, (n,), generator=gen).tolist()

        engine.add(prompt(8), 4)
        engine.run()
        out = {}
        engine.stats = EngineStats()
        engine.add(prompt(32), 200)
        engine.run()
        out["decode_1"] = engine.stats.rate(engine.stats.decode_tokens, engine.stats.decode_s)
        prefill = []
        for _ in range(5):
            engine.stats = EngineStats()
            engine.add(prompt(1000), 1)
            engine.run()
            prefill.append(engine.stats.prefill_s * 1e3)
        out["prefill_1000_ms"] = statistics.median(prefill)
        engine.stats = EngineStats()
        for _ in range(64):
            engine.add(prompt(32), self.new64)
        t0 = time.perf_counter()
        engine.run()
        out["decode_64"] = engine.stats.rate(engine.stats.decode_tokens, engine.stats.decode_s)
        out["run_64_s"] = time.perf_counter() - t0
        if self.profile:
            out.update(profile(engine))
        return out


def profile(engine: Engine) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kvtransfer.models.batch import DecodeInputs

    runner = engine.graphs
    dev = engine.model.device
    n = 1
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    pos = torch.full((n,), 100, dtype=torch.int64, device=dev)
    inputs = DecodeInputs(ids, pos, torch.zeros(n, dtype=torch.int64, device=dev),
                          torch.zeros(n, dtype=torch.int64, device=dev), (pos + 1).to(torch.int32), 32)
    engine.model.forward_decode(inputs, engine.pools)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.model.forward_decode(inputs, engine.pools)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events)
    top = sorted(events, key=lambda e: -e.device_time_total)[:14]
    print(f"eager batch-1 forward_decode: {kernels} kernels")
    for e in top:
        print(f"  {e.device_time_total:9.1f} us  x{e.count:4d}  {e.key[:90]}")
    out = {}
    for key in (("decode", 1), ("decode", 64), ("prefill", 1024)):
        if key not in runner._graphs:
            continue
        g = runner._graphs[key]
        for _ in range(3):
            g.replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            g.replay()
        stop.record()
        stop.synchronize()
        out[f"replay_{key[0]}_{key[1]}_ms"] = start.elapsed_time(stop) / 50
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gemv-rows", type=int, default=0,
                    help="decode batches up to this size use the Triton matrix-vector kernel")
    ap.add_argument("--new64", type=int, default=128, help="new tokens of each of the 64 requests")
    args = ap.parse_args()
    from kvtransfer.models import fused

    fused.DECODE_GEMV_ROWS = args.gemv_rows
    ec = EngineConfig(max_tokens=64 * 400, page_size=16, max_requests=64, chunk_size=1024, dtype=torch.bfloat16,
                      device="cuda")
    out = launch.run(spec(), 1, ec, Measure(args.profile, args.new64))
    print(f"{torch.cuda.get_device_name()} bf16 SmolLM2-135M shape, random weights: "
          + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
