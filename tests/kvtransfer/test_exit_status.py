"""Every ``kvtransfer`` process ends with the exit status its supervisor expects: 0 at a command's
normal end, 0 for a node (every role, its rank processes too) and the router stopped by SIGTERM
after serving a request, 0 for the demo stopped by SIGTERM. An exit status of 139 (SIGSEGV in a
native library's teardown after the results were printed) fails here: on a host with libibverbs, every process with NIXL's UCX ends
that way unless :func:`transport._nixl_import._load_host_libnl_route` ran first (``./dev setup``
installs libibverbs where it can, so the suite runs as on an RDMA host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvtransfer.cli import _MODULES, _bench_names
from tests.kvtransfer.serve._cluster import Cluster, chat, group_is_gone
from tests.kvtransfer.serve._demo import started_demo, stopped_demo

# each command's short form, run here to its end
SHORT_FORMS = {
    "bench control": ["--latency-requests", "5", "--inflight", "20", "--soak", "200"],
    "bench soak": ["--model", "mla-tiny", "--requests", "6", "--concurrency", "2", "--prompt-tokens", "8:32",
                   "--output-tokens", "4:8", "--no-restart"],
    "bench plan": ["--tokens", "512", "--layers", "2", "--repeat", "2", "--flatten-repeat", "1"],
    "bench transfer": ["--quick", "--no-progress", "--out", "{tmp}"],
}
# the commands whose short form another test runs as a process and checks for exit status 0
ELSEWHERE = {
    "demo": "tests/kvtransfer/serve/test_demo.py::test_demo",
    "transfer-demo": "tests/e2e/test_transfer_demo.py::test_demo_moves_and_verifies",
    "layouts": "tests/kvtransfer/test_cli.py::test_layouts_prints_every_pool_kind",
    "generate": "tests/kvtransfer/models/test_generate_cli.py::test_tiny_hybrid_generates_with_tp2",
    "bootstrap": "tests/kvtransfer/control/test_bootstrap.py::test_the_command_serves_until_terminated",
    "bench transport": "tests/kvtransfer/test_cli.py::test_bench_transport_small",
    "bench transport --kv": "tests/kvtransfer/test_cli.py::test_bench_transport_kv_shares_the_staging_slots_on_one_host",
    "bench move_kv": "tests/kvtransfer/test_cli.py::test_bench_move_kv_cpu",
    "bench serve": "tests/kvtransfer/benchmarks/test_bench_serve.py",
    "bench nvlink": "tests/kvtransfer/test_cli.py::test_bench_nvlink_names_the_gpus_it_needs (needs two GPUs)",
    "serve": "test_nodes_and_router_exit_0_on_sigterm_after_a_request (below)",
    "router": "test_nodes_and_router_exit_0_on_sigterm_after_a_request (below)",
}


def _env() -> dict:
    return dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="tcp,self,sm", NIXL_LOG_LEVEL="WARN")


def test_every_command_has_a_short_form_run_to_exit_0_somewhere():
    commands = {"demo", "transfer-demo", "layouts", "generate", *_MODULES} | {
        f"bench {name}" for name in _bench_names() if name != "transport_kv"}  # `bench transport --kv`
    assert commands <= set(SHORT_FORMS) | set(ELSEWHERE), commands - set(SHORT_FORMS) - set(ELSEWHERE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for where in ELSEWHERE.values():
        path, _, name = where.partition("::")
        if path.startswith("tests/"):
            with open(os.path.join(root, path)) as f:
                assert not name or f"def {name.split()[0]}(" in f.read(), where


@pytest.mark.parametrize("command", sorted(SHORT_FORMS))
def test_command_short_form_exits_0(command, tmp_path):
    args = command.split() + [a.format(tmp=tmp_path) for a in SHORT_FORMS[command]]
    out = subprocess.run([sys.executable, "-m", "kvtransfer", *args], capture_output=True, text=True, timeout=300,
                         env=_env())
    assert out.returncode == 0, f"exit status {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert "ended with" not in out.stderr, out.stderr[-2000:]  # a child it stopped ended badly (_procs.Child.stop)


def test_nodes_and_router_exit_0_on_sigterm_after_a_request():
    """Prefill (two ranks), decode and colocated nodes and the router each serve a request, then
    get SIGTERM on their process group: each exits 0, its ranks ended with 0 (a node logs any
    other ending of a rank), and nothing of the group is left."""
    cluster = Cluster(model="mla-tiny", prefill_tp=2)
    try:
        for name in ("router", "colocated"):
            resp = chat(cluster.url(name), "hello", max_tokens=2)
            assert resp.status_code == 200, resp.text
    finally:
        servers = dict(cluster.servers)
        for s in servers.values():
            s.terminate()
        for s in servers.values():
            s.proc.wait(60)
        cluster.stop()
    for name, s in servers.items():  # each got SIGTERM on its process group (Server.terminate)
        assert s.proc.returncode == 0, f"{name}: exit status {s.proc.returncode}: {s.tail(12)}"
        with open(s.log_path, errors="replace") as f:
            log = f.read()
        assert "ended with" not in log and "Traceback" not in log, f"{name}: {log[-3000:]}"
        assert group_is_gone(s.proc.pid), f"{name}: processes of its group are left"


def test_demo_exits_0_on_sigterm():
    """A supervisor's SIGTERM is an orderly stop: the demo tears down every process it started,
    quietly, and exits 0 (Ctrl-C stays 130: test_demo_interrupted_leaves_nothing_behind)."""
    proc, before = started_demo("--model", "mla-tiny", "--prompts", "1")
    err = stopped_demo(proc, before, signal.SIGTERM)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {err[-2000:]}"
    assert "interrupted" not in err and "Traceback" not in err, err[-2000:]
