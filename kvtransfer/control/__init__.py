"""The disaggregation control plane: wire messages, the bootstrap service, KV managers.

ZeroMQ sockets carry :mod:`kvtransfer.control.wire` frames (msgpack, one frozen dataclass per
kind, a protocol version checked on every frame). See :mod:`kvtransfer.control.bootstrap` for
the rendezvous of prefill and decode ranks.
"""
