"""KV managers end to end: real prefill and decode rank processes, NIXL over loopback, the
bootstrap service, KV checked byte for byte against the seeded reference on decode."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtransfer.control.bootstrap import BootstrapService
from tests.kvtransfer.control._ranks import (Abort, Prefill, RankProcess, RankSpec, Receive, Released, SendLast,
                                             Stats, Verify, Wait, wait_forgotten)

# The transfer timeout is a backstop no test reaches: pages released within Released's 30 s
# were not released by it.
FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "transfer_timeout_s": 600.0}


def start(bootstrap, prefill_tp, decode_tp, prefill_page=16, decode_page=4, kind="mha", config=FAST):
    """Prefill and decode ranks, started side by side (decode waits for the topology)."""
    instance = f"decode-{kind}-{prefill_tp}{decode_tp}"
    specs = [RankSpec("prefill", r, prefill_tp, prefill_page, bootstrap, kind=kind, config=config, instance=instance)
             for r in range(prefill_tp)]
    specs += [RankSpec("decode", r, decode_tp, decode_page, bootstrap, kind=kind, config=config, instance=instance)
              for r in range(decode_tp)]
    ranks = [RankProcess(spec) for spec in specs]
    try:
        for r in ranks:
            r.started()
    except BaseException:
        close_all(ranks)
        raise
    return ranks[:prefill_tp], ranks[prefill_tp:]


def close_all(*groups):
    for group in groups:
        for r in group:
            r.close()


@pytest.fixture(scope="module", params=[(kind, p, d) for kind in ("mha", "mla", "hybrid") for p, d in ((2, 1), (1, 2))],
                ids=lambda c: f"{c[0]}-tp{c[1]}to{c[2]}")
def group(request):
    kind, p, d = request.param
    with BootstrapService() as svc:
        prefill, decode = start(svc.address, p, d, kind=kind)
        yield prefill, decode
        close_all(prefill, decode)


def run_request(prefill, decode, rid, tokens, chunks, prefix=0, first_token=7, layer_groups=0):
    for d in decode:
        d.call(Receive(rid, tokens, prefix))
    for p in prefill:
        p.call(Prefill(rid, tokens, chunks, first_token=first_token, layer_groups=layer_groups))
    for r in prefill + decode:
        assert r.call(Wait(rid)) == ("Success", None), r.name


def start_held(prefill, decode, rid, tokens, chunks, layer_groups=0):
    """A request whose every chunk but the last (with layer groups: but its last group) is sent."""
    for d in decode:
        d.call(Receive(rid, tokens))
    for p in prefill:
        p.call(Prefill(rid, tokens, chunks, hold_last=True, layer_groups=layer_groups))


def test_requests_of_random_lengths_land_byte_for_byte(group):
    """KV (and Mamba state), aux record: every byte against the seeded reference; random
    lengths, chunks and slots, page 16 on prefill, 4 on decode."""
    prefill, decode = group
    rng = np.random.default_rng(len(prefill) * 10 + len(decode))
    for i in range(4):
        tokens = int(rng.integers(1, 90))
        cut = sorted(rng.choice(np.arange(1, tokens), size=min(2, tokens - 1), replace=False).tolist()) if tokens > 2 else []
        chunks = tuple(np.diff([0, *cut, tokens]).tolist())
        run_request(prefill, decode, f"req-{i}", tokens, chunks, first_token=100 + i)
        for d in decode:
            bad, token = d.call(Verify(f"req-{i}"))
            assert bad == 0 and token == 100 + i
    for r in prefill + decode:
        wait_forgotten(r)


def test_every_state_change_of_a_request_calls_its_managers_on_change(group):
    """An engine's loop sleeps until a transfer moves: each rank's manager calls its
    ``on_change`` once per state its requests enter, on both sides, and there are such moves."""
    prefill, decode = group
    ranks = prefill + decode
    before = [r.call(Stats()) for r in ranks]
    run_request(prefill, decode, "on-change", tokens=40, chunks=(20, 20))
    deadline = time.monotonic() + 5.0
    while True:  # the last call comes right after the state it reports, on the manager's thread
        after = [r.call(Stats()) for r in ranks]
        counts = [(a["changes"] - b["changes"], a["moves"] - b["moves"]) for a, b in zip(after, before)]
        if all(calls == moves for calls, moves in counts) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(calls == moves >= 2 for calls, moves in counts), counts
    for d in decode:
        assert d.call(Verify("on-change")) == (0, 7)
    for r in ranks:
        wait_forgotten(r)


@pytest.mark.parametrize("layer_groups", [2, 99], ids=["two-groups", "each-layer"])
def test_chunks_sent_layer_by_layer_land_byte_for_byte(group, layer_groups):
    """Each chunk's KV in consecutive layer groups (as a forward computes them), after a prefix
    decode holds: every byte, the Mamba state and the aux record against the reference."""
    prefill, decode = group
    run_request(prefill, decode, f"layers-{layer_groups}", tokens=61, chunks=(16, 20, 25), prefix=8,
                first_token=40 + layer_groups, layer_groups=layer_groups)
    # the last chunk empty: the KV went with the chunks before, the first token (sampled after the
    # last layer) and the state come after it, as an engine streaming its forward sends them
    run_request(prefill, decode, f"tail-{layer_groups}", tokens=45, chunks=(30, 15, 0), first_token=50 + layer_groups,
                layer_groups=layer_groups)
    for rid, first in ((f"layers-{layer_groups}", 40), (f"tail-{layer_groups}", 50)):
        for d in decode:
            bad, token = d.call(Verify(rid))
            assert bad == 0 and token == first + layer_groups


def test_a_held_last_layer_group_completes_when_it_comes_and_an_abort_stops_the_rest(group):
    """Every layer group but the last is sent: decode waits for it and succeeds once it comes;
    aborted instead, both sides fail, the later group is never posted and the pages go back."""
    prefill, decode = group
    start_held(prefill, decode, "late-layers", 33, (16, 17), layer_groups=3)
    assert decode[0].call(Wait("late-layers", timeout_s=0.5))[0] in ("Transferring", "WaitingForInput")
    for p in prefill:
        p.call(SendLast("late-layers"))
    for d in decode:
        assert d.call(Wait("late-layers")) == ("Success", None)
        assert d.call(Verify("late-layers"))[0] == 0
    start_held(prefill, decode, "cut-layers", 40, (40,), layer_groups=3)
    decode[0].call(Abort("cut-layers", "client went away"))
    for r in prefill + decode:
        assert r.call(Wait("cut-layers"))[0] == "Failed", r.name
    for p in prefill:
        p.call(SendLast("cut-layers"))  # the failed request's last group: nothing is posted
    for d in decode:
        d.call(Released("cut-layers"))
    for r in prefill + decode:
        wait_forgotten(r)


def test_decode_held_prefix_is_not_sent(group):
    prefill, decode = group
    run_request(prefill, decode, "prefix", tokens=50, chunks=(20, 30), prefix=24)
    for d in decode:
        assert d.call(Verify("prefix"))[0] == 0


def test_abort_from_decode_fails_both_sides_and_releases_the_pages(group):
    prefill, decode = group
    start_held(prefill, decode, "ab", 40, (16, 24))
    decode[0].call(Abort("ab", "client went away"))
    state, reason = decode[0].call(Wait("ab"))
    assert state == "Failed" and "client went away" in reason
    for p in prefill:
        state, reason = p.call(Wait("ab"))
        assert state == "Failed" and "aborted by decode rank" in reason and "client went away" in reason
    for d in decode:
        assert d.call(Wait("ab"))[0] == "Failed"  # the other decode ranks learn it from prefill
        d.call(Released("ab"))
    run_request(prefill, decode, "after", 30, (30,))  # the group still serves
    for d in decode:
        assert d.call(Verify("after"))[0] == 0


def test_request_with_a_held_last_chunk_completes_when_it_comes(group):
    prefill, decode = group
    start_held(prefill, decode, "late", 33, (16, 17))
    assert decode[0].call(Wait("late", timeout_s=0.5))[0] in ("Transferring", "WaitingForInput")
    for p in prefill:
        p.call(SendLast("late"))
    for d in decode:
        assert d.call(Wait("late")) == ("Success", None)
        assert d.call(Verify("late"))[0] == 0


def gpu_ranks(svc, backends, decode_device: int, instance: str) -> list:
    """A prefill rank on GPU 0 and a decode rank on ``decode_device``, one process each, not
    started. The heartbeat timeout is long: on a cold Triton cache the first NVLink write
    compiles its kernel on the prefill loop thread (seconds), and heartbeats wait for it."""
    config = {**FAST, "heartbeat_timeout_s": 15.0}
    return [RankProcess(RankSpec("prefill", 0, 1, 16, svc.address, config=config, device=0, backends=backends)),
            RankProcess(RankSpec("decode", 0, 1, 4, svc.address, config=config, device=decode_device,
                                 backends=backends, instance=instance))]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backends, want", [(("nixl", "nvlink"), "nvlink"), (("nixl",), "nixl")])
def test_cuda_pools_on_one_host_pick_nvlink_when_both_offer_it(backends, want, monkeypatch):
    """Prefill on GPU 0, decode on GPU 1, one process each: with nvlink on both sides the pair
    takes it (else NIXL), and the bytes land either way."""
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm,cuda_copy,cuda_ipc")  # NIXL refuses GPUs without a CUDA transport
    with BootstrapService() as svc:
        ranks = gpu_ranks(svc, backends, 1, "gpu")
        try:
            prefill, decode = [r.started() for r in ranks]
            assert prefill.call(Stats())["backends"] == {("gpu", 0): want}
            for i, tokens in enumerate((1, 37, 200)):
                run_request([prefill], [decode], f"gpu-{i}", tokens, (tokens,) if tokens < 16 else (16, tokens - 16))
                assert decode.call(Verify(f"gpu-{i}")) == (0, 7)
        finally:
            close_all(ranks)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_groups", [0, 2], ids=["whole", "layer-groups"])
@pytest.mark.parametrize("backends", [("nixl",), ("nixl", "nvlink")])
def test_kv_sent_while_the_engines_stream_still_computes_it_lands_as_computed(backends, layer_groups, monkeypatch):
    """An engine may call send() as soon as a chunk's KV (or a group of its layers) is queued on
    its (non-default) stream: here the rows are written there behind ~0.1 s of GPU busy wait,
    and send() follows at once. The writes must read the rows as computed: NIXL reads GPU memory
    with no stream order of its own (its writes are posted once the chunk's event completed);
    NVLink's are posted at once, from the manager's stream that waits for that event
    (``Peer.orders_on_device``). One GPU: both ranks on it, two processes."""
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm,cuda_copy,cuda_ipc")
    with BootstrapService() as svc:
        ranks = gpu_ranks(svc, backends, 0, "late")
        try:
            prefill, decode = [r.started() for r in ranks]
            for i, (tokens, chunks) in enumerate(((37, (16, 21)), (200, (200,)))):
                rid = f"late-{i}"
                decode.call(Receive(rid, tokens, 0))
                prefill.call(Prefill(rid, tokens, chunks, first_token=7, late_cycles=200_000_000,
                                     layer_groups=layer_groups))
                for r in (prefill, decode):
                    assert r.call(Wait(rid)) == ("Success", None), r.name
                assert decode.call(Verify(rid)) == (0, 7)
        finally:
            close_all(ranks)
