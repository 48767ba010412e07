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
  makes a pair set resident ahead of its first write (at handshake). Its host steps -- slots
  staged and checked, upload and order, launch -- run in C where the machine can build it
  (:mod:`~transport.nvlink.native`, ``NvlinkConfig.native``), and the call announces the
  write's notification before it returns.
- The staged engine (:mod:`~transport.nvlink.staged`) packs rows on the local GPU, moves the
  packed bytes with the copy engine and unpacks them with a kernel this process launches on
  the peer GPU; ``NvlinkEngine.AUTO`` takes it for batches of 2 GiB and more whose rows
  average 1 KiB or more (``StagedConfig``; figures in bench/RESULTS.md). Its strided writes
  take the direct path as well: the pairs' staged form resident on both GPUs, a write's slots
  uploaded to a ring on each, the pipeline enqueued over them.

Notification channel (the "mailbox", :mod:`~transport.nvlink.mailbox`)
---------------------------------------------------------------------
Each transport listens on a Unix stream socket in Linux's abstract namespace (named in its
export; nothing on disk) and each peer (each ``connect``) keeps one connected socket to it,
opened by the writer's Hello (its name, the region ids of the export it holds, and the fd of
its *landed word*, a 64-bit counter in memory both processes map). A notification is one frame
the WRITER sends while the copy runs (the socket hop, 12-20 us, overlaps the copy); the
receiver holds it until the writer has raised the landed word to its number, which it does
only after the transfer's CUDA event has completed, i.e. after the kernel's stores to the
peer's memory are done (one store: the receiver's next poll sees it). The receiver's
``poll_notifications`` reads whole frames without blocking and returns each landed one as a
:class:`~transport.base.Notification` from that writer; a failed write's notification is
withdrawn (``Dropped``) and never returned, and a connection that ends drops what it holds.
The receiver writes back on the same socket only for revocation (below); the writing
transport's mailbox thread reads it, and notes the end of the connection: a dead or closed
receiver, whose writes then fail at once.

Progress and bounded waits
--------------------------
``Transfer.status()`` and a progress thread (:mod:`~transport.nvlink.progress`, one per
transport, started on the first write) advance each peer's FIFO of pending transfers
(:mod:`~transport.nvlink.pending`): send the new writes' notifications (bounded by
``peer_timeout_s``; a peer gone refuses them); query the event; on completion raise the landed
word past its notification or, without one, check the peer is alive, and mark DONE. Between
advances the thread waits on the oldest pending event (``synchronize()``, the GIL released);
``wait()`` sleeps until the transfer settles. Where the C steps load
(:mod:`~transport.nvlink.native`), the landed word is not the progress thread's: one thread of C
per process (:mod:`~transport.nvlink.lander`, shared by every peer) waits on each
notification's event and stores its number without the GIL, so a caller that holds the GIL after a write does not hold its
notification. A dead peer is FAILED at ``write`` (nothing is launched) or at completion;
a copy whose event has not completed after ``transfer_timeout_s`` is FAILED. ``abort`` marks a
pending transfer FAILED and withdraws its notification (one the lander released already is
DONE: its bytes landed); the kernel, once launched, still runs
to completion, and a failed transfer keeps its tables until its copy ends.

Deregistering exported memory (revocation)
------------------------------------------
A peer that connected to an export opened the CUDA IPC handle of each region's allocation; its
kernel stores go straight to that GPU memory, which this side cannot refuse: after a plain
``cudaFree`` or a reuse of the caching allocator's block they would land in memory CUDA calls
undefined, or in another tensor. So ``deregister`` first revokes the region from every peer
that holds an export naming it (receiver: :mod:`~transport.nvlink.holders`, writer:
:mod:`~transport.nvlink.holds`; the revoke loop and its messages are :mod:`transport.revocation`'s,
shared with the nixl backend):

- the receiver answers each connection's Hello (in ``poll_notifications`` or ``deregister``)
  with ``HoldAck``, naming the export's regions it no longer has (deregistered, or being
  revoked right now); the peer posts no copy before that answer (its first write waits for it
  at most ``NvlinkConfig.revoke_timeout_s``, then FAILS naming the receiver) and unmaps those
  regions: a writer that connects after a ``deregister`` with an older export can never write
  the region (``RegionRevoked``);
- ``deregister(rid)`` sends ``Revoke`` on each connection that holds ``rid`` and reads the
  mailbox until each one answered ``RevokeAck`` or ended. On the writer, the transport's
  mailbox thread (one per transport, asleep in ``poll(2)`` on its connections: nothing of the
  writer's caller is needed) marks ``rid`` revoked at once -- a later write naming it raises
  ``RegionRevoked``; a write checks and posts under the hold's lock, so no copy into it starts
  after that -- waits for the completion events of the peer's copies that were in flight then
  (the pending ones and failed ones whose kernel still runs), unmaps the region and answers. A
  writer that closes the peer (which waits for its copies, unmaps, then ends the connection) or
  whose process dies ends its connection and is no longer waited for;
- a writer that neither answers nor ends within ``revoke_timeout_s`` (its process stopped or
  hung) is silent: ``deregister`` raises ``RevokeTimeout`` naming it and the region stays
  registered (keep the memory; deregister again later); ``deregister(rid, force=True)``
  releases it anyway, accepting that the silent writer may still write into it. A silent
  writer is not waited for again until it answers anything (as in NIXL);
- ``close()`` ends every connection and waits for nobody: deregister the memory that peers may
  still write before ``close()``, or keep it alive until they are gone.

Costs: a round trip (until the receiver's next poll) before the first write of each
``connect``; per write, a lock and a truth test (an ``np.isin`` over the batch's destination
regions once that peer has revoked some region): no system call; the mailbox thread sleeps in
``poll(2)`` unless a revoke waits for copies, then looks every millisecond. Not proven here:
that no copy a killed writer queued can still run once the end of its connection is read (its
process's sockets and CUDA context are both torn down at exit, in an order this side cannot
see).

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
