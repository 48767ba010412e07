"""Helpers shared by the control-plane tests."""

from __future__ import annotations

from kvtransfer.control.wire import RegisterPrefill


def register(**changes) -> RegisterPrefill:
    fields = dict(dp_rank=0, tp_rank=1, tp_size=2, control_addr="tcp://127.0.0.1:5000", host="h0", backend="nixl",
                  transport_export=b"\x00\x01export", transport_name="prefill-1", layout=b"layout",
                  regions={"kv": [0, 1], "state": []}, incarnation="abc")
    fields.update(changes)
    return RegisterPrefill(**fields)
