"""A receiver process holding registered buffers: the far end of two-process checks.

Benchmarks (``kvtransfer bench nvlink``, ``kvtransfer bench transfer``) and the GPU tests write
into another process's memory through a real transport. :class:`RemoteBuffers` spawns that
process, its buffers on one GPU or in host memory (``device=None``, nixl backends only), with a
transport per backend asked for (every backend registers every buffer, so region ids agree)
and drives it through a pipe of typed messages: one frozen dataclass per request, answered by
a :class:`_Reply`. Needs torch in the child (and CUDA for GPU buffers); nothing here runs on
import.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

__all__ = ["RemoteBuffers", "checksums", "digest", "make_transport", "nixl_direct_config", "nixl_staged_config"]

BACKENDS = ("nvlink", "nixl", "nixl-staged")


def _nixl_config(staged: bool):
    """A ``NixlConfig`` with the backend's staged mode on (``staged``) or off, or None when
    ``staged`` is asked of a build without one. Recognised: a ``staged`` field holding a config
    with ``enabled`` (thresholds named ``min_*`` set to 1, so any batch may stage), or an
    ``engine`` field with ``NixlEngine.STAGED`` / ``NixlEngine.DIRECT``."""
    from transport import nixl

    fields = {f.name for f in dataclasses.fields(nixl.NixlConfig)}
    if "staged" in fields:
        cfg = nixl.NixlConfig().staged
        names = {f.name for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else set()
        if "enabled" in names:
            changes = {"enabled": staged}
            if staged:
                changes.update({n: 1 for n in names if n.startswith("min_")})
            return nixl.NixlConfig(staged=dataclasses.replace(cfg, **changes))
    engines = getattr(nixl, "NixlEngine", None)
    if "engine" in fields and engines is not None:
        engine = getattr(engines, "STAGED" if staged else "DIRECT", None)
        if engine is not None:
            return nixl.NixlConfig(engine=engine)
    return None if staged else nixl.NixlConfig()


def nixl_staged_config():
    """The ``NixlConfig`` of the nixl backend with its staged mode on (gather into a staging
    buffer, a few large writes, scatter at the receiver; the backend still sends a batch of long
    rows direct), or None when this build of the backend has no staged mode."""
    return _nixl_config(staged=True)


def nixl_direct_config():
    """The ``NixlConfig`` of the nixl backend writing every batch as its own descriptors (the
    staged mode, where the backend has one, off)."""
    return _nixl_config(staged=False)


def make_transport(backend: str, ipc_api: str = "auto", native: bool = True, **nvlink):
    """A transport of ``backend``: "nvlink" (default settings; ``native``: its direct path's host
    steps in C; ``nvlink``: other ``NvlinkConfig`` fields), "nixl" (:func:`nixl_direct_config`:
    every range its own descriptor) or "nixl-staged" (:func:`nixl_staged_config`; ``ValueError``
    when the backend has no staged mode)."""
    if backend == "nvlink":
        from transport.nvlink import NvlinkConfig, NvlinkTransport

        if any(f.name == "native" for f in dataclasses.fields(NvlinkConfig)):  # an older transport has
            nvlink["native"] = native  # no C steps (bench/before_after_nvlink.sh runs it under this module)
        return NvlinkTransport(NvlinkConfig(ipc_api=ipc_api, **nvlink))
    if nvlink:
        raise ValueError(f"NvlinkConfig fields {sorted(nvlink)} given for the {backend!r} backend")
    if backend == "nixl":
        from transport.nixl import NixlTransport

        return NixlTransport(nixl_direct_config())
    if backend == "nixl-staged":
        from transport.nixl import NixlTransport

        config = nixl_staged_config()
        if config is None:
            raise ValueError("this nixl backend has no staged mode")
        return NixlTransport(config)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def checksums(bufs: dict, region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list[int]:
    """Position-weighted checksum of the rows of each region (in order of first appearance).

    ``bufs`` maps region id -> uint8 CUDA tensor. Rows of one region must share one length
    that divides their offsets (true of page and head-slice rows).
    """
    import torch

    _, first = np.unique(region, return_index=True)
    out = []
    for rid in region[np.sort(first)]:
        sel = region == rid
        off, ln = offset[sel], length[sel]
        row = int(ln[0])
        if (ln != row).any() or (off % row).any() or row % 4:
            raise ValueError(f"region {rid}: checksums need equal rows (4-byte multiple) at multiples of their length")
        buf = bufs[int(rid)]
        idx = torch.from_numpy(off // row).to(buf.device)
        words = buf.view(-1, row)[idx].view(torch.int32).to(torch.int64)  # [rows, row // 4]
        weights = torch.arange(words.numel(), device=buf.device, dtype=torch.int64) % 65521 + 1
        out.append(int((words.view(-1) * weights).sum()))
    return out


def digest(buf) -> str:
    """SHA-256 of a uint8 tensor's bytes (a CUDA tensor is copied to the host first): exact,
    and faster than :func:`checksums` on host memory."""
    import hashlib

    return hashlib.sha256(memoryview(buf.cpu().numpy())).hexdigest()


# -- the messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Alloc:
    sizes: tuple  # bytes of each new buffer
    fill: int  # its initial byte


@dataclass(frozen=True)
class _Export:
    pass


@dataclass(frozen=True)
class _Fill:
    region_ids: tuple
    fill: int


@dataclass(frozen=True)
class _WaitNotify:
    payload: bytes
    timeout_s: float


@dataclass(frozen=True)
class _StampNotify:
    payloads: tuple  # bytes each
    timeout_s: float
    backends: tuple = ()  # the transports polled (empty: all)


@dataclass(frozen=True)
class _Fetch:
    region_ids: tuple


@dataclass(frozen=True)
class _Free:
    region_ids: tuple


@dataclass(frozen=True)
class _Deregister:
    region_ids: tuple


@dataclass(frozen=True)
class _Digest:
    region_ids: tuple


@dataclass(frozen=True)
class _Checksum:
    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray


@dataclass(frozen=True)
class _Exit:
    pass


@dataclass(frozen=True)
class _Reply:
    ok: bool
    value: Any = None  # the answer, or the child's traceback when not ok


class _Child:
    """The receiving process's state: transports, buffers, notifications seen."""

    def __init__(self, device: Optional[int], backends: tuple, ipc_api: str):
        import torch

        self.torch, self.backends = torch, backends
        self.device = "cpu" if device is None else device
        if device is not None:
            torch.cuda.set_device(device)
        self.transports = {b: make_transport(b, ipc_api) for b in backends}
        self.bufs: dict = {}  # region id (the same in every transport) -> uint8 tensor
        self.seen: list = []  # notifications not yet waited for

    def answer(self, msg, interrupted=lambda: False) -> Any:
        """The reply to ``msg``; a wait for a notification also ends (None) once
        ``interrupted()`` says the next request has come."""
        torch = self.torch
        if isinstance(msg, _Alloc):
            rids = []
            for n in msg.sizes:
                t = torch.full((n,), msg.fill, dtype=torch.uint8, device=self.device)
                ids = {tr.register_tensor(t) for tr in self.transports.values()}
                if len(ids) != 1:
                    raise RuntimeError(f"backends gave different region ids {ids}")
                rids.append(ids.pop())
                self.bufs[rids[-1]] = t
            return rids
        if isinstance(msg, _Export):
            return {b: t.export() for b, t in self.transports.items()}
        if isinstance(msg, _Fill):
            for r in msg.region_ids:
                self.bufs[r].fill_(msg.fill)
            if self.device != "cpu":
                torch.cuda.synchronize(self.device)
            return None
        if isinstance(msg, _WaitNotify):
            return self.wait_notify(msg.payload, msg.timeout_s, interrupted)
        if isinstance(msg, _StampNotify):
            return self.stamp_notify(msg.payloads, msg.timeout_s, interrupted, msg.backends)
        if isinstance(msg, _Fetch):
            return [self.bufs[r].cpu().numpy() for r in msg.region_ids]
        if isinstance(msg, _Free):
            for r in msg.region_ids:
                for t in self.transports.values():
                    if r in t.regions:
                        t.deregister(r)
                del self.bufs[r]
            return None
        if isinstance(msg, _Deregister):
            out = []
            for r in msg.region_ids:
                start = time.monotonic()
                for t in self.transports.values():
                    t.deregister(r)
                out.append((time.monotonic() - start, digest(self.bufs[r])))
            return out
        if isinstance(msg, _Digest):
            return [digest(self.bufs[r]) for r in msg.region_ids]
        if isinstance(msg, _Checksum):
            return checksums(self.bufs, msg.region, msg.offset, msg.length)
        raise TypeError(f"unknown request {type(msg).__name__}")

    def pump(self) -> None:
        """Read every transport's notifications (kept for :meth:`wait_notify`)."""
        for t in self.transports.values():
            self.seen.extend(t.poll_notifications())

    def wait_notify(self, payload: bytes, timeout_s: float, interrupted=lambda: False) -> Optional[str]:
        """The sender of the first notification carrying ``payload`` (None: none in time, or
        ``interrupted()``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for note in self.seen:
                if note.payload == payload:
                    self.seen.remove(note)
                    return note.sender
            if time.monotonic() >= deadline or interrupted():
                return None
            for t in self.transports.values():
                self.seen.extend(t.poll_notifications())
            time.sleep(1e-4)

    def stamp_notify(self, payloads: tuple, timeout_s: float, interrupted=lambda: False, backends: tuple = ()) -> dict:
        """``{payload: (sender, time.monotonic() when poll_notifications returned it)}`` for each
        of ``payloads`` that arrived within ``timeout_s``; polls the ``backends`` transports
        (empty: all) without sleeping, so the stamp is when the notification became visible
        (within one poll)."""
        want, out = set(payloads), {}
        polled = [t for b, t in self.transports.items() if not backends or b in backends]
        for note in list(self.seen):
            if note.payload in want:
                self.seen.remove(note)
                out[note.payload] = (note.sender, time.monotonic())
        deadline = time.monotonic() + timeout_s
        polls = 0
        while len(out) < len(want) and time.monotonic() < deadline:
            for t in polled:
                for note in t.poll_notifications():
                    if note.payload in want and note.payload not in out:
                        out[note.payload] = (note.sender, time.monotonic())
                    else:
                        self.seen.append(note)
            polls += 1
            if polls % 4096 == 0 and interrupted():
                break
        return out

    def close(self) -> None:
        for t in self.transports.values():
            t.close()


def _child_main(conn, device: Optional[int], backends: tuple, ipc_api: str, host=None) -> None:
    if host is not None:  # a kvtransfer.netns.Host: UCX over its veth
        from kvtransfer.netns import enter

        enter(host)
    child = _Child(device, backends, ipc_api)
    try:
        while True:
            if not conn.poll(1e-3):  # idle: keep reading notifications, so that this exporter
                child.pump()  # answers its writers' holds and revokes (transport.revocation)
                continue
            msg = conn.recv()
            if isinstance(msg, _Exit):
                conn.send(_Reply(True))
                return
            try:
                conn.send(_Reply(True, child.answer(msg, lambda: conn.poll(0))))
            except Exception:  # report to the driving process, keep serving
                conn.send(_Reply(False, traceback.format_exc()))
    finally:
        child.close()


class RemoteBuffers:
    """A receiver process on GPU ``device`` (None: host memory) holding buffers registered with
    ``backends`` (names of :func:`make_transport`); in the network namespace of ``host`` (a
    :class:`kvtransfer.netns.Host`) when one is given."""

    def __init__(self, device: Optional[int], backends: tuple = ("nvlink",), ipc_api: str = "auto",
                 timeout_s: float = 120.0, host=None):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout_s
        self.proc = ctx.Process(target=_child_main, args=(child, device, tuple(backends), ipc_api, host), daemon=True)
        self.proc.start()
        child.close()

    def alloc(self, sizes, fill: int) -> list[int]:
        """New buffers of ``sizes`` bytes filled with ``fill``, registered; their region ids."""
        return self._call(_Alloc(tuple(int(n) for n in sizes), fill))

    def free(self, region_ids) -> None:
        """Deregister buffers from every backend (those not deregistered already) and drop them.
        Each backend revokes them from the peers that hold an export naming them first: a NIXL
        holder must answer in its own calls into its transport (a driving process that only
        waits here cannot: ``RevokeTimeout``), so close its peer first; an nvlink holder answers
        from its mailbox thread (see ``transport.base``)."""
        self._call(_Free(tuple(int(r) for r in region_ids)))

    def deregister(self, region_ids) -> list[tuple[float, str]]:
        """Deregister buffers from every backend, keeping them (a later :meth:`free` drops them):
        for each, the seconds its deregister took and the :func:`digest` of its bytes right
        after it returned (what any peer's copies had written by then)."""
        return self._call(_Deregister(tuple(int(r) for r in region_ids)))

    def export(self) -> dict:
        """Each backend's export bytes, by backend name."""
        return self._call(_Export())

    def fill(self, region_ids, fill: int) -> None:
        self._call(_Fill(tuple(int(r) for r in region_ids), fill))

    def wait_notify(self, payload: bytes, timeout_s: float) -> Optional[str]:
        """The sender of a notification carrying ``payload``, once it arrived (None: not within
        ``timeout_s``)."""
        return self._call(_WaitNotify(payload, timeout_s))

    def start_stamp_notify(self, payloads, timeout_s: float, backends=()) -> None:
        """Have the receiver poll (the transports of ``backends``; empty: all) without sleeping
        until each of ``payloads`` arrived (or ``timeout_s``); :meth:`result` then gives
        ``{payload: (sender, arrival)}``, ``arrival`` a ``time.monotonic()`` of the receiver
        (one clock for the processes of a host)."""
        self._conn.send(_StampNotify(tuple(bytes(p) for p in payloads), timeout_s, tuple(backends)))

    def stamped(self, payloads, run: Callable[[], Any], backends=(), timeout_s: float = 120.0) -> tuple:
        """``run()`` (which writes the notifications carrying ``payloads``) while the receiver
        stamps them (:meth:`start_stamp_notify`): ``(run's result, {payload: arrival})``;
        ``RuntimeError`` when a notification did not come."""
        self.start_stamp_notify(payloads, timeout_s, backends)
        time.sleep(0.05)  # the receiver is polling before the first write
        try:
            out = run()
        finally:
            stamps = self.result("stamp_notify")
        missing = [p for p in payloads if p not in stamps]
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(payloads)} notifications did not reach the receiver")
        return out, {p: stamps[p][1] for p in payloads}

    def start_wait_notify(self, payload: bytes, timeout_s: float) -> None:
        """:meth:`wait_notify` without waiting for the answer (collect it with :meth:`result`)."""
        self._conn.send(_WaitNotify(payload, timeout_s))

    def abandon_wait(self) -> Optional[str]:
        """End a :meth:`start_wait_notify` whose write failed: the next request interrupts the
        wait; both answers are read, so the pipe is in step again. Returns the wait's answer."""
        self._conn.send(_Export())
        sender = self.result("the abandoned wait")
        self.result("the request that interrupted it")
        return sender

    def fetch(self, region_ids) -> list[np.ndarray]:
        """The bytes of each buffer, copied to this process."""
        return self._call(_Fetch(tuple(int(r) for r in region_ids)))

    def digest(self, region_ids) -> list[str]:
        """:func:`digest` of each whole buffer, computed in the receiver."""
        return self._call(_Digest(tuple(int(r) for r in region_ids)))

    def checksum(self, region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list[int]:
        """:func:`checksums` of the rows, computed in the receiver."""
        return self._call(_Checksum(region, offset, length))

    def _call(self, msg):
        self._conn.send(msg)
        return self.result(type(msg).__name__)

    def result(self, what: str = "the request"):
        """The answer to the request sent last."""
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"receiver did not answer {what} within {self._timeout} s")
        reply = self._conn.recv()
        if not reply.ok:
            raise RuntimeError(f"receiver failed on {what}:\n{reply.value}")
        return reply.value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._call(_Exit())
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=10)
        self._conn.close()
