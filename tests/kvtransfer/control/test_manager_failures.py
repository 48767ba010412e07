"""KV managers when things go wrong, with real rank processes: a prefill rank killed and
restarted, a decode rank killed (its prefill peer keeps serving another), a write that fails in
the transport (in its post, or after it: the transport peer lost and connected anew), aborts
from prefill, layouts that cannot exchange data, and hundreds of requests in flight at once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import numpy as np
import pytest

from kvtransfer.control.bootstrap import BootstrapService
from kvtransfer.layout import RankLayout
from tests.kvtransfer.control._ranks import (Abort, HoldLoop, IsReleased, Prefill, RankProcess, RankSpec, Receive,
                                             Released, Rows, SendLast, Stats, Verify, Wait, until_state,
                                             wait_forgotten)
from tests._stop import stop

# The transfer timeout is a backstop no test reaches unless it sets its own: a request's pages
# released within Released's 30 s were not released by it.
FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "transfer_timeout_s": 600.0}


@pytest.fixture
def bootstrap():
    with BootstrapService() as svc:
        yield svc.address


@pytest.fixture
def ranks():
    started = []

    def start(spec: RankSpec) -> RankProcess:
        rank = RankProcess(spec)
        started.append(rank)
        return rank.started()

    yield start
    for rank in started:
        rank.close()


def wait_ready(decode, senders, timeout_s=20.0):
    """Poll until the decode rank's ready prefill ranks are ``senders`` (a sorted list), or fail
    naming what they are."""
    deadline = time.monotonic() + timeout_s
    while (ready := decode.call(Stats())["ready_senders"]) != senders:
        assert time.monotonic() < deadline, f"{decode.name}: ready senders {ready}, not {senders}, after {timeout_s} s"
        time.sleep(0.05)


def prefill_spec(bootstrap, tp_rank, tp_size, **kw):
    return RankSpec("prefill", tp_rank, tp_size, 16, bootstrap, **{"config": FAST, **kw})


def decode_spec(bootstrap, tp_rank=0, tp_size=1, instance="decode-a", **kw):
    return RankSpec("decode", tp_rank, tp_size, 4, bootstrap, instance=instance, **{"config": FAST, **kw})


def test_a_killed_prefill_rank_fails_its_requests_and_its_restart_is_used_again(bootstrap, ranks):
    prefill = [ranks(prefill_spec(bootstrap, r, 2)) for r in range(2)]
    decode = ranks(decode_spec(bootstrap))
    decode.call(Receive("doomed", 40))
    for p in prefill:
        p.call(Prefill("doomed", 40, (16, 24), hold_last=True))
    pid = prefill[1].child.proc.pid
    prefill[1].kill()
    state, reason = decode.call(Wait("doomed", timeout_s=20))
    # silent for two heartbeat intervals, and its process is gone (one host): lost by its death
    # (the heartbeat timeout would say "no answer"), which proves it writes nothing more
    assert state == "Failed" and f"prefill rank 1 lost: its process (pid {pid}) has exited" in reason, reason
    state, reason = prefill[0].call(Wait("doomed", timeout_s=20))
    assert state == "Failed" and "prefill rank 1 lost" in reason  # decode told the survivor
    decode.call(Released("doomed"))  # rank 0 quiesced; rank 1 is dead: no wait for the transfer timeout
    # a request while rank 1 is down fails at once, naming it; nothing was asked of anyone
    decode.call(Receive("while-down", 8))
    state, reason = decode.call(Wait("while-down", timeout_s=10))
    assert state == "Failed" and "prefill rank 1" in reason
    decode.call(Released("while-down"))
    # restart rank 1: it registers again, decode reconnects by itself
    prefill[1] = ranks(prefill_spec(bootstrap, 1, 2))
    wait_ready(decode, [0, 1])
    decode.call(Receive("again", 30))
    for p in prefill:
        p.call(Prefill("again", 30, (30,)))
    assert decode.call(Wait("again")) == ("Success", None)
    assert decode.call(Verify("again"))[0] == 0


def test_a_killed_decode_rank_fails_only_its_own_requests(bootstrap, ranks):
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    doomed = ranks(decode_spec(bootstrap, instance="decode-a"))
    other = ranks(decode_spec(bootstrap, instance="decode-b"))
    doomed.call(Receive("to-a", 24))
    prefill.call(Prefill("to-a", 24, (8, 16), hold_last=True))
    until_state(prefill, "to-a", "Transferring")  # the ask arrived and the first chunk went
    doomed.kill()
    state, reason = prefill.call(Wait("to-a", timeout_s=20))
    # lost to heartbeats, or to the transport first if a write was still to post
    assert state == "Failed" and "decode rank ('decode-a', 0)" in reason
    other.call(Receive("to-b", 24))
    prefill.call(Prefill("to-b", 24, (24,)))
    assert other.call(Wait("to-b")) == ("Success", None)
    assert prefill.call(Wait("to-b")) == ("Success", None)
    assert other.call(Verify("to-b"))[0] == 0
    wait_forgotten(prefill)


def test_a_decode_rank_killed_while_a_chunk_goes_layer_by_layer_fails_it_and_stops_the_rest(bootstrap, ranks):
    """The first layer groups went; the decode rank dies: the request fails on prefill, the
    groups sent after that post nothing (the held last one included), and the rank serves on."""
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    doomed = ranks(decode_spec(bootstrap, instance="decode-a"))
    other = ranks(decode_spec(bootstrap, instance="decode-b"))
    doomed.call(Receive("mid-a", 40))
    prefill.call(Prefill("mid-a", 40, (16, 24), hold_last=True, layer_groups=3))
    until_state(prefill, "mid-a", "Transferring")
    doomed.kill()
    state, reason = prefill.call(Wait("mid-a", timeout_s=20))
    assert state == "Failed" and "decode rank ('decode-a', 0)" in reason
    prefill.call(SendLast("mid-a"))  # the last group of a failed request: refused by nothing, posted nowhere
    assert prefill.call(Wait("mid-a")) == ("Failed", reason)
    other.call(Receive("mid-b", 40))
    prefill.call(Prefill("mid-b", 40, (16, 24), layer_groups=3))
    assert other.call(Wait("mid-b")) == ("Success", None)
    assert other.call(Verify("mid-b"))[0] == 0
    wait_forgotten(prefill)


def test_abort_from_prefill_fails_decode_and_releases(bootstrap, ranks):
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    decode = ranks(decode_spec(bootstrap))
    decode.call(Receive("p-abort", 20))
    prefill.call(Prefill("p-abort", 20, (10, 10), hold_last=True))
    prefill.call(Abort("p-abort", "out of memory"))
    assert prefill.call(Wait("p-abort")) == ("Failed", "out of memory")
    state, reason = decode.call(Wait("p-abort"))
    assert state == "Failed" and "prefill rank 0: out of memory" in reason
    decode.call(Released("p-abort"))


def test_an_ask_that_comes_after_prefill_aborted_is_told_at_once(bootstrap, ranks):
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    decode = ranks(decode_spec(bootstrap))
    prefill.call(Prefill("late-ask", 20, (10, 10), hold_last=True))
    prefill.call(Abort("late-ask", "out of memory"))
    assert prefill.call(Wait("late-ask")) == ("Failed", "out of memory")
    decode.call(Receive("late-ask", 20))
    state, reason = decode.call(Wait("late-ask", timeout_s=10))
    assert state == "Failed" and "prefill rank 0: out of memory" in reason
    decode.call(Released("late-ask"))


@contextlib.contextmanager
def paused(rank):
    """``with paused(rank):`` every thread of the rank's process stopped (SIGSTOP), as a
    loaded machine can stop a live one, then running again."""
    stop(rank.child.proc.pid)
    try:
        yield
    finally:
        os.kill(rank.child.proc.pid, signal.SIGCONT)


def one_request_in_flight(bootstrap, ranks, rid, prefill=FAST, decode=FAST):
    """A prefill and a decode rank (control configs ``prefill`` and ``decode``), and request
    ``rid`` half written between them."""
    prefill = ranks(prefill_spec(bootstrap, 0, 1, config=prefill))
    decode = ranks(decode_spec(bootstrap, config=decode))
    decode.call(Receive(rid, 20))
    prefill.call(Prefill(rid, 20, (10, 10), hold_last=True))
    until_state(prefill, rid, "Transferring")
    return prefill, decode


def assert_lands(prefill, decode, rid):
    """A new request ``rid`` lands byte for byte, and both ranks forget it."""
    decode.call(Receive(rid, 30))
    prefill.call(Prefill(rid, 30, (30,)))
    assert decode.call(Wait(rid)) == ("Success", None)
    assert decode.call(Verify(rid))[0] == 0
    wait_forgotten(prefill)


def test_a_decode_rank_paused_past_the_heartbeat_timeout_is_dropped_then_connected_again(bootstrap, ranks):
    """The prefill rank drops a decode rank silent for the heartbeat timeout (failing its
    request); once that rank runs again, its next heartbeat is answered NotConnected and it
    says hello anew: the next request lands with no process restarted."""
    prefill, decode = one_request_in_flight(bootstrap, ranks, "paused")
    with paused(decode):
        state, reason = prefill.call(Wait("paused", timeout_s=20))
        assert state == "Failed" and "decode rank ('decode-a', 0) lost: no heartbeat for 1.5 s" in reason
    state, reason = decode.call(Wait("paused", timeout_s=20))
    # told by the prefill rank, or (its answer to the last heartbeat before the pause not read
    # yet) timed out by the decode rank itself first: both name the loss
    assert state == "Failed" and ("prefill rank 0 dropped this rank: decode rank ('decode-a', 0) lost" in reason
                                  or "prefill rank 0 lost: no answer" in reason), reason
    decode.call(Released("paused"))
    wait_ready(decode, [0])
    assert_lands(prefill, decode, "after")


def test_dropping_a_paused_decode_rank_with_a_write_in_flight_holds_no_other_rank_up(bootstrap, ranks):
    """A decode rank pauses (SIGSTOP) with a write in flight to it: over tcp the write stays in
    flight (NIXL waits for the paused receiver). The prefill rank drops it at the heartbeat
    timeout; the write is cancelled and the rank's transport peer closes once NIXL no longer
    runs the write (at the write's deadline at the latest) -- without holding the prefill
    rank's loop meanwhile: another decode rank keeps it, and its requests land. Once the paused
    rank runs again, it is connected anew and served."""
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    stuck = ranks(decode_spec(bootstrap, instance="decode-a"))
    other = ranks(decode_spec(bootstrap, instance="decode-b"))
    stuck.call(Receive("stuck", 20))
    prefill.call(Prefill("stuck", 20, (10, 10), hold_last=True))
    until_state(prefill, "stuck", "Transferring")
    with paused(stuck):
        prefill.call(SendLast("stuck"))  # its write waits for the paused receiver
        state, reason = prefill.call(Wait("stuck", timeout_s=20))
        assert state == "Failed" and "decode rank ('decode-a', 0) lost: no heartbeat" in reason, reason
        for n in range(3):  # the write to the paused rank is still in flight meanwhile
            assert_lands(prefill, other, f"other-{n}")
        assert other.call(Stats())["ready_senders"] == [0]
    state, _ = stuck.call(Wait("stuck", timeout_s=20))
    assert state == "Failed"
    stuck.call(Released("stuck"))
    wait_ready(stuck, [0])
    assert_lands(prefill, stuck, "after")


def test_a_prefill_rank_paused_past_the_heartbeat_timeout_is_lost_then_connected_again(bootstrap, ranks):
    """The decode rank loses a prefill rank that leaves its heartbeats unanswered for the
    timeout (failing the request), but keeps asking: the first answer after the pause makes it
    say hello anew, the prefill rank replaces its old entry (failing its side), and the next
    request lands with no process restarted."""
    prefill, decode = one_request_in_flight(bootstrap, ranks, "paused")
    with paused(prefill):
        state, reason = decode.call(Wait("paused", timeout_s=20))
        assert state == "Failed" and "prefill rank 0 lost: no answer for 1.5 s" in reason
        # it may run again and post the request's writes: its pages stay fenced
        assert decode.call(IsReleased("paused")) is False
        time.sleep(1.0)
        assert decode.call(IsReleased("paused")) is False
    # the hello it answers after the pause comes once it closed its old entry with drain
    decode.call(Released("paused"))
    wait_ready(decode, [0])
    state, reason = prefill.call(Wait("paused", timeout_s=20))
    assert state == "Failed" and "decode rank ('decode-a', 0)" in reason, reason
    assert_lands(prefill, decode, "after")


def test_a_killed_prefill_rank_whose_process_is_unknown_is_found_lost_by_its_transport(bootstrap, ranks):
    """As across hosts: the prefill rank cannot name its process, so its death is not read in
    /proc. Once it is suspect (silent for two heartbeat intervals), the decode rank's NIXL
    transport, asked about that writer, probes it with a 1-byte write, which fails with a
    disconnect: the request fails and its pages are released then, long before the (20 s)
    heartbeat timeout and the (30 s) transfer timeout."""
    patient = {**FAST, "heartbeat_timeout_s": 20.0}
    prefill = ranks(prefill_spec(bootstrap, 0, 1, names_process=False, config=patient))
    decode = ranks(decode_spec(bootstrap, config=patient))
    decode.call(Receive("doomed", 20))
    prefill.call(Prefill("doomed", 20, (10, 10), hold_last=True))
    until_state(prefill, "doomed", "Transferring")
    prefill.kill()
    state, reason = decode.call(Wait("doomed", timeout_s=20))
    assert state == "Failed" and "prefill rank 0 lost: its nixl transport is lost (" in reason, reason
    assert "DISCONNECT" in reason.upper(), reason  # not the heartbeat timeout's "no answer for 20 s"
    decode.call(Released("doomed"))


def test_a_prefill_rank_paused_past_the_transfer_timeout_has_its_pages_released_then(bootstrap, ranks):
    """A prefill rank that stays silent (here paused: alive, so nothing proves it will not
    write) past the transfer timeout: the pages of the request it was lost with are fenced
    until then, after which it posts nothing for that request, and then released."""
    config = {**FAST, "transfer_timeout_s": 4.0}
    prefill, decode = one_request_in_flight(bootstrap, ranks, "orphan", prefill=config, decode=config)
    with paused(prefill):
        state, reason = decode.call(Wait("orphan", timeout_s=20))
        assert state == "Failed" and "prefill rank 0 lost: no answer for 1.5 s" in reason
        assert decode.call(IsReleased("orphan")) is False
        decode.call(Released("orphan", timeout_s=20.0))  # once the transfer timeout passed
    state, reason = prefill.call(Wait("orphan", timeout_s=20))
    assert state == "Failed", (state, reason)  # its deadline passed while paused: nothing more was posted
    wait_ready(decode, [0])
    assert_lands(prefill, decode, "after")


def test_a_killed_decode_rank_is_dropped_before_the_heartbeat_timeout(bootstrap, ranks):
    """One host: a decode rank killed mid-request is dropped once silent for two heartbeat
    intervals, its process gone, not after the (here long) heartbeat timeout."""
    patient = {**FAST, "heartbeat_timeout_s": 20.0}
    prefill, decode = one_request_in_flight(bootstrap, ranks, "doomed", prefill=patient, decode=patient)
    pid = decode.child.proc.pid
    decode.kill()
    state, reason = prefill.call(Wait("doomed", timeout_s=30))
    # lost by its death, not by the heartbeat timeout ("no answer for 20 s")
    assert state == "Failed" and f"decode rank ('decode-a', 0) lost: its process (pid {pid}) has exited" in reason, \
        reason
    wait_forgotten(prefill)


def test_a_chunk_sent_after_its_requests_deadline_is_not_posted(bootstrap, ranks):
    """A prefill rank's loop held past a request's deadline (as a paused process: its sweep has
    not looked since) while the engine sends the last chunk: the turn that takes the chunk fails
    the request instead of posting it (a decode rank that lost this one lets its pages go after
    that deadline); both sides end Failed."""
    patient = {**FAST, "heartbeat_timeout_s": 20.0}
    prefill, decode = one_request_in_flight(bootstrap, ranks, "late", prefill={**patient, "transfer_timeout_s": 3.0},
                                            decode=patient)
    prefill.call(HoldLoop(4.0, send_last=True, tick_after=False))
    state, reason = prefill.call(Wait("late", timeout_s=20))
    assert (state, reason) == ("Failed", "not done after 3 s: its deadline passed before a chunk was posted")
    state, reason = decode.call(Wait("late", timeout_s=20))
    assert state == "Failed" and "its deadline passed before a chunk was posted" in reason, reason
    decode.call(Released("late"))


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_turn_longer_than_the_heartbeat_timeout_loses_no_peer(bootstrap, ranks, side):
    """A rank whose own turn ran past the heartbeat timeout (a loaded machine) has not read
    what came meanwhile: it reads it before it calls a peer lost, so the request in flight
    lands. (The peer, patient here, saw no heartbeat or answer meanwhile: with its own timeout
    it would rightly lose this rank.)"""
    patient = {**FAST, "heartbeat_timeout_s": 20.0}
    configs = {"prefill": FAST, "decode": patient} if side == "prefill" else {"prefill": patient, "decode": FAST}
    prefill, decode = one_request_in_flight(bootstrap, ranks, "held", **configs)
    (prefill if side == "prefill" else decode).call(HoldLoop(2.5))  # FAST: lost after 1.5 s of silence
    prefill.call(SendLast("held"))
    assert decode.call(Wait("held")) == ("Success", None)
    assert prefill.call(Wait("held")) == ("Success", None)
    assert decode.call(Verify("held"))[0] == 0
    assert decode.call(Stats())["ready_senders"] == [0]


def test_a_request_made_while_its_prefill_rank_is_away_waits_for_the_rank_to_come_back(bootstrap, ranks):
    patient = {**FAST, "heartbeat_timeout_s": 20.0}  # how long a request waits for a lost rank
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    decode = ranks(decode_spec(bootstrap, config=patient))
    prefill.close()  # says goodbye: lost at once
    wait_ready(decode, [], timeout_s=10)  # the decode rank saw its prefill rank leave
    decode.call(Receive("across", 24))
    assert decode.call(Wait("across", timeout_s=0.5)) == ("Bootstrapping", None)  # held, not failed
    prefill = ranks(prefill_spec(bootstrap, 0, 1))  # a new incarnation registers
    prefill.call(Prefill("across", 24, (24,)))
    assert decode.call(Wait("across")) == ("Success", None)
    assert decode.call(Verify("across"))[0] == 0


def test_layouts_that_cannot_exchange_data_fail_the_handshake_naming_both(bootstrap, ranks):
    ranks(prefill_spec(bootstrap, 0, 1, kind="mha"))
    with pytest.raises(RuntimeError, match=r"HandshakeError.*refused decode rank 0: layouts differ in kind: "
                                           r"this side mha, peer mla"):
        ranks(decode_spec(bootstrap, kind="mla"))


def test_hundreds_of_requests_in_flight(bootstrap, ranks):
    prefill = [ranks(prefill_spec(bootstrap, r, 2, pages=400)) for r in range(2)]
    decode = ranks(decode_spec(bootstrap, pages=1200))
    rng = np.random.default_rng(3)
    lengths = {f"many-{i}": int(rng.integers(1, 12)) for i in range(200)}
    for rid, n in lengths.items():
        decode.call(Receive(rid, n))
    for rid, n in lengths.items():
        for p in prefill:
            p.call(Prefill(rid, n, (n,), first_token=n))
    for rid, n in lengths.items():
        assert decode.call(Wait(rid)) == ("Success", None), rid
        assert decode.call(Verify(rid)) == (0, n)
    for p in prefill:
        for rid in lengths:
            assert p.call(Wait(rid)) == ("Success", None)
        wait_forgotten(p)
    wait_forgotten(decode)


def test_the_transfer_timeout_fails_a_request_whose_last_chunk_never_comes(bootstrap, ranks):
    config = {**FAST, "transfer_timeout_s": 1.5}
    prefill = ranks(prefill_spec(bootstrap, 0, 1, config=config))
    decode = ranks(decode_spec(bootstrap, config=config))
    decode.call(Receive("stuck", 20))
    prefill.call(Prefill("stuck", 20, (10, 10), hold_last=True))
    state, reason = decode.call(Wait("stuck", timeout_s=20))
    # both sides time it out; under load either may be first (the other is told by an abort)
    assert state == "Failed" and re.search(r"not done after 1.5 s \((waiting for prefill ranks \[0\]|10 tokens sent, "
                                           r"waiting for the last chunk)\)", reason), reason
    assert prefill.call(Wait("stuck", timeout_s=20))[0] == "Failed"
    decode.call(Released("stuck"))


def test_a_closing_decode_rank_says_goodbye_before_freeing_its_memory(bootstrap, ranks):
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    leaving = ranks(decode_spec(bootstrap, instance="leaving"))
    staying = ranks(decode_spec(bootstrap, instance="staying"))
    assert prefill.call(Stats())["decode_peers"] == [("leaving", 0), ("staying", 0)]
    leaving.call(Receive("half", 20))
    prefill.call(Prefill("half", 20, (10, 10), hold_last=True))
    until_state(prefill, "half", "Transferring")
    leaving.close()  # its manager closes: goodbye, answered once no write to it is in flight
    state, reason = prefill.call(Wait("half", timeout_s=20))
    assert state == "Failed" and ("said goodbye" in reason or "decode manager closed" in reason)
    assert prefill.call(Stats())["decode_peers"] == [("staying", 0)]
    staying.call(Receive("fine", 12))
    prefill.call(Prefill("fine", 12, (12,)))
    assert staying.call(Wait("fine")) == ("Success", None)
    assert staying.call(Verify("fine"))[0] == 0


def test_junk_on_a_prefill_control_socket_is_dropped_and_the_rank_keeps_serving(bootstrap, ranks):
    import zmq

    from kvtransfer.control.bootstrap import BootstrapClient
    from kvtransfer.control.wire import Heartbeat, NotConnected, Ping
    from kvtransfer.control.wire import decode as decode_frame

    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    decode = ranks(decode_spec(bootstrap))
    (reg,) = BootstrapClient(bootstrap).topology(0).rank_infos()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(reg.control_addr)
    for junk in ([b"\xc1not msgpack"], [Ping(nonce=1).to_msgpack()[:-2]], [b"a", b"b", b"c"],
                 [Heartbeat(seq=1, incarnation="stranger").to_msgpack()],  # no hello: told so
                 [b"\x92\x01\x02"]):
        sock.send_multipart(junk)
    assert sock.poll(10_000)
    answer = decode_frame(sock.recv())  # the only answer: junk is dropped
    assert isinstance(answer, NotConnected) and answer.reason == "this prefill rank holds no hello of it"
    assert not sock.poll(300)
    sock.close()
    decode.call(Receive("after-junk", 9))
    prefill.call(Prefill("after-junk", 9, (9,)))
    assert decode.call(Wait("after-junk")) == ("Success", None)
    assert decode.call(Verify("after-junk"))[0] == 0


def test_a_request_waits_for_decode_past_the_transfer_timeout_and_its_deadline_counts_from_the_ask(bootstrap,
                                                                                                    ranks):
    """Decode reserves first: a prefill request may wait for decode's ask as long as decode's
    queue takes (a decode rank is connected), and its transfer deadline starts at the ask."""
    config = {**FAST, "transfer_timeout_s": 1.0}
    prefill = ranks(prefill_spec(bootstrap, 0, 1, config=config))
    decode = ranks(decode_spec(bootstrap, config=config))
    wait_ready(decode, [0])
    prefill.call(Prefill("patient", 20, (10, 10)))  # its KV is ready; nobody has asked for it yet
    assert prefill.call(Wait("patient", timeout_s=3.0)) == ("Bootstrapping", None)  # 3 transfer timeouts
    decode.call(Receive("patient", 20))
    assert decode.call(Wait("patient")) == ("Success", None)
    assert prefill.call(Wait("patient")) == ("Success", None)
    assert decode.call(Verify("patient"))[0] == 0


def test_a_request_on_a_prefill_rank_no_decode_rank_is_connected_to_fails_after_the_handshake_timeout(bootstrap,
                                                                                                       ranks):
    prefill = ranks(prefill_spec(bootstrap, 0, 1, config={**FAST, "handshake_timeout_s": 0.5}))
    prefill.call(Prefill("lonely", 20, (20,)))
    state, reason = prefill.call(Wait("lonely", timeout_s=20))
    assert state == "Failed" and "no decode node is connected to this prefill node" in reason


def wait_released(rank, rid, timeout_s=10.0):
    """Poll until the request's pages may be reused (nothing is freed), or fail."""
    deadline = time.monotonic() + timeout_s
    while not rank.call(IsReleased(rid)):
        assert time.monotonic() < deadline, f"{rank.name}: request {rid} not released after {timeout_s} s"
        time.sleep(0.01)


def test_a_write_that_fails_in_the_transport_mid_chunk_fails_the_request_and_stops_the_rest(bootstrap, ranks):
    """A chunk goes layer by layer, one layer a group: the first groups land, the next group's
    write fails in NIXL's post (as a UCX error surfaces there). The request fails on both sides,
    naming the write; the groups sent after that post nothing; decode's rows of every layer from
    the failed group on keep what they held; the pages go back. Part of a request whose post
    failed may be in flight, so the peer is lost, as for a write failing after its post: the
    decode rank is connected anew, and the rank serves on."""
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    decode = ranks(decode_spec(bootstrap))
    layers = len(RankLayout.from_msgpack(prefill.layout).layer_ids)
    assert layers >= 2, layers
    landed = layers // 2  # groups of the first chunk that land; the next one's write fails
    sends = 2 * layers  # two chunks of one group per layer, one write each (MHA, one decode rank)
    free = decode.call(Stats())["free_pages"]
    decode.call(Receive("broken", 40))
    positions = tuple(range(layers))
    before = decode.call(Rows("broken", positions))  # what decode's pages held before any write
    # the sends after the failing one are held: sent once the request failed
    prefill.call(Prefill("broken", 40, (16, 24), layer_groups=layers, fail_write=landed + 1,
                         hold_last=sends - landed - 1))
    state, reason = prefill.call(Wait("broken", timeout_s=20))
    assert state == "Failed" and reason.startswith("write to decode rank ('decode-a', 0) failed: "), reason
    assert "NIXL reported ERR (nixlBackendError: NIXL_ERR_BACKEND) when posting" in reason, reason
    state, told = decode.call(Wait("broken", timeout_s=20))
    assert state == "Failed" and f"prefill rank 0: {reason}" in told, told
    assert prefill.call(Stats())["writes"] == landed + 1  # the groups that landed and the failed one
    prefill.call(SendLast("broken"))  # the rest of the first chunk and all of the second: posted nowhere
    assert prefill.call(Wait("broken")) == ("Failed", reason)
    assert prefill.call(Stats())["writes"] == landed + 1
    wait_released(decode, "broken")  # prefill said nothing of it is in flight
    after = decode.call(Rows("broken", positions))
    source = prefill.call(Rows("broken", positions))  # the KV the prefill rank computed
    for p in positions:
        if p < landed:  # the first chunk's tokens of this layer landed, and changed the pages
            assert np.array_equal(after[p][:16], source[p][:16]), p
            assert not np.array_equal(after[p][:16], before[p][:16]), p
        else:  # the failed group and those after it: nothing written
            assert np.array_equal(after[p][:16], before[p][:16]), p
        assert np.array_equal(after[p][16:], before[p][16:]), p  # the second chunk: nothing written
    decode.call(Released("broken"))
    assert decode.call(Stats())["free_pages"] == free
    wait_forgotten(prefill)
    wait_forgotten(decode)
    wait_connects(prefill, 2)  # dropped, said hello again, connected anew
    wait_ready(decode, [0])
    decode.call(Receive("after", 40))
    prefill.call(Prefill("after", 40, (16, 24), layer_groups=layers))
    assert decode.call(Wait("after")) == ("Success", None)
    assert prefill.call(Wait("after")) == ("Success", None)
    assert decode.call(Verify("after"))[0] == 0
    assert prefill.call(Stats())["writes"] == landed + 1 + sends
    assert prefill.call(Stats())["connects"] == 2  # the failed post lost the peer: connected once more
    wait_forgotten(prefill)


def wait_connects(prefill, connects, timeout_s=20.0):
    """Poll until the prefill rank's NIXL transport has connected ``connects`` times, or fail."""
    deadline = time.monotonic() + timeout_s
    while (got := prefill.call(Stats())["connects"]) != connects:
        assert got < connects and time.monotonic() < deadline, \
            f"{prefill.name}: {got} connects, not {connects}, after {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.parametrize("stall_s", [0.0, 1.0])
def test_a_write_that_fails_after_its_post_loses_the_peer_and_the_decode_rank_is_connected_anew(bootstrap, ranks,
                                                                                                  stall_s):
    """A write is posted, then NIXL's state check of it fails (as when the connection to the
    decode rank broke): the transport counts that peer lost and refuses every later write to it
    until a new connect. The request fails on both sides, naming the write; the prefill rank
    drops the decode rank, whose next heartbeat is answered NotConnected, so it says hello again
    and the prefill rank connects anew -- once NIXL no longer runs the failed write (with
    ``stall_s``, it still does for that long after it failed: the hello waits for its answer
    meanwhile). The next request to that decode rank lands byte for byte."""
    prefill = ranks(prefill_spec(bootstrap, 0, 1))
    decode = ranks(decode_spec(bootstrap))
    assert prefill.call(Stats())["connects"] == 1
    decode.call(Receive("lost", 40))
    prefill.call(Prefill("lost", 40, (16, 24), lose_write=1, stall_s=stall_s))
    state, reason = prefill.call(Wait("lost", timeout_s=20))
    assert state == "Failed" and reason.startswith("write to decode rank ('decode-a', 0) failed: "), reason
    assert "nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT" in reason, reason
    state, told = decode.call(Wait("lost", timeout_s=20))
    assert state == "Failed" and f"prefill rank 0: {reason}" in told, told
    wait_connects(prefill, 2)  # dropped, said hello again, connected anew
    wait_ready(decode, [0])
    assert prefill.call(Stats())["decode_peers"] == [("decode-a", 0)]
    decode.call(Released("lost"))
    wait_forgotten(decode)
    assert_lands(prefill, decode, "after")
    assert prefill.call(Stats())["connects"] == 2
