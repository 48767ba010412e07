"""The ``nixl`` backend: UCX one-sided writes through NVIDIA NIXL.

One :class:`NixlTransport` owns one NIXL agent (one UCX context). Host regions register as
NIXL ``DRAM``, CUDA regions as ``VRAM`` with their device ordinal. ``export()`` is the common
envelope of :func:`transport.base.pack_descriptor` with three extra fields::

    {"backend": "nixl", "version": 1,
     "regions": [[id, ptr, length, device], ...],   # device -1: host
     "agent": "<agent name>",                       # NIXL agent name, unique per process
     "scratch": <address>,                          # 64 host bytes for notification-only writes
     "metadata": b"..."}                            # nixl_agent.get_agent_metadata()

Modules
-------
- :mod:`~transport.nixl.transport`: :class:`NixlTransport`, the contract (regions, export,
  connect, notifications, close);
- :mod:`~transport.nixl.peer`: :class:`NixlPeer`, where a write is checked and routed;
- :mod:`~transport.nixl.transfer`: :class:`NixlTransfer`, one direct request's progress;
- :mod:`~transport.nixl.agent`: the only caller of ``nixl_agent``;
- :mod:`~transport.nixl.core`: the parts of one transport and the notification pump, the
  interface through which the parts reach each other;
- :mod:`~transport.nixl.remotes`, :mod:`~transport.nixl.regions`, :mod:`~transport.nixl.prepped`:
  what is known of each remote agent, descriptor tables, prepared descriptor lists;
- :mod:`~transport.nixl.staged` (many small ranges as a few large writes) and
  :mod:`~transport.nixl.revoke` (no byte lands in memory its owner deregistered).

A write
-------
``NixlPeer.write`` checks the batch (bounds against both region tables, revoked regions, a lost
agent) and routes it. A direct write is ONE NIXL transfer request: the batch's five parallel
arrays become two ``[n, 3]`` uint64 descriptor arrays ``(address, length, device)`` built from
numpy (``RegionTable.descs``) and handed to ``initialize_xfer``, or block indices into
prepared lists (below); ``Agent.post`` posts it and :class:`NixlTransfer` follows it. The
notification rides on that request, and NIXL's UCX backend sends it only after the request's
data is flushed to the target, so a delivered notification means its bytes have landed.

Staged writes (:mod:`transport.nixl.staged`, ``NixlConfig.staged``): a batch of many small
ranges (``StagedNixlConfig.wants``) is gathered into a registered staging lane and written as
one NIXL write per slot; the receiver scatters it in ``poll_notifications()`` before it hands
the write's notification over. ``NixlPeer.write_strided`` stages a factored batch
(``StridedBatch``, P buffer pairs x S slots) the same way with O(P + S) host work per write
(``StagedNixlConfig.wants_strided``), else writes its coalesced form; with the staged mode on
the peer takes a large plan's factored form (``takes_strided``). Every other batch is the one
request described above.

Descriptor strategy: a direct write whose offsets and lengths share a power-of-two granule,
within ``prepped.MAX_INDICES`` blocks of it, is made from block indices into strided lists
prepared once per (memory kind, granule) -- one for this agent's regions, one per peer snapshot
(``prep_xfer_dlist`` / ``make_prepped_xfer``; :mod:`transport.nixl.prepped`, with when each
list is released); NIXL merges consecutive blocks back into one descriptor. Any other batch
(large writes of many blocks) is the two descriptor arrays and ``initialize_xfer``: for those
the lists save nothing measurable.

Progress
--------
NIXL's progress thread is off by default (``NixlConfig(progress_thread=True)`` turns it on):
on a host with few cores it competes with the pollers for a core. With sm in UCX_TLS, one
host's writes go through cma and finish inside the post. Without the thread, progress happens
inside calls into the transport: the writer's ``Transfer.status()``/``wait()`` and the
receiver's ``poll_notifications()``. Over tcp the receiver must poll regularly (a write
finishes no sooner than the receiver's next poll); turn the thread on for a receiver that does
not poll.

Notifications: ``poll_notifications()`` returns a :class:`~transport.base.Notification` per
payload, its ``sender`` the writing agent's name (the ``agent`` of its export, its
``NixlTransport.name``); each sender's in arrival order, different senders' not ordered
against each other.

Connecting again
----------------
Connecting to a newer export of an already connected agent reloads its metadata in place: the
old :class:`NixlPeer` refuses new writes (TransportClosed) but its pending writes complete.
Deregister a region only once no pending transfer uses it. In place means added to: NIXL keeps
an entry for every region of the agent it was ever given and looks a range up in the entry at
or just before its address, so once the agent deregistered a region that overlaps one its newer
export names (its memory reused, or the same range registered again), that entry could refuse
writes into the new region (``NIXL_ERR_NOT_FOUND``) or resolve them to the old registration.
The entries of an agent are what its exports named and what the metadata of its staged Hello or
Welcome registered (its regions then and its lanes' staging memory, listed in the message:
``wire.registered_entries``). Such an export is loaded afresh instead
(:func:`~transport.nixl.regions.stale_overlap`): the agent's metadata, its staged lane and its
endpoint are dropped first -- refused with ``PeerDraining`` while a write of this transport to
it is in flight -- and one more endpoint is opened (see Connections).

Revocation (:mod:`transport.nixl.revoke`): ``connect`` tells the owner of the export that this
transport holds it (a direct write waits for the owner's acknowledgement), and ``deregister``
revokes a region from every holder that can address it, waiting for their acknowledgement or
their loss (at most ``NixlConfig.revoke_timeout_s``) before it releases it; a later write to a
revoked region raises ``RegionRevoked``. Protocol and timeouts: that package's docstring.

Connections
-----------
``NixlPeer.close()`` refuses further writes through that peer but keeps the remote agent loaded
in NIXL, idle, and a later ``connect`` to the same agent reuses its endpoint. NIXL cannot
release a live peer's endpoint: ``remove_remote_agent`` (``invalidateRemoteMD``) drops NIXL's
connection, but over tcp each side's UCP worker keeps the endpoint the wire-up created, so the
socket stays open on both sides (one more open socket per connect/remove cycle in the writer
and in the receiver) until a worker is destroyed (``NixlTransport.close``) or the other process
exits. So connections are bounded by the distinct live agents a transport has connected to; an
agent whose transfer failed in the backend (peer lost) is removed from NIXL when its peer closes.

Aborts and failures
-------------------
The contract's "late bytes": releasing an active NIXL request does not stop bytes UCX already
has (over tcp, megabytes of an aborted write can land after the release returned, once a
stopped receiver runs again). So ``abort()`` polls the request until NIXL no longer reports it
in progress, then releases it; a request that fails at its deadline is kept (not released) in
a per-agent drain list and the agent is marked lost (``NixlPeer.lost`` says why): writes to it
fail at once, and ``connect`` to it refuses (``PeerDraining``) until the drain list is empty,
then tears the old endpoint down and loads the agent afresh.

Peer loss: when the peer process dies, UCX reports ``NIXL_ERR_REMOTE_DISCONNECT`` from the
status check. A peer that is alive but stalled (SIGSTOP) leaves the request pending forever, so
each transfer carries its own deadline, ``peer_loss_timeout_s + nbytes / min_throughput``: past
it, ``status()`` releases the request (cancelling it) and reports FAILED. A request NIXL
reports failed without raising (the state "ERR"), or whose post raised once the request was
made (the UCX backend posts a request's ranges batch by batch: those before the failing one are
on the wire), loses the agent the same way; a request NIXL refuses to make loses nothing.
"""

from transport.nixl.config import NixlConfig, StagedNixlConfig
from transport.nixl.peer import NixlPeer
from transport.nixl.transfer import NixlTransfer
from transport.nixl.transport import NixlTransport

__all__ = ["NixlConfig", "NixlPeer", "NixlTransfer", "NixlTransport", "StagedNixlConfig"]
