"""Probe (one-off measurement, not a test): how fast can one process copy scattered rows?

The staged NIXL path's target on one host is half the rate of a write of large blocks (one
copy by the writer's kernel, at memcpy speed). Its request is 65,536 rows of 1 KiB in random
order. This probe times, in one process and one address space, copies of such rows from a
128 MiB source into a 128 MiB destination (random rows on both sides), against a memcpy of the
same 64 MiB:

- ``numpy``: ``dst[d] = src[s]`` over ``void`` rows, 256 rows a step (the staged receiver's
  scatter is this form);
- ``torch``: ``index_select`` then ``index_put_`` over int64 rows, 256 rows a step;
- ``C loop``: one ``memcpy`` per row in a loop compiled here with ``cc`` (skipped without a C
  compiler), on one thread and split over two: one pass over each byte, the least any
  user-space copy of these rows can do.

``--huge-pages``: both buffers in anonymous memory advised ``MADV_HUGEPAGE`` (transparent huge
pages where the kernel allows them for ``madvise``): what a row per TLB miss costs.

Usage: python3 bench/probes/row_copy.py [--rows N] [--row-bytes B] [--repeats R] [--huge-pages]
Prints GB/s (medians) and each form's share of the memcpy rate.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import numpy as np
import torch

C_LOOP = r"""
#include <stdint.h>
#include <string.h>
void copy_rows(char *dst, const char *src, const int64_t *d, const int64_t *s, int64_t n, int64_t len) {
    for (int64_t i = 0; i < n; i++) memcpy(dst + d[i] * len, src + s[i] * len, len);
}
"""


def _c_loop():
    """The compiled loop, or None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tmp = tempfile.mkdtemp(prefix="row_copy_")
    src, lib = os.path.join(tmp, "rows.c"), os.path.join(tmp, "rows.so")
    with open(src, "w") as f:
        f.write(C_LOOP)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    fn = ctypes.CDLL(lib).copy_rows
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    return fn


_HUGE = 2 << 20  # a huge page


def _huge_buffer(nbytes: int, keep: list) -> torch.Tensor:
    """``nbytes`` of anonymous memory advised ``MADV_HUGEPAGE``, aligned to a huge page, as a
    uint8 tensor (the mapping is appended to ``keep``, which must outlive it)."""
    m = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, dtype=np.uint8)
    start = (-whole.ctypes.data) % _HUGE
    m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    keep.append(m)
    return torch.from_numpy(whole[start:start + nbytes])


def _anon_huge_kib() -> int:
    """This process's memory in transparent huge pages (KiB; 0 where the kernel says nothing)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--row-bytes", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--huge-pages", action="store_true", help="both buffers advised MADV_HUGEPAGE")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, width = args.rows, args.row_bytes
    if width % 8:
        raise SystemExit("--row-bytes must be a multiple of 8")
    src = torch.randint(0, 1 << 62, (2 * n, width // 8), dtype=torch.int64)
    dst = torch.zeros_like(src)
    maps: list = []
    if args.huge_pages:
        src = _huge_buffer(src.numel() * 8, maps).view(torch.int64).view(src.shape).copy_(src)
        dst = _huge_buffer(dst.numel() * 8, maps).view(torch.int64).view(dst.shape).zero_()
    gen = torch.Generator().manual_seed(0)
    s_idx, d_idx = torch.randperm(2 * n, generator=gen)[:n], torch.randperm(2 * n, generator=gen)[:n]
    void = np.dtype((np.void, width))
    src_v, dst_v = src.numpy().view(void).reshape(-1), dst.numpy().view(void).reshape(-1)
    s_np, d_np = s_idx.numpy(), d_idx.numpy()
    step = 256

    def memcpy():
        dst[:n].copy_(src[:n])

    def numpy_rows():
        for i in range(0, n, step):
            dst_v[d_np[i:i + step]] = src_v[s_np[i:i + step]]

    def torch_rows():
        for i in range(0, n, step):
            dst.index_put_((d_idx[i:i + step],), src.index_select(0, s_idx[i:i + step]))

    forms = [("memcpy (contiguous)", memcpy), ("numpy void rows", numpy_rows), ("torch int64 rows", torch_rows)]
    loop = _c_loop()
    if loop is not None:
        def c_rows(lo: int, hi: int) -> None:
            loop(dst.data_ptr(), src.data_ptr(), d_idx[lo:].data_ptr(), s_idx[lo:].data_ptr(), hi - lo, width)

        def c_two_threads():
            threads = [threading.Thread(target=c_rows, args=(0, n // 2)), threading.Thread(target=c_rows, args=(n // 2, n))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        forms += [("C loop, one thread", lambda: c_rows(0, n)), ("C loop, two threads", c_two_threads)]
    else:
        print("no C compiler: the C loop is skipped")
    nbytes = n * width
    base = None
    print(f"{n} rows of {width} B ({nbytes / 2**20:.0f} MiB), random rows of {2 * nbytes / 2**20:.0f} MiB on both sides, "
          f"median of {args.repeats}; {os.cpu_count()} cores"
          + (f"; in huge pages: {_anon_huge_kib() // 1024} MiB" if args.huge_pages else ""))
    for name, fn in forms:
        dst.zero_()
        rate = nbytes / _median_s(fn, args.repeats) / 1e9
        base = base or rate
        if name != "memcpy (contiguous)" and not torch.equal(dst[d_idx], src[s_idx]):
            raise RuntimeError(f"{name}: the destination rows differ from the source rows they were copied from")
        print(f"{name:22s} {rate:6.2f} GB/s  {100 * rate / base:5.1f} % of memcpy")


if __name__ == "__main__":
    main()
