"""What a node of each role does differently: one handler per role.

The HTTP side of every node is the same (:mod:`kvtransfer.serve.node_app`); a role says which
command a completion request becomes for its ranks, how its first answer from the ranks turns
into a reply, whether it runs the bootstrap service, and how it takes a ``/kvtransfer/connect``:

- prefill: the ranks compute the prompt and send its KV; the reply (JSON, never streamed) comes
  once the KV has landed and carries the first token and the transfer's figures. It runs the
  bootstrap service its ranks register with, and names it in ``/info``.
- decode: the ranks reserve pages, ask the prefill node named in the pairing for the KV, then
  generate; the first event says the KV arrived (its figures ride on the reply's last chunk).
  ``/kvtransfer/connect`` connects its ranks to a prefill node ahead of its first request.
- colocated: the ranks compute the prompt and generate, as one engine.
"""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

__all__ = ["ColocatedRole", "DecodeRole", "NodeRole", "PrefillRole", "role_of"]


def error(message: str, status: int, headers: Optional[dict] = None, **fields) -> JSONResponse:
    """An OpenAI-shaped error reply."""
    from kvtransfer.serve.openai_api import error_body

    return JSONResponse(error_body(message, status, **fields), status_code=status, headers=headers)


class NodeRole:
    """A node role (module docstring); subclasses say what differs."""

    name = ""
    runs_bootstrap = False  # the node runs the bootstrap service its ranks register with

    def bootstrap_address(self, spec) -> Optional[str]:
        """The bootstrap service ``/info`` names (a prefill node's), else None."""
        return None

    def command(self, rid: str, ids: tuple, new_tokens: int, stop_ids: frozenset, sampling, pairing):
        """The command the ranks get for one completion request."""
        raise NotImplementedError

    def first_answer(self, node, rid: str, event):
        """``(reply, event, extra)`` from the ranks' first event of a request: ``reply`` (a JSON
        body) where the request ends with it, else the token event to stream first (None if
        ``event`` was not one) and the figures that ride on the last chunk (None if none)."""
        return None, event, None

    async def connect(self, node, bootstrap: str):
        """``POST /kvtransfer/connect``: only a decode node connects to prefill nodes."""
        return error(f"a {self.name} node does not connect to prefill nodes", 400)


class PrefillRole(NodeRole):
    name = "prefill"
    runs_bootstrap = True

    def bootstrap_address(self, spec) -> Optional[str]:
        return spec.bootstrap

    def command(self, rid, ids, new_tokens, stop_ids, sampling, pairing):
        from kvtransfer.serve import messages as m

        return m.Prefill(rid, ids, sampling, pairing.verify, pairing.layerwise is not False)

    def first_answer(self, node, rid, event):
        node.metrics.transfer_seconds.observe(event.transfer_s)
        node.metrics.queue_seconds.observe(event.queue_s)
        node.finish(rid, True, "ok")
        return {"kvtransfer": {"rid": rid, "prompt_tokens": event.prompt_tokens, "first_token": event.first_token,
                               "transfer_s": event.transfer_s, "decode_wait_s": event.wait_s,
                               "queue_s": event.queue_s, "compute_s": event.compute_s, "sampled_at": event.sampled_at,
                               "posted_at": event.posted_at, "digests": event.digests}}, None, None


class DecodeRole(NodeRole):
    name = "decode"

    def command(self, rid, ids, new_tokens, stop_ids, sampling, pairing):
        from kvtransfer.serve import messages as m

        return m.Decode(rid, ids, new_tokens, stop_ids, sampling, pairing.bootstrap, pairing.verify)

    def first_answer(self, node, rid, event):
        from kvtransfer.serve import messages as m

        if not isinstance(event, m.KVReceived):
            return None, event, None
        node.metrics.transfer_seconds.observe(event.transfer_s)
        node.metrics.queue_seconds.observe(event.wait_s)
        node.metrics.kv_bytes.inc(event.kv_bytes)
        return None, None, {"rid": rid, "kv_bytes": event.kv_bytes, "kv_wait_s": event.transfer_s,
                            "queue_s": event.wait_s, "landed_at": event.landed_at, "decoding_at": event.decoding_at,
                            "digests": event.digests}

    async def connect(self, node, bootstrap: str):
        """Connect the ranks to a prefill node's ranks now, so that its first request does not
        wait for the handshakes."""
        from kvtransfer.serve import messages as m

        if node.state != "ready":
            return error(f"the decode node is {node.state}", 503)
        cmd = m.Connect(bootstrap)
        try:
            q = await node.submit(cmd.rid, cmd)
        except KeyError:
            return error(f"already connecting to {bootstrap}", 409)
        try:
            answer = await q.get()
        finally:
            node.pending.pop(cmd.rid, None)
        if isinstance(answer, m.RequestFailed) or answer.error:
            return error(getattr(answer, "error", "") or answer.reason, 502)
        return {"connected": bootstrap}


class ColocatedRole(NodeRole):
    name = "colocated"

    def command(self, rid, ids, new_tokens, stop_ids, sampling, pairing):
        from kvtransfer.serve import messages as m

        return m.Generate(rid, ids, new_tokens, stop_ids, sampling)


_ROLES = {r.name: r for r in (PrefillRole, DecodeRole, ColocatedRole)}
ROLES = tuple(_ROLES)  # the --role choices


def role_of(name: str) -> NodeRole:
    """The handler of role ``name``; ValueError naming the roles otherwise."""
    if name not in _ROLES:
        raise ValueError(f"unknown role {name!r}; expected one of {list(_ROLES)}")
    return _ROLES[name]()
