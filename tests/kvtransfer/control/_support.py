"""Helpers shared by the control-plane tests."""

from __future__ import annotations

from kvtransfer.control.wire import Endpoint, RegisterPrefill


def endpoint(backend="nixl", name="prefill-1") -> dict:
    return Endpoint(backend, name, b"\x00\x01export", {"kv": [0, 1], "state": []}).to_wire()


def register(**changes) -> RegisterPrefill:
    fields = dict(dp_rank=0, tp_rank=1, tp_size=2, control_addr="tcp://127.0.0.1:5000", host="h0",
                  endpoints=[endpoint()], layout=b"layout", incarnation="abc")
    fields.update(changes)
    return RegisterPrefill(**fields)
