"""Mooncake's Transfer Engine as a third path of ``bench transport``'s fixed cost per write
(``--mooncake``): the same rows, written with ``batch_transfer_sync`` and a ``TransferNotify``
over its tcp transport, the peers found by its P2P handshake (no metadata server).

The ``mooncake-transfer-engine`` wheel is optional; ``bench/mooncake.sh`` installs it beside the
CUDA runtime it links and, on a machine without a GPU driver, a stand-in ``libcuda.so.1`` that
answers "no device" (the tcp transport never calls the driver).
"""

from __future__ import annotations

SETUP_HINT = "bench/mooncake.sh installs it and runs this benchmark with it"


def unavailable() -> str:
    """Why Mooncake's Transfer Engine cannot load here ("" when it can)."""
    try:
        _engine_module()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _engine_module():
    try:
        from mooncake import engine
    except ImportError as exc:  # the wheel missing, or a library it links (libcuda.so.1, libcudart.so.12)
        raise RuntimeError(f"--mooncake needs mooncake-transfer-engine, which failed to load ({exc}); "
                           f"{SETUP_HINT}") from None
    return engine


class MooncakeEngine:
    """One Transfer Engine on 127.0.0.1 over tcp: registers memory, writes rows with a
    notification, and reads the notifications that reached it."""

    def __init__(self) -> None:
        self._mod = _engine_module()
        self.engine = self._mod.TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"  # what peers write to

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({nbytes} B) failed ({rc})")

    def write(self, session: str, src: list, dst: list, lengths: list, notify: bytes) -> None:
        """Rows ``src[i]`` -> the peer's ``dst[i]`` (addresses), ``lengths[i]`` bytes each, then
        ``notify``; returns when Mooncake reports the batch complete."""
        note = self._mod.TransferNotify("bench", notify.decode())
        rc = self.engine.batch_transfer_sync(session, src, dst, lengths, self._mod.TransferOpcode.Write, note)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync of {len(src)} rows failed ({rc})")

    def notifications(self) -> list:
        """The payloads (bytes) of the notifications that arrived since the last call."""
        return [n.msg.encode() for n in self.engine.get_notifies()]
