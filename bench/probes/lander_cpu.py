"""Probe (one-off measurement, not a test): the writer's CPU while its copies to N peers wait
behind compute, and how soon each peer sees its notification.

Usage:
    python3 bench/probes/lander_cpu.py [--peers N] [--rounds R] [--behind-us U] [--peer-gpu G] [--spin-us S]

One writer (an nvlink transport on GPU 0) and N receiver processes on GPU ``G``
(``kvtransfer.benchmarks._remote.RemoteBuffers``), each holding one 2 KiB row. Each round queues ``U`` us of
GPU work on the writer's current stream (``torch.cuda._sleep``), posts one one-row
``write_strided`` with a notification to every peer behind it -- the copies wait for that work,
as a prefill's layer-wise writes wait for their layer -- and waits for all of them. Prints, over
the rounds: the writer process's CPU seconds per wall second, split into the calling thread and
the others (by name, from ``/proc/self/task``: the landers' thread is ``kvt-lander``, where its
C names it), and the medians from the end of each round's GPU work to the last peer's
notification (the receivers stamp arrivals on the host's monotonic clock, polling without
sleeping; the end of the work on the host clock as ``kvtransfer bench nvlink``'s ``behind us``)
and to the return of the round's last ``wait()``. ``--spin-us`` sets ``NvlinkConfig.lander_spin_us``
(how long the landers' thread looks before it naps; the configuration's default when left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from transport.base import StridedBatch
from kvtransfer.benchmarks._remote import RemoteBuffers, make_transport

ROW = 2048


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name and CPU seconds so far, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = ("main" if int(tid) == os.getpid() else name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--behind-us", type=float, default=1000.0, help="GPU work queued before each round's writes")
    ap.add_argument("--peer-gpu", type=int, default=1)
    ap.add_argument("--native", choices=("c", "python"), default="c", help="the direct path's host steps")
    ap.add_argument("--spin-us", type=int, default=None, help="NvlinkConfig.lander_spin_us")
    args = ap.parse_args()

    torch.cuda.set_device(0)
    spin = {} if args.spin_us is None else {"lander_spin_us": args.spin_us}
    transport = make_transport("nvlink", native=args.native == "c", **spin)
    src = torch.full((ROW,), 7, dtype=torch.uint8, device="cuda:0")
    src_rid = transport.register_tensor(src)
    remotes = [RemoteBuffers(args.peer_gpu) for _ in range(args.peers)]
    peers, dst = [], []
    for remote in remotes:
        dst.append(remote.alloc([ROW], 0)[0])
        peers.append(transport.connect(remote.export()["nvlink"]))
    batches = [StridedBatch.of(src_rid, 0, ROW, d, 0, ROW, ROW, [0], [0]) for d in dst]
    cycles = int(args.behind_us * torch.cuda.get_device_properties(0).clock_rate / 1e3)  # clock_rate: kHz
    clock = torch.cuda.Stream()
    warmup = 20
    tags = [[f"r{r} p{p}".encode() for p in range(args.peers)] for r in range(warmup + args.rounds)]
    for p, remote in enumerate(remotes):
        remote.start_stamp_notify([t[p] for t in tags], 300.0, ("nvlink",))
    time.sleep(0.1)  # the receivers poll before the first write
    ends, waited = [], []
    for r, round_tags in enumerate(tags):
        if r == warmup:
            wall0, cpu0, main0, threads0 = time.monotonic(), time.process_time(), time.thread_time(), thread_cpu()
        done, mark = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        done.record()
        transfers = [peer.write_strided(b, tag) for peer, b, tag in zip(peers, batches, round_tags)]
        t_mark = time.monotonic()
        mark.record(clock)
        for t in transfers:
            t.wait(timeout=60)
        waited.append(time.monotonic())
        done.synchronize()
        ends.append(t_mark + mark.elapsed_time(done) / 1e3)
    wall, cpu, main_cpu = time.monotonic() - wall0, time.process_time() - cpu0, time.thread_time() - main0
    threads = [(name, v - threads0.get(tid, ("", 0.0))[1]) for tid, (name, v) in thread_cpu().items()]
    stamps = {}
    for remote in remotes:
        stamps.update(remote.result("stamp_notify"))
    last = [max(stamps[t][1] for t in round_tags) - end for round_tags, end in zip(tags[warmup:], ends[warmup:])]
    settled = [w - end for w, end in zip(waited[warmup:], ends[warmup:])]
    print(f"{args.peers} peers, {args.rounds} rounds, {args.behind_us:.0f} us of work before each, host steps "
          f"{args.native}, lander window {transport.config.lander_spin_us} us: wall {wall:.2f} s; writer CPU {cpu / wall:.2f} s per s (calling thread {main_cpu / wall:.2f}, "
          f"others {(cpu - main_cpu) / wall:.2f}); last peer's notification {statistics.median(last) * 1e6:.1f} us "
          f"after the work (median; p90 {statistics.quantiles(last, n=10)[-1] * 1e6:.1f}); every wait() returned "
          f"{statistics.median(settled) * 1e6:.1f} us after it")
    busy = sorted(((v, name) for name, v in threads if name != "main" and v / wall >= 0.02), reverse=True)
    print(f"  other threads over 2% CPU ({len(threads) - 1} threads): "
          + (", ".join(f"{name} {v / wall:.2f}" for v, name in busy) or "none"))
    for peer in peers:
        peer.close()
    transport.close()
    for remote in remotes:
        remote.close()


if __name__ == "__main__":
    main()
