"""Probe (one-off measurement, not a test): how late does a thread waiting on a CUDA event see
it complete, by how long it waited and how it waits?

Usage:
    python3 bench/probes/event_wakeup.py [--reps N]     (one GPU)

The nvlink progress thread waits for the oldest copy with ``event.synchronize()`` (the GIL
released). A write posted behind a model's work waits ~1 ms or more, a write on an idle GPU a
few microseconds. Per wait length, the GPU spins that long (``torch.cuda._sleep``), an event is
recorded after it, and a second thread (started right after) waits on it in one of these ways while the main thread
watches the event with ``query()`` in a loop, letting the GIL go between looks (the reference:
it sees the completion within a few microseconds); printed: the medians of (waiter saw it) - (query loop saw it), in microseconds.

- ``synchronize``: ``event.synchronize()`` on a default event (what the progress thread does);
- ``sync blocking``: the same on an event made with ``blocking=True``;
- ``query+sleep(0)``: ``query()`` in a loop, the GIL let go between looks;
- ``query+sleep(20us)``: ``query()`` every 20 us.

Caveat (one H200, Dec 2026): the reference is not neutral. Its loop takes the GIL back at each
look, so a waiter that needs the GIL to return is delayed by it: ``synchronize`` came out 31-79 us
*earlier* than the reference, ``sync blocking`` 49-185 us later, ``query+sleep(20us)`` 18-29 us
later. Read only the order of the ways from it, not the microseconds (bench/RESULTS.md).
"""
import argparse
import statistics
import threading
import time

import torch

WAYS = ("synchronize", "sync blocking", "query+sleep(0)", "query+sleep(20us)")


def wait(way: str, event) -> None:
    if way in ("synchronize", "sync blocking"):
        event.synchronize()
        return
    pause = 0.0 if way == "query+sleep(0)" else 20e-6
    while not event.query():
        time.sleep(pause)


def lateness(way: str, cycles: int, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        event = torch.cuda.Event(blocking=way == "sync blocking")
        event.record()
        saw = []
        waiter = threading.Thread(target=lambda: (wait(way, event), saw.append(time.monotonic())))
        waiter.start()
        while not event.query():
            time.sleep(0)  # the GIL let go: the waiter takes it as soon as it wakes
        seen = time.monotonic()
        waiter.join()
        out.append((saw[0] - seen) * 1e6)
        time.sleep(1e-3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    per_us = 10_000_000 / (start.elapsed_time(end) * 1e3)  # GPU clock cycles per microsecond
    print(f"event_wakeup: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; {per_us:.0f} cycles/us; "
          f"waiter's lateness behind a query loop, us, median of {args.reps}")
    waits = (300, 1000, 3000, 10000)  # the waiter thread starts well before the end
    print(f"{'way':<20}" + "".join(f"{f'{w} us wait':>14}" for w in waits))
    for way in WAYS:
        cells = [lateness(way, int(w * per_us), args.reps) for w in waits]
        print(f"{way:<20}" + "".join(f"{c:>14.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
