"""The NIXL agent of one transport: every call into ``nixl_agent`` goes through :class:`Agent`.

One agent is one UCX context. Its parts post writes (:meth:`Agent.post` and its variants, each
``(handle, state)`` or a :class:`~transport.base.TransportError` naming NIXL's refusal), read a
request's state (:meth:`Agent.state`) and release it (:meth:`Agent.release`), register memory,
load and drop remote agents' metadata, and send and read notifications. A closed agent refuses
with :class:`~transport.base.TransportClosed`.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Optional

import numpy as np

from transport._nixl_import import load_nixl_api
from transport.errors import TransportClosed, TransportError
from transport.nixl.config import NixlConfig

__all__ = ["Agent", "mem_of"]

# Host bytes that notification-only writes copy between two agents: NIXL's standalone
# notification (genNotif) has no completion to wait on, and over tcp it stays queued until
# something drives progress; a one-byte write has a real status.
SCRATCH_BYTES = 64

_LIVE_NAMES: set[str] = set()  # agent names of this process's open agents


def mem_of(device: Optional[int]) -> str:
    """NIXL's memory type of memory on ``device`` (None: host)."""
    return "DRAM" if device is None else "VRAM"


def _ucx_tls_hint() -> str:
    """Why an agent may not start: UCX_TLS without tcp (NIXL's UCX backend connects the agent
    to itself at start, which needs tcp on one host too)."""
    tls = os.environ.get("UCX_TLS")
    if tls is None or "tcp" in tls.split(",") or tls.startswith("^") or "all" in tls.split(","):
        return ""
    return f" -- UCX_TLS={tls!r} lacks tcp: keep tcp in UCX_TLS, also on one host (e.g. tcp,self,sm)"


def _default_agent_name() -> str:
    return f"kvt-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Agent:
    """One NIXL agent named ``name`` (``config.agent_name`` or a unique default), with its
    scratch bytes registered (``scratch_ptr``)."""

    def __init__(self, config: NixlConfig):
        self.name = config.agent_name or _default_agent_name()
        self.backends = list(config.backends)
        self._agent = None
        if self.name in _LIVE_NAMES:
            raise TransportError(f"NIXL agent name {self.name!r} is taken by a live NixlTransport of this process; "
                                 "agent names must be unique (pick another NixlConfig.agent_name, or None)")
        api = load_nixl_api()
        try:
            agent = api.nixl_agent(
                self.name,
                api.nixl_agent_config(
                    enable_prog_thread=config.progress_thread,
                    enable_listen_thread=False,
                    num_threads=config.num_threads,
                    backends=self.backends,
                ),
            )
        except Exception as exc:
            raise TransportError(f"NIXL agent {self.name!r} could not start: {type(exc).__name__}: {exc}"
                                 f"{_ucx_tls_hint()}") from exc
        missing = [b for b in config.backends if b not in agent.backends]
        if missing:
            raise TransportError(f"NIXL backends {missing} could not be created (plugins found: "
                                 f"{agent.get_plugin_list()}){_ucx_tls_hint()}")
        self._agent = agent
        _LIVE_NAMES.add(self.name)
        self._scratch = np.zeros(SCRATCH_BYTES, dtype=np.uint8)  # [SCRATCH_BYTES]
        self.scratch_ptr = int(self._scratch.ctypes.data)
        self._scratch_reg = self.register(self.scratch_ptr, SCRATCH_BYTES, None)
        self._stuck: list = []  # request handles whose release failed; retried at close

    @property
    def closed(self) -> bool:
        return self._agent is None

    def _checked(self):
        if self._agent is None:
            raise TransportClosed(f"NIXL transport {self.name!r} is closed")
        return self._agent

    def check_open(self) -> None:
        """:class:`~transport.base.TransportClosed` once closed."""
        self._checked()

    # -- remote agents and notifications ------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata, as a remote agent loads it."""
        return bytes(self._checked().get_agent_metadata())

    def load(self, metadata: bytes) -> str:
        """Load (or update in place) a remote agent's metadata; the agent's name. Raises what
        NIXL raises for metadata it rejects."""
        loaded = self._checked().add_remote_agent(metadata)
        return loaded.decode() if isinstance(loaded, bytes) else str(loaded)

    def remove(self, name: str) -> None:
        """Forget the remote agent ``name`` (nothing when closed or already invalidated)."""
        if self._agent is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already invalidated (e.g. after a disconnect)
            pass

    def send(self, name: str, payload: bytes) -> bool:
        """A notification alone (``send_notif``): delivered without this side's later progress
        once the endpoint is up. False when it could not go (the agent is gone or unknown)."""
        try:
            self._checked().send_notif(name, payload)
            return True
        except Exception:
            return False

    def read(self) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last read, by sender, each sender's in order."""
        notes = self._checked().get_new_notifs()
        return {(s.decode() if isinstance(s, bytes) else str(s)): [bytes(m) for m in msgs] for s, msgs in notes.items()}

    # -- memory --------------------------------------------------------------------------------

    def register(self, ptr: int, length: int, device: Optional[int]):
        """Register ``[ptr, +length)`` on ``device`` (None: host); NIXL's handle for :meth:`deregister`."""
        descs = np.array([[ptr, length, 0 if device is None else device]], dtype=np.uint64)  # [1, 3]
        try:
            return self._checked().register_memory(descs, mem_of(device), backends=self.backends)
        except TransportClosed:
            raise
        except Exception as exc:
            raise TransportError(f"NIXL could not register {mem_of(device)} [{ptr:#x}, +{length}) device {device}: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def deregister(self, reg) -> None:
        if self._agent is not None:
            self._agent.deregister_memory(reg, backends=self.backends)

    def prep_list(self, remote: Optional[str], rows: np.ndarray, mem: str):
        """A prepared descriptor list of ``rows`` (``[n, 5]`` strided form) on ``remote``'s
        memory (None: this agent's); raises what NIXL raises."""
        return self._checked().prep_xfer_dlist(remote or "NIXL_INIT_AGENT", rows, mem, backends=self.backends)

    # -- requests ------------------------------------------------------------------------------

    def post(self, name: str, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
             notif: bytes) -> tuple:
        """Post one write of ``[n, 3]`` (address, length, device) descriptor arrays to agent
        ``name``, ``notif`` riding on it: (handle, state)."""
        return self._submit(lambda agent: agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, remote_mem), name, notif,
            backends=self.backends))

    def post_prepped(self, local, local_indices, remote, remote_indices, notif: bytes) -> tuple:
        """Post one write made from block indices into prepared lists (:mod:`transport.nixl.prepped`)."""
        return self._submit(lambda agent: agent.make_prepped_xfer(
            "WRITE", local.handle, local_indices, remote.handle, remote_indices, notif, backends=self.backends))

    def post_byte(self, name: str, scratch_ptr: int, notif: bytes) -> tuple:
        """One scratch byte into agent ``name``'s scratch at ``scratch_ptr``: a notification
        alone, or a liveness probe (``notif`` empty)."""
        local = np.array([[self.scratch_ptr, 1, 0]], dtype=np.uint64)  # [1, 3]
        remote = np.array([[scratch_ptr, 1, 0]], dtype=np.uint64)  # [1, 3]
        return self.post(name, local, "DRAM", remote, "DRAM", notif)

    def post_ranges(self, name: str, local: np.ndarray, local_dev: Optional[int], remote: np.ndarray,
                    remote_dev: Optional[int], notif: bytes) -> tuple:
        """One write of ``[k, 2]`` int64 (address, bytes) ranges on each side, each side on one memory."""
        descs = []
        for ranges, dev in ((local, local_dev), (remote, remote_dev)):
            out = np.empty((ranges.shape[0], 3), dtype=np.uint64)  # [k, (address, bytes, device)]
            out[:, :2] = ranges
            out[:, 2] = dev or 0
            descs.append(out)
        return self.post(name, descs[0], mem_of(local_dev), descs[1], mem_of(remote_dev), notif)

    def _submit(self, make) -> tuple:
        """``make(agent)``'s request, posted: (handle, state). A request NIXL refused to make
        raises TransportError; one whose posting raised comes back with the state "ERR (why)":
        part of it may be in flight, so its handle is the caller's to keep until NIXL no
        longer runs it, as for a request that failed later."""
        agent = self._checked()
        try:
            handle = make(agent)
        except Exception as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        try:
            return handle, agent.transfer(handle)
        except Exception as exc:
            return handle, f"ERR ({type(exc).__name__}: {exc})"

    def state(self, handle) -> str:
        """NIXL's state of a request ("PROC", "DONE", ...); raises what NIXL raises for a
        request that failed in the backend (a lost peer: a disconnect)."""
        return self._checked().check_xfer_state(handle)

    def release(self, handle) -> None:
        """Release (cancel if active) a request; kept for a retry at close if NIXL refuses."""
        try:
            handle.release()
        except Exception:
            self._stuck.append(handle)

    def close(self, handles=()) -> None:
        """Release the scratch, ``handles`` and every request whose release failed; the agent
        (its UCX context and progress thread) goes."""
        if self._agent is None:
            return
        try:
            self._agent.deregister_memory(self._scratch_reg, backends=self.backends)
        except Exception:
            pass
        for handle in [*handles, *self._stuck]:
            try:
                handle.release()
            except Exception:
                pass
        self._stuck.clear()
        self._agent = None
        _LIVE_NAMES.discard(self.name)
