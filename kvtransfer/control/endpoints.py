"""A rank's transports and its pools' buffers registered there (:class:`Endpoints`), and which
transport two ranks use (:func:`pick_backend`)."""

from __future__ import annotations

import logging
import socket
from typing import Optional

import numpy as np

from kvtransfer.batches import BufferRegions
from kvtransfer.control.wire import Endpoint
from transport.base import RevokeTimeout, Transport

__all__ = ["Endpoints", "default_host_id", "pick_backend"]

log = logging.getLogger("kvtransfer.control")


class Endpoints:
    """A rank's transports by backend and, for each, its pools' buffers registered there.

    ``transports``: one Transport or several of distinct backends (``nixl`` for anything,
    ``nvlink`` beside it for CUDA pools of one host). Registration of every buffer with every
    transport happens here, at start; :meth:`release` deregisters (idempotent)."""

    def __init__(self, transports, kv_infos, state_infos=None, device: Optional[int] = None):
        items = [transports] if isinstance(transports, Transport) else list(transports)
        if not items or not all(isinstance(t, Transport) for t in items):
            raise TypeError(f"transports must be a Transport or a non-empty list of them, got {transports!r}")
        self.transports: dict = {}
        for t in items:
            if t.backend in self.transports:
                raise ValueError(f"two transports of backend {t.backend!r}")
            self.transports[t.backend] = t
        self.regions: dict = {}  # backend -> BufferRegions
        try:
            for backend, t in self.transports.items():
                self.regions[backend] = BufferRegions.register(t, kv_infos, state_infos, device)
        except BaseException:
            self.release()
            raise

    def notification_fds(self) -> list:
        """The transports' :meth:`~transport.base.Transport.notification_fd`, those that have one."""
        return [fd for fd in (t.notification_fd() for t in self.transports.values()) if fd is not None]

    def wire(self) -> list:
        """``Endpoint.to_wire()`` of each transport, for a registration or a hello."""
        return [Endpoint(b, t.name, t.export(), self.regions[b].to_wire()).to_wire()
                for b, t in self.transports.items()]

    def release(self) -> None:
        """Deregister every buffer. A region that a peer still holds and does not give up in
        time (``RevokeTimeout``: the transport cannot prove that peer will not write into it;
        the decode manager's goodbye normally makes peers let go first) stays registered, with
        a warning: the pools' memory must then outlive that peer."""
        for backend, regions in list(self.regions.items()):
            transport = self.transports[backend]
            kept = []
            for rid in np.concatenate([regions.kv, regions.state]).tolist():
                try:
                    transport.deregister(int(rid))
                except RevokeTimeout as exc:
                    kept.append((rid, exc))
                except ValueError as exc:  # the transport was closed first
                    log.debug("deregistering from %s after close: %s", backend, exc)
            if kept:
                log.warning("%d %s region(s) stay registered: a peer that holds them did not let go (%s)",
                            len(kept), backend, kept[0][1])
            del self.regions[backend]


def pick_backend(mine: dict, theirs: dict, same_host: bool) -> list:
    """The backends two ranks share, best first: ``nvlink`` when both offer it on one host,
    then ``nixl``, then any other."""
    common = [b for b in mine if b in theirs]
    order = {"nvlink": 0 if same_host else 9, "nixl": 1}
    return sorted((b for b in common if b != "nvlink" or same_host), key=lambda b: order.get(b, 5))


def default_host_id() -> str:
    """This host's identity in registrations (ranks on one host may share GPUs over NVLink)."""
    return socket.gethostname()
