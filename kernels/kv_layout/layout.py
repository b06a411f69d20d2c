"""Shapes, strides and byte offsets of a paged KV cache region in the two layouts.

The region holds ``num_blocks`` blocks of ``block_size`` tokens for ``num_layers`` layers;
one (block, layer) slab is ``num_heads x block_size x head_bytes`` bytes (H, N, C with C
counted in bytes, so any dtype fits: an MLA FP8 row is H=1, C=576).

* ``LBHNC`` (layer-major, vLLM's default: one tensor per layer, blocks inside it): the
  slabs of one block sit ``num_blocks`` slabs apart, so a block is ``num_layers`` regions.
* ``BLHNC`` (block-major): all layers of a block sit side by side, so a block is one region.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUTS = ("LBHNC", "BLHNC")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r} (expected one of {LAYOUTS})")
    return layout


def regions_per_block(layout: str, num_layers: int) -> int:
    """Separate memory regions one block occupies: ``num_layers`` layer-major, 1 block-major."""
    return num_layers if check_layout(layout) == "LBHNC" else 1


@dataclass(frozen=True, slots=True)
class KVRegion:
    """One process's paged KV cache: a contiguous byte region laid out as ``layout``."""

    layout: str
    num_blocks: int
    num_layers: int
    block_size: int
    head_bytes: int
    num_heads: int = 1

    def __post_init__(self) -> None:
        check_layout(self.layout)
        for name in ("num_blocks", "num_layers", "block_size", "head_bytes", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)})")

    @property
    def slab_bytes(self) -> int:
        """Bytes of one (block, layer) slab: H x N x C."""
        return self.num_heads * self.block_size * self.head_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        return self.num_layers * self.slab_bytes

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Logical shape in layout order, C in bytes."""
        h, n, c = self.num_heads, self.block_size, self.head_bytes
        if self.layout == "LBHNC":
            return (self.num_layers, self.num_blocks, h, n, c)
        return (self.num_blocks, self.num_layers, h, n, c)

    @property
    def strides(self) -> tuple[int, int, int, int, int]:
        """Byte strides matching :attr:`shape` (C-contiguous)."""
        dims = self.shape
        out = [1] * 5
        for i in range(3, -1, -1):
            out[i] = out[i + 1] * dims[i + 1]
        return tuple(out)  # type: ignore[return-value]

    def offset(self, block: int, layer: int, head: int = 0, token: int = 0) -> int:
        """Byte offset of (block, layer, head, token) from the region's start."""
        if not (0 <= block < self.num_blocks and 0 <= layer < self.num_layers):
            raise IndexError(f"block {block} / layer {layer} outside {self.num_blocks} x {self.num_layers}")
        if not (0 <= head < self.num_heads and 0 <= token < self.block_size):
            raise IndexError(f"head {head} / token {token} outside {self.num_heads} x {self.block_size}")
        s = self.strides
        idx = (layer, block) if self.layout == "LBHNC" else (block, layer)
        return idx[0] * s[0] + idx[1] * s[1] + head * s[2] + token * s[3]

    def slab_offsets(self, blocks: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`offset` of whole slabs (broadcasting ``blocks`` against ``layers``)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        layers = np.asarray(layers, dtype=np.int64)
        if self.layout == "LBHNC":
            return layers * (self.num_blocks * self.slab_bytes) + blocks * self.slab_bytes
        return blocks * self.block_bytes + layers * self.slab_bytes

    def regions_per_block(self) -> int:
        return regions_per_block(self.layout, self.num_layers)

    def view(self, buf: np.ndarray) -> np.ndarray:
        """A uint8 view of ``buf`` (the region's bytes) shaped as :attr:`shape`."""
        flat = np.asarray(buf).reshape(-1).view(np.uint8)
        if flat.size != self.nbytes:
            raise ValueError(f"buffer has {flat.size} bytes, region needs {self.nbytes}")
        return flat.reshape(self.shape)

    def block_layer(self, buf: np.ndarray, block: int, layer: int) -> np.ndarray:
        """The (H, N, C) bytes of one (block, layer) slab of ``buf``."""
        v = self.view(buf)
        return v[layer, block] if self.layout == "LBHNC" else v[block, layer]
