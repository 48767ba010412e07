"""Peers of another control protocol version: each request is answered in the receiver's own
version, so the requester fails at once naming both versions instead of waiting out its
timeout (real sockets; the prefill and decode ranks are real processes)."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from kvtransfer.control.bootstrap import BootstrapClient, BootstrapService
from kvtransfer.control.wire import PROTOCOL_VERSION, HelloAck, Registered, VersionMismatch, decode
from tests.kvtransfer.control._ranks import RankProcess, RankSpec
from tests.kvtransfer.control._support import endpoint, register

OTHER = PROTOCOL_VERSION + 1  # a newer peer


def frame(kind: str, body: dict, v: int = OTHER) -> bytes:
    return msgpack.packb({"v": v, "kind": kind, "body": body}, use_bin_type=True)


def ask(address: str, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send one frame on a fresh DEALER and return the answer (fails after ``timeout_s``)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(data)
        assert sock.poll(int(timeout_s * 1000)), f"no answer from {address} within {timeout_s} s"
        return sock.recv()
    finally:
        sock.close()


@pytest.fixture
def service():
    with BootstrapService() as svc:
        yield svc


def test_the_mismatch_names_the_senders_version_and_kind():
    with pytest.raises(VersionMismatch, match=f"protocol version {OTHER}, this side speaks {PROTOCOL_VERSION}") as got:
        decode(frame("register_prefill", {"anything": 1}))
    assert (got.value.version, got.value.kind) == (OTHER, "register_prefill")


def test_the_bootstrap_service_answers_another_version_in_its_own(service):
    answer = decode(ask(service.address, frame("register_prefill", {"tp_rank": 0})))
    assert answer == Registered(error=f"the bootstrap service speaks control protocol {PROTOCOL_VERSION}, not {OTHER}")
    assert service.dropped == 1 and BootstrapClient(service.address).ping().registered == 0  # nothing registered


def test_a_prefill_rank_refuses_a_hello_of_another_version_in_its_own(service):
    prefill = RankProcess(RankSpec("prefill", 0, 1, 16, service.address)).started()
    try:
        (reg,) = BootstrapClient(service.address).topology(0).rank_infos()
        answer = decode(ask(reg.control_addr, frame("decode_hello", {"instance": "newer"})))
        assert isinstance(answer, HelloAck) and answer.incarnation == reg.incarnation
        assert answer.error == f"this prefill rank speaks control protocol {PROTOCOL_VERSION}, not {OTHER}"
    finally:
        prefill.close()


def test_a_decode_rank_whose_hello_is_answered_in_another_version_fails_at_start_naming_it(service):
    """The prefill rank here is a socket that answers every frame in a newer version."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_in_another_version():
        while not stop.is_set():
            if router.poll(50):
                identity, _ = router.recv_multipart()
                router.send_multipart([identity, frame("hello_ack", {"error": "", "incarnation": "newer", "backend": "nixl"})])

    BootstrapClient(service.address).register(register(tp_rank=0, tp_size=1, control_addr=f"tcp://127.0.0.1:{port}",
                                                        endpoints=[endpoint(name="newer-prefill")]))
    thread = threading.Thread(target=answer_in_another_version, daemon=True)
    thread.start()
    decode_rank = RankProcess(RankSpec("decode", 0, 1, 4, service.address, instance="decode-a",
                                       config={"handshake_timeout_s": 60.0}))
    try:
        with pytest.raises(RuntimeError, match=rf"prefill rank 0 refused decode rank 0: it speaks control protocol "
                                               rf"{OTHER}, this rank {PROTOCOL_VERSION}"):
            decode_rank.started()
    finally:
        decode_rank.close()
        stop.set()
        thread.join(5)
        router.close()
