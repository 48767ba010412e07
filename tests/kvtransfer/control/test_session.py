"""A peer's session (``kvtransfer.control.session``): silence counted as each side counts it,
heartbeats when due, suspicion and loss, and the fences of a silent peer's requests. Times are
given, not read: every case sets its own clock."""

from __future__ import annotations

from kvtransfer.control.config import ControlConfig
from kvtransfer.control.session import Fences, PeerSession, PeerState, confirm_silent

CFG = ControlConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0)


def test_the_side_that_sends_heartbeats_counts_silence_from_the_first_unanswered_one():
    s = PeerSession.calling(CFG, now=0.0)
    assert s.state is PeerState.CONNECTING and s.heartbeat(1.0, "me") is None  # not ready: no heartbeat
    s.enter(PeerState.READY, 1.0)
    beat = s.heartbeat(1.0, "me")
    assert beat.seq == 1 and beat.incarnation == "me"
    assert s.heartbeat(1.2, "me") is None  # not due yet
    assert s.heartbeat(1.5, "me").seq == 2  # due again; silence still counts from the first
    assert s.silence(4.0) == 3.0 and s.suspect(4.0) and not s.timed_out(4.0)
    assert s.timed_out(6.5)
    s.heard(6.5)  # any message answers
    assert s.silence(100.0) == 0.0 and not s.suspect(100.0)  # nothing sent since: no silence of the peer's


def test_the_answering_side_counts_silence_from_the_last_message():
    s = PeerSession.answering(CFG, now=10.0, process=None)
    assert s.state is PeerState.READY and s.silence(12.0) == 2.0
    s.heard(14.0)
    assert not s.timed_out(18.0) and s.timed_out(19.5)
    assert s.process_ended(None) is None  # no process named: nothing is proven


def test_a_lost_peer_is_still_sent_heartbeats_and_only_a_ready_one_times_out():
    s = PeerSession.calling(CFG, now=0.0)
    s.enter(PeerState.LOST, 1.0, "no answer")
    assert s.heartbeat(1.0, "me") is not None  # one that answers was alive after all
    assert s.error == "no answer" and not s.timed_out(100.0) and not s.suspect(100.0)


def test_silence_is_confirmed_only_after_what_came_meanwhile_is_read():
    a, b = PeerSession.answering(CFG, 0.0, None), PeerSession.answering(CFG, 0.0, None)
    read = []

    def read_them(silent):  # b's message was waiting on the socket
        read.append(len(silent))
        b.heard(6.0)

    assert confirm_silent([a, b], lambda p: p, 6.0, read_them, lambda p: True) == [a]
    assert read == [2]
    assert confirm_silent([a], lambda p: p, 6.0, read_them, lambda p: False) == []  # replaced meanwhile
    read.clear()
    assert confirm_silent([b], lambda p: p, 7.0, read_them, lambda p: True) == [] and read == []  # none silent


def test_fences_hold_requests_until_lifted_or_released_one_by_one():
    fences = Fences()
    fences.add(3, 1.0, ["r1", "r2"])
    fences.add(3, 2.0, ["r3"])  # a fence already up keeps its start
    assert 3 in fences and fences.holds(3, "r1") and not fences.holds(4, "r1")
    fences.discard(3, "r1")  # the peer said r1 is quiet
    assert not fences.holds(3, "r1")
    assert fences.older_than(1.5) == [3] and fences.older_than(1.0) == []
    assert fences.lift(3) == {"r2", "r3"} and 3 not in fences and fences.lift(3) == set()
