"""The NIXL backend's revocation: no byte lands in memory its owner deregistered.

Why
---
A one-sided write cannot be refused by its target, and UCX's loopback transports (tcp, sm/cma)
do not check registrations there: a writer still connected with an export naming a region that
the owner deregistered and freed writes into freed memory (the owner crashes or its heap is
corrupted, while the writer sees DONE). So the owner must know
who can write into a region and make each of them stop before it lets the region go.

Protocol (messages: :mod:`~transport.revocation.wire`, over NIXL notifications)
--------------------------------------------------------------------------------
Writer = *holder* (:mod:`~transport.nixl.revoke.holder`), owner of the memory
(:mod:`~transport.nixl.revoke.owner`; its revoke loop is :mod:`transport.revocation.owner`'s,
shared with the nvlink backend):

1. ``connect(export)``: the holder sends ``Hold(seq, regions, metadata, scratch)``. The owner,
   in whatever call reads its notifications, loads the holder's metadata, records it as a
   holder of the named regions that are still live and answers ``HoldAck(seq, gone)``
   (``gone``: named regions already deregistered, which the holder treats as revoked). A
   direct write through that snapshot is posted only after its HoldAck (the first write waits
   for it, at most ``NixlConfig.revoke_timeout_s``; FAILED, naming the owner, if it does not
   come); staged writes need none: the owner scatters them itself and checks its live regions.
2. ``deregister(rid)`` on the owner: ``Revoke(seq, [rid])`` to each holder of ``rid``. The
   holder drops ``rid`` (a later write naming it raises ``RegionRevoked`` at once; a write
   already queued behind a staged one fails with the same message when its turn comes) and
   answers ``RevokeAck(seq)`` once none of its direct writes into ``rid`` is pending and no
   failed request to that owner can still run in NIXL. The owner keeps reading notifications
   (its UCX progress, so the holder's writes in flight keep landing) until every holder has
   acknowledged, released, or is lost (a 1-byte probe write into its scratch reports a
   disconnect: the process died), then deregisters. Past ``revoke_timeout_s`` with a holder
   silent: ``RevokeTimeout`` naming it, the region stays registered; ``force=True`` gives up
   on it (documented risk: it may still write). A Hold that reaches the owner while it revokes
   a region is answered with that region gone, so a writer connecting meanwhile cannot write
   into it after the deregister.
3. ``Peer.close()`` of the current snapshot (once no write to that owner is pending through
   any snapshot) and ``close()`` send ``Release``: the owner forgets the holder, and stops
   waiting for it if a revoke was on its way. A later ``connect`` holds again.
4. ``close()`` of the owner sends ``Closed`` to every holder and waits for none (closing must
   not hang on a silent peer): the holder refuses every later write to it (``RegionRevoked``)
   once it has read that. Memory that peers may still write must be deregistered before
   ``close()`` (which waits), or kept until they are gone.

What counts as *lost*: UCX reports the holder's connection closed (a probe write fails with a
disconnect), i.e. the process is gone: it posts nothing more. Not proven here: that none of
the bytes it posted just before dying can still be unpacked by this side's UCX after the
disconnect is reported (over tcp they would sit in this side's socket, read in order); a
holder that is merely stalled (SIGSTOP, a long pause) is never lost, only silent.

Messages go with ``send_notif``: once the endpoint is up it is delivered without the sender's
later progress (a write-carried notification waits for the sender to progress its flush). A
holder answers inside its calls into the transport (``write``, a transfer's ``status``/
``wait``, ``poll_notifications``, ``connect``, ``Peer.close``), an owner in the calls that read
notifications: each side must be called now and then, as a receiver must already poll.

Costs: one round trip before the first direct write after each ``connect``; a
``get_new_notifs`` per ``write`` and at most one per millisecond in ``status()``; the owner
loads each holder's metadata (a UCX endpoint back to it, also used by staged lanes).
"""

from transport.nixl.revoke.holder import Holds
from transport.nixl.revoke.owner import Holders

__all__ = ["Holds", "Holders"]
