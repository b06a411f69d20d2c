"""NVFP4 KV-row format for MLA caches (GLM-5 / DeepSeek style: 512 latent + 64 rope values per token).

Row layout (352 bytes):

    bytes [0, 256)    latent values as E2M1 codes, two per byte: value 2j in the low nibble of byte j, 2j+1 in the high
    bytes [256, 288)  one FP8 E4M3 scale per 16 latent values (block b covers values 16b .. 16b+15)
    bytes [288, 352)  the 64 rope values as FP8 E4M3

E2M1 code: bit 3 = sign, bits 0-2 index E2M1_VALUES. Two per-tensor FP32 scales live outside the rows: the global
scale of NVFP4's two-level scaling (latent = code * block_scale * global_scale) and the rope scale
(rope = e4m3 * rope_scale). The all-FP8 row (vLLM's fp8 KV) is 576 E4M3 bytes with one per-tensor scale.
"""

from __future__ import annotations

from typing import NamedTuple

LATENT_DIM = 512
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM
FP4_BLOCK = 16
LATENT_BLOCKS = LATENT_DIM // FP4_BLOCK

LATENT_BYTES = LATENT_DIM // 2
SCALE_BYTES = LATENT_BLOCKS
ROPE_BYTES = ROPE_DIM
SCALE_OFFSET = LATENT_BYTES
ROPE_OFFSET = SCALE_OFFSET + SCALE_BYTES
NVFP4_ROW_BYTES = ROPE_OFFSET + ROPE_BYTES

FP8_ROW_BYTES = ROW_DIM
BF16_ROW_BYTES = 2 * ROW_DIM
ROW_BYTES = {"bf16": BF16_ROW_BYTES, "fp8": FP8_ROW_BYTES, "nvfp4": NVFP4_ROW_BYTES}

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_SIGN = 0x8
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
E4M3_MIN_SUBNORMAL = 2.0 ** -9


class Nvfp4Scales(NamedTuple):
    """Per-tensor FP32 scales kept outside the rows."""

    global_scale: float = 1.0
    rope_scale: float = 1.0


def row_bytes(kind: str) -> int:
    """Bytes per 576-value KV row for 'bf16', 'fp8' or 'nvfp4'."""
    return ROW_BYTES[kind]


def capacity_ratio(kind: str, baseline: str = "bf16") -> float:
    """How many more tokens fit in the same cache bytes with `kind` rows than with `baseline` rows."""
    return ROW_BYTES[baseline] / ROW_BYTES[kind]
