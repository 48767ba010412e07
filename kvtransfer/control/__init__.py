"""The disaggregation control plane: wire messages, the bootstrap service, KV managers.

ZeroMQ sockets carry :mod:`kvtransfer.control.wire` frames (msgpack, one frozen dataclass per
kind, a protocol version checked on every frame). See :mod:`kvtransfer.control.bootstrap` for
the rendezvous of prefill and decode ranks.

- ``base``: the contract an engine calls (manager, sender, receiver ABCs).
- ``prefill`` / ``decode``: the two managers and their per-request handles; each keeps its
  requests (``prefill_request``, ``decode_request``: a request's own transitions) and its
  peers (``prefill_peers``, ``decode_peers``: hellos, heartbeats, goodbyes, sockets).
- ``session``: a peer's session as both sides keep it (state, silence, heartbeats), fences.
- ``state``: a request's forward-only status; ``config``: addresses and timeouts;
  ``event_loop``: a manager's one thread; ``endpoints``: transports and registered buffers;
  ``aux_records``: decode's first-token records; ``liveness``: proof a peer process ended.
"""
