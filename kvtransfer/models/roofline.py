"""What a decode step cannot beat: reading every weight once at the device's copy bandwidth.

``generate --stats`` on CUDA prints the batch-1 decode step next to this floor: the weights a
step reads (every layer's, the final norm and the LM head; the embedding rows looked up are
negligible) over the bandwidth of a large device-to-device copy measured on the spot (bytes
read plus bytes written, over the median of several copies timed with CUDA events).
"""

from __future__ import annotations

import math
import statistics

import torch


def step_weight_bytes(spec, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads at ``dtype`` (TP 1)."""
    weights = spec.weights
    shapes = getattr(weights, "shapes", None) or {k: tuple(v.shape) for k, v in weights.items()}
    tied = "lm_head" not in shapes
    elements = sum(math.prod(s) for name, s in shapes.items() if tied or name != "embed")
    return elements * torch.empty((), dtype=dtype).element_size()


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a ``nbytes`` device-to-device copy (read + written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return 2 * nbytes / statistics.median(times)
