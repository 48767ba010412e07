"""The region registry both backends keep: ids, the read-only view, derived tables, errors."""

from __future__ import annotations

import numpy as np
import pytest

from transport.base import Region, RegionSizes, WriteBatch
from transport.registry import RegionRegistry


def test_ids_are_dense_and_never_reused():
    reg = RegionRegistry()
    ids = [reg.add(4096 * (i + 1), 100 + i, None, handle=f"h{i}").region_id for i in range(3)]
    assert ids == [0, 1, 2]
    assert reg.remove(1) == "h1"
    assert reg.add(1 << 20, 64, 0).region_id == 3  # 1 is gone for good
    assert sorted(reg.view) == [0, 2, 3] and len(reg) == 3
    assert [(r.region_id, h) for r, h in reg.items()] == [(0, "h0"), (2, "h2"), (3, None)]
    assert reg.get(3) == Region(3, 1 << 20, 64, 0) and reg.handle(0) == "h0"


def test_unknown_ids_are_value_errors_naming_the_live_ids():
    reg = RegionRegistry()
    reg.add(4096, 10, None)
    for bad in (1, -1, "0", None):
        with pytest.raises(ValueError, match=r"region .* is not registered \(live ids: \[0\]\)"):
            reg.remove(bad)
    reg.remove(0)
    with pytest.raises(ValueError, match=r"region 0 is not registered \(live ids: \[\]\)"):
        reg.remove(0)


def test_registration_arguments_are_checked():
    reg = RegionRegistry()
    with pytest.raises(TypeError, match="ptr must be a positive int address"):
        reg.add(0, 10, None)
    with pytest.raises(ValueError, match="length must be a positive int, got 0"):
        RegionRegistry.check(4096, 0, None)
    with pytest.raises(ValueError, match="device must be None"):
        reg.add(4096, 10, -2)
    assert len(reg) == 0


def test_the_view_is_read_only_and_live():
    reg = RegionRegistry()
    view = reg.view
    reg.add(4096, 10, None)
    assert list(view) == [0]
    with pytest.raises(TypeError):
        view[1] = Region(1, 8192, 10)
    frozen = RegionRegistry.frozen({5: Region(5, 4096, 10)})
    with pytest.raises(TypeError):
        frozen[6] = Region(6, 8192, 10)


def test_derived_tables_are_cached_until_a_change():
    reg = RegionRegistry()
    reg.add(4096, 100, None)
    built = []

    def count(regions):
        built.append(len(regions))
        return len(regions)

    assert reg.derived(count) == reg.derived(count) == 1 and built == [1]
    sizes = reg.sizes
    assert isinstance(sizes, RegionSizes) and reg.sizes is sizes and sizes.sizes.tolist() == [100]
    reg.add(8192, 50, None)
    assert reg.derived(count) == 2 and built == [1, 2]
    assert reg.sizes is not sizes and reg.sizes.sizes.tolist() == [100, 50]
    reg.remove(0)
    assert reg.sizes.sizes.tolist() == [-1, 50]
    batch = WriteBatch.of([0], [0], [0], [0], [10])
    with pytest.raises(ValueError, match="source .* region 0 is not registered"):
        batch.check_bounds(reg.sizes, {0: Region(0, 1, 100)})
    reg.clear()
    assert len(reg) == 0 and reg.sizes.sizes.size == 0 and np.all(reg.derived(count) == 0)
