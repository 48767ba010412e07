"""A KV manager's one background thread: :class:`EventLoop`.

It polls the manager's ZeroMQ sockets, a wake pipe and its transports' notification
descriptors, runs jobs the owner's threads queue, and calls the manager's ``tick`` for timers
and in-flight transfers. Every transport and
socket call happens in one of its turns, one turn at a time (transports are single-threaded
by contract): on the loop thread, or, for a job called ``inline`` while the loop is between
turns, on the caller's thread under the same turn lock.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import queue
import select
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Optional

import zmq

__all__ = ["EventLoop", "WakePipe", "precise_sleeps"]

log = logging.getLogger("kvtransfer.control")

FD_SETSIZE = 1024  # select(2) takes no descriptor from this one on
STALL_LOG_S = 1.0  # a loop that ran this late, or a turn this long, is logged (heartbeats wait for it)
INLINE_WAIT_S = 5e-4  # an inline call waits this long for a turn in progress before it queues its job
_PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)


def precise_sleeps() -> None:
    """This thread's sleeps end when asked (Linux: timer slack of 1 ns instead of 50 us,
    ``prctl(PR_SET_TIMERSLACK)``): a busy loop's 0.2 ms pause would otherwise last 0.25 ms."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the default slack stays
        pass


class WakePipe:
    """A pipe whose read end a thread waits on (``select``) until another thread calls
    :meth:`set`: a waiting loop's wake-up. Both ends are non-blocking: ``set`` never blocks (a
    full pipe already wakes the reader) and is a no-op once closed."""

    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        try:
            os.write(self._w, b"x")
        except OSError:  # full (the reader wakes anyway: BlockingIOError) or closed
            pass

    def clear(self) -> None:
        """Read what the pipe holds (the wake-ups so far)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: the enums' operators cost more than the call


def _readable(sock) -> bool:
    """``sock`` holds a message to read (False once it is closed)."""
    try:
        return bool(sock.getsockopt(_EVENTS) & _POLLIN)
    except zmq.ZMQError:
        return False


def _poller(fds) -> "select.poll":
    """A poll object watching ``fds`` for input."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    return p


class EventLoop:
    """One background thread: sockets, queued jobs, and a tick.

    ``handlers`` maps a ZeroMQ socket to the function that drains it; ``tick()`` runs after
    every wake-up and returns how long (seconds) the loop may sleep next (short while
    transfers are in flight: a pause under 1 ms sleeps instead of spinning, which on a small
    machine would take the core the other ranks need). ``fds``: more descriptors that end a
    pause when they turn readable -- the transports' :meth:`~transport.base.Transport.notification_fd`,
    which the tick clears as it polls them: a landed notification is then read as it lands,
    not at the end of the pause. Jobs run in submission order, one turn
    at a time; ``call`` returns a Future of the job's result.

    A *turn* (queued jobs, the handlers of readable sockets, the tick) holds the loop's turn
    lock; so does an ``inline`` call, which runs on the caller's thread when the loop is
    between turns (a job's wake-up is a thread switch: ~0.1-0.25 ms on a small machine, on the
    path from ``send()`` to the write's post), or once the turn in progress ends (waiting at
    most ``INLINE_WAIT_S``: a queued job would wait for the loop thread, and that thread may
    wait for the GIL, which the caller keeps while it goes on with its own work). Between
    turns the loop thread waits in ``select`` on the wake pipe and the sockets' file
    descriptors, never in a ZeroMQ call, so whoever holds the lock may use the sockets (ZeroMQ
    allows a socket to change threads across a full memory barrier, which the lock is). The
    descriptors only signal that a socket's state may have changed: a turn asks each socket
    whether it holds a message, and the loop does not wait while one does. The wait is a
    ``select`` (a pause to the microsecond); ``select`` takes no descriptor past ``FD_SETSIZE``
    (1024), so a loop with one waits in ``poll`` instead, whose pause is whole milliseconds."""

    def __init__(self, name: str, handlers: dict, tick: Callable[[], float], fds: Iterable[int] = ()):
        self._handlers, self._tick = dict(handlers), tick
        self._more_fds = list(fds)
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = WakePipe()
        self._sock_fds = {sock: sock.getsockopt(zmq.FD) for sock in self._handlers}  # socket -> its descriptor
        self._stop = threading.Event()
        self._turn = threading.Lock()  # held by the running turn (loop thread or an inline call)
        self._owner: Optional[int] = None  # the thread that holds it
        self._fds: list = []  # what the loop waits on between turns (_watch)
        self._socket_fds: list = []  # the sockets' of them
        self._pollers = None  # (all, the sockets') poll objects when a descriptor is past FD_SETSIZE
        self._watch()
        self._holding = False  # a socket held a message at the end of the last turn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def on_loop(self) -> bool:
        """The calling thread runs the loop's turn (the loop thread, or an inline call)."""
        return self._owner == threading.get_ident()

    def call(self, fn: Callable, *args, wake: bool = True, inline: bool = False) -> Future:
        """Run ``fn(*args)`` in a turn of the loop; its result or exception lands in the Future.

        ``wake=False`` queues the job without waking the loop: it runs at the loop's next
        turn (another job, a socket message, the tick), before any message that turn handles.
        For bookkeeping nobody waits for: each wake-up costs the caller and the loop a thread
        switch (~0.1 ms on a small machine), and an owner that creates a request and sends
        its first chunk right after pays one instead of two.

        ``inline=True`` runs the job now on the caller's thread when the loop is between turns
        or its turn in progress ends within ``INLINE_WAIT_S``, after what such a turn runs
        before its tick (the queued jobs, the handlers of readable sockets); else (or when the
        caller is the loop's turn itself) it is queued and the loop woken, as without it. The
        loop is woken afterwards to look at its sockets again."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("the manager is closed"))
            return fut
        if inline and self._owner != threading.get_ident() and self._turn.acquire(timeout=INLINE_WAIT_S):
            try:
                self._owner = threading.get_ident()
                self._handle_inline()  # what came before it (a message it may need) is handled first
                self._run_job(fn, args, fut)
            finally:
                self._owner = None
                self._turn.release()
            self.wake()  # a socket call of the job may have taken the edge the loop waits for
            return fut
        self._jobs.put((fn, args, fut))
        if wake:
            self.wake()
        return fut

    def wake(self) -> None:
        """Make the loop run its queued jobs now."""
        self._wake.set()

    def add_socket(self, sock, handler: Callable[[], None]) -> None:
        """Poll ``sock`` too (in a turn, or before ``start``)."""
        self._handlers[sock] = handler
        self._sock_fds[sock] = sock.getsockopt(zmq.FD)
        self._watch()

    def remove_socket(self, sock) -> None:
        """Stop polling ``sock`` (in a turn); the caller closes it."""
        self._handlers.pop(sock, None)
        if self._sock_fds.pop(sock, None) is not None:
            self._watch()

    def _watch(self) -> None:
        """The descriptors the loop waits on: the wake pipe's, the sockets', the others given
        (new lists: the loop may be waiting on the old one)."""
        self._socket_fds = list(self._sock_fds.values())
        self._fds = [self._wake.fd, *self._socket_fds, *self._more_fds]
        self._pollers = None
        if max(self._fds) >= FD_SETSIZE:
            self._pollers = (_poller(self._fds), _poller(self._socket_fds))

    def _readable(self, sockets_only: bool, timeout_s: float) -> list:
        """The descriptors readable within ``timeout_s`` (sockets' only, or all the loop waits
        on): ``select``, or ``poll`` (at least 1 ms when it waits) past ``FD_SETSIZE``."""
        pollers = self._pollers
        if pollers is None:
            return select.select(self._socket_fds if sockets_only else self._fds, [], [], timeout_s)[0]
        wait_ms = math.ceil(timeout_s * 1e3) if timeout_s > 0 else 0
        return [fd for fd, _ in (pollers[1] if sockets_only else pollers[0]).poll(wait_ms)]

    def _run(self) -> None:
        precise_sleeps()
        sleep = 0.0
        while not self._stop.is_set():
            woken = True  # without a wait, the pipe is read anyway
            due = time.monotonic() + sleep
            if sleep > 0:
                try:
                    woken = self._wake.fd in self._readable(False, sleep)
                except (OSError, ValueError):  # a socket closed since the list was made
                    pass
            with self._turn:
                start = time.monotonic()
                self._owner = threading.get_ident()
                try:
                    sleep = self._one_turn(woken)
                finally:
                    self._owner = None
            self._log_stall(start - due, time.monotonic() - start)

    def _log_stall(self, late: float, turn: float) -> None:
        """Say so when the loop ran late (the process got no CPU, or another thread held the
        GIL or an inline turn) or a turn took long: a peer may time this rank out meanwhile."""
        if late > STALL_LOG_S:
            log.warning("control loop %s ran %.1f s late (an inline call held its turn, or the process got no CPU "
                        "or GIL; peers saw no heartbeat meanwhile)", self._thread.name, late)
        if turn > STALL_LOG_S:
            log.warning("control loop %s: one turn took %.1f s (peers saw no heartbeat meanwhile)",
                        self._thread.name, turn)

    def _one_turn(self, woken: bool) -> float:
        """Jobs, the handlers of readable sockets, jobs queued meanwhile, the tick; the pause
        before the next turn (none while a socket still holds a message). ``woken``: the wake
        pipe signalled (it is emptied; a busy loop's turns mostly find it empty)."""
        if woken:
            self._wake.clear()
        self._handle()
        sleep = self._guard(self._tick)
        sleep = 0.05 if sleep is None else sleep
        self._holding = False
        for sock in self._handlers:
            if _readable(sock):  # its descriptor may not signal again for what it already holds
                sleep, self._holding = 0.0, True
        return sleep

    def _handle(self) -> None:
        """The queued jobs, the handlers of readable sockets, the jobs queued meanwhile (not
        left for the next turn)."""
        self._run_jobs()
        for sock, handler in list(self._handlers.items()):
            if sock in self._handlers and _readable(sock):
                self._guard(handler)
        self._run_jobs()

    def _handle_inline(self) -> None:
        """:meth:`_handle` for an inline call, which asks the sockets only when one may hold a
        message: it held one after the last turn, or its descriptor signalled since (a select
        costs a fraction of asking a socket, ~40 us on a small machine)."""
        try:
            signalled = self._holding or bool(self._readable(True, 0))
        except (OSError, ValueError):  # a socket closed since the list was made
            signalled = True
        if not signalled:
            self._run_jobs()
            return
        self._handle()
        self._holding = True  # a handler may have left messages: ask again until a turn has looked

    def _run_jobs(self) -> None:
        jobs = self._jobs
        while not jobs.empty():  # cheaper than the exception of an empty get (most turns have no job)
            try:
                fn, args, fut = jobs.get_nowait()
            except queue.Empty:
                return
            self._run_job(fn, args, fut)

    @staticmethod
    def _run_job(fn: Callable, args: tuple, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller through the Future
            fut.set_exception(exc)

    def _guard(self, fn):
        try:
            return fn()
        except Exception:  # a bug in one handler must not end the loop
            log.exception("control loop %s: %s failed", self._thread.name, getattr(fn, "__name__", fn))
            return None

    def close(self, final: Optional[Callable] = None) -> None:
        """Run ``final`` on the loop (if still running), stop the thread, join it (idempotent)."""
        if self._stop.is_set():
            return
        if final is not None and self._thread.is_alive():
            try:
                self.call(final).result(timeout=30)
            except Exception:
                log.exception("control loop %s: shutdown step failed", self._thread.name)
        self._stop.set()
        self.wake()
        if self._thread.is_alive():
            self._thread.join()
        while True:  # jobs queued after the last turn: their Futures say the manager closed
            try:
                _, _, fut = self._jobs.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the manager is closed"))
        self._wake.close()
