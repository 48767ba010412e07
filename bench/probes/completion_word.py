"""Probe (one-off measurement, not a test): how late another process sees a copy's end, by the
path the transport takes today (the writer's thread spins on the copy's event, then sends on a
Unix socket, the receiver polls the socket) against a word the GPU writes itself
(``cuStreamWriteValue64`` after the copy, into shared host memory registered with CUDA, which
the receiver reads in a loop).

Usage: python3 bench/probes/completion_word.py [--mib M] [--reps N]   (one GPU)

Per rep: the GPU is kept busy ~1 ms first (so the copy's start is not the launch's), then a
copy of ``M`` MiB, an event, the word's write; the writer's thread synchronizes on the event and
sends its sequence number on the socket. The receiver process (no CUDA) spins on both and stamps
each arrival on the host's monotonic clock. Printed: medians (microseconds) of socket arrival
minus word arrival, event seen (writer) minus word arrival, and the cost of the
``cuStreamWriteValue64`` call.
"""
import argparse
import ctypes
import mmap
import multiprocessing
import os
import socket
import statistics
import struct
import time

import numpy as np


def _receiver(path, sock_name, n, conn):
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
    word = np.frombuffer(mm, dtype=np.int64, count=1)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + sock_name)
    srv.listen(1)
    conn.send("ready")
    c, _ = srv.accept()
    c.setblocking(False)
    seen_word, seen_sock = {}, {}
    last = int(word[0])
    buf = b""
    while len(seen_word) < n or len(seen_sock) < n:
        w = int(word[0])
        if w != last:
            now = time.monotonic_ns()
            for s in range(last + 1, w + 1):
                seen_word[s] = now
            last = w
        try:
            chunk = c.recv(4096)
        except BlockingIOError:
            chunk = b""
        if chunk:
            now = time.monotonic_ns()
            buf += chunk
            while len(buf) >= 8:
                (s,) = struct.unpack_from("<q", buf)
                seen_sock[s] = now
                buf = buf[8:]
    conn.send((seen_word, seen_sock))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=320)
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()

    path = f"/dev/shm/kvt-word-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    sock_name = f"kvt-probe-{os.getpid()}"
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(path, sock_name, args.reps, child), daemon=True)
    proc.start()
    if parent.recv() != "ready":
        raise RuntimeError("the receiver process did not start")

    import torch

    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096)
    host = np.frombuffer(mm, dtype=np.int64, count=1)
    ptr = host.ctypes.data
    drv = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")  # context
    reg = drv.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(4096), ctypes.c_uint(1 | 2))
    if reg != 0:
        raise RuntimeError(f"cuMemHostRegister failed: CUresult {reg}")
    dptr = ctypes.c_uint64()
    r = drv.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(ptr), ctypes.c_uint(0))
    if r != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed: CUresult {r}")
    print(f"host 0x{ptr:x} device 0x{dptr.value:x} (same: {ptr == dptr.value})")
    write = None
    for name in ("cuStreamWriteValue64_v2", "cuStreamWriteValue64"):
        if hasattr(drv, name):
            write = getattr(drv, name)
            print("using", name)
            break
    if write is None:
        raise RuntimeError("this libcuda has no cuStreamWriteValue64")
    write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]

    s = torch.cuda.Stream()
    n = args.mib << 20
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty(n, dtype=torch.uint8, device="cuda")
    busy = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out.connect("\0" + sock_name)
    call_ns, sync_at, t0s = [], {}, {}
    for seq in range(1, args.reps + 1):
        with torch.cuda.stream(s):
            for _ in range(20):
                busy.mul_(1)
            ev = torch.cuda.Event()
            b.copy_(a)
            ev.record(s)
            c0 = time.perf_counter_ns()
            rc = write(ctypes.c_void_p(s.cuda_stream), ctypes.c_uint64(dptr.value), ctypes.c_uint64(seq), 0)
            call_ns.append(time.perf_counter_ns() - c0)
            if rc != 0:
                raise RuntimeError(f"cuStreamWriteValue64 failed: CUresult {rc}")
        ev.synchronize()
        sync_at[seq] = time.monotonic_ns()
        out.sendall(struct.pack("<q", seq))
        time.sleep(0.002)
    seen_word, seen_sock = parent.recv()
    proc.join(5)
    sock_minus_word = [(seen_sock[k] - seen_word[k]) / 1e3 for k in seen_word]
    sync_minus_word = [(sync_at[k] - seen_word[k]) / 1e3 for k in seen_word]
    print(f"reps {args.reps}, copy {args.mib} MiB; word value at the end {int(host[0])}")
    print(f"  socket arrival - word arrival   median {statistics.median(sock_minus_word):7.1f} us   "
          f"min {min(sock_minus_word):7.1f}  max {max(sock_minus_word):7.1f}")
    print(f"  event seen (writer) - word       median {statistics.median(sync_minus_word):7.1f} us   "
          f"min {min(sync_minus_word):7.1f}  max {max(sync_minus_word):7.1f}")
    print(f"  cuStreamWriteValue64 call        median {statistics.median(call_ns) / 1e3:7.2f} us")
    drv.cuMemHostUnregister(ctypes.c_void_p(ptr))
    os.unlink(path)


if __name__ == "__main__":
    main()
