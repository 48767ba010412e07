"""Proof that a peer rank's process has ended, where both ranks share a kernel.

Silence alone never proves a rank dead: a paused process may run again and post writes. So a
decode rank keeps the pages of the requests a silent prefill rank was lost with until the rank
restarts, answers, or the transfer timeout passes (:mod:`kvtransfer.control.decode`). On one
host that wait is needless when the process is gone: each rank names its process in its hello
(:class:`ProcessId`: the kernel's boot id, the pid namespace, the pid and when that pid
started), and a peer that shares the boot id and the pid namespace reads ``/proc`` to learn
whether that process still runs (:func:`ended`).

A process that has ended has released its memory, files and sockets, and with them its GPU
contexts and its network endpoints: it starts no copy, and the copies it drove (NVLink kernels,
CUDA IPC and RDMA writes, the sender side of UCX's transports) stop with it. A zombie counts as
ended (all of that is released before a process becomes one), and so does a pid that another
process took since (its start time differs). Bytes a dead sender left in this side's socket
buffers may still be copied by this side's own transport progress, which the manager's loop
runs every turn before it looks here, as it does before it believes a restart.

Anything that cannot be read or compared -- another host or container, a ``/proc`` that is
not this pid namespace's, no ``/proc`` at all -- proves nothing: :func:`ended` says False and
the caller keeps waiting as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["ProcessId", "ended", "wire_of"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class ProcessId:
    """One process on one boot of one kernel: what a hello carries (``to_wire``)."""

    boot: str  # /proc/sys/kernel/random/boot_id
    pid_ns: int  # inode of /proc/self/ns/pid: pids mean the same only within one namespace
    pid: int
    started: int  # field 22 of /proc/PID/stat: clock ticks from boot to the process's start

    @classmethod
    def mine(cls) -> Optional["ProcessId"]:
        """This process's id, or None where ``/proc`` cannot name it (not Linux, or a ``/proc``
        mounted for another pid namespace: its ``self`` is not this pid)."""
        try:
            pid = os.getpid()
            fields = _stat("self")
            if fields is None or int(fields[0]) != pid:
                return None
            return cls(_read(_BOOT_ID).strip(), os.stat("/proc/self/ns/pid").st_ino, pid, int(fields[20]))
        except (OSError, ValueError, IndexError):
            return None

    def to_wire(self) -> dict:
        return {"boot": self.boot, "pid_ns": self.pid_ns, "pid": self.pid, "started": self.started}

    @classmethod
    def from_wire(cls, body: dict) -> Optional["ProcessId"]:
        """The id a peer sent ({} when it could not name itself: None). ``ValueError`` names a
        malformed one."""
        if not body:
            return None
        want = {"boot": str, "pid_ns": int, "pid": int, "started": int}
        if not isinstance(body, dict) or set(body) != set(want):
            raise ValueError(f"a process id needs the fields {sorted(want)}, got {sorted(body)!r:.120}")
        for name, kind in want.items():
            if not isinstance(body[name], kind) or isinstance(body[name], bool):
                raise ValueError(f"process id field {name!r} must be {kind.__name__}, got {body[name]!r:.60}")
        if body["pid"] <= 0 or body["started"] < 0:
            raise ValueError(f"process id pid {body['pid']} / started {body['started']} out of range")
        return cls(**body)


def wire_of(process: Optional[ProcessId]) -> dict:
    """What a hello carries for ``process``: its fields, or {} where it could not be named."""
    return process.to_wire() if process is not None else {}


def ended(process: Optional[ProcessId], here: Optional[ProcessId]) -> bool:
    """Whether ``process`` has provably ended, as seen from ``here`` (this process's id): only
    when both share a boot and a pid namespace and ``/proc`` shows that pid gone, a zombie, or
    started at another time. False for anything unknown (``process`` or ``here`` None, another
    boot or namespace, ``/proc`` unreadable)."""
    if process is None or here is None or (process.boot, process.pid_ns) != (here.boot, here.pid_ns):
        return False
    try:
        fields = _stat(str(process.pid))
    except OSError:
        return False  # present but unreadable: nothing is proven
    if fields is None:
        return True  # no such pid in this namespace: exited and reaped
    try:
        return fields[1] in ("Z", "X") or int(fields[20]) != process.started
    except (ValueError, IndexError):
        return False


def _stat(pid: str) -> Optional[list]:
    """``/proc/PID/stat`` as its fields from the pid on (field 1), the command name (field 2,
    which may hold spaces and parentheses) cut out: ``[pid, state, ppid, ...]``, so field N is
    at index N - 2 from the state on (index 1) -- or None where no such process exists."""
    try:
        text = _read(f"/proc/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        return None
    head, _, rest = text.rpartition(")")
    return [head.split(" (", 1)[0], *rest.split()]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()
