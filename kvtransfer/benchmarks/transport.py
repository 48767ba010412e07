"""``kvtransfer bench transport``: NIXL write throughput, kvtransfer's transport vs bare NIXL.

Two processes on one host. The receiver (spawned) owns a ``--total`` destination buffer in a
:class:`NixlTransport` and polls notifications (which drives UCX progress). The writer, in this
process, holds two agents connected to it: kvtransfer's ``NixlTransport`` and a bare
``nixl_agent`` driven with direct ``_api`` calls. For each block size the same write -- the
whole source as ``total / block`` blocks to a random permutation of destination blocks, with
a notification -- runs through both, alternating, ``--iters`` times; the report shows median
GB/s and kvtransfer's overhead (its median time over bare NIXL's, minus one). Then the fixed
cost per write: ``--fixed-entries`` descriptors of 2 KiB with a notification through both,
alternated ``--fixed-reps`` times: call to ``wait()`` returned on the writer, and call to the
notification seen by the receiver (which polls every 20 us; both processes read the same
monotonic clock). Medians, and kvtransfer's difference to bare NIXL. ``--mooncake`` adds
Mooncake's Transfer Engine (tcp) as a third path of the fixed cost, alternated with the other
two (:mod:`kvtransfer.benchmarks._mooncake`; ``bench/mooncake.sh`` sets it up and runs it).

``--cuda`` puts the source on cuda:0 and the destination on cuda:1 (UCX cuda_ipc) and adds
torch's peer copy of the same total (one ``copy_`` from cuda:0 to cuda:1) as a reference.

``--kv`` instead writes one planned KV request's batch staged, direct and as blocks
(:mod:`kvtransfer.benchmarks.transport_kv`); with ``--two-hosts`` between two network namespaces.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvtransfer._args import HelpFormatter, description, positive_int
from kvtransfer._procs import Child, ChildFailed, report_failure
from kvtransfer.benchmarks._report import time_once
from transport.base import Transfer, WriteBatch
from transport.nixl import NixlConfig, NixlTransport

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HOST_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm"}
CUDA_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm,cuda_copy,cuda_ipc"}
READY_TIMEOUT_S = 120.0  # the receiver's start: spawn, imports, UCX, the buffer (CUDA init)
DIGEST_TIMEOUT_S = 300.0  # a digest of up to --total bytes (a GPU buffer copied to the host)


# -- the pipe between this process and the receiver: one frozen dataclass per message ----------


@dataclass(frozen=True)
class Ready:
    export: bytes  # the receiver's transport export
    mooncake: str = ""  # with --mooncake: the receiver's Transfer Engine session (host:port)


@dataclass(frozen=True)
class DigestRequest:
    pass


@dataclass(frozen=True)
class Digest:
    sha256: str  # of the whole destination buffer


@dataclass(frozen=True)
class SeenRequest:
    payloads: tuple  # the notifications asked about (a notification comes after its write is DONE)


@dataclass(frozen=True)
class Seen:
    times: dict  # notification payload -> time.monotonic() when the receiver saw it


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class Bye:
    pass


def _receiver(conn, total: int, cuda: bool, env: dict, progress_thread: bool, staged=None, gpu: int = 1,
              mooncake: bool = False) -> None:
    """Own the destination buffer (on GPU ``gpu`` with ``cuda``); poll notifications until told
    to quit. ``staged``: the receiver's ``StagedNixlConfig`` (the staging lanes it grants), None:
    the default. ``mooncake``: the buffer is also registered with a Mooncake Transfer Engine,
    whose notifications are polled too."""
    try:
        _receive(conn, total, cuda, env, progress_thread, staged, gpu, mooncake)
    except Exception as exc:  # the parent names it instead of waiting on a dead pipe
        report_failure(conn, exc)
        raise SystemExit(1) from None


def _receive(conn, total: int, cuda: bool, env: dict, progress_thread: bool, staged=None, gpu: int = 1,
             mooncake: bool = False) -> None:
    from kvtransfer.control.event_loop import precise_sleeps

    os.environ.update(env)
    precise_sleeps()  # its 20 us pauses between polls last 20 us, not 70
    if cuda:
        import torch

        torch.cuda.set_device(gpu)
        dst = torch.zeros(total, dtype=torch.uint8, device=f"cuda:{gpu}")  # [total] bytes
        torch.cuda.synchronize()
    else:
        dst = np.ones(total, dtype=np.uint8)  # [total] bytes, touched so pages exist
    config = NixlConfig(progress_thread=progress_thread) if staged is None else \
        NixlConfig(progress_thread=progress_thread, staged=staged)
    with NixlTransport(config) as transport:
        if cuda:
            transport.register_tensor(dst)
        else:
            transport.register(dst.ctypes.data, dst.nbytes)
        engine = None
        if mooncake:
            from kvtransfer.benchmarks._mooncake import MooncakeEngine

            engine = MooncakeEngine()
            engine.register(dst.ctypes.data, dst.nbytes)
        conn.send(Ready(transport.export(), engine.session if engine else ""))
        seen = {}  # the fixed-cost writes' notifications: when each was seen
        asked, answer_by = None, 0.0  # a SeenRequest waiting for its notifications, until then
        while True:
            notes = [note.payload for note in transport.poll_notifications()]
            if engine is not None:
                notes += engine.notifications()
            now = time.monotonic()
            for payload in notes:
                if payload.startswith(SEEN_TAG):
                    seen[payload] = now
            if asked is not None and (asked.issubset(seen) or now > answer_by):
                conn.send(Seen(seen))
                seen, asked = {}, None
            if not notes:
                time.sleep(2e-5)
            if not conn.poll(0):
                continue
            msg = conn.recv()
            if isinstance(msg, Quit):
                break
            if isinstance(msg, SeenRequest):
                asked, answer_by = set(msg.payloads), time.monotonic() + SEEN_WAIT_S
                continue
            if not isinstance(msg, DigestRequest):
                raise TypeError(f"receiver: expected DigestRequest, SeenRequest or Quit, got {type(msg).__name__}")
            conn.send(Digest(hashlib.sha256(_host_bytes(dst)).hexdigest()))
    conn.send(Bye())


def _host_bytes(buf) -> memoryview:
    """A host view of a numpy array or a (CUDA) torch tensor of bytes."""
    if isinstance(buf, np.ndarray):
        return memoryview(buf)
    return memoryview(buf.cpu().numpy())


class _Bare:
    """The same write through direct NIXL ``_api`` calls: the baseline."""

    def __init__(self, api, src_ptr: int, total: int, device: int | None, peer_meta: bytes, progress_thread: bool):
        self.agent = api.nixl_agent(
            f"bench-bare-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        self.mem = "DRAM" if device is None else "VRAM"
        self.dev = 0 if device is None else device
        self.reg = self.agent.register_memory(np.array([[src_ptr, total, self.dev]], dtype=np.uint64), self.mem)
        self.peer = self.agent.add_remote_agent(peer_meta)
        self.peer = self.peer.decode() if isinstance(self.peer, bytes) else self.peer

    def write(self, local: np.ndarray, remote: np.ndarray, notify: bytes) -> None:
        a = self.agent
        h = a.initialize_xfer("WRITE", a.get_xfer_descs(local, self.mem), a.get_xfer_descs(remote, self.mem), self.peer, notify)
        state = a.transfer(h)
        sleep, spin_end = 0.0, time.monotonic() + Transfer.spin_s
        while state == "PROC":  # the same polling as Transfer.wait: back to back at first, then a
            if time.monotonic() < spin_end:  # back-off (a long tight spin here starves the
                os.sched_yield()  # receiver of a core on a 2-core machine and makes NIXL look slower)
            else:
                if sleep:
                    time.sleep(sleep)
                sleep = min(1e-3, sleep * 2 or 1e-5)
            state = a.check_xfer_state(h)
        h.release()
        if state != "DONE":
            raise RuntimeError(f"bare NIXL transfer ended in {state}")

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)
        self.agent.remove_remote_agent(self.peer)


def _descs(base: int, offsets: np.ndarray, block: int, dev: int) -> np.ndarray:
    out = np.empty((offsets.size, 3), dtype=np.uint64)  # [n, (addr, len, dev)]
    out[:, 0] = base + offsets.astype(np.uint64)
    out[:, 1] = block
    out[:, 2] = dev
    return out




def run(args) -> list[dict]:
    for key, value in (CUDA_ENV if args.cuda else HOST_ENV).items():
        os.environ.setdefault(key, value)
    if args.cuda and "cuda_ipc" not in os.environ["UCX_TLS"]:
        os.environ["UCX_TLS"] += ",cuda_copy,cuda_ipc"
    from transport._nixl_import import load_nixl_api

    api = load_nixl_api()
    total = args.total
    if args.cuda:
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit("--cuda needs two CUDA GPUs")
        torch.cuda.set_device(0)
        src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda:0")  # [total] bytes
        torch.cuda.synchronize()
        src_ptr, device = src.data_ptr(), 0
    else:
        src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)  # [total] bytes
        src_ptr, device = src.ctypes.data, None
    receiver = Child.spawn(_receiver, (total, args.cuda, dict(os.environ), args.progress_thread, None, 1,
                                       args.mooncake), name="receiver")
    rows = []
    try:
        ready = receiver.recv(Ready, "its export", READY_TIMEOUT_S)
        peer_bytes = ready.export
        mooncake = None  # (this side's Transfer Engine, the receiver's session)
        if args.mooncake:
            from kvtransfer.benchmarks._mooncake import MooncakeEngine

            mooncake = (MooncakeEngine(), ready.mooncake)
            mooncake[0].register(src_ptr, total)
        ours = NixlTransport(NixlConfig(progress_thread=args.progress_thread))
        sid = ours.register(src_ptr, total, device)
        peer = ours.connect(peer_bytes)
        (dst_region,) = peer.regions.values()
        bare = _Bare(api, src_ptr, total, device, _metadata(peer_bytes), args.progress_thread)
        rng = np.random.default_rng(1)
        for block in args.blocks:
            n = total // block
            src_off = np.arange(n, dtype=np.int64) * block  # [n]
            dst_off = rng.permutation(src_off)  # [n]
            dev = 0 if device is None else device

            def ours_write():
                batch = WriteBatch.of(np.full(n, sid), src_off, np.full(n, dst_region.region_id), dst_off, np.full(n, block))
                peer.write(batch, notify=b"ours").wait(120)

            def bare_write():
                local = _descs(src_ptr, src_off, block, dev)
                remote = _descs(dst_region.ptr, dst_off, block, dst_region.device or 0)
                bare.write(local, remote, b"bare")

            ours_write(), bare_write()  # warm-up: connection, page faults
            t_ours, t_bare = [], []
            for _ in range(args.iters):  # alternate so both paths see the same background load
                t_ours.append(time_once(ours_write))
                t_bare.append(time_once(bare_write))
            def checks():  # what kvtransfer adds on top of bare NIXL's descriptor arrays
                batch = WriteBatch.of(np.full(n, sid), src_off, np.full(n, dst_region.region_id), dst_off, np.full(n, block))
                batch.check_bounds(ours.regions, peer.regions)

            row = {
                "checks_ms": 1e3 * statistics.median(time_once(checks) for _ in range(args.iters)),
                "block": block,
                "entries": n,
                "ours_gbps": total / statistics.median(t_ours) / 1e9,
                "bare_gbps": total / statistics.median(t_bare) / 1e9,
                "overhead_pct": (statistics.median(t_ours) / statistics.median(t_bare) - 1) * 100,
            }
            # both paths wrote the same permutation: destination block dst_off[i] holds source block i
            want = np.empty(total, dtype=np.uint8)
            want.reshape(n, block)[dst_off // block] = np.frombuffer(_host_bytes(src), np.uint8).reshape(n, block)
            receiver.send(DigestRequest())
            row["verified"] = receiver.recv(Digest, "the destination's digest", DIGEST_TIMEOUT_S).sha256 == \
                hashlib.sha256(want).hexdigest()
            del want
            if not row["verified"]:
                raise RuntimeError(f"destination bytes differ from the source permutation ({block} B blocks)")
            if args.cuda:
                dst2 = torch.empty(total, dtype=torch.uint8, device="cuda:1")

                def peer_copy():
                    dst2.copy_(src)
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)

                peer_copy()
                row["torch_peer_copy_gbps"] = total / statistics.median(time_once(peer_copy) for _ in range(args.iters)) / 1e9
                del dst2
            rows.append(row)
            print(_format(row, args.cuda), flush=True)
        for entries in args.fixed_entries:
            if entries * FIXED_SPACING > total:
                print(f"fixed cost per write, {entries} x {FIXED_BLOCK // KiB} KiB: skipped (--total holds "
                      f"{total // FIXED_SPACING} rows {FIXED_SPACING // KiB} KiB apart)", flush=True)
                continue
            fixed = _fixed_cost(peer, sid, dst_region, bare, src_ptr, device, entries, args.fixed_reps, receiver,
                                mooncake)
            print(_format_fixed(fixed), flush=True)
        bare.close()
        ours.close()
    finally:
        receiver.stop(Quit())
    return rows


FIXED_BLOCK = 2 * KiB  # a token row of the Llama-3-70B preset (8 KV heads x 128 bf16)
FIXED_SPACING = 16 * KiB  # between the rows of one write: none adjacent, so none merge into one descriptor
SEEN_TAG = b"seen-"  # the payloads whose arrival the receiver times
SEEN_WAIT_S = 30.0  # how long the receiver waits for the notifications asked about before it answers


def _fixed_cost(peer, sid: int, dst_region, bare, src_ptr: int, device, entries: int, reps: int, receiver,
                mooncake=None) -> dict:
    """The fixed cost of a write: ``entries`` descriptors of :data:`FIXED_BLOCK` bytes
    (:data:`FIXED_SPACING` apart, the destination in reverse order) with a notification,
    through kvtransfer's transport (``peer``; a ``WriteBatch`` made beforehand), through bare
    NIXL (its descriptor arrays made beforehand) and, with ``mooncake`` (an engine and the
    receiver's session), through Mooncake's Transfer Engine, alternated ``reps`` times: call to
    ``wait()`` (Mooncake: its synchronous batch) returned on the writer, and call to the
    notification seen by the receiver (its times asked for afterwards). Medians in
    microseconds; the bytes themselves take well under a microsecond."""
    src_off = np.arange(entries, dtype=np.int64) * FIXED_SPACING  # [entries]
    dst_off = src_off[::-1].copy()
    dev = 0 if device is None else device
    local, remote = _descs(src_ptr, src_off, FIXED_BLOCK, dev), _descs(dst_region.ptr, dst_off, FIXED_BLOCK,
                                                                       dst_region.device or 0)

    batch = WriteBatch.of(np.full(entries, sid), src_off, np.full(entries, dst_region.region_id), dst_off,
                          np.full(entries, FIXED_BLOCK))  # made once, as bare NIXL's descriptor arrays
    called = {}  # payload -> time.monotonic() of the call

    def ours_write(tag: bytes = b"warm-up"):
        called[tag] = time.monotonic()
        peer.write(batch, notify=tag).wait(120)

    def bare_write(tag: bytes = b"warm-up"):
        called[tag] = time.monotonic()
        bare.write(local, remote, tag)

    writes = {b"ours": ours_write, b"bare": bare_write}
    if mooncake is not None:
        engine, session = mooncake
        mc_src = [int(a) for a in local[:, 0]]
        mc_dst = [int(a) for a in remote[:, 0]]
        mc_len = [FIXED_BLOCK] * entries

        def mooncake_write(tag: bytes = b"warm-up"):
            called[tag] = time.monotonic()
            engine.write(session, mc_src, mc_dst, mc_len, tag)

        writes[b"mooncake"] = mooncake_write
    for _ in range(3):  # warm-up: the descriptor lists' first use, Mooncake's handshake
        for write in writes.values():
            write()
    times = {path: [] for path in writes}
    for i in range(reps):
        for path, write in writes.items():
            times[path].append(time_once(lambda: write(SEEN_TAG + path + b"-%d" % i)))
    tags = {path: [SEEN_TAG + path + b"-%d" % i for i in range(reps)] for path in writes}
    receiver.send(SeenRequest(tuple(t for path in writes for t in tags[path])))
    seen = receiver.recv(Seen, "when it saw the notifications", SEEN_WAIT_S + READY_TIMEOUT_S).times

    def seen_us(path: bytes) -> float:
        missing = [t for t in tags[path] if t not in seen]
        if missing:
            raise RuntimeError(f"the receiver saw no notification {missing[0]!r} ({len(missing)} of {reps} missing)")
        return statistics.median(seen[t] - called[t] for t in tags[path]) * 1e6

    row = {"entries": entries, "reps": reps}
    for path in writes:
        name = path.decode()
        row[f"{name}_us"] = statistics.median(times[path]) * 1e6
        row[f"{name}_seen_us"] = seen_us(path)
    return row


def _format_fixed(row: dict) -> str:
    return (f"fixed cost per write, {row['entries']} x {FIXED_BLOCK // KiB} KiB with a notification (median of "
            f"{row['reps']}): call -> wait() returned: kvtransfer {row['ours_us']:.1f} us, bare NIXL "
            f"{row['bare_us']:.1f} us ({row['ours_us'] - row['bare_us']:+.1f} us); call -> the receiver saw it: "
            f"kvtransfer {row['ours_seen_us']:.1f} us, bare NIXL {row['bare_seen_us']:.1f} us "
            f"({row['ours_seen_us'] - row['bare_seen_us']:+.1f} us)"
            + (f"; Mooncake TE (tcp): returned {row['mooncake_us']:.1f} us, the receiver saw it "
               f"{row['mooncake_seen_us']:.1f} us" if "mooncake_us" in row else ""))


def _metadata(peer_bytes: bytes) -> bytes:
    import msgpack

    return msgpack.unpackb(peer_bytes)["metadata"]


def _size(text: str) -> int:
    """``"16K"``, ``"4MiB"``, ``"1G"`` or plain bytes -> bytes."""
    units = {"k": KiB, "m": MiB, "g": GiB}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t[-1:] in units else int(t)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected a size like 16K, 4M or 1G, got {text!r}") from None


def _format(row: dict, cuda: bool) -> str:
    line = (
        f"{row['block'] // KiB:>8} KiB x {row['entries']:>6}  kvtransfer {row['ours_gbps']:6.2f} GB/s  "
        f"bare NIXL {row['bare_gbps']:6.2f} GB/s  overhead {row['overhead_pct']:+5.1f} % "
        f"(batch checks {row['checks_ms']:.1f} ms)  "
        f"data {'ok' if row['verified'] else 'WRONG'}"
    )
    if cuda:
        line += f"  torch peer copy {row['torch_peer_copy_gbps']:6.2f} GB/s"
    return line


def record_variant(argv) -> str:
    """The kind of a ``--record`` run in bench/RESULTS.md: blocks or a KV request, and where."""
    memory = "GPU" if "--cuda" in argv else "host memory"
    if "--kv" not in argv:
        return f"blocks, {memory}"
    return "KV request, two hosts" if "--two-hosts" in argv else f"KV request, {memory}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtransfer bench transport", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    parser.add_argument("--total", type=_size, default=GiB, help="bytes per write (default 1G)")
    parser.add_argument("--blocks", type=lambda s: [_size(x) for x in s.split(",")], default=None,
                        help="block sizes, e.g. 256K,16K (default: 256K,16K; with --cuda 16K,256K,4M,64M)")
    parser.add_argument("--iters", type=positive_int, default=5, help="timed writes per path and block size")
    parser.add_argument("--cuda", action="store_true", help="cuda:0 -> cuda:1 (two GPUs)")
    parser.add_argument("--progress-thread", action="store_true", help="run NIXL's progress thread")
    parser.add_argument("--fixed-entries", type=lambda s: [int(x) for x in s.split(",")], default=[1, 160],
                        help="descriptors of 2 KiB per write for the fixed cost per write (default 1,160: one row, "
                             "one token's row in each of 160 buffers)")
    parser.add_argument("--fixed-reps", type=positive_int, default=51, help="writes per path for the fixed cost")
    parser.add_argument("--mooncake", action="store_true",
                        help="host memory: Mooncake's Transfer Engine (tcp) as a third path of the fixed cost per "
                             "write (the mooncake-transfer-engine wheel; bench/mooncake.sh sets it up)")
    parser.add_argument("--kv", action="store_true",
                        help="a planned KV request: staged vs direct NIXL vs --block blocks (transport_kv)")
    parser.add_argument("--block", type=_size, default=None,
                        help="with --kv: block size of the blocks rate (default 256K; with --cuda 64M)")
    parser.add_argument("--slot-bytes", type=_size, default=None,
                        help="with --kv: staging slot size (default: StagedNixlConfig's, 4M on the host and "
                             "128M for GPU memory)")
    parser.add_argument("--slots", type=positive_int, default=4, help="with --kv: staging slots per lane")
    parser.add_argument("--wire-gather-bytes", type=_size, default=None,
                        help="with --kv on host memory: StagedNixlConfig.wire_gather_bytes (default: its default)")
    parser.add_argument("--two-hosts", action="store_true",
                        help="with --kv, host memory: the writer and the receiver in two network namespaces, NIXL "
                             "over tcp on a veth pair between them (root; kvtransfer.netns)")
    parser.add_argument("--request", choices=("demo", "page1", "heads"), default=None,
                        help="with --kv: only this request (default: demo on the host; page1 and heads with --cuda)")
    args = parser.parse_args(argv)
    if args.two_hosts and (args.cuda or not args.kv):
        parser.error("--two-hosts goes with --kv on host memory (not --cuda)")
    if args.mooncake and (args.cuda or args.kv):
        parser.error("--mooncake times the fixed cost per write on host memory (not with --cuda or --kv)")
    if args.kv:
        return _main_kv(args)
    if args.blocks is None:
        args.blocks = [16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB] if args.cuda else [256 * KiB, 16 * KiB]
    if args.total <= 0:
        parser.error(f"--total must be a positive size, got {args.total}")
    bad = [b for b in args.blocks if b <= 0 or args.total % b]
    if bad:
        parser.error(f"block sizes must divide --total ({args.total}); got blocks {bad}")
    if any(n <= 0 for n in args.fixed_entries):
        parser.error(f"--fixed-entries must be counts > 0, got {args.fixed_entries}")
    if args.mooncake:
        from kvtransfer.benchmarks._mooncake import unavailable

        why = unavailable()
        if why:
            print(f"kvtransfer bench transport: {why}", file=sys.stderr)
            return 2
    where = "cuda:0 -> cuda:1" if args.cuda else "host -> host (loopback)"
    print(f"NIXL transport, {where}, {args.total / GiB:.2f} GiB per write, median of {args.iters}, "
          f"progress thread {'on' if args.progress_thread else 'off'}", flush=True)
    try:
        run(args)
    except ChildFailed as exc:
        print(f"kvtransfer bench transport failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _main_kv(args) -> int:
    from kvtransfer.benchmarks.transport_kv import run_kv, run_kv_two_hosts
    from kvtransfer.netns import netns_unavailable

    for key, value in (CUDA_ENV if args.cuda else HOST_ENV).items():
        os.environ.setdefault(key, value)
    if args.cuda and "cuda_ipc" not in os.environ["UCX_TLS"]:
        os.environ["UCX_TLS"] += ",cuda_copy,cuda_ipc"
    if args.block is None:
        args.block = 64 * MiB if args.cuda else 256 * KiB
    if args.two_hosts:
        why = netns_unavailable()
        if why:
            print(f"kvtransfer bench transport: --two-hosts needs network namespaces: {why}", file=sys.stderr)
            return 2
    where = ("cuda:0 -> cuda:1" if args.cuda else "host -> host, two network namespaces (tcp over veth)"
             if args.two_hosts else "host -> host (loopback)")
    print(f"NIXL staged / direct / blocks, {where}, median of {args.iters}, "
          f"progress thread {'on' if args.progress_thread else 'off'}", flush=True)
    try:
        (run_kv_two_hosts if args.two_hosts else run_kv)(args, sys.modules[__name__])
    except ChildFailed as exc:
        print(f"kvtransfer bench transport failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
