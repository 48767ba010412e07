"""Stop a process for a test, and know it is stopped.

``os.kill(pid, SIGSTOP)`` returns once the signal is queued and *one* thread of the process is
woken to take it; its other threads run on until that thread has started the group stop, which
on a busy machine can be milliseconds later. A test that stops a process so that it cannot
answer (a mailbox thread, UCX's progress thread) and then sends it something could still get
its answer: measured on a 2-core VM, a thread blocked in ``recv`` echoed a byte sent right
after ``os.kill`` returned in 38-48 of 200 tries. :func:`stop` waits until every thread is
stopped.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["stop"]


def _thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (``/proc/<pid>/task/<tid>/stat``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])  # the field after "(comm)"
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return states


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """Send ``SIGSTOP`` to ``pid`` and return once every one of its threads is stopped
    (``TimeoutError`` naming their states otherwise)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = _thread_states(pid)
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout_s:g} s after SIGSTOP: thread states {states}")
        time.sleep(1e-4)
