"""Control-plane frames: round trips, and every way a frame can be untrustworthy."""

from __future__ import annotations

import msgpack
import pytest

from kvtransfer.control import wire
from kvtransfer.control.wire import GetTopology, Ping, Registered, Topology, WireError, decode
from tests.kvtransfer.control._support import endpoint, register


def frame(kind, body, v=wire.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": v, "kind": kind, "body": body}, use_bin_type=True)


@pytest.mark.parametrize("msg", [register(), Registered(error=""), GetTopology(dp_rank=3), Ping(nonce=7),
                                 Topology(dp_rank=0, tp_size=2, ranks=[register().to_msgpack()])])
def test_round_trip(msg):
    back = decode(msg.to_msgpack())
    assert back == msg and type(back) is type(msg)
    assert type(msg).from_msgpack(msg.to_msgpack()) == msg


def test_topology_decodes_its_registrations():
    topo = decode(Topology(dp_rank=0, tp_size=2, ranks=[register(tp_rank=0).to_msgpack()]).to_msgpack())
    assert [r.tp_rank for r in topo.rank_infos()] == [0] and not topo.complete
    with pytest.raises(WireError, match="frame must be bytes, got int"):
        Topology(dp_rank=0, tp_size=1, ranks=[5]).rank_infos()


@pytest.mark.parametrize("data, match", [
    (b"\xc1", "not valid msgpack"),
    (register().to_msgpack()[:-3], "not valid msgpack"),
    (msgpack.packb([1, 2]), "must be a map with keys"),
    (frame("ping", {"nonce": 1}, v=wire.PROTOCOL_VERSION - 1),
     f"protocol version {wire.PROTOCOL_VERSION - 1}, this side speaks {wire.PROTOCOL_VERSION}"),
    (frame("launch_missiles", {}), "unknown message kind 'launch_missiles'"),
    (frame("ping", {}), r"missing \['nonce'\]"),
    (frame("ping", {"nonce": 1, "extra": 2}), r"unexpected \['extra'\]"),
    (frame("ping", {"nonce": "1"}), "ping.nonce must be int, got str"),
    (frame("ping", {"nonce": True}), "ping.nonce must be int, got bool"),
    (frame("ping", [1]), "ping body must be a map"),
    (frame("register_prefill", {**register().__dict__, "tp_rank": 2}), "need 0 <= tp_rank < tp_size"),
    ("text", "must be bytes, got str"),
])
def test_untrustworthy_frames_raise_wire_error(data, match):
    with pytest.raises(WireError, match=match):
        decode(data)


def test_oversized_frames_are_refused_before_parsing(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 64)
    with pytest.raises(WireError, match="exceeds the limit of 64"):
        decode(register().to_msgpack())


def test_from_msgpack_checks_the_kind():
    with pytest.raises(WireError, match="expected a pong message, got ping"):
        wire.Pong.from_msgpack(Ping(nonce=1).to_msgpack())


def test_constructing_a_bad_message_fails_here_not_at_the_peer():
    with pytest.raises(WireError, match="get_topology.dp_rank must be int, got float"):
        GetTopology(dp_rank=1.5)


def test_decode_prefill_messages_round_trip():
    from kvtransfer.control.wire import (AbortRequest, DecodeHello, Heartbeat, HelloAck, KVArrived, NotConnected,
                                         Quiesced, TransferRequest)

    msgs = [DecodeHello(instance="decode-a", dp_rank=0, tp_rank=0, tp_size=1, host="h",
                        endpoints=[endpoint(name="d0"), endpoint("nvlink", "d0-nvlink")], layout=b"l", incarnation="i",
                        process={"boot": "b", "pid_ns": 4026531836, "pid": 7, "started": 12}),
            HelloAck(error="layouts differ in dtype: this side 'bfloat16', peer 'float16'", incarnation="p", process={},
                     backend=""),
            TransferRequest(request_id="r", instance="decode-a", decode_tp_rank=0, dst_slots=b"\x01" + bytes(7),
                            prefix_tokens=0, state_slot=-1),
            KVArrived(request_id="r", part="kv", seq=0, total=1, aux=b"\x07" * 16), AbortRequest(request_id="r", reason="client"),
            Quiesced(request_id="r"),
            Heartbeat(seq=1, incarnation="p"),
            NotConnected(incarnation="p", reason="decode rank ('decode-a', 0) lost: no heartbeat for 5 s")]
    for msg in msgs:
        assert decode(msg.to_msgpack()) == msg


@pytest.mark.parametrize("endpoints, match", [
    ([], "no endpoint"),
    ([{"backend": "nixl"}], "an endpoint must be a map with keys"),
    ([{"backend": "nixl", "name": 3, "export": b"", "regions": {}}], "endpoint.name must be str, got int"),
    (["x"], "an endpoint must be a map"),
])
def test_bad_endpoints_are_refused(endpoints, match):
    with pytest.raises(WireError, match=match):
        decode(frame("register_prefill", {**register().__dict__, "endpoints": endpoints}))


def test_a_backend_listed_twice_is_refused():
    with pytest.raises(WireError, match="backend 'nixl' listed twice"):
        register(endpoints=[endpoint(), endpoint(name="other")])


@pytest.mark.parametrize("process, match", [
    ({"boot": "b", "pid": 7, "started": 12}, r"process id needs the fields \['boot', 'pid', 'pid_ns', 'started'\]"),
    ({"boot": "b", "pid_ns": 1, "pid": "7", "started": 12}, "process id field 'pid' must be int"),
    ({"boot": "b", "pid_ns": 1, "pid": True, "started": 12}, "process id field 'pid' must be int"),
    ({"boot": "b", "pid_ns": 1, "pid": 0, "started": 12}, "pid 0 / started 12 out of range"),
    ([1], "hello_ack.process must be dict, got list"),
])
def test_a_malformed_process_id_in_a_hello_answer_is_refused(process, match):
    with pytest.raises(WireError, match=match):
        decode(frame("hello_ack", {"error": "", "incarnation": "p", "process": process, "backend": "nixl"}))
