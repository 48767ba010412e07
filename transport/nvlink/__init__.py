"""The ``nvlink`` backend: GPU-to-GPU writes between two processes of one host.

Data path (push, on the writer)
-------------------------------
- ``register`` exports a CUDA IPC handle for each GPU region (the handle of its allocation's
  base plus the region's offset; :mod:`~transport.nvlink.ipc`). All regions of one transport
  live on one GPU, the one whose SMs run the copy kernel.
- ``connect`` opens every peer region's handle while the LOCAL GPU is current and builds the
  pointer tables once (:mod:`~transport.nvlink.mapping`): local and peer addresses by region id.
- A write is prepared (:mod:`~transport.nvlink.job`): bounds checked against cached region
  sizes, the engine chosen (:class:`NvlinkEngine`, :mod:`~transport.nvlink.route`), the table
  built in pinned host memory (:mod:`~transport.nvlink.tables`): for ``write`` the row table
  ``[3, n]`` (source address, destination address, bytes), for ``write_strided`` (buffer pairs
  x slots) a ``[5 * P + 2 * S]`` table built in O(P + S) whose rows the strided kernel
  computes on the GPU (:mod:`~transport.nvlink.kernel`). It is then posted
  (:mod:`~transport.nvlink.stream`): the table goes to the GPU by one raw ``cudaMemcpyAsync``
  and the Triton kernel runs once, on a stream of its own that first waits for the caller's
  current stream (so KV written by the model is complete). A CUDA event recorded after the
  copy marks completion. ``peer.prepare(batch)`` returns that prepared write as a public
  handle, :class:`PreparedWrite`, to post many times (``job.post()``) and ``release()``.
- The direct path of ``write_strided`` (:mod:`~transport.nvlink.fastpath`), taken whenever
  the write goes to the direct kernel: the pair part of the strided table (which buffer goes
  where; the two layouts' business) is built, bounds-reduced to one slot limit per side and
  uploaded once per pair set, and kept on the GPU (a per-peer cache); a write checks its slots
  in one pass against those limits, copies them into a pinned ring, uploads them with one
  ``cudaMemcpyAsync`` and launches the split strided kernel once, through a launch bound once
  per pair set (``kernel.SplitLaunch``: Triton's compiled launcher called directly): no pinned
  allocation, no table build, no synchronisation, no Python loop over pairs or slots. ``peer.plan_pairs(batch)``
  makes a pair set resident ahead of its first write (at handshake).
- The staged engine (:mod:`~transport.nvlink.staged`) packs rows on the local GPU, moves the
  packed bytes with the copy engine and unpacks them with a kernel this process launches on
  the peer GPU; ``NvlinkEngine.AUTO`` takes it for batches of 2 GiB and more whose rows
  average 1 KiB or more (``StagedConfig``; figures in bench/RESULTS.md).

Notification channel (the "mailbox", :mod:`~transport.nvlink.mailbox`)
---------------------------------------------------------------------
Each transport listens on a Unix stream socket in Linux's abstract namespace (named in its
export; nothing on disk) and each peer keeps one connected socket to it, introduced by the
writer's name. A notification is one frame sent by the WRITER only after the transfer's CUDA
event has completed, i.e. after the kernel's stores to the peer's memory are done; the
receiver's ``poll_notifications`` reads whole frames without blocking and returns each as a
:class:`~transport.base.Notification` from that writer. The same socket detects a dead peer:
the receiver never writes to it, so a readable socket means end-of-file.

Progress and bounded waits
--------------------------
``Transfer.status()`` and a progress thread (:mod:`~transport.nvlink.progress`, one per
transport, started on the first write) advance each peer's FIFO of pending transfers
(:mod:`~transport.nvlink.pending`): query the event; on completion send the notification
(bounded by ``peer_timeout_s``; a peer gone refuses it) or, without one, check the peer is
alive, and mark DONE. Between advances the
thread waits on the oldest pending event (``synchronize()``, the GIL released), so the
notification leaves as soon as the copy ends; ``wait()`` sleeps until the transfer settles. A dead peer is FAILED at
``write`` (nothing is launched) or at completion; a copy whose event has not completed after
``transfer_timeout_s`` is FAILED. ``abort`` marks a pending transfer FAILED and suppresses its
notification; the kernel, once launched, still runs to completion, and a failed transfer keeps
its tables until its copy ends.

Deregistering exported memory (no revocation here)
--------------------------------------------------
``deregister`` only forgets the region here: it revokes nothing. A peer that connected to an
export opened the CUDA IPC handle of the region's whole allocation and keeps that mapping until
its ``NvlinkPeer.close()`` (which waits for its copies in flight, then unmaps) or its process
ends; its kernel stores go straight to the GPU memory, which this side cannot refuse. A write
through a peer that still holds an older export therefore still lands after ``deregister``:
in the caching allocator's block (torch keeps freed blocks for reuse: another tensor's bytes
get overwritten, silently), or, once the allocation is ``cudaFree``-d while mapped elsewhere,
into memory CUDA calls undefined behaviour. Until this backend carries revocation (its mailbox
socket would need messages from receiver to writer; it has none), the rule of the contract
holds as the caller's duty: before deregistering and freeing a region, make every peer that
connected to an export naming it close that peer, and wait for its acknowledgement or its
loss -- the control plane's ``Goodbye`` does exactly that; the nixl backend does it itself
(:mod:`transport.nixl_revoke`).

What this backend refuses (the caller falls back to NIXL)
---------------------------------------------------------
:class:`NvlinkUnsupported` for host memory, a peer on another host or in this process, and a
peer allocation that cannot be opened here (no peer access, another container, no CUDA IPC).
"""

from transport.nvlink.config import NvlinkConfig, NvlinkEngine, NvlinkUnsupported
from transport.nvlink.descriptor import parse_descriptor
from transport.nvlink.job import PreparedWrite
from transport.nvlink.kernel import KernelConfig
from transport.nvlink.mailbox import host_id
from transport.nvlink.peer import NvlinkPeer
from transport.nvlink.staged import StagedConfig
from transport.nvlink.transfer import NvlinkTransfer
from transport.nvlink.transport import NvlinkTransport

__all__ = ["KernelConfig", "NvlinkConfig", "NvlinkEngine", "NvlinkPeer", "NvlinkTransfer", "NvlinkTransport",
           "NvlinkUnsupported", "PreparedWrite", "StagedConfig", "host_id", "parse_descriptor"]
