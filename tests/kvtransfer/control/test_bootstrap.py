"""The bootstrap service over real ZeroMQ sockets: registration, topology, restarts,
refusals, malformed frames, a service that comes up late, one that never answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from kvtransfer.control.bootstrap import BootstrapClient, BootstrapError, BootstrapService, BootstrapTimeout
from kvtransfer.control.wire import Ping, Pong, RegisterPrefill, decode
from tests.kvtransfer.control._support import endpoint, register


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def service():
    with BootstrapService() as svc:
        yield svc


def test_ranks_register_and_decode_sees_the_topology(service):
    client = BootstrapClient(service.address)
    client.register(register(tp_rank=1))
    topo = client.topology(0)
    assert topo.tp_size == 2 and not topo.complete and [r.tp_rank for r in topo.rank_infos()] == [1]
    client.register(register(tp_rank=0, control_addr="tcp://127.0.0.1:5001"))
    topo = client.wait_for_topology(0, deadline_s=5)
    assert topo.complete and [r.control_addr for r in topo.rank_infos()] == ["tcp://127.0.0.1:5001",
                                                                             "tcp://127.0.0.1:5000"]
    assert client.topology(dp_rank=1).tp_size == 0
    assert client.ping().registered == 2


def test_a_restarted_rank_replaces_its_entry(service):
    client = BootstrapClient(service.address)
    client.register(register(tp_rank=0, incarnation="first", endpoints=[endpoint(name="old")]))
    client.register(register(tp_rank=0, incarnation="second", endpoints=[endpoint(name="new")]))
    (reg,) = client.topology(0).rank_infos()
    assert (reg.incarnation, reg.endpoints[0]["name"]) == ("second", "new")


def test_a_contradicting_tp_size_is_refused_naming_both(service):
    client = BootstrapClient(service.address)
    client.register(register(tp_rank=0, tp_size=2))
    with pytest.raises(BootstrapError, match=r"registers tp_size 4, the group's other ranks registered \[2\]"):
        client.register(register(tp_rank=1, tp_size=4))


def test_malformed_frames_are_dropped_and_the_service_keeps_serving(service):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.address)
    for junk in ([b"\xc1garbage"], [Ping(nonce=1).to_msgpack()[:-1]], [b"a", b"b"], [Pong(nonce=1, registered=0).to_msgpack()]):
        sock.send_multipart(junk)
    deadline = time.monotonic() + 30
    while service.dropped < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.dropped == 4
    assert not sock.poll(100)  # nothing was answered
    sock.send(Ping(nonce=9).to_msgpack())
    assert sock.poll(30000) and decode(sock.recv()) == Pong(nonce=9, registered=0)
    sock.close()


def test_registration_retries_until_a_late_service_comes_up():
    """The service comes up once the client's first try went unanswered (at its second)."""
    port = free_port()
    client = BootstrapClient(f"tcp://127.0.0.1:{port}")
    box, tries, request = {}, [], client.request

    def late_service(*args, **kwargs):
        tries.append(args[0].KIND)
        if len(tries) == 2:
            box["svc"] = BootstrapService(port=port)
        return request(*args, **kwargs)

    client.request = late_service
    try:
        client.register(register(), deadline_s=30)
        assert len(tries) >= 2 and set(tries) == {RegisterPrefill.KIND}, tries
        assert box["svc"].registrations(0)[1].endpoints[0]["name"] == "prefill-1"
    finally:
        if "svc" in box:
            box["svc"].close()


def test_no_service_times_out_within_its_bound():
    client = BootstrapClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3)
    with pytest.raises(BootstrapTimeout, match="no answer to ping"):
        client.ping()
    with pytest.raises(BootstrapTimeout, match="did not answer within 0.5 s"):
        client.register(register(), deadline_s=0.5)


def test_wait_for_topology_names_the_ranks_still_missing(service):
    client = BootstrapClient(service.address)
    client.register(register(tp_rank=1))
    with pytest.raises(BootstrapTimeout, match=r"ranks \[1\] of tp_size 2 registered after 0.3 s"):
        client.wait_for_topology(0, deadline_s=0.3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'tcp://host:port'"):
        BootstrapClient("127.0.0.1:5")
    with pytest.raises(ValueError, match="port must be in"):
        BootstrapService(port=70000)
    with BootstrapService() as svc:
        port = int(svc.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="cannot bind"):
            BootstrapService(port=port)


def test_the_command_serves_until_terminated():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtransfer", "bootstrap", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert f"serving on tcp://127.0.0.1:{port}" in proc.stdout.readline()
        client = BootstrapClient(f"tcp://127.0.0.1:{port}")
        client.register(register(), deadline_s=10)
        assert client.ping().registered == 1
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0 and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_rank_that_shuts_down_leaves_but_an_old_goodbye_spares_its_successor(service):
    client = BootstrapClient(service.address)
    client.register(register(tp_rank=0, incarnation="old"))
    client.register(register(tp_rank=0, incarnation="new"))
    client.unregister(0, 0, "old")  # the old process's late goodbye
    assert [r.incarnation for r in client.topology(0).rank_infos()] == ["new"]
    client.unregister(0, 0, "new")
    assert client.topology(0).ranks == [] and client.topology(0).tp_size == 0
    client.register(register(tp_rank=0, tp_size=4))  # a new TP size once the group is empty
