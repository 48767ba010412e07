"""``kvtransfer bench transfer``: its cases against a byte-level reference, and ``--quick`` end to end
(the JSON's figures consistent with each other and with the plans, every path verified, the PNGs);
``--layerwise``: a request's layers written one by one land the request's bytes, and a run
streams, verifies and times them against one write."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtransfer.batches import BufferRegions
from kvtransfer.benchmarks import transfer
from kvtransfer.benchmarks._cases import Case, Pools
from kvtransfer.benchmarks._layerwise import layer_batches
from kvtransfer.benchmarks._models import PRESETS


def _apply(batches, src: list, dst: list) -> None:
    """Copy every range of the batches, one at a time (the reference writer)."""
    for b in batches:
        flat = b.expand() if hasattr(b, "expand") else b
        for sr, so, dr, do, n in zip(flat.src_region, flat.src_offset, flat.dst_region, flat.dst_offset, flat.length):
            dst[dr][do:do + n] = src[sr][so:so + n]


@pytest.mark.parametrize("model", sorted(PRESETS))
@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1), (2, 4)])
@pytest.mark.parametrize("page,slots", [(1, "random"), (16, "random"), (16, "contiguous")])
def test_planner_and_peers_way_write_the_expected_bytes(model, tp, page, slots):
    import torch

    shape = PRESETS[model].overridden(layers=2)
    pools = Pools.for_tokens(shape, *tp, max_tokens=64, pool_factor=2.0)
    case = Case.make(pools, 64, page, slots, np.random.default_rng(sum(tp) + page))
    kv, state = pools.sizes("src")
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in kv + state]
    dkv, dstate = pools.sizes("dst")
    src_ids = BufferRegions.of(range(len(kv)), range(len(kv), len(kv) + len(state)))
    dst_ids = BufferRegions.of(range(len(dkv)), range(len(dkv), len(dkv) + len(dstate)))
    expected = [case.expected([torch.from_numpy(s) for s in src], 0x5A, i).numpy() for i in range(len(dkv + dstate))]
    plan_bytes = sum(p.nbytes for p in case.plans())
    assert plan_bytes == case.expected_bytes() > 0
    for batches in (case.planned(src_ids, dst_ids), [case.peer_batch(src_ids, dst_ids)]):
        assert sum(b.nbytes for b in batches) == plan_bytes
        dst = [np.full(n, 0x5A, dtype=np.uint8) for n in dkv + dstate]
        _apply(batches, src, dst)
        for i, (got, want) in enumerate(zip(dst, expected)):
            assert np.array_equal(got, want), f"destination buffer {i} differs"


@pytest.mark.parametrize("model", sorted(PRESETS))
@pytest.mark.parametrize("tp", [(1, 1), (2, 1)])
@pytest.mark.parametrize("group", [1, 2])
def test_a_request_written_layer_by_layer_lands_its_bytes_and_each_layer_only_its_own(model, tp, group):
    import torch

    shape = PRESETS[model].overridden(layers=3)
    pools = Pools.for_tokens(shape, *tp, max_tokens=64, pool_factor=2.0)
    case = Case.make(pools, 48, 16, "random", np.random.default_rng(3))
    kv, state = pools.sizes("src")
    dkv, dstate = pools.sizes("dst")
    rng = np.random.default_rng(2)
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in kv + state]
    src_ids = BufferRegions.of(range(len(kv)), range(len(kv), len(kv) + len(state)))
    dst_ids = BufferRegions.of(range(len(dkv)), range(len(dkv), len(dkv) + len(dstate)))
    layers = layer_batches(case, src_ids, dst_ids, group)
    assert len(layers) == -(-3 // group)
    dst = [np.full(n, 0x5A, dtype=np.uint8) for n in dkv + dstate]
    for i, batches in enumerate(layers):
        with_state = bool(dstate) and i == len(layers) - 1  # the state's write goes with the last group
        assert len(batches) == 1 + with_state  # one write of the group's KV
        touched = {int(r) for b in batches for r in (b.expand() if hasattr(b, "expand") else b).dst_region}
        kv_touched = {r for r in touched if r < len(dkv)}
        mine = set(range(i * group, min(3, (i + 1) * group)))
        assert kv_touched and {r % 3 for r in kv_touched} == mine, (i, touched)  # KV buffer = export * layers + layer
        assert i == len(layers) - 1 or touched == kv_touched  # state goes with the last group
        _apply(batches, src, dst)
    for i, got in enumerate(dst):
        want = case.expected([torch.from_numpy(s) for s in src], 0x5A, i).numpy()
        assert np.array_equal(got, want), f"destination buffer {i} differs"


def test_layerwise_run_streams_verifies_and_times_both_modes(tmp_path, capsys):
    argv = ["--models", "llama3-8b", "--layers", "4", "--tokens", "64,256", "--page-sizes", "16", "--tp", "1:1",
            "--paths", "nixl direct", "--layerwise", "on,off", "--layer-group", "1,3", "--layer-ms", "1",
            "--layerwise-reps", "2",
            "--out", str(tmp_path), "--no-progress"]
    assert transfer.main(argv) == 0
    table = capsys.readouterr().out
    doc = json.loads((tmp_path / "transfer.json").read_text())
    assert doc["config"]["layerwise"] == ["on", "off"]
    assert transfer._layerwise_table(doc["results"]) in table
    for rec in doc["results"]:
        lw = rec["layerwise"]
        assert lw["layers"] == 4 and lw["layer_bytes"] * 4 == rec["plan"]["bytes"], lw
        assert lw["layer_s"] > 0
        for mode in ("on", "on/3", "off"):
            assert lw[mode]["compute_s"] > 0 and lw[mode]["tail_s"] > 0, lw


def test_layerwise_run_through_the_staged_transport_verifies_and_times(tmp_path, capsys):
    """``--layerwise-staged``: a layer of a TP 2 -> 1, page-1 request is 2,048 rows of 1 KiB,
    which the transport with its staged mode on stages (as a serving node's does); the streamed
    bytes are checked before the timed rounds (a record says "failed" otherwise)."""
    argv = ["--models", "llama3-8b", "--layers", "2", "--tokens", "1024", "--page-sizes", "1", "--tp", "2:1",
            "--paths", "nixl staged", "--layerwise", "on,off", "--layer-ms", "1", "--layerwise-reps", "1",
            "--layerwise-staged", "--out", str(tmp_path), "--no-progress"]
    assert transfer.main(argv) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "transfer.json").read_text())
    assert doc["config"]["layerwise_staged"] is True
    (rec,) = doc["results"]
    lw = rec["layerwise"]
    assert "failed" not in lw and "skipped" not in lw, lw
    assert lw["layers"] == 2 and lw["layer_bytes"] * 2 == rec["plan"]["bytes"], lw
    for mode in ("on", "off"):
        assert lw[mode]["compute_s"] > 0 and lw[mode]["tail_s"] > 0, lw


def test_layerwise_switches_are_checked(capsys):
    with pytest.raises(SystemExit):
        transfer.main(["--layerwise", "sideways"])
    assert "expected on, off or on,off, got 'sideways'" in capsys.readouterr().err


def test_quick_run_writes_consistent_json_and_plots(tmp_path, capsys):
    assert transfer.main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    table = capsys.readouterr().out
    doc = json.loads((tmp_path / "transfer.json").read_text())
    assert doc["benchmark"] == "transfer" and doc["config"]["quick"] is True
    machine = doc["machine"]
    assert machine["cpu_count"] >= 1 and machine["versions"]["numpy"] and "gpus" in machine
    assert transfer._table(doc["results"]) in table
    models = {r["model"] for r in doc["results"]}
    assert models == {PRESETS[m].name for m in transfer.QUICK["models"].split(",")}
    for rec in doc["results"]:
        assert rec["plan"]["bytes"] == rec["expected_bytes"] > 0
        assert rec["model"] in table
        by_path = {p["path"]: p for p in rec["paths"]}
        assert set(by_path) == set(transfer.PATHS)
        for name in ("link", "nixl direct", transfer.PEERS):
            assert by_path[name]["status"] == "ok", by_path[name]
        link, peers = by_path["link"], by_path[transfer.PEERS]
        for p in rec["paths"]:
            if p["status"] == "skipped":
                assert p["reason"]
                continue
            t = p["time"]
            assert p["verified"] is True and p["bytes"] == rec["plan"]["bytes"]
            assert 1 <= t["repeats"] == len(t["samples_s"]) <= 3 * doc["config"]["repeats"]
            assert t["min_s"] <= t["median_s"] <= t["max_s"]
            assert p["gbps"] == pytest.approx(p["bytes"] / t["median_s"] / 1e9)
            assert p["vs_link"] == pytest.approx(link["time"]["median_s"] / t["median_s"])
            assert p["vs_peers"] == pytest.approx(peers["time"]["median_s"] / t["median_s"])
        assert by_path[transfer.PEERS]["entries"] >= by_path["nixl direct"]["entries"]
    again = tmp_path / "again"
    assert transfer.main(["--from-json", str(tmp_path / "transfer.json"), "--out", str(again)]) == 0
    assert transfer._table(doc["results"]) in capsys.readouterr().out  # the run's table, again
    for model in models:
        for where in (tmp_path, again):
            png = where / f"transfer-{model.lower().replace(' ', '-')}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_hosts_run_writes_and_streams_across_network_namespaces(tmp_path, capsys):
    from kvtransfer.netns import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(why)
    argv = ["--two-hosts", "--models", "llama3-8b", "--layers", "2", "--tokens", "64", "--page-sizes", "16",
            "--tp", "1:1", "--paths", "nixl direct", "--layerwise", "on", "--layer-ms", "1", "--layerwise-reps", "1",
            "--out", str(tmp_path), "--no-progress"]
    assert transfer.main(argv) == 0
    assert "host memory, two network namespaces (tcp over veth)" in capsys.readouterr().out  # printed here
    doc = json.loads((tmp_path / "transfer.json").read_text())
    assert doc["config"]["two_hosts"] is True and doc["config"]["memory"] == "host"
    (rec,) = doc["results"]
    (path,) = rec["paths"]
    assert path["path"] == "nixl direct" and path["status"] == "ok" and path["verified"] is True, path
    assert set(rec["layerwise"]) == {"layers", "layer_bytes", "layer_s", "on"}, rec["layerwise"]


def test_two_hosts_refuses_gpu_memory(capsys):
    with pytest.raises(SystemExit):
        transfer.main(["--two-hosts", "--memory", "gpu"])
    assert "--two-hosts moves host memory (not --memory gpu)" in capsys.readouterr().err
