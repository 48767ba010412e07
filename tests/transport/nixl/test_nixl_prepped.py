"""NIXL direct writes through prepared descriptor lists (transport.nixl.prepped).

Bytes are checked against a numpy reference built entry by entry (as in test_nixl.py); the
lists' lifetime is checked on the handles NIXL gave: released when the regions they name change,
when the peer closes or is replaced, when a region of the peer is revoked, at close.
"""

from __future__ import annotations

import numpy as np
import pytest

from transport._nixl_import import load_nixl_api

try:
    load_nixl_api()
except ImportError as exc:  # NIXL is an optional extra
    pytest.skip(f"NIXL is not installed: {exc}", allow_module_level=True)

import transport.nixl.prepped as prepped  # noqa: E402
from tests.transport._support import assert_same  # noqa: E402
from transport.base import Region, RegionRevoked, WriteBatch  # noqa: E402

KiB = 1 << 10


def wb(*arrays) -> WriteBatch:
    arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in arrays))
    return WriteBatch.of(*arrays)


def handles(lists: prepped.PreparedLists) -> list:
    return [lst.handle for lst in lists._lists.values() if lst is not None]


def expect(dst, src, batch):
    for sr, so, dr, do, n in zip(batch.src_region.tolist(), batch.src_offset.tolist(), batch.dst_region.tolist(),
                                 batch.dst_offset.tolist(), batch.length.tolist()):
        dst[dr][do:do + n] = src[sr][so:so + n]


@pytest.fixture
def pair(writer, receiver):
    """A writer with two host regions connected to a receiver with two zeroed regions of 64 KiB."""
    rx = receiver([64 * KiB, 64 * KiB])
    t = writer()
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, 64 * KiB, dtype=np.uint8) for _ in range(2)]
    ids = [t.register(a.ctypes.data, a.nbytes) for a in src]
    assert ids == [0, 1]
    return t, t.connect(rx.export), rx, src


def test_small_writes_of_any_granule_land_byte_for_byte(pair):
    t, peer, rx, src = pair
    want = [np.zeros(64 * KiB, np.uint8) for _ in range(2)]
    batches = [
        wb([0, 1, 0], [256, 1024, 4096], [1, 0, 0], [512, 2048, 8192], [256, 768, 1024]),  # granule 256
        wb([1, 0], [3, 5000], [0, 1], [7, 40001], [100, 9]),  # odd: granule 1
        wb(0, 8192, 1, 16384, 8192),  # granule 8 KiB: too many blocks for the finer lists, a list of its own
        wb([0, 1], [64 * KiB - 256, 0], [1, 1], [64 * KiB - 256, 30000], [256, 256]),  # the regions' last block
    ]
    for batch in batches:
        peer.write(batch).wait(30)
        expect(want, src, batch)
    assert len(peer.lists) >= 1 and len(t._core.lists) >= 1  # written through prepared lists
    for region in (0, 1):
        assert_same(rx.dump(region), want[region], f"region {region}")


def test_a_write_of_too_many_blocks_goes_by_descriptors(pair):
    t, peer, rx, src = pair
    batch = wb(0, 1, 1, 3, 60 * KiB)  # granule 1: more blocks than MAX_INDICES
    assert 60 * KiB > prepped.MAX_INDICES
    peer.write(batch).wait(30)
    assert len(peer.lists) == 0
    assert_same(rx.dump(1)[3:3 + 60 * KiB], src[0][1:1 + 60 * KiB], "region 1")


def test_registering_or_deregistering_a_region_releases_this_sides_lists(pair):
    t, peer, rx, src = pair
    peer.write(wb(0, 0, 0, 0, 1024)).wait(30)
    first = handles(t._core.lists)
    assert first
    extra = np.full(4 * KiB, 7, np.uint8)
    rid = t.register(extra.ctypes.data, extra.nbytes)
    assert all(h._released for h in first) and len(t._core.lists) == 0
    peer.write(wb(rid, 0, 0, 1024, 4096)).wait(30)  # prepared again, with the new region
    second = handles(t._core.lists)
    assert second and not any(h._released for h in second)
    t.deregister(rid)
    assert all(h._released for h in second) and len(t._core.lists) == 0
    peer.write(wb(1, 0, 0, 8192, 1024)).wait(30)
    dumped = rx.dump(0)
    assert_same(dumped[:1024], src[0][:1024], "first write")
    assert_same(dumped[1024:5120], extra, "the new region's write")
    assert_same(dumped[8192:9216], src[1][:1024], "after the deregister")


def test_a_peers_lists_go_with_it_and_with_the_transport(pair):
    t, peer, rx, src = pair
    peer.write(wb(0, 0, 0, 0, 512)).wait(30)
    mine = handles(peer.lists)
    assert mine
    again = t.connect(rx.export)  # a newer connect replaces the snapshot: its lists go
    assert all(h._released for h in mine)
    again.write(wb(0, 512, 0, 512, 512)).wait(30)
    theirs, local = handles(again.lists), handles(t._core.lists)
    again.close()
    assert all(h._released for h in theirs) and not any(h._released for h in local)
    third = t.connect(rx.export)
    third.write(wb(0, 1024, 0, 1024, 512)).wait(30)
    last = handles(third.lists) + handles(t._core.lists)
    t.close()
    assert last and all(h._released for h in last)
    assert_same(rx.dump(0)[:1536], src[0][:1536], "region 0")


def test_a_revoked_region_releases_the_peers_lists(pair):
    t, peer, rx, src = pair
    peer.write(wb([0, 1], 0, [0, 1], 0, 2048)).wait(30)
    before = handles(peer.lists)
    assert before
    rx.deregister(1, pump=t.poll_notifications)  # t answers the revoke meanwhile
    assert all(h._released for h in before)
    peer.write(wb(1, 0, 0, 4096, 2048)).wait(30)  # the same snapshot: lists prepared again, without region 1
    lists = [lst for lst in peer.lists._lists.values() if lst is not None]
    assert lists and {rid for lst in lists for rid, first in enumerate(lst.start) if first >= 0} == {0}
    with pytest.raises(RegionRevoked):
        peer.write(wb(0, 0, 1, 0, 64))
    assert_same(rx.dump(0)[4096:6144], src[1][:2048], "region 0")


# -- the indices, without NIXL ------------------------------------------------------------------


class _Stub:
    def __init__(self):
        self.released = False

    def release(self):
        self.released = True


class _Agent:
    """What prepared lists use of ``transport.nixl.agent.Agent``."""

    def __init__(self):
        self.prepared = []

    def prep_list(self, remote, rows, mem):
        self.prepared.append((remote, rows.tolist(), mem))
        return _Stub()


def _lists(regions):
    agent = _Agent()
    return agent, prepped.PreparedLists(agent, "peer", lambda: regions)


@pytest.mark.parametrize("small", [prepped.SMALL_BATCH, 0], ids=["python", "numpy"])
def test_indices_address_each_entrys_blocks(small, monkeypatch):
    monkeypatch.setattr(prepped, "SMALL_BATCH", small)
    regions = {0: Region(0, 1000, 4096), 2: Region(2, 9000, 1000), 3: Region(3, 5000, 64, 0)}
    agent, lists = _lists(regions)
    lst = lists.get("DRAM", 256)
    assert agent.prepared == [("peer", [[1000, 256, 0, 256, 16], [9000, 256, 0, 256, 3]], "DRAM")]
    assert lst.start == [0, -1, 16, -1] and lst.usable == [4096, 0, 768, 0]
    batch = wb([0, 2, 0], [512, 256, 0], [2, 0, 0], [0, 1024, 3840], [512, 256, 256])
    granule, nbytes, rows = prepped.shape_of(batch)
    assert (granule, nbytes) == (256, 1024)
    li, ri = prepped.prepped_indices(batch, rows, lst, lst)
    assert list(li) == [2, 3, 17, 0] and list(ri) == [16, 17, 4, 15]
    rows_of_one_block = wb([0, 2, 0], [512, 256, 0], [2, 0, 0], [0, 1024, 3840], 256)  # numpy: the firsts alone
    li, ri = prepped.prepped_indices(rows_of_one_block, prepped.shape_of(rows_of_one_block)[2], lst, lst)
    assert list(li) == [2, 17, 0] and list(ri) == [16, 4, 15]
    for bad in (wb(2, 768, 0, 0, 256),  # past region 2's last whole block
                wb(0, 0, 3, 0, 64),  # a CUDA region: not in a DRAM list
                wb(0, 0, 7, 0, 256)):  # an id beyond the list
        assert prepped.prepped_indices(bad, prepped.shape_of(bad)[2], lst, lst) is None
    assert prepped.shape_of(wb(0, 3, 0, 1 << 20, 1 << 20))[0] == 1
    assert prepped.shape_of(wb(0, 0, 0, 1 << 20, 1 << 20))[0] == prepped.MAX_GRANULE


def test_lists_prepare_once_and_release_every_handle():
    regions = {0: Region(0, 1000, 4096), 1: Region(1, 5000, 4096, 0)}
    agent, lists = _lists(regions)
    a, b = lists.get("DRAM", 256), lists.get("DRAM", 256)
    c = lists.get("VRAM", 1024)
    assert a is b and len(agent.prepared) == 2 and lists.finest("DRAM") == 256
    assert lists.get("DRAM", 8192) is None  # no whole block in any region: descriptors
    lists.release()
    assert a.handle.released and c.handle.released and len(lists) == 0 and lists.finest("DRAM") is None
