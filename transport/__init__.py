"""Byte-range transport between registered memory regions of two processes.

Knows nothing of KV, layers or heads; imports neither ``pools`` nor ``kvtransfer``.
"""

from transport.base import (
    Notification,
    PeerDescriptorError,
    PeerDraining,
    Region,
    RegionRevoked,
    RevokeTimeout,
    Transfer,
    TransferFailed,
    TransferStatus,
    TransferTimeout,
    Transport,
    TransportClosed,
    TransportError,
    StridedBatch,
    WriteBatch,
)
from transport.registry import RegionRegistry

__all__ = [
    "Notification",
    "PeerDescriptorError",
    "PeerDraining",
    "Region",
    "RegionRegistry",
    "RegionRevoked",
    "RevokeTimeout",
    "StridedBatch",
    "Transfer",
    "TransferFailed",
    "TransferStatus",
    "TransferTimeout",
    "Transport",
    "TransportClosed",
    "TransportError",
    "WriteBatch",
]
