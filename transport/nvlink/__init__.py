"""The ``nvlink`` backend: GPU-to-GPU writes between two processes of one host, over CUDA IPC
mappings and a Triton copy kernel that stores straight into the peer's memory.

Modules
-------
- :mod:`~transport.nvlink.transport`: :class:`NvlinkTransport` (regions, export, connect,
  notifications, deregister) and :class:`NvlinkPeer` (one connected peer: where a write's steps
  are called in order).
- :mod:`~transport.nvlink.config`: :class:`NvlinkConfig`, :class:`NvlinkEngine`.
- :mod:`~transport.nvlink.ipc`: mapping and IPC -- handles exported and opened, a peer's
  regions mapped here (``PeerMapping``), the export's format.
- :mod:`~transport.nvlink.kernel`: the Triton kernels and the layouts of their tables;
  :mod:`~transport.nvlink.launch`: their launch bound once (Triton's launcher, or ``cuLaunchKernel``
  from C).
- :mod:`~transport.nvlink.prepare`: a write's host side before it is posted (engine, tables,
  :class:`PreparedWrite`).
- :mod:`~transport.nvlink.direct`: the copy stream, and ``write_strided``'s direct path (pair
  plans resident on the GPU, slots from a ring).
- :mod:`~transport.nvlink.staged`: the staged engine (gather, copy engine, scatter on the peer's GPU).
- :mod:`~transport.nvlink.native` (``native.c``, ``lander.c``): the direct path's host steps and
  the landed word's thread in C, built at first use.
- :mod:`~transport.nvlink.mailbox`: notification, one Unix socket per transport;
  :mod:`~transport.nvlink.landed`: the landed word that releases a notification, and the thread
  of C (``lander.c``) that stores it; :mod:`~transport.nvlink.completion`: transfers, their FIFO
  and the progress thread.
- :mod:`~transport.nvlink.revoke`: revocation over the mailbox (``deregister`` of exported memory).

One write, followed through (``peer.write_strided(batch, notify)``, the direct path)
-----------------------------------------------------------------------------------
1. ``transport.NvlinkPeer.write_strided``: the notification checked, the engine chosen, then
   ``_write_direct``.
2. ``direct.SlotRing.fits`` and ``direct.PairCache.get``: the pair set's plan, resident on the
   GPU since its first write (a miss builds it: ``direct.build_plan``). For the staged engine,
   ``prepare.EngineRoute.lane_for`` and the staged plan's chunk cuts.
3. ``revoke.Hold``: the peer's answer to the Hello awaited once, then under the hold's lock
   ``Hold.refuse`` (a revoked destination region raises ``RegionRevoked``).
4. ``direct.SlotRing.reuse`` or ``SlotRing.stage``: the slots into the pinned ring, bounds
   checked in the same pass; ``mailbox.Outbox.alive``.
5. ``direct.CopyStream.enqueue_split``: slots uploaded, the copy stream ordered after the
   caller's stream, one launch (``kernel.SplitLaunch``, or ``native`` from C), an event recorded.
6. ``completion.PendingQueue.track``: the :class:`NvlinkTransfer` queued; ``_posted`` makes the
   first look (``PendingQueue.advance`` -> ``mailbox.Outbox.announce``: the notification sent
   while the copy runs, and handed to ``landed.Lander.watch``; a copy already ended is landed at
   once) and wakes ``completion.Progress``.
7. After the copy: the landers' thread of C (or, without the C steps, ``PendingQueue.advance``
   on the progress thread, through ``Outbox.settle``) stores the landed word; the receiver's
   ``poll_notifications`` (``mailbox.Inbox``) hands the notification out;
   ``PendingQueue.advance`` marks the transfer DONE.

``write`` and ``write_strided`` past the ring take the general path instead of steps 2-5:
``prepare.build`` (the table in pinned memory, the launch planned), then
``direct.CopyStream.upload`` and ``enqueue``. ``peer.prepare(batch)`` returns that
:class:`PreparedWrite` to post many times.

What this backend refuses (the caller falls back to NIXL): :class:`NvlinkUnsupported` for host
memory, a peer on another host or in this process, and a peer allocation that cannot be opened
here (no peer access, another container, no CUDA IPC).
"""

from transport.nvlink.completion import NvlinkTransfer
from transport.nvlink.config import NvlinkConfig, NvlinkEngine
from transport.nvlink.ipc import NvlinkUnsupported, parse_descriptor
from transport.nvlink.kernel import KernelConfig
from transport.nvlink.mailbox import host_id
from transport.nvlink.prepare import PreparedWrite
from transport.nvlink.staged import StagedConfig
from transport.nvlink.transport import NvlinkPeer, NvlinkTransport

__all__ = ["KernelConfig", "NvlinkConfig", "NvlinkEngine", "NvlinkPeer", "NvlinkTransfer", "NvlinkTransport",
           "NvlinkUnsupported", "PreparedWrite", "StagedConfig", "host_id", "parse_descriptor"]
