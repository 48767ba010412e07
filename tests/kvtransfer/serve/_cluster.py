"""Real nodes and a router as separate processes for the serving tests (the demo's Server)."""

from __future__ import annotations

import socket
import tempfile
import time
from typing import Dict, List, Optional

import httpx

from kvtransfer._procs import group_members
from kvtransfer.demo import Server, stop_all, threads_per_rank
from kvtransfer.serve.http import free_port

READY_TIMEOUT_S = 240.0


def wait_ready(servers: List[Server], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            assert s.starting(), f"{s.name} exited with {s.proc.returncode}: {s.tail(8)}"
            try:
                health = httpx.get(f"{s.url}/health", timeout=2.0)
                if s.answered(health.status_code, httpx.get(f"{s.url}/info", timeout=2.0).json()):
                    pending.remove(s)
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, f"not ready in {timeout_s} s: {[s.name for s in pending]}"
        time.sleep(0.2)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def group_is_gone(pgid: int, wait_s: float = 10.0) -> bool:
    """No live process of the process group ``pgid`` is left (waiting up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class Cluster:
    """A prefill node, a decode node, a router and (optionally) a colocated node."""

    def __init__(self, model: str = "mla-tiny", prefill_tp: int = 1, decode_tp: int = 1, pages=(16, 64),
                 colocated: bool = True, node_args=(), router_args=()):
        self.logdir = tempfile.mkdtemp(prefix="kvt-serve-test-")
        self.model, self.prefill_tp, self.pages = model, prefill_tp, pages
        # every rank an equal share of the cores, as the demo gives them (threads_per_rank)
        self.node_args = ["--threads", str(threads_per_rank(prefill_tp + decode_tp + int(colocated))), *node_args]
        # picked here; a server whose port is taken before it binds moves to fresh ones (Server.starting)
        self.ports: Dict[str, int] = {k: free_port() for k in ("router", "prefill", "decode", "colocated", "bootstrap")}
        self.servers: Dict[str, Server] = {}
        try:
            self.start_prefill()
            self.servers["decode"] = self._node("decode", decode_tp, pages[1])
            if colocated:
                self.servers["colocated"] = self._node("colocated", 1, 16)
            wait_ready(list(self.servers.values()))
            self.ports.update({name: s.port for name, s in self.servers.items()},
                              bootstrap=int(self.servers["prefill"].flag("--bootstrap-port")))
            self.servers["router"] = Server("router", ["router", "--prefill", self.url("prefill"), "--decode",
                                                       self.url("decode"), "--port", str(self.ports["router"]),
                                                       "--health-interval", "0.3", *router_args],
                                            self.logdir, self.ports["router"])
            wait_ready([self.servers["router"]])
            self.ports["router"] = self.servers["router"].port
        except BaseException:  # a cluster that did not come up leaves nothing running
            self.stop()
            raise

    def _node(self, role: str, tp: int, page: int, extra=(), move_ports: bool = True) -> Server:
        return Server(f"{role} node", ["serve", "--role", role, "--model", self.model, "--tp", str(tp), "--page-size",
                                       str(page), "--port", str(self.ports[role]), "--device", "cpu",
                                       *self.node_args, *extra], self.logdir, self.ports[role], move_ports)

    def start_prefill(self) -> Server:
        """The prefill node; started again after the cluster is up, it keeps its ports (the router
        and the decode node know it by them)."""
        s = self.servers["prefill"] = self._node("prefill", self.prefill_tp, self.pages[0],
                                                 ("--bootstrap-port", str(self.ports["bootstrap"])),
                                                 move_ports="router" not in self.servers)
        return s

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def stop(self) -> None:
        stop_all(self.servers.values())


def chat(url: str, content: str, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120.0)


def sse_events(resp_lines) -> List[Optional[dict]]:
    """The parsed ``data:`` events of a stream; ``None`` for ``[DONE]``."""
    import json

    out = []
    for line in resp_lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(None if data == "[DONE]" else json.loads(data))
    return out


def metric(url: str, name: str, **labels) -> float:
    """The value of the sample ``name`` (with ``labels``) in a server's ``/metrics``; 0 if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition()`` until it is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not so after {timeout_s} s: {what}"
        time.sleep(0.05)


def idle(url: str) -> bool:
    """A node holds no slot and runs or queues no request (its gauges, from its ranks' reports)."""
    return all(metric(url, name) == 0 for name in ("kvtransfer_slots_in_use", "kvtransfer_requests_running",
                                                    "kvtransfer_requests_waiting"))


def ranks_of(server: Server) -> List[int]:
    return [p for p in group_members(server.proc.pid) if p != server.proc.pid]
