"""Nodes and the router when things go wrong: a prefill node killed mid-request and restarted, a
rank that dies, bad command lines, a router given a dead node, clean shutdown (no process or
port left behind). Real processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvtransfer.demo import Server, stop_all
from kvtransfer.serve.http import free_port
from tests._stop import stop
from tests.kvtransfer.serve._cluster import (Cluster, chat, group_is_gone, group_members, metric, port_is_free,
                                             wait_ready, wait_until)


def _run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtransfer", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_killed_prefill_node_fails_its_request_and_a_restarted_one_serves(tmp_path):
    c = Cluster("mla-tiny", prefill_tp=1, decode_tp=1, colocated=False)
    try:
        assert chat(c.url("router"), "before").status_code == 200
        prefill = c.servers["prefill"]
        ranks = [p for p in group_members(prefill.proc.pid) if p != prefill.proc.pid]
        for pid in ranks:  # frozen: the request is in flight on both nodes when the node dies
            stop(pid)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=chat(c.url("router"), "during")))
        t.start()
        wait_until(lambda: all(metric(c.url(n), "kvtransfer_requests_in_flight") >= 1 for n in ("prefill", "decode")),
                   "the request in flight on both nodes")
        os.killpg(prefill.proc.pid, signal.SIGKILL)  # the node and its frozen ranks
        t.join(60)
        prefill.stop()
        r = result["r"]
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["message"].startswith("the prefill node is unreachable or died during the request")
        assert err["node"] == c.url("prefill") and err["code"] == "node_lost"
        assert group_is_gone(prefill.proc.pid)
        down = httpx.get(f"{c.url('router')}/health").json()
        assert down["nodes_up"]["prefill"] == 0
        assert chat(c.url("router"), "while down").status_code == 503
        c.start_prefill()  # the same ports: the router and the decode node find it again
        wait_ready([c.servers["prefill"]])
        deadline = time.monotonic() + 30
        while httpx.get(f"{c.url('router')}/health").status_code != 200:
            assert time.monotonic() < deadline, "the router did not see the restarted prefill node"
            time.sleep(0.2)
        after = chat(c.url("router"), "after", kvtransfer={"verify": True})
        assert after.status_code == 200, after.text
        assert after.json()["kvtransfer"]["verified"] is True
        decode_metrics = httpx.get(f"{c.url('decode')}/metrics").text
        assert "kvtransfer_slots_in_use 0.0" in decode_metrics  # the failed request's pages came back
    finally:
        c.stop()


def test_a_rank_that_dies_fails_requests_and_the_node_exits(tmp_path):
    port = free_port()
    node = Server("colocated node", ["serve", "--role", "colocated", "--model", "mla-tiny", "--tp", "2", "--port",
                                     str(port), "--device", "cpu"], str(tmp_path), port)
    try:
        wait_ready([node])
        ranks = [p for p in group_members(node.proc.pid) if p != node.proc.pid]
        assert len(ranks) >= 2
        rank1 = max(ranks)
        os.kill(rank1, signal.SIGKILL)
        node.proc.wait(30)
        assert node.proc.returncode == 1
        log = open(node.log_path).read()
        assert "colocated rank" in log and "died (killed by SIGKILL)" in log
        assert group_is_gone(node.proc.pid), group_members(node.proc.pid)
        assert port_is_free(node.port)
    finally:
        node.stop()


def test_start_and_sigterm_leave_no_process_or_port(tmp_path):
    port, boot = free_port(), free_port()
    node = Server("prefill node", ["serve", "--role", "prefill", "--model", "hybrid-tiny", "--tp", "2", "--port",
                                   str(port), "--bootstrap-port", str(boot), "--device", "cpu"], str(tmp_path), port)
    try:
        wait_ready([node])
        assert len(group_members(node.proc.pid)) >= 3  # the node and its two ranks
        os.killpg(node.proc.pid, signal.SIGTERM)
        assert node.proc.wait(30) == 0
        assert group_is_gone(node.proc.pid), f"left behind: {group_members(node.proc.pid)}"
        assert port_is_free(node.port) and port_is_free(int(node.flag("--bootstrap-port")))
    finally:
        node.stop()


@pytest.mark.parametrize("args, words", [
    (["--role", "decode", "--model", "llama-9000", "--port", "0"], "unknown model 'llama-9000'"),
    (["--role", "prefill", "--model", "smollm2", "--tp", "2", "--port", "0"], "TP size 2 does not divide"),
    (["--role", "colocated", "--model", "mla-tiny", "--device", "cuda", "--port", "0"], "no CUDA GPU"),
    (["--role", "colocated", "--model", "mla-tiny", "--port", "70000"], "is not a TCP port"),
    (["--role", "prefill", "--model", "mla-tiny", "--layerwise", "-2", "--port", "0"], "--layerwise must be 0"),
])
def test_bad_command_lines_are_one_line(args, words, capsys):
    from kvtransfer.serve import node

    assert node.main(args) == 2  # in this process: nothing is started before the checks
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_a_server_is_ready_only_when_its_own_process_answers(tmp_path):
    """Another process answers on the port picked for a node (as another test's server may): the
    node exits 2, moves to a fresh port, and only its own answer there counts as ready."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Impostor(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ready", "role": "colocated", "pid": 1}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    impostor = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    taken = impostor.server_address[1]
    node = Server("colocated node", ["serve", "--role", "colocated", "--model", "mla-tiny", "--device", "cpu",
                                     "--threads", "1", "--port", str(taken)], str(tmp_path), taken)
    try:
        wait_ready([node])
        assert node.port != taken and node.retries >= 1
        info = httpx.get(f"{node.url}/info", timeout=10).json()
        assert info["role"] == "colocated" and info["pid"] == node.proc.pid
    finally:
        node.stop()
        impostor.shutdown()


def test_a_port_in_use_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _run("serve", "--role", "colocated", "--model", "mla-tiny", "--port", str(port))
        assert out.returncode == 2
        assert out.stderr.strip() == f"kvtransfer serve: error: port 127.0.0.1:{port} is not free: Address already in use"
        out = _run("router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", str(port))
        assert out.returncode == 2 and "is not free" in out.stderr


def test_a_server_whose_port_is_taken_before_it_binds_moves_to_fresh_ports(tmp_path):
    """The demo, the benchmark and these tests pick free ports and hand them to new processes;
    another process may bind one first. The server then starts again on fresh ports."""
    import socket

    dead = f"http://127.0.0.1:{free_port()}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        args = ["router", "--prefill", dead, "--decode", dead, "--port", str(busy)]
        moving, staying = Server("router", args, str(tmp_path), busy), Server("fixed", args, str(tmp_path), busy,
                                                                              move_ports=False)
        try:
            deadline = time.monotonic() + 60
            while moving.port == busy:
                assert moving.starting(), moving.tail()
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert moving.retries == 1 and moving.flag("--port") == str(moving.port) != str(busy)
            assert moving.url == f"http://127.0.0.1:{moving.port}"
            while port_is_free(moving.port):  # the new process binds its new port
                assert moving.starting() and time.monotonic() < deadline, moving.tail()
                time.sleep(0.1)
            staying.proc.wait(60)
            assert not staying.starting() and staying.port == busy and "is not free" in staying.tail()
        finally:
            stop_all([moving, staying])


def test_the_router_starts_with_the_nodes_that_answer_and_adds_the_others(tmp_path):
    ports = {name: free_port() for name in ("router", "prefill", "bootstrap", "decode")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}

    def node(role: str, *extra) -> Server:
        return Server(f"{role} node", ["serve", "--role", role, "--model", "mla-tiny", "--port", str(ports[role]),
                                       "--device", "cpu", "--threads", "1", *extra], str(tmp_path), ports[role],
                      move_ports=False)

    servers = [node("decode")]
    try:
        wait_ready(servers)
        servers.append(Server("router", ["router", "--prefill", url["prefill"], "--decode", url["decode"], "--port",
                                         str(ports["router"]), "--health-interval", "0.3"], str(tmp_path),
                              ports["router"], move_ports=False))
        router = servers[-1]
        deadline = time.monotonic() + 60
        while "serving mla-tiny with decode node" not in open(router.log_path).read():
            assert router.starting() and time.monotonic() < deadline, router.tail()
            time.sleep(0.1)
        log = open(router.log_path).read()
        assert f"prefill node {url['prefill']} is not ready (ConnectError" in log
        health = httpx.get(f"{url['router']}/health")
        assert health.status_code == 503 and health.json()["nodes_up"] == {"prefill": 0, "decode": 1}
        r = chat(url["router"], "no prefill yet")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "no_node_available" and "http://" not in err["message"]
        assert list(err["nodes"]) == [url["prefill"]]

        servers.append(node("prefill", "--bootstrap-port", str(ports["bootstrap"])))
        wait_ready([servers[-1]])
        while httpx.get(f"{url['router']}/health").status_code != 200:
            assert time.monotonic() < deadline + 120, "the router did not add the prefill node"
            time.sleep(0.2)
        r = chat(url["router"], "now both", kvtransfer={"verify": True})
        assert r.status_code == 200 and r.json()["kvtransfer"]["verified"] is True, r.text

        wrong = _run("router", "--prefill", url["decode"], "--decode", url["decode"], "--port", str(free_port()))
        assert wrong.returncode == 2
        assert wrong.stderr.strip().splitlines()[-1] == (f"kvtransfer router: error: {url['decode']} is a decode node, "
                                                        f"given as --prefill")
    finally:
        stop_all(servers)
    out = _run("router", "--prefill", "localhost:1", "--decode", "http://x", "--port", str(free_port()))
    assert out.returncode == 2 and "must start with http://" in out.stderr
