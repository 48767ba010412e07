"""The test decides when a deregister's wait for the holders of its region ends, not the
machine's speed.

:func:`revoke_clock` stands a :class:`RevokeClock` in for the ``time`` module of
:mod:`transport.revocation.owner` (the owner's side of revocation, both backends): the wait
(``Holders.revoke``) naps between its looks at the holders' answers, and at each nap it asks
:attr:`RevokeClock.expire`; once that says so, the clock jumps past any revoke's deadline and the
wait ends as at its timeout (RevokeTimeout naming the silent holders, or ``force``). With the
backend's ``revoke_timeout_s`` set long, that timeout is only a backstop against a hang.
:meth:`RevokeClock.no_wait` makes a nap an error: a revoke that must not wait for anyone (a
holder once silent is not waited for again) fails the test at once instead of after a delay.
"""

from __future__ import annotations

import contextlib
import time

LONG_S = 60.0  # a revoke_timeout_s the tests never reach: the clock ends the wait


class RevokeClock:
    """``monotonic`` and ``sleep`` for :mod:`transport.revocation.owner` (module docstring)."""

    def __init__(self):
        self.expire = lambda: False  # asked at each nap of a wait: True ends it as at its timeout
        self.on_nap = lambda: None  # called at each nap, before ``expire`` (what the test does meanwhile)
        self.naps = 0
        self._may_wait = True
        self._skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self._skipped

    def sleep(self, seconds: float) -> None:
        assert self._may_wait, "deregister waited for a holder (one once silent is not waited for again)"
        self.naps += 1
        self.on_nap()
        if self.expire():
            self._skipped += 1e9  # past any revoke's deadline
        time.sleep(seconds)

    @contextlib.contextmanager
    def no_wait(self):
        """Inside: a revoke that naps fails the test (it waited for someone)."""
        self._may_wait = False
        try:
            yield
        finally:
            self._may_wait = True


def revoke_clock(monkeypatch) -> RevokeClock:
    clock = RevokeClock()
    monkeypatch.setattr("transport.revocation.owner.time", clock)
    return clock


def owner_side(transport):
    """``transport``'s :class:`~transport.revocation.owner.Holders` (NIXL keeps it on its core)."""
    core = getattr(transport, "_core", None)
    return core.holders if core is not None else transport._holders


def answered(transport, names) -> bool:
    """Every holder of ``transport``'s export named in ``names`` acknowledged its latest revoke
    (read off the owner's holds: what a deregister waits for)."""
    holders = owner_side(transport)
    return all(h.acked >= holders.seq for h in holders.holding() if h.name in names)


def holds(transport, name: str) -> bool:
    """The writer named ``name`` holds ``transport``'s export (its hold was answered)."""
    return any(h.name == name for h in owner_side(transport).holding())


def silent(transport, name: str) -> bool:
    """The owner counts the writer named ``name`` as silent (a revoke of it went unanswered, and
    nothing of it has been read since): a revoke does not wait for it."""
    return any(h.name == name and h.silent_since is not None for h in owner_side(transport).holding())
