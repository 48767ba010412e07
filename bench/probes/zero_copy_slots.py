"""Probe (one-off measurement, not a test): can the direct path's kernel read a write's slots
straight from the pinned host ring, so that the write needs no ``cudaMemcpyAsync`` of them?

Usage:
    python3 bench/probes/zero_copy_slots.py [--reps N]     (one GPU)

The direct path stages each write's ``[2 * S]`` slots in a pinned ring and copies them to a ring
on the GPU (one ``cudaMemcpyAsync``, 5-6 us of the write call's host time on one H200), which
the split kernel reads. Pinned memory is addressable from the GPU (unified addressing), so the
kernel could read the host ring itself. This times the split kernel (CUDA events, the GPU kept
busy before it) reading the slots from the GPU ring and from the pinned ring, alternated, on a
Llama-3-70B-shaped request inside one GPU (80 layers x K, V: 160 buffer pairs, 2 KiB token rows;
page 1, page 16, and 256-byte head slices), and checks both copies land the same bytes.
"""
import argparse
import statistics

import numpy as np
import torch

from transport.nvlink import kernel as kern

LAYERS, TOKEN_BYTES = 80, 2048


def case(tokens: int, page: int, row: int, reps: int, rng) -> str:
    pairs, pool = 2 * LAYERS, 2 * tokens // page  # pages per buffer
    page_bytes = page * TOKEN_BYTES
    src = [torch.randint(0, 256, (pool * page_bytes,), dtype=torch.uint8, device="cuda:0") for _ in range(pairs)]
    dst = [torch.zeros(pool * page_bytes, dtype=torch.uint8, device="cuda:0") for _ in range(pairs)]
    src_base = np.array([t.data_ptr() for t in src], dtype=np.int64)
    dst_base = np.array([t.data_ptr() for t in dst], dtype=np.int64)
    ids = np.arange(pairs, dtype=np.int64)
    length = page_bytes if row == TOKEN_BYTES else row  # a head slice: the first `row` bytes of each page
    pair_arrays = (ids, np.zeros(pairs, np.int64), np.full(pairs, page_bytes, np.int64), ids,
                   np.zeros(pairs, np.int64), np.full(pairs, page_bytes, np.int64), np.full(pairs, length, np.int64))
    n = tokens // page
    s_slot = rng.choice(np.arange(pool), n, replace=False).astype(np.int64)
    d_slot = rng.choice(np.arange(pool), n, replace=False).astype(np.int64)
    empty = np.zeros(0, dtype=np.int64)
    table = kern.build_strided_table(src_base, dst_base, pair_arrays, empty, empty)
    pair_dev = torch.from_numpy(table).to("cuda:0")
    plan = kern.plan_shape(length, kern.choose_path(table), kern.KernelConfig())
    host = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)  # [2 * S]
    host[:n], host[n:] = torch.from_numpy(s_slot), torch.from_numpy(d_slot)
    dev = host.to("cuda:0")
    stream = torch.cuda.current_stream(0)

    def run(slots) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        a.record()
        kern.scatter_strided_split(pair_dev, slots, 0, pairs, n, plan, 0, 4, checked=True, stream=stream)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3

    landed = {}
    for name, slots in (("device", dev), ("pinned", host)):
        for t in dst:
            t.zero_()
        run(slots)
        torch.cuda.synchronize()
        landed[name] = torch.stack([t.view(pool, page_bytes)[:, :length].sum(dtype=torch.int64, dim=1) for t in dst])
    want = torch.stack([t.view(pool, page_bytes)[:, :length].sum(dtype=torch.int64, dim=1) for t in src])
    expect = torch.zeros_like(want)
    expect[:, torch.from_numpy(d_slot).cuda()] = want[:, torch.from_numpy(s_slot).cuda()]
    ok = all(torch.equal(landed[k], expect) for k in landed)
    times = {"device": [], "pinned": []}
    for _ in range(reps):
        times["device"].append(run(dev))
        times["pinned"].append(run(host))
    d, p = statistics.median(times["device"]), statistics.median(times["pinned"])
    mib = pairs * n * length / 2**20
    return (f"{tokens:>6} {page:>5} {length:>7} {n:>6} {mib:>8.1f}  {d:9.1f}  {p:9.1f}  {100 * (p / d - 1):+6.1f}%  "
            f"{'ok' if ok else 'MISMATCH'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    rng = np.random.default_rng(0)
    print(f"zero_copy_slots: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}; split kernel, medians of {args.reps}, us")
    print(f"{'tokens':>6} {'page':>5} {'row B':>7} {'slots':>6} {'MiB':>8}  {'dev ring':>9}  {'pinned':>9}  {'diff':>7}  data")
    for tokens, page, row in ((1024, 1, TOKEN_BYTES), (1024, 16, TOKEN_BYTES), (1024, 1, 256),
                              (4096, 1, TOKEN_BYTES), (4096, 16, TOKEN_BYTES), (4096, 1, 256), (16384, 1, TOKEN_BYTES)):
        print(case(tokens, page, row, args.reps, rng), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
