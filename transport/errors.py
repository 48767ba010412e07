"""The transport contract's exceptions (what each means: :mod:`transport.base`, "Errors")."""

__all__ = ["PeerDescriptorError", "PeerDraining", "RegionRevoked", "RevokeTimeout", "TransferFailed",
           "TransferTimeout", "TransportClosed", "TransportError"]


class TransportError(RuntimeError):
    """Base class of transport failures that are not bad arguments."""


class TransportClosed(TransportError):
    """The transport or peer was closed before the call."""


class PeerDescriptorError(ValueError):
    """The peer's export bytes cannot be used (malformed, truncated, wrong backend/version)."""


class PeerDraining(TransportError):
    """``connect`` cannot connect to that peer yet: writes of this transport to it are still
    running in the backend (the failed requests of a peer it lost, or writes that loading the
    new export would cancel). Nothing changed; connect again once they end."""


class TransferFailed(TransportError):
    """A transfer ended in ``FAILED``; the message says why."""


class TransferTimeout(TransportError, TimeoutError):
    """``Transfer.wait`` ran out of time; the transfer is still pending."""


class RegionRevoked(TransportError, ValueError):
    """A write names a region of the peer that its owner revoked (deregistered): nothing was
    written. A ``ValueError`` too, as for any region id that is not (or no longer) registered."""


class RevokeTimeout(TransportError, TimeoutError):
    """``deregister`` could not revoke a region from every peer that can write into it (one
    neither acknowledged nor is known dead): the region stays registered."""
