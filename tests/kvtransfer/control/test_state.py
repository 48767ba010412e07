"""KVPoll and RequestStatus: forward only, Failed wins, final states stay; request ids once."""

from __future__ import annotations

import threading

import pytest

from kvtransfer.control.base import check_on_change
from kvtransfer.control.state import DuplicateRequest, KVPoll, RequestStatus, RequestTable


def test_status_moves_forward_only():
    st = RequestStatus("r1")
    assert st.state is KVPoll.Bootstrapping and st.reason is None
    assert st.advance(KVPoll.Transferring)
    assert not st.advance(KVPoll.WaitingForInput)  # backwards: ignored
    assert st.state is KVPoll.Transferring
    assert st.advance(KVPoll.Success) and st.state.final
    assert not st.fail("late failure") and st.state is KVPoll.Success
    t = st.times
    assert set(t) == {KVPoll.Bootstrapping, KVPoll.Transferring, KVPoll.Success}
    assert t[KVPoll.Bootstrapping] <= t[KVPoll.Transferring] <= t[KVPoll.Success]


def test_failed_wins_and_keeps_the_first_reason():
    st = RequestStatus("r2")
    st.advance(KVPoll.WaitingForInput)
    assert st.fail("prefill rank 1 lost (no heartbeat for 3.0 s)")
    assert not st.fail("aborted by decode")
    assert not st.advance(KVPoll.Success)
    assert st.state is KVPoll.Failed and st.reason == "prefill rank 1 lost (no heartbeat for 3.0 s)"
    assert "prefill rank 1 lost" in repr(st)


def test_bad_transitions_are_errors():
    st = RequestStatus("r3")
    with pytest.raises(ValueError, match="fail\\(reason\\)"):
        st.advance(KVPoll.Failed)
    with pytest.raises(ValueError, match="needs a reason"):
        st.fail("")


def test_racing_success_and_failure_end_in_exactly_one_final_state():
    for _ in range(200):
        st = RequestStatus("race")
        results = {}
        a = threading.Thread(target=lambda: results.__setitem__("ok", st.advance(KVPoll.Success)))
        b = threading.Thread(target=lambda: results.__setitem__("fail", st.fail("peer lost")))
        a.start(); b.start(); a.join(); b.join()
        assert results["ok"] != results["fail"]
        assert st.state is (KVPoll.Success if results["ok"] else KVPoll.Failed)


def test_on_change_is_called_once_per_state_entered_after_the_lock_is_released():
    seen = []
    st = RequestStatus("r4", on_change=lambda: seen.append((st.state, st.advance(KVPoll.WaitingForInput))))
    assert st.advance(KVPoll.Transferring)  # the call may touch the status: the lock is free
    assert not st.advance(KVPoll.WaitingForInput)  # ignored moves call nothing
    assert st.fail("peer lost") and not st.fail("again") and not st.advance(KVPoll.Success)
    assert seen == [(KVPoll.Transferring, False), (KVPoll.Failed, False)]
    with pytest.raises(TypeError, match="on_change must be callable or None, got int"):
        check_on_change(5)


def test_request_ids_are_used_once_until_released():
    table = RequestTable()
    table.add("a", 1)
    with pytest.raises(DuplicateRequest, match="'a' is already in use"):
        table.add("a", 2)
    assert table.pop("a") == 1 and len(table) == 0
    table.add("a", 3)
    assert list(table) == [3]
    with pytest.raises(ValueError, match="non-empty str"):
        table.add("", 4)
