"""Time the decode step's matmuls at batch 1-4 (SmolLM2-135M and Llama-3-8B shapes, bf16):
cuBLAS through F.linear against the Triton matrix-vector kernel (kvtransfer.models.fused),
each as launches captured in a CUDA graph, weights rotated through copies of 256 MiB in all
(more than any L2) so they are read from memory. Prints microseconds per call.

    PYTHONPATH=. python3 bench/probes/small_linear.py
"""

import torch
import torch.nn.functional as F

from kvtransfer.models.fused import small_linear

SHAPES = {"smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576),
          "smollm2 down": (576, 1536), "llama3 qkv": (6144, 4096), "llama3 down": (4096, 14336)}


def per_call_us(fn, xs, ws) -> float:
    for x, w in zip(xs, ws):
        fn(x, w)
    torch.cuda.synchronize()
    calls = max(50, len(ws))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    g.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / (10 * calls)


L2_SPILL_BYTES = 256 << 20  # weights rotated through copies of this many bytes in all: read from memory
CONFIGS = [(bn, bk, nw) for bn in (4, 8, 16, 32) for bk in (64, 128, 256, 512) for nw in (1, 2, 4)]


def main():
    """Per shape and row count: cuBLAS, torch.mv (M=1), and the kernel's three fastest tilings
    (block_n x block_k, warps) of :data:`CONFIGS`."""
    for name, (n, k) in SHAPES.items():
        copies = max(8, -(-L2_SPILL_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for m in (1, 2, 4):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
            err = ((small_linear(xs[0], ws[0]).float() - F.linear(xs[0], ws[0]).float()).norm()
                   / F.linear(xs[0], ws[0]).float().norm()).item()
            row = [f"{name:16s} M={m}", f"cublas {per_call_us(F.linear, xs, ws):6.2f}"]
            if m == 1:
                row.append(f"mv {per_call_us(lambda x, w: torch.mv(w, x[0]), xs, ws):6.2f}")
            times = sorted((per_call_us(lambda x, w: small_linear(x, w, bn, bk, nw), xs, ws), bn, bk, nw)
                           for bn, bk, nw in CONFIGS)
            row += [f"gemv{bn}x{bk}w{nw} {t:6.2f}" for t, bn, bk, nw in times[:3]]
            print("  ".join(row), f"err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
