"""Prometheus metrics of a node and of the router (``GET /metrics``, through prometheus_client).

Each server keeps its own registry, so several can live in one process (tests) and the
text holds only what the server measures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "NodeMetrics", "RouterMetrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# aborted: the client went away; busy: refused at once, the node's queue full (503, Retry-After)
OUTCOMES = ("ok", "client_error", "busy", "failed", "aborted")


class NodeMetrics:
    """What a node counts: requests by outcome, tokens, KV moved, latencies, its pools."""

    def __init__(self, role: str, model: str):
        r = self.registry = CollectorRegistry()
        Gauge("kvtransfer_node_info", "The node's role and model (value 1)", ["role", "model"],
              registry=r).labels(role, model).set(1)
        self.requests = Counter("kvtransfer_requests", "Requests that ended, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("kvtransfer_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generated_tokens = Counter("kvtransfer_generated_tokens", "Tokens generated here", registry=r)
        self.kv_bytes = Counter("kvtransfer_kv_bytes", "KV and state bytes received (decode nodes)", registry=r)
        self.transfer_seconds = Histogram("kvtransfer_transfer_seconds", "KV transfer time per request (prefill: "
                                          "handed over -> landed; decode: asked -> all landed)",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("kvtransfer_queue_seconds", "Arrival until the request holds its pages "
                                       "(decode: reserved; prefill: admitted, after decode's reservation; "
                                       "colocated: admitted)", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("kvtransfer_time_to_first_token_seconds", "Arrival until the first token",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.slots_in_use = Gauge("kvtransfer_slots_in_use", "KV token slots held by requests", registry=r)
        self.slots_total = Gauge("kvtransfer_slots_total", "KV token slots of the pool", registry=r)
        self.running = Gauge("kvtransfer_requests_running", "Requests in the engine", registry=r)
        self.waiting = Gauge("kvtransfer_requests_waiting", "Requests waiting for pages or KV", registry=r)
        self.in_flight = Gauge("kvtransfer_requests_in_flight", "Requests the HTTP process is answering",
                               registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class RouterMetrics:
    """What the router counts: requests by outcome and node, latency, KV moved."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvtransfer_router_requests", "Requests that ended, by outcome", ["outcome"],
                                registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.routed = Counter("kvtransfer_router_routed", "Requests sent to each node", ["node"], registry=r)
        self.kv_bytes = Counter("kvtransfer_router_kv_bytes", "KV and state bytes the routed requests moved",
                                registry=r)
        self.request_seconds = Histogram("kvtransfer_router_request_seconds", "Arrival until the last byte",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_seconds = Histogram("kvtransfer_router_transfer_seconds",
                                          "KV transfer time: prefill handed the KV over -> every write landed",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.nodes_up = Gauge("kvtransfer_router_nodes_up", "Nodes answering, by role", ["role"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
