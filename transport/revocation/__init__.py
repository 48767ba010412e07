"""Revocation, common to the backends: no byte of a writer lands in memory its owner deregistered.

The rule (:mod:`transport.base`, "Deregistering written-to memory"): a one-sided write cannot be
refused by its target, so deregistering a region that a connected peer can still address
first revokes it from that peer and waits for its acknowledgement or its loss; a peer that
does neither within the backend's ``revoke_timeout_s`` keeps the region registered
(:class:`~transport.base.RevokeTimeout`) unless the owner forces it.

Pieces every backend shares (each backend carries the messages its own way and says when its
sides answer):

- :mod:`~transport.revocation.wire`: the messages (holds, their acknowledgements, revokes and
  theirs);
- :mod:`~transport.revocation.owner`: who holds this transport's export and the revoke loop
  (wait for each holder's acknowledgement or loss, ``RevokeTimeout``, ``force``, silent holders);
- :mod:`~transport.revocation.holder`: the writer's revoked regions of one owner and the check
  a write makes against them (``RegionRevoked``'s message).

Backends: :mod:`transport.nixl.revoke` (over NIXL notifications) and :mod:`transport.nvlink.revoke`
(over the nvlink backend's mailbox connections).
"""

from transport.revocation.holder import Revoked
from transport.revocation.owner import Holder, Holders

__all__ = ["Holder", "Holders", "Revoked"]
