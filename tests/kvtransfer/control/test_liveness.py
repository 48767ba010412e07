"""Proof that a process has ended (kvtransfer.control.liveness), against real child processes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvtransfer.control.liveness import ProcessId, ended

pytestmark = pytest.mark.skipif(ProcessId.mine() is None, reason="no /proc of this pid namespace")


def child() -> tuple:
    """A sleeping child and its ProcessId, read by the child itself."""
    proc = subprocess.Popen([sys.executable, "-c", "import json, sys; from kvtransfer.control.liveness import ProcessId; "
                             "print(json.dumps(ProcessId.mine().to_wire()), flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, ProcessId.from_wire(json.loads(proc.stdout.readline()))


def test_this_process_names_itself_and_round_trips_the_wire():
    me = ProcessId.mine()
    assert me.pid == os.getpid() and me.boot and me.pid_ns > 0 and me.started >= 0
    assert ProcessId.from_wire(me.to_wire()) == me
    assert ProcessId.from_wire({}) is None
    assert not ended(me, me)


def test_a_running_child_has_not_ended_a_killed_one_has_zombie_or_reaped():
    me = ProcessId.mine()
    proc, theirs = child()
    try:
        assert theirs.pid == proc.pid and not ended(theirs, me)
        proc.send_signal(signal.SIGSTOP)  # stopped (paused) is alive: it may run again
        assert not ended(theirs, me)
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        deadline = time.monotonic() + 10
        while not ended(theirs, me):  # a zombie until reaped: ended already
            assert time.monotonic() < deadline, "a killed child still looks alive after 10 s"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert ended(theirs, me)  # reaped: its pid is gone


def test_a_pid_that_another_process_took_counts_as_ended():
    me = ProcessId.mine()
    earlier = dataclasses.replace(me, started=me.started + 1)  # this pid, but started at another time
    assert ended(earlier, me)


@pytest.mark.parametrize("change", [{"boot": "another-boot"}, {"pid_ns": 1}])
def test_nothing_is_proven_across_boots_or_pid_namespaces(change):
    me = ProcessId.mine()
    proc, theirs = child()
    proc.kill()
    proc.wait()
    assert ended(theirs, me)
    assert not ended(dataclasses.replace(theirs, **change), me)  # another host or container: unknown
    assert not ended(theirs, None) and not ended(None, me)
