"""The NVLink engine's notification channel (the "mailbox"), one Unix socket per transport.

Each transport listens on a Unix stream socket in Linux's abstract namespace (nothing on
disk); each peer keeps one connected socket to it. A frame is a 4-byte big-endian length, then
that many bytes. The first frame on a connection is the sender's name (UTF-8, the ``name`` of
the writing transport's export); every later frame is one notification payload, which the
receiver returns as a :class:`~transport.base.Notification` from that sender. The receiver
never writes to its connections, so a readable socket on the writer's side means end-of-file:
the peer process is gone.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
import uuid

from transport.base import Notification, TransportError

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


class Inbox:
    """The receiving end: a listening abstract Unix socket and the writers connected to it."""

    _CHUNK = 1 << 16

    def __init__(self):
        self.name = f"kvtransfer-nvlink-{os.getpid()}-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._listen_fd = self._sock.fileno()
        self._conns: dict[int, list] = {}  # fd -> [socket, bytearray of unparsed bytes, sender name or None]
        self._ready = select.poll()  # the listening socket and every connection: one poll(2) per call
        self._ready.register(self._sock, select.POLLIN)

    def poll(self) -> list[Notification]:
        """Whole notifications received since the last call, per connection in sending order.
        One ``poll(2)``; then only what it named: new connections accepted (and read once),
        ready connections read until a short read."""
        ready = self._ready.poll(0)
        if not ready:  # nothing to accept, read or close
            return []
        out: list[Notification] = []
        for fd, _ in ready:
            if fd == self._listen_fd:
                for entry in self._accept():
                    self._read(entry, out)
            elif fd in self._conns:
                self._read(self._conns[fd], out)
        return out

    def _accept(self) -> list:
        new = []
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return new
            conn.setblocking(False)
            entry = [conn, bytearray(), None]
            self._conns[conn.fileno()] = entry
            self._ready.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
            new.append(entry)

    def _read(self, entry: list, out: list) -> None:
        """Read what ``entry``'s connection holds, append its whole frames to ``out``; close it
        at end-of-file or an error."""
        conn, buf = entry[0], entry[1]
        closed = False
        while True:
            try:
                chunk = conn.recv(self._CHUNK)
            except BlockingIOError:
                break
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            buf += chunk
            if len(chunk) < self._CHUNK:  # drained (more that comes now: the next poll(2) says so)
                break
        while len(buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(buf)
            if len(buf) < _FRAME.size + n:
                break
            frame = bytes(buf[_FRAME.size : _FRAME.size + n])
            del buf[: _FRAME.size + n]
            if entry[2] is None:  # the connection's first frame names its sender
                entry[2] = frame.decode("utf-8", errors="replace")
            else:
                out.append(Notification(entry[2], frame))
        if closed:
            fd = conn.fileno()
            self._ready.unregister(conn)
            conn.close()
            self._conns.pop(fd, None)

    def close(self) -> None:
        for conn, *_ in self._conns.values():
            conn.close()
        self._conns.clear()
        self._sock.close()


class Outbox:
    """The writing end: one connected socket to a peer's inbox, introduced as ``sender``."""

    def __init__(self, name: str, timeout_s: float, sender: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect("\0" + name)
        except OSError as exc:
            self._sock.close()
            raise MailboxUnreachable(
                f"cannot reach the peer's notification socket {name!r} ({exc}); "
                "is it on this host and in this network namespace?"
            ) from None
        try:
            self._sock.sendall(_FRAME.pack(len(sender.encode("utf-8"))) + sender.encode("utf-8"))
        except OSError as exc:
            self._sock.close()
            raise MailboxUnreachable(f"the peer's notification socket {name!r} refused our name: {exc}") from None
        # From here the socket is non-blocking and send() bounds its own waits: a socket with a
        # timeout would poll(2) before every send(2) (CPython does), twice the system calls.
        self._timeout_s = timeout_s
        self._sock.setblocking(False)
        # one poll object per calling thread, registered once: alive() is one poll(2) per call, and
        # the caller's thread and the progress thread may call it at once (a poll object refuses that)
        self._polls = threading.local()

    def _poller(self) -> select.poll:
        try:
            return self._polls.poll
        except AttributeError:
            poll = self._polls.poll = select.poll()
            poll.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            return poll

    def alive(self) -> bool:
        """False once the peer closed its end (the peer never writes, so readable = EOF).
        Any thread may call it, several at once."""
        try:
            if not self._poller().poll(0):
                return True
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except (OSError, ValueError):  # ValueError: closed here (no descriptor to register)
            return False

    def send(self, payload: bytes) -> None:
        """Send one frame: one ``send(2)`` while the socket has room, else waits for room up to
        the timeout (``TimeoutError``; ``OSError`` when the peer is gone). One sender at a time
        (the pending queue's lock)."""
        data = _FRAME.pack(len(payload)) + payload
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._send_rest(memoryview(data)[sent:])

    def _send_rest(self, rest: memoryview) -> None:
        deadline = time.monotonic() + self._timeout_s
        room = select.poll()
        room.register(self._sock, select.POLLOUT)
        while rest:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the peer's mailbox took no bytes for {self._timeout_s} s")
            if not room.poll(max(1, int(left * 1000))):
                continue
            try:
                rest = rest[self._sock.send(rest):]
            except BlockingIOError:
                continue

    def close(self) -> None:
        self._sock.close()
