"""Transfer planner: block ids on both sides -> NIXL (addr, len) descriptor pairs.

A transfer moves block ``src_blocks[i]`` of the prefill side's region into block
``dst_blocks[i]`` of the decode side's. Pairs are sorted by source block, then every (block,
layer) slab is enumerated in the source layout's natural order (layer-major: layer by
layer, blocks ascending; block-major: block by block, its layers in order) and consecutive slabs are merged while
they are contiguous on BOTH sides. Scattered blocks give ``blocks x layers`` descriptors
layer-major and ``blocks`` block-major; contiguous runs collapse (a run of k blocks is one
descriptor per layer layer-major, one descriptor block-major).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kernels.kv_layout.layout import KVRegion, regions_per_block


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Merged descriptors as parallel arrays of byte offsets (relative to each region) and lengths."""

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def descs(self, base: int, side: str, dev_id: int = 0) -> np.ndarray:
        """(N, 3) int64 rows of (addr, len, dev_id) for one side, as NIXL's ``get_xfer_descs`` takes them."""
        offsets = {"src": self.src_offsets, "dst": self.dst_offsets}[side]
        out = np.empty((len(self), 3), dtype=np.int64)
        out[:, 0] = offsets + base
        out[:, 1] = self.lengths
        out[:, 2] = dev_id
        return out

    def pairs(self, src_base: int = 0, dst_base: int = 0) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """((src_addr, len), (dst_addr, len)) pairs, mostly for tests and small transfers."""
        return [((int(s) + src_base, int(n)), (int(d) + dst_base, int(n)))
                for s, d, n in zip(self.src_offsets, self.dst_offsets, self.lengths, strict=True)]


def _check_compatible(src: KVRegion, dst: KVRegion) -> None:
    if (src.num_layers, src.slab_bytes) != (dst.num_layers, dst.slab_bytes):
        raise ValueError(f"incompatible regions: {src.num_layers} layers x {src.slab_bytes} B slabs vs "
                         f"{dst.num_layers} x {dst.slab_bytes}")


def _slab_order(src: KVRegion, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(request index, layer) of every slab in the order the source layout lays them out."""
    layers = np.arange(src.num_layers, dtype=np.int64)
    idx = np.arange(n, dtype=np.int64)
    if src.layout == "LBHNC":
        return np.tile(idx, src.num_layers), np.repeat(layers, n)
    return np.repeat(idx, src.num_layers), np.tile(layers, n)


def plan_transfer(src: KVRegion, dst: KVRegion, src_blocks: Sequence[int] | np.ndarray,
                  dst_blocks: Sequence[int] | np.ndarray) -> TransferPlan:
    """Descriptors moving ``src_blocks[i]`` of ``src`` to ``dst_blocks[i]`` of ``dst``, merged where contiguous."""
    _check_compatible(src, dst)
    sb = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    db = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    if sb.size != db.size:
        raise ValueError(f"{sb.size} source blocks but {db.size} destination blocks")
    for name, ids, region in (("source", sb, src), ("destination", db, dst)):
        if ids.size and (ids.min() < 0 or ids.max() >= region.num_blocks):
            raise IndexError(f"{name} block id outside 0..{region.num_blocks - 1}")
        if np.unique(ids).size != ids.size:
            raise ValueError(f"{name} block ids repeat")
    if sb.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return TransferPlan(empty, empty.copy(), empty.copy())
    order = np.argsort(sb, kind="stable")  # any order moves the same bytes; source order merges the most
    sb, db = sb[order], db[order]
    req, layer = _slab_order(src, sb.size)
    s_off = src.slab_offsets(sb[req], layer)
    d_off = dst.slab_offsets(db[req], layer)
    unit = src.slab_bytes
    # A new descriptor starts wherever either side does not continue the previous slab.
    starts = np.ones(s_off.size, dtype=bool)
    starts[1:] = (s_off[1:] != s_off[:-1] + unit) | (d_off[1:] != d_off[:-1] + unit)
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, s_off.size))
    return TransferPlan(s_off[first], d_off[first], counts * unit)


def scattered_descriptor_count(num_blocks: int, num_layers: int, layout: str) -> int:
    """Descriptors :func:`plan_transfer` gives when no two blocks are adjacent on both sides."""
    return num_blocks * regions_per_block(layout, num_layers)


def scattered_placement(num_blocks: int, pool_blocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination block ids of a request in busy pools: the first ``num_blocks`` of two
    seeded permutations of ``pool_blocks`` (independent on each side, as two engines' allocators are)."""
    if num_blocks > pool_blocks:
        raise ValueError(f"{num_blocks} blocks do not fit a pool of {pool_blocks}")
    rng = np.random.default_rng(seed)
    return rng.permutation(pool_blocks)[:num_blocks], rng.permutation(pool_blocks)[:num_blocks]
