"""Child processes of the ``kvtransfer`` commands (demo, benchmarks) and their pipes.

Every parent/child exchange has a timeout, and a child that dies is named with how it died::

    child = Child.spawn(target, args, name="receiver")   # target(conn, *args) in a spawned process
    export = child.recv(Ready, "its export", timeout=60).export
    child.send(Quit())
    child.stop()

:meth:`Child.recv` raises :class:`ChildFailed` when the child died (its exit code or the signal
that killed it), reported a :class:`Failed` message (what the child caught), sent a message of
another type, or said nothing within the timeout. A child reports its own exceptions with
:func:`report_failure`. :meth:`Child.stop` returns the child's exit code and logs a warning
(logger ``kvtransfer.procs``) naming a child that ended any other way than exit code 0.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Callable, List, Optional

__all__ = ["Child", "ChildFailed", "Failed", "exit_text", "group_members", "report_failure"]

log = logging.getLogger("kvtransfer.procs")


class ChildFailed(RuntimeError):
    """A child process died, failed, or did not answer in time; the message names it."""


@dataclass(frozen=True)
class Failed:
    """What a child sends before it exits on an exception."""

    error: str  # "TypeName: message"
    trace: str = ""


def report_failure(conn, exc: BaseException) -> None:
    """Send ``exc`` to the parent as a :class:`Failed` (best effort: the pipe may be gone)."""
    try:
        conn.send(Failed(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    except (OSError, ValueError):
        pass


def exit_text(proc) -> str:
    """How a process ended: "exit code 3", "killed by SIGKILL", or "still running"."""
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Child:
    """A spawned process and the parent's end of its pipe (the child's end is closed here, so a
    dead child reads as EOF, never as a silent pipe)."""

    def __init__(self, proc, conn, name: str):
        self.proc, self.conn, self.name = proc, conn, name

    @classmethod
    def spawn(cls, target: Callable, args: tuple = (), name: str = "child", daemon: bool = True) -> "Child":
        """``target(conn, *args)`` in a new process. A daemon (the default) dies with this
        process but may not start children of its own; one that does says ``daemon=False``
        and its parent must :meth:`stop` it."""
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=daemon)
        proc.start()
        child_conn.close()
        return cls(proc, conn, name)

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            raise self._died(f"before it was sent {type(msg).__name__}") from None

    def recv(self, kind: type, what: str, timeout: float):
        """The next message, which must be a ``kind``; ``what`` names it in errors."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise self._died(f"before {what}")
            if time.monotonic() >= deadline:
                raise ChildFailed(f"{self.name}: no {what} within {timeout:g} s ({exit_text(self.proc)})")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise self._died(f"before {what}") from None
        if isinstance(msg, Failed):
            raise ChildFailed(f"{self.name} failed before {what}: {msg.error}")
        if not isinstance(msg, kind):
            raise ChildFailed(f"{self.name}: expected {kind.__name__} ({what}), got {type(msg).__name__}")
        return msg

    def _died(self, when: str) -> ChildFailed:
        self.proc.join(5)
        return ChildFailed(f"{self.name} died {when} ({exit_text(self.proc)})")

    def stop(self, quit_msg=None, timeout: float = 10.0) -> int:
        """Ask it to quit (``quit_msg``), wait ``timeout`` s, then kill it; close the pipe.
        Returns its exit code (negative: the signal that ended it); any but 0 is logged."""
        if quit_msg is not None and self.proc.is_alive():
            try:
                self.conn.send(quit_msg)
            except (OSError, ValueError):
                pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        if self.proc.exitcode != 0:
            log.warning("%s (pid %s) ended with %s", self.name, self.proc.pid, exit_text(self.proc))
        return self.proc.exitcode

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid


def group_members(pgid: int) -> List[int]:
    """Live (not zombie) processes of the process group ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            out.append(int(name))
    return out
