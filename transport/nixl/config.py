"""Configuration of the ``nixl`` backend: one frozen, validated :class:`NixlConfig` per agent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from transport.nixl.staged.config import StagedNixlConfig

__all__ = ["NixlConfig", "StagedNixlConfig"]


@dataclass(frozen=True)
class NixlConfig:
    """Configuration of one NIXL agent.

    agent_name: unique name of this process's agent; None picks ``kvt-<host>-<pid>-<random>``.
    progress_thread: run NIXL's progress thread (see :mod:`transport.nixl`, "Progress").
    backends: NIXL backend plugins to create; writes use only these.
    num_threads: UCX backend worker threads (0: NIXL's default).
    peer_loss_timeout_s: a transfer still pending this long past the time its bytes need at
        ``min_throughput_gbps`` is failed as "peer lost or stalled".
    min_throughput_gbps: slowest throughput (GB/s) still considered alive.
    staged: when a write goes through staging (many small ranges), and the staging's size
        (:mod:`transport.nixl.staged`); this side's ``max_lanes`` / lane size also bound what
        it grants senders.
    revoke_timeout_s: how long ``deregister`` waits for the peers that hold an export naming
        the region to acknowledge its revocation (or be found dead) before it refuses
        (``RevokeTimeout``), and how long a first direct write waits for the owner to record
        this transport's hold (:mod:`transport.nixl.revoke`).
    """

    agent_name: Optional[str] = None
    progress_thread: bool = False
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    peer_loss_timeout_s: float = 10.0
    min_throughput_gbps: float = 0.1
    staged: StagedNixlConfig = field(default_factory=StagedNixlConfig)
    revoke_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.agent_name is not None and (not isinstance(self.agent_name, str) or not self.agent_name):
            raise ValueError(f"agent_name must be a non-empty str or None, got {self.agent_name!r}")
        if not isinstance(self.backends, tuple) or not self.backends or not all(
            isinstance(b, str) and b for b in self.backends
        ):
            raise ValueError(f"backends must be a non-empty tuple of names, got {self.backends!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"num_threads must be an int >= 0, got {self.num_threads!r}")
        if not self.peer_loss_timeout_s > 0:
            raise ValueError(f"peer_loss_timeout_s must be > 0, got {self.peer_loss_timeout_s!r}")
        if not self.min_throughput_gbps > 0:
            raise ValueError(f"min_throughput_gbps must be > 0, got {self.min_throughput_gbps!r}")
        if not self.revoke_timeout_s > 0:
            raise ValueError(f"revoke_timeout_s must be > 0, got {self.revoke_timeout_s!r}")
        if not isinstance(self.staged, StagedNixlConfig):
            raise TypeError(f"staged must be a StagedNixlConfig, got {type(self.staged).__name__}")

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` may stay pending before it counts as lost."""
        return self.peer_loss_timeout_s + nbytes / (self.min_throughput_gbps * 1e9)
