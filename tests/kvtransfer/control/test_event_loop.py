"""The managers' event loop (``kvtransfer.control.event_loop.EventLoop``): jobs, wakes, sockets."""

from __future__ import annotations

import os
import re
import resource
import select
import threading
import time

import pytest
import zmq

from kvtransfer.control import event_loop
from kvtransfer.control.event_loop import EventLoop

LONG_S = 30.0  # the tick's pause: nothing below may be waiting for the tick


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://loop-test")
    b.connect("inproc://loop-test")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def _loop(handlers=None):
    ticks = []

    def tick():
        ticks.append(time.monotonic())
        return LONG_S

    loop = EventLoop("test-loop", handlers or {}, tick)
    loop.start()
    return loop, ticks


def _settled(loop, ticks) -> None:
    """Return once the loop has run a job, is between turns and no wake is pending (its wake
    pipe is empty): it sleeps in its tick's long pause until something wakes it. (A wake left
    over from a job that an earlier turn already ran makes one more turn first.)"""
    loop.call(lambda: None).result(timeout=30)
    deadline = time.monotonic() + 30
    while loop._turn.locked() or select.select([loop._wake.fd], [], [], 0)[0]:
        assert time.monotonic() < deadline, "the loop keeps turning"
        time.sleep(0.001)
    assert ticks, "the loop did not tick"


def test_jobs_run_in_order_on_the_loop_thread_and_report_through_futures():
    loop, _ = _loop()
    try:
        seen = []
        futs = [loop.call(lambda i=i: (seen.append(i), threading.current_thread().name)[1]) for i in range(5)]
        boom = loop.call(lambda: 1 / 0)
        assert [f.result(timeout=30) for f in futs] == ["test-loop"] * 5
        assert seen == [0, 1, 2, 3, 4]
        with pytest.raises(ZeroDivisionError):
            boom.result(timeout=30)
    finally:
        loop.close()


def test_a_job_queued_without_a_wake_waits_for_the_next_turn():
    """``wake=False``: the loop, asleep until its tick's pause ends, does not run the job;
    ``wake()`` (or any later woken call) does."""
    loop, ticks = _loop()
    try:
        _settled(loop, ticks)
        lazy = loop.call(lambda: "ran", wake=False)
        time.sleep(0.3)
        assert not lazy.done(), "a job queued without a wake ran before anything woke the loop"
        loop.wake()
        assert lazy.result(timeout=30) == "ran"
        lazy = loop.call(lambda: "first", wake=False)
        woken = loop.call(lambda: "second")
        assert (lazy.result(timeout=30), woken.result(timeout=30)) == ("first", "second")
    finally:
        loop.close()


@pytest.mark.parametrize("past_fd_setsize", [False, True], ids=["select", "poll past FD_SETSIZE"])
def test_a_descriptor_given_to_the_loop_ends_its_pause_and_the_tick_clears_it(past_fd_setsize):
    """``fds``: a transport's notification descriptor turning readable wakes the loop from its
    tick's long pause (the tick, which polls the transport, clears it); a rung bell is one
    tick, not a spin. A descriptor numbered past select's FD_SETSIZE (a process with many
    open files) is waited on with poll: the same, where select would refuse it and the loop
    would spin."""
    bell = os.eventfd(0, os.EFD_NONBLOCK)
    if past_fd_setsize:
        high = event_loop.FD_SETSIZE + 476
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft <= high:
            if hard != resource.RLIM_INFINITY and hard <= high:
                os.close(bell)
                pytest.skip(f"this process may open no descriptor past {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (high + 1, hard))
        os.dup2(bell, high)
        os.close(bell)
        bell = high
    ticks = []

    def tick():
        try:
            os.eventfd_read(bell)  # what a transport's poll_notifications() does
        except BlockingIOError:
            pass
        ticks.append(time.monotonic())
        return LONG_S

    loop = EventLoop("test-loop", {}, tick, fds=[bell])
    loop.start()
    try:
        _settled(loop, ticks)
        before = len(ticks)
        os.eventfd_write(bell, 1)
        deadline = time.monotonic() + 30
        while len(ticks) == before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(ticks) == before + 1, "the rung descriptor did not wake the loop from its pause"
        time.sleep(0.2)
        assert len(ticks) == before + 1, "the loop turned again with nothing rung"
    finally:
        loop.close()
        os.close(bell)


def test_a_lazy_job_runs_before_the_message_that_wakes_the_loop(sockets):
    """A request made without a wake must be known when its peer's message is handled."""
    a, b = sockets
    order = []

    def on_message():
        order.append(a.recv())

    loop, ticks = _loop({a: on_message})
    try:
        _settled(loop, ticks)
        loop.call(order.append, b"job", wake=False)
        b.send(b"message")
        deadline = time.monotonic() + 30
        while len(order) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == [b"job", b"message"]
    finally:
        loop.close()


def test_a_job_queued_while_a_handler_runs_is_not_left_for_the_next_turn(sockets):
    """A handler (or another thread meanwhile) queues a job without a wake: it runs in the
    same turn, not after the tick's long pause."""
    a, b = sockets
    done = threading.Event()

    def on_message():
        a.recv()
        loop.call(done.set, wake=False)

    loop, ticks = _loop({a: on_message})
    try:
        _settled(loop, ticks)
        b.send(b"go")
        assert done.wait(30), "the job queued by the handler waited for the next turn"
    finally:
        loop.close()


def test_an_inline_call_between_turns_runs_at_once_on_the_callers_thread_after_queued_jobs():
    """The loop sleeps in its tick's long pause: an inline job runs before ``call`` returns,
    on the caller's thread, as the loop's turn (``on_loop``), after a job queued before it
    without a wake; the loop is woken afterwards (a turn follows)."""
    loop, ticks = _loop()
    try:
        _settled(loop, ticks)
        order = []
        lazy = loop.call(order.append, "lazy", wake=False)
        turns = len(ticks)
        fut = loop.call(lambda: (order.append("inline"), threading.current_thread().name, loop.on_loop)[1:],
                        inline=True)
        assert fut.done() and lazy.done()
        assert fut.result() == (threading.current_thread().name, True) and not loop.on_loop
        assert order == ["lazy", "inline"]
        deadline = time.monotonic() + 30
        while len(ticks) == turns and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ticks) > turns, "the loop was not woken after the inline job"
    finally:
        loop.close()


def _recv_all(sock, order: list, handled_by: set):
    """A handler: every message ``sock`` holds, appended to ``order``; the thread noted."""
    def on_message():
        while True:
            try:
                order.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            handled_by.add(threading.current_thread().name)
    return on_message


def test_an_inline_call_handles_a_message_that_came_before_it_first(sockets):
    """A message sent before an inline call is handled before the call's job, by the inline
    call itself. On a loop whose thread is not started every call runs inline and nothing else
    handles the messages, so this holds call after call (on a running loop, whether its thread
    or the call gets to a message first is the scheduler's choice: the next test)."""
    a, b = sockets
    order, handled_by = [], set()
    me = threading.current_thread().name
    loop = EventLoop("test-loop", {a: _recv_all(a, order, handled_by)}, lambda: LONG_S)  # never started
    try:
        for i in range(50):
            b.send(b"m%d" % i)
            job = loop.call(lambda i=i: order.append(b"job%d" % i) or threading.current_thread().name, inline=True)
            assert job.done() and job.result() == me
            assert order[-2:] == [b"m%d" % i, b"job%d" % i], order[-4:]
        alone = loop.call(order.append, b"alone", inline=True)  # nothing sent: nothing handled before it
        assert alone.done() and order[-3:] == [b"m49", b"job49", b"alone"]
        assert handled_by == {me}
    finally:
        loop.close()


def test_on_a_running_loop_an_inline_call_never_runs_its_job_before_an_earlier_message(sockets):
    """The same against a running loop, woken after each inline call: a call that finds it in
    a turn is queued (``call``'s doc) and promises nothing about the message's order, so only
    the calls that ran inline are checked; which thread handles a message is not."""
    a, b = sockets
    order, handled_by = [], set()
    me = threading.current_thread().name

    def job(i):
        order.append(b"job%d" % i)
        return threading.current_thread().name

    loop, ticks = _loop({a: _recv_all(a, order, handled_by)})
    try:
        for i in range(50):
            _settled(loop, ticks) if i % 10 == 0 else None
            b.send(b"m%d" % i)
            if loop.call(job, i, inline=True).result(timeout=30) == me:  # ran inline: the message was handled first
                assert b"m%d" % i in order and order.index(b"m%d" % i) < order.index(b"job%d" % i), order[-4:]
            deadline = time.monotonic() + 30
            while b"m%d" % i not in order:  # queued: the loop handles the message in this turn or the next
                assert time.monotonic() < deadline, f"m{i} was never handled"
                time.sleep(0.001)
        assert set(order) == {b"m%d" % i for i in range(50)} | {b"job%d" % i for i in range(50)}
    finally:
        loop.close()


def test_an_inline_call_during_a_turn_is_queued_for_the_loop_thread():
    """The loop is inside a turn (a job runs): an inline call does not run beside it; it is
    queued and runs on the loop thread once the turn's job is done."""
    loop, _ = _loop()
    try:
        started, release = threading.Event(), threading.Event()
        loop.call(lambda: (started.set(), release.wait(30)))
        assert started.wait(30)
        fut = loop.call(lambda: threading.current_thread().name, inline=True)
        time.sleep(0.1)
        assert not fut.done(), "an inline job ran beside the loop's turn"
        release.set()
        assert fut.result(timeout=30) == "test-loop"
    finally:
        loop.close()


def test_an_inline_call_waits_for_the_turn_in_progress_then_runs_on_the_callers_thread(monkeypatch):
    """A turn that ends while an inline call waits for it (here within the 30 s the test
    allows, ``INLINE_WAIT_S``): the job then runs on the caller's thread, not queued behind a
    wake-up of the loop thread."""
    monkeypatch.setattr(event_loop, "INLINE_WAIT_S", 30.0)
    loop, _ = _loop()
    try:
        started, release = threading.Event(), threading.Event()
        loop.call(lambda: (started.set(), release.wait(30)))
        assert started.wait(30)
        threading.Timer(0.2, release.set).start()
        fut = loop.call(lambda: threading.current_thread().name, inline=True)
        assert release.is_set() and fut.done(), "the inline call returned before the turn ended"
        assert fut.result() == threading.current_thread().name
    finally:
        loop.close()


def test_an_inline_call_from_the_loops_own_turn_is_queued_without_waiting(monkeypatch):
    """The caller is the turn itself: the call cannot wait for its own turn to end; the job
    runs after the calling job, in the same turn."""
    monkeypatch.setattr(event_loop, "INLINE_WAIT_S", 30.0)
    loop, _ = _loop()
    try:
        order = []

        def outer():
            inner = loop.call(lambda: order.append("inner"), inline=True)
            order.append("outer")
            return inner

        start = time.monotonic()
        inner = loop.call(outer).result(timeout=30)
        inner.result(timeout=30)
        assert order == ["outer", "inner"] and time.monotonic() - start < 10
    finally:
        loop.close()


def test_close_fails_jobs_it_did_not_run():
    loop, _ = _loop()
    loop.call(lambda: None).result(timeout=30)
    block = threading.Event()
    loop.call(block.wait, 5)  # the loop is busy with this job
    late = loop.call(lambda: "never", wake=False)
    closer = threading.Thread(target=loop.close)
    closer.start()
    block.set()
    closer.join(10)
    assert not closer.is_alive()
    if late.done() and late.exception() is None:  # it got in before the stop: that is allowed
        assert late.result() == "never"
    else:
        with pytest.raises(RuntimeError, match="the manager is closed"):
            late.result(timeout=30)
    with pytest.raises(RuntimeError, match="the manager is closed"):
        loop.call(lambda: None).result(timeout=30)


def test_a_long_turn_and_a_late_loop_are_logged(monkeypatch, caplog):
    """Heartbeats wait for the loop: a turn that takes long, or a loop kept from running (here
    an inline call holds the turn), is logged with how long, naming the loop."""
    from kvtransfer.control import event_loop

    monkeypatch.setattr(event_loop, "STALL_LOG_S", 0.2)
    loop = EventLoop("stall-loop", {}, lambda: 0.01)
    loop.start()
    try:
        with caplog.at_level("WARNING", logger="kvtransfer.control"):
            loop.call(time.sleep, 0.4).result(timeout=30)
            loop.call(lambda: None).result(timeout=30)  # the turn after: the long one was logged
            assert any(re.match(r"control loop stall-loop: one turn took \d+\.\d s", r.getMessage())
                       for r in caplog.records), caplog.text
            caplog.clear()
            me, deadline = threading.current_thread().name, time.monotonic() + 30
            # inline runs here when the loop is between turns (nearly always; else it is queued)
            while loop.call(lambda: (time.sleep(0.4), threading.current_thread().name)[1],
                            inline=True).result(timeout=30) != me:
                assert time.monotonic() < deadline, "no call ran inline"
            loop.call(lambda: None).result(timeout=30)
            assert any(re.match(r"control loop stall-loop ran \d+\.\d s late", r.getMessage())
                       for r in caplog.records), caplog.text
    finally:
        loop.close()
