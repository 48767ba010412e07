"""Notification: the mailbox, one Unix socket per transport.

Each transport listens on a Unix stream socket in Linux's abstract namespace (nothing on
disk); each peer (each ``connect``) keeps one connected socket to it. A frame is a 4-byte
big-endian length, then that many bytes. The first frame on a connection is the writer's
:class:`~transport.revocation.wire.Hello` (its name, the ``name`` of its export, and the
region ids of the export it holds; the fd of its landed word comes with it, below); every
later frame from the writer is one notification payload, which the receiver returns as a
:class:`~transport.base.Notification` from that writer, or a control message
(:data:`~transport.revocation.wire.MAGIC` first: notifications may not start with it).

Notifications sent before their bytes land
------------------------------------------
Seeing the copy's end and then sending the notification would put the socket's send and read
after the copy. So a write's notification goes out while its copy runs
(:meth:`Outbox.announce`: the k-th of the connection is number k), and the receiver holds it
until the *landed word* says its bytes are in place: a 64-bit counter in memory both processes
map (:mod:`transport.nvlink.landed`; its fd rides with the Hello), which the writer sets to k once copy k
has completed (:meth:`Outbox.settle`), with one store. The receiver hands out, per connection
and in order, the notifications numbered up to the counter as it read it *before* reading the
socket. A write that fails after its announcement is withdrawn: the writer sends
:class:`~transport.revocation.wire.Dropped` naming it before it raises the counter past it, so
a receiver that sees the counter past k has read the Dropped too, and never hands k out. A
connection that ends drops what it still holds (those bytes were never said to be in place).
Where the C steps load, the word is stored by a thread of C that waits on each notification's
copy event, without the GIL (:meth:`Outbox.land_with`, :class:`~transport.nvlink.landed.Lander`);
a failed write's notification is then withdrawn at once (:meth:`Outbox.withdraw`), the thread
held at it until the Dropped is sent.

The doorbell
------------
A receiver that sleeps between looks (a KV manager's loop waits up to 0.2 ms in ``select``
while transfers are in flight) would see a landed word only at its next look. So the inbox
makes one *bell*, an eventfd (:attr:`Inbox.bell`), and sends it to each writer with its first
frame back (the Hello's answer, ``SCM_RIGHTS``); the writer rings it (adds 1) after each store
of its word, or after each notification it sends whole (:meth:`Outbox.settle`; the C lander
after its own stores, :meth:`~transport.nvlink.landed.Lander.ring`). The receiver waits on the
bell with its other descriptors; :meth:`Inbox.poll` clears it before it reads the words, so a
store after that read rings again. A writer takes the fd only if it is an eventfd in
non-blocking mode (a ring never blocks it); a receiver without one (no eventfd on this system)
sends none, and its writers ring nothing.

The receiver writes revocation messages back on the same connection
(:class:`~transport.revocation.wire.HoldAck`, :class:`~transport.revocation.wire.Revoke`);
the writing transport's mailbox thread reads them (:mod:`transport.nvlink.revoke`) and notes
the connection's end: the receiver's process is gone or its transport closed.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import uuid
from collections import deque
from typing import Callable, Iterable, Optional

from transport.base import Notification, TransportError
from transport.nvlink.landed import ORDERED, Lander, SharedWord, WordView
from transport.revocation import wire

__all__ = ["Inbox", "MailboxUnreachable", "Outbox", "host_id"]


_FRAME = struct.Struct(">I")


class MailboxUnreachable(TransportError):
    """The peer's mailbox socket cannot be reached (another host or network namespace)."""


def host_id() -> str:
    """Identifies this host (boot id + hostname): peers with another id are on another host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}@{socket.gethostname()}"


def _receive(fd: int, buf: bytearray) -> bool:
    """Append what the non-blocking socket ``fd`` holds to ``buf``; False once its other end
    closed. (``os.read``: a socket with a timeout would wait in ``recv``.)"""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        except OSError:  # reset by the peer
            return False
        if not chunk:
            return False
        buf += chunk


def _new_bell() -> Optional[int]:
    """An inbox's doorbell: a non-blocking eventfd, or None where the system has none."""
    try:
        return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    except (AttributeError, OSError):
        return None


def _is_bell(fd: int) -> bool:
    """``fd`` is an eventfd in non-blocking mode (what a receiver's bell must be: ringing it
    never blocks the writer)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]" and not os.get_blocking(fd)
    except OSError:
        return False


def _framed(payload: bytes) -> bytes:
    """One frame: the 4-byte length, then ``payload``."""
    return _FRAME.pack(len(payload)) + payload


def _frames(buf: bytearray) -> list[bytes]:
    """The whole frames at the start of ``buf``, taken out of it."""
    out = []
    while len(buf) >= _FRAME.size:
        (n,) = _FRAME.unpack_from(buf)
        if len(buf) < _FRAME.size + n:
            break
        out.append(bytes(buf[_FRAME.size:_FRAME.size + n]))
        del buf[:_FRAME.size + n]
    return out


def _read_with_fds(sock: socket.socket, max_fds: int) -> Optional[tuple[bytes, list[int]]]:
    """One ``recvmsg`` of the non-blocking ``sock``: the bytes and the file descriptors that
    came with them (at most ``max_fds``; the caller owns them), ``b""`` at the connection's end
    or when it was reset, None when nothing waits."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    except BlockingIOError:
        return None
    except OSError:  # reset by the peer
        return b"", []
    return data, fds


def _receive_with_fds(conn: "_Connection") -> bool:
    """As :func:`_receive`, keeping the first file descriptor that comes with the bytes (the
    landed word's, sent with the Hello) in ``conn.word``; any other is closed."""
    while True:
        got = _read_with_fds(conn.sock, 2)
        if got is None:
            return True
        data, fds = got
        for fd in fds:
            try:
                if conn.word is None and conn.name is None:
                    conn.word = WordView(fd)
            except (OSError, ValueError):  # not a map we can read: the Hello check closes it
                conn.word_error = True
            finally:
                os.close(fd)
        if not data:
            return False
        conn.buf += data


class _Connection:
    """One writer's connection to an :class:`Inbox`: its socket, its name once its Hello came,
    bytes received and not parsed, frames to send that the socket did not take yet, and its
    landed word with the notifications it holds (module doc)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.name: Optional[str] = None
        self.buf = bytearray()
        self.out = bytearray()
        self.word: Optional[WordView] = None  # None: a writer without one (its notifications go out at once)
        self.word_error = False
        self.mark = 0  # the word as read before the socket, in this poll
        self.received = 0  # notifications read (number k is the k-th)
        self.held: deque[tuple[int, bytes]] = deque()  # [(number, payload)] read, not yet landed
        self.dropped: set[int] = set()  # held numbers withdrawn by the writer
        self.fds: list[int] = []  # to go with the next bytes sent (the inbox's bell, with the first)

    def send(self, payload: bytes) -> None:
        """Queue one frame to the writer and send what the socket takes now (the rest at the
        inbox's next read); a writer that is gone is noticed when its end of file is read."""
        self.out += _framed(payload)
        self.flush()

    def flush(self) -> None:
        while self.out:
            try:
                if self.fds:
                    n = socket.send_fds(self.sock, [bytes(self.out)], self.fds)
                    self.fds = []
                else:
                    n = self.sock.send(self.out)
            except BlockingIOError:
                return
            except OSError:
                self.out.clear()
                return
            del self.out[:n]


class Inbox:
    """The receiving end: a listening abstract Unix socket and the writers connected to it.

    ``listener`` (the transport's :class:`~transport.nvlink.revoke.MailboxHolders`) gets each
    connection's Hello (``hello(conn, msg)``), its revocation messages (``message(conn, msg)``)
    and its end (``closed(conn)``); a connection whose first frame is no Hello is closed (its
    writer never gets the answer its first write waits for, and sees the end)."""

    def __init__(self, listener=None):
        self.name = f"kvtransfer-nvlink-{os.getpid()}-{uuid.uuid4().hex}"
        self.listener = listener
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._conns: list[_Connection] = []
        self._notes: list[Notification] = []  # read, not yet polled
        # one poll(2) call says which sockets have something: a look at idle ones costs no
        # read that fails (an exception each in Python)
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN)
        self.bell: Optional[int] = _new_bell()  # readable once a writer stored its word (module doc)

    def poll(self) -> list[Notification]:
        """The notifications whose bytes are in place, received since the last call, per
        connection in sending order; clears :attr:`bell` first."""
        if self.bell is not None:
            try:
                os.eventfd_read(self.bell)
            except BlockingIOError:  # nobody rang
                pass
        for conn in self._conns:  # the words first, then the socket (module doc)
            if conn.word is not None:
                conn.mark = conn.word.read()
        self.read()
        for conn in self._conns:
            if conn.held:
                self._release(conn, conn.mark)
        out, self._notes = self._notes, []
        return out

    def _release(self, conn: _Connection, mark: int) -> None:
        """Hand out ``conn``'s held notifications numbered up to ``mark``, but the dropped."""
        held, dropped = conn.held, conn.dropped
        while held and held[0][0] <= mark:
            number, payload = held.popleft()
            if dropped and number in dropped:
                dropped.discard(number)
                continue
            self._notes.append(Notification(conn.name, payload))

    def read(self) -> None:
        """Accept and read every connection: notifications are kept for :meth:`poll`, the rest
        goes to the listener (what ``deregister`` calls while it waits for acknowledgements)."""
        ready = {fd for fd, _ in self._poller.poll(0)}  # readable, hung up or in error
        if self._sock.fileno() in ready:
            while True:
                try:
                    sock, _ = self._sock.accept()
                except BlockingIOError:
                    break
                sock.setblocking(False)
                self._conns.append(_Connection(sock))
                self._poller.register(sock.fileno(), select.POLLIN)
                ready.add(sock.fileno())  # its first frames may be there already
        for conn in list(self._conns):
            if conn.out:
                conn.flush()
            if conn.sock.fileno() not in ready:
                continue
            if conn.name is None:
                open_ = _receive_with_fds(conn)
            else:
                open_ = _receive(conn.sock.fileno(), conn.buf)
            for frame in _frames(conn.buf):
                if not self._take(conn, frame):
                    open_ = False
                    break
            if not open_:
                self._end(conn)

    def _end(self, conn: _Connection) -> None:
        """Close ``conn``: what its word says landed goes out, the rest it holds is dropped."""
        self._conns.remove(conn)
        self._poller.unregister(conn.sock.fileno())
        conn.sock.close()
        if conn.word is not None:
            self._release(conn, conn.word.read())  # every frame sent before the last store is read
            conn.held.clear()
            conn.word.close()
        if conn.name is not None and self.listener is not None:
            self.listener.closed(conn)

    def _take(self, conn: _Connection, frame: bytes) -> bool:
        """One frame of ``conn``; False when the connection must close (no Hello first)."""
        if conn.name is None:
            try:
                msg = wire.decode(frame)
            except wire.ProtocolError:
                msg = None
            if not isinstance(msg, wire.Hello) or conn.word_error:
                return False
            conn.name = msg.name
            if self.bell is not None:
                conn.fds = [self.bell]  # with the Hello's answer
            if self.listener is not None:
                self.listener.hello(conn, msg)
        elif frame.startswith(wire.MAGIC):
            try:
                msg = wire.decode(frame)
            except wire.ProtocolError:
                return True  # a control message that does not decode carries nothing to act on
            if isinstance(msg, wire.Dropped):
                if conn.held and conn.held[0][0] <= msg.note <= conn.received:  # one it holds
                    conn.dropped.add(msg.note)
            elif self.listener is not None:
                self.listener.message(conn, msg)
        elif conn.word is not None:
            conn.received += 1
            conn.held.append((conn.received, frame))
        else:
            self._notes.append(Notification(conn.name, frame))
        return True

    def close(self) -> None:
        for conn in self._conns:
            conn.sock.close()
            if conn.word is not None:
                conn.word.close()
        self._conns.clear()
        self._sock.close()
        self._poller = select.poll()  # watches nothing (the closed sockets' numbers may be reused)
        if self.bell is not None:
            os.close(self.bell)
            self.bell = None


class Outbox:
    """The writing end: one connected socket to a peer's inbox, opened with a Hello naming
    ``sender`` and the peer's ``regions`` this side holds (the ids of the export it connected
    to), the landed word's fd with it. Notifications go out with :meth:`announce` and are
    released by :meth:`settle` (or both at once, :meth:`send`), from any thread; what the peer
    sends back is read by :meth:`receive`, on the transport's mailbox thread alone.

    ``landed_word`` False (default: where the CPU orders memory as the word needs,
    :data:`ORDERED`): no word, the Hello carries no fd and the receiver
    hands each notification out as it arrives; only :meth:`send` then fits, once the bytes are
    in place (:attr:`early` is False)."""

    def __init__(self, name: str, timeout_s: float, sender: str, regions: Iterable[int] = (),
                 landed_word: Optional[bool] = None):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)  # sends wait at most this long (the fd itself is non-blocking)
        self._send_lock = threading.Lock()  # notifications (progress thread) and acks (mailbox thread)
        self._buf = bytearray()
        self.lost = False  # receive() saw the peer close its end
        self._announced = 0  # notifications sent, numbered from 1
        self._settled = 0  # the highest number settled (what the word says)
        self._word: Optional[SharedWord] = None
        self._lander = None  # the thread that stores the word instead of settle() (land_with)
        self._bell: Optional[int] = None  # the receiver's doorbell, rung after each settle (module doc)
        self._first = True  # nothing read from the receiver yet: its bell may come with it
        try:
            if ORDERED if landed_word is None else landed_word:
                self._word = SharedWord()  # how many notifications landed (module doc)
        except OSError as exc:  # no memfd here (an old kernel, a sandbox that forbids it)
            self._sock.close()
            raise MailboxUnreachable(
                f"cannot make the shared memory of the notifications' landed word: {exc}") from None
        try:
            self._sock.connect("\0" + name)
        except OSError as exc:
            self.close()
            raise MailboxUnreachable(
                f"cannot reach the peer's notification socket {name!r} ({exc}); "
                "is it on this host and in this network namespace?"
            ) from None
        try:
            hello = wire.encode(wire.Hello(sender, sorted(int(r) for r in regions)))
            frame = _framed(hello)
            sent = socket.send_fds(self._sock, [frame], [self._word.fd]) if self._word is not None else 0
            self._sock.sendall(frame[sent:])
        except OSError as exc:
            self.close()
            raise MailboxUnreachable(f"the peer's notification socket {name!r} refused our hello: {exc}") from None

    def land_with(self, make: Callable[[SharedWord], Lander]) -> None:
        """From now on the word is stored by ``make(word)``, a
        :class:`Lander` (its thread stores each number once the event
        given to :meth:`announce` completed; :meth:`settle` is then refused and :meth:`withdraw`
        takes its place). Nothing without a word. Called before the first announcement."""
        if self._word is not None and self._announced == 0:
            self._lander = make(self._word)
            if self._bell is not None:
                self._lander.ring(self._bell)

    @property
    def watching(self) -> bool:
        """A lander stores the word (:meth:`land_with`)."""
        return self._lander is not None

    @property
    def early(self) -> bool:
        """Notifications may go out before their bytes land (the peer holds them until the
        landed word passes them)."""
        return self._word is not None

    def alive(self) -> bool:
        """False once the peer closed its end, as :meth:`receive` (the mailbox thread) saw, or
        a send failed (:meth:`_sendall`): a flag, no system call."""
        return not self.lost

    def _sendall(self, payload: bytes) -> None:
        """Send ``payload`` as one whole frame (under the send lock). A send that fails or times out may have
        sent part of it, after which no frame can be read right: the connection is ended (the
        receiver drops what it holds) and the outbox is lost."""
        try:
            self._sock.sendall(_framed(payload))
        except OSError:
            self.lost = True
            self.shutdown()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def receive(self) -> list[bytes]:
        """The whole frames the peer sent since the last call (without blocking: called when
        the socket is readable); at the peer's end of the connection, :attr:`lost` is set. The
        first bytes may bring the receiver's bell (:attr:`rings`)."""
        if self._first and not self._receive_bell():
            self.lost = True
        if not _receive(self._sock.fileno(), self._buf):
            self.lost = True
        return _frames(self._buf)

    def _receive_bell(self) -> bool:
        """Read the first bytes the receiver sent and the fd that comes with them, kept as the
        bell if it is a non-blocking eventfd (else closed: no bell); False at the connection's
        end. One ``recvmsg``: the socket is readable, so it does not wait."""
        got = _read_with_fds(self._sock, 1)
        if got is None:
            return True
        data, fds = got
        self._first = False
        for fd in fds:
            if self._bell is None and _is_bell(fd):
                with self._send_lock:
                    self._bell = fd
                if self._lander is not None:
                    self._lander.ring(fd)
            else:
                os.close(fd)
        self._buf += data
        return bool(data)

    @property
    def rings(self) -> bool:
        """The receiver's bell came: each settle rings it."""
        return self._bell is not None

    def announce(self, payload: bytes, event=None) -> int:
        """Send a notification whose bytes have not landed yet; return its number, which
        :meth:`settle` releases (numbers are settled in order), or with a lander, its thread
        once ``event`` (recorded after the copy; required then) completed. ``OSError`` when the
        socket refuses it (peer gone, or no room for ``timeout_s``); ``ValueError`` for a
        payload that starts with :data:`~transport.revocation.wire.MAGIC` (the receiver would
        take it for a control message and not count it: every later number would name the next
        one)."""
        if payload.startswith(wire.MAGIC):
            raise ValueError("a notification may not start with the control messages' magic bytes")
        if self._lander is not None and event is None:
            raise ValueError("a lander releases a notification once its event completed: the event is needed")
        with self._send_lock:  # numbers are watched in the order they are sent
            self._sendall(payload)
            self._announced += 1
            if self._lander is not None:
                try:
                    self._lander.watch(self._announced, event)
                except Exception as exc:  # sent, never to be released: a later number would pass it
                    self.lost = True
                    self.shutdown()  # the receiver drops what it holds
                    raise OSError(f"the lander refused notification {self._announced}: {exc}") from exc
            return self._announced

    def landed(self, number: int, look: bool = False) -> bool:
        """The lander has released notification ``number`` (False without a lander); ``look``:
        first release, from this thread, what has completed (:meth:`Lander.land`)."""
        if self._lander is None:
            return False
        if look:
            self._lander.land()
        return self._lander.landed(number)

    def awaiting(self, number: int, event):
        """What to wait on (``synchronize()``) until announced notification ``number`` whose copy
        ``event`` ends is settled: with a lander its thread passing the number
        (:meth:`Lander.awaiting`: no core kept busy), else the event."""
        return event if self._lander is None else self._lander.awaiting(number, event)

    def withdraw(self, number: int) -> bool:
        """With a lander: withdraw announced notification ``number`` now, out of order -- the
        thread stops at it, the receiver is sent its Dropped, then the thread goes on -- or
        False when the thread has released it already (its bytes landed; the receiver may have
        handed it out). A connection that ended takes nothing more: True."""
        if self._lander is None:
            raise RuntimeError("withdraw() is the lander's; without one, settle(number, landed=False)")
        if not self._lander.withdraw(number):
            return False
        try:
            self.send_control(wire.encode(wire.Dropped(number)))
        except OSError:  # the connection ended: the receiver drops every notification it holds
            pass
        finally:
            self._lander.release(number)
        return True

    def settle(self, number: int, landed: bool = True) -> None:
        """Notification ``number`` and every one before it are settled: landed, the receiver
        hands them out (one store into the shared word); not ``landed``, it is withdrawn first
        (a :class:`~transport.revocation.wire.Dropped`; ``OSError`` if the socket refuses it)."""
        if self._lander is not None:
            raise RuntimeError("a lander stores this outbox's word: withdraw() a failed notification")
        if not 0 < number <= self._announced or number <= self._settled:
            raise ValueError(f"notification {number} cannot be settled: {self._settled} of "
                             f"{self._announced} announced are")
        if self.lost:  # the receiver drops what it holds: nothing more may be released
            raise ConnectionError("the notification connection ended")
        if not landed:
            self.send_control(wire.encode(wire.Dropped(number)))
        if self._word is not None:
            self._word.store(number)
        self._settled = number
        if self._bell is not None:
            with self._send_lock:  # not into a closed (or reused) fd
                if self._bell is not None:
                    os.eventfd_write(self._bell, 1)

    def send(self, payload: bytes) -> None:
        """A notification whose bytes are in place: announced and settled at once (every
        earlier one must be settled: the receiver would hand them out with it)."""
        if self._settled != self._announced:
            raise RuntimeError(f"{self._announced - self._settled} notification(s) announced and not "
                               "settled: send() would release them")
        self.settle(self.announce(payload))

    def send_control(self, message: bytes) -> None:
        """A control message (:data:`~transport.revocation.wire.MAGIC` first, else ``ValueError``:
        the receiver would count it as a notification): not numbered."""
        if not message.startswith(wire.MAGIC):
            raise ValueError("a control message starts with the magic bytes")
        with self._send_lock:
            self._sendall(message)

    def shutdown(self) -> None:
        """End the connection now (the peer reads its end) without closing the socket, which a
        mailbox thread may still poll."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self._sock.close()
        if self._lander is not None:
            self._lander.close()  # before the word goes: its thread stores into it
        if self._word is not None:
            self._word.close()
        with self._send_lock:
            bell, self._bell = self._bell, None
        if bell is not None:
            os.close(bell)
