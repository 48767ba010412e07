"""``kvtransfer demo`` as a process a test stops: started in a session of its own and returned
once its first node is ready (so its node processes exist), and the processes it started."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.kvtransfer.serve._cluster import group_members


def started_demo(*args) -> tuple[subprocess.Popen, set]:
    """The demo process, once a node it started is ready, and its descendants then."""
    proc = subprocess.Popen([sys.executable, "-m", "kvtransfer", "demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:  # the nodes start at once; the first "ready" line: all of them are processes
        if " ready at " in line:
            break
    else:
        raise AssertionError(f"the demo ended before a node was ready: {proc.wait(60)} {proc.stderr.read()}")
    before = set(descendants(proc.pid))
    assert before, "the demo started no process"
    return proc, before


def stopped_demo(proc: subprocess.Popen, before: set, sig: int) -> str:
    """Send ``sig`` to the demo; once it exited and every process it had started is gone, its
    stderr."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while [p for p in before if alive(p)]:
        assert time.monotonic() < deadline, f"left behind: {[p for p in before if alive(p)]}"
        time.sleep(0.2)
    assert not group_members(proc.pid)
    return err


def descendants(pid: int) -> list:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    children: dict = {}
    for line in out:
        if line.strip():
            p, pp = map(int, line.split())
            children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
