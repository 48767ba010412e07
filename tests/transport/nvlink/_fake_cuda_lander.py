"""Run by ``test_nvlink_lander_c.py`` in a fresh Python whose ``libcuda.so.1`` is the stand-in
of ``fake_cuda/libcuda.c``: the real C lander (``native.c``'s ``lander_*``, its own thread) over
a real shared word, its "events" flags in host memory the script sets (0 running, 1 done, 2 a
CUDA error). Each case prints its name; an assertion names what went wrong."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import numpy as np

from tests.transport.nvlink._nvlink_cpu import wait_until as until
from transport.nvlink import native
from transport.nvlink.landed import SharedWord, WordView

RUNNING, DONE, FAILED = 0, 1, 2


def stays(what: str, check, seconds: float = 0.05) -> None:
    """``check()`` holds for ``seconds`` (the thread had every chance to break it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), what
        time.sleep(1e-4)


def threads() -> tuple[int, int]:
    """This process's threads, and how many of them are named as the landers' thread."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return len(names), names.count("kvt-lander")


def lander_naps() -> int:
    """How often the landers' thread has slept so far (its voluntary context switches: a nap
    between looks is one; a look without pause is none)."""
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() != "kvt-lander":
                continue
        with open(f"/proc/self/task/{tid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
    raise AssertionError("no landers' thread")


def waiting(steps, h, number: int, got: list) -> threading.Thread:
    """A thread in ``lander_wait(h, number)`` (30 s at most), appending what it returned to ``got``."""
    waiter = threading.Thread(target=lambda: got.append(steps.lander_wait(h, number, 30.0)))
    waiter.start()
    return waiter


def main() -> None:
    fake = ctypes.CDLL("libcuda.so.1")
    assert hasattr(fake, "fake_retained"), "libcuda.so.1 is not the stand-in: LD_LIBRARY_PATH"
    steps = native.build()
    steps.load_driver()
    flags = np.zeros(4096, dtype=np.uint64)  # [events] one flag per "event"
    event = lambda i: flags.ctypes.data + 8 * i  # noqa: E731
    word = SharedWord()
    view = WordView(word.fd)  # what a receiver reads
    alone = threads()
    h = steps.lander_new(word.address)
    one = (alone[0] + 1, 1)  # one more thread, the landers'
    assert threads() == one, f"threads (all, landers') {alone} before the first lander, {threads()} after"

    # in order: a later copy that ends first is not released before the earlier one
    for n in (1, 2, 3):
        steps.lander_watch(h, n, event(n), 0)
    flags[2] = DONE
    stays("nothing passes a copy still running", lambda: view.read() == 0)
    flags[1] = DONE
    until("1 and 2 released once 1 ended", lambda: view.read() == 2)
    flags[3] = DONE
    until("3 released", lambda: view.read() == 3)
    assert steps.lander_landed(h) == 3 and steps.lander_passed(h) == 3
    print("in order")

    # a withdrawn notification: nothing passes it before its release; its copy, still running,
    # is not waited for once released; a released one cannot be withdrawn
    steps.lander_watch(h, 4, event(4), 0)
    steps.lander_watch(h, 5, event(5), 0)
    assert steps.lander_withdraw(h, 4) is True
    flags[5] = DONE
    stays("nothing passes a withdrawn notification before its release", lambda: view.read() == 3)
    steps.lander_release(h, 4)
    until("5 released past the withdrawn 4 (its copy never ended)", lambda: view.read() == 5)
    assert steps.lander_withdraw(h, 5) is False
    assert steps.lander_withdraw(h, 4) is False  # the word passed it: nothing to hold any more
    # withdrawn while the thread waits on it, its copy ending before the release: still held
    steps.lander_watch(h, 6, event(6), 0)
    time.sleep(0.005)
    assert steps.lander_withdraw(h, 6) is True
    flags[6] = DONE
    stays("a withdrawn notification is not released when its copy ends", lambda: view.read() == 5)
    steps.lander_release(h, 6)
    stays("nor after its release (it is skipped, not stored)", lambda: view.read() == 5, 0.01)
    print("withdrawn")

    # a copy already ended is released by the caller's own look, before the call returns
    flags[7] = DONE
    steps.lander_watch(h, 7, event(7), 0)
    steps.lander_land(h)
    assert steps.lander_landed(h) >= 7 and view.read() == 7
    # the caller's look taking the copy the thread waits on, many times over: the thread then
    # goes on to the next one, which it must wait for too (not store it as if it had ended)
    for n in range(2000, 2100, 2):
        steps.lander_watch(h, n, event(n), 0)
        steps.lander_watch(h, n + 1, event(n + 1), 0)
        time.sleep(0.003)  # the thread naps between looks at n's event
        flags[n] = DONE
        steps.lander_land(h)
        stays(f"{n + 1} is not released while its copy runs", lambda: view.read() < n + 1, 0.002)
        flags[n + 1] = DONE
        until(f"{n + 1} released", lambda: view.read() == n + 1)
    print("landed by the caller")

    # a failed event is never released; the thread waits for its withdrawal, then goes on
    flags[8] = FAILED
    steps.lander_watch(h, 2108, event(8), 0)
    steps.lander_watch(h, 2109, event(9), 0)
    flags[9] = DONE
    steps.lander_land(h)  # the caller's look refuses it too
    stays("a failed copy is not released", lambda: view.read() == 2099)
    assert steps.lander_withdraw(h, 2108) is True
    steps.lander_release(h, 2108)
    until("2109 released past the failed 2108", lambda: view.read() == 2109)
    print("failed")

    # the event being waited on stays counted as not passed (its owner keeps it alive)
    steps.lander_watch(h, 2110, event(10), 0)
    time.sleep(0.01)
    assert steps.lander_passed(h) == 2109
    flags[10] = DONE
    until("2110 passed", lambda: steps.lander_passed(h) == 2110)
    print("passed")

    # waiting for the thread to pass a number: asleep until then (the GIL let go), or a timeout
    steps.lander_watch(h, 2111, event(11), 0)
    assert steps.lander_wait(h, 2111, 0.05) is False  # its timeout: not passed
    got = []
    waiter = waiting(steps, h, 2111, got)
    time.sleep(0.01)  # the waiter sleeps in lander_wait while this thread runs
    assert waiter.is_alive() and not got
    flags[11] = DONE
    waiter.join(timeout=30)
    assert got == [True], got
    assert steps.lander_wait(h, 2110, 0.0) is True  # passed long ago
    steps.lander_watch(h, 2112, event(12), 0)
    assert steps.lander_withdraw(h, 2112) is True
    waiter = waiting(steps, h, 2112, got)
    steps.lander_release(h, 2112)
    waiter.join(timeout=30)
    assert got == [True, True], f"a withdrawn number, once let go, is passed too: {got}"
    print("waited")

    # more than the ring's first capacity (64), ended in reverse: released in order, all of them
    numbers = list(range(13, 313))  # events; their numbers are 2100 more
    for n in numbers:
        steps.lander_watch(h, 2100 + n, event(n), n % 3)  # three devices: a context each, retained once
    for n in reversed(numbers[1:]):
        flags[n] = DONE
    stays("nothing passes the first of 300", lambda: view.read() == 2111)
    flags[numbers[0]] = DONE
    until("all 300 released", lambda: view.read() == 2100 + numbers[-1])
    print("grown")

    # bad calls
    for bad, match in (((h, 2412, event(400), 0), "notification 2412 after 2412"),
                       ((h, 2500, 0, 0), "event"), ((h, 2500, event(400), 64), "device 64 out of range")):
        try:
            steps.lander_watch(*bad)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"lander_watch{bad[1:]} was accepted")
    try:
        steps.lander_withdraw(h, 3000)
    except ValueError as exc:
        assert "never watched" in str(exc), exc
    else:
        raise AssertionError("withdrawing a number never watched was accepted")
    print("refused")

    # one thread serves every lander; a held or a long copy on one holds up no other
    words = [SharedWord() for _ in range(3)]
    views = [WordView(w.fd) for w in words]
    others = [steps.lander_new(w.address) for w in words]
    assert threads() == one, f"threads (all, landers') {threads()} for four landers"
    lands, runs, held = others  # the thread looks at the newest first: held, runs, lands, h
    v_lands, v_runs, v_held = views
    steps.lander_watch(runs, 1, event(500), 0)  # a copy that runs on
    steps.lander_watch(held, 1, event(501), 1)
    steps.lander_watch(held, 2, event(502), 1)
    assert steps.lander_withdraw(held, 1) is True
    flags[502] = DONE
    steps.lander_watch(lands, 7, event(503), 2)
    flags[503] = DONE
    until("released beside a held notification and a running copy", lambda: v_lands.read() == 7)
    stays("a lander holds behind its withdrawn 1; a copy runs", lambda: v_held.read() == 0 and v_runs.read() == 0)
    steps.lander_release(held, 1)
    until("2 released once the withdrawn 1 is let go", lambda: v_held.read() == 2)
    # a lander closed while the thread queries its copy: the close returns, the others go on
    time.sleep(0.005)
    steps.lander_close(runs)
    flags[500] = DONE
    steps.lander_watch(lands, 8, event(504), 0)
    flags[504] = DONE
    until("released after another lander closed", lambda: v_lands.read() == 8)
    stays("nothing is stored for a closed lander", lambda: v_runs.read() == 0, 0.01)
    steps.lander_close(held)
    steps.lander_close(lands)
    assert threads() == one, "the thread ended while a lander was open"
    print("shared")

    # closing while the thread waits on a copy that never ends: it returns, stores nothing more,
    # and a waiter for that copy wakes
    steps.lander_watch(h, 2500, event(400), 0)
    other = SharedWord()
    keep = steps.lander_new(other.address)  # open: h's close is not the thread's end
    got = []
    waiter = waiting(steps, h, 2500, got)
    time.sleep(0.005)  # past the 2 ms without pause: the thread naps between looks
    steps.lander_close(h)
    waiter.join(timeout=20)  # a backstop, short of the waiter's own 30 s
    assert not waiter.is_alive() and got == [None], f"a waiter for a closed lander (woke at its timeout?): {got}"
    steps.lander_close(keep)
    other.close()
    flags[400] = DONE
    steps.lander_watch(h, 2501, event(401), 0)  # after close: nothing
    flags[401] = DONE
    steps.lander_land(h)
    stays("nothing is stored after close", lambda: view.read() == 2100 + numbers[-1], 0.02)
    steps.lander_close(h)  # idempotent
    assert steps.lander_wait(h, 2500, 5.0) is None, "a closed lander is waited for"  # False at the timeout
    retained, released = (ctypes.c_int.in_dll(fake, n).value for n in ("fake_retained", "fake_released"))
    assert retained == released == 3, f"contexts retained {retained}, released {released}"
    assert threads() == alone, "the thread outlived the last lander"
    # a lander made after the last one closed gets a thread again
    again = steps.lander_new(word.address)
    steps.lander_watch(again, 2 ** 40, event(402), 0)
    flags[402] = DONE
    until("a new lander's notification released", lambda: view.read() == 2 ** 40)
    steps.lander_close(again)
    assert threads() == alone
    print("closed")

    # the window of looking without pause (lander_spin): 0 naps between looks from the first
    # one (a nap, a voluntary context switch of the thread, per look); a long window looks on
    # without pause (no nap however many looks)
    queries = ctypes.c_long.in_dll(fake, "fake_queries")
    spin_word = SharedWord()
    spin_view = WordView(spin_word.fd)
    spun = steps.lander_new(spin_word.address)

    def looks_in(window_ns: int, number: int, seconds: float = 0.1) -> tuple[int, int]:
        """(looks, naps) of the thread while it waits ``seconds`` for one copy."""
        steps.lander_spin(window_ns)
        steps.lander_watch(spun, number, event(600 + number), 0)
        start, naps = queries.value, lander_naps()
        time.sleep(seconds)
        looks, naps = queries.value - start, lander_naps() - naps
        flags[600 + number] = DONE
        until(f"released under a window of {window_ns} ns", lambda: spin_view.read() == number)
        return looks, naps

    assert steps.lander_spin(2_000_000) == 2_000_000, "the default window is 2 ms"
    (napping, naps), (spinning, spun_naps) = looks_in(0, 1), looks_in(10 ** 10, 2)
    assert naps >= napping * 9 // 10, f"{napping} looks under a window of 0 with {naps} naps: not one per look"
    assert spun_naps <= 2 + spinning // 100, f"{spinning} looks without pause with {spun_naps} naps"
    assert steps.lander_spin(2_000_000) == 10 ** 10
    try:
        steps.lander_spin(-1)
    except ValueError:
        pass
    else:
        raise AssertionError("a negative window was taken")
    steps.lander_close(spun)
    spin_view.close()
    spin_word.close()
    print(f"spin ({napping} looks, {naps} naps; {spinning} looks without pause, {spun_naps} naps)")

    # the receiver's doorbell: each store rings it (after the word moved), by the thread or by
    # the caller's lander_land; nothing rings while the copy runs; the lander's own duplicate
    # of the fd is closed with it
    bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    bell_word = SharedWord()
    bell_view = WordView(bell_word.fd)
    rung = steps.lander_new(bell_word.address)
    fds_before = len(os.listdir("/proc/self/fd"))
    steps.lander_bell(rung, bell)

    def rings() -> int:
        try:
            return os.eventfd_read(bell)
        except BlockingIOError:
            return 0

    steps.lander_watch(rung, 1, event(700), 0)
    stays("no ring while the copy runs", lambda: rings() == 0)
    flags[700] = DONE
    until("the store rings the bell", lambda: bell_view.read() == 1 and rings() == 1)
    steps.lander_watch(rung, 2, event(701), 0)
    steps.lander_watch(rung, 3, event(702), 0)
    flags[701] = flags[702] = DONE
    steps.lander_land(rung)  # whichever of it and the thread stores a number rings for it
    until("each store rings once", lambda: bell_view.read() == 3)
    got = rings()
    assert got == 2, f"two stores rang {got} times"
    for bad, error in ((-1, ValueError), (2 ** 31, ValueError)):
        try:
            steps.lander_bell(rung, bad)
        except error:
            pass
        else:
            raise AssertionError(f"lander_bell took fd {bad}")
    spare = os.open("/dev/null", os.O_RDONLY)
    os.close(spare)  # a number no file holds
    try:
        steps.lander_bell(rung, spare)
    except OSError:
        pass
    else:
        raise AssertionError("lander_bell took a closed fd")
    assert len(os.listdir("/proc/self/fd")) == fds_before + 1, "the lander keeps one duplicate of the bell"
    steps.lander_close(rung)
    assert len(os.listdir("/proc/self/fd")) == fds_before, "the lander's duplicate of the bell outlived it"
    os.close(bell)
    bell_view.close()
    bell_word.close()
    print("bell")
    for v, w in zip(views, words):
        v.close()
        w.close()
    del h
    view.close()
    word.close()
    print("lander ok")


if __name__ == "__main__":
    main()
    sys.exit(0)
