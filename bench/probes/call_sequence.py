"""Probe (one-off measurement, not a test): what the CUDA calls of one direct write cost on the
host, back to back and with the gaps a write waited for leaves between them.

Usage: python3 bench/probes/call_sequence.py [--reps N] [--gap-us G]   (one GPU)

The sequence is the direct path's (:meth:`transport.nvlink.direct.CopyStream.enqueue_split`):
``cudaGetDevice``, an event recorded on the caller's stream and waited for by the copy stream,
a 16 KiB ``cudaMemcpyAsync`` from pinned memory, a Triton launch (a tiny kernel, through its
compiled launcher as the relauncher calls it), ``torch.cuda.Event()`` and its ``record``. Each
call is timed alone (``perf_counter_ns`` around it), in three settings: back to back, after
sleeping ``G`` us between sequences (a caller that waited in ``wait()``), and after spinning
``G`` us (a caller busy meanwhile). Medians in microseconds.
"""
import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from transport.nvlink import ipc


@triton.jit
def _tiny(x, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n, other=0) + 1, mask=i < n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--gap-us", type=float, default=300.0)
    args = ap.parse_args()
    api = ipc.load_api("auto")
    dev = 0
    torch.cuda.set_device(dev)
    copy = torch.cuda.Stream()
    caller = torch.cuda.current_stream()
    order = api.event_create()
    host = torch.empty(2048, dtype=torch.int64, pin_memory=True)
    ring = torch.empty(2048, dtype=torch.int64, device="cuda")
    x = torch.zeros(128, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(copy):
        compiled = _tiny[(1,)](x, 100, BLOCK=128)
    torch.cuda.synchronize()

    steps = {
        "cudaGetDevice": lambda: api.get_device(),
        "event record (caller stream)": lambda: api.event_record(order, caller.cuda_stream),
        "stream wait event": lambda: api.stream_wait_event(copy.cuda_stream, order),
        "cudaMemcpyAsync 16 KiB pinned": lambda: api.memcpy_async(ring.data_ptr(), host.data_ptr(), 16384,
                                                                  copy.cuda_stream),
        "Triton launcher (compiled.run)": lambda: compiled.run(1, 1, 1, copy.cuda_stream, compiled.function,
                                                               compiled.packed_metadata, None, None, None, x, 100, 128),
        "torch.cuda.Event()": None,  # with its record below
        "event.record(copy stream)": None,
    }
    clock = time.perf_counter_ns

    def sequence(out):
        for name, fn in steps.items():
            if fn is None:
                continue
            t = clock()
            fn()
            out[name].append(clock() - t)
        t = clock()
        ev = torch.cuda.Event()
        t1 = clock()
        ev.record(copy)
        t2 = clock()
        out["torch.cuda.Event()"].append(t1 - t)
        out["event.record(copy stream)"].append(t2 - t1)
        return ev

    def gap_sleep():
        time.sleep(args.gap_us * 1e-6)

    def gap_spin():
        end = time.perf_counter() + args.gap_us * 1e-6
        while time.perf_counter() < end:
            pass

    settings = (("back to back", None), (f"after sleeping {args.gap_us:g} us", gap_sleep),
                (f"after spinning {args.gap_us:g} us", gap_spin))
    results = {}
    for _ in range(2):  # twice, alternated, the first round a warm-up
        for label, gap in settings:
            out = {name: [] for name in steps}
            total = []
            for _ in range(args.reps):
                if gap is not None:
                    gap()
                t = clock()
                ev = sequence(out)
                total.append(clock() - t)
                ev.synchronize()
            results[label] = (out, total)
    print(f"call_sequence: {torch.cuda.get_device_name(dev)}, ipc api {api.name}, triton {triton.__version__}, "
          f"torch {torch.__version__}; medians of {args.reps} (us)")
    labels = [label for label, _ in settings]
    print(f"  {'call':<34}" + "".join(f"{label:>26}" for label in labels))
    for name in steps:
        print(f"  {name:<34}" + "".join(f"{statistics.median(results[l][0][name]) / 1e3:>26.2f}" for l in labels))
    print(f"  {'the whole sequence':<34}" + "".join(f"{statistics.median(results[l][1]) / 1e3:>26.2f}" for l in labels))
    api.event_destroy(order)


if __name__ == "__main__":
    main()
