"""Shared helpers of the pool tests (test modules import this, never each other)."""

from dataclasses import dataclass


@dataclass
class Layer:
    """A layer argument as the pools take it: anything with a ``layer_id``."""

    layer_id: int


class Counter:
    """A layer_transfer_counter that records its ``wait_until`` calls; a layer in ``missing``
    has "not arrived" and raises TimeoutError (so the pool must not return its data)."""

    def __init__(self, missing=()):
        self.calls, self.missing = [], set(missing)

    def wait_until(self, layer_id):
        self.calls.append(layer_id)
        if layer_id in self.missing:
            raise TimeoutError(f"layer {layer_id} not arrived")


def reference_move(buffers, tgt, src):
    """Expected buffers after rows tgt <- src: read every source from a snapshot."""
    out = [b.clone() for b in buffers]
    for o, b in zip(out, buffers):
        snapshot = b.clone()
        o[tgt.long()] = snapshot[src.long()]
    return out
