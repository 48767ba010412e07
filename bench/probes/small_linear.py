"""Time the decode step's matmuls at batch 1-4 (SmolLM2-135M and Llama-3-8B shapes, bf16):
cuBLAS through F.linear against the Triton matrix-vector kernel (kvtransfer.models.fused),
each as 50 launches captured in a CUDA graph, weights rotated through 8 copies so they are
read from memory. Prints microseconds per call.

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
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(50):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    g.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / 500


def main():
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(8)]
        for m in (1, 2, 4):
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
            err = ((small_linear(xs[0], ws[0]).float() - F.linear(xs[0], ws[0]).float()).norm()
                   / F.linear(xs[0], ws[0]).float().norm()).item()
            row = [f"{name:16s} M={m}", f"cublas {per_call_us(F.linear, xs, ws):6.2f}"]
            for bn, bk in ((8, 256), (16, 256), (32, 128), (16, 512)):
                row.append(f"gemv{bn}x{bk} {per_call_us(lambda x, w: small_linear(x, w, bn, bk), xs, ws):6.2f}")
            print("  ".join(row), f"err {err:.1e}")


if __name__ == "__main__":
    main()
