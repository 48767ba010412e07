"""KV managers end to end: real prefill and decode rank processes, NIXL over loopback, the
bootstrap service, KV checked byte for byte against the seeded reference on decode."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.control.bootstrap import BootstrapService
from tests.kvtransfer.control._ranks import (Abort, Prefill, RankProcess, RankSpec, Receive, Released, SendLast,
                                             Stats, Verify, Wait)

FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "transfer_timeout_s": 30.0}


@pytest.fixture
def bootstrap():
    with BootstrapService() as svc:
        yield svc.address


def start(bootstrap, prefill_tp, decode_tp, prefill_page=16, decode_page=4, heads=4, config=FAST):
    ranks = []
    try:
        prefill = [RankProcess(RankSpec("prefill", r, prefill_tp, prefill_page, bootstrap, total_heads=heads,
                                        config=config)) for r in range(prefill_tp)]
        ranks += prefill
        for p in prefill:
            p.started()
        decode = [RankProcess(RankSpec("decode", r, decode_tp, decode_page, bootstrap, total_heads=heads,
                                       config=config, instance="decode-a")) for r in range(decode_tp)]
        ranks += decode
        for d in decode:
            d.started()
    except BaseException:
        for r in ranks:
            r.close()
        raise
    return prefill, decode


def close_all(*groups):
    for group in groups:
        for r in group:
            r.close()


def run_request(prefill, decode, rid, tokens, chunks, prefix=0, first_token=7):
    for d in decode:
        d.call(Receive(rid, tokens, prefix))
    for p in prefill:
        p.call(Prefill(rid, tokens, chunks, first_token=first_token))
    for r in prefill + decode:
        assert r.call(Wait(rid)) == ("Success", None), r.name


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_requests_of_random_lengths_land_byte_for_byte(bootstrap, prefill_tp, decode_tp):
    prefill, decode = start(bootstrap, prefill_tp, decode_tp)
    try:
        rng = np.random.default_rng(prefill_tp * 10 + decode_tp)
        for i in range(4):
            tokens = int(rng.integers(1, 90))
            cut = sorted(rng.choice(np.arange(1, tokens), size=min(2, tokens - 1), replace=False).tolist()) if tokens > 2 else []
            chunks = tuple(np.diff([0, *cut, tokens]).tolist())
            run_request(prefill, decode, f"req-{i}", tokens, chunks, first_token=100 + i)
            for d in decode:
                bad, token = d.call(Verify(f"req-{i}"))
                assert bad == 0 and token == 100 + i
        for r in prefill + decode:
            assert r.call(Stats())["requests"] == 0
    finally:
        close_all(prefill, decode)


def test_decode_held_prefix_is_not_sent(bootstrap):
    prefill, decode = start(bootstrap, 2, 1)
    try:
        run_request(prefill, decode, "prefix", tokens=50, chunks=(20, 30), prefix=24)
        assert decode[0].call(Verify("prefix"))[0] == 0
    finally:
        close_all(prefill, decode)


def test_abort_from_decode_fails_both_sides_and_releases_the_pages(bootstrap):
    prefill, decode = start(bootstrap, 2, 1)
    try:
        decode[0].call(Receive("ab", 40))
        for p in prefill:
            p.call(Prefill("ab", 40, (16, 24), hold_last=True))
        decode[0].call(Abort("ab", "client went away"))
        state, reason = decode[0].call(Wait("ab"))
        assert state == "Failed" and "client went away" in reason
        for p in prefill:
            state, reason = p.call(Wait("ab"))
            assert state == "Failed" and "aborted by decode rank" in reason and "client went away" in reason
        assert decode[0].call(Released("ab")) < 10
        run_request(prefill, decode, "after", 30, (30,))  # the pair still serves
        assert decode[0].call(Verify("after"))[0] == 0
    finally:
        close_all(prefill, decode)


def test_request_with_a_held_last_chunk_completes_when_it_comes(bootstrap):
    prefill, decode = start(bootstrap, 1, 1)
    try:
        decode[0].call(Receive("late", 33))
        prefill[0].call(Prefill("late", 33, (16, 17), hold_last=True))
        assert decode[0].call(Wait("late", timeout_s=0.5)) == ("Transferring", None)
        prefill[0].call(SendLast("late"))
        assert decode[0].call(Wait("late")) == ("Success", None)
        assert decode[0].call(Verify("late"))[0] == 0
    finally:
        close_all(prefill, decode)
