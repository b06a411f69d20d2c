"""Real NIXL (UCX, host memory) between two processes: planned READs land every byte where the layout says."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl", reason="NIXL is installed by scripts/lib/venv.sh; without it there is nothing to test")

from kernels.kv_layout import LAYOUTS, KVRegion, plan_transfer, scattered_placement  # noqa: E402
from kernels.kv_layout.nixl_io import NixlReader, NixlTarget, check_landed, pattern  # noqa: E402

pytestmark = pytest.mark.integration

BLOCKS, LAYERS, BLOCK_SIZE, ROW = 128, 8, 16, 128  # 2 KiB slabs, 16 KiB blocks, 2 MiB regions
NBYTES = BLOCKS * LAYERS * BLOCK_SIZE * ROW


@pytest.fixture(scope="module")
def reader() -> Iterator[NixlReader]:
    with NixlTarget(NBYTES) as target, NixlReader(NBYTES, telemetry=True) as rd:
        rd.connect(target)
        yield rd


def cases() -> dict[str, tuple[list[int], list[int]]]:
    sb, db = scattered_placement(40, BLOCKS, seed=11)
    return {
        "scattered": (sb.tolist(), db.tolist()),
        "partly-contiguous": ([10, 11, 12, 13, 50, 90, 91], [100, 101, 102, 103, 3, 60, 61]),
        "reversed": ([7, 6, 5, 4, 3], [120, 119, 118, 117, 116]),
        "whole-pool": (list(range(BLOCKS)), list(range(BLOCKS))),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(cases()))
def test_read_lands_every_slab(reader: NixlReader, layout: str, case: str) -> None:
    region = KVRegion(layout, BLOCKS, LAYERS, BLOCK_SIZE, ROW)
    src_blocks, dst_blocks = cases()[case]
    plan = plan_transfer(region, region, src_blocks, dst_blocks)
    reader.buf[:] = 0
    handle = reader.prepare(plan)
    try:
        assert reader.run(handle, timeout_s=30) > 0
        tele = reader.telemetry(handle)
    finally:
        handle.release()
    assert tele["desc_count"] == len(plan)
    assert tele["total_bytes"] == plan.nbytes == len(src_blocks) * region.block_bytes
    source = pattern(NBYTES).view(np.uint8)  # what the target process holds
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        for layer in range(LAYERS):
            assert np.array_equal(region.block_layer(reader.buf, d, layer), region.block_layer(source, s, layer)), \
                f"{layout} {case}: block {s} layer {layer} did not land in block {d}"
    untouched = sorted(set(range(BLOCKS)) - set(dst_blocks))
    for d in untouched:
        assert all(not region.block_layer(reader.buf, d, layer).any() for layer in range(LAYERS))
    assert check_landed(plan, reader.buf, region.slab_bytes) == plan.nbytes


def test_descriptor_counts_on_the_wire(reader: NixlReader) -> None:
    """NIXL posts exactly the planner's descriptors: layers x blocks layer-major, blocks block-major."""
    sb, db = scattered_placement(24, BLOCKS, seed=5)
    counts = {}
    for layout in LAYOUTS:
        region = KVRegion(layout, BLOCKS, LAYERS, BLOCK_SIZE, ROW)
        plan = plan_transfer(region, region, sb, db)
        handle = reader.prepare(plan)
        try:
            reader.run(handle, timeout_s=30)
            counts[layout] = reader.telemetry(handle)["desc_count"]
        finally:
            handle.release()
    assert counts == {"LBHNC": 24 * LAYERS, "BLHNC": 24}


def test_check_landed_catches_misplaced_bytes(reader: NixlReader) -> None:
    region = KVRegion("BLHNC", BLOCKS, LAYERS, BLOCK_SIZE, ROW)
    plan = plan_transfer(region, region, [1, 5], [2, 9])
    reader.buf[:] = 0
    handle = reader.prepare(plan)
    try:
        reader.run(handle, timeout_s=30)
    finally:
        handle.release()
    assert check_landed(plan, reader.buf, region.slab_bytes) == 2 * region.block_bytes
    swapped = plan_transfer(region, region, [1, 5], [9, 2])  # what a planner mixing up the pairs would claim
    with pytest.raises(AssertionError, match="did not land"):
        check_landed(swapped, reader.buf, region.slab_bytes)
