"""kernels/kv_layout: byte offsets of both layouts and the merged NIXL descriptor plan (pure, no NIXL)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.kv_layout import (
    LAYOUTS,
    KVRegion,
    plan_transfer,
    regions_per_block,
    scattered_descriptor_count,
    scattered_placement,
)
from kernels.kv_layout.fit import fit_transfer_model

L = 5  # layers in the small regions below


def region(layout: str, num_blocks: int = 16, block_size: int = 4, head_bytes: int = 8, heads: int = 2) -> KVRegion:
    return KVRegion(layout, num_blocks=num_blocks, num_layers=L, block_size=block_size, head_bytes=head_bytes,
                    num_heads=heads)


def apply(plan, src_buf: np.ndarray, dst_buf: np.ndarray) -> None:
    """What NIXL does with the plan, on two byte buffers."""
    for (s, n), (d, _) in plan.pairs():
        dst_buf[d:d + n] = src_buf[s:s + n]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offsets_match_the_strided_view(layout) -> None:
    r = region(layout)
    buf = np.arange(r.nbytes, dtype=np.int64)  # element i stands for byte i
    view = buf.reshape(r.shape)
    for block, layer, head, token in [(0, 0, 0, 0), (3, 2, 1, 2), (15, 4, 1, 3), (7, 0, 0, 1)]:
        idx = (layer, block) if layout == "LBHNC" else (block, layer)
        assert view[idx + (head, token, 0)] == r.offset(block, layer, head, token)
    assert r.slab_bytes == 2 * 4 * 8 and r.block_bytes == L * r.slab_bytes and r.nbytes == 16 * r.block_bytes
    assert np.array_equal(r.slab_offsets(np.array([3, 9]), 2), [r.offset(3, 2), r.offset(9, 2)])
    with pytest.raises(IndexError):
        r.offset(16, 0)


def test_layer_major_spreads_a_block_block_major_keeps_it_together() -> None:
    lb, bl = region("LBHNC"), region("BLHNC")
    assert lb.offset(3, 1) - lb.offset(3, 0) == 16 * lb.slab_bytes  # a whole layer of blocks apart
    assert bl.offset(3, 1) - bl.offset(3, 0) == bl.slab_bytes  # the next slab
    assert lb.strides == (16 * lb.slab_bytes, lb.slab_bytes, 4 * 8, 8, 1)
    assert regions_per_block("LBHNC", 78) == 78 and regions_per_block("BLHNC", 78) == 1
    with pytest.raises(ValueError):
        KVRegion("NHD", 1, 1, 1, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("src_blocks, dst_blocks, expected", [
    ([5, 1, 9, 3], [2, 7, 0, 12], None),           # scattered: the formula
    ([2, 3, 4, 5], [10, 11, 12, 13], (1, 1)),      # one run on both sides
    ([0, 1, 2, 7, 8], [4, 5, 6, 1, 2], (2, 2)),    # two runs
    ([3, 2, 1, 0], [7, 6, 5, 4], (1, 1)),          # reversed on both sides: still one run once sorted
    ([0, 1, 2, 3], [3, 2, 1, 0], None),            # contiguous on one side only: nothing merges
    ([0, 1, 2, 3], [0, 2, 4, 6], None),            # source contiguous, destination strided
])
def test_descriptor_counts(layout, src_blocks, dst_blocks, expected) -> None:
    src, dst = region(layout), region(layout)
    plan = plan_transfer(src, dst, src_blocks, dst_blocks)
    n = len(src_blocks)
    runs = n if expected is None else expected[0]
    assert len(plan) == (runs * L if layout == "LBHNC" else runs)
    if expected is None:
        assert len(plan) == scattered_descriptor_count(n, L, layout)
    assert plan.nbytes == n * src.block_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_pool_is_one_descriptor(layout) -> None:
    src, dst = region(layout, num_blocks=6), region(layout, num_blocks=6)
    plan = plan_transfer(src, dst, range(6), range(6))
    assert plan.pairs() == [((0, src.nbytes), (0, src.nbytes))]
    # one block short of the pool: layer-major can no longer join one layer's run to the next
    assert len(plan_transfer(src, dst, range(5), range(5))) == (L if layout == "LBHNC" else 1)


@pytest.mark.parametrize("src_layout, dst_layout", [("LBHNC", "LBHNC"), ("BLHNC", "BLHNC"), ("LBHNC", "BLHNC")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_moves_every_slab_to_its_place(src_layout, dst_layout, seed) -> None:
    rng = np.random.default_rng(seed)
    src, dst = region(src_layout, num_blocks=12), region(dst_layout, num_blocks=20)
    n = 7
    sb = rng.choice(12, n, replace=False)
    db = rng.choice(20, n, replace=False)
    if seed == 2:  # make part of it contiguous on both sides
        sb[:3], db[:3] = [4, 5, 6], [10, 11, 12]
        sb[3:] = rng.choice([b for b in range(12) if b not in (4, 5, 6)], n - 3, replace=False)
        db[3:] = rng.choice([b for b in range(20) if b not in (10, 11, 12)], n - 3, replace=False)
    src_buf = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    dst_buf = np.zeros(dst.nbytes, dtype=np.uint8)
    plan = plan_transfer(src, dst, sb, db)
    apply(plan, src_buf, dst_buf)
    for s, d in zip(sb, db, strict=True):
        for layer in range(L):
            assert np.array_equal(dst.block_layer(dst_buf, d, layer), src.block_layer(src_buf, s, layer))
    untouched = [b for b in range(20) if b not in set(db.tolist())]
    assert all(not dst.block_layer(dst_buf, b, 0).any() for b in untouched)
    assert plan.nbytes == n * src.block_bytes
    assert (plan.lengths % src.slab_bytes == 0).all()


def test_descs_rows_are_addr_len_dev() -> None:
    src = dst = region("BLHNC")
    plan = plan_transfer(src, dst, [1, 2, 9], [0, 1, 5])
    rows = plan.descs(base=1000, side="dst", dev_id=3)
    assert rows.tolist() == [[1000, 2 * src.block_bytes, 3], [1000 + 5 * src.block_bytes, src.block_bytes, 3]]
    assert plan.descs(0, "src")[:, 0].tolist() == [src.block_bytes, 9 * src.block_bytes]


def test_bad_requests_are_refused() -> None:
    r = region("LBHNC")
    with pytest.raises(ValueError, match="destination blocks"):
        plan_transfer(r, r, [1, 2], [1])
    with pytest.raises(IndexError):
        plan_transfer(r, r, [16], [0])
    with pytest.raises(ValueError, match="repeat"):
        plan_transfer(r, r, [1, 2], [3, 3])
    with pytest.raises(ValueError, match="incompatible"):
        plan_transfer(r, region("LBHNC", block_size=8), [1], [1])
    assert len(plan_transfer(r, r, [], [])) == 0


@pytest.mark.parametrize("block_size", [16, 64, 1024])
def test_glm53_request_counts_and_the_layer_ratio(block_size) -> None:
    """200K tokens of GLM-5.3 (78 layers, 576 B FP8 MLA rows) scattered in a pool twice as large."""
    blocks = -(-200_000 // block_size)
    counts = {}
    for layout in LAYOUTS:
        r = KVRegion(layout, num_blocks=2 * blocks, num_layers=78, block_size=block_size, head_bytes=576)
        sb, db = scattered_placement(blocks, 2 * blocks, seed=7)
        counts[layout] = len(plan_transfer(r, r, sb, db))
    # a random placement may, rarely, leave a pair adjacent on both sides; never more than a handful
    assert blocks * 78 - 78 * 3 <= counts["LBHNC"] <= blocks * 78
    assert blocks - 3 <= counts["BLHNC"] <= blocks
    assert counts["LBHNC"] == 78 * counts["BLHNC"]
    assert scattered_descriptor_count(3125, 78, "LBHNC") == 243_750


def test_scattered_placement_is_seeded_and_distinct() -> None:
    a = scattered_placement(50, 100, seed=3)
    b = scattered_placement(50, 100, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(np.unique(x).size == 50 and x.max() < 100 for x in a)
    assert not np.array_equal(a[0], a[1])
    with pytest.raises(ValueError):
        scattered_placement(101, 100, seed=0)


def test_fit_recovers_overhead_and_bandwidth() -> None:
    nbytes = np.array([1e8, 1e8, 5e8, 5e8, 9e8, 2e7])
    descs = np.array([1, 1e5, 78, 4e5, 1e6, 3e3])
    truth = nbytes / 6e9 + descs * 1.5e-6
    noise = 1 + 0.01 * np.array([1, -1, 0.5, -0.5, 0.2, -0.3])
    fit = fit_transfer_model(nbytes, descs, truth * noise)
    assert fit.overhead_s == pytest.approx(1.5e-6, rel=0.05)
    assert fit.bandwidth_bytes_per_s == pytest.approx(6e9, rel=0.05)
    assert fit.rms_rel_err < 0.02 and fit.points == 6
    assert fit.predict(1e9, 1e4) == pytest.approx(1e9 / fit.bandwidth_bytes_per_s + 1e4 * fit.overhead_s)
    with pytest.raises(ValueError):
        fit_transfer_model([1e8], [1], [0.1])
    with pytest.raises(ValueError):
        fit_transfer_model([1e8, 2e8], [1, 2], [0.1, 0.0])
