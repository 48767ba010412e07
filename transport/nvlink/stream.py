"""The transport's copy stream on its GPU: table uploads, launches, the completion event.

The direct path of ``write_strided`` (:mod:`transport.nvlink.fastpath`) enqueues with
:meth:`CopyStream.enqueue_split`: a raw event orders the copy stream after the caller's, the
slots go up from the pinned ring (ahead of that wait: they need nothing of the caller's), one
launch reads the resident pair table. With the C steps (:mod:`transport.nvlink.native`) the
upload and the order are one call into the driver, and so is the launch.

Every peer of one transport enqueues on the same stream, which first waits for the caller's
current stream (``wait_current_stream``: KV written by the model is complete before it is
read). Tables go up by one raw ``cudaMemcpyAsync`` each (torch's stream contexts cost more
than the copy); a staged write's second table goes to the peer's GPU on the lane's scatter
stream.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

from transport.nvlink import ipc
from transport.nvlink import kernel as kern

if TYPE_CHECKING:
    from transport.nvlink.fastpath import PairPlan, SlotRing
    from transport.nvlink.job import PreparedWrite

__all__ = ["CopyStream", "empty_for"]


_CURRENT: list = []  # the function that gives the raw current stream, found at the first call


def _current_stream_handle(device: int) -> int:
    """The raw handle of torch's current stream on ``device``: the private call Triton's launcher
    uses (no Stream object made), else through ``torch.cuda.current_stream``."""
    if not _CURRENT:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _CURRENT.append(raw if raw is not None else lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _CURRENT[0](device)


def empty_for(stream, shape, dtype, device: int):
    """An uninitialised tensor on GPU ``device`` for work queued on ``stream`` (a torch stream),
    allocated for that stream: the caching allocator orders a block's reuse only on the stream
    it was allocated for, so a block taken on the caller's stream could still be written by work
    queued there (a model's temporaries, freed as soon as launched), which ``stream`` does not
    wait for."""
    import torch

    with torch.cuda.stream(stream):
        return torch.empty(shape, dtype=dtype, device=torch.device("cuda", device))


class CopyStream:
    """A torch stream on ``device`` (created at first use) and the enqueue steps of a write."""

    def __init__(self, api, device: int, wait_current_stream: bool, native=None):
        """``native``: the C steps of :meth:`enqueue_split` (:mod:`transport.nvlink.native`;
        None: ``api``'s calls from Python)."""
        self._api, self.device, self._wait_current, self._native = api, device, wait_current_stream, native
        self._stream = None
        self._order_event = None  # raw event: the caller's stream's point the copy stream waits for
        self._events = api if native is None else native  # what makes and destroys it: the side that records it

    @property
    def stream(self):
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _table_on(self, host, device: int, stream):
        """``host`` copied to ``device`` on ``stream``, into memory allocated for ``stream``
        (:func:`empty_for`). The pinned ``host`` must outlive the copy: transfers keep it
        until their event completes, failed ones too (buried)."""
        table = empty_for(stream, host.shape, host.dtype, device)
        with ipc.on_device(self._api, device, torch_too=False):
            self._api.memcpy_async(table.data_ptr(), host.data_ptr(), host.numel() * host.element_size(),
                                   stream.cuda_stream)
        return table

    def upload(self, job: "PreparedWrite") -> tuple:
        """The job's pinned table on the local GPU (on this stream) and, staged, on the peer's
        (on the scatter stream): the tables :meth:`enqueue` reads."""
        tables = (self._table_on(job.host_table, self.device, self.stream),)
        if job.lane is not None:
            tables += (self._table_on(job.host_table, job.lane.peer, job.lane.scatter_stream),)
        return tables

    def enqueue(self, job: "PreparedWrite", tables: tuple):
        """Queue the job's copy; return the CUDA event that marks its completion."""
        import torch

        stream = self.stream
        if self._wait_current:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        lane, launch = job.lane, job.launch
        if lane is None:
            with ipc.on_device(self._api, self.device, torch_too=False):
                launch(tables[0], self.device, stream)
            event = torch.cuda.Event()
            event.record(stream)
            return event
        return lane.run(stream, job.bounds, job.offsets,
                        lambda a, b, st, s: launch(tables[0], lane.local, s, a, b, st),
                        lambda a, b, st, s: launch(tables[1], lane.peer, s, a, b, st))

    def _caller(self, stream) -> Optional[int]:
        """The raw handle of the caller's current stream, which ``stream`` must wait for (None:
        nothing to wait for, configured off or the same stream); the reused raw event that
        orders them exists once this returns a handle (the device is current)."""
        if not self._wait_current:
            return None
        current = _current_stream_handle(self.device)
        if current == stream.cuda_stream:
            return None
        if self._order_event is None:
            self._order_event = self._events.event_create()
        return current

    def _wait_caller(self, stream) -> None:
        """The copy stream waits for the work queued so far on the caller's current stream (one
        reused raw event: record, wait)."""
        current = self._caller(stream)
        if current is not None:
            self._api.event_record(self._order_event, current)
            self._api.stream_wait_event(stream.cuda_stream, self._order_event)

    def enqueue_split(self, plan: "PairPlan", num_slots: int, ring: "SlotRing", start: int, num_warps: int,
                      cuts: Optional[tuple] = None, upload: bool = True):
        """Queue the direct write of ``num_slots`` slots staged in ``ring`` at ``start`` over the
        pairs resident in ``plan``: the slots' upload, the wait for the caller's stream, one
        launch, the event. The upload reads only the pinned ring, so it goes ahead of the wait
        and runs while the caller's work does (a write posted behind compute starts its copy
        that much sooner). Returns the event (recorded after the copy); the ring's span is
        fenced with it (or freed once nothing can read it, on an error).

        A staged plan (``plan.staged``) runs its lane's pipeline instead of the one launch,
        over the chunks ``cuts`` (``(bounds, offsets)``, :meth:`PairPlan.cuts`), the slots also
        uploaded to the lane's ring on the peer's GPU; the event is then the lane's, after the
        last scatter. ``upload`` False: the span's slots are on the GPU already, uploaded by an
        earlier write on this stream (:meth:`SlotRing.reuse`; direct writes only)."""
        import torch

        api, device, stream, native = self._api, self.device, self.stream, self._native
        prev = api.get_device() if native is None else native.current_device()  # one call when the caller drives this GPU
        if prev != device:
            api.set_device(device)
        event = None
        try:
            if not upload and plan.staged is not None:
                raise ValueError("a staged write uploads its slots (the lane's ring has only its own)")
            if native is not None:  # the same two steps, one C call
                caller = self._caller(stream)  # (makes the order event at the first wait)
                native.upload_after(stream.cuda_stream, *ring.addresses(start), 16 * num_slots if upload else 0,
                                    caller, self._order_event)
            else:
                if upload:  # needs nothing of the caller's: ahead of the wait
                    ring.upload(start, 2 * num_slots, stream.cuda_stream)
                self._wait_caller(stream)
            part = plan.staged
            if part is not None:
                upload = (part.lane.peer_slots(ring.space.capacity).data_ptr() + 8 * start, ring.addresses(start)[1],
                          16 * num_slots)
                specs = (part.gather.native_spec(), part.scatter.native_spec()) if native is not None else (None,)
                if None not in specs:  # both launches kept and found equivalent in C: the pipeline in one call
                    event = part.lane.run_native(native, stream, *cuts, *specs, (
                        start, plan.num_pairs, num_slots, plan.launch.block_r, plan.launch.num_programs), upload)
                else:
                    event = part.lane.run(
                        stream, *cuts,
                        lambda a, b, stage, s: part.gather(start, num_slots, s, a, b, stage),
                        lambda a, b, stage, s: part.scatter(start, num_slots, s, a, b, stage), upload=upload)
            else:
                if plan.launcher is not None:  # the launch bound at the plan's making
                    plan.launcher(start, num_slots, stream)
                else:
                    kern.scatter_strided_split(plan.device_table, ring.dev, start, plan.num_pairs, num_slots,
                                               plan.launch, device, num_warps, checked=True, stream=stream)
                event = torch.cuda.Event()
                event.record(stream)
        finally:
            if event is None:  # part of it may be queued: let the span go only once nothing reads it
                self._drain(plan.staged.lane if plan.staged is not None else None)
            ring.space.hold(start, event)
            if prev != device and prev >= 0:  # -1: no device was current on this thread (native's answer)
                api.set_device(prev)
        return event

    def quiesce(self, job: "PreparedWrite") -> None:
        """Wait for everything queued (after a failed enqueue: part of it may be queued, and
        nothing may read the tables once they go)."""
        self._drain(job.lane)

    def _drain(self, lane=None) -> None:
        """Wait for the copy stream and, given one, a staged lane's streams, each whatever the
        other did (a CUDA error here would only repeat the first one)."""
        for sync in (self.synchronize, None if lane is None else lane.synchronize):
            if sync is not None:
                with contextlib.suppress(Exception):
                    sync()

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        """Wait for the stream, release the raw event (idempotent)."""
        self.synchronize()
        if self._order_event is not None:
            with contextlib.suppress(Exception), ipc.on_device(self._api, self.device, torch_too=False):
                self._events.event_destroy(self._order_event)
            self._order_event = None

