"""The direct path's host steps in C (``transport.nvlink.native``): the build and its errors,
``stage`` against numpy, the launch kept only where it is Triton's own, the config switch; on a
GPU (marked), the same writes landing the same bytes with the steps in C and in Python."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.transport._support import SLOTS, TOKEN, check_landed, kv_strided, local_pair
from transport.base import StridedBatch, TransferStatus
from transport.nvlink import native
from transport.nvlink.config import NvlinkConfig
from transport.nvlink.direct import NO_LIMIT, SlotRing
from transport.nvlink.launch import native_launch


@pytest.fixture(scope="module")
def module():
    try:
        return native.build()
    except OSError as exc:  # no compiler or no Python headers here: nothing to test
        pytest.skip(f"the C steps cannot be built here: {exc}")


def _expected_fits(src, dst, src_limit, dst_limit) -> bool:
    return all(0 <= s <= src_limit for s in src.tolist()) and all(0 <= d <= dst_limit for d in dst.tolist())


@pytest.mark.parametrize("seed", range(40))
def test_stage_copies_both_sides_and_checks_them_as_the_rules_say(module, seed):
    """Random slots (some negative, some past a limit) and limits (-1, small, NO_LIMIT): the
    ring holds source then destination slots at the span, nothing outside it changes, and the
    verdict is every slot in ``[0, limit]`` of its side."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    src = rng.integers(-3 if seed % 5 == 0 else 0, 1000, n).astype(np.int64)
    dst = rng.integers(0, 1000, n).astype(np.int64)
    src_limit, dst_limit = [int(rng.choice([-1, 500, 999, 1000, NO_LIMIT])) for _ in range(2)]
    ring = np.full(2 * n + 20, 7, dtype=np.int64)
    fits = module.stage(ring.ctypes.data + 8 * 10, src, dst, src_limit, dst_limit)
    assert fits is (n == 0 or _expected_fits(src, dst, src_limit, dst_limit))
    assert np.array_equal(ring[10:10 + 2 * n], np.concatenate([src, dst]))
    assert (ring[:10] == 7).all() and (ring[10 + 2 * n:] == 7).all()


def test_stage_declines_arrays_it_cannot_read_as_int64_and_leaves_the_ring(module):
    ring = np.zeros(16, dtype=np.int64)
    a = np.arange(8, dtype=np.int64)
    for src, dst in ((a[::2], a[:4]), (a[:4], a.astype(np.int32)[:4]), (a.astype(np.float64)[:4], a[:4]),
                     ([0, 1, 2, 3], a[:4])):
        assert module.stage(ring.ctypes.data, src, dst, NO_LIMIT, NO_LIMIT) is None
    assert not ring.any()
    with pytest.raises(ValueError, match="source and destination slots differ in length: 3 and 4"):
        module.stage(ring.ctypes.data, a[:3], a[:4], NO_LIMIT, NO_LIMIT)
    with pytest.raises(TypeError, match=r"stage\(\) takes 5 arguments, got 4"):
        module.stage(ring.ctypes.data, a, a, 1)


def test_same_bytes_agrees_with_the_pair_key(module):
    """``same_bytes(key, arrays)`` is ``pair_key`` of the arrays == key, for equal pairs, a
    changed value, arrays cut differently and a key longer or shorter; None for arrays that are
    not int64."""
    rng = np.random.default_rng(4)
    pairs = tuple(rng.integers(0, 1 << 40, 6) for _ in range(7))
    key = b"".join(a.tobytes() for a in pairs)
    assert module.same_bytes(key, pairs) is True
    changed = tuple(a.copy() for a in pairs)
    changed[6][5] += 1
    assert module.same_bytes(key, changed) is False
    recut = (np.concatenate(pairs[:2]),) + pairs[2:]  # the same bytes, other arrays: the key cannot tell
    assert module.same_bytes(key, recut) is True
    assert module.same_bytes(key + b"\0" * 8, pairs) is False and module.same_bytes(key[:-8], pairs) is False
    assert module.same_bytes(b"", ()) is True
    assert module.same_bytes(key, pairs[:6] + (pairs[6].astype(np.int32),)) is None


def test_pair_cache_finds_the_last_plan_alike_with_the_c_compare(module):
    """The cache with the C compare: the last plan found while the pairs' bytes are the same
    (other slots), other pairs built, the first pairs found again by their key."""
    from transport.nvlink.direct import PairCache

    built = []
    cache = PairCache(4, lambda: 0, lambda b: built.append(b) or object(), native=module)
    offsets = np.array([0, 64], dtype=np.int64)
    b = StridedBatch.of([1, 2], offsets, 128, [3, 4], 0, 128, 64, [0], [0])
    first = cache.get(b)
    assert cache.get(StridedBatch.of([1, 2], offsets, 128, [3, 4], 0, 128, 64, [5, 6], [7, 8])) is first
    other = StridedBatch.of([1, 2], [0, 72], 128, [3, 4], 0, 128, 64, [0], [0])
    assert cache.get(other) is not first and cache.builds == 2
    assert cache.get(b) is first and cache.builds == 2  # from the dict, by its key


def test_slot_ring_stages_alike_in_c_and_in_numpy(module):
    """``SlotRing.stage`` with the C step and without: the same spans, ring contents and verdicts
    over writes that wrap the ring."""
    import torch

    rings = [SlotRing(None, 0, torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), steps)
             for steps in (module, None)]
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(1, 12))
        src, dst = rng.integers(-1, 40, n), rng.integers(0, 40, n)
        limits = int(rng.integers(20, 45)), int(rng.integers(20, 45))
        got = [r.stage(src, dst, *limits) for r in rings]
        assert got[0] == got[1]
        assert torch.equal(rings[0].host, rings[1].host)
        for r, (start, _) in zip(rings, got):
            r.space.hold(start, None)


def test_slot_ring_reuses_a_kept_span_alike_in_c_and_in_numpy(module):
    """``SlotRing.reuse``, the C compare and numpy's: the kept span for the same slots (whatever
    the arrays' dtype or identity), None for a byte changed in place, another count, a kept
    check against larger limits than asked, a span taken since, or nothing kept."""
    import torch

    for steps in (module, None):
        ring = SlotRing(None, 0, torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), steps)
        src, dst = np.array([3, 9, 4]), np.array([7, 1, 30])
        assert ring.reuse(src, dst, 40, 40) is None  # nothing kept
        start, fits = ring.stage(src, dst, 31, 31)
        assert fits
        ring.space.hold(start, "fence")
        ring.keep(start, 3, 31, 31)
        assert ring.reuse(src.copy(), dst.astype(np.int32), 40, 31) == start  # values alike, limits as large
        ring.space.hold(start, "fence 2")
        assert ring.reuse(src, dst, 30, 31) is None  # checked against 31: not enough for 30
        assert ring.reuse(src[:2], dst[:2], 40, 40) is None
        changed = dst.copy()
        changed[2] = 31
        assert ring.reuse(src, changed, 40, 40) is None
        again = ring.reuse(src, dst, 31, 31)
        assert again == start and ring.space.live == 1
        ring.space.hold(start, None)  # a write that failed: the span keeps "fence 2"
        assert ring.space._live[-1][2] == "fence 2"
        other, _ = ring.stage(dst, src, 31, 31)  # another span taken: nothing kept
        ring.space.hold(other, "fence 3")
        assert ring.reuse(src, dst, 31, 31) is None
        ring.keep(start, 3, 31, 31)  # said kept again, but no longer the newest span: not renewed
        assert ring.reuse(src, dst, 31, 31) is None


def test_the_driver_calls_refuse_to_run_before_the_driver_is_loaded(module):
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass
    with pytest.raises(OSError, match="cannot load libcuda.so.1"):
        module.load_driver()
    for call in (lambda: module.event_create(), lambda: module.param_sizes(1), lambda: module.current_device(),
                 lambda: module.launch(1, 128, 0, 0, 1, (), (), 0), lambda: module.upload_after(1, 1, 1, 8, None, None)):
        with pytest.raises(RuntimeError, match=r"the CUDA driver is not loaded: call load_driver\(\) first"):
            call()
    assert native.load() is None and "libcuda.so.1" in native.why_unavailable()


def test_set_error_class_takes_an_exception_class(module):
    with pytest.raises(TypeError, match="set_error_class\\(\\) takes an exception class"):
        module.set_error_class(3)


def test_load_warns_once_on_a_gpu_machine_that_cannot_build(monkeypatch, caplog):
    """A driver but no compiler: None, the reason kept, one warning; no driver: no warning."""
    import ctypes

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a driver, as far as load() looks
    monkeypatch.setattr(native, "build", lambda: (_ for _ in ()).throw(OSError("no C compiler (cc, gcc or clang) on PATH")))
    with caplog.at_level("WARNING", logger="transport.nvlink.native"):
        assert native.load() is None and native.load() is None
    assert native.why_unavailable() == "no C compiler (cc, gcc or clang) on PATH"
    assert [r.getMessage() for r in caplog.records] == [
        "nvlink: the direct path's host steps run in Python (slower by tens of microseconds per write): "
        "no C compiler (cc, gcc or clang) on PATH"]
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(f"{name}: not found")))
    caplog.clear()
    assert native.load() is None and native.why_unavailable() == "libcuda.so.1: not found" and not caplog.records


def test_build_says_what_is_missing(monkeypatch, tmp_path):
    """No compiler, or a source the compiler refuses: ``OSError`` naming it (nothing cached)."""
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path / "cache"])
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(OSError, match=r"no C compiler \(cc, gcc or clang\) on PATH"):
        native.build()
    monkeypatch.undo()
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    bad = tmp_path / "native.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path / "cache"])
    monkeypatch.setattr(native, "_SOURCE", bad)
    with pytest.raises(OSError, match=r"-shared .* failed:\n.*error"):
        native.build()
    assert not list((tmp_path / "cache").rglob("*.so"))


class _Steps:
    """``param_sizes`` as a driver would answer it."""

    def __init__(self, sizes):
        self.sizes = sizes

    def param_sizes(self, function):
        return self.sizes


def _compiled(**meta):
    base = dict(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
                profile_scratch_size=0, num_warps=4, shared=1024)
    return types.SimpleNamespace(function=0x1234, metadata=types.SimpleNamespace(**{**base, **meta}))


def test_native_launch_is_kept_only_where_it_is_tritons_own_launch():
    """Two pointers and three int32s, then Triton's two scratch pointers: kept, with the block
    and shared memory of the kernel; anything else (other parameters, scratch memory, clusters,
    cooperative or PDL launches, a driver that cannot tell) falls back to Triton's launcher."""
    i32 = ("i32",) * 3
    assert native_launch(_Steps([8, 8, 4, 4, 4, 8, 8]), _compiled(), 2, i32) == (0x1234, 128, 1024, 2, 0)
    assert native_launch(_Steps([8, 8, 4, 4, 4]), _compiled(), 2, i32) == (0x1234, 128, 1024, 0, 0)
    # an int64 the kernel declares (the staging address): 8 bytes, its bit set in wide
    assert native_launch(_Steps([8, 8, 4, 8, 8, 8, 8]), _compiled(), 2, ("i32", "i64", "i64")) == (
        0x1234, 128, 1024, 2, 0b110)
    for sizes in ([8, 8, 4, 4], [8, 8, 4, 4, 8, 8, 8], [8, 8, 4, 4, 4, 4], [8, 4, 4, 4, 4], None):
        assert native_launch(_Steps(sizes), _compiled(), 2, i32) is None, sizes
    assert native_launch(_Steps([8, 8, 4, 4, 4, 8, 8]), _compiled(), 2, ("i32", "i64", "i32")) is None  # 4 != 8
    assert native_launch(_Steps([8, 8, 4, 4, 8]), _compiled(), 2, ("i32", "i32", "u64")) is None  # not a declared type
    for meta in (dict(num_ctas=2), dict(launch_cooperative_grid=True), dict(launch_pdl=True),
                 dict(global_scratch_size=64), dict(profile_scratch_size=8), dict(shared=None)):
        assert native_launch(_Steps([8, 8, 4, 4, 4, 8, 8]), _compiled(**meta), 2, i32) is None, meta
    assert native_launch(None, _compiled(), 2, i32) is None


def test_the_landers_window_is_the_smallest_any_transport_asked_for(monkeypatch):
    """``NvlinkConfig.lander_spin_us``: checked; ``landed.ask_spin`` sets the process's one
    thread's window only when a transport asks for less than what is in force."""
    from transport.nvlink import landed

    assert NvlinkConfig().lander_spin_us == 2000 and NvlinkConfig(lander_spin_us=0).lander_spin_us == 0
    for bad in (-1, 10 ** 7 + 1, 1.5, True):
        with pytest.raises(ValueError, match=r"lander_spin_us must be an int in \[0, 10\*\*7\]"):
            NvlinkConfig(lander_spin_us=bad)
    monkeypatch.setattr(landed, "_spin_ns", [])
    set_to = []
    steps = types.SimpleNamespace(lander_spin=lambda ns: set_to.append(ns))
    assert [landed.ask_spin(steps, ns) for ns in (2_000_000, 500_000, 2_000_000, 0, 100)] == [
        2_000_000, 500_000, 500_000, 0, 0]
    assert set_to == [2_000_000, 500_000, 0]


def test_config_takes_native_as_a_bool():
    assert NvlinkConfig().native is True and NvlinkConfig(native=False).native is False
    with pytest.raises(TypeError, match="native must be a bool, got 'yes'"):
        NvlinkConfig(native="yes")


@pytest.mark.gpu
def test_the_c_and_python_host_steps_land_the_same_bytes(remote_any):
    """The same direct writes (page 1, page 16, head slices; slots changing) with the host steps
    in C and in Python: every byte exact against a reference, each notification after its bytes;
    with C, the steps ran in C (the upload, the order and the launch through the driver)."""
    from transport.nvlink import kernel as kern

    buf_bytes = SLOTS * TOKEN
    for steps_in_c in (True, False):
        t, peer, src, dst_rids = local_pair(remote_any, 2 * 4, buf_bytes, NvlinkConfig(native=steps_in_c))
        try:
            for i, (page, head) in enumerate([(1, False), (16, False), (1, True), (1, False)]):
                b = kv_strided(sorted(src), dst_rids, page, head, np.random.default_rng(70 + i), tokens=24 + 8 * i)
                remote_any.fill(dst_rids, 0x5A)
                tag = b"steps %d %d" % (steps_in_c, i)
                tr = peer.write_strided(b, notify=tag)
                tr.wait(timeout=60)
                assert tr.status() is TransferStatus.DONE, tr.error
                check_landed(remote_any, src, dst_rids, b.expand(), buf_bytes, tag, sender=t.name)
            if steps_in_c:
                assert t.native_unavailable is None and t._native_steps() is not None
                plan = peer.pair_plans.get(b)
                assert plan.launcher._launch._native is not None  # the launch went through the driver
            else:
                assert t.native_unavailable == "configured off (NvlinkConfig.native=False)"
            with pytest.raises(ValueError, match=r"batch pair \d+: destination \(peer\) range .* is outside region"):
                peer.write_strided(StridedBatch.of(sorted(src), 0, TOKEN, dst_rids, 0, TOKEN, TOKEN, [1], [SLOTS]))
        finally:
            t.close()
    assert kern._KERNELS[(False, "_scatter_strided_body")].direct_launches > 0


@pytest.mark.gpu
def test_a_request_written_layer_by_layer_lands_exactly_from_one_span_of_slots(remote_any):
    """A request's layers written one by one, in flight behind GPU work, the last one notifying:
    page 1 and head slices, host steps in C and in Python. Every byte exact; the slots went up
    with the first layer and every later layer read them there."""
    import torch

    buf_bytes = SLOTS * TOKEN
    for steps_in_c in (True, False):
        t, peer, src, dst_rids = local_pair(remote_any, 2 * 4, buf_bytes, NvlinkConfig(native=steps_in_c))
        try:
            ring = t._slot_ring()
            reused = []
            real_reuse = ring.reuse
            ring.reuse = lambda *a: reused.append(real_reuse(*a)) or reused[-1]
            for i, head in enumerate((False, True)):
                whole = kv_strided(sorted(src), dst_rids, 1, head, np.random.default_rng(90 + i), tokens=40)
                layers = [StridedBatch(*(p[g] for p in whole.pairs), whole.src_slot, whole.dst_slot)
                          for g in np.array_split(np.arange(whole.num_pairs), 4)]  # 4 layers: K and V each
                remote_any.fill(dst_rids, 0x5A)
                reused.clear()
                tag = b"layers %d %d" % (steps_in_c, i)
                torch.cuda._sleep(5_000_000)  # the writes wait behind this, all in flight
                transfers = [peer.write_strided(b, notify=tag if k == len(layers) - 1 else None)
                             for k, b in enumerate(layers)]
                for tr in transfers:
                    tr.wait(timeout=60)
                    assert tr.status() is TransferStatus.DONE, tr.error
                check_landed(remote_any, src, dst_rids, whole.expand(), buf_bytes, tag, sender=t.name)
                assert [r is not None for r in reused] == [False, True, True, True]
                assert len(set(reused[1:])) == 1
        finally:
            t.close()


@pytest.mark.gpu
def test_a_driver_error_names_the_call_as_a_cuda_ipc_error():
    """A call the driver refuses (an event record on a null event) raises ``CudaIpcError``
    naming the call and the CUresult, as the Python steps' failures do; the device as the
    runtime sees it."""
    import torch

    from transport.nvlink.ipc import CudaIpcError

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # the runtime's context current on this thread
    steps = native.load()
    assert steps is not None, native.why_unavailable()
    assert steps.current_device() == torch.cuda.current_device() == 0
    with pytest.raises(CudaIpcError, match=r"cuEventRecord failed: CUresult \d+ \(CUDA_ERROR_INVALID_HANDLE\)"):
        steps.upload_after(0, 0, 0, 0, 0, 0)
