"""Two "hosts" on one machine: network namespaces joined by a veth pair.

:class:`TwoHosts` creates namespaces ``A`` and ``B`` (names unique per process), a veth pair
with one end in each, addresses ``10.203.0.1/24`` (A) and ``10.203.0.2/24`` (B) that exist
only inside those namespaces, and brings the links up; :meth:`TwoHosts.link` sets A's end down
or up (a cut cable); :meth:`TwoHosts.close` deletes both namespaces (and so the pair), also
after a failure. :func:`netns_unavailable` says why this machine cannot (not root, no ``ip``,
no namespaces), for a skip or an error. The two-host tests (``tests/kvtransfer/test_two_hosts.py``)
and ``kvtransfer bench transport --kv --two-hosts`` / ``bench transfer --two-hosts`` build
their hosts with it.

:func:`writer_on_two_hosts` runs a benchmark's writer in a process on host A, its receiver
to be started on host B, and returns what the writer returned.

A process joins a host by :func:`enter` before anything opens a socket, as ``ip netns exec``
does: ``setns`` into the namespace (``/run/netns/NAME``), then a private mount namespace with
``/sys`` mounted afresh (UCX lists network devices from sysfs, which otherwise still shows the
machine's); and it points UCX at that host's veth over tcp only (shared memory and cma would
cross between the namespaces without the link).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.203.0"  # private; the addresses live only inside the two namespaces
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")


def netns_unavailable() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kvtprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", name)
    return ""


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its veth device and address."""

    netns: str
    device: str
    address: str

    @property
    def env(self) -> dict:
        """UCX over this host's veth, tcp only."""
        return {"UCX_NET_DEVICES": self.device, "UCX_TLS": "tcp,self"}


class TwoHosts:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a = Host(f"kvt{tag}a", f"kv{tag}a", f"{SUBNET}.1")
        self.b = Host(f"kvt{tag}b", f"kv{tag}b", f"{SUBNET}.2")
        self._made: list[str] = []
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.netns)
                self._made.append(host.netns)
            _ip("link", "add", self.a.device, "type", "veth", "peer", "name", self.b.device)
            for host in (self.a, self.b):
                _ip("link", "set", host.device, "netns", host.netns)
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.device)
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "link", "set", host.device, "up")
        except BaseException:
            self.close()
            raise

    def link(self, up: bool) -> None:
        """Set A's end of the pair up or down."""
        _ip("-n", self.a.netns, "link", "set", self.a.device, "up" if up else "down")

    def close(self) -> None:
        while self._made:
            name = self._made.pop()
            try:
                _ip("netns", "del", name)  # the veth end inside goes with it, and so the pair
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                pass

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enter(host: Host) -> None:
    """Move this process into ``host``'s namespace and point UCX at its veth (call first)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} ({host.netns}): {os.strerror(err)}")

    fd = os.open(f"/run/netns/{host.netns}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")
    os.environ.update(host.env)


def writer_on_two_hosts(target, args: tuple, kind: type, timeout_s: float):
    """``target(receiver_host, *args)`` in a writer process that entered host A, ``receiver_host``
    being host B (where the writer starts its receiver); what it returned (a ``kind``). The
    namespaces go when it returns. ``target`` is a module-level function (the process is spawned)."""
    from kvtransfer._procs import Child

    with TwoHosts() as hosts:
        writer = Child.spawn(_writer_on, (hosts.a, hosts.b, target, args), name=f"writer ({hosts.a.netns})",
                             daemon=False)  # it starts the receiver
        try:
            return writer.recv(kind, "its results", timeout_s)
        finally:
            writer.stop()


def _writer_on(conn, host: Host, receiver_host: Host, target, args: tuple) -> None:
    from kvtransfer._procs import report_failure

    try:
        enter(host)
        conn.send(target(receiver_host, *args))
    except Exception as exc:  # the parent names it instead of waiting on a dead pipe
        report_failure(conn, exc)
        raise SystemExit(1) from None
