"""A node rank's KV managers and the transports each one owns: :class:`RankManagers`.

A prefill rank has one :class:`~kvtransfer.control.prefill.PrefillKVManager`, made at start. A
decode rank has one :class:`~kvtransfer.control.decode.DecodeKVManager` per prefill node it
reads from, made on the first request that names that node; every rank of the node must agree
that its own came up, or none keeps it (the ranks' schedules stay equal). Each manager gets
transports of its own (``nixl``, and ``nvlink`` beside it for CUDA pools when asked), closed
with it. ``auto`` on CUDA pools without NIXL installed uses the NVLink engine alone.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

__all__ = ["RankManagers"]

log = logging.getLogger("kvtransfer.serve.worker")


class RankManagers:
    """The KV managers of one rank (module docstring). ``all_up(ok)`` is the node's vote: True
    on every rank when every rank's ``ok`` is True; ``on_change`` goes to every manager (called
    when one of its requests changes state)."""

    def __init__(self, spec, layout, kv_infos, state_infos, gpu: Optional[int], all_up: Callable[[bool], bool],
                 on_change: Optional[Callable[[], None]] = None):
        self.spec, self.layout, self.kv_infos, self.state_infos, self.gpu = spec, layout, kv_infos, state_infos, gpu
        self._all_up = all_up
        self._on_change = on_change  # every manager's: a request of it changed state
        self.prefill = None  # PrefillKVManager of a prefill rank
        self.decode: Dict[str, object] = {}  # prefill bootstrap -> DecodeKVManager

    def start_prefill(self) -> None:
        from kvtransfer.control.prefill import PrefillKVManager

        self.prefill = PrefillKVManager(self.layout, self._transports(), self.kv_infos, self.state_infos,
                                        bootstrap=self.spec.bootstrap, config=self._config(), device=self.gpu,
                                        on_change=self._on_change)

    def prefill_backends(self) -> tuple:
        """The backends of the prefill manager's transports (none on other ranks)."""
        return () if self.prefill is None else tuple(self.prefill.endpoints.transports)

    def decode_for(self, bootstrap: str) -> tuple:
        """``(DecodeKVManager, None)`` for the prefill node at ``bootstrap``, or ``(None, why)``
        where this rank's or another rank's could not connect."""
        mgr = self.decode.get(bootstrap)
        if mgr is not None:
            return mgr, None
        from kvtransfer.control.decode import DecodeKVManager

        error, transports = None, []
        try:
            transports = self._transports()
            mgr = DecodeKVManager(self.layout, transports, self.kv_infos, self.state_infos,
                                  bootstrap=bootstrap, instance=self.spec.instance, config=self._config(),
                                  device=self.gpu, on_change=self._on_change)
        except Exception as exc:  # noqa: BLE001 - any failure to connect fails the request, not the node
            error = f"cannot connect to the prefill node at {bootstrap}: {exc}"
        if not self._all_up(error is None):
            if mgr is not None:
                mgr.close()
            for t in transports:  # the manager's own, not kept: no agent left behind
                t.close()
            return None, error or f"cannot connect to the prefill node at {bootstrap}: another rank failed to"
        self.decode[bootstrap] = mgr
        return mgr, None

    def _config(self):
        from kvtransfer.control.config import ControlConfig

        return ControlConfig(host=self.spec.host, **self.spec.control)

    def _transports(self) -> list:
        from transport.nixl import NixlTransport

        out = []
        if self.spec.transport in ("auto", "nixl"):
            try:
                out.append(NixlTransport())
            except ImportError as exc:  # NIXL is not installed
                if self.spec.transport == "nixl" or self.gpu is None:
                    raise
                log.warning("transport auto: NIXL is not installed, the NVLink engine alone moves KV (%s)", exc)
        if self.spec.transport in ("auto", "nvlink") and self.gpu is not None:
            from transport.nvlink import NvlinkTransport

            out.append(NvlinkTransport())
        if not out:
            raise ValueError(f"transport {self.spec.transport!r} needs CUDA pools (--device cuda)")
        return out

    def close(self) -> None:
        """Close every manager, then its transports."""
        managers = list(self.decode.values())
        if self.prefill is not None:
            managers.append(self.prefill)
        for mgr in managers:
            try:
                mgr.close()
            finally:
                for t in mgr.endpoints.transports.values():
                    t.close()
