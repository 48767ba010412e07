"""The nvlink mailbox's landed word: notifications sent while their copies run, handed out by
the receiver only once the writer's shared counter says their bytes are in place
(:mod:`transport.nvlink.mailbox`, :mod:`transport.nvlink.landed`). No GPU: the copies are the
test's stand-in events; the mailbox, the shared memory and the processes are real."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import select
import signal
import socket
import struct
import threading
import time

import pytest

from tests.transport.nvlink._nvlink_cpu import StandInLander, wait_until
from transport.base import Notification
from transport.nvlink.mailbox import Inbox, MailboxUnreachable, Outbox
from transport.nvlink.landed import SharedWord, WordView
from transport.revocation import wire


@pytest.fixture
def pair():
    inbox = Inbox()
    out = Outbox(inbox.name, 5.0, sender="writer")
    yield inbox, out
    out.close()
    inbox.close()


def _drain(inbox, want: int, timeout: float = 30.0) -> list[Notification]:
    """What ``inbox`` got until ``want`` notifications came or ``timeout`` passed (a backstop;
    a short one looks for notifications that must not come)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += inbox.poll()
    return got


def _notes(*payloads) -> list[Notification]:
    return [Notification("writer", p) for p in payloads]


def test_the_shared_word_is_seen_by_a_second_mapping_and_only_goes_up():
    word = SharedWord()
    view = WordView(word.fd)
    assert view.read() == 0
    word.store(7)
    assert view.read() == 7
    with pytest.raises(ValueError, match="only goes up"):
        word.store(6)
    word.close()
    word.store(9)  # after close: nothing (a store racing with the close is harmless)
    assert view.read() == 7
    view.close()
    word.close()  # idempotent


def test_an_announced_notification_is_held_until_its_copy_landed(pair):
    inbox, out = pair
    assert (out.announce(b"a"), out.announce(b"b")) == (1, 2)
    assert _drain(inbox, 1, timeout=0.2) == []  # read, held
    assert [n for n, _ in inbox._conns[0].held] == [1, 2]
    out.settle(1)
    assert _drain(inbox, 1) == _notes(b"a")
    assert _drain(inbox, 1, timeout=0.1) == []
    out.settle(2)
    assert _drain(inbox, 1) == _notes(b"b")


def test_settling_the_last_releases_every_one_before_it(pair):
    inbox, out = pair
    for p in (b"a", b"b", b"c"):
        out.announce(p)
    out.settle(3)
    assert _drain(inbox, 3) == _notes(b"a", b"b", b"c")


def test_a_withdrawn_notification_is_never_handed_out_and_the_next_one_is(pair):
    inbox, out = pair
    out.announce(b"failed")
    out.announce(b"landed")
    out.settle(1, landed=False)
    out.settle(2)
    assert _drain(inbox, 2, timeout=0.5) == _notes(b"landed")
    assert inbox._conns[0].dropped == set() and not inbox._conns[0].held


def test_settling_out_of_order_twice_or_unannounced_is_refused_and_send_needs_all_settled(pair):
    inbox, out = pair
    out.announce(b"a")
    out.announce(b"b")
    out.settle(2)
    for bad in (1, 2, 3, 0):
        with pytest.raises(ValueError, match=f"notification {bad} cannot be settled"):
            out.settle(bad)
    out.announce(b"c")
    with pytest.raises(RuntimeError, match="1 notification\\(s\\) announced and not settled"):
        out.send(b"d")
    out.settle(3)
    out.send(b"d")
    assert _drain(inbox, 4) == _notes(b"a", b"b", b"c", b"d")


def test_notifications_and_control_messages_cannot_pass_for_each_other(pair):
    """The receiver counts notifications, not control frames: a control-looking notification
    would shift every later number onto the next notification (released before its bytes
    landed), a notification sent as control the other way (the last never released)."""
    inbox, out = pair
    with pytest.raises(ValueError, match="magic bytes"):
        out.announce(wire.MAGIC + b"payload")
    with pytest.raises(ValueError, match="magic bytes"):  # and the other way round
        out.send_control(b"no magic")
    assert out.announce(b"a") == 1
    out.settle(1)
    assert _drain(inbox, 1) == _notes(b"a")


def test_a_writer_that_ends_drops_what_had_not_landed(pair):
    inbox, out = pair
    out.announce(b"landed")
    out.announce(b"in flight")
    out.settle(1)
    out.close()
    assert _drain(inbox, 2, timeout=0.5) == _notes(b"landed")
    assert inbox._conns == []


def test_dropped_messages_for_numbers_not_held_and_malformed_ones_change_nothing(pair):
    inbox, out = pair
    out.announce(b"a")
    for number in (0, 2, 99):
        out.send_control(wire.encode(wire.Dropped(number)))
    out.send_control(wire.MAGIC + b"\xc1 not msgpack")
    _drain(inbox, 1, timeout=0.2)
    assert inbox._conns[0].dropped == set()
    out.settle(1)
    assert _drain(inbox, 1) == _notes(b"a")


def _raw_hello(name: str, fds=()) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    hello = wire.encode(wire.Hello("raw", []))
    socket.send_fds(sock, [struct.pack(">I", len(hello)) + hello], list(fds))
    return sock


def test_a_writer_without_a_word_has_its_notifications_handed_out_at_once():
    """A Hello without a word (a writer that lands every copy before it sends): each
    notification goes out as it is read."""
    inbox = Inbox()
    sock = _raw_hello(inbox.name)
    try:
        sock.sendall(struct.pack(">I", 3) + b"now")
        assert _drain(inbox, 1) == [Notification("raw", b"now")]
    finally:
        sock.close()
        inbox.close()


@pytest.mark.parametrize("kind", ["pipe", "unsealed memfd", "sealed but empty memfd"])
def test_a_hello_whose_fd_is_no_sealed_word_is_refused(kind):
    """The fd that comes with a Hello must be a memfd of 8 bytes or more, sealed against
    shrinking (an unsealed one could be truncated under the receiver's map: SIGBUS at its next
    read). Anything else closes the connection (the writer sees its end), the others go on."""
    inbox = Inbox()
    good = Outbox(inbox.name, 5.0, sender="writer")
    if kind == "pipe":
        fd, other = os.pipe()
    else:
        fd, other = os.memfd_create("test", os.MFD_ALLOW_SEALING), None
        if kind == "unsealed memfd":
            os.ftruncate(fd, 8)
        else:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    sock = _raw_hello(inbox.name, fds=[fd])
    try:
        good.send(b"fine")
        assert _drain(inbox, 1) == _notes(b"fine")
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed by the inbox
        assert [c.name for c in inbox._conns] == ["writer"]
    finally:
        for f in (fd, other):
            if f is not None:
                os.close(f)
        sock.close()
        good.close()
        inbox.close()


def test_the_writers_word_is_sealed_against_shrinking():
    word = SharedWord()
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(word.fd, 0)
        with pytest.raises(PermissionError):  # and the seals themselves are sealed
            fcntl.fcntl(word.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    finally:
        word.close()


def test_the_word_and_the_socket_race_without_a_withdrawn_notification_escaping():
    """A writer thread announces and settles 3,000 notifications, withdrawing a random third,
    while the receiver polls as fast as it can: exactly the landed ones come out, in order."""
    inbox = Inbox()
    out = Outbox(inbox.name, 5.0, sender="writer")
    rng = random.Random(5)
    plan = [rng.random() >= 1 / 3 for _ in range(3000)]
    landed = [b"%d" % i for i, ok in enumerate(plan) if ok]

    def write():
        number = 0
        for i, ok in enumerate(plan):
            number = out.announce(b"%d" % i)
            if rng.random() < 0.5 or i == len(plan) - 1 or not ok:  # settle in runs, withdrawals at once
                for n in range(out._word.value + 1, number + 1):
                    out.settle(n, landed=plan[n - 1])

    writer = threading.Thread(target=write)
    writer.start()
    got, deadline = [], time.monotonic() + 30
    while len(got) < len(landed) and time.monotonic() < deadline:
        got += [n.payload for n in inbox.poll()]
    writer.join()
    got += [n.payload for n in _drain(inbox, 1, timeout=0.2)]
    out.close()
    inbox.close()
    assert got == landed


def test_no_shared_memory_for_the_word_makes_the_mailbox_unreachable(monkeypatch):
    """Where memfd_create is refused (an old kernel, a sandbox), connecting fails as for a
    mailbox on another host: NvlinkPeer turns it into NvlinkUnsupported (NIXL is used)."""
    def refused(*a):
        raise PermissionError(1, "Operation not permitted")

    inbox = Inbox()
    monkeypatch.setattr(os, "memfd_create", refused)
    try:
        with pytest.raises(MailboxUnreachable, match="landed word: .*Operation not permitted"):
            Outbox(inbox.name, 5.0, sender="writer")
    finally:
        inbox.close()


def test_without_a_landed_word_a_notification_goes_out_once_its_bytes_are_in_place():
    """Where the CPU does not order memory as the word needs (``word.ORDERED`` False: arm64),
    the outbox makes no word: its Hello carries no fd, the receiver hands notifications out
    as they arrive, and the queue sends each one only once its copy completed."""
    from tests.transport.nvlink._nvlink_cpu import StandInEvent
    from transport.base import TransferStatus
    from transport.nvlink.completion import PendingQueue
    from transport.nvlink.completion import NvlinkTransfer

    inbox = Inbox()
    out = Outbox(inbox.name, 5.0, sender="writer", landed_word=False)
    queue = PendingQueue("peer", out, transfer_timeout_s=30)
    try:
        assert not out.early
        aborted = queue.track(NvlinkTransfer(queue, StandInEvent(), b"aborted"))
        t = queue.track(NvlinkTransfer(queue, StandInEvent(), b"kv"))
        assert queue.advance() and t._number is None  # nothing sent while the copy runs
        inbox.read()
        assert inbox._conns[0].word is None and not inbox._conns[0].held and _drain(inbox, 1, 0.2) == []
        aborted.abort()
        t._event.fired = True
        assert t.status() is TransferStatus.DONE
        assert _drain(inbox, 1) == _notes(b"kv") and _drain(inbox, 1, 0.2) == []
    finally:
        out.close()
        inbox.close()


@pytest.mark.parametrize("answered", [False, True], ids=["no answer", "answered: a bell"])
def test_connections_leave_no_file_descriptor_or_map_behind(answered):
    def fds():
        return len(os.listdir("/proc/self/fd"))

    inbox = Inbox(listener=_Answering() if answered else None)
    inbox.poll()
    before = fds()
    for _ in range(20):
        out = Outbox(inbox.name, 5.0, sender="writer")
        if answered:
            _answered(out, inbox)
            assert out.rings
        out.send(b"x")
        assert _drain(inbox, 1) == _notes(b"x")
        out.close()
        wait_until("the inbox reading the end", lambda: (inbox.poll(), inbox._conns)[1] == [])
    assert fds() == before
    inbox.close()


# -- across processes -----------------------------------------------------------------------------


def _dying_writer(mailbox: str, conn) -> None:
    out = Outbox(mailbox, 5.0, sender="dies")
    out.announce(b"landed")
    out.announce(b"never landed")
    out.settle(1)
    conn.send("ready")
    time.sleep(60)  # killed


def test_across_processes_a_notification_waits_for_its_landing_and_dies_with_its_writer():
    """A receiver process (``RemoteBuffers``, a real nvlink transport): a notification announced
    by this process comes out only after its settle; a writer process killed between the
    announcement and the settle of its second notification: its first comes out, its second
    never."""
    from transport.nvlink import parse_descriptor
    from kvtransfer.benchmarks._remote import RemoteBuffers

    remote = RemoteBuffers(None, ("nvlink",))
    child = None
    try:
        body, _, _ = parse_descriptor(remote.export()["nvlink"])
        out = Outbox(body["mailbox"], 5.0, sender="writer")
        try:
            number = out.announce(b"held")
            assert remote.wait_notify(b"held", 0.3) is None
            out.settle(number)
            assert remote.wait_notify(b"held", 5.0) == "writer"
        finally:
            out.close()
        ctx = multiprocessing.get_context("fork")
        parent, there = ctx.Pipe()
        child = ctx.Process(target=_dying_writer, args=(body["mailbox"], there), daemon=True)
        child.start()
        assert parent.poll(10) and parent.recv() == "ready"
        os.kill(child.pid, signal.SIGKILL)
        child.join(5)
        assert remote.wait_notify(b"landed", 5.0) == "dies"
        assert remote.wait_notify(b"never landed", 0.5) is None
    finally:
        if child is not None and child.is_alive():
            child.kill()
        remote.close()


@pytest.fixture
def landed_pair(pair):
    inbox, out = pair
    landers = []
    out.land_with(lambda word: landers.append(StandInLander(word)) or landers[0])
    return inbox, out, landers[0]


def test_with_a_lander_a_withdrawn_notification_is_dropped_out_of_order_and_the_others_come(landed_pair):
    """Three announced; the second fails while the first still runs: its Dropped goes out at
    once and the lander does not pass it before; the first and third land and come out, the
    second never. A notification the lander released already cannot be withdrawn."""
    inbox, out, lander = landed_pair
    assert out.watching
    assert [out.announce(p, event=object()) for p in (b"a", b"b", b"c")] == [1, 2, 3]
    assert out.withdraw(2) is True
    lander.complete(3)
    assert _drain(inbox, 1, timeout=0.2) == []  # 1 still runs: nothing passes it
    lander.complete(1)
    assert _drain(inbox, 2) == _notes(b"a", b"c")
    assert out.landed(3) and out.withdraw(3) is False  # released: too late
    with pytest.raises(RuntimeError, match="a lander stores this outbox's word"):
        out.settle(1)


def test_with_a_lander_an_announcement_needs_its_event_and_one_it_refuses_ends_the_connection(landed_pair):
    inbox, out, lander = landed_pair
    with pytest.raises(ValueError, match="the event is needed"):
        out.announce(b"x")
    out.announce(b"a", event=object())
    lander.refuse = True
    with pytest.raises(OSError, match="the lander refused notification 2"):
        out.announce(b"b", event=object())
    assert not out.alive()  # the connection ended: no later number can release "b"
    with pytest.raises(OSError):
        out.announce(b"c", event=object())
    lander.complete(1)  # "a" did land: handed out or dropped with the connection, "b" never
    got = []
    wait_until("the receiver's end of the connection", lambda: got.extend(inbox.poll()) or not inbox._conns, 2.0)
    assert got in ([], _notes(b"a"))


def test_a_lander_comes_only_before_the_first_announcement_and_only_with_a_word(pair):
    inbox, out = pair
    out.announce(b"a")
    out.land_with(lambda word: pytest.fail("a lander after an announcement"))
    assert not out.watching
    with pytest.raises(RuntimeError, match="withdraw\\(\\) is the lander's"):
        out.withdraw(1)
    wordless = Outbox(inbox.name, 5.0, sender="no-word", landed_word=False)
    try:
        wordless.land_with(lambda word: pytest.fail("a lander without a word"))
        assert not wordless.watching
    finally:
        wordless.close()


# -- the doorbell ---------------------------------------------------------------------------------


class _Answering:
    """An inbox's listener that answers each Hello, as the transport's holders do (the bell
    goes with the first frame back)."""

    def hello(self, conn, msg) -> None:
        conn.send(wire.encode(wire.HoldAck(0, [])))

    def message(self, conn, msg) -> None:
        pass

    def closed(self, conn) -> None:
        pass


def _answered(out: Outbox, inbox: Inbox) -> None:
    """Read the inbox (which answers the Hello) and, as the writer's mailbox thread does once
    its socket is readable, the answer."""
    def read() -> bool:
        inbox.read()
        if select.select([out.fileno()], [], [], 0)[0]:
            out.receive()
            return True
        return False

    wait_until("the Hello's answer", read)


def _rang(bell: int) -> bool:
    return bool(select.select([bell], [], [], 0)[0])


@pytest.fixture
def belled():
    inbox = Inbox(listener=_Answering())
    out = Outbox(inbox.name, 5.0, sender="writer")
    _answered(out, inbox)
    yield inbox, out
    out.close()
    inbox.close()


def test_a_settle_rings_the_receivers_bell_after_the_store_and_poll_clears_it(belled):
    """The bell comes with the Hello's answer; an announcement rings nothing, its settle rings
    once the word moved (a receiver woken by it finds the notification), and ``poll`` clears
    it: a receiver that waits on the bell sleeps until the next settle."""
    inbox, out = belled
    assert out.rings and inbox.bell is not None
    inbox.poll()
    assert not _rang(inbox.bell)
    number = out.announce(b"a")
    assert not _rang(inbox.bell)
    assert _drain(inbox, 1, timeout=0.1) == []
    out.settle(number)
    assert select.select([inbox.bell], [], [], 30)[0]
    assert inbox.poll() == _notes(b"a")
    assert not _rang(inbox.bell)
    out.send(b"b")
    assert _rang(inbox.bell) and inbox.poll() == _notes(b"b") and not _rang(inbox.bell)


def test_a_lander_rings_the_bell_whether_it_came_before_or_after_the_lander(belled):
    inbox, out = belled
    landers = []
    out.land_with(lambda word: landers.append(StandInLander(word)) or landers[0])
    lander = landers[0]
    out.announce(b"a", event=object())
    assert not _rang(inbox.bell)
    lander.complete(1)
    assert _rang(inbox.bell) and inbox.poll() == _notes(b"a")
    # a lander made before the answer came: the bell is handed to it then
    late_inbox = Inbox(listener=_Answering())
    late = Outbox(late_inbox.name, 5.0, sender="writer")
    try:
        late.land_with(lambda word: landers.append(StandInLander(word)) or landers[1])
        _answered(late, late_inbox)
        late.announce(b"b", event=object())
        landers[1].complete(1)
        assert _rang(late_inbox.bell) and late_inbox.poll() == _notes(b"b")
    finally:
        late.close()
        late_inbox.close()


@pytest.mark.parametrize("kind", ["pipe", "blocking eventfd"])
def test_a_bell_that_is_no_non_blocking_eventfd_is_refused_and_the_writer_goes_on(kind):
    """A receiver that sends a pipe (a write into a full one would block the writer) or a
    blocking eventfd: the writer closes it, rings nothing, and its notifications still go."""
    inbox = Inbox()
    out = Outbox(inbox.name, 5.0, sender="writer")
    r, w = os.pipe()
    given = w if kind == "pipe" else os.eventfd(0)
    try:
        wait_until("the Hello read", lambda: (inbox.read(), inbox._conns and inbox._conns[0].name)[1])
        fds_before = len(os.listdir("/proc/self/fd"))
        conn = inbox._conns[0]
        conn.fds = [given]
        conn.send(wire.encode(wire.HoldAck(0, [])))
        wait_until("the answer read", lambda: bool(select.select([out.fileno()], [], [], 0)[0]))
        out.receive()
        assert not out.rings
        assert len(os.listdir("/proc/self/fd")) == fds_before  # the writer's copy closed
        out.send(b"x")
        assert _drain(inbox, 1) == _notes(b"x")
    finally:
        out.close()
        inbox.close()
        for fd in {r, w, given}:
            os.close(fd)

