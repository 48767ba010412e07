"""Byte-range transport between registered memory regions of two processes.

Knows nothing of KV, layers or heads; imports neither ``pools`` nor ``kvtransfer``.
"""

from transport.base import (
    PeerDescriptorError,
    Region,
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

__all__ = [
    "PeerDescriptorError",
    "Region",
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
