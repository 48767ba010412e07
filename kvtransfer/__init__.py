"""kvtransfer: disaggregated prefill/decode KV-cache and state transfer."""

__version__ = "0.1.0"
