"""Settings of the nvlink backend: :class:`NvlinkConfig` and the engine choice (:class:`NvlinkEngine`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from transport.nvlink.ipc import API_CHOICES
from transport.nvlink.kernel import KernelConfig
from transport.nvlink.staged import StagedConfig

__all__ = ["NvlinkConfig", "NvlinkEngine", "check_engine"]


class NvlinkEngine(enum.Enum):
    """Which engine a write takes.

    AUTO: the staged engine for large batches of long rows (``StagedConfig.wants``), else the kernel.
    KERNEL: always the direct push kernel.
    STAGED: the staged engine whenever it can run (a second GPU it can reach, rows no longer
        than a chunk), whatever the batch's size and ``StagedConfig.enabled``; else the kernel.
    """

    AUTO = "auto"
    KERNEL = "kernel"
    STAGED = "staged"


@dataclass(frozen=True)
class NvlinkConfig:
    """Settings of one :class:`~transport.nvlink.NvlinkTransport`.

    peer_timeout_s: bound on sending one notification (a peer that stops reading fails the
        transfer after this long).
    transfer_timeout_s: a copy whose completion event has not fired by then is FAILED.
    ipc_api: "auto" (cuda-python, else ctypes on libcudart), "cuda-python" or "ctypes".
    engine: the engine writes take (:class:`NvlinkEngine`); a prepared write may override it.
    kernel: launch shape of the copy kernel.
    staged: the staged engine for large batches (:mod:`transport.nvlink.staged`).
    wait_current_stream: the copy stream waits for the caller's current stream first.
    max_notify_bytes: largest notification payload.
    slot_ring_bytes: the ring of slots of the direct path of ``write_strided``
        (:mod:`transport.nvlink.direct`), pinned on the host and on the GPU, allocated at the
        first such write; a write whose ``2 * S`` int64 slots exceed it takes the general path.
        0: no direct path (every write prepares its own tables).
    pair_plans: pair sets kept resident on the GPU per peer (least recently used out): at
        least as many as the writes to one peer cycle through, or each write rebuilds its
        plan. A request written layer by layer uses one pair set per layer (and per head
        slice): 80 for a 70B-class model. A plan holds its pair table, 40 bytes per pair on the GPU and pinned
        on the host (48 in the staged engine's form, on both GPUs).
    native: the direct path's host steps (slots staged and checked, uploaded, ordered after the
        caller's stream, launched) in C (:mod:`transport.nvlink.native`, built at first use
        with the system's C compiler); False, or where it cannot be built, in Python.
    lander_spin_us: how long the landers' thread (:mod:`transport.nvlink.completion`) looks
        without pause at a copy in flight before it naps 20 us at a time: the notification
        within a microsecond of the copy's end against a core busy meanwhile (0: naps from
        its first look). Process-wide: the smallest any transport of the process asked for.
    revoke_timeout_s: how long ``deregister`` waits for the peers that hold an export naming the
        region to acknowledge its revocation (or be found gone) before it refuses
        (``RevokeTimeout``), and how long a peer's first write waits for the receiver to
        acknowledge its hold (:mod:`transport.nvlink.revoke`).
    """

    peer_timeout_s: float = 10.0
    transfer_timeout_s: float = 60.0
    ipc_api: str = "auto"
    engine: NvlinkEngine = NvlinkEngine.AUTO
    kernel: KernelConfig = field(default_factory=KernelConfig)
    staged: StagedConfig = field(default_factory=StagedConfig)
    wait_current_stream: bool = True
    max_notify_bytes: int = 1 << 20
    slot_ring_bytes: int = 8 << 20
    pair_plans: int = 1024
    native: bool = True
    lander_spin_us: int = 2000
    revoke_timeout_s: float = 5.0

    def __post_init__(self):
        for name in ("peer_timeout_s", "transfer_timeout_s", "revoke_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.ipc_api not in API_CHOICES:
            raise ValueError(f"ipc_api must be one of {API_CHOICES}, got {self.ipc_api!r}")
        check_engine(self.engine)
        if not isinstance(self.kernel, KernelConfig):
            raise TypeError(f"kernel must be a KernelConfig, got {type(self.kernel).__name__}")
        if not isinstance(self.staged, StagedConfig):
            raise TypeError(f"staged must be a StagedConfig, got {type(self.staged).__name__}")
        if not isinstance(self.max_notify_bytes, int) or not 0 < self.max_notify_bytes < 1 << 31:
            raise ValueError(f"max_notify_bytes must be an int in (0, 2**31), got {self.max_notify_bytes!r}")
        if not isinstance(self.slot_ring_bytes, int) or isinstance(self.slot_ring_bytes, bool) \
                or not 0 <= self.slot_ring_bytes < 1 << 40 or self.slot_ring_bytes % 8:
            raise ValueError(f"slot_ring_bytes must be a multiple of 8 in [0, 2**40), got {self.slot_ring_bytes!r}")
        if not isinstance(self.native, bool):
            raise TypeError(f"native must be a bool, got {self.native!r}")
        if not isinstance(self.lander_spin_us, int) or isinstance(self.lander_spin_us, bool) \
                or not 0 <= self.lander_spin_us <= 10_000_000:
            raise ValueError(f"lander_spin_us must be an int in [0, 10**7], got {self.lander_spin_us!r}")
        if not isinstance(self.pair_plans, int) or isinstance(self.pair_plans, bool) or self.pair_plans < 1:
            raise ValueError(f"pair_plans must be an int >= 1, got {self.pair_plans!r}")


def check_engine(engine) -> NvlinkEngine:
    """``engine`` if it is an :class:`NvlinkEngine`, else ``TypeError`` naming the choices."""
    if not isinstance(engine, NvlinkEngine):
        raise TypeError(f"engine must be an NvlinkEngine ({', '.join(e.name for e in NvlinkEngine)}), "
                        f"got {engine!r}")
    return engine
