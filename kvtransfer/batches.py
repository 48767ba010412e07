"""The plan -> batch road: a plan's buffer numbers become transport region ids.

A pool exports its buffers in a fixed order (``get_contiguous_buf_infos()`` for the KV,
``get_state_buf_infos()`` for Mamba / NSA state); a :class:`~kvtransfer.plan.TransferPlan`
names buffers by that order; a transport names memory by region id. :class:`BufferRegions`
is the explicit map from the one to the other: built once, when a rank registers its pools
(:meth:`BufferRegions.register`), and sent to the peer in the handshake (``to_wire`` /
``from_wire``), since the destination side of every batch is the peer's map.

One request's bytes, from pool export to the remote pool::

    src_regions = BufferRegions.register(transport, pool.get_contiguous_buf_infos())  # at start-up
    plan = plan_kv_transfer(prefill_layout, decode_layout, src_slots, dst_slots)      # per request
    transfer = write_plan(peer, plan, src_regions, decode_regions, notify=b"req-17")
    transfer.wait()

:func:`plan_batch` is the middle step on its own: a :class:`~transport.base.StridedBatch`
(buffer pairs x token slots, which the NVLink backend expands on the GPU and NIXL's staged mode
stages with O(pairs + slots) host work; NIXL without it coalesces it into runs) whenever the plan has that form, else (NSA's sectioned index pages) the plan's
flattened, merged :class:`~transport.base.WriteBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from kvtransfer.plan import BufferSet, TransferPlan
from transport.base import Peer, StridedBatch, Transfer, Transport, WriteBatch

__all__ = ["BufferRegions", "plan_batch", "write_batch", "write_plan"]

_MAX_BUFFERS = 1 << 20  # a map longer than this from the wire is refused


def _region_ids(name: str, ids) -> np.ndarray:
    arr = np.asarray(ids if len(ids) else np.zeros(0, np.int64))
    if arr.ndim != 1:
        raise ValueError(f"{name} region ids must be 1-D, got shape {list(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} region ids must be integers, got dtype {arr.dtype}")
    if arr.size > _MAX_BUFFERS:
        raise ValueError(f"{name} region ids: at most {_MAX_BUFFERS} buffers, got {arr.size}")
    out = np.array(arr, dtype=np.int64)  # a copy the caller cannot change
    if out.size and out.min() < 0:
        raise ValueError(f"{name} region ids must be >= 0, got {int(out.min())}")
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class BufferRegions:
    """The transport region id of each exported buffer of one rank, in export order."""

    kv: np.ndarray  # [num KV buffers]: region id of get_contiguous_buf_infos() entry i
    state: np.ndarray  # [num state buffers]: region id of get_state_buf_infos() entry i

    @classmethod
    def of(cls, kv: Sequence[int], state: Sequence[int] = ()) -> "BufferRegions":
        """Validated, read-only int64 maps."""
        return cls(_region_ids("kv", kv), _region_ids("state", state))

    @classmethod
    def register(cls, transport: Transport, kv_infos, state_infos=None,
                 device: Optional[int] = None) -> "BufferRegions":
        """Register every exported buffer with ``transport`` (host memory, or CUDA ``device``)
        and return the map. ``kv_infos`` / ``state_infos`` are the pools' export tuples
        ``(data_ptrs, data_lens, item_lens)``. On failure the buffers registered so far are
        deregistered again."""
        done: list = []
        try:
            parts = []
            for infos in (kv_infos, state_infos):
                ids = []
                if infos is not None:
                    ptrs, lens, _ = infos
                    if len(ptrs) != len(lens):
                        raise ValueError(f"export lists differ in length: {len(ptrs)} pointers, {len(lens)} lengths")
                    for ptr, length in zip(ptrs, lens):
                        ids.append(transport.register(int(ptr), int(length), device))
                        done.append(ids[-1])
                parts.append(ids)
        except BaseException:
            for rid in done:
                transport.deregister(rid)
            raise
        return cls.of(*parts)

    def deregister(self, transport: Transport) -> None:
        """Deregister every region of this map from ``transport`` (the one that registered them)."""
        for rid in np.concatenate([self.kv, self.state]):
            transport.deregister(int(rid))

    def ids(self, part: BufferSet) -> np.ndarray:
        """The map of one export (:class:`~kvtransfer.plan.BufferSet`)."""
        return self.kv if part is BufferSet.KV else self.state

    def to_wire(self) -> dict:
        return {"kv": self.kv.tolist(), "state": self.state.tolist()}

    @classmethod
    def from_wire(cls, body) -> "BufferRegions":
        if not isinstance(body, dict) or set(body) != {"kv", "state"}:
            got = sorted(body) if isinstance(body, dict) else type(body).__name__
            raise ValueError(f"buffer regions must be a map with keys ['kv', 'state'], got {got}")
        for key in ("kv", "state"):
            if not isinstance(body[key], list):
                raise ValueError(f"buffer regions {key!r} must be a list, got {type(body[key]).__name__}")
        return cls.of(body["kv"], body["state"])


def _lookup(ids: np.ndarray, buffers: np.ndarray, side: str, part: BufferSet) -> np.ndarray:
    """Region ids of ``buffers`` (plan buffer numbers, >= 0) through one side's map."""
    try:
        return ids[buffers]
    except IndexError:  # numpy checks every index: no pass of our own over them first
        raise ValueError(f"the plan names {part.value} buffer {int(buffers.max())} on the {side} side, "
                         f"whose map holds {ids.size} buffers") from None


def plan_batch(plan: TransferPlan, src: BufferRegions, dst: BufferRegions,
               strided: bool = True) -> Union[StridedBatch, WriteBatch]:
    """The transport batch that writes ``plan``: source buffers through ``src`` (this rank's
    map), destination buffers through ``dst`` (the peer's). With ``strided`` a
    :class:`StridedBatch` when the plan is pairs x slots (every plan but NSA's sectioned index
    pages); otherwise, and without ``strided``, the flat :class:`WriteBatch` of the plan's
    merged ranges (what a peer that does not expand a StridedBatch on the device writes:
    ``strided=peer.takes_strided(plan.num_token_entries)``)."""
    if not isinstance(plan, TransferPlan):
        raise TypeError(f"plan must be a TransferPlan, got {type(plan).__name__}")
    for name, regions in (("src", src), ("dst", dst)):
        if not isinstance(regions, BufferRegions):
            raise TypeError(f"{name} must be BufferRegions, got {type(regions).__name__}")
    s_ids, d_ids = src.ids(plan.buffers), dst.ids(plan.buffers)
    # A plan's arrays are 1-D int64, non-negative, lengths > 0 (the planner's invariants): the
    # batches are built directly, without re-validation (a fifth of a small request's host
    # time). The transport still checks the bounds.
    form = plan.strided() if strided else None
    if form is not None:
        s_buf, s_off, s_stride, d_buf, d_off, d_stride, length, s_slot, d_slot = form
        return StridedBatch(_lookup(s_ids, s_buf, "source", plan.buffers), s_off, s_stride,
                            _lookup(d_ids, d_buf, "destination", plan.buffers), d_off, d_stride, length,
                            s_slot, d_slot)
    s_buf, s_off, d_buf, d_off, length = plan.flatten()
    return WriteBatch(_lookup(s_ids, s_buf, "source", plan.buffers), s_off,
                      _lookup(d_ids, d_buf, "destination", plan.buffers), d_off, length)


def write_plan(peer: Peer, plan: TransferPlan, src: BufferRegions, dst: BufferRegions,
               notify: Optional[bytes] = None) -> Transfer:
    """Start writing ``plan`` to ``peer`` (see :func:`plan_batch`, in the form the peer takes
    best); ``notify`` reaches the peer once every byte has landed."""
    return write_batch(peer, plan_batch(plan, src, dst, strided=peer.takes_strided(plan.num_token_entries)), notify)


def write_batch(peer: Peer, batch: Union[StridedBatch, WriteBatch], notify: Optional[bytes] = None) -> Transfer:
    """Start writing what :func:`plan_batch` returned: ``write_strided`` or ``write``."""
    if isinstance(batch, StridedBatch):
        return peer.write_strided(batch, notify)
    return peer.write(batch, notify)
