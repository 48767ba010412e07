"""A KV manager's addresses and timeouts (:class:`ControlConfig`: no environment variables), and
the pauses of its event loop."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUSY_POLL_S", "SWEEP_INTERVAL_S", "ControlConfig"]

BUSY_POLL_S = 2e-4  # a manager loop's pause while transfers are in flight
SWEEP_INTERVAL_S = 0.01  # how often a manager loop looks at every request (deadlines, forgotten ids)


@dataclass(frozen=True)
class ControlConfig:
    """Addresses and timeouts of one rank's KV manager."""

    host: str = "127.0.0.1"  # the address this rank's control socket binds and announces
    port: int = 0  # control socket port (0: any free port)
    dp_rank: int = 0  # the DP group of this rank (prefill) / of the prefill ranks it reads from (decode)
    bootstrap_timeout_s: float = 60.0  # registration and topology deadline
    handshake_timeout_s: float = 30.0  # a DecodeHello's answer
    transfer_timeout_s: float = 120.0  # a request not done by then fails
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0  # a peer silent this long is lost
    aux_slots: int = 1024  # decode: aux records, one per request in flight

    def loop_pause(self, busy: bool) -> float:
        """How long a manager's loop may pause: briefly while transfers are in flight (their
        status and notifications are polled), else until the next heartbeat is due."""
        return BUSY_POLL_S if busy else min(0.05, self.heartbeat_interval_s)

    def __post_init__(self):
        for name in ("bootstrap_timeout_s", "handshake_timeout_s", "transfer_timeout_s", "heartbeat_interval_s",
                     "heartbeat_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s})")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.aux_slots, int) or self.aux_slots < 2:
            raise ValueError(f"aux_slots must be an int >= 2 (slot 0 is padding), got {self.aux_slots!r}")
        if not isinstance(self.dp_rank, int) or self.dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {self.dp_rank!r}")
