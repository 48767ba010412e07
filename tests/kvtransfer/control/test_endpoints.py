"""``Endpoints.release`` with the real NIXL transport: a peer that holds the rank's export and
does not let go (a silent holder: the transport refuses to deregister, ``RevokeTimeout``) leaves
those regions registered with a warning; closing a manager does not fail on it, and waits for
that peer once (its regions after the first are not waited for)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from transport._nixl_import import load_nixl_api

try:
    load_nixl_api()
except ImportError as exc:  # NIXL is an optional extra
    pytest.skip(f"NIXL is not installed: {exc}", allow_module_level=True)

from kvtransfer.control.endpoints import Endpoints  # noqa: E402
from tests.transport._nixl_peer import LOOPBACK_ENV  # noqa: E402
from tests.transport._revoke_clock import LONG_S, revoke_clock  # noqa: E402
from tests.transport._support import Writer  # noqa: E402
from transport.base import RevokeTimeout  # noqa: E402
from transport.nixl import NixlConfig, NixlTransport  # noqa: E402


def test_release_keeps_the_regions_a_silent_peer_holds_and_warns(monkeypatch, caplog):
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    clock = revoke_clock(monkeypatch)
    owner = NixlTransport(NixlConfig(revoke_timeout_s=LONG_S))
    writer = None
    try:
        bufs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]  # [4096] each: one page of 3 "layers"
        endpoints = Endpoints(owner, ([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [4096] * 3))
        ids = endpoints.regions["nixl"].kv.tolist()
        writer = Writer(7, 4096)
        writer.connect(owner.export())
        writer.write(1, ids[0], 0, 4096, pump=owner.poll_notifications)
        assert writer.wait_finished(1, pump=owner.poll_notifications).status == "DONE"
        writer.idle(pump=False)  # holds the export, answers nothing
        clock.expire = lambda: True  # the wait for it times out at its first nap
        with caplog.at_level(logging.WARNING, logger="kvtransfer.control"):
            endpoints.release()
        assert clock.naps == 1, f"{clock.naps} naps: one wait for the silent peer, then it is known"
        clock.expire = lambda: False
        assert "3 nixl region(s) stay registered: a peer that holds them did not let go" in caplog.text
        assert f"still held by peer(s) ['{writer.name}']" in caplog.text
        assert sorted(owner.regions) == sorted(ids)  # kept: the memory must outlive that peer
        assert endpoints.regions == {}
        writer.idle(pump=True)  # it answers now (a silent peer is waited for again once its answers came)
        deadline = time.monotonic() + 30.0
        while owner.regions and time.monotonic() < deadline:
            owner.poll_notifications()
            for rid in list(owner.regions):
                try:
                    owner.deregister(rid)
                except RevokeTimeout:
                    time.sleep(0.05)
        assert not owner.regions
    finally:
        if writer is not None:
            writer.stop()
        owner.close()
